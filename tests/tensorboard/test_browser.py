"""The headwatch pages in a real TensorBoard server and a real (headless) browser.

Two runs under one log directory: the example (``examples/train_tiny_lm.py``, 12 steps) and a small
Lightning run with every monitor, synonym groups, a collision threshold every rare token crosses and an
alert that fires at once (a warning and a critical alert at one step), so each panel has something to show.
``tensorboard`` is started on 127.0.0.1; its answers are compared with the event files read by TensorBoard's
``EventAccumulator`` (the independent reference). Headless Chromium renders the headwatch tab's entry page
alone (``--dump-dom``) and the tab inside TensorBoard (a screenshot, kept in ``$HEADWATCH_ARTIFACTS``,
default ``artifacts/``). Browser tests are skipped, with the reason, when Chromium is not installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from headwatch.tensorboard.charts import CHARTS

from tests.helpers.paths import ROOT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
WATCHED = "watched/version_0"


def token_text(i: int) -> str:
    """The watched run's tokenizer: characters a Markdown table or a quote parser could trip on."""
    return f"tok{i} |'\""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 30.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - loopback only
        return response.read()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from headwatch import GradientDensityMonitor, LogitStatsMonitor, SharpnessCollapseAlert, SynonymCollisionMonitor, TokenFrequency
    from tests.helpers import TinyCausalLM, loader

    sys.path.insert(0, str(ROOT / "examples"))
    import train_tiny_lm

    root = tmp_path_factory.mktemp("runs")
    train_tiny_lm.main(["--max-steps", "12", "--max-corpus-mb", "0.3", "--vocab-size", "512", "--log-every-n-steps", "2",
                        "--logdir", str(root), "--no-progress-bar"])  # fmt: skip
    pl.seed_everything(0)
    callbacks = [
        TokenFrequency(), LogitStatsMonitor(compare_loss="train_loss"), GradientDensityMonitor(),
        SynonymCollisionMonitor(tau=-1.0, every_n_steps=2, tokenizer=token_text, synonym_groups=[[3, 4], [5, 6, 7]]),
        SharpnessCollapseAlert(entropy_floor=(100.0, 50.0), entropy_drop=None, warmup_steps=0),  # fires at once
    ]  # fmt: skip
    trainer = pl.Trainer(max_steps=6, log_every_n_steps=2, logger=TensorBoardLogger(root, name="watched"), callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         limit_val_batches=2, val_check_interval=3, check_val_every_n_epoch=None, num_sanity_val_steps=0, accelerator="cpu", devices=1)  # fmt: skip
    trainer.fit(TinyCausalLM(), loader(), loader(n=16, seed=1))
    return root


