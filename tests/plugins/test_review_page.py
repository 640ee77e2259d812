"""The review pages inside a real Airflow api-server, checked over HTTP and in headless Chromium.

One module-scoped api-server (SimpleAuthManager with a known user, SQLite DB migrated here, this
project's dags/ and plugins/) serves an output root built here with the real ledger and the real
`audit_and_report`: a run stopped at the pilot gate, a run that passed, and a run with a corrupt report.
"""

from __future__ import annotations

import html
import json
import os
import secrets
import sqlite3
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from cdp_browser import Browser, journey_shot
from fixtures.simulator import free_port

ROOT = Path(__file__).resolve().parents[2]
USER, PASSWORD = "reviewer", "review-" + secrets.token_hex(8)
# A viewer who may see plugin views but not tracegen_generate (tests/plugins/dag_scoped_auth.py).
OUTSIDER, OUTSIDER_PASSWORD = "outsider", "outside-" + secrets.token_hex(8)
STOP_RUN = "manual__2026-01-02T10:00:00.000000+00:00"  # as Airflow names it
PASS_RUN = "manual__2026-01-02T11:30:00.000000+00:00"
BROKEN_RUN = "broken_run"
GATE_STOP_RUN = "manual__2026-01-02T12:00:00.000000+00:00"  # gate_mode=stop: pilot stop, then the final audit
ASKING_RUN = "manual__2026-01-02T13:00:00.000000+00:00"  # gate_mode=ask: the question is open
PLANTED_RUN = "planted_run"  # a report.html someone wrote into the output root by hand
SCREENSHOT_DIR = ROOT / ".state" / "test-screenshots"
TIMEOUT = 60  # a 2-core CI box running other suites can be slow; no assertion depends on speed


def _get(url: str, **kwargs) -> httpx.Response:
    return httpx.get(url, timeout=TIMEOUT, **kwargs)


def _post(url: str, **kwargs) -> httpx.Response:
    return httpx.post(url, timeout=TIMEOUT, **kwargs)


def _rows(run_id: str, cap: int, indices: range, truncated_every: int):
    from tracegen.store.records import FAILED, OK, GeneratedRow

    rows = []
    for i in indices:
        if i % 97 == 13:
            rows.append(GeneratedRow(index=i, status=FAILED, max_tokens=cap, run_id=run_id, chunk=99999,
                                     error="HTTP 503 from server after 6 attempts", attempt=6))
            continue
        cut = i % truncated_every == 0
        tokens = cap if cut else 300 + (i * 37) % (cap - 400)
        rows.append(GeneratedRow(
            index=i, status=OK, max_tokens=cap, run_id=run_id, chunk=99999, finish_reason="length" if cut else "stop",
            # Text that does not loop, so the audit does not take the truncated rows for runaways.
            reasoning_content="Let me think about the <b>tests</b>. " + " ".join(
                f"{(i * 7919 + k * 104729) % 1000003:x}" for k in range(60)), content="" if cut and i % 2 else "Done.",
            completion_tokens=tokens, reasoning_tokens=int(tokens * 0.7), prompt_tokens=800,
            server="http://127.0.0.1:30000", latency_s=1.5, category="refactor" if i % 3 else "debug",
        ))
    return rows


def make_run(root: Path, raw: str, cap: int, indices: range, every: int, names: tuple[str, ...], n: int,
             gate_mode: str = "ask", n_rows: int = 400):
    """One run through the real ledger and report code: its rows committed, its record, its reports."""
    from tracegen.config import RunConfig, safe_run_id
    from tracegen.run.plan import ChunkLayout
    from tracegen.run.run_record import write_run_record
    from tracegen.run.run_report import audit_and_report
    from tracegen.run.run_spec import DatasetIdentity, FleetRef, RunSpec
    from tracegen.store.root import OutputRoot
    from tracegen.store.storage import open_storage

    output_root = OutputRoot(open_storage(str(root)))
    if output_root.run_files.dataset() is None:
        output_root.run_files.bind_dataset("test-fingerprint", {"uri": "test", "rows": n_rows})
    run_id = safe_run_id(raw)
    config = RunConfig(max_tokens=cap, dataset_uri="/data/prompts.jsonl", output_uri=str(root),
                       pilot_size=len(indices), gate_mode=gate_mode)
    if len(indices):
        output_root.commits.commit(_rows(run_id, cap, indices, every), run_id, 99999, "pilot")
    spec = RunSpec(run_id, 1_767_348_000.0 + 5400 * n, config, FleetRef("test-fleet", "0" * 64, "m", 1, None),
                   DatasetIdentity("/data/prompts.jsonl", "test-fingerprint", n_rows), ChunkLayout(100))
    write_run_record(output_root, spec)
    for name in names:
        # A measured throughput, so the cap table carries its cost columns (ETA, GPU time, tokens left).
        audit_and_report(spec, name=name, indices=None if name == "report" else list(indices),
                         tokens_per_s_per_gpu=900.0)
    return output_root, run_id


PLANTED_HTML = """<!doctype html><html><head><meta http-equiv="refresh" content="1;url=/tracegen/?planted=refresh">
<base href="https://attacker.invalid/"></head><body><h1>planted report</h1>
<form id="planted" method="post" action="/tracegen/?planted=form"><input name="x" value="1">
<button id="go" type="submit" style="width:300px;height:80px">Continue</button></form></body></html>"""


def build_output_root(root: Path) -> None:
    """Runs through the real ledger and report code: 4096 stopped by the gate (ask: the question was
    asked, so only its pilot report), 8192 passing, a gate_mode=stop run with its final audit too, a run
    with a corrupt report and a report planted by hand."""
    make_run(root, STOP_RUN, 4096, range(300), 4, ("pilot-report",), 0)
    make_run(root, PASS_RUN, 8192, range(300), 50, ("pilot-report", "report"), 1)
    output_root, _ = make_run(root, GATE_STOP_RUN, 4096, range(300, 400), 4, ("pilot-report", "report"), 2,
                         gate_mode="stop")
    output_root.run_files.put(BROKEN_RUN, "report.json", b"{not json")
    output_root.run_files.put(PLANTED_RUN, "report.html", PLANTED_HTML.encode())


