"""Which sample of its prompt a request draws, and what the request produces of it.

Every request draws a fresh sample, as SGLang samples; only with --enable-deterministic-inference does the
request's seed fix it. Whether a sample ends in a tool call is decided from the prompt's ids (the tools the
prompt offers), so the chat route and /generate on the same ids decide alike.
"""

from __future__ import annotations

import random

from tracegen.simulator import protocol as p
from tracegen.simulator.lengths import Drawn, Sample, fresh_sample
from tracegen.simulator.state import State

# Fresh sampling: every request without deterministic inference gets its own sample number.
_FRESH_SAMPLES = random.SystemRandom()


def sample_number(state: State, seed: int | None) -> int:
    """Which sample of the prompt this request draws: its seed in deterministic mode, else a fresh one."""
    if state.args["enable_deterministic_inference"]:
        return seed if seed is not None else p.DEFAULT_SAMPLING_SEED
    return _FRESH_SAMPLES.getrandbits(64)


def fresh(state: State, ids: list[int], thinking: bool, seed: int | None) -> Drawn:
    number = sample_number(state, seed)
    return fresh_sample(ids, state.args["sim_seed"], state.settings.length_model, number, thinking)


def tool_name(state: State, tool_names: list[str] | None, sample: Sample) -> str | None:
    """The tool a sample of a prompt offering tools (`tool_names`, read from its ids, so chat and /generate
    decide alike) calls at the end of its answer, if it calls one."""
    if tool_names and sample.tool_roll < state.args["sim_tool_call_rate"]:
        return tool_names[sample.key % len(tool_names)]
    return None


def plan(state: State, drawn: Drawn, cap: int, ignore_eos: bool, tool_names: list[str] | None) -> p.Plan:
    """The request's plan; a sample of a prompt offering tools may end in a call to one of them."""
    return p.plan_request(drawn, cap, ignore_eos, tool_name(state, tool_names, drawn.sample))
