"""tracegen: complete LLM completions (thinking trace + answer) at scale, for drafter training."""

__version__ = "0.1.0"
