"""GradientDensityMonitor and TokenFrequency in real Trainer runs, against hand-computed values."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from headwatch import GradientDensityMonitor, HeadwatchError, TokenFrequency
from tests.helpers import TinyCausalLM, ids_loader, loader
from tests.helpers.gradients import GradRecorder, Recording
from tests.helpers.lightning_runs import make_trainer

V = 64


def metrics(trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def test_only_two_token_ids_give_embedding_density_two_over_v(tmp_path):
    ids = torch.tensor([3, 7, 7, 3, 3, 7]).repeat(8, 1)  # only tokens 3 and 7 ever occur
    trainer = make_trainer(tmp_path, [GradientDensityMonitor()], max_steps=1, log_every_n_steps=1)
    trainer.fit(TinyCausalLM(vocab_size=V), ids_loader(ids, 4))
    m = metrics(trainer)
    assert m["headwatch/grad/embedding_row_density"] == 2 / V
    assert m["headwatch/grad/head_row_density"] == 1.0
    assert m["headwatch/grad/tied"] == 0.0
    assert m["headwatch/grad/unseen/embedding_row_density"] == 0.0
    assert m["headwatch/grad/unseen/head_row_density"] == 1.0
    tracker = next(c for c in trainer.callbacks if isinstance(c, TokenFrequency))
    counts = tracker.snapshot(trainer).counts
    assert counts[3].item() == 12 and counts[7].item() == 12 and counts.sum().item() == 24


def _twins():
    torch.manual_seed(0)
    tied = TinyCausalLM(vocab_size=V, tie_weights=True)
    untied = TinyCausalLM(vocab_size=V, tie_weights=False)
    state = {k: v for k, v in tied.state_dict().items()}
    untied.load_state_dict(state)  # lm_head.weight and embed_tokens.weight: the same values, two Parameters
    assert untied.lm_head.weight is not untied.embed_tokens.weight
    torch.testing.assert_close(untied.lm_head.weight, tied.embed_tokens.weight, rtol=0, atol=0)
    return tied, untied


def test_tied_decomposition_matches_untied_twin(tmp_path):
    tied, untied = _twins()
    data = loader(n=8, batch_size=8)
    rec_tied = Recording(log_every_n_steps=1)
    make_trainer(tmp_path, [rec_tied], max_steps=1).fit(tied, data)
    twin = GradRecorder()
    make_trainer(tmp_path, [twin], max_steps=1).fit(untied, data)
    flows = rec_tied.recorded[0]
    torch.testing.assert_close(flows["embedding"], twin.grads[0]["embedding"], rtol=0, atol=1e-6)
    torch.testing.assert_close(flows["head"], twin.grads[0]["head"], rtol=0, atol=1e-6)
    torch.testing.assert_close(flows["embedding"] + flows["head"], flows["shared"], rtol=0, atol=1e-6)


def test_tied_statistics_are_logged(tmp_path):
    tied, _ = _twins()
    tied.embed_tokens.padding_idx = 0  # a row that is not valid: left out of the histograms
    trainer = make_trainer(tmp_path, [GradientDensityMonitor()], max_steps=2, log_every_n_steps=1)
    trainer.fit(tied, loader(n=16))
    m = metrics(trainer)
    assert m["headwatch/grad/tied"] == 1.0
    assert 0 < m["headwatch/grad/embedding_row_density"] < 1
    assert m["headwatch/grad/head_row_density"] == 1.0
    assert -1 <= m["headwatch/grad/tied_flow_cosine_mean"] <= 1
    assert 0 <= m["headwatch/grad/tied_flow_conflict_fraction"] <= 1
    assert m["headwatch/grad/tied_flow_rows"] > 0
    assert "headwatch/update/shared_row_density" in m and "headwatch/freq/shared_norm_spearman" in m
    acc = EventAccumulator(trainer.logger.log_dir)
    acc.Reload()
    assert "headwatch/grad/tying/text_summary" in acc.Tags()["tensors"]
    assert "headwatch/grad/embedding_row_norm_histogram" in acc.Tags()["histograms"]
    hist = acc.Histograms("headwatch/grad/embedding_row_norm_histogram")[-1].histogram_value
    assert hist.num == V - 1 and hist.min >= 0  # the valid rows' norms (not padding_idx's), nothing else


def test_norm_statistics_equal_numpy_on_the_recorded_gradient(tmp_path):
    rec = GradRecorder()
    trainer = make_trainer(tmp_path, [GradientDensityMonitor(log_every_n_steps=1), rec], max_steps=1)
    trainer.fit(TinyCausalLM(vocab_size=V), loader(n=8))
    m = metrics(trainer)
    tracker = next(c for c in trainer.callbacks if isinstance(c, TokenFrequency))
    counts = tracker.snapshot(trainer).counts.numpy()
    for flow in ("embedding", "head"):
        norms = np.linalg.norm(rec.grads[0][flow].double().numpy(), axis=1)
        assert m[f"headwatch/grad/{flow}_row_norm_mean"] == pytest.approx(norms.mean(), rel=1e-5)
        assert m[f"headwatch/grad/{flow}_row_norm_max"] == pytest.approx(norms.max(), rel=1e-5)
        assert m[f"headwatch/grad/{flow}_row_norm_p50"] == pytest.approx(np.percentile(norms, 50), rel=1e-5)
        assert m[f"headwatch/grad/{flow}_row_norm_p95"] == pytest.approx(np.percentile(norms, 95), rel=1e-5)
        assert m[f"headwatch/grad/unseen/{flow}_row_norm_mean"] == pytest.approx(norms[counts == 0].mean(), rel=1e-5, abs=1e-12)
    seen = counts > 0
    from scipy.stats import spearmanr

    for name, weight in (("embedding", trainer.lightning_module.embed_tokens.weight), ("head", trainer.lightning_module.lm_head.weight)):
        # the gravity statistic is measured before the step: recompute from the weights minus the SGD update
        before = (weight.detach() + trainer.lightning_module.hparams.lr * rec.grads[0][name]).double().numpy()
        want = spearmanr(np.log(counts[seen]), np.linalg.norm(before, axis=1)[seen]).statistic
        assert m[f"headwatch/freq/{name}_norm_spearman"] == pytest.approx(want, abs=1e-6)


def test_adamw_moves_rows_that_had_no_gradient(tmp_path):
    class AdamLM(TinyCausalLM):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.0)

    # step 0 sees tokens {1, 2}, step 1 sees only {5, 6}: momentum still moves rows 1 and 2
    ids = torch.tensor([[1, 2, 1, 2, 1, 2], [5, 6, 5, 6, 5, 6]])
    trainer = make_trainer(tmp_path, [GradientDensityMonitor(log_every_n_steps=1)], max_steps=2)
    trainer.fit(AdamLM(vocab_size=V), ids_loader(ids, 1))
    m = metrics(trainer)  # the last logged step: step 1
    assert m["headwatch/grad/embedding_row_density"] == 2 / V
    assert m["headwatch/update/embedding_row_density"] == 4 / V
    assert m["headwatch/update/embedding_row_density"] > m["headwatch/grad/embedding_row_density"]


def test_gradient_accumulation_density_is_the_union(tmp_path):
    ids = torch.tensor([[1, 2, 1, 2], [9, 9, 9, 9]])  # two micro-batches with disjoint tokens
    trainer = make_trainer(
        tmp_path, [GradientDensityMonitor(log_every_n_steps=1)], max_steps=1, accumulate_grad_batches=2
    )
    trainer.fit(TinyCausalLM(vocab_size=V), ids_loader(ids, 1))
    assert metrics(trainer)["headwatch/grad/embedding_row_density"] == 3 / V


def test_gradient_accumulation_tied_split_spans_micro_batches(tmp_path):
    tied, untied = _twins()
    ids = torch.tensor([[1, 2, 1, 2], [9, 9, 9, 9]])
    rec = Recording(log_every_n_steps=1)
    make_trainer(tmp_path, [rec], max_steps=1, accumulate_grad_batches=2).fit(tied, ids_loader(ids, 1))
    twin = GradRecorder()
    make_trainer(tmp_path, [twin], max_steps=1, accumulate_grad_batches=2).fit(untied, ids_loader(ids, 1))
    torch.testing.assert_close(rec.recorded[0]["embedding"], twin.grads[0]["embedding"], rtol=0, atol=1e-6)
    assert (rec.recorded[0]["embedding"] != 0).any(1).sum().item() == 3


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_norms_are_unscaled(tmp_path, precision):
    tied, untied = _twins()
    data = loader(n=8, batch_size=8, pad=False)

    def plugin():
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if precision == "16-mixed" else None
        return MixedPrecision(precision, "cpu", scaler=scaler)

    rec = Recording(log_every_n_steps=1)
    tied_trainer = make_trainer(tmp_path, [rec], max_steps=1, plugins=[plugin()])
    tied_trainer.fit(tied, data)
    twin = GradRecorder()
    untied_trainer = make_trainer(tmp_path, [GradientDensityMonitor(log_every_n_steps=1), twin], max_steps=1, plugins=[plugin()])
    untied_trainer.fit(untied, data)
    # the twin's .grad is unscaled by Lightning; the tied lookup part must be unscaled by headwatch
    torch.testing.assert_close(rec.recorded[0]["embedding"], twin.grads[0]["embedding"], rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(rec.recorded[0]["head"], twin.grads[0]["head"], rtol=1e-3, atol=1e-6)
    norms = np.linalg.norm(twin.grads[0]["head"].double().numpy(), axis=1)
    assert metrics(untied_trainer)["headwatch/grad/head_row_norm_mean"] == pytest.approx(norms.mean(), rel=1e-5)


def test_sparse_embedding(tmp_path):
    class SparseLM(TinyCausalLM):
        def __init__(self):
            super().__init__(vocab_size=V)
            self.embed_tokens = torch.nn.Embedding(V, 16, sparse=True)

    ids = torch.tensor([[4, 5, 6, 4], [4, 4, 5, 5]])
    trainer = make_trainer(tmp_path, [GradientDensityMonitor(log_every_n_steps=1)], max_steps=1)
    trainer.fit(SparseLM(), ids_loader(ids, 2))
    m = metrics(trainer)
    assert m["headwatch/grad/embedding_row_density"] == 3 / V
    assert m["headwatch/grad/head_row_density"] == 1.0


def test_padded_vocabulary_and_padding_idx_are_excluded(tmp_path):
    class PaddedLM(TinyCausalLM):
        def __init__(self):
            super().__init__(vocab_size=V)
            self.embed_tokens = torch.nn.Embedding(V, 16, padding_idx=0)

    # the tokenizer has 56 tokens; rows 56..63 pad the vocabulary to a multiple of 8; token 0 is padding
    # (a token only at the last position gets no gradient: its logits are not scored)
    ids = torch.tensor([[0, 4, 3, 0], [0, 5, 5, 3]])
    tracker = TokenFrequency(vocab_size=56)
    trainer = make_trainer(tmp_path, [tracker, GradientDensityMonitor(log_every_n_steps=1)], max_steps=1)
    trainer.fit(PaddedLM(), ids_loader(ids, 2))
    m = metrics(trainer)
    valid = 56 - 1  # rows 0..55 minus padding_idx
    assert m["headwatch/grad/embedding_row_density"] == pytest.approx(3 / valid, rel=1e-7)
    assert m["headwatch/grad/head_row_density"] == 1.0  # over the 55 valid rows only
    snap = tracker.snapshot(trainer)
    assert snap.valid.sum().item() == valid and not snap.valid[0] and not snap.valid[56:].any()
    assert (snap.bucket[56:] == -1).all() and not snap.rare[56:].any()


class SeenIds(Callback):
    """Independent count of the token ids of every training batch Lightning actually ran."""

    def __init__(self):
        self.counts = torch.zeros(V, dtype=torch.long)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counts += torch.bincount(batch["input_ids"].flatten(), minlength=V)


def test_token_counts_survive_a_checkpoint(tmp_path):
    data = loader(n=16, batch_size=4, pad=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    tracker, seen = TokenFrequency(), SeenIds()
    trainer = make_trainer(tmp_path, [tracker, GradientDensityMonitor(), ckpt, seen], enable_checkpointing=True, max_steps=4)
    trainer.fit(TinyCausalLM(vocab_size=V), data)
    assert torch.equal(tracker.snapshot(trainer).counts, seen.counts)
    resumed, seen_after = TokenFrequency(), SeenIds()
    trainer = make_trainer(tmp_path, [resumed, GradientDensityMonitor(), seen_after], max_steps=8)
    trainer.fit(TinyCausalLM(vocab_size=V), data, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    total = seen.counts + seen_after.counts  # restored counts + the resumed run's
    assert torch.equal(resumed.snapshot(trainer).counts, total)
    state = resumed.state_dict()
    assert torch.equal(state["counts"], total) and state["num_rows"] == V and state["out_of_range"] == 0


def test_monitors_share_one_tracker(tmp_path):
    from headwatch import LogitStatsMonitor

    monitors = [GradientDensityMonitor(prefix="a"), GradientDensityMonitor(prefix="b"), LogitStatsMonitor()]
    trainer = make_trainer(tmp_path, monitors, max_steps=2)
    trainer.fit(TinyCausalLM(vocab_size=V), loader(n=8, batch_size=4, pad=False))
    trackers = [c for c in trainer.callbacks if isinstance(c, TokenFrequency)]
    assert len(trackers) == 1
    assert trackers[0].snapshot(trainer).counts.sum().item() == 2 * 4 * 12  # counted once per step


def test_vocabulary_mismatch_between_embedding_and_head(tmp_path):
    class Mismatch(TinyCausalLM):
        def __init__(self):
            super().__init__(vocab_size=V)
            self.lm_head = torch.nn.Linear(16, V + 8, bias=False)

    # a monitoring limitation never stops training (docs/evaluation.md): refused with the cause; strict raises it
    trainer = make_trainer(tmp_path, [GradientDensityMonitor(embedding="embed_tokens")])
    with pytest.warns(UserWarning, match="vocabulary mismatch.*training goes on"):
        trainer.fit(Mismatch(), loader())
    assert trainer.global_step == 4
    with pytest.raises(HeadwatchError, match="vocabulary mismatch"):
        make_trainer(tmp_path, [GradientDensityMonitor(embedding="embed_tokens", strict=True)]).fit(Mismatch(), loader())
    with pytest.raises(HeadwatchError, match="larger than the input embedding"):
        make_trainer(tmp_path, [TokenFrequency(vocab_size=V + 1), GradientDensityMonitor(strict=True)]).fit(
            TinyCausalLM(vocab_size=V), loader()
        )


def test_frozen_embedding_is_skipped_with_a_warning(tmp_path):
    model = TinyCausalLM(vocab_size=V)
    model.embed_tokens.weight.requires_grad_(False)
    trainer = make_trainer(tmp_path, [GradientDensityMonitor(log_every_n_steps=1)], max_steps=1)
    with pytest.warns(UserWarning, match="`embed_tokens` is FROZEN: it gets no gradient"):
        trainer.fit(model, loader())
    m = metrics(trainer)
    assert "headwatch/grad/embedding_row_density" not in m and m["headwatch/grad/head_row_density"] == 1.0


def test_no_work_off_logging_steps(tmp_path, monkeypatch):
    import headwatch.distributed.sharded as gd  # where GradientDensity computes row norms (plain or sharded rows)

    calls = []
    original = gd.row_norms
    monkeypatch.setattr(gd, "row_norms", lambda m: calls.append(1) or original(m))
    tied, _ = _twins()
    monitor = GradientDensityMonitor(log_every_n_steps=3)
    make_trainer(tmp_path, [monitor], max_steps=6).fit(tied, loader(n=48))
    per_step = len(calls) // 2
    assert len(calls) == 2 * per_step and per_step > 0  # steps 2 and 5 only
    assert monitor._lookup_capture.gradient is None and not monitor._before  # nothing kept between logging steps


def test_checkpoint_state_and_bad_arguments(tmp_path):
    monitor = GradientDensityMonitor(log_every_n_steps=1)
    make_trainer(tmp_path, [monitor], max_steps=2).fit(TinyCausalLM(vocab_size=V), loader())
    state = monitor.state_dict()
    assert state["logged_steps"] == 2
    other = GradientDensityMonitor()
    other.load_state_dict(copy.deepcopy(state))
    assert other.state_dict() == state
    with pytest.raises(HeadwatchError, match="update_density"):
        GradientDensityMonitor(update_density="yes")
    with pytest.raises(HeadwatchError, match="embedding"):
        GradientDensityMonitor(embedding=3)
    with pytest.raises(HeadwatchError, match="rare_fraction"):
        TokenFrequency(rare_fraction=0)
    with pytest.raises(HeadwatchError, match="vocab_size"):
        TokenFrequency(vocab_size=0)


def test_trainer_runs_without_logger(tmp_path):
    trainer = make_trainer(tmp_path, [GradientDensityMonitor(log_every_n_steps=1)], max_steps=1, logger=False)
    trainer.fit(TinyCausalLM(vocab_size=V), loader())
    assert metrics(trainer)["headwatch/grad/head_row_density"] == 1.0


def test_pl_seed():
    # keeps test order independent: the twins above seed torch themselves
    pl.seed_everything(0, verbose=False)


def test_tied_lookup_by_keyword_is_captured_and_functional_lookup_is_reported(tmp_path):
    import torch.nn.functional as F

    class KeywordLookup(TinyCausalLM):
        def forward(self, input_ids):
            h = self.embed_tokens(input=input_ids)
            return self.lm_head(h + torch.tanh(self.mix(h.cumsum(1) / torch.arange(1, h.shape[1] + 1).view(1, -1, 1))))

    class FunctionalLookup(TinyCausalLM):
        def forward(self, input_ids):
            h = F.embedding(input_ids, self.embed_tokens.weight)  # the module's forward never runs
            return self.lm_head(h + torch.tanh(self.mix(h.cumsum(1) / torch.arange(1, h.shape[1] + 1).view(1, -1, 1))))

    trainer = make_trainer(tmp_path, [GradientDensityMonitor(log_every_n_steps=1)], max_steps=1)
    trainer.fit(KeywordLookup(vocab_size=V, tie_weights=True), loader())
    m = metrics(trainer)
    assert 0 < m["headwatch/grad/embedding_row_density"] < 1 and m["headwatch/grad/tied_flow_rows"] > 0
    trainer = make_trainer(tmp_path, [GradientDensityMonitor(log_every_n_steps=1)], max_steps=1)
    with pytest.warns(UserWarning, match="cannot be split into the lookup and scoring flows"):
        trainer.fit(FunctionalLookup(vocab_size=V, tie_weights=True), loader())
    m = metrics(trainer)
    assert "headwatch/grad/embedding_row_density" not in m  # not silently reported as zero
    assert m["headwatch/grad/shared_row_density"] == 1.0


def test_token_counting_failure_does_not_stop_training(tmp_path):
    calls = {"n": 0}

    def flaky_ids(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyError("input_ids")  # one odd batch from a mixed dataloader
        return batch["input_ids"]

    tracker = TokenFrequency(ids_fn=flaky_ids)
    trainer = make_trainer(tmp_path, [tracker, GradientDensityMonitor()], max_steps=3)
    with pytest.warns(UserWarning, match="counting the batch's token ids"):
        trainer.fit(TinyCausalLM(vocab_size=V), loader(n=12, batch_size=4, pad=False))
    assert trainer.global_step == 3
    assert tracker.snapshot(trainer).counts.sum().item() == 2 * 4 * 12  # the two good batches


def test_resume_after_the_vocabulary_grew(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    make_trainer(tmp_path, [TokenFrequency(), ckpt], enable_checkpointing=True, max_steps=2).fit(
        TinyCausalLM(vocab_size=V), loader(n=8, pad=False)
    )
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]
    (saved,) = [v for k, v in state.items() if k.startswith("TokenFrequency")]
    grown = TokenFrequency()
    trainer = make_trainer(tmp_path, [grown], max_steps=1)
    bigger = TinyCausalLM(vocab_size=V + 8)  # tokens added: resize_token_embeddings
    grown.setup(trainer, bigger, "fit")
    with pytest.warns(UserWarning, match="the added rows start at count 0"):
        grown.load_state_dict(saved)
    assert torch.equal(grown.latest_snapshot().counts[:V], saved["counts"])
    assert grown.latest_snapshot().counts[V:].sum().item() == 0
    shrunk = TokenFrequency()
    shrunk.setup(trainer, TinyCausalLM(vocab_size=V - 8), "fit")
    with pytest.warns(UserWarning, match="counting starts afresh"):
        shrunk.load_state_dict(saved)
    assert shrunk.latest_snapshot().counts.sum().item() == 0


def test_rare_to_frequent_ratio_is_nan_when_the_frequent_bucket_has_no_gradient():
    from headwatch.functional.rows import norm_ratio

    rare = torch.tensor([0.3, 0.0, 0.25, 0.0], dtype=torch.float32)
    frequent = torch.tensor([0.0, 0.0, 0.5, 2.0], dtype=torch.float32)
    got = norm_ratio(rare, frequent)
    assert torch.isnan(got[0]) and torch.isnan(got[1])  # x / 0 and 0 / 0: undefined, not +inf
    assert got[2].item() == 0.5 and got[3].item() == 0.0  # float64 by hand: 0.25 / 0.5, 0 / 2
    assert not torch.isinf(got).any()