@dataclass
class Server:
    url: str
    token: str
    output: Path
    empty_root: Path
    outsider_token: str
    tmp: Path

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def _airflow(env: dict[str, str], *args: str, log: Path) -> None:
    with log.open("a") as out:
        rc = subprocess.call([sys.executable, "-m", "airflow", *args], env=env, stdout=out, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"airflow {' '.join(args)} failed ({rc}):\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("review")
    home, output, empty_root = tmp / "airflow", tmp / "output", tmp / "empty-root"
    home.mkdir()
    build_output_root(output)
    passwords = tmp / "passwords.json"
    passwords.write_text(json.dumps({USER: PASSWORD, OUTSIDER: OUTSIDER_PASSWORD}))
    port = free_port()
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin,{OUTSIDER}:viewer",
        "AIRFLOW__CORE__AUTH_MANAGER": "dag_scoped_auth.DagScopedAuthManager",
        "TRACEGEN_TEST_NO_DAG_USERS": OUTSIDER,
        # This checkout's tracegen, not the one the venv's .pth names (another worktree's).
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), str(ROOT / "include"),
                                                    os.environ.get("PYTHONPATH")])),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(16),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__API__PORT": str(port),
        "TRACEGEN_STATE_DIR": str(tmp / "state"),
        "TRACEGEN_OUTPUT_URI": str(output),
        "AIRFLOW_VAR_TRACEGEN_OUTPUT_ROOTS": json.dumps([str(output), f"file://{empty_root}"]),
    }
    log = tmp / "airflow.log"
    _airflow(env, "db", "migrate", log=log)
    _airflow(env, "dags", "reserialize", log=log)  # the trigger form needs the DAG in the DB
    with log.open("a") as out:
        proc = subprocess.Popen([sys.executable, "-m", "airflow", "api-server", "--host", "127.0.0.1",
                                 "--port", str(port), "--workers", "1"], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"api-server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/api/v2/monitor/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"api-server not healthy after 120 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        resp = _post(f"{url}/auth/token", json={"username": USER, "password": PASSWORD})
        assert resp.status_code == 201, resp.text
        outsider = _post(f"{url}/auth/token", json={"username": OUTSIDER, "password": OUTSIDER_PASSWORD})
        assert outsider.status_code == 201, outsider.text
        yield Server(url, resp.json()["access_token"], output, empty_root, outsider.json()["access_token"], tmp)
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    b = Browser()
    try:
        yield b
    finally:
        b.close()


def _stored_id(raw: str) -> str:
    from tracegen.config import safe_run_id

    return safe_run_id(raw)


# ---- HTTP: authentication, pages, JSON, bad input ---------------------------------------------------


def test_unauthenticated_requests_are_refused(server: Server) -> None:
    for path in ("/tracegen/", "/tracegen/runs.json", f"/tracegen/runs/{_stored_id(PASS_RUN)}"):
        resp = _get(server.url + path, headers={"Accept": "application/json"})
        assert resp.status_code == 401, (path, resp.status_code, resp.text[:200])
    # A browser (Accept: text/html) goes to Airflow's login page and is sent back afterwards.
    resp = _get(server.url + "/tracegen/", headers={"Accept": "text/html"})
    assert resp.status_code == 303
    assert resp.headers["location"].startswith("/auth/login?next=")
    # A forged token is refused too.
    resp = _get(server.url + "/tracegen/runs.json", headers={"Authorization": "Bearer not-a-jwt"})
    assert resp.status_code in (401, 403)


def test_run_list_json(server: Server) -> None:
    resp = _get(server.url + "/tracegen/runs.json", headers=server.auth)
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    roots = {r["uri"]: r for r in doc["roots"]}
    assert str(server.output) in roots and f"file://{server.empty_root}" in roots
    assert roots[f"file://{server.empty_root}"]["runs"] == []
    runs = {r["run_id"]: r for r in roots[str(server.output)]["runs"]}
    stop, passed = runs[_stored_id(STOP_RUN)], runs[_stored_id(PASS_RUN)]
    assert (stop["verdict"], stop["pilot_verdict"], stop["final_verdict"], stop["max_tokens"]) == ("stop", "stop", None, 4096)
    assert (passed["verdict"], passed["pilot_verdict"], passed["max_tokens"]) == ("pass", "pass", 8192)
    assert passed["rows"] == 300 and 0 < passed["truncation_rate"] < 0.05
    assert 0.2 < stop["truncation_rate"] < 0.3
    assert stop["created"] < passed["created"]
    # Where the run's tokens went, from its report: generated per token kept, as the run list shows it.
    account = passed["token_account"]
    assert account["generated"] >= account["kept"] > 0
    assert account["generated_per_kept"] == round(account["generated"] / account["kept"], 4)
    page = _get(server.url + "/tracegen/", headers=server.auth).text
    assert "tokens generated / kept" in page and f">{account['generated_per_kept']:.2f}<" in page
    # And what prefill cost: the prompt tokens sent, found cached and computed, in the cell's title.
    from tracegen.audit.token_account import prefill_line

    assert account["prefill"]["rows"] > 0 and html.escape(prefill_line(account)) in page
    assert runs[BROKEN_RUN]["problem"].startswith("report.json is not valid JSON")
    # Newest first.
    assert [r["run_id"] for r in roots[str(server.output)]["runs"]][:3] == [
        _stored_id(GATE_STOP_RUN), _stored_id(PASS_RUN), _stored_id(STOP_RUN)]


def test_report_files_are_served_as_stored(server: Server) -> None:
    listing = _get(server.url + "/tracegen/runs.json", headers=server.auth).json()
    key = next(r["key"] for r in listing["roots"] if r["uri"] == str(server.output))
    run_dir = server.output / "runs" / _stored_id(PASS_RUN)
    base = f"{server.url}/tracegen/roots/{key}/runs/{_stored_id(PASS_RUN)}"
    resp = _get(f"{base}/report.json", headers=server.auth)
    assert resp.status_code == 200 and resp.json() == json.loads((run_dir / "report.json").read_text())
    resp = _get(f"{base}/pilot-report.html", headers=server.auth)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    assert "script-src" not in resp.headers["content-security-policy"]  # default-src 'none' forbids scripts
    assert "report.html</a>" in resp.text  # the navigation bar links the run's other files
    # The page frames the stored file, which is served byte for byte at raw/<name>, sandboxed.
    assert f'src="/tracegen/roots/{key}/runs/{_stored_id(PASS_RUN)}/raw/pilot-report.html"' in resp.text
    raw = _get(f"{base}/raw/pilot-report.html", headers=server.auth)
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/html")
    assert raw.content == (run_dir / "pilot-report.html").read_bytes()
    assert "sandbox" in raw.headers["content-security-policy"]


def test_dag_run_link_finds_the_report_from_airflows_run_id(server: Server) -> None:
    # The UI substitutes {RUN_ID} URL-encoded; the page maps it to the sanitised stored id.
    resp = _get(f"{server.url}/tracegen/runs/{httpx.URL(PASS_RUN).raw_path.decode()}",
                     headers=server.auth, params={"dag_id": "tracegen_generate"})
    assert resp.status_code == 200
    framed = _get(server.url + _frame_src(resp.text), headers=server.auth)
    assert framed.status_code == 200 and "8192" in framed.text and "<svg" in framed.text
    # A run the gate stopped has only its pilot report: that is what the tab shows.
    resp = _get(f"{server.url}/tracegen/runs/{STOP_RUN}", headers=server.auth)
    assert resp.status_code == 200 and _frame_src(resp.text).endswith("/raw/pilot-report.html")
    framed = _get(server.url + _frame_src(resp.text), headers=server.auth)
    assert framed.text == (server.output / "runs" / _stored_id(STOP_RUN) / "pilot-report.html").read_text()
    assert "STOP" in framed.text.upper()


def _frame_src(page: str) -> str:
    """The stored report an app page frames (its raw URL)."""
    import re

    match = re.search(r'<iframe sandbox="" title="[^"]*" src="([^"]+)"', page)
    assert match, page[:500]
    return match.group(1)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/tracegen/runs/scheduled__2020-01-01T00:00:00+00:00?dag_id=other_dag", "no tracegen report for run"),
        ("/tracegen/runs/%2E%2E", "invalid run id"),
        ("/tracegen/runs/%2E%2E%2F%2E%2E%2Fdataset.json", "no tracegen page at"),
        ("/tracegen/roots/000000000000/runs/x/report.html", "no known output root"),
        ("/tracegen/roots/..%2F..%2Fetc/runs/x/report.html", "no tracegen page at"),
        ("/tracegen/roots/ROOT/runs/x/report.html", "invalid output root key"),
        ("/tracegen/roots/{key}/runs/{run}/run.json", "no such report file"),
        ("/tracegen/roots/{key}/runs/{run}/..%2F..%2Fdataset.json", "no tracegen page at"),
        ("/tracegen/roots/{key}/runs/{run}/%2E%2E", "no such report file"),
        ("/tracegen/roots/{key}/runs/.hidden/report.json", "invalid run id"),
        ("/tracegen/roots/{key}/runs/never_ran/report.html", "has no report.html"),
    ],
)
def test_bad_paths_are_clear_404s(server: Server, path: str, message: str) -> None:
    listing = _get(server.url + "/tracegen/runs.json", headers=server.auth).json()
    key = next(r["key"] for r in listing["roots"] if r["uri"] == str(server.output))
    url = server.url + path.format(key=key, run=_stored_id(PASS_RUN))
    resp = _get(url, headers=server.auth)
    assert resp.status_code == 404, (url, resp.status_code, resp.text[:300])
    assert message in resp.json()["detail"]
    if url.endswith(".json"):
        return  # a .json URL answers in JSON whatever the Accept header says
    html_resp = _get(url, headers={**server.auth, "Accept": "text/html"})
    assert html_resp.status_code == 404 and message in html_resp.text and "<h1>404</h1>" in html_resp.text


