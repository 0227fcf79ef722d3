"""Every metric headwatch emits, declared once (no torch import).

A declaration gives the name pattern (after ``<prefix>/``), the unit, the definition and
the kind (``scalar``, ``histogram``, ``text``, ``image``). Placeholders in braces take the
values of :data:`PLACEHOLDERS`. The TensorBoard charts (:mod:`headwatch.tensorboard.charts`, written by
:mod:`headwatch.tensorboard.layout`), ``headwatch report``'s groups and default selection
(:data:`GROUPS`, :func:`is_headline`), the alert's default metrics and the metric reference derive
from or are tested against this module: a new metric is one :class:`Metric` line here. Generated from
it: the documentation site's metric reference, ``docs/reference/metrics.md`` (:func:`reference_page`,
``python -m headwatch.names --reference docs/reference/metrics.md``: key, unit, definition, formula,
source, on which steps and through which front doors it is published) and the "Logged metrics" list of
:class:`headwatch.LogitStatsMonitor` (:func:`logged_metrics`).
"""

from __future__ import annotations

import functools
import itertools
import re
from typing import NamedTuple

BUCKETS = ("top1", "top10", "top50", "tail", "unseen")
"""Frequency buckets by count rank among the seen valid tokens."""

STATS = ("mean", "max", "p50", "p95")
"""Summary statistics of per-row norms."""

ALERT_RULES = ("entropy_floor", "entropy_ceiling", "kl_ceiling", "entropy_drop", "val_stall", "rare_nll_rise")
"""The rules of :class:`headwatch.SharpnessCollapseAlert` (``headwatch.alerts.RULES`` is this tuple)."""

PLACEHOLDERS: dict[str, tuple[str, ...]] = {
    "split": ("logits", "val/logits"),
    "flow": ("embedding", "head", "shared"),
    "matrix": ("embedding", "head", "shared"),
    "bucket": (*BUCKETS, "rare"),
    "m": ("head", "embedding"),
    "stat": STATS,
    "q": ("05", "50", "95"),
    "rule": ALERT_RULES,
    "dim": ("vocab_size", "hidden_size"),
}


DOORS: dict[str, str] = {"lightning": "Lightning", "hf": "HF", "loop": "loop"}
"""The front doors (key: how :attr:`Metric.doors` names it; value: how the reference page spells it)."""


class Metric(NamedTuple):
    """One metric (or one family of metrics, through placeholders) and what the documentation says of it."""

    pattern: str
    """Name after ``<prefix>/``, with ``{placeholder}`` fields."""
    unit: str
    definition: str
    """What it means, in words (Markdown)."""
    monitor: str
    """Class that emits it."""
    kind: str = "scalar"
    headline: bool = True
    """Shown by ``headwatch report`` by default (False: only with ``--all``; see also :data:`DETAIL`)."""
    formula: str = ""
    """The formula, when :attr:`definition` (what it means, in words) does not give it."""
    source: str = ""
    """Where the definition comes from (authors and year), when it is not headwatch's own."""
    steps: str = ""
    """When it is published (Markdown), when not what :func:`steps_of` derives from the pattern."""
    doors: tuple[str, ...] = ()
    """The front doors that publish it (keys of :data:`DOORS`); empty: every door (see :func:`doors_of`)."""
    better: str | None = None
    """Its good direction when two settings are compared: ``"lower"``, ``"higher"``, or None (no preferred
    direction: ``headwatch report`` then gives the difference and no verdict word)."""

    def regex(self, prefix: str = "headwatch") -> re.Pattern[str]:
        """A regex matching the full names this declaration stands for.

        ``{split}`` names of validation may end in Lightning's ``/dataloader_idx_<k>`` (several
        validation dataloaders)."""
        parts = re.split(r"\{(\w+)\}", self.pattern)
        body = "".join(
            re.escape(p) if i % 2 == 0 else "(?:" + "|".join(map(re.escape, PLACEHOLDERS[p])) + ")"
            for i, p in enumerate(parts)
        )
        if self.pattern.startswith("{split}/"):
            body += r"(?:/dataloader_idx_\d+)?"
        return re.compile(re.escape(prefix) + "/" + body + "$")


_L, _G, _T, _C, _A = "LogitStatsMonitor", "GradientDensityMonitor", "TokenFrequency", "SynonymCollisionMonitor", "SharpnessCollapseAlert"
_O = "Overhead"
_HF = ("hf",)  # the Hugging Face Trainer / TRL front door only
_TRL_LOGS = "logging steps of a TRL trainer that logs the figure (`SFTTrainer`)"
_EVAL = "each validation epoch or evaluation whose model returns `outputs.loss` (self-check)"

