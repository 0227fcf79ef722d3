"""SharpnessCollapseAlert in real Trainer runs: severities and for_steps against the logged values,
validation metric names (a misnamed metric, two validation dataloaders)."""

from __future__ import annotations

import math

import pytest
import torch

from headwatch import LogitStatsMonitor, SharpnessCollapseAlert
from headwatch.errors import HeadwatchError
from tests.helpers import TinyCausalLM, loader
from tests.helpers.events import read_events
from tests.helpers.lightning_runs import make_trainer


class PlantedEntropy(TinyCausalLM):
    """At step k the head's output is uniform over the first ``WIDTH[k]`` tokens (others -1e4):
    the entropy is exactly ``log WIDTH[k]`` nats at every position."""

    WIDTH = [1, 64, 32, 32, 64, 64, 1, 64]

    def __init__(self):
        super().__init__()
        self.lm_head.register_forward_hook(self._plant)  # runs before headwatch's hook

    def _plant(self, module, args, logits):
        if self._trainer is None:
            return logits
        width = self.WIDTH[min(self.global_step, len(self.WIDTH) - 1)]
        planted = torch.full_like(logits, -1e4)
        planted[..., :width] = 0.0
        return logits + (planted - logits).detach()


def test_ceiling_severities_and_for_steps_on_a_planted_series(tmp_path):
    # H_k = log WIDTH[k]: 0, 4.159, 3.466, 3.466, 4.159, 4.159, 0, 4.159 (log 64 = 4.159, log 32 = 3.466)
    # warning 3.0 for 2 steps: above at 1, 2 -> fires at 2; critical 4.0 for 2 steps: above at 1, then 2 (3.466)
    # restarts the count, above at 4, 5 -> fires at 5; stop_training acts on it: the run ends after step 5.
    alert = SharpnessCollapseAlert(entropy_ceiling=(3.0, 4.0), entropy_drop=None, for_steps=2, stop_training=True)
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(validation=False), alert], max_steps=8, log_every_n_steps=1)
    trainer.fit(PlantedEntropy(), loader(n=96, batch_size=8, pad=False))
    acc = read_events(trainer.logger.log_dir)
    logged = [e.value for e in acc.Scalars("headwatch/logits/entropy")]
    assert logged == pytest.approx([math.log(w) for w in PlantedEntropy.WIDTH[:6]], abs=1e-5)
    assert [(a.step, a.severity) for a in alert.alerts] == [(2, "warning"), (5, "critical")]
    assert trainer.global_step == 6
    assert [e.step for e in acc.Scalars("headwatch/alerts/entropy_ceiling_warning")] == [2]
    assert [e.step for e in acc.Scalars("headwatch/alerts/entropy_ceiling")] == [5]


def test_stop_with_only_warning_thresholds_is_refused():
    with pytest.raises(HeadwatchError, match="critical"):
        SharpnessCollapseAlert(entropy_floor={"warning": 1.0}, entropy_drop=None, stop_training=True)


def test_misnamed_validation_metric_warns_with_the_closest_names(tmp_path):
    alert = SharpnessCollapseAlert(entropy_drop=None, patience=1, val_metric="val/loss")
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(), alert], max_steps=4, val_check_interval=2)
    with pytest.warns(UserWarning, match=r"'val/loss' was not logged.*closest logged names are 'val_loss'"):
        trainer.fit(TinyCausalLM(), loader(n=96, batch_size=8), loader(n=16, batch_size=8))


def test_misnamed_training_metric_warns_with_the_closest_names(tmp_path):
    alert = SharpnessCollapseAlert(entropy_floor=1.0, entropy_drop=None, entropy_metric="headwatch/logit/entropy",
                                   kl_metric="headwatch/logits/kl_uniform")
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(validation=False), alert], max_steps=21, log_every_n_steps=1)
    with pytest.warns(UserWarning, match=r"'headwatch/logit/entropy' \(the closest logged names are 'headwatch/logits/entropy'"):
        trainer.fit(TinyCausalLM(), loader(n=192, batch_size=8))