def test_plugin_registers_the_app_and_the_views(server: Server) -> None:
    resp = _get(f"{server.url}/api/v2/plugins", headers=server.auth)
    plugin = next(p for p in resp.json()["plugins"] if p["name"] == "tracegen_review")
    assert [a["url_prefix"] for a in plugin["fastapi_apps"]] == ["/tracegen"]
    views = {v["destination"]: v for v in plugin["external_views"]}
    assert views["nav"]["href"] == "/tracegen/"
    assert views["dag_run"]["href"].startswith("/tracegen/runs/{RUN_ID}") and views["dag_run"]["url_route"]


# ---- the trigger form's params (REST) -------------------------------------------------------------


def test_trigger_params_carry_titles_and_invalid_values_are_rejected(server: Server) -> None:
    resp = _get(f"{server.url}/api/v2/dags/tracegen_generate/details", headers=server.auth)
    assert resp.status_code == 200, resp.text
    params = resp.json()["params"]
    assert params["max_tokens"]["schema"]["title"] == "Max tokens (completion cap)"
    assert all(p["schema"].get("title") and p.get("description") for p in params.values())
    for bad in (0, "lots"):
        resp = _post(f"{server.url}/api/v2/dags/tracegen_generate/dagRuns", headers=server.auth,
                          json={"logical_date": None, "conf": {"max_tokens": bad}})
        assert resp.status_code == 400, (bad, resp.status_code, resp.text[:300])
        assert "max_tokens" in resp.text
    runs = _get(f"{server.url}/api/v2/dags/tracegen_generate/dagRuns", headers=server.auth).json()
    assert not [r for r in runs["dag_runs"] if r["conf"].get("max_tokens") in (0, "lots")]


# ---- in the browser ---------------------------------------------------------------------------------


def _login(browser: Browser, server: Server) -> None:
    browser.set_cookie(server.url + "/", "_token", server.token)


def _open_frame(browser: Browser, server: Server) -> str:
    """Open the stored report the current page frames, at its own (raw, sandboxed) URL: its text is not
    readable through the page, whose frame has an opaque origin. Returns the app page's URL."""
    page = browser.url()
    src = browser.eval("document.querySelector('iframe[sandbox]').getAttribute('src')")
    assert "/raw/" in src, src
    browser.goto(server.url + src)
    return page


def test_browser_without_login_lands_on_the_login_page(server: Server, browser: Browser) -> None:
    browser.clear_cookies()
    browser.goto(f"{server.url}/tracegen/")
    browser.wait_for("location.pathname.startsWith('/auth/login')")
    assert "tracegen reports" not in browser.text()


def test_browser_renders_run_list_and_report(server: Server, browser: Browser) -> None:
    _login(browser, server)
    browser.goto(f"{server.url}/tracegen/")
    text = browser.text()
    assert "tracegen reports" in text and _stored_id(STOP_RUN) in text and "No runs yet." in text
    assert browser.eval("document.querySelectorAll('span.badge.stop').length") >= 1
    assert browser.eval("document.querySelectorAll('span.badge.pass').length") >= 1
    # Follow the list's link to the passing run's final report, as a reviewer would.
    browser.eval("[...document.querySelectorAll('a')].find(a => a.href.includes('"
                 + _stored_id(PASS_RUN) + "/report.html')).click()")
    browser.wait_for("location.pathname.endsWith('/report.html') && document.readyState === 'complete'")
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    journey_shot(browser, "6-report-page")  # the bar and the framed report
    _open_frame(browser, server)
    journey_shot(browser, "6-report-raw")  # the stored report on its own fits the window too
    text = browser.text()
    assert "PASS" in text.upper() and "8192" in text.replace(",", "")
    assert browser.eval("document.querySelectorAll('svg').length") >= 2  # the inline plots
    # Hostile-looking model text is shown as text, never as markup.
    assert browser.eval("document.querySelectorAll('main b, body > b').length") == 0 or "<b>tests</b>" in text
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    shot = browser.screenshot(SCREENSHOT_DIR / "review-report.png")
    assert shot.stat().st_size > 10_000
    browser.goto(f"{server.url}/tracegen/")
    browser.screenshot(SCREENSHOT_DIR / "review-list.png")


MAX_TOKENS_FIELD = "input[name=element_max_tokens]"
DIALOG_TEXT = "[...document.querySelectorAll('[role=dialog]')].map(d => d.innerText).join('\\n')"


def _open_trigger_form(browser: Browser, server: Server) -> None:
    _login(browser, server)
    browser.goto(f"{server.url}/dags/tracegen_generate")
    browser.wait_for("[...document.querySelectorAll('button')].some(b => /trigger/i.test(b.innerText))", 60)
    browser.eval("[...document.querySelectorAll('button')].find(b => /trigger/i.test(b.innerText)).click()")
    browser.wait_for(f"!!document.querySelector({json.dumps(MAX_TOKENS_FIELD)})", 30)


TRIGGER_BUTTON = "[data-testid=trigger-dag-submit]"  # the dialog's submit button
TRIGGER_BUTTON_STATE = f"(b => b ? (b.disabled ? 'disabled' : 'enabled') : 'missing')(document.querySelector('{TRIGGER_BUTTON}'))"


def _dag_runs(server: Server) -> list[dict]:
    resp = _get(f"{server.url}/api/v2/dags/tracegen_generate/dagRuns", headers=server.auth)
    assert resp.status_code == 200, resp.text
    return resp.json()["dag_runs"]


def test_browser_trigger_form_shows_the_params_with_titles(server: Server, browser: Browser) -> None:
    _open_trigger_form(browser, server)
    browser.wait_for("document.body.innerText.includes('Max tokens (completion cap)')", 30)
    text = browser.text()
    for title in ("Max tokens (completion cap)", "Output root", "Dataset", "Pilot size", "Truncation threshold",
                  "Rows truncated under a lower cap"):
        assert title in text, title
    assert browser.eval(f"document.querySelector({json.dumps(MAX_TOKENS_FIELD)}).value") == "4096"
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    journey_shot(browser, "1-trigger-form")


