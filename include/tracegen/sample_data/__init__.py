"""The bundled demo dataset: 3,000 agentic-coding prompts written for tracegen (see make_sample.py).

`make demo` generates from this file, so a fresh checkout runs end to end with no download.
Rebuild it with `python -m tracegen.sample_data.make_sample`; the output is byte-for-byte reproducible.
"""

from pathlib import Path

SAMPLE_DATASET = Path(__file__).resolve().parent / "agentic_coding_prompts.jsonl.gz"
SAMPLE_ROWS = 3000
