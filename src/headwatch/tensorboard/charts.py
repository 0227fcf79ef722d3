"""Every chart of headwatch's TensorBoard views, declared once from the names of :mod:`headwatch.names` (no torch import).

Two views read these declarations:

- the CUSTOM SCALARS layout (:data:`CATEGORIES`, :data:`CHARTS`; written by :mod:`headwatch.tensorboard.layout`).
  TensorBoard colours a custom-scalars chart by run and tells the tags of one run apart only by small marker
  shapes, so every chart draws **one series a run** (one Multiline regex that matches one tag a run, or one
  ``Line``) or **one margin band** (value, lower, upper). A ``Line`` is written as a margin chart whose band has
  no width (value = lower = upper): TensorBoard draws margin charts unsmoothed, which a sparse series needs (a
  collision rate measured every 10 logging steps, 1.07e-3 logged, was drawn at 8.7e-4 by the default
  smoothing), and it draws a category's margin charts after its Multiline charts, whatever the layout's
  order: the vital signs are all margin charts, so they keep their order, and each category declares its
  Multiline charts first. A run's layout holds only the charts whose tags the run wrote
  (:func:`headwatch.tensorboard.layout.LayoutTracker`): no RL category outside RL runs, no synonym chart without
  synonym groups, one chart per alert rule that fired. The first category, the vital signs, is open; the others
  start closed.
- the headwatch tab (:mod:`headwatch.integrations.tensorboard_plugin`): :data:`PANELS`, the vital signs again, each with
  several named series and its references, drawn unsmoothed.

Names are after ``<prefix>/`` (``headwatch/``, or ``train/headwatch/`` for the Hugging Face Trainer); a name
starting with ``^`` is a whole-tag regex of the trainer's own (``train_loss``, ``eval/loss``).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from headwatch.names import ALERT_RULES

_MATRICES = (("embedding", "embedding"), ("head", "head"), ("shared", "tied matrix"))
"""``{flow}``/``{matrix}`` values with their words in a title."""


class Category(NamedTuple):
    """One category (a collapsible section) of the CUSTOM SCALARS page."""

    key: str
    title: str
    """Shown after the page name: ``headwatch: vital signs``."""
    closed: bool
    """Whether the section starts closed (``layout_pb2.Category.closed``)."""


CATEGORIES: tuple[Category, ...] = (
    Category("vital", "vital signs", False),
    Category("entropy", "entropy and sharpness", True),
    Category("loss", "loss and calibration", True),
    Category("gradients", "gradients and updates", True),
    Category("collision", "collision", True),
    Category("check", "self-check", True),
    Category("rl", "RL fine-tuning", True),
    Category("cost", "cost", True),
)
"""The categories in page order: the vital signs first and open, the others closed."""


class Chart(NamedTuple):
    """One chart of the CUSTOM SCALARS page: one series a run, or one margin band."""

    title: str
    """With the unit in parentheses when there is one."""
    kind: str
    """``Multiline`` (one regex, smoothed by the page's slider), ``Line`` (one exact tag, unsmoothed) or
    ``Margin`` (exact value, lower, upper, unsmoothed)."""
    series: tuple[str, ...]
    """Multiline: one declared name (or a ``^...`` regex of the trainer's tags); Line: one declared name;
    Margin: value, lower, upper."""
    category: str
    """Key of its :class:`Category`."""


def _one(category: str, title: str, name: str) -> Chart:
    return Chart(title, "Multiline", (name,), category)


def _line(category: str, title: str, name: str) -> Chart:
    return Chart(title, "Line", (name,), category)


def _band(category: str, title: str, value: str, low: str, high: str) -> Chart:
    return Chart(title, "Margin", (value, low, high), category)


_SPLITS = (("logits", "train"), ("val/logits", "validation"))

CHARTS: tuple[Chart, ...] = (
    # ---- the vital signs, in reading order
    _band("vital", "entropy, train: mean and p05-p95 band (nats)", "logits/entropy", "logits/entropy_p05", "logits/entropy_p95"),
    _line("vital", "target NLL minus the trainer's loss, train (nats; 0: they agree)", "check/nll_gap"),
    _line("vital", "gradient row density: embedding, lookup flow (fraction of rows)", "grad/embedding_row_density"),
    _line("vital", "gradient row density: head, scoring flow (fraction of rows)", "grad/head_row_density"),
    _line("vital", "collision rate beyond drift: head (fraction of rare rows)", "collision/rare_rate_head"),
    *(_line("vital", f"alert: {rule} (1 at each alert step)", f"alerts/{rule}") for rule in ALERT_RULES),
    *(_line("vital", f"alert warning: {rule} (1 at each warning step)", f"alerts/{rule}_warning") for rule in ALERT_RULES),
    # ---- entropy and sharpness (Multiline first: TensorBoard draws the bands after them)
    *(_one("entropy", f"Rényi-2 entropy, {where} (nats)", f"{s}/renyi2_entropy") for s, where in _SPLITS),
    *(_one("entropy", f"sharpness KL(p ‖ U) = log V - entropy, {where} (nats)", f"{s}/kl_to_uniform") for s, where in _SPLITS),
    *(_one("entropy", f"KL(U ‖ p), {where} (nats)", f"{s}/kl_from_uniform") for s, where in _SPLITS),
    _band("entropy", "entropy, validation: mean and p05-p95 band (nats)",
          "val/logits/entropy", "val/logits/entropy_p05", "val/logits/entropy_p95"),
    *(_band("entropy", f"top-1 probability, {where}: mean and p05-p95 band", f"{s}/max_prob", f"{s}/max_prob_p05",
            f"{s}/max_prob_p95") for s, where in _SPLITS),
    # ---- loss and calibration
    _one("loss", "target NLL, train (nats)", "logits/target_nll"),
    _one("loss", "the trainer's loss, train (nats)", "^(train_loss|train/loss)$"),
    _one("loss", "target NLL, validation (nats)", "val/logits/target_nll"),
    _one("loss", "the trainer's loss, validation (nats)", "^(val_loss|eval/loss)$"),
    *(_one("loss", f"target NLL of rare targets, {where} (nats)", f"{s}/rare/target_nll") for s, where in _SPLITS),
    *(_one("loss", f"calibration ECE, {where}", f"{s}/ece") for s, where in _SPLITS),
    *(_one("loss", f"over-confidence (confidence - accuracy), {where}", f"{s}/overconfidence") for s, where in _SPLITS),
    # ---- gradients and updates
    _one("gradients", "gradient row density: tied matrix, both flows (fraction of rows)", "grad/shared_row_density"),
    *(_one("gradients", f"update row density: {w} (fraction of rows the optimizer moved)", f"update/{m}_row_density")
      for m, w in _MATRICES),
    _one("gradients", "tied matrix: mean cosine of the lookup and scoring flows", "grad/tied_flow_cosine_mean"),
    _one("gradients", "tied matrix: fraction of rows whose two flows pull apart", "grad/tied_flow_conflict_fraction"),
    *(_one("gradients", f"rare / frequent gradient norm ratio: {w}", f"grad/{m}_rare_to_frequent_norm_ratio")
      for m, w in _MATRICES),
    *(_one("gradients", f"frequency gravity: Spearman(log frequency, row norm), {w}", f"freq/{m}_norm_spearman")
      for m, w in _MATRICES),
    # ---- collision
    _line("collision", "collision rate beyond drift: embedding (fraction of rare rows)", "collision/rare_rate_embedding"),
    *(_line("collision", f"common drift: raw rate, cosine >= tau before the drift is removed, {m} (fraction)",
           f"collision/drift/raw_rate_{m}") for m in ("head", "embedding")),
    *(_line("collision", f"common drift: mean cosine of rare rows to their mean direction, {m}", f"collision/drift/mean_cos_{m}")
      for m in ("head", "embedding")),
    *(_line("collision", f"nearest-neighbour cosine of rare rows, drift removed, {m}", f"collision/rare/{m}_nn_cosine_mean")
      for m in ("head", "embedding")),
    *(_line("collision", f"synonym pair rate, {m} (fraction of pairs)", f"collision/synonym_pair_rate_{m}") for m in ("head", "embedding")),
    *(_line("collision", f"synonym partner rank, {m} (median; 1 = nearest)", f"collision/synonym_partner_rank_{m}")
      for m in ("head", "embedding")),
    _line("collision", "synonym confusion rate, train (fraction of positions)", "collision/synonym_confusion_rate"),
    _line("collision", "synonym confusion rate, validation (fraction of positions)", "collision/val/synonym_confusion_rate"),
    # ---- the self-check's other figures
    _line("check", "self-check: mismatch (1: a gap beyond its tolerance)", "check/mismatch"),
    _line("check", "self-check: vanished head gradient (1: all zero next to a finite loss)", "check/vanished_gradient"),
    _line("check", "self-check: entropy minus TRL's entropy (nats)", "check/entropy_gap"),
    _line("check", "self-check: token accuracy minus TRL's mean_token_accuracy", "check/accuracy_gap"),
    # ---- RL fine-tuning
    _one("rl", "RL: sampled tokens' NLL at the sampling temperature (nats)", "rl/sampled_nll"),
    _one("rl", "RL: fraction of sampled tokens that were the top-1", "rl/sampled_top1_rate"),
    _one("rl", "RL: rare sampled tokens' part of the entropy (nats)", "rl/entropy_share/rare"),
    _one("rl", "RL: rare tokens' share of the entropy lost since the start", "rl/rare_share_of_entropy_drop"),
    # ---- headwatch's own cost (overhead budget)
    _one("cost", "headwatch's share of wall time since the last logging step", "overhead/fraction"),
    _line("cost", "headwatch's share of wall time over the run", "overhead/fraction_run"),
    _line("cost", "steps between probes (collision, figures, histograms)", "overhead/probe_interval"),
)  # fmt: skip
"""Every chart a run can get, in page order within each category."""


def chart_tag(series: str, kind: str, prefix: str = "headwatch") -> str:
    """A chart entry as TensorBoard wants it: a regex (Multiline, matched from the tag's start) or an exact
    tag (Line, Margin).

    A validation name (``val/...``) also matches its evaluations' names: Lightning's ``/dataloader_idx_<k>``,
    the HF Trainer's ``/<metric_key_prefix>`` (one line each: one series a dataloader)."""
    if series.startswith("^"):
        return series
    if kind in ("Margin", "Line"):
        return f"{prefix}/{series}"
    named = r"(/\w+)?" if series.startswith(("val/", "collision/val/")) else ""
    return re.escape(f"{prefix}/") + re.sub(r"\{\w+\}", r"\\w+", series) + named + "$"


class Series(NamedTuple):
    """One named line of a :class:`Panel` of the headwatch tab."""

    label: str
    """Its name in the legend."""
    names: tuple[str, ...]
    """Declared names (after the prefix) or ``^...`` whole-tag regexes; the first a run has is drawn."""
    style: str = "line"
    """``line``, ``band_low`` / ``band_high`` (the band around the panel's first line), ``points`` (sparse:
    markers, no smoothing, lines between measurements) or ``reference`` (dashed)."""
    plus: tuple[str, ...] = ()
    """Names whose values are added to the drawn one, step by step (``log V = entropy + KL(p ‖ U)``)."""


class Panel(NamedTuple):
    """One vital sign of the headwatch tab: several named series on one chart, with references."""

    key: str
    title: str
    unit: str
    series: tuple[Series, ...]
    reference: tuple[float, str] | None = None
    """A constant reference line ``(value, label)``, drawn dashed."""
    note: str = ""
    """What healthy looks like (one sentence under the chart)."""


PANELS: tuple[Panel, ...] = (
    Panel("entropy", "entropy of the next-token distribution", "nats", (
        Series("entropy, train (mean)", ("logits/entropy",)),
        Series("p05", ("logits/entropy_p05",), "band_low"),
        Series("p95", ("logits/entropy_p95",), "band_high"),
        Series("entropy, validation (mean)", ("val/logits/entropy",), "points"),
        Series("log V: uniform (entropy + KL(p ‖ U))", ("logits/entropy",), "reference", plus=("logits/kl_to_uniform",)),
    ), note="healthy: a fast fall from log V, then slow, the p05-p95 band wide; collapse: mean and band fall to near 0"),
    Panel("nll", "target NLL against the trainer's loss", "nats", (
        Series("target NLL, train (headwatch)", ("logits/target_nll",)),
        Series("the trainer's loss, train", ("^(train_loss|train/loss)$", "debug/check/reference_nll"), "reference"),
        Series("target NLL, validation (headwatch)", ("val/logits/target_nll",), "points"),
        Series("the trainer's loss, validation", ("^(val_loss|eval/loss)$",), "points"),
    ), note="healthy: headwatch's NLL on the trainer's loss (the self-check's gap is float32 rounding)"),
    Panel("density", "gradient row density: embedding vs head", "fraction of rows", (
        Series("embedding, lookup flow", ("grad/embedding_row_density",)),
        Series("head, scoring flow", ("grad/head_row_density",)),
        Series("tied matrix, both flows", ("grad/shared_row_density",)),
    ), reference=(1.0, "1: every row (a softmax head's flow)"),
        note="healthy: the head (and a tied matrix) at 1; the embedding at the batch's share of the vocabulary"),
    Panel("collision", "rare-token collision rate beyond drift", "fraction of rare rows", (
        Series("collision rate, head (drift removed)", ("collision/rare_rate_head",), "points"),
        Series("collision rate, embedding (drift removed)", ("collision/rare_rate_embedding",), "points"),
        Series("raw rate, head: common drift, not collision", ("collision/drift/raw_rate_head",), "reference"),
    ), reference=(0.0, "0: no rare row merges with another"),
        note="measured on probe steps; healthy: near 0 (the raw rate can be high: that is the common drift)"),
)  # fmt: skip
"""The vital signs of the headwatch tab, in reading order (the alerts timeline follows them)."""