def test_browser_trigger_form_refuses_invalid_max_tokens_and_sends_a_typed_valid_one(
    server: Server, browser: Browser
) -> None:
    """Typed with real keyboard events (React sees them): what the form does with each kind of bad value."""
    before = {r["dag_run_id"] for r in _dag_runs(server)}
    _open_trigger_form(browser, server)
    field = json.dumps(MAX_TOKENS_FIELD)
    value = f"document.querySelector({field}).value"
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)

    # Letters: the number input drops them, the emptied required field shows an inline error, Trigger is off.
    browser.type_into(MAX_TOKENS_FIELD, "lots")
    browser.wait_for(f"document.querySelector({field}).getAttribute('aria-invalid') === 'true'")
    assert browser.eval(value) == ""
    assert "This field is required" in browser.eval(DIALOG_TEXT)
    assert browser.eval(TRIGGER_BUTTON_STATE) == "disabled"
    browser.screenshot(SCREENSHOT_DIR / "trigger-form-required.png")
    browser.click(TRIGGER_BUTTON)  # a disabled button: nothing may be sent

    # Out of range: 0, -5 and 10,000,000 stay as typed (the bounds are not where the number input clamps), and
    # Airflow refuses each when Trigger is clicked, naming the bound, in the dialog: no run is created.
    for typed, says in (("0", "0 is less than the minimum of 1"), ("-5", "-5 is less than the minimum of 1"),
                        ("10000000", "10000000 is greater than the maximum of 1048576")):
        if typed.startswith("-"):
            # Typed left to right, the lone "-" is not a number and the field drops it: type the digits, then
            # put the sign in front of them, as a person correcting the field would.
            browser.type_into(MAX_TOKENS_FIELD, typed[1:])
            browser.key("ArrowLeft", "ArrowLeft", 37, commands=["moveLeft"])  # Home would set the field to its minimum
            browser.call("Input.dispatchKeyEvent", type="keyDown", key="-", text="-", unmodifiedText="-")
            browser.call("Input.dispatchKeyEvent", type="keyUp", key="-")
        else:
            browser.type_into(MAX_TOKENS_FIELD, typed)
        browser.wait_for(f"{value} === {json.dumps(typed)}", 5)
        browser.key("Tab", "Tab", 9)
        time.sleep(0.3)
        assert browser.eval(value) == typed, f"the form changed {typed} to {browser.eval(value)}"
        assert browser.eval(TRIGGER_BUTTON_STATE) == "enabled"
        browser.click(TRIGGER_BUTTON)
        error = browser.wait_for(f"(t => t.includes({json.dumps(says)}) && t)({DIALOG_TEXT})")
        assert "Invalid input for param max_tokens" in error, error
    browser.center_of(MAX_TOKENS_FIELD)
    browser.screenshot(SCREENSHOT_DIR / "trigger-form-out-of-range.png")

    # 1.5 is not an integer: the REST call the form makes is refused and the error is shown.
    browser.type_into(MAX_TOKENS_FIELD, "1.5")
    browser.wait_for(f"{value} === '1.5'", 5)
    assert browser.eval(TRIGGER_BUTTON_STATE) == "enabled"
    browser.click(TRIGGER_BUTTON)
    error = browser.wait_for(f"(t => t.includes(\"1.5 is not of type 'integer'\") && t)({DIALOG_TEXT})")
    assert "400 Bad Request" in error and "Invalid input for param max_tokens" in error
    assert browser.eval(value) == "1.5"  # the dialog stays open with the value for the reviewer to fix
    browser.center_of(MAX_TOKENS_FIELD)  # scroll the error (just above the params) into the screenshot
    browser.screenshot(SCREENSHOT_DIR / "trigger-form-rejected.png")
    assert {r["dag_run_id"] for r in _dag_runs(server)} == before, "an invalid max_tokens created a dag run"

    # A valid typed value goes through the same form path and lands in the run's conf.
    browser.type_into(MAX_TOKENS_FIELD, "8192")
    browser.wait_for(f"{value} === '8192'", 5)
    assert browser.eval(TRIGGER_BUTTON_STATE) == "enabled"
    browser.click(TRIGGER_BUTTON)
    deadline = time.monotonic() + TIMEOUT
    while not (new := [r for r in _dag_runs(server) if r["dag_run_id"] not in before]):
        assert time.monotonic() < deadline, f"no dag run after triggering max_tokens=8192: {browser.eval(DIALOG_TEXT)}"
        time.sleep(0.3)
    assert len(new) == 1, new  # exactly one: none of the refused attempts above created a run
    conf = new[0]["conf"]
    assert conf["max_tokens"] == 8192 and isinstance(conf["max_tokens"], int), conf
    details = _get(f"{server.url}/api/v2/dags/tracegen_generate/details", headers=server.auth).json()
    defaults = {name: p["value"] for name, p in details["params"].items()}
    assert conf == {**defaults, "max_tokens": 8192}, conf  # the untouched fields keep their defaults


# ---- the reviewer's journey and what a planted report can do -----------------------------------------

GONE_RUN = "manual__2026-01-02T14:00:00.000000+00:00"  # prepared, then its output root was removed
LIVE_RUN = "manual__2026-01-02T15:00:00.000000+00:00"  # generating: the progress view


def _key(uri: str) -> str:
    from tracegen.review.roots import root_key

    return root_key(uri)


def _quoted(raw: str) -> str:
    return urllib.parse.quote(raw, safe="")


def _trigger_run(server: Server, raw: str, conf: dict) -> dict:
    """A DAG run in Airflow's metadata DB with this id and conf (nothing runs it: no scheduler here)."""
    resp = _post(f"{server.url}/api/v2/dags/tracegen_generate/dagRuns", headers=server.auth,
                 json={"dag_run_id": raw, "logical_date": None, "conf": conf})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_served_reports_carry_a_csp_that_forbids_forms_base_framing_and_sandboxes_them(server: Server) -> None:
    url = f"{server.url}/tracegen/roots/{_key(str(server.output))}/runs/{PLANTED_RUN}/raw/report.html"
    csp = _get(url, headers=server.auth).headers["content-security-policy"]
    for directive in ("default-src 'none'", "form-action 'none'", "base-uri 'none'", "frame-ancestors 'self'",
                      "sandbox"):
        assert directive in csp, (directive, csp)
    assert "allow-" not in csp  # no sandbox exception: no scripts, forms, popups or top navigation
    # The app's own pages: the same rules but the sandbox (the progress page refreshes itself); the page
    # showing a stored report frames it (same origin only), sandboxed by the frame and by its own CSP.
    own = _get(f"{server.url}/tracegen/", headers=server.auth).headers["content-security-policy"]
    assert "form-action 'none'" in own and "frame-ancestors 'self'" in own and "sandbox" not in own
    shown = _get(url.replace("/raw/", "/"), headers=server.auth)
    assert "frame-src 'self'" in shown.headers["content-security-policy"] and "sandbox" not in own
    assert _frame_src(shown.text).endswith(f"/runs/{PLANTED_RUN}/raw/report.html")


