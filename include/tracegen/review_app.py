"""The review pages' former module name, kept for the callers that still import it (`steps._review_page`,
tests of the stage rule): the pages are the `tracegen.review` package."""

from tracegen.review.access import conf_output_root
from tracegen.review.app import EXTERNAL_VIEWS, create_app
from tracegen.review.read_model import REPORT_FILES, gate_stage
from tracegen.review.roots import URL_PREFIX, configured_roots, report_file_path, root_key

__all__ = ["EXTERNAL_VIEWS", "REPORT_FILES", "URL_PREFIX", "conf_output_root", "configured_roots", "create_app",
           "gate_stage", "report_file_path", "root_key"]
