"""One run of `tracegen_generate`: its typed description (`spec`), how it is prepared (`prepare`), how it is
stored beside the data (`records`), where it stands at its gate (`stage`), its audit and reports
(`report`), and what the scheduled rerun finds left of it (`rerun`)."""

from tracegen.store.layout import (
    FINAL_REPORT,
    MEASURE_CHUNK,
    MEASURE_FILE,
    PILOT_REPORT,
    QUESTION_FILE,
    RESAMPLE_CHUNK,
    RUN_FILE,
)

__all__ = ["FINAL_REPORT", "MEASURE_CHUNK", "MEASURE_FILE", "PILOT_REPORT", "QUESTION_FILE", "RESAMPLE_CHUNK", "RUN_FILE"]
