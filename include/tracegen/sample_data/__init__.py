"""The bundled datasets: 3,000 agentic-coding prompts written for tracegen (see make_sample.py), and a small
SFT-style set of conversations in ShareGPT form (make_sft_sample.py), and a small set of chat conversations
without tools (chat_conversations.jsonl).

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

# The bundled chat sample: 12 conversations in ShareGPT form of 2 to 4 user and assistant turns each, without
# tools, for `turns=chain` (34 prompt rows under `each` or `chain`). Written by hand.
CHAT_SAMPLE_DATASET = Path(__file__).resolve().parent / "chat_conversations.jsonl"
CHAT_SAMPLE_ROWS = 12
CHAT_SAMPLE_TURNS = 34