def test_browser_a_planted_form_and_meta_refresh_do_nothing(server: Server, browser: Browser) -> None:
    """A report.html written into the output root by hand, with a form posting to the Airflow origin, a
    meta refresh and a <base>: served, shown, and inert."""
    _login(browser, server)
    url = f"{server.url}/tracegen/roots/{_key(str(server.output))}/runs/{PLANTED_RUN}/raw/report.html"
    browser.goto(url)
    assert "planted report" in browser.text()
    time.sleep(3)  # the planted refresh asked for 1 s
    assert browser.url() == url, "the planted meta refresh navigated"
    browser.click("#go")  # a person clicking the planted button
    time.sleep(3)
    assert browser.url() == url, "the planted form was submitted"
    assert "planted" not in browser.eval("location.search")


def test_a_user_without_read_access_to_the_dag_reads_no_report(server: Server) -> None:
    outsider = {"Authorization": f"Bearer {server.outsider_token}"}
    # The outsider may see plugin views (viewer role) but not the DAG the reports belong to.
    assert _get(f"{server.url}/api/v2/plugins", headers=outsider).status_code == 200
    assert _get(f"{server.url}/api/v2/dags/tracegen_generate", headers=outsider).status_code == 403
    key, run = _key(str(server.output)), _stored_id(PASS_RUN)
    for path in ("/tracegen/", "/tracegen/runs.json", f"/tracegen/runs/{_quoted(PASS_RUN)}",
                 f"/tracegen/roots/{key}/runs/{run}/report.html", f"/tracegen/roots/{key}/runs/{run}/report.json",
                 f"/tracegen/roots/{key}/runs/{run}/progress"):
        resp = _get(server.url + path, headers={**outsider, "Accept": "application/json"})
        assert resp.status_code == 403, (path, resp.status_code, resp.text[:200])
        assert _get(server.url + path, headers=server.auth).status_code == 200, path


def test_browser_a_run_stopped_by_the_gate_shows_the_report_that_decided_and_the_next_run(
    server: Server, browser: Browser
) -> None:
    conf = {"max_tokens": 4096, "gate_mode": "stop", "output_uri": str(server.output), "pilot_size": 100}
    _trigger_run(server, GATE_STOP_RUN, conf)
    run_dir = server.output / "runs" / _stored_id(GATE_STOP_RUN)
    assert (run_dir / "report.html").exists()  # the final audit exists, but it is not what decided
    pilot = json.loads((run_dir / "pilot-report.json").read_text())
    rec = pilot["cap_table"]["recommended_cap"]
    assert rec is not None
    _login(browser, server)
    browser.goto(f"{server.url}/tracegen/runs/{_quoted(GATE_STOP_RUN)}?dag_id=tracegen_generate")
    text = browser.text()
    assert "Stopped by the gate." in text and "This is the report that decided (pilot-report.html)" in text
    # The next run one step away: the same settings at the recommended cap.
    assert f"max_tokens={rec:,}" in text
    assert json.dumps({**conf, "max_tokens": rec}, sort_keys=True) in text
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    journey_shot(browser, "5-stopped-by-gate")
    _open_frame(browser, server)
    text = browser.text()
    assert "pilot-report" in text.split("Run\n", 1)[-1]  # the Run table at the bottom names the pilot audit
    # The run list says so too.
    browser.goto(f"{server.url}/tracegen/")
    row = browser.eval(f"[...document.querySelectorAll('tr')].map(r => r.innerText)"
                       f".find(t => t.includes('{_stored_id(GATE_STOP_RUN)}'))")
    assert "stopped by the gate" in row and "pilot-report.html (decided)" in row and f"{rec:,}" in row
    # Each run links back to its page in Airflow.
    hrefs = browser.eval("[...document.querySelectorAll('a')].map(a => a.getAttribute('href'))")
    assert f"/dags/tracegen_generate/runs/{_quoted(GATE_STOP_RUN)}" in hrefs


TAB = "document.querySelector('iframe[title=\"tracegen report\"]')"  # the UI's frame of the run's tab
TAB_DOC = f"({TAB} && {TAB}.contentDocument)"


def _ensure_run(server: Server, raw: str, conf: dict) -> None:
    if _get(f"{server.url}/api/v2/dags/tracegen_generate/dagRuns/{_quoted(raw)}", headers=server.auth).status_code != 200:
        _trigger_run(server, raw, conf)


def test_browser_every_link_in_the_run_tab_lands_on_its_page(server: Server, browser: Browser) -> None:
    """Inside the Airflow UI's "tracegen report" tab, each link of the bar opens its
    page with the reviewer's session (a 200 page, never the login page or "Not authenticated"), and no
    link opens Airflow inside the tab."""
    _ensure_run(server, GATE_STOP_RUN, {"max_tokens": 4096, "gate_mode": "stop", "output_uri": str(server.output),
                                        "pilot_size": 100})
    _login(browser, server)
    tab = f"{server.url}/dags/tracegen_generate/runs/{_quoted(GATE_STOP_RUN)}/plugin/tracegen-run-report"
    ready = f"{TAB_DOC} && {TAB_DOC}.readyState === 'complete' && {TAB_DOC}.querySelector('nav') && {TAB_DOC}.body.innerText"
    browser.goto(tab)
    assert "Stopped by the gate." in browser.wait_for(ready, 60)
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    journey_shot(browser, "5-run-tab-stopped")
    # Airflow's own pages are named, not linked, inside the tab (the UI's frame may not leave itself).
    assert browser.eval(f"[...{TAB_DOC}.querySelectorAll('a')].filter(a => a.getAttribute('href').startsWith('/dags/')).length") == 0
    assert "/dags/tracegen_generate" in browser.eval(f"{TAB_DOC}.body.innerText")
    links = browser.eval(f"[...{TAB_DOC}.querySelectorAll('nav a')].map(a => a.innerText)")
    assert {"all runs", "progress", "report.html", "report.json", "pilot-report.json"} <= set(links), links
    for text in links:
        browser.goto(tab)
        browser.wait_for(ready, 60)
        browser.eval(f"[...{TAB_DOC}.querySelectorAll('nav a')].find(a => a.innerText === {json.dumps(text)}).click()")
        landed = browser.wait_for(
            f"{TAB_DOC} && {TAB}.contentWindow.location.pathname !== '/tracegen/runs/{_quoted(GATE_STOP_RUN)}' && "
            f"{TAB_DOC}.readyState === 'complete' && [{TAB}.contentWindow.location.pathname, "
            f"performance.getEntriesByType && {TAB}.contentWindow.performance.getEntriesByType('navigation')[0].responseStatus, "
            f"{TAB_DOC}.body.innerText]", 60)
        path, status, body = landed
        assert status == 200, (text, path, status, body[:300])
        assert path.startswith("/tracegen/") and "Not authenticated" not in body and "Sign in" not in body, (text, path)
        if text.endswith(".json"):
            assert json.loads(body), (text, body[:300])
    browser.goto(tab)
    browser.wait_for(ready, 60)


