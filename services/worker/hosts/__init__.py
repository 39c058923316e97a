"""Where an engine runs: its device and memory, its build and warmup, the child process or thread that
hosts it, its golden checks, mirror pacing and fault hook.

The map of the worker's rooms is docs/worker.md, "Code layout"."""