def test_one_misspelt_metric_is_offered_every_published_name(tmp_path, recwarn):
    """Only the entropy's name is wrong (the KL's is published): the suggestion comes from every published name,
    not only from the watched values (which would offer kl_to_uniform)."""
    alert = SharpnessCollapseAlert(entropy_floor=1.0, entropy_drop=None, entropy_metric="headwatch/logits/entropyy")
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(validation=False), alert], max_steps=21, log_every_n_steps=1)
    trainer.fit(TinyCausalLM(), loader(n=192, batch_size=8))
    said = [str(w.message) for w in recwarn.list if "entropyy" in str(w.message)]
    assert len(said) == 1 and "the closest logged names are 'headwatch/logits/entropy'" in said[0], said


class TwoValidations(TinyCausalLM):
    """Logs planted validation values per dataloader: ``val_loss`` and ``val_ent`` at validation ``v``."""

    LOSSES = {0: [3.0, 2.9, 2.9, 2.9], 1: [3.0, 2.5, 2.0, 1.99]}
    ENTROPY = [5.0, 4.5, 4.0, 3.5]

    def __init__(self):
        super().__init__()
        self.validations = 0

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        v = self.validations
        self.log("val_loss", self.LOSSES[dataloader_idx][v])  # Lightning adds /dataloader_idx_k
        self.log("val_ent", self.ENTROPY[v])

    def on_validation_epoch_end(self):
        self.validations += 1


@pytest.mark.parametrize("idx, steps", [(0, [6]), (1, [8]), (2, [])])
def test_val_stall_watches_the_named_dataloader(tmp_path, idx, steps, recwarn):
    # patience 1, delta 0.05: validations after steps 2, 4, 6, 8 (v = 0..3).
    # dataloader 0: v1 improved 0.1; v2 improved 0.0 < 0.05 while val_ent fell (4.5 - 4.0) / 4.5 = 11%: fires
    #   at step 6 (v3 still stalls: the episode stays open).
    # dataloader 1: improves 0.5 at v1 and v2; v3 improved 0.01 while val_ent fell 12.5%: fires at step 8.
    alert = SharpnessCollapseAlert(entropy_drop=None, patience=1, val_delta=0.05, val_entropy_metric="val_ent",
                                   val_dataloader_idx=idx)
    trainer = make_trainer(tmp_path, [alert], max_steps=8, val_check_interval=2, log_every_n_steps=1)
    trainer.fit(TwoValidations(), loader(n=96, batch_size=8), [loader(n=16, batch_size=8), loader(n=16, batch_size=8)])
    assert [a.step for a in alert.alerts] == steps
    if steps:
        loss = TwoValidations.LOSSES[idx][3 if idx else 2]
        assert alert.alerts[0].metrics["val_loss"] == pytest.approx(loss) and "dataloader " + str(idx) in alert.alerts[0].message
    else:
        assert any("val_dataloader_idx=2" in str(w.message) for w in recwarn.list)


class PlantedNLL(TinyCausalLM):
    """Logs planted ``rare_nll`` / ``all_nll`` values at each training step (read by the alert by name)."""

    RARE = [5.0, 5.0, 5.5, 6.2, 6.2, 6.2]
    ALL = [4.0, 3.9, 3.8, 3.7, 3.7, 3.6]

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("rare_nll", self.RARE[self.global_step])
        self.log("all_nll", self.ALL[self.global_step])
        return loss


def test_rare_nll_rise_through_the_lightning_alert(tmp_path):
    # smoothing 1 (no smoothing), window 2: rise over 2 steps and overall falling
    # k=2: 5.5-5.0=0.5 (all 3.8<4.0) > 0.4 -> fires at 2; k=3: 1.2 still fired; k=4: 6.2-5.5=0.7, 3.7<3.8 held;
    # k=5: 6.2-6.2=0 <= 0.38 -> resolved; never fires again
    alert = SharpnessCollapseAlert(entropy_drop=None, rare_nll_rise=0.4, rare_window=2, smoothing=1.0,
                                   rare_nll_metric="rare_nll", nll_metric="all_nll")
    trainer = make_trainer(tmp_path, [alert], max_steps=6, log_every_n_steps=1)
    trainer.fit(PlantedNLL(), loader(n=96, batch_size=8))
    assert [(a.rule, a.step) for a in alert.alerts] == [("rare_nll_rise", 2)]
