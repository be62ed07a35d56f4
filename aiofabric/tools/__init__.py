"""The command line and the engines behind it: the parser and one function per command (`cli`), perftest's bandwidth
(`perftest`) and latency (`latency`) engines with perftest's flags (`perftest_flags`), and their helpers (samples,
units, plots, signals). Nothing below imports this package."""
