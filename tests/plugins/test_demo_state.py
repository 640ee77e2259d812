"""`make demo` starts from an empty output root without destroying the earlier demos' output: their runs
stay in the metadata DB, so their reports must stay readable (the review pages find each run's root from
its conf). Only the oldest roots beyond the kept number go, and the demo removes their runs with them."""

from __future__ import annotations

from pathlib import Path

from tracegen.demo import new_output_root


def test_each_demo_gets_a_new_root_and_earlier_ones_are_kept_up_to_the_limit(tmp_path: Path) -> None:
    demo = tmp_path / "demo"
    (demo / "output").mkdir(parents=True)  # a root from before roots were kept per demo
    (demo / "output" / "dataset.json").write_text("{}")
    first, dropped = new_output_root(demo, keep=3)
    assert dropped == [] and (demo / "output").resolve() == first.resolve() and not any(first.iterdir())
    legacy = [p for p in demo.glob("output-*-earlier")]
    assert len(legacy) == 1 and (legacy[0] / "dataset.json").exists()  # kept, renamed
    (first / "marker").write_text("first")
    second, dropped = new_output_root(demo, keep=3)
    assert dropped == [] and second != first and (first / "marker").exists()
    assert (demo / "output").resolve() == second.resolve()
    third, dropped = new_output_root(demo, keep=3)
    assert dropped == legacy and not legacy[0].exists()  # the oldest beyond three goes, and is reported
    assert first.exists() and second.exists() and (demo / "output").resolve() == third.resolve()
