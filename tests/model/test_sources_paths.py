"""The hidden-state path (fused loss, logits_to_keep), diagnoses (compiled, head never run), padding, tie config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from headwatch.errors import HeadwatchError  # noqa: E402
from headwatch.functional.padding import padded_mass  # noqa: E402
from headwatch.model.find import resolve_matrices  # noqa: E402
from headwatch.model.sources import resolve_logits_source  # noqa: E402
from tests.helpers import positions  # noqa: E402
from tests.helpers.sources import llama_batch, run_captured, tiny_llama  # noqa: E402


def assert_same_statistics(a, b, atol=1e-5):
    assert torch.equal(a.valid, b.valid) and int(a.valid.sum()) > 0
    for field in ("entropy", "nll", "max_prob", "kl_from_uniform"):
        x, y = getattr(a, field), getattr(b, field)
        assert torch.allclose(x[a.valid], y[b.valid], atol=atol), field


def test_logits_to_keep_measures_the_kept_positions_only():
    """``logits_to_keep=k``: the logits of the last k positions, checked against the base's ``last_hidden_state``;
    those positions only (the ones a loss on these logits uses), equal to the full forward's last k."""
    from headwatch.model.capture import LogitsCapture
    from headwatch.model.captured import captured_statistics

    model, batch = tiny_llama(), llama_batch()
    source = resolve_logits_source(model)
    assert source.base is model.model
    mask, targets = positions(batch, source.alignment)
    with torch.no_grad():
        full, _, _ = run_captured(model, source, batch, lambda: model(**batch))
        got = []
        capture = LogitsCapture(source, got.append, model=model)
        capture.attach()
        capture.begin(targets.shape)
        out = model(input_ids=batch["input_ids"], logits_to_keep=3)
        report = capture.end()
        capture.detach()
    assert out.logits.shape == (2, 3, 64)
    assert (report.path, report.reason, report.problem) == ("logits", "kept_positions", None) and got[0].kept == 3
    kept = captured_statistics(got[0], mask[:, -3:], targets[:, -3:]).statistics
    want = full[0][1].statistics
    for field in ("entropy", "max_prob"):  # the last position has no target: entropy over the 2 that do
        a, b = getattr(kept, field), getattr(want, field)[:, -3:]
        assert torch.equal(kept.valid, want.valid[:, -3:]) and int(kept.valid.sum()) == 4
        assert torch.allclose(a[kept.valid], b[kept.valid], atol=1e-5), field


class FusedLinearCrossEntropy(nn.Module):
    """The shape of Liger's / CCE's API: the loss from hidden states and the head's weight, no logits kept."""

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        y = labels[:, 1:].reshape(-1)
        losses = [F.cross_entropy(h[i : i + 4] @ weight.T, y[i : i + 4], ignore_index=-100, reduction="sum")
                  for i in range(0, h.shape[0], 4)]
        return torch.stack(losses).sum() / (y != -100).sum()


class FusedLlama(nn.Module):
    """A training wrapper that never calls the head: hidden states go to a fused loss."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.loss_fn = FusedLinearCrossEntropy()

    def forward(self, input_ids, labels, attention_mask=None):
        hidden = self.lm.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.loss_fn(hidden, self.lm.lm_head.weight, labels)


def test_fused_loss_equals_unfused_statistics():
    lm, batch = tiny_llama(), llama_batch()
    fused = FusedLlama(lm)
    with torch.no_grad():
        unfused, _, out = run_captured(lm, resolve_logits_source(lm), batch, lambda: lm(**batch))
        for hidden_module in (None, "loss_fn"):  # found by itself (the HF inner model), or named
            source = resolve_logits_source(fused, hidden_module=hidden_module)
            results, report, loss = run_captured(fused, source, batch, lambda: fused(**batch))
            assert loss.item() == pytest.approx(out.loss.item(), abs=1e-5)  # the same model, fused
            assert report.measured == 1 and report.path == "hidden" and report.problem is None
            assert "never ran" in report.note or "hidden" in report.note
            assert_same_statistics(unfused[0][1].statistics, results[0][1].statistics)


class TinyLM(nn.Module):
    """Not a Hugging Face model: the head's output is the logits, unless a fused loss is used."""

    def __init__(self, fused: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(64, 16)
        self.mix = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, 64, bias=False)
        self.loss_fn = FusedLinearCrossEntropy() if fused else None

    def forward(self, input_ids, labels=None, attention_mask=None):
        h = self.embed_tokens(input_ids)
        h = h + torch.tanh(self.mix(h.cumsum(1)))
        if self.loss_fn is not None:
            return self.loss_fn(h, self.lm_head.weight, labels)
        return self.lm_head(h)


