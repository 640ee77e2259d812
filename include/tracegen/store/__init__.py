"""Where committed data lives: storage backends, the ledger of immutable parts, the worker-local spool, row records."""