@pytest.fixture(scope="module")
def tensorboard(logdir):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port),
         "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if len(json.loads(_get(f"{base}/data/plugin/scalars/tags"))) >= 2:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tensorboard did not serve the runs: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _acc(logdir: Path, run: str) -> EventAccumulator:
    acc = EventAccumulator(str(logdir / run), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _route(base: str, route: str, run: str | None = None):
    query = f"?run={urllib.parse.quote(run)}" if run else ""
    return json.loads(_get(f"{base}/data/plugin/headwatch/{route}{query}"))


def _runs(base: str) -> list[str]:
    return [r["run"] for r in _route(base, "runs")["runs"]]


# ---------------------------------------------------------------- TensorBoard's own pages
def test_tensorboard_serves_headwatch_tags_and_a_layout_of_the_runs_charts(tensorboard, logdir):
    tags = json.loads(_get(f"{tensorboard}/data/plugin/scalars/tags"))
    example = next(r for r in tags if r != WATCHED)
    for tag in ("headwatch/logits/entropy", "headwatch/logits/kl_to_uniform", "headwatch/val/logits/entropy"):
        assert tag in tags[example], tag
    layout = json.loads(_get(f"{tensorboard}/data/plugin/custom_scalars/layout"))
    first = layout["category"][0]
    assert first["title"] == "headwatch: vital signs" and not first.get("closed")
    from headwatch.tensorboard.layout import drawn_order

    drawn = [c["title"] for c in drawn_order(first["chart"])]
    # the first run's vital signs in order (charts only the second run has, its alerts, are appended by TensorBoard)
    assert drawn[-5:] == [c.title for c in CHARTS[:5]]
    assert all(c.get("closed") for c in layout["category"][1:])
    titles = [c["title"] for cat in layout["category"] for c in cat["chart"]]
    # the watched run's alerts and synonyms bring their charts; nothing RL (no run is RL)
    assert "alert warning: entropy_floor (1 at each warning step)" in titles and "alert: entropy_floor (1 at each alert step)" in titles
    assert "synonym partner rank, head (median; 1 = nearest)" in titles
    assert not [t for t in titles if t.startswith("RL:")]


def _pictures_module():
    """``docs/pictures_browser.py`` (standard library only): the pictures' headless Chromium and DevTools client."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pictures_browser", ROOT / "docs" / "pictures_browser.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CARD_TITLES = r"""
(() => {
  const deep = (root, f) => { for (const el of root.querySelectorAll('*')) { f(el); if (el.shadowRoot) deep(el.shadowRoot, f); } };
  const cards = [];
  deep(document, (el) => { const t = el.tagName.toLowerCase();
    if (t.startsWith('tf-custom-scalar-') && t.endsWith('-card')) { const r = el.getBoundingClientRect(); cards.push([r.y, r.x, el.title]); } });
  return cards.sort((a, b) => a[0] - b[0] || a[1] - b[1]).map((c) => c[2]);
})()
"""


@needs_chromium
def test_the_custom_scalars_page_draws_the_open_category_in_the_order_layout_drawn_order_says(tensorboard, tmp_path):
    from headwatch.tensorboard.layout import drawn_order

    pictures = _pictures_module()
    layout = json.loads(_get(f"{tensorboard}/data/plugin/custom_scalars/layout"))  # merged over the runs by TensorBoard
    expected = [c["title"] for c in drawn_order(layout["category"][0]["chart"])]
    with pictures.chromium(CHROMIUM, tmp_path / "profile") as tools:
        pictures.open_page(tools, f"{tensorboard}/?darkMode=false#custom_scalars")
        deadline = time.monotonic() + 120
        while (titles := tools.evaluate(_CARD_TITLES)) != expected and time.monotonic() < deadline:
            time.sleep(2)
    assert titles == expected  # only the open category's cards are drawn; margin charts after Multiline, reversed


@needs_chromium
def test_headless_chromium_screenshot_of_the_custom_scalars_page(tensorboard, tmp_path):
    shot = _screenshot(tensorboard, "custom_scalars", tmp_path, "dashboard.png")
    print(f"\nscreenshot of the CUSTOM SCALARS page: {shot}")


# ---------------------------------------------------------------- the headwatch tab's routes
def test_the_plugin_is_found_through_its_entry_point_and_lists_the_runs(tensorboard):
    listing = json.loads(_get(f"{tensorboard}/data/plugins_listing"))
    assert listing["headwatch"]["enabled"] and listing["headwatch"]["loading_mechanism"] == {
        "type": "IFRAME", "module_path": "/data/plugin/headwatch/index.js"}
    runs = _route(tensorboard, "runs")["runs"]
    watched = next(r for r in runs if r["run"] == WATCHED)
    assert watched == {"run": WATCHED, "prefix": "headwatch", "rl": False, "synonyms": True, "alerts": True, "collision": True}
    script = _get(f"{tensorboard}/data/plugin/headwatch/index.js").decode()
    assert "export async function render" in script and not re.search(r"https?://(?!www\.w3\.org/2000/svg)", script)


def test_vitals_are_the_event_files_values_unsmoothed(tensorboard, logdir):
    for run in _runs(tensorboard):
        acc = _acc(logdir, run)
        scalars = set(acc.Tags()["scalars"])
        answer = _route(tensorboard, "vitals", run)
        assert [p["key"] for p in answer["panels"]] == ["entropy", "nll", "density", "collision"]
        for panel in answer["panels"]:
            assert panel["series"], (run, panel["key"])
            for series in panel["series"]:
                tags = series["tag"].split("+")
                assert set(tags) <= scalars
                read = [{e.step: e.value for e in acc.Scalars(t)} for t in tags]
                steps = sorted(set.intersection(*(set(r) for r in read)))
                assert series["points"] == [[s, sum(r[s] for r in read)] for s in steps], (run, series["label"])
        labels = {s["label"] for p in answer["panels"] for s in p["series"]}
        assert {"entropy, train (mean)", "p05", "p95", "target NLL, train (headwatch)", "the trainer's loss, train",
                "embedding, lookup flow", "head, scoring flow", "collision rate, head (drift removed)"} <= labels


def test_alerts_timeline_holds_each_marker_with_its_message(tensorboard, logdir):
    acc = _acc(logdir, WATCHED)
    markers = sorted((e.step, t.rsplit("/", 1)[1]) for t in acc.Tags()["scalars"] if t.startswith("headwatch/alerts/")
                     for e in acc.Scalars(t) if e.value == 1.0)  # fmt: skip
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("headwatch/alerts/text_summary")]
    assert {m for _, m in markers} == {"entropy_floor", "entropy_floor_warning"}
    answer = _route(tensorboard, "alerts", WATCHED)
    got = [(a["step"], a["rule"] + ("" if a["severity"] == "critical" else "_" + a["severity"])) for a in answer["alerts"]]
    assert sorted(got) == markers
    for a in answer["alerts"]:  # each marker carries the message written at its step with its severity...
        if a["message"] is not None:
            assert (a["step"], f"[{a['severity']}] {a['message']}") in texts
        else:  # ...unless TensorBoard's data server kept only the other text of that step (one a tag and step)
            assert "one text per tag and step" in a["note"]
            assert (a["step"], f"[{a['severity']}]") in [(s, t.split(" ", 1)[0]) for s, t in texts]
            assert any(b["step"] == a["step"] and b["message"] for b in answer["alerts"])
    assert answer["last_step"] == acc.Scalars("headwatch/logits/entropy")[-1].step


def test_collision_table_decodes_the_tokens_and_their_nearest_rows(tensorboard, logdir):
    acc = _acc(logdir, WATCHED)
    events = acc.Tensors("headwatch/collision/top_pairs_head/text_summary")
    answer = _route(tensorboard, "collisions", WATCHED)
    head = [t for t in answer["tables"] if t["matrix"] == "head"]
    assert [t["step"] for t in head] == sorted((e.step for e in events), reverse=True)
    latest = events[-1].tensor_proto.string_val[0].decode()
    rows = [line for line in latest.splitlines() if line.startswith("| ") and not line.startswith("| rare token")]
    assert head[0]["pairs"] and len(head[0]["pairs"]) == len(rows)  # tau = -1: every measured rare token collides
    for pair, line in zip(head[0]["pairs"], rows):
        assert pair["text"] == token_text(pair["token"]) and pair["neighbour_text"] == token_text(pair["neighbour"])
        assert line.startswith(f"| {pair['token']} ") and f"| {pair['neighbour']} " in line
        assert f"| {pair['cosine']:.4f} |" in line and line.endswith(f"| {pair['raw_cosine']:.4f} |")


def test_verdicts_equal_headwatch_report_json(tensorboard, logdir):
    done = subprocess.run([sys.executable, "-m", "headwatch", "report", str(logdir), "--json"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    assert done.returncode == 0, done.stderr
    expected = json.loads(done.stdout)
    expected.pop("notes", None)
    answer = _route(tensorboard, "verdicts")
    assert answer["available"] is True
    assert answer["verdicts"] == expected
    runs = [r for side in expected["sides"].values() for r in side["runs"]]
    assert sorted(runs) == sorted(_runs(tensorboard)) and len(expected["headlines"]) >= 5


# ---------------------------------------------------------------- the headwatch tab in a browser
class _Text(HTMLParser):
    """The text of every element with a ``data-label`` and of the tables' cells, in document order."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: list[str] = []
        self.cells: list[str] = []
        self.body: dict[str, str] = {}
        self._cell = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        if "data-label" in attrs and tag == "li":
            self.labels.append(attrs["data-label"])
        if tag == "td":
            self._cell = ""

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self.cells.append(self._cell)
            self._cell = None


def _chromium(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         f"--user-data-dir={tmp_path / 'chromium'}", *args],
        check=True, capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def _screenshot(base: str, tab: str, tmp_path: Path, name: str, height: int = 1100) -> Path:
    from PIL import Image

    out_dir = Path(os.environ.get("HEADWATCH_ARTIFACTS", ROOT / "artifacts"))
    out_dir.mkdir(parents=True, exist_ok=True)
    shot = out_dir / name
    shot.unlink(missing_ok=True)
    _chromium(["--window-size=1400," + str(height), "--virtual-time-budget=20000", f"--screenshot={shot}",
               f"{base}/?darkMode=false#{tab}"], tmp_path)  # fmt: skip
    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, height)
    colors = image.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 300, "the page looks blank"
    assert image.getpixel((10, 10))[0] > 200 and image.getpixel((10, 10))[2] < 100  # TensorBoard's orange header
    return shot


