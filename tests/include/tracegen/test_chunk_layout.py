"""How a run cuts its dataset into chunks: sized from the fleet, staggered over the chunk tasks in flight,
recorded in run.json so the scheduled rerun of unfinished chunks finds the run's own chunks."""

from __future__ import annotations

from pathlib import Path

from engine_support.helpers import make_config, rerun_work, root_of, write_dataset

from tracegen.fleet import FleetSpec
from tracegen.fleet.spec import HostSpec
from tracegen.run.plan import ChunkLayout, choose_layout
from tracegen.run.prepare import prepare_run
from tracegen.run.run_record import read_run_record
from tracegen.run.run_spec import FleetRef


def fleet(max_running: int | str | None = 64, gpus: int = 2) -> FleetRef:
    flags = {} if max_running is None else {"--max-running-requests": max_running}
    spec = FleetSpec(hosts=(HostSpec("local", tuple(range(gpus))),), model_path="sim/m",
                     launch_module="tracegen.simulator", sglang_flags=flags)
    return FleetRef.of(spec, "test-fleet")


def test_fleet_slots_come_from_the_flags_or_are_unknown() -> None:
    assert fleet(64, gpus=2).slots == 128
    assert fleet(256, gpus=7).slots == 1792
    assert fleet(None).slots is None  # SGLang sizes its batch from KV memory: a plan cannot know
    assert fleet("64", gpus=2).slots == 128  # a fleet file may write it as on a command line


def test_chosen_chunks_are_four_fleet_batches_and_the_first_ones_outlast_the_pilot(tmp_path: Path) -> None:
    config = make_config(tmp_path / "d.jsonl", tmp_path / "out", chunk_size=0, pilot_size=500)
    # The reference job's fleet (7 GPUs x 256 slots) over its 913,786 prompts: four batches of 1,792.
    assert choose_layout(config, 913_786, fleet(256, gpus=7).slots, stagger=3) == ChunkLayout(7168, 3, 7168)
    # The benchmark's fleet (2 x 64): 512 rows, and the first three chunks 1,000 (twice the pilot).
    assert choose_layout(config, 16_000, fleet(64).slots, stagger=3) == ChunkLayout(512, 3, 1000)
    # Unknown batch size: from the dataset size alone.
    assert choose_layout(config, 16_000, fleet(None).slots, stagger=3) == ChunkLayout(500, 3, 1000)
    # A chunk size the user chose is kept, first chunks included; only the stagger applies.
    chosen = make_config(tmp_path / "d.jsonl", tmp_path / "out", chunk_size=200, pilot_size=500)
    assert choose_layout(chosen, 16_000, fleet(64).slots, stagger=3) == ChunkLayout(200, 3, None)


def test_the_layout_is_recorded_and_the_rerun_finds_the_same_chunks(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "d.jsonl", 2_000)
    config = make_config(dataset, tmp_path / "out", chunk_size=0, pilot_size=100)
    _, planned = prepare_run(config, "run-1", fleet(64), stagger=3)
    assert [w.stop - w.start for w in planned] == [512, 512, 512, 171, 293]
    root = root_of(config)
    assert read_run_record(root, "run-1").layout == ChunkLayout(512, 3, 512)
    rerun = rerun_work(str(tmp_path / "out"))
    assert [w.work for w in rerun] == planned


def test_a_layout_written_before_staggering_reads_as_equal_chunks() -> None:
    layout = ChunkLayout.from_json({"chunk_size": 300})
    assert layout == ChunkLayout(300)
    assert [(c.start, c.stop) for c in layout.chunks(1_000)] == [(0, 300), (300, 600), (600, 900), (900, 1000)]


def test_under_each_a_conversation_s_turns_are_in_one_chunk_and_the_pilot_stays_a_sample_of_rows(tmp_path: Path):
    # The bundled agentic sample read one row per assistant turn: 40 conversations, 156 prompt rows; chunks of 10
    # would cut 15 of them in two, each half's turns sent to wherever the routing finds room.
    from tracegen.dataset.index import build_index
    from tracegen.dataset.reading import Reading
    from tracegen.run.plan import pilot_indices
    from tracegen.sample_data import SFT_SAMPLE_DATASET

    config = make_config(SFT_SAMPLE_DATASET, tmp_path / "out", chunk_size=10, pilot_size=30, turns="each")
    spec, planned = prepare_run(config, "run-1", fleet(64))
    starts = set(build_index(str(SFT_SAMPLE_DATASET), reading=Reading(turns="each")).turn_starts.tolist())
    cut = spec.layout.chunks(spec.dataset.n_rows)
    assert spec.dataset.n_rows == 156 and cut[-1].stop == 156
    # Every chunk starts a conversation; each end moved forward to the next conversation's first turn.
    assert all(c.start in starts for c in cut) and len(cut) <= len(ChunkLayout(10).chunks(156))
    assert all(c.stop >= planned_stop for c, planned_stop in zip(cut, range(10, 156, 10), strict=False))
    assert [(w.start, w.stop) for w in planned] == [(c.start, c.stop) for c in cut]
    # The pilot is drawn from rows, as for one row a conversation, not from whole conversations.
    assert spec.layout.pilot is None and pilot_indices(config, 156, spec.layout).size == 30
