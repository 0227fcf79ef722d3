"""Make every picture under ``docs/`` from real runs of the current code.

What it does, in order:

1. trains four small runs of ``examples/train_tiny_lm.py`` (the README's example job, on the
   standard library's ``*.py`` files; 200 steps each, d_model 64, a 2,048-token BPE vocabulary):
   ``tied`` and ``untied`` (healthy), ``collapse`` (``--induce-collapse 100 --collapse-weight 2``: from step 100
   the loss adds twice the mean prediction entropy) and ``broken`` (two capture faults, see ``BrokenCaptureLM`` below);
2. runs ``examples/grpo_collapse.py --plot`` (TRL's GRPO on a tiny Llama: the collapse and the
   entropy-bonus remedy) for ``docs/rl_collapse.png``;
3. writes ``headwatch report --html --charts png`` of the four runs;
4. starts TensorBoard on the runs and headless Chromium, drives Chromium over the DevTools protocol
   (a WebSocket, standard library only) and saves screenshots of the headwatch page (CUSTOM SCALARS),
   of chosen charts of it, of the IMAGES tab and of the report page.

:data:`PICTURES` lists every picture it writes (paths relative to ``docs/``); ``tests/docs/test_pictures.py``
checks that the pictures checked in and the pictures the docs reference match this list (it does not
render anything). ``docs/dashboard.md`` explains the pictures.

Usage (from the repository root)::

    pip install -e ".[examples,test]"          # torch, Lightning, tokenizers, matplotlib, tensorboard, trl
    python docs/make_pictures.py                # writes docs/*.png and docs/img/*.png
    python docs/make_pictures.py --work /tmp/pictures --reuse   # keep the runs; redraw without training

Needs: everything of the ``examples`` and ``test`` extras (``tensorboard`` comes with Lightning,
``trl``/``transformers``/``datasets`` for the GRPO picture), and Chromium (``/usr/bin/chromium``,
``chromium-browser`` or ``google-chrome`` on the PATH, or ``--chromium PATH``). Nothing is downloaded.

Takes about 4 minutes on 2 CPU cores (measured from nothing: 3 min 41 s wall, 170 CPU seconds, on a
shared 2-core machine: each training run about 15 s when the machine is quiet, the GRPO runs 10 s,
TensorBoard and the screenshots about a minute); ``--reuse`` skips the training. The runs are
deterministic (seeded), and every number in the pictures is what this code logged in them.
"""

from __future__ import annotations

import argparse
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
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

PICTURES: dict[str, str] = {
    "dashboard.png": "the headwatch page of TensorBoard (CUSTOM SCALARS), healthy runs tied and untied",
    "images.png": "the IMAGES tab of the same runs: row norm vs frequency, entropy over the run, nearest-neighbour cosine",
    "rl_collapse.png": "examples/grpo_collapse.py --plot: GRPO entropy collapse and the entropy-bonus remedy",
    "img/healthy.png": "chosen charts of the headwatch page, healthy tied run",
    "img/collapse.png": "chosen charts of the headwatch page, collapsing run (--induce-collapse 100 --collapse-weight 2)",
    "img/broken_capture.png": "chosen charts of the headwatch page, run whose capture breaks (self-check)",
    "img/report.png": "the top of `headwatch report --html` of the four runs",
}
"""Every picture this script writes, relative to ``docs/``, with what it shows."""

COMMON = [
    "--max-corpus-mb", "1", "--vocab-size", "2048", "--d-model", "64", "--max-steps", "200",
    "--val-check-interval", "50", "--limit-val-batches", "8", "--log-every-n-steps", "10",
    "--collision-every", "50", "--alert-warmup-steps", "50", "--no-progress-bar", "--print-every-s", "30",
]  # fmt: skip
"""Arguments of ``examples/train_tiny_lm.py`` shared by the four runs."""

RUNS: dict[str, list[str]] = {
    "tied": [],
    "untied": ["--no-tie-weights"],
    "collapse": ["--induce-collapse", "100", "--collapse-weight", "2"],
    "broken": [],
}
"""Run name -> extra arguments. ``broken`` also swaps in :class:`BrokenCaptureLM`."""

SMOOTH_FROM_STEP = 80
"""``broken``: from this step on, ``training_step`` trains and logs a label-smoothed loss (0.1)."""
ZERO_GRAD_FROM_STEP = 140
"""``broken``: from this step on, a gradient hook multiplies the head's gradient by 0."""

