"""A late untie_output_head (training under way): the new head joins the optimizer headwatch knows (passed in, the
Hugging Face Trainer's, Lightning's), with its state, and trains; with no optimizer known it raises naming the fix."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from headwatch import HeadwatchError
from headwatch.remedies import untie_output_head
from tests.helpers import TinyCausalLM, loader
from tests.helpers.lightning_runs import make_trainer

V, D = 64, 16


def step(model: TinyCausalLM, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (4, 8), generator=g)
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)).backward()
    optimizer.step()


def groups_of(optimizer: torch.optim.Optimizer, weight: torch.Tensor) -> list[int]:
    return [i for i, g in enumerate(optimizer.param_groups) if any(p is weight for p in g["params"])]


def test_a_late_untie_with_the_optimizer_passed_in_trains_the_new_head_from_the_shared_state():
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=V, d_model=D, tie_weights=True)
    others = [p for n, p in model.named_parameters() if "embed_tokens" not in n]
    optimizer = torch.optim.AdamW([{"params": others}, {"params": [model.embed_tokens.weight], "lr": 0.05}], lr=0.01)
    for seed in range(3):
        optimizer.zero_grad()
        step(model, optimizer, seed)
    shared = model.embed_tokens.weight
    report = untie_output_head(model, optimizer=optimizer)
    head = model.lm_head.weight
    assert head is not shared and report.optimizers_updated == 1 and report.optimizer_state == "copy"
    assert groups_of(optimizer, head) == groups_of(optimizer, shared) == [1]  # the shared matrix's group: lr 0.05
    assert torch.equal(optimizer.state[head]["exp_avg"], optimizer.state[shared]["exp_avg"])
    assert optimizer.state[head]["exp_avg"] is not optimizer.state[shared]["exp_avg"]
    before = head.detach().clone()
    optimizer.zero_grad()
    step(model, optimizer, 3)
    assert not torch.equal(head.detach(), before)  # it trains
    assert not torch.equal(head.detach(), model.embed_tokens.weight.detach())  # apart from the embedding


def test_a_late_untie_with_no_optimizer_known_raises_naming_the_fix():
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=V, d_model=D, tie_weights=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step(model, optimizer, 0)  # the tied matrix holds a gradient: training is under way
    with pytest.raises(HeadwatchError, match=r"no optimizer known.*Pass optimizer=.*trainer=.*configure_model"):
        untie_output_head(model)
    assert model.lm_head.weight is model.embed_tokens.weight  # left tied


def test_a_trainer_that_is_no_trainer_is_refused():
    model = TinyCausalLM(vocab_size=V, d_model=D, tie_weights=True)
    with pytest.raises(HeadwatchError, match="`trainer` must be a Lightning Trainer"):
        untie_output_head(model, trainer=object())


class UntieAt(pl.Callback):
    """Unties the module's head at the start of training batch ``at`` (the optimizers are built and stepping)."""

    def __init__(self, at: int, explicit: bool) -> None:
        self.at, self.explicit, self.report, self.at_untie = at, explicit, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            self.report = untie_output_head(pl_module, trainer=trainer if self.explicit else None)
            self.at_untie = pl_module.lm_head.weight.detach().clone()


@pytest.mark.parametrize("explicit", [False, True], ids=["attached-module", "trainer="])
def test_a_late_untie_under_lightning_puts_the_head_into_the_trainers_optimizer(tmp_path, explicit):
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=V, d_model=D, tie_weights=True)
    untie = UntieAt(2, explicit)
    trainer = make_trainer(tmp_path, [untie], max_steps=4)
    trainer.fit(model, loader(n=32))
    head = model.lm_head.weight
    (optimizer,) = trainer.optimizers
    assert untie.report.optimizers_updated == 1 and groups_of(optimizer, head)
    assert not torch.equal(head.detach(), untie.at_untie)  # two steps after the untie, it moved
    assert not torch.equal(head.detach(), model.embed_tokens.weight.detach())


def test_a_late_untie_under_the_hugging_face_trainer_puts_the_head_into_its_optimizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.helpers.hf import Rows, hf_args, one_batch, tiny_llama

    model = tiny_llama(tie=True)
    seen: dict = {}

    class UntieAtStep(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                seen["report"] = untie_output_head(model, trainer=seen["trainer"])
                seen["at_untie"] = model.lm_head.weight.detach().clone()

    args = hf_args(tmp_path, max_steps=4, learning_rate=0.05, optim="adamw_torch")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(one_batch(), repeat=4), callbacks=[UntieAtStep()])
    seen["trainer"] = trainer
    trainer.train()
    head = model.lm_head.weight
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert seen["report"].optimizers_updated == 1 and seen["report"].optimizer_state == "copy"
    assert groups_of(inner, head) and head is not model.model.embed_tokens.weight
    assert not torch.equal(head.detach(), seen["at_untie"])  # it trained after the untie
    assert model.config.tie_word_embeddings is False
