"""Where committed data lives: storage backends, the output root (`root.OutputRoot`, with its commits,
snapshots, run files and repair), the worker-local spool, row records."""
