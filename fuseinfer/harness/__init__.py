"""What evaluating a model needs, for any package: model resolution (``random:`` names, local folders), the dtype
and device names (``devices``), the backend interface, its options and the plain backends (``backends``), data,
timing, metrics, perplexity, the run's environment and terminal output. The eval CLI (``fuseinfer.eval``) sits on
top of it; feature packages and the profiler use it, never the CLI."""
