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