@needs_chromium
def test_the_tabs_entry_page_renders_alone(tensorboard, logdir, tmp_path):
    dom = _chromium(["--virtual-time-budget=20000", "--dump-dom", f"{tensorboard}/data/plugin_entry.html?name=headwatch"],
                    tmp_path).stdout  # fmt: skip
    page = _Text()
    page.feed(dom)
    assert page.body.get("data-state") == "ready", dom[-2000:]
    assert page.body.get("data-runs") == "2"  # alone, every run with headwatch tags is shown
    for label in ("entropy, train (mean)", "p05-p95 band", "log V: uniform (entropy + KL(p ‖ U))", "the trainer's loss, train",
                  "embedding, lookup flow", "head, scoring flow", "1: every row (a softmax head's flow)",
                  "collision rate, head (drift removed)"):  # fmt: skip
        assert page.labels.count(label) == 2, label  # one legend a run
    alerts = _route(tensorboard, "alerts", WATCHED)["alerts"]
    for a in alerts:
        assert (a["message"] or f"({a['note']})") in page.cells
    pairs = _route(tensorboard, "collisions", WATCHED)["tables"][0]["pairs"]
    assert json.dumps(pairs[0]["text"]) in page.cells and json.dumps(pairs[0]["neighbour_text"]) in page.cells
    assert 'id="verdicts"' in dom


@needs_chromium
def test_headless_chromium_screenshot_of_the_headwatch_tab(tensorboard, tmp_path):
    shot = _screenshot(tensorboard, "headwatch", tmp_path, "headwatch_tab.png", height=2000)
    print(f"\nscreenshot of the headwatch tab: {shot}")
