"""Stand-ins for tests and benchmarks: runnable services with no model, weights or GPU."""
