"""Headless Debian Chromium driven over the Chrome DevTools protocol (aiohttp websocket), for UI tests.

Just enough of CDP to log in by cookie, open pages, read the DOM, run a little JavaScript (clicks,
typing) and take screenshots. Fails loudly when /usr/bin/chromium is missing: `make test` installs it.
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
