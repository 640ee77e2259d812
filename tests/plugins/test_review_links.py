"""The review pages inside a real Airflow api-server (the `server` fixture of test_review_page, one per
module) against an output root holding what someone with write access to it could plant:
links out of the root, a configured root that does not exist, a report.json that is not JSON.

- `runs/evil/report.json -> /proc/self/environ` (the api-server's environment) and
  `report.html -> a file outside the root` answer 404 saying a link is not followed, never the target's bytes,
  and the run list does not show them.
- listing a configured root that does not exist creates nothing and says it does not exist.
- a report.html whose report.json is not JSON answers a 422 page naming the file, escaped.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from test_review_page import Server, _get, server  # noqa: F401  (the module-scoped api-server fixture)

OUTSIDE_SECRET = "TRACEGEN_PLANTED_SECRET_7f3a"


def _key(server: Server) -> str:  # noqa: F811
    listing = _get(server.url + "/tracegen/runs.json", headers=server.auth).json()
    return next(r["key"] for r in listing["roots"] if r["uri"] == str(server.output))


@pytest.fixture(scope="module")
def planted(server: Server) -> Path:  # noqa: F811
    """Links planted in the served root: files of a run pointing out of the root, and a run directory that
    is itself a link to a directory outside it holding report files."""
    outside = server.tmp / "outside"
    (outside / "run").mkdir(parents=True)
    (outside / "secret.html").write_text(f"<html><body>{OUTSIDE_SECRET}</body></html>")
    for name in ("report.html", "report.json", "pilot-report.html"):
        (outside / "run" / name).write_text(f'{{"secret": "{OUTSIDE_SECRET}"}}')
    evil = server.output / "runs" / "evil"
    evil.mkdir(parents=True)
    (evil / "report.json").symlink_to("/proc/self/environ")
    (evil / "report.html").symlink_to(outside / "secret.html")
    (evil / "run.json").symlink_to(outside / "run" / "report.json")
    (server.output / "runs" / "evil_dir").symlink_to(outside / "run", target_is_directory=True)
    return outside


def _assert_no_leak(resp: httpx.Response) -> None:
    assert OUTSIDE_SECRET not in resp.text
    # /proc/self/environ of the api-server: its JWT secret and its Airflow home are in there.
    assert "JWT_SECRET" not in resp.text and "AIRFLOW_HOME" not in resp.text


@pytest.mark.parametrize(
    ("run", "name"),
    [("evil", "report.json"), ("evil", "report.html"), ("evil_dir", "report.json"), ("evil_dir", "report.html"),
     ("evil_dir", "pilot-report.html")],
)
def test_a_link_in_the_output_root_is_never_served(
    server: Server, planted: Path, run: str, name: str  # noqa: F811
) -> None:
    url = f"{server.url}/tracegen/roots/{_key(server)}/runs/{run}/{name}"
    resp = _get(url, headers=server.auth)
    assert resp.status_code == 404, (url, resp.status_code, resp.text[:300])
    _assert_no_leak(resp)
    assert "symbolic link" in resp.json()["detail"] and "never follows a link" in resp.json()["detail"]
    if name.endswith(".html"):
        page = _get(url, headers={**server.auth, "Accept": "text/html"})
        assert page.status_code == 404 and "<h1>404</h1>" in page.text and "symbolic link" in page.text
        _assert_no_leak(page)


def test_links_are_not_listed_and_the_run_tab_finds_nothing_through_them(
    server: Server, planted: Path  # noqa: F811
) -> None:
    resp = _get(server.url + "/tracegen/runs.json", headers=server.auth)
    assert resp.status_code == 200
    _assert_no_leak(resp)
    runs = {r["run_id"] for root in resp.json()["roots"] for r in root["runs"]}
    assert runs and not runs & {"evil", "evil_dir"}
    for run in ("evil", "evil_dir"):
        resp = _get(f"{server.url}/tracegen/runs/{run}", headers=server.auth)
        assert resp.status_code == 404, (run, resp.status_code, resp.text[:300])
        _assert_no_leak(resp)
        resp = _get(f"{server.url}/tracegen/roots/{_key(server)}/runs/{run}/progress.json", headers=server.auth)
        assert resp.status_code == 404, (run, resp.status_code, resp.text[:300])
        _assert_no_leak(resp)
    index = _get(server.url + "/tracegen/", headers={**server.auth, "Accept": "text/html"})
    assert index.status_code == 200 and "evil" not in index.text
    _assert_no_leak(index)


def test_listing_a_configured_root_that_does_not_exist_creates_nothing(server: Server) -> None:  # noqa: F811
    assert not server.empty_root.exists()
    resp = _get(server.url + "/tracegen/runs.json", headers=server.auth)
    root = next(r for r in resp.json()["roots"] if r["uri"] == f"file://{server.empty_root}")
    assert root["runs"] == [] and root["problem"] is None
    assert root["missing"] == f"output root {server.empty_root} does not exist (nothing was created; check the path)"
    index = _get(server.url + "/tracegen/", headers={**server.auth, "Accept": "text/html"})
    assert index.status_code == 200 and "No runs yet." in index.text
    assert f"{server.empty_root} does not exist" in index.text
    assert not server.empty_root.exists()


def test_a_report_whose_json_is_not_json_answers_a_clear_error_page(server: Server) -> None:  # noqa: F811
    from tracegen.store.root import OutputRoot
    from tracegen.store.storage import open_storage

    output_root = OutputRoot(open_storage(str(server.output)))
    output_root.run_files.put("damaged_json", "report.html", b"<html><body><h1>final report</h1></body></html>")
    output_root.run_files.put("damaged_json", "report.json", b"<script>alert('report')</script>")
    for url in (f"{server.url}/tracegen/roots/{_key(server)}/runs/damaged_json/report.html",
                f"{server.url}/tracegen/runs/damaged_json"):
        resp = _get(url, headers=server.auth)
        assert resp.status_code == 422, (url, resp.status_code, resp.text[:300])
        assert "report.json is not valid JSON" in resp.json()["detail"] and "damaged_json" in resp.json()["detail"]
        page = _get(url, headers={**server.auth, "Accept": "text/html"})
        assert page.status_code == 422 and "<h1>422</h1>" in page.text
        assert "report.json is not valid JSON" in page.text and "<script>" not in page.text
        assert page.headers["content-security-policy"].startswith("default-src 'none'")
    # The stored JSON itself is still served as stored bytes (it is what the reviewer needs to see).
    resp = _get(f"{server.url}/tracegen/roots/{_key(server)}/runs/damaged_json/report.json", headers=server.auth)
    assert resp.status_code == 200 and resp.content == b"<script>alert('report')</script>"