METRICS: tuple[Metric, ...] = (
    # ---- logits (train: logits/, validation: val/logits/)
    # no preferred direction: a lower entropy is a sharper model or a collapsing one (the loss says which)
    Metric("{split}/entropy", "nats", "mean entropy of the next-token distribution", _L,
           formula="`H(p) = -sum_v p_v log p_v`, in `[0, log V]`; `0 log 0 = 0`", source="Shannon 1948", better=None),
    Metric("{split}/kl_to_uniform", "nats", "sharpness: distance from uniform", _L,
           formula="`KL(p ‖ U) = log V - H(p)`", source="Kullback and Leibler 1951"),
    Metric("{split}/kl_from_uniform", "nats", "the other direction, sensitive to near-zero probabilities", _L,
           formula="`KL(U ‖ p) = -log V - (1/V) sum_v log p_v` (`+inf` if a logit is `-inf`)"),
    Metric("{split}/renyi2_entropy", "nats",
           "mean Rényi entropy of order 2 (collision entropy): minus the log-probability that two independent draws "
           "from `p` agree; in `[0, H(p)]`, it weighs the large probabilities and barely sees the tail", _L,
           formula="`H_2(p) = -log sum_v p_v^2` (`-inf` logits add 0)", source="Rényi 1961"),
    Metric("{split}/entropy_p{q}", "nats", "quantiles of per-position entropy", _L,
           formula="linear interpolation (NumPy's default)"),
    Metric("{split}/max_prob", "probability", "mean top-1 probability", _L, formula="`max_v p_v`"),
    Metric("{split}/max_prob_p{q}", "probability", "quantiles of per-position top-1 probability", _L,
           formula="linear interpolation (NumPy's default)"),
    Metric("{split}/target_nll", "nats", "mean negative log-likelihood of the target (equals the CE loss)", _L,
           formula="`-log p_target`", better="lower"),
    Metric("{split}/target_argmax_rate", "fraction", "fraction of positions whose target has the largest logit", _L,
           formula="`x_target == max_v x_v`"),
    Metric("{split}/positions", "count", "measured positions", _L),
    Metric("{split}/nonfinite_positions", "count", "positions excluded for NaN/`+inf` logits", _L),
    Metric("{split}/invalid_target_positions", "count",
           "positions excluded for a target outside `[0, V)` (a vocabulary mismatch)", _L),
    Metric("{split}/padded_mass", "probability",
           "mean `sum_{v >= vocab_size} p_v` over measured positions: the softmax mass on columns beyond the tokenizer's "
           "vocabulary (with `vocab_size=`, else the shared `TokenFrequency`'s `vocab_size` when set); entropy stays "
           "that of the full softmax the loss uses", _L),
    Metric("{split}/ece", "probability", "expected calibration error of the top-1 prediction, M equal-width bins `B_m` (default 15, `ece_bins=`; the last bin closed: a confidence of 1.0 is in it)", _L,
           formula="`sum_m abs(sum_{n in B_m} (c_n - a_n)) / N`, `c_n = max_v p_v`, `a_n = [target is the argmax]`",
           source="Naeini et al. 2015; Guo et al. 2017", better="lower"),
    Metric("{split}/overconfidence", "probability", "over-confidence gap: confidence above accuracy", _L,
           formula="`mean c_n - mean a_n`"),
    Metric("{split}/rare/ece", "probability", "the ECE over positions whose target is rare", _L),
    Metric("{split}/rare/overconfidence", "probability", "the over-confidence gap over positions whose target is rare", _L),
    Metric("{split}/{bucket}/target_nll", "nats",
           "mean target NLL over positions whose **target** is in the frequency bucket (`TokenFrequency`'s buckets, and `rare`)",
           _L, formula="`-log p_target`", better="lower"),
    Metric("{split}/{bucket}/target_argmax_rate", "fraction", "token accuracy for those targets", _L,
           formula="`x_target == max_v x_v`"),
    Metric("{split}/{bucket}/max_prob", "probability", "mean confidence at those positions", _L, formula="`max_v p_v`"),
    Metric("{split}/{bucket}/positions", "count", "positions whose target is in the bucket", _L),
    Metric("{split}/{bucket}/entropy", "nats",
           "mean entropy at positions whose target is in the bucket (in RL: the sampled token's bucket)", _L,
           formula="`H(p) = -sum_v p_v log p_v`"),
    Metric("{split}/entropy_histogram", "nats", "histogram of per-position entropy (TensorBoard)", _L, kind="histogram"),
    Metric("logits/entropy_over_run", "", "image (matplotlib): the entropy distribution at every logging step so far", _L,
           kind="image"),
    # ---- RL fine-tuning (GRPO, RLOO; headwatch.core.rl; docs/rl.md), training logging steps of an RL run
    Metric("rl/sampled_nll", "nats",
           "NLL of the sampled completion tokens under the sampling distribution `softmax(logits / T)` (not a label NLL; "
           "`logits/target_nll` on an RL run)", _L, formula="`-log p_T(sampled token)`, TRL's `-per_token_logps`"),
    Metric("rl/sampled_top1_rate", "fraction", "sampled completion tokens that were the policy's top-1", _L),
    Metric("rl/temperature", "", "the sampling temperature `T` the statistics are measured at", _L),
    Metric("rl/entropy_share/{bucket}", "nats",
           "the bucket's part of `logits/entropy`: its share of completion positions times their mean entropy "
           "(by the sampled token's bucket); the buckets add up to `logits/entropy`, less the part of the positions "
           "whose sampled token is in no bucket (the embedding's `padding_idx` row, rows past `vocab_size`)", _L,
           formula="`(n_b / n) H_b`"),
    Metric("rl/rare_share_of_entropy_drop", "fraction",
           "the part of the entropy lost since the run's first RL logging step that rare sampled tokens account for "
           "(NaN while the entropy has not fallen by more than 1% of `H(start)`, a drop within noise; may leave [0, 1] "
           "when other buckets gained)", _L,
           formula="`(S_rare(start) - S_rare) / (H(start) - H)`, `S_rare` = `rl/entropy_share/rare`"),
    # ---- the self-check of a training logging step (headwatch.core.self_check; docs/self_check.md)
    Metric("debug/capture/forwards", "count", "self-check: forwards measured on the logging step, this process", _L),
    Metric("debug/capture/positions", "count", "self-check: positions measured (`logits/positions`)", _L),
    Metric("debug/capture/generation_forwards", "count",
           "self-check: forwards of the logging step made by a `generate()` call (an RL trainer sampling), not measured, "
           "this process", _L),
    Metric("debug/capture/no_grad_forwards", "count",
           "self-check: other forwards of the logging step left out (no gradient or eval mode: reference, old "
           "log-probability or metrics passes), this process", _L),
    Metric("debug/capture/labelled_positions", "count",
           "self-check: positions of the measured forwards' labels that predict a label, counted from the labels", _L,
           formula="`sum [target != ignore_index]`"),
    Metric("debug/check/reference_nll", "nats",
           "self-check: the trainer's own token-mean cross-entropy of the step's loss forwards (a Hugging Face "
           "model's `outputs.loss`, `step_end(loss=)`, Lightning's `compare_loss=` metric)", _L,
           formula="`sum_f loss_f w_f / sum_f n_f` (`w_f`: `num_items_in_batch`, else `n_f`)"),
    Metric("debug/check/reference_positions", "count", "self-check: labelled positions of the loss forwards (NaN: unknown)", _L),
    Metric("debug/check/reference_forwards", "count", "self-check: loss forwards read on the step (NaN: a step-level figure)", _L),
    Metric("check/nll_gap", "nats", "self-check: headwatch's target NLL minus the trainer's; beyond tolerance: warned once", _L,
           formula="`target_nll - reference_nll`, tolerance `atol + rtol abs(reference_nll)` by the dtype the loss scored: "
           "`atol = max(eps log V / 8, 1e-5)`, `rtol = max(1.28 eps, 1e-4)` (bf16: `rtol` 0.01)"),
    Metric("check/entropy_gap", "nats", "self-check: headwatch's entropy minus TRL's logged `entropy` of the step", _L,
           formula="tolerance `atol + rtol abs(entropy_TRL)`, as `check/nll_gap` with `atol` at least `5e-4`", steps=_TRL_LOGS, doors=_HF),
    Metric("check/accuracy_gap", "fraction",
           "self-check: `target_argmax_rate` minus TRL's logged `mean_token_accuracy` of the step", _L,
           formula="tolerance `0.02`", steps=_TRL_LOGS, doors=_HF),
    Metric("check/mismatch", "",
           "self-check: 1 when a gap is beyond its tolerance (or NaN while the reference is finite) or the labelled "
           "position counts differ at all, else 0; the step's `logits/*` figures are then withheld", _L),
    Metric("check/vanished_gradient", "",
           "self-check: 1 when the head's gradient is all zero (row density 0; a density below 1 alone is not) "
           "next to a finite, positive loss, else 0; the head's row densities are then withheld", _L),
    Metric("check/withheld", "count",
           "figures of the step withheld on every process, decided from values reduced over processes (a failed "
           "self-check's `logits/*`, a vanished gradient's row densities); 0 when none", _L),
    # ---- the self-check of an evaluation (the first validation dataloader; docs/self_check.md)
    Metric("val/debug/capture/forwards", "count", "evaluation self-check: forwards measured, this process", _L, steps=_EVAL),
    Metric("val/debug/capture/positions", "count", "evaluation self-check: positions measured (`val/logits/positions`)", _L, steps=_EVAL),
    Metric("val/debug/capture/labelled_positions", "count", "evaluation self-check: labelled positions of the measured forwards", _L,
           formula="`sum [target != ignore_index]`", steps=_EVAL),
    Metric("val/debug/check/reference_nll", "nats",
           "evaluation self-check: the token-mean of the model's own `outputs.loss` of its eval-mode forwards; NaN when "
           "a distributed split's repeated rows were left out of the capture", _L, steps=_EVAL),
    Metric("val/debug/check/reference_positions", "count", "evaluation self-check: labelled positions of those forwards", _L, steps=_EVAL),
    Metric("val/debug/check/reference_forwards", "count", "evaluation self-check: eval-mode forwards with a loss", _L, steps=_EVAL),
    Metric("val/check/nll_gap", "nats", "evaluation self-check: `val/logits/target_nll` minus the model's own loss", _L,
           formula="tolerance as `check/nll_gap`", steps=_EVAL),
    Metric("val/check/mismatch", "", "evaluation self-check: as `check/mismatch`; the evaluation's `val/logits/*` are then withheld", _L, steps=_EVAL),
    Metric("val/check/withheld", "count", "figures of the evaluation withheld on every process (a failed self-check's `val/logits/*`)", _L, steps=_EVAL),
    # ---- gradients
    Metric("grad/{flow}_row_density", "fraction", "|{i valid : G_i != 0}| / |valid|", _G),
    Metric("grad/{flow}_row_norm_{stat}", "gradient units", "statistics of ||G_i||_2 over valid rows", _G),
    Metric("grad/{bucket}/{flow}_row_density", "fraction", "row density within a frequency bucket", _G, headline=False),
    Metric("grad/{bucket}/{flow}_row_norm_{stat}", "gradient units", "row-norm statistics within a bucket", _G, headline=False),
    Metric("grad/{flow}_rare_to_frequent_norm_ratio", "ratio", "mean row norm of rare tokens / of the top1 bucket; NaN when the top1 mean is 0 (no top1 row had a gradient)", _G),
    # what untying costs is a price, not an outcome: no preferred direction
    Metric("grad/tied", "", "1 when head and embedding are one Parameter, else 0", _G, better=None),
    Metric("model/{dim}", "count", "the head's rows (`vocab_size`) and width (`hidden_size`), as its module declares them", _G, headline=False),
    Metric("grad/tied_flow_cosine_mean", "cosine", "mean cos(E_i, H_i) over rows with both flows", _G),
    # no preferred direction: it describes the tie (how often the two flows disagree), not what the model learned
    Metric("grad/tied_flow_conflict_fraction", "fraction", "rows with cos(E_i, H_i) < 0 / rows with both flows", _G, better=None),
    Metric("grad/tied_flow_rows", "count", "valid rows that get both flows", _G),
    Metric("update/{matrix}_row_density", "fraction", "valid rows with W_after,i != W_before,i / valid rows", _G),
    Metric("update/{matrix}_row_norm_{stat}", "weight units", "statistics of ||W_after,i - W_before,i||_2", _G),
    Metric("freq/{matrix}_norm_spearman", "[-1, 1]", "Spearman(log count, ||W_i||_2) over seen tokens", _G),
    Metric("grad/{flow}_row_norm_histogram", "gradient units", "histogram of per-row gradient norms", _G, kind="histogram"),
    Metric("grad/row_norm_vs_frequency", "", "image: row norm vs frequency rank, log-log", _G, kind="image"),
    Metric("grad/tying", "", "text: whether and how the matrices are tied", _G, kind="text",
           steps="the first gradient logging step of a run, and again when it changes"),
    # ---- tokens
    Metric("tokens/seen_fraction", "fraction", "valid tokens seen at least once / valid tokens", _T),
    Metric("tokens/total", "count", "tokens counted, all processes", _T),
    Metric("tokens/rare_count", "count", "rare tokens", _T),
    Metric("tokens/out_of_range", "count", "input ids outside [0, V)", _T),
    # ---- collision
    Metric("collision/rare_rate_{m}", "fraction", "rare r whose nearest other pairable row has cosine >= tau after removing the mean and the top k principal directions (all-but-the-top) / measured rare tokens", _C, better="lower"),
    Metric("collision/drift/raw_rate_{m}", "fraction", "drift, not collision: rare r with raw max_j cos(W_r, W_j) >= tau / measured rare tokens", _C),
    Metric("collision/drift/mean_cos_{m}", "cosine", "mean cosine of the measured rare rows to their mean direction (mean resultant length)", _C),
    Metric("collision/drift/removed_variance_{m}", "fraction", "share of the pairable rows' variance held by the removed principal directions", _C),
    Metric("collision/{bucket}/{m}_nn_cosine_mean", "cosine", "mean nearest-neighbour cosine of a bucket's pairable rows, drift removed", _C, headline=False),
    Metric("collision/rare_count", "count", "rare tokens", _C),
    Metric("collision/rare_rate_{m}_low", "fraction", "lower end of the 95% Wilson score interval of collision/rare_rate_{m} (k colliding of n = rare_measured_{m} rows)", _C, headline=False,
           formula="(p + z^2/2n - z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), p = k/n, z = 1.959964; 0 when k = 0", source="Wilson 1927"),
    Metric("collision/rare_rate_{m}_high", "fraction", "upper end of the 95% Wilson score interval of collision/rare_rate_{m}", _C, headline=False,
           formula="(p + z^2/2n + z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), p = k/n, z = 1.959964; 1 when k = n", source="Wilson 1927"),
    Metric("collision/rare_measured_{m}", "count", "rare rows of the panel measured in the matrix (pairable): the n of collision/rare_rate_{m} and of its interval", _C, headline=False),
    Metric("collision/rare_sample_size", "count", "rare tokens in the panel: a fixed seeded selection, the same rows each probe; 1024 (all rare tokens when fewer), doubled after a probe whose Wilson half-width exceeds 0.01; max_rare fixes it", _C),
    Metric("collision/unseen_count", "count", "valid tokens never seen (not paired unless include_unseen)", _C),
    Metric("collision/invalid_count", "count", "rows that cannot occur (padded vocabulary; never paired)", _C),
    Metric("collision/untrained_count_{m}", "count", "valid rows never trained (all zeros), left out of every collision search", _C),
    Metric("collision/nonfinite_count_{m}", "count", "valid rows holding NaN or inf (never paired)", _C),
    Metric("collision/synonym_pair_rate_{m}", "fraction", "ordered within-group pairs of pairable rows with cos >= tau, drift removed / such pairs", _C),
    Metric("collision/synonym_partner_rank_{m}", "rank", "median rank of each synonym's partner among its nearest pairable rows, drift removed (1 = nearest)", _C),
    Metric("collision/synonym_pairs", "count", "ordered within-group pairs measured (both rows pairable in the head)", _C),
    Metric("collision/synonym_skipped_pairs", "count", "ordered within-group pairs with a row that is not pairable (never seen, padded, zero)", _C),
    Metric("collision/synonym_confusion_rate", "fraction", "positions with a rare grouped target where a synonym scores >= the target / such positions, over every training batch since the last measurement", _C),
    Metric("collision/synonym_confusion_positions", "count", "positions with a rare grouped target, every training batch since the last measurement", _C),
    Metric("collision/val/synonym_confusion_rate", "fraction", "the same over one validation epoch", _C),
    Metric("collision/val/synonym_confusion_positions", "count", "positions with a rare grouped target in one validation epoch", _C),
    Metric("collision/top_pairs_{m}", "", "text: most similar colliding pairs", _C, kind="text"),
    Metric("collision/nn_similarity_{m}", "", "image: nearest-neighbour cosine histograms, rare vs frequent", _C, kind="image"),
    # ---- overhead (with an overhead budget: `overhead_budget=`, default 0.01)
    Metric("overhead/fraction", "fraction",
           "headwatch's share of the wall time since the last logging step (this process's: rank zero's in TensorBoard)",
           _O, formula="`(t_statistics + t_probe + t_figures + t_publish) / t_wall` from the end of the last logging step's "
           "headwatch work to this step's transfer",
           headline=False, better="lower"),
    Metric("overhead/fraction_run", "fraction", "headwatch's share of the wall time since the run's first step", _O,
           formula="`sum t_headwatch / sum t_wall` over the run's windows to this step's transfer", headline=False, better="lower"),
    Metric("overhead/probe_fraction_run", "fraction",
           "the probes' share of the wall time since the run's first step (part of `overhead/fraction_run`)", _O,
           formula="`sum (t_probe + t_figures) / sum t_wall` over the run's windows, the first, periodic and end probes",
           headline=False, better="lower"),
    Metric("overhead/probe_interval", "steps",
           "steps between two probe steps (the collision measurement, figures, histograms): a power of two times the "
           "logging interval, the same on every process", _O, formula="`2^j * log_every`", headline=False),
    Metric("overhead/probe_seconds", "seconds", "the last probe's cost: the collision measurement and the figures", _O,
           formula="`t_probe + t_figures` of the last window with a probe (this process's)", headline=False, better="lower"),
    # ---- alerts
    Metric("alerts/{rule}", "", "1 at each critical alert step of the rule", _A, better="lower"),
    Metric("alerts/{rule}_warning", "", "1 at each warning alert step of the rule", _A, better="lower"),
    Metric("alerts", "", "text: the alert message", _A, kind="text"),
    Metric("alerts/action_failures", "count", "alert actions that failed so far (a webhook POST after its retries, an unwritable record file, an action that raised); written when it changes", "AlertEngine", headline=False),
    # ---- storage (headwatch.tensorboard.guard): written when writing resumes after a storage fault
    Metric("storage/delayed_events", "count", "TensorBoard events that could not be written when added and were written once the log directory could be written again", "GuardedFileWriter", headline=False),
    Metric("storage/lost_events", "count", "TensorBoard events never written (kept in memory beyond 64 MiB during a storage fault, or still kept at close)", "GuardedFileWriter", headline=False),
)