def test_browser_a_run_in_a_root_named_only_by_its_conf_is_listed_and_its_tab_shows_the_question(
    server: Server, browser: Browser
) -> None:
    other = server.tmp / "conf-only-root"  # not the default root, not in tracegen_output_roots
    output_root, stored = make_run(other, ASKING_RUN, 4096, range(200), 4, ("pilot-report",), 3)
    output_root.run_files.put(stored, "question.json", b"{}")
    _trigger_run(server, ASKING_RUN, {"output_uri": str(other), "max_tokens": 4096})
    listing = _get(server.url + "/tracegen/runs.json", headers=server.auth).json()
    roots = {r["uri"]: r for r in listing["roots"]}
    assert [r["run_id"] for r in roots[str(other)]["runs"]] == [stored]
    assert roots[str(other)]["runs"][0]["stage"] == "waiting for the reviewer's answer"
    _login(browser, server)
    browser.goto(f"{server.url}/tracegen/runs/{_quoted(ASKING_RUN)}?dag_id=tracegen_generate")
    text = browser.text()
    assert "Waiting for the reviewer's answer." in text and "pilot-report.html" in text
    link = browser.eval("[...document.querySelectorAll('a')].map(a => a.getAttribute('href'))"
                        ".find(h => h.endsWith('/required_actions'))")
    assert link == f"/dags/tracegen_generate/runs/{_quoted(ASKING_RUN)}/tasks/review_cap/required_actions"


def test_conf_output_root_is_data_checked_by_the_uri_rule() -> None:
    from tracegen.review.access import conf_output_root

    assert conf_output_root({"output_uri": "/data/out", "aws_conn_id": "someone_elses"}) == ("/data/out", None)
    assert conf_output_root({"output_uri": "s3://bucket/prefix"}) == ("s3://bucket/prefix", None)
    for bad in ("relative/path", "http://evil/x", "", 7):
        root, problem = conf_output_root({"output_uri": bad})
        assert root is None and "refuse" in problem, bad
    assert conf_output_root({"max_tokens": 1}) == (None, None)


def test_a_run_whose_output_is_gone_says_so(server: Server) -> None:
    gone = server.tmp / "gone-root"
    _trigger_run(server, GONE_RUN, {"output_uri": str(gone)})
    resp = _get(f"{server.url}/tracegen/runs/{_quoted(GONE_RUN)}", headers=server.auth)
    assert resp.status_code == 404 and "never" not in resp.json()["detail"]
    # Queued, not prepared: neither a claim that it was, nor that it failed.
    assert "is queued and has not written its record yet" in resp.json()["detail"]
    assert "failed" not in resp.json()["detail"]
    # Its first task finished, so it wrote its record there; the root is gone since.
    resp = httpx.patch(f"{server.url}/api/v2/dags/tracegen_generate/dagRuns/{_quoted(GONE_RUN)}/taskInstances/"
                       "prepare_run", headers=server.auth, json={"new_state": "success"}, timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    resp = _get(f"{server.url}/tracegen/runs/{_quoted(GONE_RUN)}", headers=server.auth)
    assert resp.status_code == 404
    detail = resp.json()["detail"]
    assert f"the output of run {GONE_RUN!r}" in detail and "is gone" in detail and str(gone) in detail


def test_browser_a_finished_report_says_what_to_do_next_and_what_each_count_counts(
    server: Server, browser: Browser
) -> None:
    _login(browser, server)
    browser.goto(f"{server.url}/tracegen/runs/{_quoted(PASS_RUN)}")
    text = browser.text()
    assert "Finished. Next: export the dataset: python -m tracegen export " + str(server.output) in text
    journey_shot(browser, "6-finished")
    _open_frame(browser, server)
    text = browser.text()
    assert "proceed with generation" not in text  # the gate's advice is for a run still to generate
    assert "this is the final audit of a finished run" in text
    report = json.loads((server.output / "runs" / _stored_id(PASS_RUN) / "report.json").read_text())
    tr = report["audit"]["truncation"]
    assert (f"still truncated, of all completed rows (each index's current row, any cap)\t{tr['truncated']:,} of "
            f"{tr['ok_rows']:,}") in text
    assert "truncated, of the rows generated at max_tokens=8,192 (this cap only)" in text
    # The cost columns: every option's ETA, GPU time and tokens left differ at this (small) scale.
    table = browser.eval("""(() => { const h = [...document.querySelectorAll('h2')].find(e => e.innerText === 'Cap table');
        let t = h.nextElementSibling; while (t && t.tagName !== 'TABLE') t = t.nextElementSibling;
        return [...t.querySelectorAll('tr')].map(r => [...r.children].map(c => c.innerText)); })()""")
    header, rows = table[0], table[1:]
    left = next(h for h in header if h.startswith("tokens for the"))
    cap_rows = report["cap_table"]["rows"]
    remaining = report["cap_table"]["throughput"]["rows_remaining"]
    for column, key in ((left, None), ("ETA", "eta_hours"), ("GPU time", "gpu_hours")):
        shown = [r[header.index(column)] for r in rows]
        exact = [c["expected_tokens_per_row"] * remaining if key is None else c[key] for c in cap_rows]
        for i in range(len(exact)):
            for j in range(i):
                if abs(exact[i] - exact[j]) > 0.01 * max(exact[i], exact[j]):  # options that differ read differently
                    assert shown[i] != shown[j], (column, shown, exact)
    assert all(r[header.index("GPU time")].endswith("GPU-h") for r in rows)


def test_browser_progress_of_a_running_run_refreshes_by_itself(server: Server, browser: Browser) -> None:
    from tracegen.run.run_record import read_run_record
    from tracegen.status import run_progress

    live = server.tmp / "live-root"
    output_root, stored = make_run(live, LIVE_RUN, 8192, range(100), 20, (), 5)
    _trigger_run(server, LIVE_RUN, {"output_uri": str(live), "max_tokens": 8192})  # queued: not over
    _login(browser, server)
    browser.goto(f"{server.url}/tracegen/runs/{_quoted(LIVE_RUN)}?dag_id=tracegen_generate")
    browser.wait_for("location.pathname.endsWith('/progress')")  # the tab of a running run: its progress
    expected = run_progress(output_root, read_run_record(output_root, stored))
    text = browser.text()
    assert f"{expected['done']:,} of 400 dataset rows" in text and "rows/s" in text and "idle" not in text
    from tracegen.audit.figures import AT_CAP, STILL, figure, figures_from_ledger

    figures = figures_from_ledger(output_root.snapshots.frame(), 8192)
    assert f"{AT_CAP}\t{figure(*figures[AT_CAP])}; 95% interval" in text, text
    assert f"{STILL}\t{figure(*figures[STILL])}" in text and "completion tokens/s" in text
    assert browser.eval("document.querySelector('meta[http-equiv=refresh]').content") == "5"
    # The mid-run pivot is one trigger away, naming the run as Airflow knows it.
    assert (f"trigger tracegen_raise_cap with run_id {LIVE_RUN}" in text and "above 8,192" in text), text
    key = _key(str(live))
    doc = _get(f"{server.url}/tracegen/roots/{key}/runs/{stored}/progress.json", headers=server.auth).json()
    assert (doc["done"], doc["left"], doc["live"], doc["state"]) == (expected["done"], 400 - expected["done"],
                                                                    True, "queued")
    assert doc["rows_per_s"] > 0 and doc["tokens_per_s"] > 0 and doc["eta_s"] > 0
    assert doc["truncation_low"] <= doc["truncation_rate"] <= doc["truncation_high"]
    # More rows committed: the open page shows them without anyone reloading it.
    output_root.commits.commit(_rows(stored, 8192, range(100, 200), 20), stored, 99999, "c1")
    now = run_progress(output_root, read_run_record(output_root, stored))["done"]
    browser.wait_for(f"document.body.innerText.includes('{now:,} of 400 dataset rows')", 30)
    journey_shot(browser, "3-progress")
    # The bar and the run over its time, with the figures `python -m tracegen status --json` prints.
    status = _status_json(live)
    bar = browser.eval("(b => b && [b.getAttribute('aria-valuenow'), b.getAttribute('aria-valuemax'), "
                       "b.querySelector('rect.done').getAttribute('width')])"
                       "(document.querySelector('#progress-bar [role=progressbar]'))")
    assert bar[:2] == [str(status["done"]), str(status["total"])] and float(bar[2]) > 0, (bar, status)
    assert f"{status['done']:,} of {status['total']:,} dataset rows" in browser.text()
    doc = _get(f"{server.url}/tracegen/roots/{key}/runs/{stored}/progress.json", headers=server.auth).json()
    assert (doc["done"], doc["total"], doc["left"], doc["truncation_figures"]) == (
        status["done"], status["total"], status["left"], status["truncation_figures"])
    charts = browser.eval("Object.fromEntries([...document.querySelectorAll('figure[id^=chart-]')].map(f => [f.id, "
                          "[f.querySelectorAll('svg').length, f.querySelectorAll('polyline.series, rect').length, "
                          "f.innerText]]))")
    assert set(charts) == {f"chart-{c}" for c in ("rows", "tokens", "truncation", "loops", "servers")}, charts
    assert all(n_svg == 1 and marks > 0 for name, (n_svg, marks, _) in charts.items() if name != "chart-loops"), charts
    assert browser.eval("!!document.querySelector('#chart-truncation polygon.band') && "
                        "!!document.querySelector('#chart-truncation line.threshold')")
    from tracegen.audit.formats import pct

    assert f"truncated: {pct(doc['truncation_rate'], 0)}" in charts["chart-truncation"][2], charts
    assert "127.0.0.1:30000" in charts["chart-servers"][2] and doc["timeline"]["bins"] >= 2, charts
    browser.eval("document.querySelector('#chart-truncation').scrollIntoView()")
    journey_shot(browser, "3-progress-charts")


def _status_json(root: Path) -> dict:
    """`python -m tracegen status ROOT --json`, as a shell runs it (in this process: the same code)."""
    import contextlib
    import io

    from tracegen.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["status", str(root), "--json"]) == 0
    return json.loads(out.getvalue())


