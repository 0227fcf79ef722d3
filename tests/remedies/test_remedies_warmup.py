"""HeadWarmup: exactly the head trains during the warm-up, groups restored, phase logged, resumes."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from headwatch import HeadwatchError
from headwatch.remedies import HeadWarmup, HeadWarmupCore
from headwatch.remedies.warmup import PHASE_KEY
from tests.helpers import TinyCausalLM, loader
from tests.helpers.lightning_runs import make_trainer

V, D = 64, 16


class AdamWModel(TinyCausalLM):
    """Untied; AdamW with decay/no-decay groups (weight decay would move frozen rows if stepped) + a schedule."""

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": self.optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Moved(Callback):
    """Names of the parameters each optimizer step changed, and the groups the optimizer had."""

    def __init__(self):
        self.moved: list[set[str]] = []
        self.groups: list[list[tuple[int, float]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.groups.append([(len(g["params"]), pytest.approx(g["lr"])) for g in optimizer.param_groups])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.moved.append({n for n, p in pl_module.named_parameters() if not torch.equal(p.detach(), self._before[n])})
        if len(self.moved) == 1:
            self.first_head_step = (pl_module.lm_head.weight.detach() - self._before["lm_head.weight"]).abs().max().item()


def _model():
    torch.manual_seed(0)
    return AdamWModel(vocab_size=V, d_model=D, tie_weights=False)


def test_only_the_head_moves_during_the_warmup_then_everything(tmp_path):
    model = _model()
    names = {n for n, _ in model.named_parameters()}
    moved = Moved()
    trainer = make_trainer(tmp_path, [HeadWarmup(warmup_steps=3, head_lr=0.05), moved], max_steps=5, log_every_n_steps=1)
    trainer.fit(model, loader(n=40))
    assert moved.moved[:3] == [{"lm_head.weight"}] * 3
    assert moved.moved[3:] == [names] * 2
    # the user's two groups throughout; at each warm-up step the head's group runs at head_lr, then the schedule's
    schedule = [1e-2 / (1 + s) for s in range(5)]
    assert moved.groups == [[(3, 0.05), (1, schedule[s])] for s in range(3)] + [[(3, schedule[s]), (1, schedule[s])] for s in (3, 4)]
    assert model.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 6)  # the scheduler's value after 5 steps
    assert all(p.requires_grad for p in model.parameters())
    # AdamW's first step moves a weight by lr * grad / |grad| plus the decay lr * wd * w (|w| <= 1/sqrt(d) = 0.25
    # for nn.Linear's init): head_lr = 0.05 within 0.05 * 0.1 * 0.25, where the group's own lr would give 0.01
    assert moved.first_head_step == pytest.approx(0.05, abs=0.05 * 0.1 * 0.25 + 1e-6)


def test_phase_is_logged(tmp_path):
    trainer = make_trainer(tmp_path, [HeadWarmup(warmup_steps=2)], max_steps=4, log_every_n_steps=1)
    trainer.fit(_model(), loader(n=32))
    acc = EventAccumulator(trainer.logger.log_dir)
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars(PHASE_KEY)] == [(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0)]


def _final_weights(tmp_path, callback_kw, max_steps, resume_from=None, stop_at=None):
    model = _model()
    trainer = make_trainer(tmp_path, [HeadWarmup(**callback_kw)], max_steps=stop_at or max_steps)
    # one batch per epoch: every step sees the same batch, so the resumed run's data cannot differ
    trainer.fit(model, loader(n=8, batch_size=8), ckpt_path=resume_from)
    return model, trainer


@pytest.mark.parametrize("save_at", [2, 4])  # mid-warm-up (switch at 3), and after it
def test_resume_from_a_real_checkpoint_continues_the_warmup(tmp_path, save_at):
    kw = {"warmup_steps": 3, "head_lr": 0.05}
    straight, _ = _final_weights(tmp_path / "a", kw, 6)
    _, first = _final_weights(tmp_path / "b", kw, 6, stop_at=save_at)
    ckpt = tmp_path / "b" / "mid.ckpt"
    first.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)["callbacks"]
    key = next(k for k in state if k.startswith("HeadWarmup"))
    assert state[key]["phase"] == (0 if save_at < 3 else 1)
    resumed, _ = _final_weights(tmp_path / "c", kw, 6, resume_from=ckpt)
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_core_without_a_trainer():
    model = TinyCausalLM(V, D, tie_weights=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    core = HeadWarmupCore(warmup_steps=1, head_lr=1.0)
    frozen = core.freeze(model, [model.lm_head.weight])
    assert {id(p) for p in frozen} == {id(p) for p in model.parameters()} - {id(model.lm_head.weight)}
    assert core.attach(optimizer, [model.lm_head.weight])
    assert not core.step(0, [optimizer])
    before = model.lm_head.weight.detach().clone()
    model.lm_head.weight.grad = torch.ones_like(before)
    optimizer.step()
    torch.testing.assert_close(model.lm_head.weight.detach(), before - 1.0, rtol=0, atol=0)  # SGD at head_lr
    assert optimizer.param_groups[0]["lr"] == 0.1  # put back after the step
    assert core.step(1, [optimizer]) and core.phase == 1 and core.switched_at_step == 1
    assert all(p.requires_grad for p in model.parameters())
    before = model.lm_head.weight.detach().clone()
    optimizer.step()  # hooks removed: the group's own lr
    torch.testing.assert_close(model.lm_head.weight.detach(), before - 0.1, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"warmup_steps": -1}, "`warmup_steps` must be an int >= 0, got -1"), ({"warmup_steps": 2, "head_lr": 0}, "`head_lr`")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(HeadwatchError, match=match):
        HeadWarmup(**kwargs)


def test_a_tied_head_is_refused_not_trained_with_the_embedding():
    # the shared matrix is never trained as "the head only" (it used to warn and train it);
    # tests/remedies/test_remedies_contract.py holds the untie=True path and the parameter-value checks
    model = TinyCausalLM(V, D, tie_weights=True)
    with pytest.raises(HeadwatchError, match="tied to `embed_tokens`.*would train the input embedding too.*untie=True"):
        HeadWarmup(warmup_steps=2).freeze_before_training(model)
    assert all(p.requires_grad for p in model.parameters())  # nothing frozen by the refused warm-up


def test_gradient_density_measures_the_embedding_once_the_warmup_unfreezes_it(tmp_path):
    from headwatch import GradientDensityMonitor

    # warm-up of 2 steps: the embedding is frozen at steps 0, 1 (no density: it has no gradient),
    # then trains, and its density must be logged from step 2 on (resolved again when it unfreezes)
    trainer = make_trainer(tmp_path, [HeadWarmup(warmup_steps=2), GradientDensityMonitor(log_every_n_steps=1)],
                           max_steps=4, log_every_n_steps=1)
    trainer.fit(_model(), loader(n=32))
    acc = EventAccumulator(trainer.logger.log_dir)
    acc.Reload()
    assert [e.step for e in acc.Scalars("headwatch/grad/embedding_row_density")] == [2, 3]
    assert [e.step for e in acc.Scalars("headwatch/grad/head_row_density")] == [0, 1, 2, 3]
