"""What evaluating a model needs, for any package: model resolution (``random:`` names, local folders), data,
timing, metrics, perplexity, the run's environment and terminal output. The eval CLI (``fuseinfer.eval``) sits on
top of it; feature packages use it, never the CLI."""
