"""The output roots the review pages read, and the runs each holds.

Output roots are never taken from a request: a page names a root by a short hash of a known root, and run
ids must match the alphabet `tracegen.config.safe_run_id` produces, so no request can reach outside
`runs/`. The known roots are the default output root, the `tracegen_output_roots` Variable's, and the
`output_uri` each `tracegen_generate` run was triggered with (its conf in Airflow's metadata DB, checked by
the config's `Uri` rule). A run's conf only names where its data is: the pages read that root with the
api-server's own connection (never one the conf names). A local root reached by two paths (a symlink) is
one root, listed once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import HTTPException

from tracegen.config import RUN_ID_PATTERN, ConfigError, safe_run_id, stored_as
from tracegen.review.access import GENERATE_DAG, AirflowRun
from tracegen.review.registration import URL_PREFIX
from tracegen.review.summary import RunSummary, summarise_run

log = logging.getLogger(__name__)

MAX_RUNS_PER_ROOT = 200  # newest first; an output root rarely has more, and each run costs two reads
_ROOT_KEY_RE = re.compile(r"[0-9a-f]{12}")


def root_key(uri: str) -> str:
    """A stable, opaque name for an output root in URLs (the URI itself never comes from a request)."""
    return hashlib.sha256(uri.encode()).hexdigest()[:12]


def report_file_path(output_uri: str, run_id: str, name: str) -> str:
    """The path (under the api-server's root) of the page serving one of a run's report files."""
    return f"{URL_PREFIX}/roots/{root_key(output_uri)}/runs/{run_id}/{name}"


def check_run_id(run_id: str) -> str:
    """A stored (sanitised) run id, or a 404 saying what a run id looks like."""
    if not RUN_ID_PATTERN.fullmatch(run_id or ""):
        raise HTTPException(
            404, f"invalid run id {run_id!r}: stored run ids use only letters, digits, '.', '_' and '-'"
        )
    return run_id


def configured_roots() -> list[str]:
    """The default output root, then the roots of the `tracegen_output_roots` Variable, deduplicated."""
    from tracegen import params

    roots = [params.default_params()["output_uri"]]
    roots.extend(params.output_roots())
    return list(dict.fromkeys(r.strip() for r in roots if r and r.strip()))


def same_root(uri: str) -> str:
    """What makes two URIs one root: a local path's real path (links resolved), else the URI itself."""
    if "://" in uri and not uri.startswith("file://"):
        return uri.rstrip("/")
    return os.path.realpath(uri.removeprefix("file://"))


@dataclass(frozen=True)
class RootListing:
    key: str
    uri: str
    runs: tuple[RunSummary, ...]
    problem: str | None = None
    missing: str | None = None  # why the root holds no runs when it does not exist (nothing is created)


def list_root(uri: str, limit: int = MAX_RUNS_PER_ROOT) -> RootListing:
    """Runs of one output root, newest first. A root that cannot be read says why instead of failing."""
    from tracegen.store.root import open_root
    from tracegen.store.run_files import RUNS_DIR
    from tracegen.store.storage import StorageRootError

    key = root_key(uri)
    try:
        try:
            # Read-only: a root that does not exist is listed as such, never created.
            output_root = open_root(uri, must_exist=True)
        except StorageRootError as exc:
            return RootListing(key, uri, (), missing=str(exc))
        files: dict[str, set[str]] = {}
        for k in output_root.storage.list(RUNS_DIR):
            parts = k.split("/")
            if len(parts) == 3 and RUN_ID_PATTERN.fullmatch(parts[1]):
                files.setdefault(parts[1], set()).add(parts[2])
        runs = [summarise_run(output_root, run_id, names) for run_id, names in files.items()]
    except Exception as exc:  # any storage or config failure: show it on the page, keep other roots
        log.warning("output root %s: %s", uri, exc)
        return RootListing(key, uri, (), problem=f"cannot read this output root: {exc}")
    runs.sort(key=lambda r: (r.created or "", r.run_id), reverse=True)
    return RootListing(key, uri, tuple(runs[:limit]))


def airflow_run_of(stored: str, recorded: str | None, by_stored: dict[str, AirflowRun]) -> AirflowRun | None:
    """The run of `by_stored` (`Site.by_stored_id`) whose files are `runs/<stored>/`, the record there naming
    the Airflow run `recorded` (None: no record, or one naming none): the run the record names, when its
    files are there by `config.stored_as` (its stored id, or that id's earlier form); without a name, the run
    whose stored id it is."""
    if recorded is None:
        return by_stored.get(stored)
    try:
        named = by_stored.get(safe_run_id(recorded))
    except ConfigError:
        return None
    return named if named is not None and stored_as(stored, named.run_id, recorded) else None


class Site:
    """The roots and Airflow's runs as one request sees them: `roots` lists the configured output roots,
    `runs` reads `tracegen_generate` runs from Airflow's metadata DB."""

    def __init__(self, roots: Callable[[], list[str]], runs: Callable[..., list[AirflowRun]]) -> None:
        self._roots, self._runs = roots, runs

    def known_runs(self, run_id: str | None = None) -> tuple[list[AirflowRun], list[str]]:
        try:
            return self._runs(run_id) if run_id is not None else self._runs(), []
        except Exception as exc:  # the metadata DB is the api-server's; if it fails, the configured roots remain
            log.warning("tracegen runs from the metadata DB: %s", exc)
            return [], [f"cannot read {GENERATE_DAG}'s runs from Airflow's metadata DB: {exc}"]

    def resolve_roots(self) -> tuple[dict[str, str], list[str]]:
        """{key: uri} of every known root, each root once, and the problems met finding them."""
        problems: list[str] = []
        try:
            uris = list(self._roots())
        except Exception as exc:  # e.g. a malformed Variable: say so, still show the default root
            log.warning("output roots: %s", exc)
            from tracegen import params

            uris, problems = [params.default_params()["output_uri"]], [str(exc)]
        found, run_problems = self.known_runs()
        uris.extend(r.output_uri for r in found if r.output_uri)
        by_root: dict[str, str] = {}
        for uri in uris:
            by_root.setdefault(same_root(uri), uri)
        return {root_key(u): u for u in by_root.values()}, problems + run_problems

    def open_root(self, key: str, by_key: dict[str, str] | None = None) -> tuple[Any, str]:
        from tracegen.store.root import open_root

        if not _ROOT_KEY_RE.fullmatch(key):
            raise HTTPException(404, f"invalid output root key {key!r}")
        known = by_key if by_key is not None else self.resolve_roots()[0]
        uri = known.get(key)
        if uri is None:  # a root known under another spelling of the same path
            uri = next((u for u in self._all_spellings() if root_key(u) == key), None)
        if uri is None:
            raise HTTPException(404, f"no known output root has key {key!r}; open the run list again")
        return open_root(uri), uri

    def _all_spellings(self) -> list[str]:
        try:
            uris = list(self._roots())
        except Exception:  # noqa: BLE001 - resolve_roots has said why already
            uris = []
        return uris + [r.output_uri for r in self.known_runs()[0] if r.output_uri]

    def by_stored_id(self) -> dict[str, AirflowRun]:
        """Airflow's runs by their stored id (`safe_run_id`: Airflow's ids carry ':' and '+'). A run stored
        under the earlier id form is found by `airflow_run_for` with the Airflow id its record names."""
        out: dict[str, AirflowRun] = {}
        for r in self.known_runs()[0]:
            try:
                out.setdefault(safe_run_id(r.run_id), r)
            except ConfigError:
                continue
        return out

    def airflow_run_for(self, stored: str, recorded: str | None = None,
                        by_stored: dict[str, AirflowRun] | None = None) -> AirflowRun | None:
        """The Airflow run stored as `stored`, whose record names the Airflow run `recorded` (`config.stored_as`).
        `by_stored`: `by_stored_id()`, when the caller holds it already."""
        by_stored = self.by_stored_id() if by_stored is None else by_stored
        return airflow_run_of(stored, recorded, by_stored)

    def refused_answer(self, airflow_run_id: str) -> dict[str, Any] | None:
        from tracegen.review.access import refused_answer

        try:
            return refused_answer(airflow_run_id)
        except Exception as exc:  # noqa: BLE001 - the page still shows the question's state
            log.warning("refused answer of %s: %s", airflow_run_id, exc)
            return None


def review_page_url(output_uri: str, run_id: str, name: str, *, run_conf: dict[str, Any]) -> str | None:
    """The review page showing one of a run's report files (for the question to link), absolute when the
    api-server's base URL is configured; None when the review pages do not serve the run's output root (they
    serve the default root, the `tracegen_output_roots` Variable's and the root a run's conf names, never one
    named by a URL). `run_conf`: the conf the run was triggered with."""
    from airflow.providers.common.compat.sdk import conf

    if run_conf.get("output_uri") == output_uri:
        served = [output_uri]  # the review pages find it from this run's conf
    else:
        try:
            served = configured_roots()
        except Exception as exc:  # noqa: BLE001 - a malformed Variable must not keep the question from being asked
            log.warning("cannot tell which output roots the review pages serve: %s", exc)
            return None
    if output_uri not in served:
        log.info("the review pages do not serve %s (not in tracegen_output_roots): the question names the "
                 "report's storage location only", output_uri)
        return None
    base = (conf.get("api", "base_url", fallback=None) or "").rstrip("/")
    return base + report_file_path(output_uri, run_id, name)
