# tracegen — the two set-up commands are `make demo` and `make test`; everything else is a step of those.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
SGLANG_VENV := .venv-sglang
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
STATE := $(CURDIR)/.state

.PHONY: test lint unit venv system-deps clean demo bytecode airflow bench-occupancy-airflow-ask test-late-answer

# The embedded default's Airflow: SQLite metadata DB and logs under .state/, this project's DAGs and plugins,
# and the stand-ins' loop rate `make demo` runs them with (tracegen.demo.airflow_env): it is part of the
# bundled fleet's digest, and a run refuses a changed fleet, so a demo run reruns from this UI only with it.
AIRFLOW_ENV := AIRFLOW_HOME=$(STATE)/airflow AIRFLOW__CORE__DAGS_FOLDER=$(CURDIR)/dags \
	AIRFLOW__CORE__PLUGINS_FOLDER=$(CURDIR)/plugins AIRFLOW__CORE__LOAD_EXAMPLES=False \
	AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=sqlite:///$(STATE)/airflow/airflow.db \
	TRACEGEN_STATE_DIR=$(STATE) TRACEGEN_SPOOL_DIR=$(STATE)/spool TRACEGEN_OUTPUT_URI=$(STATE)/demo/output \
	TRACEGEN_SIM_RUNAWAY_RATE="$${TRACEGEN_SIM_RUNAWAY_RATE-$$($(PY) -c 'from tracegen.demo import DEMO_LOOP_RATE; print(DEMO_LOOP_RATE)')}"

# The venv is rebuilt when a requirements file changes. uv resolves in seconds where pip takes minutes.
# The CPU build of torch the trainers' loaders import (requirements-trainers.txt); PyPI's x86_64 torch is a
# CUDA build of several GB. Taken from the wheel folder TORCH_WHEELS when it holds that version's wheel (no
# download), else from PyTorch's own CPU index, which serves the `+cpu` local versions. uv only looks in
# either when told to, and only for this one package (--no-deps).
TORCH_WHEELS ?= /opt/wheels
TORCH_CPU ?= torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_SOURCE = $(if $(wildcard $(TORCH_WHEELS)/$(subst ==,-,$(TORCH_CPU))-*.whl),--find-links $(TORCH_WHEELS),--index-url $(TORCH_CPU_INDEX))

$(VENV)/.installed: pyproject.toml constraints.txt requirements.txt requirements-test.txt requirements-sglang.txt \
		requirements-trainers.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check uv
	# Bytecode now, not at first import: uv skips it by default, and where PYTHONDONTWRITEBYTECODE is set
	# (it is on our build machines) every process would compile what it imports from source, every time:
	# airflow.sdk took 3.1 s to import instead of 1.6 s, pandas 1.4 s instead of 0.4 s.
	# tracegen itself as an editable distribution (the `tracegen` package from include/, which a worker runs as
	# it is on disk, and the `tracegen` command), with requirements.txt and the tests' extra; constraints.txt
	# pins what those pull in (it says why not Airflow's own constraints file).
	$(UV) pip install --quiet --compile-bytecode --python $(PY) --constraint constraints.txt --editable ".[tests]"
	# SGLang without its dependencies (CUDA, torch): the tests judge the stand-in with its parser and
	# protocol models, which need only what requirements-test.txt adds. A step of its own: --no-deps
	# applies to a whole install.
	$(UV) pip install --quiet --compile-bytecode --no-deps --python $(PY) -r requirements-sglang.txt
	# SpecForge and speculators without their dependencies (CUDA kernels, another sglang, wandb): the export
	# tests read each layout with their own loaders, which need only what requirements-trainers.txt lists and
	# CPU torch (about 35 s and 750 MB).
	$(UV) pip install --quiet --compile-bytecode --no-deps --python $(PY) -r requirements-trainers.txt
	$(UV) pip install --quiet --compile-bytecode --no-deps --python $(PY) $(TORCH_SOURCE) "$(TORCH_CPU)"
	# A venv made before tracegen was a distribution named include/ in a .pth file; the editable install does.
	rm -f "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tracegen-include.pth"
	touch $@

# Real SGLang for the `real_sglang` tests, in a venv of its own: SGLang pins torch 2.14.1 (PyPI's build, which
# runs on a CPU) and the Airflow venv has the trainers' CPU torch 2.13. pip, not uv: pip reads the machine's
# pip configuration, where local wheel mirrors may hold torch and its nvidia libraries. Every package is pinned
# and installed --no-deps (requirements-sglang-server.txt says why); docs/simulator.md has what it costs.
$(SGLANG_VENV)/.installed: requirements-sglang-server.txt
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-sglang-server.txt
	touch $@

venv: $(VENV)/.installed $(SGLANG_VENV)/.installed

# Debian packages the tests start for real (sshd for the fleet tests). Installed only when missing.
system-deps:
	@bash scripts/install-system-deps.sh

# tracegen's own modules compiled once, here, rather than by every process that imports them: where
# PYTHONDONTWRITEBYTECODE is set (it is on our build machines) each task, stand-in and Airflow component would
# compile them from source at each start (a chunk task's imports of tracegen: 0.17 s of CPU from source, 0.07 s
# from bytecode). Incremental: a file is compiled again only when it changed.
bytecode: $(VENV)/.installed
	$(PY) -m compileall -q include dags plugins

lint: venv
	$(VENV)/bin/ruff check dags plugins include tests bench

unit: venv
	$(PY) -m pytest -q

