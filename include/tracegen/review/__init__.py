"""The review pages reviewers open from the Airflow UI: every run of every output root, and each run's
report, progress and next step. A FastAPI app (`app.create_app`) that `plugins/tracegen_review.py` mounts
into Airflow's api-server under `/tracegen`.

- `access`: who may see the pages (Airflow's authentication and DAG read access), Airflow's view of runs;
- `read_model`: one read model of a run from its stored files (its stage, reports, question), the report
  names; `summary`: a run's line in the list; `roots`: the output roots, each once, and their runs;
- pages: `runs_page` (the run list), `run_tab` (the DAG run's tab), `files_page` (a run's report files),
  `progress_page` (live progress), over `page` (templates, CSP, URLs) and `next_step` (what to do next);
  their HTML is the autoescaped jinja2 templates in `templates/`, over one base (head, CSS) and shared macros
  (navigation, badges);
- `registration`: what the plugin registers besides the app (URL prefix, menu entry, run tab), import-light.
"""