LINKED_RUN = "manual__2026-01-02T18:00:00.000000+00:00"  # triggered into the output root through a symlink
QUEUED_ONLY_RUN = "manual__2026-01-02T19:00:00.000000+00:00"  # known to Airflow, nothing written


def test_the_run_list_is_newest_first_lists_every_state_and_each_root_once(server: Server, browser: Browser) -> None:
    """A root named through a symlink is the same root (listed once, its runs once);
    a run Airflow knows that wrote nothing yet is listed with its state; one list, newest first."""
    link = server.tmp / "output-link"
    if not link.exists():
        link.symlink_to(server.output, target_is_directory=True)
    _ensure_run(server, LINKED_RUN, {"output_uri": str(link)})
    _ensure_run(server, QUEUED_ONLY_RUN, {"output_uri": str(server.tmp / "not-yet")})
    listing = _get(server.url + "/tracegen/runs.json", headers=server.auth).json()
    uris = [r["uri"] for r in listing["roots"]]
    assert str(server.output) in uris and str(link) not in uris, uris
    _login(browser, server)
    browser.goto(f"{server.url}/tracegen/")
    rows = browser.eval("[...document.querySelectorAll('tr')].slice(1).map(r => r.innerText.split('\\t'))")
    ids = [r[0] for r in rows]
    assert len(ids) == len(set(ids)), ids  # each run once
    assert ids.count(_stored_id(STOP_RUN)) == 1
    queued = next(r for r in rows if r[0] == _stored_id(QUEUED_ONLY_RUN))
    assert queued[3] == "queued" and "nothing written yet" in queued[-1], queued
    created = [r[1] for r in rows if r[1] != "–"]
    assert created == sorted(created, reverse=True), created  # newest first, across roots
    # A long id may be cut to fit the window (journey_shot checks the width); hovering it shows it whole.
    cut = browser.eval("[...document.querySelectorAll('td.id')].filter(td => td.title !== td.innerText.trim())"
                       ".map(td => td.outerHTML)")
    assert cut == [], cut
    journey_shot(browser, "7-run-list")


STOPPED_BY_REVIEWER_RUN = "manual__2026-01-02T20:00:00.000000+00:00"
CONTINUED_RUN = "manual__2026-01-02T21:00:00.000000+00:00"


def _decided(server: Server, raw: str, n: int, cap: int | None) -> str:
    """An asked run (gate_mode=ask, pilot at stop) whose reviewer answered: stop, or continue at `cap`."""
    root = server.tmp / f"decided-{n}"
    output_root, stored = make_run(root, raw, 4096, range(200), 4, ("pilot-report",), n)
    doc = json.loads(output_root.run_files.get(stored, "run.json"))
    doc["decisions"] = [{"trigger": "pilot", "option": "Stop the run" if cap is None else f"Continue at {cap:,}",
                         "kind": "stop" if cap is None else "recommended", "from_cap": 4096, "cap": cap,
                         "responded_by": "reviewer", "responded_at": "2026-01-02T20:05:00+00:00", "timed_out": False,
                         "verdict": {}, "cap_rows": [], "report_uri": "x"}]
    output_root.run_files.put(stored, "run.json", json.dumps(doc).encode())
    output_root.run_files.put(stored, "question.json", b"{}")
    _ensure_run(server, raw, {"output_uri": str(root)})
    return stored


def test_a_decided_run_says_who_decided_and_when(server: Server, browser: Browser) -> None:
    """A reviewer's stop says who and when; a stop answered by continuing is no red pill."""
    stopped = _decided(server, STOPPED_BY_REVIEWER_RUN, 8, None)
    continued = _decided(server, CONTINUED_RUN, 9, 8192)
    _login(browser, server)
    browser.goto(f"{server.url}/tracegen/runs/{_quoted(STOPPED_BY_REVIEWER_RUN)}?dag_id=tracegen_generate")
    who = "stopped by reviewer at 2026-01-02T20:05:00+00:00, answering the gate's question"
    assert f"Stopped by the gate. ({who})" in browser.text()
    browser.goto(f"{server.url}/tracegen/")
    rows = browser.eval("[...document.querySelectorAll('tr')].map(r => r.innerText)")
    assert who in next(r for r in rows if r.startswith(stopped))
    row = next(r for r in rows if r.startswith(continued))
    assert "stop, answered" in row and "continued at max_tokens=8,192 by reviewer" in row, row
    red = browser.eval(f"[...document.querySelectorAll('tr')].find(r => r.innerText.startsWith('{continued}'))"
                       ".querySelectorAll('.badge.stop').length")
    assert red == 0


FIGURES_RUN = "manual__2026-01-02T17:00:00.000000+00:00"  # asking, alone in its root