def test_head_never_run_names_the_cause_and_measures_with_hidden_module():
    model, batch = TinyLM(fused=True), llama_batch()
    plain = TinyLM()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        silent, report, _ = run_captured(model, resolve_logits_source(model), batch, lambda: model(**batch))
        assert report.measured == 0 and report.problem == "head_not_called" and not silent
        assert "fused linear cross-entropy" in report.message and "hidden_module=" in report.message
        source = resolve_logits_source(model, hidden_module="loss_fn")
        results, report, _ = run_captured(model, source, batch, lambda: model(**batch))
        ref, _, _ = run_captured(plain, resolve_logits_source(plain), batch, lambda: plain(**batch))
    assert report.measured == 1 and report.path == "hidden"
    assert_same_statistics(ref[0][1].statistics, results[0][1].statistics)


def test_compiled_before_hooks_is_diagnosed_and_logits_module_measures_anyway():
    model, batch = TinyLM(), llama_batch()
    eager, _, _ = run_captured(model, resolve_logits_source(model), batch, lambda: model(batch["input_ids"]))
    model.compile()
    model(batch["input_ids"])  # compiled and run once before headwatch registers its hooks
    try:
        silent, report, _ = run_captured(model, resolve_logits_source(model), batch, lambda: model(batch["input_ids"]))
        assert not silent and report.problem == "compiled"
        assert "torch._dynamo.reset()" in report.message and "logits_module=" in report.message
        source = resolve_logits_source(model, logits_module="")  # the fix the message gives
        results, report, _ = run_captured(model, source, batch, lambda: model(batch["input_ids"]))
    finally:
        torch._dynamo.reset()
    assert report.measured == 1 and report.problem is None
    assert_same_statistics(eager[0][1].statistics, results[0][1].statistics)


def test_owner_hook_still_runs_on_a_model_compiled_before():
    lm, batch = tiny_llama(), llama_batch()
    with torch.no_grad():
        eager, _, _ = run_captured(lm, resolve_logits_source(lm), batch, lambda: lm(**batch))
        lm.compile()
        lm(**batch)
        try:
            results, report, _ = run_captured(lm, resolve_logits_source(lm), batch, lambda: lm(**batch))
        finally:
            torch._dynamo.reset()
    assert report.measured == 1 and report.path == "logits" and report.problem is None
    assert_same_statistics(eager[0][1].statistics, results[0][1].statistics)


def test_unknown_post_head_transform_is_refused_on_the_hidden_path():
    model, batch = tiny_llama(), llama_batch()

    def double(module, args, out):  # a post-head transform no config declares
        out.logits = out.logits * 2.0
        return out

    model.register_forward_hook(double)
    with torch.no_grad():
        results, report, _ = run_captured(
            model, resolve_logits_source(model), batch, lambda: model(input_ids=batch["input_ids"]), path="hidden"
        )
    assert not results and report.problem == "transform_mismatch"


def test_padded_mass_against_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 128, generator=g) * 3
    x[0, 0, 103:] = float("-inf")  # padded logits masked: mass exactly 0
    x[1, 1, 5] = float("nan")
    p = torch.softmax(x.double(), dim=-1)
    mass = padded_mass(x, 103)
    expected = p[..., 103:].sum(-1)
    finite = torch.isfinite(x).any(-1) & ~torch.isnan(x).any(-1)
    assert torch.allclose(mass[finite].double(), expected[finite], atol=1e-6)
    assert mass[0, 0] == 0 and torch.isnan(mass[1, 1])
    assert torch.equal(padded_mass(x[2], 128), torch.zeros(5))
    assert torch.allclose(padded_mass(x.bfloat16(), 103, max_chunk_bytes=1024)[2].double(),
                          torch.softmax(x.bfloat16().double(), -1)[2, :, 103:].sum(-1), atol=1e-6)
    with pytest.raises(HeadwatchError, match=r"`vocab_size` must be an int in \[1, 128\].*got 129"):
        padded_mass(x, 129)
    with pytest.raises(HeadwatchError, match="expected logits of shape"):
        padded_mass(torch.ones(3, dtype=torch.long), 2)