def declaration(name: str, prefix: str = "headwatch") -> Metric | None:
    """The declaration a full metric name belongs to, or None."""
    for metric in METRICS:
        if metric.regex(prefix).match(name):
            return metric
    return None


def expand(metric: Metric) -> list[str]:
    """Every concrete name (without prefix) a declaration stands for."""
    return [name for name, _ in _expansions(metric)]


def _expansions(metric: Metric) -> list[tuple[str, dict[str, str]]]:
    fields = re.findall(r"\{(\w+)\}", metric.pattern)
    out = []
    for values in itertools.product(*(PLACEHOLDERS[f] for f in fields)):
        chosen = dict(zip(fields, values))
        out.append((metric.pattern.format(**chosen), chosen))
    return out


_STEPS: tuple[tuple[str, str], ...] = (
    ("{split}/", "logging steps; `val`: each validation epoch or evaluation"),
    ("rl/", "logging steps of an RL run (GRPO, RLOO)"),
    ("debug/capture/", "logging steps (self-check)"),
    ("debug/check/", "logging steps (self-check)"),
    ("check/", "logging steps (self-check)"),
    ("collision/val/", "each validation epoch or evaluation"),
    ("collision/", "collision steps"),
    ("overhead/", "logging steps (`overhead_budget=`)"),
    ("alerts/action_failures", "when the count changes"),
    ("alerts", "alert steps"),
    ("storage/", "when writing resumes after a storage fault"),
    ("", "logging steps"),
)
"""When a metric is published, by the start of its pattern (the first match wins)."""


