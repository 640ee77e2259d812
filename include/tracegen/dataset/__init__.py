"""Prompts in: JSONL / JSONL.gz / Parquet, local or S3, read through a stable row index."""
