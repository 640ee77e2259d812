"""The in-flight auto-tuner: its decisions as a pure function, its semaphore, and a real stand-in run."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tracegen.config import RunConfig
from tracegen.generate.chunk import starting_in_flight
from tracegen.sglang.autotune import (
    Autotuner,
    InFlightLimit,
    Observation,
    TunePolicy,
    next_limit,
    parse_metrics,
)
from tracegen.sglang.client import ChatRequest, ClientConfig, Sampling, SGLangClient
from tracegen.sglang.routing import ServerEndpoint

POLICY = TunePolicy(headroom=0.5, shrink_at=2.0, ceiling=1024)


def obs(**kw) -> Observation:
    base = {"running": 0, "queued": 0, "max_running": 64, "own_in_flight": 0, "limit": 8}
    return Observation(**{**base, **kw})


# ---- decisions ----------------------------------------------------------------------------------


def test_bad_default_jumps_to_fill_the_batch_plus_headroom_in_one_step():
    # Client uses its whole limit of 8; the server runs 8 of 64 with no queue: fill 56 more + 32 queued.
    assert next_limit(obs(running=8, own_in_flight=8, limit=8), POLICY) == 8 + 56 + 32


def test_growth_is_at_least_doubling_when_the_batch_size_is_unknown():
    assert next_limit(obs(running=8, own_in_flight=8, limit=8, max_running=None), POLICY) == 16


def test_a_client_in_its_tail_does_not_grow():
    # Server under-fed, but this client holds fewer requests than its limit: it has nothing more to send.
    assert next_limit(obs(running=10, own_in_flight=10, limit=96), POLICY) == 96


def test_full_batch_with_the_target_queue_holds():
    assert next_limit(obs(running=64, queued=32, own_in_flight=96, limit=96), POLICY) == 96
    # Anywhere between the target and shrink_at x target is the dead band: no flapping.
    assert next_limit(obs(running=64, queued=60, own_in_flight=96, limit=96), POLICY) == 96


def test_thin_queue_behind_a_full_batch_is_topped_up():
    # Another client's tail left only 10 queued of the 32 wanted: this client adds the 22 missing.
    assert next_limit(obs(running=64, queued=10, own_in_flight=80, limit=80), POLICY) == 102


def test_overfed_server_shrinks_by_this_clients_share_of_the_excess():
    # 64 running + 192 queued, target 32: excess 160; this client holds half of the 256 outstanding.
    assert next_limit(obs(running=64, queued=192, own_in_flight=128, limit=128), POLICY) == 128 - 80


def test_a_cut_that_has_not_drained_yet_is_not_cut_again():
    # Six chunk tasks started together on a 64-slot server, 128 each: one cut, then hold while the
    # requests sent before it drain (the queue lags the cut). Cutting on every poll drove all to 1.
    first = next_limit(obs(running=64, queued=704, own_in_flight=128, limit=128), POLICY)
    assert first == 128 - math.ceil((704 - 32) * 128 / 768)
    assert next_limit(obs(running=64, queued=650, own_in_flight=120, limit=first), POLICY) == first
    # A client in its tail gives back from what it holds, not from a limit it no longer uses.
    assert next_limit(obs(running=64, queued=192, own_in_flight=40, limit=128), POLICY) == 40 - math.ceil(160 * 40 / 256)


def test_a_chunk_task_joining_full_servers_trickles_until_the_others_drain():
    # It starts at RunConfig.autotune_start_in_flight (8) beside tasks keeping the batch full and the
    # target queue: it holds, so it does not take an equal share and end with them. When their tails thin
    # the queue it tops up, and when the batch runs short it takes the whole deficit.
    start = RunConfig(dataset_uri="/d.jsonl", output_uri="/out").autotune_start_in_flight
    assert start <= 64 // 8, "the start must be a trickle against a 64-slot batch, not a batch"
    assert next_limit(obs(running=64, queued=40, own_in_flight=start, limit=start), POLICY) == start
    assert next_limit(obs(running=64, queued=12, own_in_flight=start, limit=start), POLICY) == start + 20
    assert next_limit(obs(running=30, own_in_flight=start, limit=start), POLICY) == start + 34 + 32
    # The chunk engine's servers start there; a fixed limit is used as it is.
    config = RunConfig(dataset_uri="/d.jsonl", output_uri="/out", max_in_flight_per_server=96)
    assert starting_in_flight(config) == start
    assert starting_in_flight(replace(config, autotune_in_flight=False)) == 96


def test_shrinking_never_goes_below_the_floor_and_growth_stops_at_the_ceiling():
    policy = TunePolicy(floor=4, ceiling=100)
    assert next_limit(obs(running=64, queued=5000, own_in_flight=8, limit=8), policy) == 4
    assert next_limit(obs(running=1, own_in_flight=90, limit=90), policy) == 100


def test_kv_bound_server_counts_as_saturated():
    # Fewer running than max but a queue: memory, not slots, is the bound. Do not grow past the target.
    assert next_limit(obs(running=40, queued=32, own_in_flight=72, limit=72), POLICY) == 72


@pytest.mark.parametrize(
    ("field", "value"),
    [("running", -1), ("queued", 1.5), ("own_in_flight", None), ("limit", True), ("max_running", 0)],
)
def test_bad_observations_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        obs(**{field: value})


@pytest.mark.parametrize(
    ("kw", "name"),
    [({"floor": 0}, "floor"), ({"ceiling": 0}, "ceiling"), ({"headroom": -1}, "headroom"),
     ({"shrink_at": 1}, "shrink_at"), ({"interval_s": 0}, "interval_s")],
)  # fmt: skip
def test_bad_policies_are_rejected_naming_the_field(kw, name):
    with pytest.raises(ValueError, match=name):
        TunePolicy(**kw)


def test_parse_metrics_sums_series_and_skips_histograms_and_comments():
    text = (
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="m",dp_rank="0"} 3\n'
        'sglang:num_running_reqs{model_name="m",dp_rank="1"} 4\n'
        'sglang:num_queue_reqs{model_name="m"} 2.0\n'
        'sglang:e2e_request_latency_seconds_bucket{model_name="m",le="1.0"} 9\n'
        "garbage line nan-ish x\n"
    )
    m = parse_metrics(text)
    assert m["sglang:num_running_reqs"] == 7
    assert m["sglang:num_queue_reqs"] == 2
    assert not any(k.endswith("_bucket") for k in m)


def test_parse_metrics_reads_the_totals_of_a_priority_scheduling_server():
    # SGLang with --enable-priority-scheduling: the total under priority="", one series per priority beside
    # it. Summing them all would show twice the running and queued requests.
    labels = 'model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
    text = (
        f'sglang:num_running_reqs{{{labels},priority=""}} 48\n'
        f'sglang:num_running_reqs{{{labels},priority="0"}} 40\n'
        f'sglang:num_running_reqs{{{labels},priority="1"}} 8\n'
        f'sglang:num_queue_reqs{{{labels},priority=""}} 5\n'
        f'sglang:num_queue_reqs{{{labels},priority="None"}} 5\n'
    )
    m = parse_metrics(text)
    assert (m["sglang:num_running_reqs"], m["sglang:num_queue_reqs"]) == (48, 5)


class _Reply:
    def __init__(self, body: dict) -> None:
        self.body = body

    def json(self) -> dict:
        return self.body


@pytest.mark.parametrize(
    ("info", "batch"),
    [
        ({"max_running_requests": 64, "internal_states": [{"effective_max_running_requests_per_dp": 64}]}, 64),
        # SGLang without the flag: null, and the size its scheduler settled on per data-parallel rank.
        ({"max_running_requests": None, "internal_states": [{"effective_max_running_requests_per_dp": 256},
                                                            {"effective_max_running_requests_per_dp": 256}]}, 512),
        ({"max_running_requests": None}, None),
    ],
)  # fmt: skip
def test_the_batch_size_is_read_as_sglang_reports_it(info, batch):
    async def get(path: str, timeout: float) -> _Reply:
        assert path == "/server_info"
        return _Reply(info)

    server = SimpleNamespace(http=SimpleNamespace(get=get))  # a ServerState's client, as far as read
    assert asyncio.run(Autotuner._max_running(None, server)) == batch


# ---- the resizable semaphore --------------------------------------------------------------------


def test_in_flight_limit_grows_and_shrinks_while_tasks_wait():
    async def scenario() -> list[int]:
        gate = InFlightLimit(2)
        await gate.acquire()
        await gate.acquire()
        waiter = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0.01)
        assert not waiter.done()  # full at 2
        gate.set_limit(3)  # growing admits the waiter without any release
        await asyncio.wait_for(waiter, 1)
        gate.set_limit(1)  # shrinking cancels nothing; new acquirers wait until below the limit
        blocked = asyncio.create_task(gate.acquire())
        gate.release()
        gate.release()
        await asyncio.sleep(0.01)
        assert not blocked.done()  # 1 used, limit 1
        gate.release()
        await asyncio.wait_for(blocked, 1)
        return [gate.used, gate.limit]

    assert asyncio.run(scenario()) == [1, 1]


def test_in_flight_limit_rejects_a_bad_size():
    with pytest.raises(ValueError, match="limit"):
        InFlightLimit(0)


# ---- against a real stand-in ---------------------------------------------------------------------


def test_autotune_raises_a_bad_default_until_the_stand_in_runs_full_batches(sim_server):
    """Start at 2 in flight against a server with 8 slots: the tuner must grow the limit from what the
    server reports, the pool must grow its connections past the endpoint's size, and the server must
    end up running full batches with a queue behind them."""
    sim = sim_server(max_running_requests=8, enable_metrics=True, sim_time_scale=20,
                     sim_length_model="short")  # fmt: skip
    config = ClientConfig(autotune=True, autotune_interval_s=0.05, autotune_ceiling=64)
    seen_capacity: list[int] = []

    async def scenario() -> tuple[list[dict], list[dict], int]:
        async with SGLangClient([ServerEndpoint(sim.url, max_in_flight=2)], config) as client:
            client.on_capacity_change(seen_capacity.append)
            gate = InFlightLimit(client.capacity)
            client.on_capacity_change(gate.set_limit)

            async def one(i: int) -> str:
                await gate.acquire()
                try:
                    out = await client.complete(
                        ChatRequest(i, [{"role": "user", "content": f"q{i}"}], sampling=Sampling(max_tokens=200),
                                    model="m")
                    )
                finally:
                    gate.release()
                return "ok" if out.value is not None else out.failed or out.rejected or "?"

            statuses = await asyncio.gather(*(one(i) for i in range(300)))
            assert set(statuses) == {"ok"}
            return client.autotune_history, client.stats(), client.capacity

    history, stats, capacity = asyncio.run(scenario())
    assert seen_capacity and max(seen_capacity) >= 8 + 4  # a full batch plus the headroom queue
    assert stats[0]["limit"] == capacity >= 8
    assert any(h["running"] == 8 and h["queued"] > 0 for h in history), [
        (h["running"], h["queued"], h["limit"]) for h in history
    ]
