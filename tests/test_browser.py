"""The headwatch dashboard in a real TensorBoard server and a real (headless) browser.

Starts ``tensorboard`` on 127.0.0.1 against a run of the example, checks through
TensorBoard's HTTP API that the headwatch tags and the custom-scalars layout are served,
and saves a headless Chromium screenshot of the headwatch page to
``$HEADWATCH_ARTIFACTS/dashboard.png`` (default ``artifacts/`` at the repository root).
Skipped, with the reason, when Chromium is not installed (``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - loopback only
        return response.read()


@pytest.fixture(scope="module")
def example_run(tmp_path_factory) -> Path:
    sys.path.insert(0, str(ROOT / "examples"))
    import train_tiny_lm

    logdir = tmp_path_factory.mktemp("runs")
    train_tiny_lm.main(
        ["--max-steps", "12", "--max-corpus-mb", "0.3", "--vocab-size", "512", "--log-every-n-steps", "2",
         "--logdir", str(logdir), "--no-progress-bar"]
    )
    return logdir


@pytest.fixture(scope="module")
def tensorboard(example_run):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(example_run), "--host", "127.0.0.1", "--port", str(port),
         "--reload_interval", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                tags = json.loads(_get(f"{base}/data/plugin/scalars/tags"))
                if tags:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tensorboard did not serve the run: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_tensorboard_serves_headwatch_tags_and_layout(tensorboard):
    tags = json.loads(_get(f"{tensorboard}/data/plugin/scalars/tags"))
    (run,) = tags
    for tag in ("headwatch/logits/entropy", "headwatch/logits/kl_to_uniform", "headwatch/val/logits/entropy"):
        assert tag in tags[run], tag
    layout = json.loads(_get(f"{tensorboard}/data/plugin/custom_scalars/layout"))
    first = layout["category"][0]
    assert first["title"] == "headwatch: vital signs" and not first.get("closed")
    assert first["chart"][0]["title"] == "entropy, train: mean and p05-p95 band (nats)"
    assert all(c.get("closed") for c in layout["category"][1:])


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium; .ci/run installs it)")
def test_headless_chromium_screenshot_of_the_headwatch_page(tensorboard, tmp_path):
    from PIL import Image

    out_dir = Path(os.environ.get("HEADWATCH_ARTIFACTS", ROOT / "artifacts"))
    out_dir.mkdir(parents=True, exist_ok=True)
    shot = out_dir / "dashboard.png"
    shot.unlink(missing_ok=True)
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1400,1100", "--virtual-time-budget=20000",
         f"--screenshot={shot}", f"{tensorboard}/?darkMode=false#custom_scalars"],
        check=True, capture_output=True, timeout=120,
    )
    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 1100)
    colors = image.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 500, "the page looks blank"
    # TensorBoard's orange header is drawn: the app loaded, not an error page
    assert image.getpixel((10, 10))[0] > 200 and image.getpixel((10, 10))[2] < 100
    print(f"\nscreenshot of the headwatch dashboard: {shot}")
