"""Bad input to every public function: a Python list, a NumPy array or a string where a tensor
belongs, and boolean or floating token ids, get a :class:`HeadwatchError` naming the argument, what it must be
and what was given; never an unrelated exception, never silent acceptance. (Constructors: tests/core/test_checks.py.)"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from headwatch import functional as F
from headwatch.errors import HeadwatchError

TENSOR_ARGS = [
    (name, param)
    for name in F.__all__
    if inspect.isfunction(getattr(F, name))
    for param, p in inspect.signature(getattr(F, name)).parameters.items()
    if str(p.annotation).replace("torch.", "") in ("Tensor", "Tensor | None")
]
BAD = {"list": [[1.0, 2.0]], "ndarray": np.ones((2, 2), dtype=np.float32), "str": "logits"}


def test_the_table_covers_the_functional_api():
    assert len({n for n, _ in TENSOR_ARGS}) >= 40, sorted({n for n, _ in TENSOR_ARGS})


@pytest.mark.parametrize(("kind"), sorted(BAD))
@pytest.mark.parametrize(("name", "param"), TENSOR_ARGS, ids=[f"{n}.{p}" for n, p in TENSOR_ARGS])
def test_a_non_tensor_is_refused_naming_the_argument(name, param, kind):
    fn = getattr(F, name)
    with pytest.raises(HeadwatchError, match=rf"`{param}` must be a torch\.Tensor.*, got"):
        fn(**{param: BAD[kind]})


@pytest.mark.parametrize("ids", [torch.ones(2, 3, dtype=torch.bool), torch.ones(2, 3)], ids=["bool", "float"])
def test_token_ids_must_be_integers(ids):
    logits = torch.randn(2, 3, 8)
    with pytest.raises(HeadwatchError, match="targets"):
        F.logit_statistics(logits, targets=ids)
    with pytest.raises(HeadwatchError, match="`targets` must be an integer tensor of token ids"):
        F.calibration_update(logits, ids, torch.zeros(2, 3, dtype=torch.long), 5)


@pytest.mark.parametrize("ignore_index", [-100.0, True, "x", None, 2**70 + 0.5])
def test_the_functions_refuse_an_ignore_index_that_is_not_an_int(ignore_index):
    logits, targets = torch.randn(2, 3, 8), torch.randint(0, 8, (2, 3))
    with pytest.raises(HeadwatchError, match="`ignore_index` must be an int"):
        F.logit_statistics(logits, targets=targets, ignore_index=ignore_index)
    F.logit_statistics(logits, targets=targets, ignore_index=-1)  # an int is taken


def test_a_string_ignore_index_and_an_empty_metric_name_are_refused():
    from headwatch.alerts import CollapseRules
    from headwatch.model.batch import BatchFormat

    with pytest.raises(HeadwatchError, match="`ignore_index` must be an int, got 'x'"):
        BatchFormat(ignore_index="x")
    with pytest.raises(HeadwatchError, match="`entropy_metric` must be a non-empty string, got ''"):
        CollapseRules(entropy_metric="")


def test_non_finite_values_never_poison_an_alert_rules_smoothing():
    """The documented policy (CollapseRules): a NaN or infinite value is skipped; it neither counts nor restarts."""
    from headwatch.alerts import CollapseRules

    e = "headwatch/logits/entropy"
    clean, dirty = CollapseRules(entropy_drop=0.3), CollapseRules(entropy_drop=0.3)
    values = [3.0, 2.9, 2.8, 2.7]
    for step, v in enumerate(values):
        clean.observe_train(step, {e: v})
    for step, v in enumerate([3.0, float("nan"), 2.9, float("inf"), -float("inf"), 2.8, 2.7]):
        dirty.observe_train(step, {e: v})
    assert dirty.smoothed == clean.smoothed and list(dirty.history) == list(clean.history)


def _plain_step(hw, model, with_labels: bool) -> dict:
    ids = torch.randint(0, 64, (2, 8))
    hw.step_start({"input_ids": ids, "labels": ids} if with_labels else {"input_ids": ids}, 0)
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
    hw.before_optimizer_step()
    hw.after_optimizer_step()
    return hw.step_end()


def test_strict_raises_where_the_default_warns_but_never_on_a_note():
    """A limitation (a batch without labels: target statistics NaN) warns by default and raises under strict; a
    note on how something is measured (the hidden-state path, forced here) is said and never raised."""
    import warnings

    from headwatch import Headwatch
    from headwatch.core import LogitStats
    from tests.helpers import TinyCausalLM

    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=64, d_model=16)
    with pytest.warns(UserWarning, match="labels"):
        _plain_step(Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=0), model, False)
    model = TinyCausalLM(vocab_size=64, d_model=16)  # a fresh model each time: hooks of the last Headwatch stay
    with pytest.raises(HeadwatchError, match="labels"):
        _plain_step(Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=0, strict=True), model, False)
    model = TinyCausalLM(vocab_size=64, d_model=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hw = Headwatch(model, monitors=[LogitStats(path="hidden")], log_every_n_steps=1, figure_every_n_steps=0, strict=True)
        values = _plain_step(hw, model, True)
    assert any("(said once)" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert values["headwatch/logits/positions"] == 2 * 7
