"""Third-party test suites run in their own pytest sessions (tests/models/llama/test_transformers_suite.py starts
transformers'), never collected by the project's: their imports, settings and fixtures are their own."""
collect_ignore = ["transformers"]
