"""The continuous-batching engine, driven with explicit simulated times (no clock)."""

import pytest

from tracegen.simulator.batching import BatchEngine, Job, QueueFull, StepModel

STEP = StepModel(base_s=0.01, per_request_s=0.001, accept_length=1.0)


def run_batch(concurrency: int, max_running: int, tokens: int = 100) -> tuple[float, BatchEngine]:
    """Submit `concurrency` equal jobs at t=0; return (makespan, engine)."""
    engine = BatchEngine(max_running, STEP)
    engine.start_accounting(0.0)
    for i in range(concurrency):
        engine.submit(Job(rid=str(i), target=tokens), 0.0)
    t = 0.0
    while (nxt := engine.next_event_time()) is not None:
        t = nxt
        engine.advance(t)
    return t, engine


def test_single_request_takes_target_steps():
    makespan, engine = run_batch(1, 8, tokens=100)
    assert makespan == pytest.approx(100 * STEP.step_time(1))
    assert engine.finished_count == 1 and engine.tokens_generated() == 100


def test_throughput_rises_with_concurrency_up_to_max_running_then_flattens():
    max_running = 8
    throughput = {}
    for c in (1, 2, 4, 8, 16, 32):
        makespan, engine = run_batch(c, max_running)
        throughput[c] = engine.tokens_generated() / makespan
    assert throughput[1] < throughput[2] < throughput[4] < throughput[8]
    # Beyond max running the batch size is capped: same throughput, the rest waits.
    assert throughput[16] == pytest.approx(throughput[8], rel=1e-6)
    assert throughput[32] == pytest.approx(throughput[8], rel=1e-6)


def test_requests_beyond_capacity_wait_then_run():
    engine = BatchEngine(2, STEP)
    jobs = [Job(rid=str(i), target=10) for i in range(5)]
    for j in jobs:
        engine.submit(j, 0.0)
    assert len(engine.running) == 2 and len(engine.waiting) == 3
    done = engine.advance(10 * STEP.step_time(2) + 1e-9)
    assert {j.rid for j in done} == {"0", "1"}
    assert len(engine.running) == 2 and len(engine.waiting) == 1
    assert jobs[2].admitted == pytest.approx(10 * STEP.step_time(2))


def test_queue_full_when_max_queued_exceeded():
    engine = BatchEngine(1, STEP, max_queued=2)
    for i in range(3):
        engine.submit(Job(rid=str(i), target=10), 0.0)
    with pytest.raises(QueueFull, match="The request queue is full."):
        engine.submit(Job(rid="x", target=10), 0.0)


def test_speculative_accept_length_speeds_up_decoding():
    spec = StepModel(base_s=0.01, per_request_s=0.001, accept_length=3.0)
    plain, fast = BatchEngine(4, STEP), BatchEngine(4, spec)
    for e in (plain, fast):
        e.submit(Job(rid="a", target=300), 0.0)
    assert fast.next_event_time() == pytest.approx(plain.next_event_time() / 3)


def test_abort_running_keeps_partial_tokens_and_admits_waiting():
    engine = BatchEngine(1, STEP)
    a, b = Job(rid="a", target=100), Job(rid="b", target=100)
    engine.submit(a, 0.0)
    engine.submit(b, 0.0)
    job, _ = engine.abort("a", 40.5 * STEP.step_time(1))
    # 40 tokens decoded, and the one of the decode step SGLang still runs for an aborted running request.
    assert job is a and a.aborted and a.tokens == 41 and a.abort_message == "Aborted"
    assert a.aborted_in == "running" and "b" in engine.running
    job, _ = engine.abort("b", 41 * STEP.step_time(1))
    assert job.tokens in (1, 2)
    missing, _ = engine.abort("nope", 50.0)
    assert missing is None


def test_abort_in_waiting_queue():
    engine = BatchEngine(1, STEP)
    engine.submit(Job(rid="a", target=100), 0.0)
    engine.submit(Job(rid="b", target=100), 0.0)
    job, _ = engine.abort("b", 0.1)
    assert job.tokens == 0 and job.abort_message == "Abort in waiting queue" and job.aborted_in == "waiting"
    assert engine.aborted_count == 1


def test_wedged_engine_makes_no_progress_but_holds_slots():
    engine = BatchEngine(2, STEP)
    engine.start_accounting(0.0)
    job = Job(rid="a", target=10)
    engine.submit(job, 0.0)
    engine.wedged = True
    assert engine.next_event_time() is None
    engine.advance(100.0)
    assert engine.produced(job) == 0 and job.state == "running"
    assert engine.busy_slot_s == pytest.approx(100.0)


def test_occupancy_accounting():
    engine = BatchEngine(4, STEP)
    engine.start_accounting(0.0)
    engine.submit(Job(rid="a", target=10), 0.0)
    end = engine.next_event_time()
    engine.advance(2 * end)
    assert engine.busy_slot_s == pytest.approx(end)
    assert engine.available_slot_s() == pytest.approx(4 * 2 * end)
    assert engine.tokens_generated() == 10
    assert engine.busy_s == pytest.approx(end)


def test_gpu_time_is_the_time_a_request_runs_whatever_the_batch():
    # Two requests side by side: the GPU is busy for the longer one's time, while the slots count both.
    engine = BatchEngine(4, STEP)
    engine.start_accounting(0.0)
    engine.submit(Job(rid="a", target=10), 0.0)
    engine.submit(Job(rid="b", target=20), 0.0)
    first = engine.next_event_time()
    engine.advance(first)
    second = engine.next_event_time()
    engine.advance(second + 5.0)  # then idle: neither counts it
    assert engine.busy_s == pytest.approx(second)
    assert engine.busy_slot_s == pytest.approx(first + second)


def test_progress_is_linear_between_events():
    engine = BatchEngine(4, STEP)
    job = Job(rid="a", target=1000)
    engine.submit(job, 0.0)
    engine.advance(250 * STEP.step_time(1) + 1e-9)
    assert engine.produced(job) == 250


def test_validation():
    with pytest.raises(ValueError, match="max_running"):
        BatchEngine(0, STEP)
    with pytest.raises(ValueError, match="accept_length"):
        StepModel(accept_length=0.5)
    with pytest.raises(ValueError, match="target"):
        Job(rid="a", target=-1)