CARDS: dict[str, tuple[str, list[str]]] = {
    "img/healthy.png": (
        "tied",
        [
            "entropy and sharpness, train (nats)",
            "entropy and sharpness, validation (nats)",
            "target NLL vs loss (nats)",
            "gradient row density: embedding vs head",
            "self-check: gaps to the trainer's figures, failed checks",
            "entropy median with p05-p95 band, train (nats)",
        ],
    ),
    "img/collapse.png": (
        "collapse",
        [
            "entropy and sharpness, train (nats)",
            "entropy median with p05-p95 band, train (nats)",
            "RL: top-1 probability median with p05-p95 band",
            "target NLL vs loss (nats)",
            "self-check: gaps to the trainer's figures, failed checks",
            "alerts (1 at the alert step)",
        ],
    ),
    "img/broken_capture.png": (
        "broken",
        [
            "self-check: gaps to the trainer's figures, failed checks",
            "target NLL vs loss (nats)",
            "gradient row density: embedding vs head",
            "entropy and sharpness, train (nats)",
            "update row density (rows the optimizer moved)",
            "alerts (1 at the alert step)",
        ],
    ),
}
"""Composite picture -> (run, titles of the headwatch page's charts, in reading order)."""

WIDTH, HEIGHT = 1400, 4200  # the browser's viewport: tall enough that the headwatch page never scrolls