def steps_of(metric: Metric) -> str:
    """On which steps ``metric`` is published (Markdown): :attr:`Metric.steps`, else derived from its pattern.

    Figures (images) outside ``collision/`` follow ``figure_every_n_steps``; names of the supervised mode of
    the collision monitor need ``synonym_groups``."""
    if metric.steps:
        return metric.steps
    if metric.kind == "image" and not metric.pattern.startswith("collision/"):
        return "figure steps"
    text = next(text for start, text in _STEPS if metric.pattern.startswith(start))
    if metric.kind == "image":
        text += " (`figures=`)"
    if "synonym" in metric.pattern:
        text += " (`synonym_groups=`)"
    return text


def doors_of(metric: Metric, name: str | None = None) -> tuple[str, ...]:
    """The front doors (keys of :data:`DOORS`) that publish ``metric``, or its concrete ``name`` (without prefix).

    :attr:`Metric.doors` when given, else ``rl/`` names: the Hugging Face door (TRL's RL trainers), others:
    every door. Validation names (``val/...``, ``collision/val/...``) never come from the plain loop, which
    has no validation."""
    doors = metric.doors or (("hf",) if metric.pattern.startswith("rl/") else tuple(DOORS))
    validation = (name if name is not None else metric.pattern).startswith(("val/", "collision/val/"))
    return tuple(d for d in doors if not (validation and d == "loop"))


