"""Make every picture under ``docs/`` from real runs of the current code.

What it does, in order:

1. trains four small runs of ``examples/train_tiny_lm.py`` (the README's example job, on the
   standard library's ``*.py`` files; 200 steps each, d_model 64, a 2,048-token BPE vocabulary):
   ``tied`` and ``untied`` (healthy), ``collapse`` (``--induce-collapse 100 --collapse-weight 2``: from step 100
   the loss adds twice the mean prediction entropy) and ``broken`` (two capture faults, see ``BrokenCaptureLM`` below);
2. runs ``examples/grpo_collapse.py --plot`` (TRL's GRPO on a tiny Llama: the collapse and the
   entropy-bonus remedy) for ``docs/rl_collapse.png``;
3. writes ``headwatch report --html --charts png`` of the four runs;
4. writes the table of ``docs/dashboard.md`` that says, for every chart of the CUSTOM SCALARS pages, what
   the healthy runs and the collapsing run logged (between its ``<!-- chart table`` markers);
5. starts TensorBoard on the runs and headless Chromium, drives Chromium over the DevTools protocol
   (``docs/pictures_browser.py``: a WebSocket, standard library only) and saves screenshots of the CUSTOM
   SCALARS pages, of chosen charts of them, of the headwatch tab, of the IMAGES tab and of the report page.

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

Takes a few minutes on 2 CPU cores (see ``docs/dashboard.md``, "Making the pictures", for the last
measured time); ``--reuse`` skips the training. The runs are
deterministic (seeded), and every number in the pictures is what this code logged in them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pictures_browser as browser  # noqa: E402 - beside this script
from pictures_browser import WIDTH, HEIGHT, compose, open_page, save_png, say, wait_for_cards, wait_for_images  # noqa: E402

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
    "img/headwatch_tab.png": "the headwatch tab of TensorBoard (the plugin), runs tied, untied and collapse",
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
            "entropy, train: mean and p05-p95 band (nats)",
            "target NLL minus the trainer's loss, train (nats; 0: they agree)",
            "gradient row density: embedding, lookup flow (fraction of rows)",
            "gradient row density: head, scoring flow (fraction of rows)",
            "collision rate beyond drift: head (fraction of rare rows)",
            "target NLL, validation (nats)",
        ],
    ),
    "img/collapse.png": (
        "collapse",
        [
            "entropy, train: mean and p05-p95 band (nats)",
            "alert: entropy_drop (1 at each alert step)",
            "alert: entropy_floor (1 at each alert step)",
            "top-1 probability, train: mean and p05-p95 band",
            "the trainer's loss, train (nats)",
            "the trainer's loss, validation (nats)",
        ],
    ),
    "img/broken_capture.png": (
        "broken",
        [
            "target NLL minus the trainer's loss, train (nats; 0: they agree)",
            "self-check: mismatch (1: a gap beyond its tolerance)",
            "self-check: vanished head gradient (1: all zero next to a finite loss)",
            "gradient row density: head, scoring flow (fraction of rows)",
            "gradient row density: tied matrix, both flows (fraction of rows)",
            "update row density: tied matrix (fraction of rows the optimizer moved)",
        ],
    ),
}
"""Composite picture -> (run, titles of charts of the CUSTOM SCALARS pages, in reading order)."""

TABLE_RUNS = ("tied", "untied", "collapse")
"""The runs the chart table of ``docs/dashboard.md`` describes: the healthy ones and the collapsing one."""


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


def _cell(points: list[tuple[int, float]], alerts: bool) -> str:
    """A run's values of one chart: at the first logged step, at step 99 (the last step before the collapse
    begins) and at the last step; an alert chart: the steps it fired at."""
    if not points:
        return "—"
    if alerts:
        return "fired at step " + ", ".join(str(s) for s, v in points if v == 1.0)

    def fmt(v: float) -> str:
        return "NaN" if math.isnan(v) else f"{v:.3g}" if v == 0 or 1e-3 <= abs(v) < 1e4 else f"{v:.2e}"

    picked = [points[0], max((p for p in points if p[0] <= 99), default=points[0]), points[-1]]
    unique = [p for i, p in enumerate(picked) if p not in picked[:i]]
    return " → ".join(f"{fmt(v)} ({s})" for s, v in unique)


def chart_table(logdir: Path) -> str:
    """The Markdown table of ``docs/dashboard.md``: for every chart of the CUSTOM SCALARS pages, what the runs of
    :data:`TABLE_RUNS` logged (read back from their event files), then the charts none of them has."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from headwatch.tensorboard.charts import CATEGORIES, CHARTS, chart_tag

    scalars: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for name in TABLE_RUNS:
        acc = EventAccumulator(str(logdir / name / "version_0"), size_guidance={"scalars": 0})
        acc.Reload()
        scalars[name] = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}

    def points(chart: Any, run: str) -> list[tuple[int, float]]:
        tag = chart_tag(chart.series[0], chart.kind)
        if chart.kind == "Multiline":
            tag = next((t for t in sorted(scalars[run]) if re.match(tag, t)), "")
        return scalars[run].get(tag, [])

    def band(chart: Any, run: str) -> str:
        low, high = (scalars[run].get(f"headwatch/{s}", []) for s in chart.series[1:])
        return f"; p05-p95 at step {low[-1][0]}: {low[-1][1]:.3g}-{high[-1][1]:.3g}" if low and high else ""

    lines = ["| chart | " + " | ".join(TABLE_RUNS) + " |", "|---|" + "---|" * len(TABLE_RUNS)]
    absent = []
    for category in CATEGORIES:
        rows = []
        for chart in (c for c in CHARTS if c.category == category.key):
            found = {run: points(chart, run) for run in TABLE_RUNS}
            if not any(found.values()):
                absent.append(chart.title)
                continue
            cells = [_cell(found[run], chart.series[0].startswith("alerts/")) + (band(chart, run) if chart.kind == "Margin" and found[run] else "")
                     for run in TABLE_RUNS]  # fmt: skip
            rows.append(f"| {chart.title} | " + " | ".join(cells) + " |")
        if rows:
            lines += [f"| **{category.title}** |" + " |" * len(TABLE_RUNS), *rows]
    return "\n".join(lines) + "\n\nNot in these runs (no tag, so no chart): " + " · ".join(absent) + "."


