"""The bundled datasets: 3,000 agentic-coding prompts written for tracegen (see make_sample.py), and a small
SFT-style set of conversations in ShareGPT form (make_sft_sample.py).

`make demo` generates from this file, so a fresh checkout runs end to end with no download.
Rebuild it with `python -m tracegen.sample_data.make_sample`; the output is byte-for-byte reproducible.
"""

from pathlib import Path

SAMPLE_DATASET = Path(__file__).resolve().parent / "agentic_coding_prompts.jsonl.gz"
SAMPLE_ROWS = 3000

# The bundled SFT-style sample: 40 multi-turn agentic conversations in ShareGPT form with tool calls and
# results, each ending with its own answer (see make_sft_sample.py).
SFT_SAMPLE_DATASET = Path(__file__).resolve().parent / "agentic_sft_conversations.jsonl"
SFT_SAMPLE_ROWS = 40
