"""The core's shared pieces: BatchFormat, the step schedule against Lightning's own logged steps,
the private-attribute fallback, and metric names declared once."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from headwatch import (
    BatchFormat,
    GradientDensityMonitor,
    HeadwatchError,
    LogitStatsMonitor,
    SynonymCollisionMonitor,
    TokenFrequency,
)
from headwatch.integrations.lightning import lightning_step
from tests.helpers import ROOT, TinyCausalLM, loader
from tests.helpers.lightning_runs import StepLogger, make_trainer


# ---------------------------------------------------------------- BatchFormat
def test_batch_format_reads_mappings_tuples_and_overrides():
    ids = torch.tensor([[1, 2, 3, 4]])
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[1, 1, 1, 0]])}
    view = BatchFormat().read(batch)
    assert view.targets.tolist() == [[2, 3, 4, -100]] and view.mask.tolist() == [[True, True, True, False]]
    assert view.masked_targets().tolist() == [[2, 3, 4, -100]]
    assert BatchFormat(shift_labels=False).read(batch).targets.tolist() == [[1, 2, 3, 4]]
    tup = (ids, ids + 1)
    view = BatchFormat(targets_fn=lambda b: b[1]).read(tup)
    assert torch.equal(view.ids, ids) and view.targets.tolist() == [[2, 3, 4, 5]] and view.mask is None
    assert BatchFormat().read(tup).targets is None
    with pytest.raises(HeadwatchError, match="`shift_labels` must be a bool, got 1"):
        BatchFormat(shift_labels=1)
    with pytest.raises(HeadwatchError, match=r"mask_fn must return a \(B, T\) bool tensor, got list"):
        _ = BatchFormat(mask_fn=lambda b: [1]).read(batch).mask
    with pytest.raises(HeadwatchError, match=r"targets_fn must return a \(B, T\) tensor, got NoneType"):
        _ = BatchFormat(targets_fn=lambda b: None).read(batch).targets
    fmt = BatchFormat(mask_fn=lambda b: b["attention_mask"], targets_fn=lambda b: b["labels"].int())
    view = fmt.read(batch)
    assert view.mask.dtype == torch.bool and view.mask.tolist() == [[True, True, True, False]]
    assert view.targets.dtype == torch.long and view.targets.tolist() == [[1, 2, 3, 4]]  # no shift applied


class TupleLM(TinyCausalLM):
    """(input_ids, targets) tuple batches; targets already aligned with the logits."""

    def _loss(self, batch, stage):
        ids, targets = batch
        logits = self(ids)
        self.records.append((stage, self.global_step, logits.detach().clone(), {"targets": targets.clone()}))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _tuple_loader():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 64, (8, 12), generator=g)
    ids[:, ::3] = 5  # token 5 is frequent; 7 and 9 appear once each: rare, grouped with 5
    ids[0, 1], ids[1, 1] = 7, 9
    targets = torch.roll(ids, -1, dims=1)
    return torch.utils.data.DataLoader(list(zip(ids, targets)), batch_size=8)


def test_collision_confusion_reads_tuple_batches_with_targets_fn(tmp_path):
    """Was NaN: the collision monitor ignored targets_fn; now its BatchFormat reads the tuple."""
    fmt = BatchFormat(targets_fn=lambda b: b[1], shift_labels=False, ids_fn=lambda b: b[0])
    monitor = SynonymCollisionMonitor(every_n_steps=1, synonym_groups=[[5, 7, 9]], figures=False, batch_format=fmt)
    model = TupleLM()
    trainer = make_trainer(tmp_path, [TokenFrequency(ids_fn=lambda b: b[0], rare_max_count=2), monitor], max_steps=2, log_every_n_steps=1)
    trainer.fit(model, _tuple_loader())
    positions = float(trainer.callback_metrics["headwatch/collision/synonym_confusion_positions"])
    rate = float(trainer.callback_metrics["headwatch/collision/synonym_confusion_rate"])
    # independent count on step 1's logits: positions whose target is rare (by the tracker) and grouped
    _, _, logits, rec = model.records[-1]
    rare = monitor.frequency.snapshot().rare
    t = rec["targets"]
    eligible = rare[t] & torch.isin(t, torch.tensor([5, 7, 9]))
    assert positions == eligible.sum().item() > 0
    syn = {5: [7, 9], 7: [5, 9], 9: [5, 7]}
    confused = sum(
        bool((logits[b, i, syn[int(t[b, i])]] >= logits[b, i, t[b, i]]).any()) for b, i in eligible.nonzero().tolist()
    )
    assert rate == pytest.approx(confused / positions) and rate == rate  # finite


# ---------------------------------------------------------------- schedule
class TwoOptimizers(TinyCausalLM):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        loss = self._loss(batch, "train")
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()
        self.log("train_loss", loss)

    def configure_optimizers(self):
        head = list(self.lm_head.parameters())
        rest = [p for n, p in self.named_parameters() if not n.startswith("lm_head")]
        return [torch.optim.SGD(rest, lr=0.01), torch.optim.SGD(head, lr=0.01)]


def _steps(tmp_path, model, every, **kw):
    logger = StepLogger()
    callbacks = [LogitStatsMonitor(validation=False, figure_every_n_steps=0), GradientDensityMonitor(figure_every_n_steps=0)]
    opts = dict(max_epochs=1, log_every_n_steps=every, logger=logger)
    opts.update(kw)
    make_trainer(tmp_path, callbacks, **{k: v for k, v in opts.items() if k != "max_steps"}, max_steps=-1).fit(
        model, loader(n=64)
    )
    return logger.steps


@pytest.mark.parametrize("every, expected", [(2, [1, 3, 5, 7]), (1, list(range(8)))])
def test_manual_optimization_two_optimizers_logs_on_lightnings_steps(tmp_path, every, expected):
    steps = _steps(tmp_path, TwoOptimizers(), every)
    assert steps["train_loss"] == expected  # Lightning's own points
    for key in ("headwatch/logits/entropy", "headwatch/grad/head_row_density", "headwatch/tokens/total"):
        assert steps[key] == expected, key


def test_gradient_accumulation_logs_on_lightnings_steps(tmp_path):
    steps = _steps(tmp_path, TinyCausalLM(), 2, accumulate_grad_batches=2)
    assert steps["train_loss"] == [1, 3]  # 8 batches, 4 optimizer steps
    assert steps["headwatch/logits/entropy"] == steps["headwatch/grad/head_row_density"] == [1, 3]


def test_lightning_step_falls_back_to_global_step():
    assert lightning_step(SimpleNamespace(global_step=7)) == 7  # no fit_loop: the public counter
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=3))
    assert lightning_step(SimpleNamespace(global_step=6, fit_loop=loop)) == 3  # manual: 2 optimizers


# ---------------------------------------------------------------- names declared once
def _emitted(tmp_path, tie: bool) -> set[str]:
    logger = StepLogger()
    callbacks = [
        LogitStatsMonitor(figure_every_n_steps=1, vocab_size=60, compare_loss="train_loss"),  # 4 padded columns: padded_mass
        GradientDensityMonitor(figure_every_n_steps=1),
        SynonymCollisionMonitor(every_n_steps=2, synonym_groups=[[1, 2, 3], [4, 5]], figures=True, tau=-1.0),
    ]
    tb_logger = pl.loggers.TensorBoardLogger(tmp_path, name="tb")
    trainer = make_trainer(tmp_path, callbacks, max_steps=2, log_every_n_steps=1, logger=[logger, tb_logger], val_check_interval=2)
    trainer.fit(TinyCausalLM(tie_weights=tie), loader(n=16), loader(n=8, seed=1))
    acc = EventAccumulator(tb_logger.log_dir, size_guidance={"images": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    media = set(tags["histograms"]) | set(tags["images"]) | {t.removesuffix("/text_summary") for t in tags["tensors"]}
    return (set(logger.steps) | media) - {"train_loss", "val_loss", "epoch", "custom_scalars__config__"}


def test_every_emitted_name_is_declared_and_documented(tmp_path):
    import re

    from headwatch import names
    from headwatch.core.logits import SCALAR_KEYS
    from headwatch.core.metrics import LogitStatsMetric

    emitted = _emitted(tmp_path / "untied", False) | _emitted(tmp_path / "tied", True)
    undeclared = sorted(n for n in emitted if names.declaration(n) is None)
    assert not undeclared, undeclared
    # the metric reference names the Lightning door for every name it emitted ...
    elsewhere = sorted(n for n in emitted if "lightning" not in names.doors_of(names.declaration(n), n.removeprefix("headwatch/")))
    assert not elsewhere, f"emitted by Lightning, the reference says another door: {elsewhere}"
    hit = {names.declaration(n) for n in emitted}
    # ... and everything it says the Lightning door emits was emitted, but for alert markers, alert-delivery
    # failures and storage-fault counts, emitted only when an alert fires or a fault happens
    # (tests/alerts/, tests/tensorboard/test_storage_faults.py read them back); the
    # Hugging Face door: tests/docs/test_docs_site.py
    under_faults = {"SharpnessCollapseAlert", "AlertEngine", "GuardedFileWriter"}
    lightning = [m for m in names.METRICS if "lightning" in names.doors_of(m) and m.monitor not in under_faults]
    assert {m.pattern for m in names.METRICS if m.pattern.startswith("rl/")}.isdisjoint(m.pattern for m in lightning)
    # the evaluation's self-check compares with the model's own outputs.loss, which TinyCausalLM does not return
    # (tests/core/test_self_check_evaluation.py reads them back from a Lightning run of a model that does)
    val_check = {m.pattern for m in lightning if m.pattern.startswith(("val/check/", "val/debug/check/"))}
    never = [m.pattern for m in lightning if m not in hit and m.pattern not in val_check]
    assert not never, f"declared but never emitted: {never}"
    reference = (ROOT / names.REFERENCE_PATH).read_text(encoding="utf-8")
    undocumented = [m.pattern for m in names.METRICS if "| `headwatch/" + re.sub(r"\{(\w+)\}", r"<\1>", m.pattern) + "` |" not in reference]
    assert not undocumented, undocumented
    # nothing computed is dropped: every value of the metric but the raw entropies is published
    metric = LogitStatsMetric()
    metric.update(torch.randn(2, 3, 8), None, torch.randint(0, 8, (2, 3)))
    assert set(metric.compute()) - {"entropy_values"} == set(SCALAR_KEYS)


def test_published_logit_scalars_and_their_declarations_agree():
    """Both ways, without a trainer: every scalar a split of LogitStats publishes has a declaration, and
    every scalar declaration of LogitStatsMonitor is published (a new statistic needs both)."""
    from headwatch import names
    from headwatch.core.logit_split import SplitSums
    from headwatch.distributed.reduce import NoReducer
    from headwatch.functional import logit_statistics

    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(2, 5, 8, generator=g), torch.randint(0, 8, (2, 5), generator=g)
    split = SplitSums(ignore_index=-100, max_chunk_bytes=1 << 20)
    frequency = (torch.arange(8) % 5, torch.arange(8) >= 6)  # (bucket (V,), rare (V,))
    split.update(logit_statistics(logits, targets=targets), targets, frequency, torch.zeros(2, 5), 8)
    published = set(split.compute(NoReducer(), by_frequency=True, padded=True)) - {"entropy_values"}
    declared = {
        name.removeprefix("logits/")
        for m in names.METRICS if m.monitor == "LogitStatsMonitor" and m.kind == "scalar"
        for name in names.expand(m) if name.startswith("logits/")
    }  # fmt: skip
    assert sorted(published - declared) == [], "published, not declared"
    assert sorted(declared - published) == [], "declared, not published"


def test_metric_tables_and_docstring_lists_are_generated_from_the_declarations(tmp_path):
    """The metric reference of the site (docs/reference/metrics.md; regenerate: python -m headwatch.names
    --reference docs/reference/metrics.md) holds one row per declaration, current (also
    tests/docs/test_docs_site.py), and ``--check`` finds a stale page; the Lightning monitor's docstring lists
    every declaration of its metrics."""
    import re

    from headwatch import names

    reference = ROOT / names.REFERENCE_PATH
    assert reference.read_text(encoding="utf-8") == names.reference_page(), "stale: run python -m headwatch.names --reference"
    ours = [m for m in names.METRICS if m.monitor == "LogitStatsMonitor"]
    logits_section = names.reference_page().split("## Logits\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in logits_section.splitlines() if line.startswith("| `headwatch/")]
    assert len(rows) == len(ours)  # one row per declaration
    assert rows[0].startswith(
        "| `headwatch/<split>/entropy` | nats | mean entropy of the next-token distribution; "
        "`H(p) = -sum_v p_v log p_v`, in `[0, log V]`; `0 log 0 = 0` (Shannon 1948) |"
    )
    page = tmp_path / "metrics.md"
    page.write_text("# a hand-edited page\n", encoding="utf-8")
    assert names.main(["--reference", str(page), "--check"]) == 1
    assert page.read_text(encoding="utf-8") == "# a hand-edited page\n"  # --check writes nothing
    assert names.main(["--reference", str(page)]) == 0
    assert page.read_text(encoding="utf-8") == names.reference_page()
    assert names.main(["--reference", str(page), "--check"]) == 0
    doc = LogitStatsMonitor.__doc__ or ""
    for m in ours:
        assert "``" + re.sub(r"\{(\w+)\}", r"<\1>", m.pattern) + "``" in doc, m.pattern


def test_alert_defaults_use_declared_names():  # the dashboard's names: tests/test_dashboard.py
    from headwatch import names

    assert all(names.declaration(f"headwatch/{n}") for n in names.DEFAULT_ALERT_METRICS)


def test_core_imports_no_lightning_and_functional_all_is_complete():
    import importlib
    import inspect
    import pkgutil
    import subprocess
    import sys

    code = "import sys, headwatch.core, headwatch.integrations.loop, headwatch.names; print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out
    names_only = "import sys, headwatch.names; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", names_only], capture_output=True, text=True, check=True).stdout.strip() == "False"
    import headwatch.functional as functional

    for info in pkgutil.iter_modules(functional.__path__):
        module = importlib.import_module(f"headwatch.functional.{info.name}")
        public = [n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_")]
        public = getattr(module, "__all__", public)  # a module's own __all__ leaves out its building blocks
        missing = [n for n in public if n not in functional.__all__]
        assert not missing, (info.name, missing)


def test_alert_rules_are_declared_names():
    from headwatch import names
    from headwatch.alerts import RULES

    assert all(names.declaration(f"headwatch/alerts/{rule}") for rule in RULES)
