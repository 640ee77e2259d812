"""Generation of one chunk of rows: the engine that keeps servers full and commits parts."""