DEFAULT_ALERT_METRICS = ("logits/entropy", "logits/kl_to_uniform")
"""Names (after the prefix) the collapse alert watches by default."""

CONSOLE_KEYS = (
    "logits/entropy", "logits/target_nll", "logits/rare/target_nll", "val/logits/entropy", "val/logits/target_nll",
    "grad/embedding_row_density", "grad/head_row_density", "tokens/seen_fraction", "collision/rare_rate_head",
)  # fmt: skip
"""Names (after the prefix) the Hugging Face front door prints on the console by default (every key still
goes to the reporting integrations)."""


# ---- `headwatch report`: groups and the default selection, derived from the declarations above

class Group(NamedTuple):
    name: str
    """Heading of the group in ``headwatch report`` (text, HTML, charts)."""
    monitor: str
    """The class whose metrics (:attr:`Metric.monitor`) the group holds."""
    title: str


GROUPS: tuple[Group, ...] = (
    Group("logits", _L, "the head's output distribution: training steps (logits/), validation epochs (val/logits/)"),
    Group("gradients", _G, "gradient and update rows of embedding and head, frequency gravity (grad/, update/, freq/)"),
    Group("collision", _C, "rare-token collision (collision/)"),
    Group("tokens", _T, "token counts (tokens/)"),
    Group("overhead", _O, "headwatch's own cost and the probe interval, with an overhead budget (overhead/)"),
    Group("alerts", _A, "alert markers, 1 at the alert step (alerts/)"),
    Group("alert delivery", "AlertEngine", "alert actions that failed (alerts/action_failures)"),
    Group("storage", "GuardedFileWriter", "TensorBoard events delayed or lost by a storage fault (storage/)"),
)
"""Report groups in display order: one per monitor."""