# Four workers on the CI machine's two cores: the end-to-end modules spend most of their time waiting on their
# Airflow clusters (five measured slower: more contention). --dist loadfile keeps a module on one worker, so its
# module fixtures (a cluster) start once; tests/conftest.py makes the modules that share a cluster one unit.
test: venv system-deps lint bytecode
	$(PY) -m pytest -q -p no:cacheprovider -n 4 --dist loadfile --no-loadscope-reorder

# The reference job's 4096 -> 8192 pivot through the real DAG, on a simulated fleet, in about a minute.
demo: $(VENV)/.installed bytecode
	$(PY) -m tracegen.demo

# The Airflow UI on the same state as `make demo` (airflow standalone prints the admin password).
airflow: venv
	mkdir -p $(STATE)/airflow
	# standalone starts its components as `airflow ...` subprocesses: the venv's bin must be on PATH.
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(AIRFLOW_ENV) $(VENV)/bin/airflow standalone

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(STATE)

# GPU occupancy of a whole run (pilot, gate, chunk fan-out) vs the reference job's asyncio script, and in-flight
# auto-tuning vs a sweep of fixed limits, on a simulated fleet; a few minutes. See docs/benchmarks.md.
.PHONY: bench-occupancy
bench-occupancy: venv
	$(PY) bench/occupancy.py

# The 4096 -> 8192 pivot on simulated SGLang: extending truncated rows from their tokens against
# regenerating them (tokens spent, KS test of the final lengths against one uninterrupted 8192 run);
# about 2 minutes. See docs/benchmarks.md.
.PHONY: bench-pivot
bench-pivot: venv
	$(PY) bench/pivot.py

# The cap table's accuracy on every stand-in length law (with and without 5% runaways): a 4096 pilot measured to
# 16384 or 8192 against the log-normal-only extrapolation; 2-5 minutes on 2 cores. See docs/benchmarks.md.
.PHONY: bench-capfit
bench-capfit: venv
	$(PY) bench/capfit_accuracy.py

# The same comparison with a whole tracegen_generate run on a real Airflow (PostgreSQL, CeleryExecutor on
# Redis, as `make airflow-up`) and its bundled 2-GPU simulated fleet; about 13 minutes. Starts its own private
# PostgreSQL and Redis on free loopback ports (system-deps).
.PHONY: bench-occupancy-airflow
bench-occupancy-airflow: venv system-deps
	$(PY) bench/occupancy_airflow.py

# The ask path: the pilot gate asks at 4096 and the answer comes 5 minutes late (about 20 minutes in all).
bench-occupancy-airflow-ask: venv system-deps
	$(PY) bench/occupancy_airflow.py --ask-late 300 --rows 20000

# tests/e2e/test_while_asking.py (a slow test: make soak answers 20 s late) with the answer 2 minutes late, as
# its figures in docs/benchmarks.md were taken; about 15 minutes.
test-late-answer: venv system-deps
	TRACEGEN_TEST_LATE_ANSWER_S=120 $(PY) -m pytest -q -s -p no:cacheprovider -m slow tests/e2e/test_while_asking.py

# The distributed setup (PostgreSQL + CeleryExecutor on Redis, two workers) as local processes, for a person:
# prints the UI URL and credentials. Starts its own private PostgreSQL and Redis on free loopback ports
# (system-deps; TRACEGEN_PG_PORT / TRACEGEN_REDIS_PORT name running ones instead, docs/deployment.md).
.PHONY: airflow-up
airflow-up: venv system-deps
	bash scripts/airflow-cluster.sh

# Every benchmark; each prints its figures as ratios against a baseline run in the same process.
# Latest figures: docs/benchmarks.md.
.PHONY: bench
bench: venv
	$(PY) bench/client_overhead.py
	$(PY) bench/plan_resume.py
	$(PY) bench/audit_ledger.py
	$(PY) bench/dataset_read.py
	$(PY) bench/chunk_memory.py
	$(PY) bench/occupancy.py
	$(PY) bench/pivot.py

# Long soak and chaos runs kept out of `make test` (e.g. 120 SIGKILL trials of a chunk).
.PHONY: soak
soak: venv system-deps
	$(PY) -m pytest -q -p no:cacheprovider -m slow

# The reference job's 913,786 prompts through the real tracegen_generate DAG on the distributed deployment (PostgreSQL,
# CeleryExecutor on Redis, a 7-GPU fleet of stand-ins over SSH), output lengths and caps scaled down 32x: the
# 4096 pilot stops, the reviewer's 8192 extends, the dataset completes, a Celery worker is SIGKILLed halfway.
# About 70 minutes on 2 cores (budget: 90); needs the whole machine. Figures in docs/benchmarks.md.
.PHONY: rehearsal
rehearsal: venv system-deps
	$(PY) bench/rehearsal.py

# Faults injected into real tracegen_generate runs on the distributed deployment (private PostgreSQL,
# CeleryExecutor on private Redis, an SSH fleet of stand-ins, S3 on an S3-compatible server): Celery worker,
# scheduler and stand-in SIGKILLs, S3 outages, PostgreSQL and Redis restarts, sshd killed while provisioning
# and while tunnels carry requests, prepare_run's worker killed and S3 flapping under it, with the scheduled
# rerun DAG on a one-minute schedule beside the runs; then every row checked. CPU heavy, about an hour on
# 2 cores (more on a shared machine); docs/reliability.md.
.PHONY: chaos
chaos: venv system-deps
	$(PY) bench/chaos.py
