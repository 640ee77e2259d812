"""Each injected fault, seen by a real HTTP client against the stand-in subprocess."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 50}
GEN = {"text": "hello", "sampling_params": {"max_new_tokens": 50}}


def test_faults_control_endpoint_roundtrip_and_validation(sim_server):
    sim = sim_server(api_key="k", sim_error_rate=0.25, sim_fault_seed=3)
    assert sim.get_faults()["error_rate"] == 0.25 and sim.get_faults()["seed"] == 3
    new = sim.set_faults(hang_rate=0.5, error_status=502)
    assert new["hang_rate"] == 0.5 and new["error_rate"] == 0.25 and new["error_status"] == 502
    for bad, fragment in (
        ({"error_status": 404}, "error_status must be a 5xx"),
        ({"drop_rate": 2}, "drop_rate must be a number in [0, 1]"),
        ({"bogus": 1}, "unknown fault setting"),
    ):
        r = httpx.post(sim.url + "/sim/faults", json=bad, headers=sim.headers)
        assert r.status_code == 400 and fragment in r.json()["message"]
    r = httpx.post(sim.url + "/sim/faults", content=b"{oops", headers=sim.headers)
    assert r.status_code == 400 and "Invalid JSON body" in r.json()["message"]
    assert httpx.get(sim.url + "/server_info", headers=sim.headers).json()["sim_faults"]["hang_rate"] == 0.5


@pytest.mark.parametrize("status", [500, 503])
def test_error_rate_with_chosen_status(sim_server, status):
    sim = sim_server(sim_error_rate=1.0, sim_error_status=status)
    r = httpx.post(sim.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == status and r.json()["object"] == "error" and r.json()["code"] == status
    r = httpx.post(sim.url + "/generate", json=GEN)
    assert r.status_code == status and "simulated fault" in r.json()["error"]["message"]
    assert httpx.get(sim.url + "/health").status_code == 200  # health does not see request faults


def test_faults_are_seeded_and_reproducible(sim_server):
    def statuses(sim):
        with httpx.Client(base_url=sim.url, timeout=10) as c:
            return [c.post("/generate", json=GEN).status_code for _ in range(30)]

    a = statuses(sim_server(sim_error_rate=0.4, sim_fault_seed=11))
    b = statuses(sim_server(sim_error_rate=0.4, sim_fault_seed=11))
    c = statuses(sim_server(sim_error_rate=0.4, sim_fault_seed=12))
    assert a == b and 500 in a and 200 in a
    assert a != c


def test_dropped_connection_has_no_response(sim_server):
    sim = sim_server(sim_drop_rate=1.0)
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(sim.url + "/v1/chat/completions", json=CHAT, timeout=10)
    sim.set_faults(drop_rate=0.0)
    assert httpx.post(sim.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200


def test_hang_never_answers_and_server_stays_up(sim_server):
    sim = sim_server()
    sim.set_faults(hang_rate=1.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(sim.url + "/generate", json=GEN, timeout=0.5)
    assert httpx.get(sim.url + "/health").status_code == 200
    sim.set_faults(hang_rate=0.0)
    assert httpx.post(sim.url + "/generate", json=GEN, timeout=10).status_code == 200


def test_abort_finishes(sim_server):
    sim = sim_server(sim_abort_rate=1.0, sim_length_model="fixed:200")
    body = httpx.post(sim.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1000}).json()
    assert body["choices"][0]["finish_reason"] == "abort"
    assert body["usage"]["completion_tokens"] < 200
    r = httpx.post(sim.url + "/generate", json={**GEN, "sampling_params": {"max_new_tokens": 1000}})
    assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert "prompt_tokens" not in r.json()["meta_info"]


def test_slow_start_flag_and_runtime(sim_server):
    sim = sim_server(wait=False, sim_slow_start_s=1.0)
    seen = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not seen or seen[-1] != 200):
        try:
            seen.append(httpx.get(sim.url + "/health", timeout=2).status_code)
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    assert seen[0] == 503 and seen[-1] == 200 and seen.count(503) > 1
    sim.set_faults(slow_start_s=30)
    assert httpx.get(sim.url + "/health").status_code == 503
    assert httpx.get(sim.url + "/ready").status_code == 503
    sim.set_faults(slow_start_s=0)
    assert httpx.get(sim.url + "/health").status_code == 200


def test_crash_after_n_requests_exits_the_process(sim_server):
    sim = sim_server(sim_crash_after=2)
    for _ in range(2):
        assert httpx.post(sim.url + "/generate", json=GEN).status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.post(sim.url + "/generate", json=GEN, timeout=10)
    assert sim.proc.wait(10) == 1
    assert "simulated fault: crashing" in sim.log()


def test_wedged_server_answers_health_but_produces_nothing(sim_server):
    sim = sim_server(sim_time_scale=100, sim_length_model="fixed:100")

    async def scenario():
        async with httpx.AsyncClient(base_url=sim.url, timeout=30) as c:
            assert (await c.post("/generate", json=GEN)).status_code == 200
            await c.post("/sim/faults", json={"wedged": True})
            stuck = asyncio.create_task(c.post("/generate", json={**GEN, "rid": "stuck"}))
            await asyncio.sleep(0.5)
            health = (await c.get("/health")).status_code
            before = (await c.get("/server_info")).json()["sim_occupancy"]
            await asyncio.sleep(0.3)
            after = (await c.get("/server_info")).json()["sim_occupancy"]
            assert not stuck.done()
            await c.post("/sim/faults", json={"wedged": False})
            return health, before, after, await stuck

    health, before, after, unstuck = asyncio.run(scenario())
    assert health == 200
    assert before["num_running_reqs"] == 1 and before["tokens_generated"] == after["tokens_generated"] == 50
    assert unstuck.status_code == 200 and unstuck.json()["meta_info"]["completion_tokens"] == 50


def test_wedge_after_flag(sim_server):
    sim = sim_server(sim_wedge_after=1)
    assert httpx.post(sim.url + "/generate", json=GEN, timeout=10).status_code == 200
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(sim.url + "/generate", json=GEN, timeout=0.5)
    assert httpx.get(sim.url + "/health").status_code == 200
    assert sim.get_faults()["wedged"] is True


def test_client_disconnect_aborts_server_side(sim_server):
    sim = sim_server(
        sim_time_scale=10, sim_length_model="fixed:100000", context_length=200000, enable_metrics=True
    )
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            sim.url + "/generate",
            json={"text": "x", "sampling_params": {"max_new_tokens": 100000}},
            timeout=0.3,
        )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        occ = sim.server_info()["sim_occupancy"]
        if occ["num_running_reqs"] == 0:
            break
        time.sleep(0.05)
    assert occ["num_running_reqs"] == 0 and occ["aborted_requests"] == 1