DETAIL: dict[str, tuple[str, ...]] = {"q": ("05",), "stat": ("max",)}
"""Placeholder values ``headwatch report`` shows only with ``--all``: the 5% entropy quantile
(the median and p95 are shown) and the largest row norm (one row; the mean, p50 and p95 are shown)."""


@functools.lru_cache(maxsize=1)
def _concrete() -> dict[str, tuple[Metric, dict[str, str]]]:
    return {name: (metric, chosen) for metric in METRICS for name, chosen in _expansions(metric)}


_DATALOADER_SUFFIX = re.compile(r"/dataloader_idx_\d+$")


def _lookup(name: str, prefix: str) -> tuple[Metric, dict[str, str]] | None:
    """The declaration and placeholder values of a full name; a ``{split}`` name may end in Lightning's
    ``/dataloader_idx_<k>`` (several validation dataloaders), as :meth:`Metric.regex` accepts."""
    if not name.startswith(prefix + "/"):
        return None
    short = name[len(prefix) + 1 :]
    found = _concrete().get(short)
    if found is None and _DATALOADER_SUFFIX.search(short):
        found = _concrete().get(_DATALOADER_SUFFIX.sub("", short))
        if found is not None and not found[0].pattern.startswith("{split}/"):
            return None
    return found


def report_group(name: str, prefix: str = "headwatch") -> str | None:
    """The :class:`Group` name of a full metric name (``<prefix>/...``), or None when it is not declared."""
    found = _lookup(name, prefix)
    if found is None:
        return None
    return next(g.name for g in GROUPS if g.monitor == found[0].monitor)


