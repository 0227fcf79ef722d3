"""LogitStats: calibration by target frequency, per-dataloader validation, padded mass, bf16 autocast.

Expected values come from outside headwatch's statistics: a float64 recomputation from the
logits the model returned (or from its head's input and weight), torchmetrics'
``MulticlassCalibrationError`` for the ECE. Buckets of the targets use the one definition of
``TokenFrequency`` (``frequency_snapshot``) on counts summed here from the batches.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassCalibrationError

from headwatch import LogitStatsMonitor, TokenFrequency
from headwatch.core import LogitStats
from headwatch.functional import frequency_snapshot
from headwatch.functional.frequency import BUCKETS
from tests.helpers import TinyCausalLM, loader
from tests.helpers.lightning_runs import StepLogger, make_trainer

V, TOKENIZER_V = 64, 60  # 4 padded columns


class TwoValLoaders(TinyCausalLM):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val_loss", self._loss(batch, "val"))


def positions(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 logits ``(N, V)`` and targets ``(N,)`` of the measured positions (shifted labels)."""
    labels = batch["labels"]
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    keep = (batch["attention_mask"] != 0) & (targets != -100)
    return logits.double()[keep], targets[keep]


def reference(rows: list[tuple[torch.Tensor, torch.Tensor]], bucket: torch.Tensor, rare: torch.Tensor) -> dict[str, float]:
    x = torch.cat([r[0] for r in rows])
    t = torch.cat([r[1] for r in rows])
    logp = torch.log_softmax(x, -1)
    p = logp.exp()
    nll = -logp.gather(1, t[:, None])[:, 0]
    conf = p.max(1).values
    acc = (x.gather(1, t[:, None])[:, 0] == x.max(1).values).double()
    out: dict[str, float] = {"target_nll": nll.mean().item(), "padded_mass": p[:, TOKENIZER_V:].sum(1).mean().item()}
    groups = {name: bucket[t] == i for i, name in enumerate(BUCKETS)} | {"rare": rare[t]}
    for name, sel in groups.items():
        n = int(sel.sum())
        out[f"{name}/positions"] = float(n)
        for key, v in (("target_nll", nll), ("target_argmax_rate", acc), ("max_prob", conf)):
            out[f"{name}/{key}"] = v[sel].mean().item() if n else math.nan
    for prefix, sel in (("", torch.ones_like(t, dtype=torch.bool)), ("rare/", groups["rare"])):
        if not sel.any():
            out[f"{prefix}ece"] = out[f"{prefix}overconfidence"] = math.nan
            continue
        ece = MulticlassCalibrationError(num_classes=V, n_bins=15, norm="l1")
        out[f"{prefix}ece"] = ece(p[sel], t[sel]).item()
        out[f"{prefix}overconfidence"] = (conf[sel].mean() - acc[sel].mean()).item()
    return out


def buckets(batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.zeros(V, dtype=torch.long)
    for b in batches:
        counts += torch.bincount(b["input_ids"][b["attention_mask"] != 0], minlength=V)
    snap = frequency_snapshot(counts, torch.arange(V) < TOKENIZER_V, None, 0.5)
    return snap.bucket, snap.rare


def check(logged: dict[str, list[float]], group: str, suffix: str, ref: dict[str, float], index: int) -> None:
    for key, want in ref.items():
        got = logged[f"{group}/{key}{suffix}"][index]
        if math.isnan(want):
            assert math.isnan(got), (key, got)
        else:
            assert got == pytest.approx(want, abs=1e-5), (key, got, want)


def test_calibration_by_frequency_train_and_two_val_loaders(tmp_path):
    model = TwoValLoaders()
    model.keep_logits = True
    logger = StepLogger()
    callbacks = [TokenFrequency(vocab_size=TOKENIZER_V), LogitStatsMonitor(figure_every_n_steps=None, log_histogram=False)]
    trainer = make_trainer(tmp_path, callbacks, max_steps=2, log_every_n_steps=1, logger=logger)
    trainer.fit(model, loader(n=16), [loader(n=16, seed=1), loader(n=16, seed=2)])
    train = [r for r in model.records if r[0] == "train"]
    val = [r for r in model.records if r[0] == "val"]
    assert len(train) == 2 and len(val) == 4
    for s, (_, _, logits, batch) in enumerate(train):
        bucket, rare = buckets([r[3] for r in train[: s + 1]])  # the tracker counted this batch first
        ref = reference([positions(logits, batch)], bucket, rare)
        check(logger.values, "headwatch/logits", "", ref, s)
    assert 0 < logger.values["headwatch/logits/rare/positions"][0] < logger.values["headwatch/logits/positions"][0]
    bucket, rare = buckets([r[3] for r in train])
    for k in range(2):  # Lightning runs dataloader 0's batches, then 1's
        ref = reference([positions(r[2], r[3]) for r in val[2 * k : 2 * k + 2]], bucket, rare)
        check(logger.values, "headwatch/val/logits", f"/dataloader_idx_{k}", ref, 0)
    assert not [n for n in logger.values if n.startswith("headwatch/val/") and "/dataloader_idx_" not in n]
    assert "val_loss/dataloader_idx_1" in logger.values  # Lightning's own names, the same convention


def test_without_token_counts_ece_and_overconfidence_only():
    torch.manual_seed(0)
    model = TinyCausalLM()
    core = LogitStats()
    core.attach(model)
    batch = next(iter(loader(n=8)))
    core.step_start(batch, 0, True)
    logits = model(batch["input_ids"])
    core.batch_end()
    values = {k: v.item() for k, v in core.compute().items()}
    assert not [k for k in values if "/rare/" in k or "/top1/" in k or k.endswith("padded_mass")]
    ref = reference([positions(logits.detach(), batch)], torch.zeros(V, dtype=torch.long), torch.zeros(V, dtype=torch.bool))
    for key in ("ece", "overconfidence", "target_nll"):
        assert values[f"headwatch/logits/{key}"] == pytest.approx(ref[key], abs=1e-6), key


@pytest.mark.parametrize("path", ["logits", "hidden"])
def test_bf16_autocast_capture_equals_float64(tmp_path, path):
    """Lightning precision="bf16-mixed" on CPU: the forward runs in autocast; the statistics do not."""
    model = TinyCausalLM(d_model=32)
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def keep(module, args, output):
        if not seen:
            seen.append((args[0].detach().clone(), module.weight.detach().clone(), output.detach().clone()))

    model.lm_head.register_forward_hook(keep)
    logger = StepLogger()
    monitor = LogitStatsMonitor(path=path, validation=False, figure_every_n_steps=None, log_histogram=False)
    trainer = make_trainer(tmp_path, [monitor], max_steps=1, log_every_n_steps=1, logger=logger, precision="bf16-mixed")
    batch = next(iter(loader(n=8)))
    trainer.fit(model, loader(n=8))
    hidden, weight, out = seen[0]
    assert out.dtype == torch.bfloat16  # the head ran under autocast
    x64 = out.double() if path == "logits" else hidden.double() @ weight.double().T  # (B, T, V) float64
    x, t = positions(x64, batch)
    logp = torch.log_softmax(x, -1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1)
    want = {
        "entropy": entropy.mean(),
        "kl_to_uniform": (math.log(V) - entropy).mean(),
        "max_prob": p.max(-1).values.mean(),
        "target_nll": -logp.gather(1, t[:, None]).mean(),
    }
    for key, value in want.items():
        assert logger.values[f"headwatch/logits/{key}"][0] == pytest.approx(value.item(), abs=1e-5), key