def test_padded_mass_through_either_path():
    model, batch = tiny_llama(), llama_batch()
    source = resolve_logits_source(model)
    with torch.no_grad():
        a, _, out = run_captured(model, source, batch, lambda: model(**batch), vocab_size=50)
        b, _, _ = run_captured(model, source, batch, lambda: model(**batch), path="hidden", vocab_size=50)
    expected = torch.softmax(out.logits.double(), -1)[..., 50:].sum(-1)
    assert torch.allclose(a[0][1].padded_mass.double(), expected, atol=1e-6)
    assert torch.allclose(b[0][1].padded_mass.double(), expected, atol=1e-5)


def test_config_and_storage_disagreeing_storage_wins():
    """What ``attach`` warns once (``resolve_matrices(...).config_message``) and measures (``tie``)."""
    tied = tiny_llama(tie=True)
    head, emb = tied.lm_head.weight, tied.model.embed_tokens.weight
    assert head is emb and resolve_matrices(tied).config_message is None
    tied.lm_head.weight = nn.Parameter(emb.detach().clone())  # storage untied, config still says tied
    found = resolve_matrices(tied)
    msg = found.config_message
    assert not found.tie.tied and msg is not None and "tie_word_embeddings=True" in msg
    assert "two separate Parameters; headwatch measures the storage (tied=False)" in msg
    untied = tiny_llama(tie=False)
    assert resolve_matrices(untied).config_message is None
    untied.lm_head.weight = untied.model.embed_tokens.weight
    found = resolve_matrices(untied)
    msg = found.config_message
    assert found.tie.tied and msg is not None and "tie_word_embeddings=False" in msg
    assert "one shared Parameter; headwatch measures the storage (tied=True)" in msg


def test_resolution_of_named_modules():
    model = TinyLM()
    source = resolve_logits_source(model)
    assert source.kind == "head_output" and source.owner is model.lm_head and source.alignment == "causal"
    assert "output of the head `lm_head`" in source.describe()
    with pytest.raises(HeadwatchError, match="`logits_module='nope'` names no submodule"):
        resolve_logits_source(model, logits_module="nope")
    with pytest.raises(HeadwatchError, match="`hidden_module` is a Linear that is not a submodule"):
        resolve_logits_source(model, hidden_module=nn.Linear(2, 2))
    with pytest.raises(HeadwatchError, match="`path` must be one of"):
        from headwatch.model.capture import LogitsCapture

        LogitsCapture(source, print, path="both")


def test_cut_cross_entropy_torch_fallback_on_cpu():
    cce = pytest.importorskip("cut_cross_entropy", reason="cut-cross-entropy (and triton, which it imports) not installed")
    lm, batch = tiny_llama(), llama_batch()
    fused = FusedLlama(lm)
    fused.loss_fn = cce.LinearCrossEntropy(impl="torch_compile", shift=True)  # its CPU-capable implementation
    try:
        with torch.no_grad():
            unfused, _, out = run_captured(lm, resolve_logits_source(lm), batch, lambda: lm(**batch))
            source = resolve_logits_source(fused, hidden_module="loss_fn")
            results, report, loss = run_captured(fused, source, batch, lambda: fused(**batch))
    finally:
        torch._dynamo.reset()
    assert loss.item() == pytest.approx(out.loss.item(), abs=1e-5)
    assert report.path == "hidden" and report.problem is None
    assert_same_statistics(unfused[0][1].statistics, results[0][1].statistics)


