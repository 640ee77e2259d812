"""The Celery settings tracegen's workers run with (tracegen/common/celery_config.py)."""

from __future__ import annotations

import importlib

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG

from tracegen.common.celery_config import CELERY_CONFIG, PRELOADED_MODULES


def test_keeps_every_airflow_default_and_adds_the_preloaded_imports() -> None:
    assert {k: v for k, v in CELERY_CONFIG.items() if k != "imports"} == {
        k: v for k, v in DEFAULT_CELERY_CONFIG.items() if k != "imports"
    }
    assert set(PRELOADED_MODULES) <= set(CELERY_CONFIG["imports"])


def test_preloads_only_third_party_modules_that_import() -> None:
    # tracegen itself must stay out: a preloaded copy would outlive an edit of include/ until a restart.
    assert not [m for m in PRELOADED_MODULES if m.split(".")[0] == "tracegen"]
    for module in PRELOADED_MODULES:
        importlib.import_module(module)
