"""Names in an output root that more than one layer reads: the files of `runs/<run_id>/` and the chunk
numbers of rows generated outside a run's chunks."""

# runs/<run_id>/ in the output root: the run's record, and the pilot audit's report (its verdict is the gate's).
RUN_FILE = "run.json"
PILOT_REPORT = "pilot-report.json"
# The final audit's report: once it is written, the run has ended.
FINAL_REPORT = "report.json"
# The question a gate put to the reviewer (gate_mode=ask); the answer goes into the run's record.
QUESTION_FILE = "question.json"
# The tail measurement's decision and cost (`tracegen.generate.measure`), read by the reports.
MEASURE_FILE = "measure.json"
# Chunk numbers of rows generated outside the run's chunks, beside the pilot's (99_999): the pilot's truncated
# rows continued to measure the tail, and the fresh samples of runaway rows (runaway_policy=resample).
MEASURE_CHUNK = 99_998
RESAMPLE_CHUNK = 99_997
