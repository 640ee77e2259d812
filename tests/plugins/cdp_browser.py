"""Headless Debian Chromium driven over the Chrome DevTools protocol (aiohttp websocket), for UI tests.

Just enough of CDP to log in by cookie, open pages, read the DOM, run a little JavaScript and take
screenshots, and to click and type like a person: real mouse and keyboard events through `Input.*`, which
React-controlled fields (the Airflow trigger form) see, unlike a value assigned by script. Fails loudly when /usr/bin/chromium is missing: `make test` installs it.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         "--window-size=1400,1000", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0"]


def chromium_path() -> str:
    if not Path(CHROMIUM).is_file():
        raise RuntimeError(f"{CHROMIUM} is missing: run `make system-deps` (scripts/install-system-deps.sh)")
    return CHROMIUM


class Browser:
    """One Chromium process with one page; every call is synchronous for the test's sake."""

    def __init__(self) -> None:
        self.profile = tempfile.mkdtemp(prefix="tracegen-chromium-")
        self.proc = subprocess.Popen(
            [chromium_path(), *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.loop = asyncio.new_event_loop()
        self._ids = itertools.count(1)
        self.loop.run_until_complete(self._connect())

    async def _connect(self) -> None:
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit code {self.proc.poll()})")
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as resp:
            pages = [t for t in await resp.json() if t["type"] == "page"]
        self.ws = await self.session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        for domain in ("Page", "Network", "Runtime"):
            await self._send(f"{domain}.enable")

    async def _send(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        await self.ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads((await asyncio.wait_for(self.ws.receive(), 60)).data)
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"CDP {method}: {msg['error']}")
                return msg.get("result", {})

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        return self.loop.run_until_complete(self._send(method, **params))

    def set_cookie(self, url: str, name: str, value: str) -> None:
        self.call("Network.setCookie", url=url, name=name, value=value, httpOnly=True, sameSite="Lax")

    def clear_cookies(self) -> None:
        self.call("Network.clearBrowserCookies")

    def eval(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"JS error in {expression[:80]!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def goto(self, url: str) -> None:
        """Navigate and wait until the document has loaded."""
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def wait_for(self, js_condition: str, timeout: float = 30.0) -> Any:
        """Poll a JS expression until it is truthy; its last value on timeout goes into the error."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            try:
                value = self.eval(js_condition)
            except RuntimeError:
                value = None  # the page is between documents
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {js_condition!r} at {self.eval('location.href')}")

    # ---- a person's mouse and keyboard (trusted events, so React's handlers run) -------------------

    def center_of(self, selector: str, timeout: float = 10.0) -> tuple[float, float]:
        """Scroll the first element matching a CSS selector into view; its centre in viewport pixels.

        Waits until the element stops moving: a dialog that is still animating open would take the
        click somewhere else.
        """
        js = (f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return null;"
              " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
              " return [r.x + r.width / 2, r.y + r.height / 2, r.width, r.height]; })()")
        deadline = time.monotonic() + timeout
        last = None
        while True:
            rect = self.eval(js)
            if rect and rect == last and rect[2] > 0 and rect[3] > 0:
                return rect[0], rect[1]
            if time.monotonic() > deadline:
                raise AssertionError(f"no steady visible element matches {selector!r} at {self.url()}: {rect}")
            last = rect
            time.sleep(0.15)

    def click(self, selector: str, timeout: float = 30.0) -> None:
        """Press and release the left mouse button over an element, as a person clicking it would.

        Waits until nothing covers the element's centre: a real click there would hit the cover instead
        (Airflow's error toast lays an invisible strip over the trigger dialog's button for a few seconds).
        """
        x, y = self.center_of(selector)
        hit = (f"(() => {{ const t = document.querySelector({json.dumps(selector)});"
               f" const e = document.elementFromPoint({x}, {y});"
               " return t && e && t.contains(e) ? '' : (e ? e.outerHTML.slice(0, 200) : 'nothing'); })()")
        deadline = time.monotonic() + timeout
        while cover := self.eval(hit):
            if time.monotonic() > deadline:
                raise AssertionError(f"{selector!r} stayed covered by {cover}")
            time.sleep(0.2)
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def key(self, key: str, code: str, key_code: int, modifiers: int = 0, commands: list[str] | None = None) -> None:
        """One key press (down + up). `commands` are editing commands the key triggers (e.g. selectAll)."""
        down: dict[str, Any] = {"key": key, "code": code, "windowsVirtualKeyCode": key_code, "modifiers": modifiers}
        if commands:
            down["commands"] = commands
        self.call("Input.dispatchKeyEvent", type="rawKeyDown", **down)
        self.call("Input.dispatchKeyEvent", type="keyUp", key=key, code=code, windowsVirtualKeyCode=key_code,
                  modifiers=modifiers)

    def type_into(self, selector: str, text: str, pause: float = 0.05) -> None:
        """Click a text field, select what it holds (Ctrl+A), delete it and type `text` key by key.

        Each character is a real key press with a short pause after it, as a person types: a controlled
        React field re-renders after every keystroke, and a burst faster than that can lose characters
        (a number field turned "1.5" into "15"). Callers check the field's value afterwards.
        """
        self.click(selector)
        self.wait_for(f"document.activeElement === document.querySelector({json.dumps(selector)})", 10)
        self.key("a", "KeyA", 65, modifiers=2, commands=["selectAll"])
        self.key("Backspace", "Backspace", 8)
        for char in text:
            self.call("Input.dispatchKeyEvent", type="keyDown", key=char, text=char, unmodifiedText=char)
            self.call("Input.dispatchKeyEvent", type="keyUp", key=char)
            time.sleep(pause)

    def url(self) -> str:
        return self.eval("location.href")

    def text(self) -> str:
        return self.eval("document.body ? document.body.innerText : ''")

    def html(self) -> str:
        return self.eval("document.documentElement.outerHTML")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=False)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.ws.close())
            self.loop.run_until_complete(self.session.close())
        except Exception:
            pass
        self.loop.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


# Where the review journey's screenshots go (trigger form, question, refusal, answer, reports, run list,
# progress, the run's tab), for a person to look at after `make test`.
JOURNEY_DIR = Path(__file__).resolve().parents[2] / ".state" / "test-screenshots" / "review-journey"
_PAGE_ERROR = """(() => {
  const h1 = document.querySelector('h1'), text = document.body ? document.body.innerText : '';
  if (location.pathname.startsWith('/auth/login')) return 'the login page';
  if (h1 && /^[45]\\d\\d$/.test(h1.innerText.trim())) return 'an error page: ' + text.slice(0, 300);
  for (const e of ['Not authenticated', 'Internal Server Error', '"detail"']) if (text.includes(e)) return e;
  return '';
})()"""


# A review page wider than the window (FLAGS: 1,400 px) needs a horizontal scroll: the widest element says why.
_TOO_WIDE = """(() => {
  if (!location.pathname.startsWith('/tracegen/')) return '';
  const d = document.documentElement;
  if (d.scrollWidth <= d.clientWidth) return '';
  const wide = [...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > d.clientWidth);
  return `${d.scrollWidth} px for ${d.clientWidth}: ` + wide.slice(-3).map(e => e.outerHTML.slice(0, 120)).join(' | ');
})()"""


def journey_shot(browser: Browser, name: str) -> Path:
    """A screenshot of the page a reviewer is on, into JOURNEY_DIR; fails when the page shows an error, or
    when a review page does not fit the window. A page framing a stored report gets a moment for the frame
    (another process) to paint."""
    problem = browser.eval(_PAGE_ERROR)
    assert not problem, f"{name}: the page at {browser.url()} shows {problem}"
    if browser.eval("document.querySelectorAll('iframe').length"):
        time.sleep(1.5)
    JOURNEY_DIR.mkdir(parents=True, exist_ok=True)
    shot = browser.screenshot(JOURNEY_DIR / f"{name}.png")  # also when too wide: the shot shows where
    too_wide = browser.eval(_TOO_WIDE)
    assert not too_wide, f"{name}: the page at {browser.url()} is wider than the window: {too_wide}"
    return shot
