"""When and where the model appears: built in configure_model or setup, or compiled with fullgraph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headwatch import GradientDensityMonitor, LogitStatsMonitor, SynonymCollisionMonitor
from tests.helpers import TinyCausalLM, loader
from tests.helpers.lightning_runs import make_trainer


class BuiltLater(TinyCausalLM):
    """The layers exist only after ``configure_model`` (the FSDP way) or ``setup``."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where
        del self.embed_tokens, self.mix, self.lm_head

    def _build(self):
        if not hasattr(self, "lm_head"):
            torch.manual_seed(0)
            self.embed_tokens = nn.Embedding(64, 16)
            self.mix = nn.Linear(16, 16)
            self.lm_head = nn.Linear(16, 64, bias=False)

    def configure_model(self):
        if self.where == "configure_model":
            self._build()

    def setup(self, stage):
        if self.where == "setup":
            self._build()


def _callbacks():
    return [
        LogitStatsMonitor(figure_every_n_steps=0),
        GradientDensityMonitor(figure_every_n_steps=0),
        SynonymCollisionMonitor(every_n_steps=2, figures=False),
    ]


@pytest.mark.parametrize("where", ["configure_model", "setup"])
def test_model_built_in_configure_model_or_setup(tmp_path, where):
    model = BuiltLater(where)
    trainer = make_trainer(tmp_path, _callbacks(), max_steps=2, log_every_n_steps=1, val_check_interval=2)
    trainer.fit(model, loader(), loader(n=8, seed=1))
    m = trainer.callback_metrics
    assert float(m["headwatch/logits/positions"]) > 0 and float(m["headwatch/grad/head_row_density"]) == 1.0
    assert "headwatch/collision/rare_rate_head" in m and "headwatch/val/logits/entropy" in m


def _values(tmp_path, compiled: bool) -> dict[str, float]:
    torch.manual_seed(0)
    model = TinyCausalLM()
    if compiled:  # the network compiled as one graph; Lightning's own logging stays outside it
        model.forward = torch.compile(model.forward, fullgraph=True)
    callbacks = [LogitStatsMonitor(figure_every_n_steps=0, validation=False), GradientDensityMonitor(figure_every_n_steps=0)]
    trainer = make_trainer(tmp_path, callbacks, max_steps=2, log_every_n_steps=1)
    trainer.fit(model, loader(n=16))
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("headwatch/")}


def test_torch_compile_fullgraph_measures_the_same_values_as_eager(tmp_path):
    eager = _values(tmp_path / "eager", False)
    compiled = _values(tmp_path / "compiled", True)  # was: "Skip inlining torch.compiler.disable()d function"
    assert compiled.keys() == eager.keys() and eager["headwatch/logits/positions"] > 0
    for key, value in eager.items():
        if "/overhead/" not in key:  # headwatch's own timings: measured values of each run
            assert compiled[key] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), key