def test_each_truncation_figure_reads_the_same_in_the_report_progress_list_question_and_status(
    server: Server, browser: Browser
) -> None:
    """One run, its two truncation figures, each under its one name and with the same
    number in the report, the progress page, the run list, the gate's question and `status`."""
    from tracegen.audit.cap_question import PILOT, question_from_report
    from tracegen.audit.figures import AT_CAP, STILL, figure, figures_from_report
    from tracegen.review_gate import CapReviewOperator
    from tracegen.status import dataset_status, format_status

    root = server.tmp / "figures-root"
    # Rows that finished under a lower cap and rows cut under one: the two figures differ in count and base.
    output_root, stored = make_run(root, FIGURES_RUN, 4096, range(200), 4, (), 6)
    output_root.commits.commit(_rows(stored, 2048, range(200, 260), 3), stored, 99999, "lower")
    from tracegen.config import RunConfig
    from tracegen.run.plan import ChunkLayout
    from tracegen.run.run_report import audit_and_report
    from tracegen.run.run_spec import DatasetIdentity, FleetRef, RunSpec

    spec = RunSpec(stored, 1_767_348_000.0 + 5400 * 6, RunConfig(max_tokens=4096, dataset_uri="/data/prompts.jsonl",
                   output_uri=str(root), pilot_size=260), FleetRef("test-fleet", "0" * 64, "m", 1, None),
                   DatasetIdentity("/data/prompts.jsonl", "test-fingerprint", 400), ChunkLayout(100))
    audit_and_report(spec, name="pilot-report", indices=list(range(260)), tokens_per_s_per_gpu=900.0)
    output_root.run_files.put(stored, "question.json", b"{}")
    _ensure_run(server, FIGURES_RUN, {"output_uri": str(root), "max_tokens": 4096})
    report = json.loads((root / "runs" / stored / "pilot-report.json").read_text())
    figures = figures_from_report(report)
    assert figures[AT_CAP] != figures[STILL] and figures[AT_CAP][0] > 0 and figures[STILL][0] > 0, figures
    named = {n: f"{n}: {figure(*figures[n])}" for n in (AT_CAP, STILL)}

    # The report, as the reviewer reads it.
    _login(browser, server)
    key = _key(str(root))
    browser.goto(f"{server.url}/tracegen/roots/{key}/runs/{stored}/raw/pilot-report.html")
    text = browser.text()
    assert named[AT_CAP] in text and named[STILL] in text, text[:1500]
    # The progress page: its JSON and its rows.
    progress = _get(f"{server.url}/tracegen/roots/{key}/runs/{stored}/progress.json", headers=server.auth).json()
    assert {n: tuple(v) for n, v in progress["truncation_figures"].items()} == figures
    browser.goto(f"{server.url}/tracegen/roots/{key}/runs/{stored}/progress")
    text = browser.text()
    assert f"{AT_CAP}\t{figure(*figures[AT_CAP])}" in text and f"{STILL}\t{figure(*figures[STILL])}" in text, text
    # The run list: runs.json and its row, under columns of the same names.
    listing = _get(server.url + "/tracegen/runs.json", headers=server.auth).json()
    line = next(r for root_ in listing["roots"] for r in root_["runs"] if r["run_id"] == stored)
    assert {n: tuple(v) for n, v in line["truncation_figures"].items()} == figures
    browser.goto(f"{server.url}/tracegen/")
    headers = browser.eval("[...document.querySelectorAll('th')].map(h => h.innerText)")
    row = browser.eval(f"[...document.querySelectorAll('tr')].find(r => r.innerText.includes('{stored}'))"
                       ".innerText.split('\\t')")
    assert row[headers.index(AT_CAP)] == figure(*figures[AT_CAP]), (headers, row)
    assert row[headers.index(STILL)] == figure(*figures[STILL]), (headers, row)
    # The gate's question, as the review task poses it.
    question = question_from_report(report, run_id=stored, trigger=PILOT, max_cap=40_959, context_length=40_960,
                                    truncated_policy="extend", report_uri="file://x", report_url=None,
                                    timeout_minutes=60)
    task = CapReviewOperator(task_id="review_cap", question=question.to_json())
    task._pose()
    assert f"{AT_CAP}: **{figure(*figures[AT_CAP])}**" in task.body
    # `python -m tracegen status`.
    status = format_status(dataset_status(str(root)))
    assert f"truncated:   {named[AT_CAP]} · {named[STILL]}" in status, status


def test_task_logs_the_demo_writes_are_where_airflow_reads_them(server: Server) -> None:
    """`airflow dags test` (make demo) prints every task's log to stdout; the demo splits it into the files
    Airflow's task handler reads, so the UI of `make airflow` (same AIRFLOW_HOME) shows them."""
    from airflow.configuration import conf

    from tracegen.demo import split_task_logs, task_log_path

    raw = "manual__2026-01-02T16:00:00.000000+00:00"
    _trigger_run(server, raw, {})
    printed = "\n".join([
        "[2026-01-02 16:00:01] INFO - [DAG TEST] starting task_id=prepare_run map_index=-1",
        "[2026-01-02 16:00:02] INFO - run demo: max_tokens=4096, dataset prompts, output out, 2 GPUs",
        "[2026-01-02 16:00:03] INFO - [DAG TEST] end task task_id=prepare_run map_index=-1",
        "[2026-01-02 16:00:04] INFO - [DAG TEST] starting task_id=generate_chunk map_index=3",
        "[2026-01-02 16:00:05] INFO - chunk 0003 (rows 1,500–1,999): 500/500 (100.0%) | 9.10 rows/s",
        "[2026-01-02 16:00:06] INFO - [DAG TEST] end task task_id=generate_chunk map_index=3",
        "a line of the scheduler loop, no task's",
    ])
    by_task = split_task_logs(printed)
    assert set(by_task) == {("prepare_run", -1), ("generate_chunk", 3)}
    assert not any("scheduler loop" in line for lines in by_task.values() for line in lines)
    base = f"{server.url}/api/v2/dags/tracegen_generate/dagRuns/{_quoted(raw)}/taskInstances/prepare_run"
    resp = httpx.patch(base, headers=server.auth, json={"new_state": "success"}, timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    # Nothing runs tasks here (no scheduler): make it a task that ran once, as the demo's tasks did.
    with sqlite3.connect(server.tmp / "airflow" / "airflow.db") as db:
        db.execute("UPDATE task_instance SET try_number = 1 WHERE dag_id = 'tracegen_generate' AND run_id = ? "
                   "AND task_id = 'prepare_run'", (raw,))
    try_number = _get(base, headers=server.auth).json()["try_number"]
    assert try_number == 1
    path = task_log_path(server.tmp / "airflow" / "logs", conf.get("logging", "log_filename_template"),
                         "tracegen_generate", raw, "prepare_run", -1, try_number)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(by_task["prepare_run", -1]) + "\n")
    resp = _get(f"{base}/logs/{try_number}", headers={**server.auth, "Accept": "application/json"})
    assert resp.status_code == 200, resp.text[:300]
    assert "run demo: max_tokens=4096" in resp.text and "Log file not found" not in resp.text, resp.text[:1000]


def test_a_skipped_chunk_task_says_in_the_ui_that_skipped_is_not_a_failure(server: Server) -> None:
    for task_id in ("generate_chunk", "generate_alongside_pilot", "generate_at_decided_cap"):
        resp = _get(f"{server.url}/api/v2/dags/tracegen_generate/tasks/{task_id}", headers=server.auth)
        assert resp.status_code == 200, resp.text
        assert "Skipped is not a failure" in resp.json()["doc_md"], task_id
