"""Headless Chromium and TensorBoard for ``docs/make_pictures.py`` (and ``tests/tensorboard/test_browser.py``): standard library only.

- :func:`tensorboard`: a TensorBoard process serving a log directory on 127.0.0.1;
- :func:`chromium` and :class:`DevTools`: headless Chromium driven over its DevTools protocol (one WebSocket,
  RFC 6455, text frames), no client library;
- the page scripts that find TensorBoard's CUSTOM SCALARS cards in its shadow DOMs, open categories and
  "Matches" lists, untick "Ignore outliers", and wait for images or for the headwatch tab;
- :func:`save_png` and :func:`compose` (Pillow, imported when called).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

WIDTH, HEIGHT = 1400, 4200  # the browser's viewport: tall enough that the headwatch page never scrolls
ROOT = Path(__file__).resolve().parents[1]


def say(message: str) -> None:
    print(f"[pictures {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------------- browser plumbing
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # loopback only
        return response.read()


@contextlib.contextmanager
def tensorboard(logdir: Path, runs: int = 1) -> Iterator[str]:
    """A TensorBoard serving ``logdir`` on 127.0.0.1; yields its base URL once it serves ``runs`` runs."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port),
         "--reload_interval", "0", "--samples_per_plugin", "images=100"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if len(json.loads(get(f"{base}/data/plugin/scalars/tags"))) >= runs:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("tensorboard did not serve the runs: " + (proc.stderr.read().decode()[-2000:] if proc.stderr else ""))
            time.sleep(1)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def find_chromium(path: str | None) -> str:
    found = path or shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not found:
        raise SystemExit("Chromium not found: apt-get install chromium, or pass --chromium PATH")
    return found


class DevTools:
    """A minimal Chrome DevTools Protocol client: one WebSocket (RFC 6455), text frames, standard library only."""

    def __init__(self, ws_url: str) -> None:
        hostport, path = ws_url.split("://", 1)[1].split("/", 1)
        host, port = hostport.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=300)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += self._exact(1)
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"DevTools refused the WebSocket: {head[:200]!r}")
        self.next_id = 0

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("DevTools closed the connection")
            buf += chunk
        return bytes(buf)

    def _send(self, text: str) -> None:
        data, mask = text.encode(), os.urandom(4)
        n = len(data)
        length = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n) if n < 1 << 16 else bytes([0x80 | 127]) + struct.pack(">Q", n)
        self.sock.sendall(bytes([0x81]) + length + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def _receive(self) -> str:
        parts = []
        while True:
            b0, b1 = self._exact(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._exact(8))[0]
            payload = self._exact(n)
            if b0 & 0x0F == 0x8:
                raise ConnectionError("DevTools closed the WebSocket")
            if b0 & 0x0F in (0x9, 0xA):
                continue
            parts.append(payload)
            if b0 & 0x80:
                return b"".join(parts).decode()

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self._send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:  # events in between are dropped
            message = json.loads(self._receive())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, x: float, y: float, width: float, height: float) -> bytes:
        clip = {"x": x, "y": y, "width": width, "height": height, "scale": 1}
        shot = self.call("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)
        return base64.b64decode(shot["data"])


@contextlib.contextmanager
def chromium(binary: str, profile: Path) -> Iterator[DevTools]:
    """Headless Chromium with its DevTools port on 127.0.0.1; yields a client of its first page."""
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         f"--user-data-dir={profile}", f"--remote-debugging-port={port}", "--remote-allow-origins=*", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                pages = [t for t in json.loads(get(f"http://127.0.0.1:{port}/json/list")) if t.get("type") == "page"]
                if pages:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("Chromium did not open its DevTools port")
            time.sleep(0.5)
        tools = DevTools(pages[0]["webSocketDebuggerUrl"])
        tools.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1, mobile=False)
        try:
            yield tools
        finally:
            tools.sock.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# The cards of the headwatch page live in shadow DOMs (Polymer): walk every shadow root.
