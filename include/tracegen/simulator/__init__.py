"""The SGLang stand-in: a real HTTP server speaking SGLang's protocol, without a GPU.

Run it as `python -m tracegen.simulator --model-path M --port N [sglang flags] [--sim-* knobs]`.
The length model is importable on its own: `tracegen.simulator.lengths.draw(messages, seed, model, sample)`
gives one sample of a prompt (the server draws a fresh sample per request).
"""

from tracegen.simulator.lengths import (
    CALIBRATIONS,
    DEFAULT_MODEL,
    LengthModel,
    Sample,
    build_model,
    draw,
    natural_length,
    prompt_tokens,
)

__all__ = [
    "CALIBRATIONS",
    "DEFAULT_MODEL",
    "LengthModel",
    "Sample",
    "build_model",
    "draw",
    "natural_length",
    "prompt_tokens",
]
