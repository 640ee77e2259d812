"""The work of each Airflow task, below the adapter (`tracegen.steps`), in the order a run meets it:

- `prepare` — the params checked and the run prepared (`run.prepare`);
- `provision` — one server per GPU, healthy, its context checked against the cap;
- `pilot` — the tail measured past the cap, then the pilot gate;
- `chunks` — one chunk of a fan-out generated at the cap Airflow's metadata says;
- `question` — whether to ask, the question or a raise taken instead, the answer applied;
- `resample` — a fresh sample for each runaway row;
- `raise_cap` — an operator's raise of a running run's cap;
- `rerun` — the scheduled rerun of what runs left unfinished.

Each takes a `api.TaskApi` (Airflow's metadata as one running task sees it) and the task's inputs, and
returns the task's result or raises one of `outcomes` (a skip, a refusal). Nothing here reads the task
context or imports Airflow at module level, so each can be run, and is tested, without an Airflow task.
"""