def is_headline(name: str, prefix: str = "headwatch") -> bool | None:
    """Whether ``headwatch report`` shows a full metric name by default, None when it is not declared.

    True when its declaration is :attr:`Metric.headline` and none of its placeholder values is
    listed in :data:`DETAIL`.
    """
    found = _lookup(name, prefix)
    if found is None:
        return None
    metric, chosen = found
    return metric.headline and not any(value in DETAIL.get(field, ()) for field, value in chosen.items())


# ---- documentation generated from the declarations: the metric reference, docstring lists

REFERENCE_PATH = "docs/reference/metrics.md"
"""Where the metric reference lives, from the repository root (``python -m headwatch.names --reference``)."""

_GROUP_SLUG = re.compile(r"[^a-z0-9]+")


def _key(metric: Metric) -> str:
    return "headwatch/" + re.sub(r"\{(\w+)\}", r"<\1>", metric.pattern)


def _doors_text(doors: tuple[str, ...]) -> str:
    return "all" if set(doors) == set(DOORS) else ", ".join(DOORS[d] for d in doors)


def _doors_cell(metric: Metric) -> str:
    doors = doors_of(metric)
    val = doors_of(metric, "val/" + metric.pattern)
    if metric.pattern.startswith("{split}/") and val != doors:
        return _doors_text(doors) + "; `val`: " + _doors_text(val)
    return _doors_text(doors)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reference_page() -> str:
    """The metric reference (Markdown): one table per :data:`GROUPS` entry, one row per declaration.

    Columns: key, unit, definition (with :attr:`Metric.formula` and :attr:`Metric.source`), kind, on which
    steps (:func:`steps_of`) and through which front doors (:func:`doors_of`) it is published."""
    placeholders = "\n".join(
        f"| `<{name}>` | " + ", ".join(f"`{v}`" for v in values) + " |" for name, values in PLACEHOLDERS.items()
    )
    out = [
        "# Metric reference",
        "",
        "<!-- generated from src/headwatch/names.py by `python -m headwatch.names --reference docs/reference/metrics.md`;",
        "     edit the declarations there, not this page (tests/docs/test_docs_site.py fails when it is stale) -->",
        "",
        "Every name headwatch publishes, generated from the one declaration of the metrics in the code",
        "(`headwatch.names.METRICS`). A name is `<prefix>/<key>`, the prefix `headwatch` by default (the Hugging Face",
        "Trainer shows training values under `train/headwatch/...`). A `<placeholder>` in a key stands for each of",
        "its values:",
        "",
        "| placeholder | values |",
        "|---|---|",
        placeholders,
        "",
        "`<split>` is `logits` on training logging steps and `val/logits` (`val` in the tables) for validation",
        "epochs and evaluations (Lightning appends `/dataloader_idx_<k>` with several validation dataloaders; the",
        "Hugging Face Trainer names each set of an `eval_dataset` dict). Buckets rank the seen valid tokens by count",
        "(`top1`, `top10`, `top50`: the top 1%, 10%, 50%; `tail`; `unseen`); `rare` is the rare-token set.",
        "",
        "**Steps.** *Logging steps*: the training steps the front door logs on (Lightning's `log_every_n_steps`,",
        "the Hugging Face Trainer's `logging_steps`, the plain loop's `log_every_n_steps`). *Collision steps*: the",
        "probe steps of the overhead budget (the first logging step, then every `overhead/probe_interval` steps, a",
        "power of two of logging intervals, and the end of training; `overhead_budget=None`, or a cadence of the user's",
        "(`every_n_steps=` of `SynonymCollision` or",
        "`SynonymCollisionMonitor`): every 10 logging steps, or that cadence, and at the end",
        "of each training epoch).",
        "*Figure steps*: the probe steps (without a budget, or with an explicit `figure_every_n_steps`: every 10",
        "logging intervals, or that many steps, when matplotlib is installed). *Alert steps*: the steps where an alert",
        "rule fires.",
        "",
        "**Doors.** The front doors that publish the name: `Lightning` (the callbacks), `HF` (the Hugging Face",
        "`Trainer` and TRL's trainers, `HeadwatchCallback`), `loop` (a plain PyTorch loop, `headwatch.Headwatch`);",
        "`all`: the three. The plain loop has no validation. Histograms, images and text go to TensorBoard only.",
    ]
    for group in GROUPS:
        out += ["", f"## {group.name.capitalize()}", "", group.title[0].upper() + group.title[1:] + ".", ""]
        out += ["| key | unit | definition | steps | doors |", "|---|---|---|---|---|"]
        for m in METRICS:
            if m.monitor != group.monitor:
                continue
            definition = m.definition if m.kind == "scalar" or m.definition.startswith(m.kind) else f"{m.kind}: {m.definition}"
            if m.formula:
                definition += f"; {m.formula}"
            if m.source:
                definition += f" ({m.source})"
            cells = (f"`{_key(m)}`", m.unit, definition, steps_of(m), _doors_cell(m))
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