def say(message: str) -> None:
    print(f"[pictures {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ----------------------------------------------------------------------------------------------- runs
def _broken_model_class(base: type) -> type:
    class BrokenCaptureLM(base):  # type: ignore[misc, valid-type]
        """The example's model with two faults a user can make, one after the other.

        From :data:`SMOOTH_FROM_STEP`, ``training_step`` computes its loss itself with label smoothing 0.1
        and logs that as ``train_loss``: the loss the trainer optimizes is no longer the cross-entropy that
        headwatch measures. From :data:`ZERO_GRAD_FROM_STEP`, a gradient hook multiplies the (tied) head's
        gradient by 0, as a fused loss whose backward drops the head would.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.lm_head.weight.register_hook(lambda g: g * 0 if self.global_step >= ZERO_GRAD_FROM_STEP else g)

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            if self.global_step < SMOOTH_FROM_STEP:
                return super().training_step(batch, batch_idx)
            import torch.nn.functional as F

            logits = self(batch["input_ids"]).logits  # (B, T, V)
            targets = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # the model's own shift
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, label_smoothing=0.1)
            self.log("train_loss", loss, prog_bar=True)
            return loss

    return BrokenCaptureLM


def train_runs(logdir: Path, reuse: bool) -> None:
    """The four runs of ``examples/train_tiny_lm.py`` under ``logdir/<name>/version_0``."""
    sys.path.insert(0, str(ROOT / "examples"))
    import train_tiny_lm

    for name, extra in RUNS.items():
        if reuse and list((logdir / name).glob("version_*/events.out.tfevents.*")):
            say(f"run {name}: reused")
            continue
        shutil.rmtree(logdir / name, ignore_errors=True)
        say(f"run {name}: train_tiny_lm.py {' '.join(COMMON + extra)}")
        original = train_tiny_lm.TinyLM
        if name == "broken":
            train_tiny_lm.TinyLM = _broken_model_class(original)
        try:
            summary = train_tiny_lm.main([*COMMON, *extra, "--logdir", str(logdir), "--run-name", name])
        finally:
            train_tiny_lm.TinyLM = original
        say(f"run {name}: {summary['steps']} steps, val loss {summary['final_val_loss']:.3f}, "
            f"entropy {summary['entropy']:.3f} nats, {len(summary['alerts'])} alerts, {summary['fit_time_s']:.0f} s")


def grpo_picture(workdir: Path, out: Path, reuse: bool) -> None:
    """``examples/grpo_collapse.py --plot out`` (both runs)."""
    if reuse and out.exists() and (workdir / "grpo").exists():
        say("GRPO picture: reused")
        return
    sys.path.insert(0, str(ROOT / "examples"))
    import grpo_collapse

    say("GRPO: examples/grpo_collapse.py --plot (collapse, then --remedy)")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        grpo_collapse.main(["--out", str(workdir / "grpo"), "--plot", str(out)])
    say("GRPO: " + " | ".join(line for line in printed.getvalue().splitlines() if line.startswith("alerts")))


def report_page(logdir: Path, out: Path) -> None:
    """``headwatch report`` of the four runs as an HTML page with PNG charts."""
    from headwatch.report.cli import main as report_main

    args = ["report", *(f"runs/{name}" for name in RUNS), "--html", str(out.resolve()), "--charts", "png",
            "--match", r"logits/entropy$|check/nll_gap$|grad/shared_row_density$|grad/head_row_density$|val_loss$"]  # fmt: skip
    cwd = os.getcwd()
    os.chdir(logdir.parent)  # the page names the runs as given: runs/tied, not a temporary path
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            status = report_main(args)
    finally:
        os.chdir(cwd)
    if status != 0:
        raise RuntimeError(f"headwatch report exited with {status}")


# ---------------------------------------------------------------------------------- browser plumbing
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # loopback only
        return response.read()


@contextlib.contextmanager
def tensorboard(logdir: Path) -> Iterator[str]:
    """A TensorBoard serving ``logdir`` on 127.0.0.1; yields its base URL once it serves every run."""
    port = _free_port()
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
                if len(json.loads(_get(f"{base}/data/plugin/scalars/tags"))) >= len(RUNS):
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
    port = _free_port()
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
                pages = [t for t in json.loads(_get(f"http://127.0.0.1:{port}/json/list")) if t.get("type") == "page"]
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
_CARDS_JS = r"""
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
_OPEN_MATCHES_JS = r"""
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
_KEEP_OUTLIERS_JS = r"""
(() => {
  const deep = (root, f) => { for (const el of root.querySelectorAll('*')) { f(el); if (el.shadowRoot) deep(el.shadowRoot, f); } };
  let n = 0;
  deep(document, (el) => { if ('_ignoreYOutliers' in el && el._ignoreYOutliers === true) { el._ignoreYOutliers = false; n++; } });
  return n;
})()
"""

_IMAGES_JS = r"""
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
        cards = tools.evaluate(_CARDS_JS) or []
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
        total, loaded = tools.evaluate(_IMAGES_JS)
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


def screenshots(base: str, binary: str, report_html: Path, docs: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="headwatch_chromium_") as profile, chromium(binary, Path(profile)) as tools:
        page = f"{base}/?darkMode=false#custom_scalars&_smoothingWeight=0&regexInput="
        # the whole page, healthy runs tied and untied
        open_page(tools, page + "%5E(tied%7Cuntied)%2F")
        wait_for_cards(tools, ["entropy and sharpness, train (nats)", "gradient row density: embedding vs head"])
        save_png(tools.screenshot(0, 0, WIDTH, 1500), docs / "dashboard.png")
        # chosen charts of one run
        for picture, (run, titles) in CARDS.items():
            open_page(tools, page + f"%5E{run}%2F")
            wait_for_cards(tools, titles)
            tools.evaluate(_KEEP_OUTLIERS_JS)
            tools.evaluate(_OPEN_MATCHES_JS % json.dumps(titles))
            cards = {c["title"]: c for c in wait_for_cards(tools, titles)}
            shots = [tools.screenshot(cards[t]["x"], cards[t]["y"], cards[t]["w"], cards[t]["h"]) for t in titles]
            command = "examples/train_tiny_lm.py " + " ".join(RUNS[run]) if RUNS[run] else "examples/train_tiny_lm.py"
            save_png(compose(shots, f"run {run}/version_0 ({command}), TensorBoard's headwatch page, smoothing 0, outliers kept"),
                     docs / picture)
        # IMAGES tab of the healthy runs
        open_page(tools, f"{base}/?darkMode=false#images&regexInput=%5E(tied%7Cuntied)%2F")
        wait_for_images(tools)
        save_png(tools.screenshot(0, 0, WIDTH, 1300), docs / "images.png")
        # the report page
        open_page(tools, report_html.resolve().as_uri())
        time.sleep(3)
        save_png(tools.screenshot(0, 0, WIDTH, 1300), docs / "img" / "report.png")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=None, help="folder for the runs (default: a temporary folder, removed)")
    parser.add_argument("--reuse", action="store_true", help="keep runs already in --work instead of training again")
    parser.add_argument("--docs", default=str(DOCS), help="where the pictures go (default: docs/)")
    parser.add_argument("--chromium", default=None, help="the Chromium binary (default: found on the PATH)")
    args = parser.parse_args(argv)
    binary = find_chromium(args.chromium)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        workdir = Path(args.work) if args.work else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="headwatch_pictures_")))
        workdir.mkdir(parents=True, exist_ok=True)
        docs = Path(args.docs)
        logdir = workdir / "runs"
        train_runs(logdir, args.reuse)
        grpo_picture(workdir, docs / "rl_collapse.png", args.reuse)
        report_html = workdir / "report.html"
        report_page(logdir, report_html)
        say("TensorBoard and Chromium: screenshots")
        with tensorboard(logdir) as base:
            screenshots(base, binary, report_html, docs)
    import resource

    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))  # fmt: skip
    say(f"done in {time.perf_counter() - t0:.0f} s ({cpu:.0f} CPU seconds, this process and its children): "
        + ", ".join(PICTURES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
