"""A run's first step: index and bind the dataset, choose the chunk layout, store the run's record, and
list the chunks with work left. Its `RunSpec` is what every later task receives."""

from __future__ import annotations

import logging
import time

from tracegen.config import RunConfig
from tracegen.dataset.reading import Reading
from tracegen.dataset.stored import bind_index
from tracegen.dataset.usable import check_usable
from tracegen.run import plan
from tracegen.run.run_record import create_run_record, stored_run_id
from tracegen.run.run_spec import DatasetIdentity, FleetRef, RunSpec
from tracegen.store.root import open_root
from tracegen.store.snapshots import COMPACT_OVER

log = logging.getLogger(__name__)


def prepare_run(
    config: RunConfig, run_id: str | None, fleet: FleetRef, *, stagger: int = 0, teardown: bool = False,
    airflow_run_id: str | None = None,
) -> tuple[RunSpec, list[plan.ChunkWork]]:
    """The run's spec and its chunks with work left. `stagger`: chunk tasks in flight at once (see
    `plan.chunks`); 0 for equal chunks. `run_id` None: the Airflow run's stored id in this root
    (`records.stored_run_id`: a run recorded under an earlier id form keeps it). Refused with
    `RunRecordTaken`, writing nothing under `runs/`, when the run's directory holds another run's record. A
    dataset or output root outside the operator's prefixes is a `ConfigError` before anything is opened
    (`RunConfig.check_locations`); a dataset most of whose rows cannot be used is a `DatasetUnusableError`, and
    one read another way than the root's is a `ReadingMismatchError`, both before the run's record."""
    config.check_locations()
    root = open_root(config.output_uri, config.aws_conn_id)
    if run_id is None:
        if airflow_run_id is None:
            raise ValueError("prepare_run needs a run id or the Airflow run id to derive it from")
        run_id = stored_run_id(root, airflow_run_id)
    index = bind_index(root, config.dataset_uri, config.aws_conn_id, Reading.of(config))
    # A dataset most of whose rows cannot be used stops here, before a record or a GPU: DatasetUnusableError.
    check_usable(index, config.max_invalid_pct, config.pilot_seed, aws_conn_id=config.aws_conn_id)
    # Every count from here on is of prompt rows: under turns=each, one per assistant turn.
    layout = plan.choose_layout(config, index.n_prompt_rows, fleet.slots, stagger)
    if index.reading.expands:
        # A conversation's turns in one chunk: under turns=chain they go in order (one pilot holds them whole
        # too); under each, the turns share their history's prefix, which the chunk's routing keeps on one
        # server's cache (`sglang.affinity`) while they run side by side. The pilot of `each` stays a sample
        # of rows: the gate's estimate is of rows, and whole conversations would cluster it.
        assert index.turn_starts is not None
        layout = plan.whole_conversations(layout, index.n_prompt_rows, index.turn_starts, config.pilot_size,
                                          config.pilot_seed, whole_pilot=index.reading.chained)
    spec = RunSpec(
        run_id=run_id, created_at=time.time(), config=config, fleet=fleet,
        dataset=DatasetIdentity(config.dataset_uri, index.fingerprint, index.n_prompt_rows, index.source_size,
                                index.source_version), layout=layout,
        teardown=teardown, airflow_run_id=airflow_run_id,
    )
    create_run_record(root, spec)
    work = plan.chunks_with_work(root.snapshots.frame(compact_over=COMPACT_OVER), index.n_prompt_rows, layout, config,
                                 index.turn_starts if index.reading.chained else None)
    log.info(
        "plan: %d rows, chunks of %d (the first %d of %s, then %d staggered), %d chunks with work left "
        "(%d rows to generate at max_tokens=%d)",
        index.n_prompt_rows, layout.size, layout.stagger, layout.first_size or layout.size, layout.stagger, len(work),
        sum(w.remaining for w in work), config.max_tokens,
    )
    return spec, work