def test_statistics_inside_autocast_stay_float32():
    model, batch = tiny_llama(), llama_batch()
    source = resolve_logits_source(model)
    with torch.no_grad():
        outside, _, _ = run_captured(model, source, batch, lambda: model(**batch), path="hidden")
        captured = outside[0][0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            from headwatch.model.captured import captured_statistics

            mask, targets = positions(batch, "causal")
            inside = captured_statistics(captured, mask, targets, vocab_size=50)
    assert_same_statistics(outside[0][1].statistics, inside.statistics, atol=1e-6)


def test_t5_hidden_path_is_the_head_input():
    from tests.helpers.sources import tiny_t5

    model = tiny_t5()
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(1, 64, (2, 8), generator=g)
    labels[0, 0] = -100
    batch = {"input_ids": torch.randint(1, 64, (2, 12), generator=g), "labels": labels}
    source = resolve_logits_source(model)
    assert source.base is None  # T5's base_model is itself: the head's input is the hidden state used
    with torch.no_grad():
        a, _, _ = run_captured(model, source, batch, lambda: model(**batch))
        b, report, _ = run_captured(model, source, batch, lambda: model(**batch), path="hidden")
    assert "the input of `lm_head`" in report.note
    assert_same_statistics(a[0][1].statistics, b[0][1].statistics)


def test_a_failure_while_measuring_never_stops_the_forward():
    from headwatch.model.capture import LogitsCapture

    model, batch = tiny_llama(), llama_batch()
    source = resolve_logits_source(model)

    def broken(captured):
        raise RuntimeError("boom")

    capture = LogitsCapture(source, broken, model=model)
    capture.attach()
    capture.begin((2, 8))
    out = model(**batch)  # the forward completes
    report = capture.end()
    assert out.logits.shape == (2, 8, 64)
    assert report.problem == "failed" and "RuntimeError: boom" in report.message
    strict = LogitsCapture(source, broken, model=model, strict=True)
    capture.detach()
    strict.attach()
    strict.begin((2, 8))
    with pytest.raises(HeadwatchError, match="measuring the logits failed: RuntimeError: boom"):
        model(**batch)
    strict.detach()


def test_pre_head_transform_is_refused_on_the_hidden_path():
    model, batch = tiny_llama(), llama_batch()
    model.lm_head.register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))  # scales the head's input
    with torch.no_grad():
        results, report, _ = run_captured(
            model, resolve_logits_source(model), batch, lambda: model(input_ids=batch["input_ids"], logits_to_keep=2)
        )
    assert not results and report.problem == "hidden_mismatch" and "hidden_module=" in report.message


def test_hooks_attached_before_compile_fullgraph_measure_exactly():
    from headwatch.model.capture import LogitsCapture
    from headwatch.model.captured import captured_statistics

    lm, batch = tiny_llama(), llama_batch()
    source = resolve_logits_source(lm)
    mask, targets = positions(batch, source.alignment)
    with torch.no_grad():
        eager, _, _ = run_captured(lm, source, batch, lambda: lm(**batch))
        results = []

        def consume(c):  # logits_to_keep: the kept positions only
            k = c.kept
            results.append((k, captured_statistics(c, mask[:, -k:] if k else mask, targets[:, -k:] if k else targets)))

        captures = {path: LogitsCapture(source, consume, path=path, model=lm) for path in ("auto", "hidden")}
        for capture in captures.values():
            capture.attach()  # before compiling: the hooks are traced into the graph
        compiled = torch.compile(lm, fullgraph=True)
        try:
            compiled(**batch)  # not armed
            assert captures["auto"].end().measured == 0 and not results
            reports = []
            # the logits path, logits_to_keep (the kept positions, logits path), the forced hidden path: under fullgraph
            for path, kept in (("auto", 0), ("auto", 3), ("hidden", 0)):
                captures[path].begin(targets.shape)
                compiled(input_ids=batch["input_ids"], logits_to_keep=kept)
                reports.append(captures[path].end())
        finally:
            for capture in captures.values():
                capture.detach()
            torch._dynamo.reset()
    assert [(r.measured, r.path, r.problem) for r in reports] == [(1, "logits", None), (1, "logits", None), (1, "hidden", None)]
    assert [k for k, _ in results] == [None, 3, None]
    want = eager[0][1].statistics
    for k, got in results:
        if k is None:
            assert_same_statistics(want, got.statistics)
        else:
            valid = want.valid[:, -k:]
            assert torch.equal(got.statistics.valid, valid) and int(valid.sum()) == 4
            assert torch.allclose(got.statistics.entropy[valid], want.entropy[:, -k:][valid], atol=1e-5)