TABLE_MARKERS = ("<!-- chart table: generated by docs/make_pictures.py from its runs; do not edit -->",
                 "<!-- end of chart table -->")  # fmt: skip


def write_chart_table(logdir: Path, page: Path) -> None:
    """Replace the text between :data:`TABLE_MARKERS` of ``page`` (``docs/dashboard.md``) by :func:`chart_table`."""
    text = page.read_text(encoding="utf-8")
    start, end = (text.index(m) for m in TABLE_MARKERS)
    page.write_text(text[: start + len(TABLE_MARKERS[0])] + "\n\n" + chart_table(logdir) + "\n\n" + text[end:], encoding="utf-8")
    say(f"wrote the chart table of {page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}")


def _category_titles(titles: Sequence[str]) -> list[str]:
    from headwatch.tensorboard.charts import CATEGORIES, CHARTS

    keys = {c.category for c in CHARTS if c.title in titles}
    return [f"headwatch: {c.title}" for c in CATEGORIES if c.key in keys]


def view(logdir: Path, runs: Sequence[str], workdir: Path) -> Path:
    """A log directory holding only ``runs`` (their files hard-linked): TensorBoard's CUSTOM SCALARS page shows the
    union of the layouts of every run it serves, whichever runs are ticked, so each picture gets its own."""
    out = workdir / "views" / "+".join(runs)
    shutil.rmtree(out, ignore_errors=True)
    for run in runs:
        shutil.copytree(logdir / run, out / run, copy_function=os.link)
    return out


def screenshots(logdir: Path, workdir: Path, binary: str, report_html: Path, docs: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="headwatch_chromium_", ignore_cleanup_errors=True) as profile, \
            browser.chromium(binary, Path(profile)) as tools:  # fmt: skip
        page = "/?darkMode=false#custom_scalars&_smoothingWeight=0"
        # the whole page, healthy runs tied and untied: the vital signs open, the other categories closed
        with browser.tensorboard(view(logdir, ["tied", "untied"], workdir), runs=2) as base:
            open_page(tools, base + page)
            wait_for_cards(tools, CARDS["img/healthy.png"][1][:5])
            save_png(tools.screenshot(0, 0, WIDTH, 1500), docs / "dashboard.png")
        # chosen charts of one run
        for picture, (run, titles) in CARDS.items():
            with browser.tensorboard(view(logdir, [run], workdir)) as base:
                open_page(tools, base + page)
                wait_for_cards(tools, titles[:1])
                tools.evaluate(browser.OPEN_CATEGORIES_JS % json.dumps(_category_titles(titles)))
                wait_for_cards(tools, titles)
                tools.evaluate(browser.KEEP_OUTLIERS_JS)
                tools.evaluate(browser.OPEN_MATCHES_JS % json.dumps(titles))
                cards = {c["title"]: c for c in wait_for_cards(tools, titles)}
                shots = [tools.screenshot(cards[t]["x"], cards[t]["y"], cards[t]["w"], cards[t]["h"]) for t in titles]
            command = "examples/train_tiny_lm.py " + " ".join(RUNS[run]) if RUNS[run] else "examples/train_tiny_lm.py"
            save_png(compose(shots, f"run {run}/version_0 ({command}), TensorBoard's CUSTOM SCALARS pages, outliers kept"),
                     docs / picture)
        # the headwatch tab (the plugin) of the healthy runs and the collapsing one, three charts a row
        with browser.tensorboard(view(logdir, ["collapse", "tied", "untied"], workdir), runs=3) as base:
            tools.call("Emulation.setDeviceMetricsOverride", width=1540, height=HEIGHT, deviceScaleFactor=1, mobile=False)
            open_page(tools, f"{base}/?darkMode=false#headwatch")
            tab = browser.wait_for_headwatch_tab(tools)
            save_png(tools.screenshot(0, 0, 1540, min(HEIGHT, tab["y"] + tab["height"])), docs / "img" / "headwatch_tab.png")
            tools.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1, mobile=False)
        # IMAGES tab of the healthy runs
        with browser.tensorboard(logdir, runs=len(RUNS)) as base:
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
    binary = browser.find_chromium(args.chromium)
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
        write_chart_table(logdir, DOCS / "dashboard.md")
        say("TensorBoard and Chromium: screenshots")
        screenshots(logdir, workdir, binary, report_html, docs)
    import resource

    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))  # fmt: skip
    say(f"done in {time.perf_counter() - t0:.0f} s ({cpu:.0f} CPU seconds, this process and its children): "
        + ", ".join(PICTURES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
