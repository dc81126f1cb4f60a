"""Power cuts for tests and benchmarks: a file system that loses unsynced writes and the runs on it (issue 53)."""