CARDS_JS = r"""
(() => {
  const deep = (root, f) => { for (const el of root.querySelectorAll('*')) { f(el); if (el.shadowRoot) deep(el.shadowRoot, f); } };
  const cards = [];
  deep(document, (el) => {
    const tag = el.tagName.toLowerCase();
    if (!(tag.startsWith('tf-custom-scalar-') && tag.endsWith('-card'))) return;
    let lines = 0;
    // drawn: a line, or a marker (a series of one point, e.g. an alert, draws a marker and no line)
    deep(el.shadowRoot || el, (x) => { if (x.tagName.toLowerCase() === 'path' && /\b(line|symbol)\b/.test(x.getAttribute('class') || '')
                                          && (x.getAttribute('d') || '').length > 4) lines++; });
    const r = el.getBoundingClientRect();
    cards.push({title: el.title, lines: lines, series: (el._seriesNames || []).length, x: r.x, y: r.y, w: r.width, h: r.height});
  });
  return cards;
})()
"""

# Open every card's "Matches" list: the tags of its lines, each with the line's marker.
OPEN_MATCHES_JS = r"""
((titles) => {
  const deep = (root, f) => { for (const el of root.querySelectorAll('*')) { f(el); if (el.shadowRoot) deep(el.shadowRoot, f); } };
  let n = 0;
  deep(document, (el) => { const tag = el.tagName.toLowerCase();
    if (tag.startsWith('tf-custom-scalar-') && tag.endsWith('-card') && '_matchesListOpened' in el && titles.includes(el.title)) {
      el._matchesListOpened = true; n++; } });
  return n;
})(%s)
"""

# Untick "Ignore outliers in chart scaling" (the dashboard's `_ignoreYOutliers`, default on): every point is
# drawn inside the axes, so a jump to 1 or a gap of -0.3 among gaps of 1e-7 stays visible.
KEEP_OUTLIERS_JS = r"""
(() => {
  const deep = (root, f) => { for (const el of root.querySelectorAll('*')) { f(el); if (el.shadowRoot) deep(el.shadowRoot, f); } };
  let n = 0;
  deep(document, (el) => { if ('_ignoreYOutliers' in el && el._ignoreYOutliers === true) { el._ignoreYOutliers = false; n++; } });
  return n;
})()
"""

IMAGES_JS = r"""
(() => {
  const deep = (root, f) => { for (const el of root.querySelectorAll('*')) { f(el); if (el.shadowRoot) deep(el.shadowRoot, f); } };
  let total = 0, loaded = 0;
  deep(document, (el) => { if (el.tagName.toLowerCase() === 'img' && el.getBoundingClientRect().width > 100) {
    total++; if (el.complete && el.naturalWidth > 0) loaded++; } });
  return [total, loaded];
})()
"""


def open_page(tools: DevTools, url: str) -> None:
    """A fresh load of ``url`` (through about:blank: a change of the fragment alone would keep the page and
    its charts' axes)."""
    tools.call("Page.navigate", url="about:blank")
    tools.call("Page.navigate", url=url)


def wait_for_cards(tools: DevTools, titles: Sequence[str] | None, timeout: float = 240) -> list[dict[str, Any]]:
    """The headwatch page's cards once ``titles`` (None: every card with data) have drawn lines that stopped changing."""
    deadline, previous = time.monotonic() + timeout, None
    while True:
        time.sleep(3)
        cards = tools.evaluate(CARDS_JS) or []
        by_title = {c["title"]: c for c in cards}
        wanted = [by_title.get(t) for t in titles] if titles is not None else cards
        state = [(c["lines"], c["series"], round(c["y"]), round(c["h"])) if c else None for c in wanted]
        # a card whose tags match nothing in the run ("Matches (0)", e.g. no alert) is ready empty, once others drew
        ready = any(c and c["lines"] for c in wanted) and all(c and (c["lines"] > 0 or c["series"] == 0) for c in wanted)
        if ready and state == previous:
            return cards
        if time.monotonic() > deadline:
            missing = [t for t, c in zip(titles or [], wanted) if not c or not c["lines"]]
            raise RuntimeError(f"the headwatch page did not draw {missing or 'its charts'} in {timeout:.0f} s")
        previous = state