def logged_metrics(monitor: str, indent: str = "    ") -> str:
    """A reST list of every metric ``monitor`` emits, with units, for its docstring's "Logged metrics"."""
    lines = []
    for m in METRICS:
        if m.monitor == monitor:
            name = re.sub(r"\{(\w+)\}", r"<\1>", m.pattern)
            what = ", ".join(w for w in (m.kind if m.kind != "scalar" else "", m.unit) if w)
            lines.append(f"{indent}- ``{name}``" + (f" ({what})" if what else "") + ": " + m.definition.replace("`", "``"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m headwatch.names --reference docs/reference/metrics.md [--check]``: write (or check) the
    metric reference.

    Returns:
        0, or 1 with ``--check`` when the page is stale (nothing is written then).
    """
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m headwatch.names", description=main.__doc__)
    parser.add_argument("--reference", type=Path, required=True, help=f"the metric reference page (in the repository: {REFERENCE_PATH})")
    parser.add_argument("--check", action="store_true", help="exit 1 when the page is stale, write nothing")
    args = parser.parse_args(argv)
    path = args.reference
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    new = reference_page()
    if not args.check and new != text:
        path.write_text(new, encoding="utf-8")
    return int(args.check and new != text)


if __name__ == "__main__":
    raise SystemExit(main())
