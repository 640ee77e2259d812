"""How the work of a task ends when it does not return: the two outcomes the modules below `tracegen.steps`
raise, which the adapter turns into Airflow's (a skip, a failure without retries). Kept apart from Airflow's
exceptions so that the work runs, and is tested, without an Airflow task around it."""

from __future__ import annotations


class Skip(Exception):  # noqa: N818 - an outcome, not an error
    """The task ends skipped, its message saying why: the gate doing its job, nothing to do, another writer
    owning the root. Never a failure."""


class Refuse(Exception):  # noqa: N818 - an outcome, not an error
    """The task fails without retries: its input is wrong, and a retry would meet the same input."""