def wait_for_images(tools: DevTools, timeout: float = 240) -> None:
    deadline, previous = time.monotonic() + timeout, None
    while True:
        time.sleep(3)
        total, loaded = tools.evaluate(IMAGES_JS)
        if total and total == loaded and previous == (total, loaded):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the IMAGES tab loaded {loaded} of {total} images in {timeout:.0f} s")
        previous = (total, loaded)


def save_png(data: bytes | Any, path: Path) -> None:
    """Save a PNG (bytes or a PIL image) with at most 256 colors, which keeps screenshots small."""
    from PIL import Image

    image = Image.open(io.BytesIO(data)) if isinstance(data, bytes) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)
    say(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} ({path.stat().st_size // 1024} KiB)")


def compose(shots: Sequence[bytes], caption: str, columns: int = 3, pad: int = 8) -> Any:
    """Card screenshots on a white grid, ``caption`` above."""
    from PIL import Image, ImageDraw, ImageFont

    images = [Image.open(io.BytesIO(s)).convert("RGB") for s in shots]
    w = max(i.width for i in images)
    h = max(i.height for i in images)
    rows = -(-len(images) // columns)
    top = 34
    canvas = Image.new("RGB", (columns * (w + pad) + pad, top + rows * (h + pad) + pad), "white")
    for k, image in enumerate(images):
        canvas.paste(image, (pad + (k % columns) * (w + pad), top + (k // columns) * (h + pad)))
    draw = ImageDraw.Draw(canvas)
    try:
        font = ImageFont.load_default(size=15)
    except TypeError:  # Pillow < 10.1
        font = ImageFont.load_default()
    draw.text((pad + 6, 9), caption, fill=(33, 33, 33), font=font)
    return canvas




# Open the CUSTOM SCALARS categories whose titles are given (closed ones draw no card until opened).
OPEN_CATEGORIES_JS = r"""
((names) => {
  const deep = (root, f) => { for (const el of root.querySelectorAll('*')) { f(el); if (el.shadowRoot) deep(el.shadowRoot, f); } };
  let n = 0;
  deep(document, (el) => { if (el.tagName.toLowerCase() === 'tf-category-paginated-view' && el.category && names.includes(el.category.name)) {
    el.opened = true; n++; } });
  return n;
})(%s)
"""

# The headwatch tab's frame: its page state (body data-state: "ready" once drawn) and its content's height.
HEADWATCH_TAB_JS = r"""
(() => {
  const deep = (root, f) => { for (const el of root.querySelectorAll('*')) { f(el); if (el.shadowRoot) deep(el.shadowRoot, f); } };
  let out = null;
  deep(document, (el) => { if (el.tagName.toLowerCase() === 'iframe' && el.contentDocument && el.contentDocument.body) {
    const r = el.getBoundingClientRect(), d = el.contentDocument;
    out = {state: d.body.dataset.state || '', runs: d.body.dataset.runs || '', y: r.y, height: d.documentElement.scrollHeight}; } });
  return out;
})()
"""


def wait_for_headwatch_tab(tools: DevTools, timeout: float = 240) -> dict[str, Any]:
    """The headwatch tab's frame once its page is drawn and its height stopped changing."""
    deadline, previous = time.monotonic() + timeout, None
    while True:
        time.sleep(3)
        found = tools.evaluate(HEADWATCH_TAB_JS)
        if found and found["state"] == "ready" and found == previous:
            return found
        if time.monotonic() > deadline:
            raise RuntimeError(f"the headwatch tab was not drawn in {timeout:.0f} s: {found}")
        previous = found
