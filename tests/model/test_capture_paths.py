"""Capturing what to measure (headwatch.model.capture, .captured, .flows) on the paths the model-level tests
leave out: the chunked hidden-state statistics with padded columns against a float64 recomputation, a base
model returning a tuple, a forced hidden path, problems named by key (no logits, few positions, a head
without a matrix, nothing fired, hooks detached), and gradient captures that never raise into the backward
(checked against autograd)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from headwatch import HeadwatchError
from headwatch.distributed.reduce import NoReducer
from headwatch.distributed.sharded import Rows, ShardedLookup
from headwatch.model.capture import Captured, LogitsCapture
from headwatch.model.captured import captured_statistics
from headwatch.model.flows import HeadFlowCapture, LookupFlowCapture
from headwatch.model.sources import FinalTransform, resolve_logits_source
from headwatch.model.weights import find_embedding_group

V, D = 40, 8


def ref64(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """float64 statistics with plain torch ops; ``targets`` in ``[0, V)``."""
    logp = torch.log_softmax(logits.double(), -1)
    p = logp.exp()
    return {
        "entropy": -(p * logp).sum(-1),
        "max_prob": p.amax(-1),
        "nll": -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1),
        "kl_from_uniform": -math.log(logits.shape[-1]) - logp.mean(-1),
    }


def assert_matches(stats, want: dict[str, torch.Tensor], select: torch.Tensor, atol: float = 3e-5) -> None:
    assert torch.equal(stats.valid, select)
    for name, value in want.items():
        torch.testing.assert_close(getattr(stats, name)[select].double(), value[select], atol=atol, rtol=3e-5, msg=name)


# ---------------------------------------------------------------- statistics of a capture
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_hidden_capture_with_padded_columns_equals_float64_logits(weight_dtype):
    """With ``vocab_size`` the hidden path is projected a chunk of rows at a time (a bf16 head a slice of rows at
    a time), transformed, measured and its padded mass taken: the same numbers as float64 logits."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, D, generator=g)
    weight = (torch.randn(V, D, generator=g) * 0.7).to(weight_dtype)
    bias = torch.randn(V, generator=g)
    cap = FinalTransform("3.0 * tanh(x / 3.0)", lambda x: 3.0 * torch.tanh(x / 3.0))
    mask = torch.rand(3, 5, generator=g) > 0.2
    targets = torch.randint(0, 36, (3, 5), generator=g)
    captured = Captured("hidden", hidden=hidden, weight=weight, bias=bias, transform=cap)
    got = captured_statistics(captured, mask, targets, vocab_size=36, max_chunk_bytes=2000)
    logits = 3.0 * torch.tanh((hidden.double() @ weight.double().T + bias.double()) / 3.0)  # (3, 5, V)
    assert_matches(got.statistics, ref64(logits, targets), mask)
    torch.testing.assert_close(got.padded_mass.double(), torch.softmax(logits, -1)[..., 36:].sum(-1), atol=1e-6, rtol=1e-5)
    # without vocab_size the one-pass functional path gives the same statistics and no padded mass
    plain = captured_statistics(captured, mask, targets)
    assert plain.padded_mass is None
    assert_matches(plain.statistics, ref64(logits, targets), mask)


def test_values_a_loss_gave_leave_out_the_rows_the_door_marked():
    """The loss's own per-position values (TRL's fused head) keep positions in rows the door marked as no prediction
    (the repeats of a distributed evaluation: targets ``-100`` there): those rows are left out, and the figures
    reproduced from the hidden states stay published (a float64 recomputation of the real rows)."""
    from headwatch.model.at_loss import LossValues

    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(3, 5, D, generator=g), torch.randn(V, D, generator=g)
    targets = torch.randint(0, V, (3, 5), generator=g)
    logits = hidden.double() @ weight.double().T  # (3, 5, V)
    want = ref64(logits, targets)
    given = LossValues(nll=want["nll"].float(), valid=torch.ones(3, 5, dtype=torch.bool), entropy=want["entropy"].float())
    marked = targets.clone()
    marked[2] = -100  # the row a distributed sampler repeated
    captured = Captured("hidden", hidden=hidden, weight=weight, source="trl_fused_head", targets=marked, given=given)
    got = captured_statistics(captured, None, marked)
    real = torch.ones(3, 5, dtype=torch.bool)
    real[2] = False
    assert_matches(got.statistics, want, real)


def test_logits_capture_statistics_and_padded_mass():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, V, generator=g) * 2
    targets = torch.randint(0, V, (2, 6), generator=g)
    got = captured_statistics(Captured("logits", logits=logits), None, targets, vocab_size=30)
    assert_matches(got.statistics, ref64(logits, targets), torch.ones(2, 6, dtype=torch.bool))
    torch.testing.assert_close(got.padded_mass.double(), torch.softmax(logits.double(), -1)[..., 30:].sum(-1), atol=1e-6, rtol=1e-5)


def test_a_hidden_capture_of_no_position_gives_empty_statistics():
    captured = Captured("hidden", hidden=torch.zeros(0, 4, D), weight=torch.randn(V, D))
    got = captured_statistics(captured, None, torch.zeros(0, 4, dtype=torch.long), vocab_size=30)
    assert got.statistics.entropy.shape == (0, 4) and got.padded_mass.shape == (0, 4)
    assert not got.statistics.valid.any()


@pytest.mark.parametrize(
    "captured, kwargs, match",
    [
        (Captured("logits"), {}, "a logits-path capture holds no logits"),
        (Captured("hidden", hidden=torch.zeros(2, D)), {}, "needs both `hidden` and `weight`"),
        (Captured("hidden", weight=torch.zeros(V, D)), {}, "needs both `hidden` and `weight`"),
        (Captured("hidden", hidden=torch.zeros(2, D), weight=torch.zeros(V, D + 1)), dict(vocab_size=30),
         r"hidden \(2, 8\) and weight \(40, 9\)"),
        (Captured("hidden", hidden=torch.zeros(2, 3, D), weight=torch.zeros(V, D)),
         dict(vocab_size=30, mask=torch.ones(3, 2, dtype=torch.bool)), r"mask of shape \(2, 3\) \(the hidden states' leading shape\)"),
        (Captured("hidden", hidden=torch.zeros(2, 3, D), weight=torch.zeros(V, D)),
         dict(vocab_size=30, targets=torch.zeros(6, dtype=torch.long)), r"targets of shape \(2, 3\)"),
    ],
)
def test_malformed_captures_are_refused(captured, kwargs, match):
    with pytest.raises(HeadwatchError, match=match):
        captured_statistics(captured, **kwargs)


# ---------------------------------------------------------------- LogitsCapture on hand-built models
class Body(nn.Module):
    """A base model returning a tuple ``(last_hidden_state, extra)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        h = self.embed_tokens(ids)
        return h + torch.tanh(self.mix(h.cumsum(1))), None


class Owner(nn.Module):
    """Hugging Face's shape: ``base_model`` and ``get_output_embeddings()``; ``keep`` keeps the last positions only."""

    base_model_prefix = "body"

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = Body()
        self.lm_head = nn.Linear(D, V)

    @property
    def base_model(self) -> nn.Module:
        return self.body

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        h = self.body(ids)[0]
        return self.lm_head(h[:, -keep:] if keep else h)


def run(capture: LogitsCapture, shape, forward):
    capture.attach()
    capture.begin(shape)
    try:
        with torch.no_grad():
            out = forward()
        return capture.end(), out
    finally:
        capture.detach()


IDS = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(2))
TARGETS = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(3))


def test_kept_positions_are_measured_alone_with_a_tuple_returning_base_model():
    """Logits of the last k positions (logits_to_keep), checked against the base's hidden states: those k only."""
    model = Owner()
    source = resolve_logits_source(model)
    assert (source.kind, source.base) == ("model_logits", model.body)
    got = []
    report, out = run(LogitsCapture(source, got.append), (2, 7), lambda: model(IDS, keep=2))
    assert out.shape == (2, 2, V)
    assert (report.measured, report.path, report.reason, report.problem) == (1, "logits", "kept_positions", None)
    assert got[0].kept == 2 and "last 2 positions" in report.note
    with torch.no_grad():
        full = model(IDS)  # the model's own logits of every position: the reference
    stats = captured_statistics(got[0], None, TARGETS[:, -2:]).statistics
    assert_matches(stats, ref64(full[:, -2:], TARGETS[:, -2:]), torch.ones(2, 2, dtype=torch.bool))


def test_forced_hidden_path_measures_what_the_logits_path_measures():
    model = Owner()
    source = resolve_logits_source(model)
    by_logits, by_hidden = [], []
    report, out = run(LogitsCapture(source, by_logits.append), (2, 7), lambda: model(IDS))
    assert (report.path, report.note) == ("logits", None) and torch.equal(by_logits[0].logits, out)
    report, _ = run(LogitsCapture(source, by_hidden.append, path="hidden"), (2, 7), lambda: model(IDS))
    assert (report.path, report.reason) == ("hidden", "forced") and "forced by path='hidden'" in report.note
    a = captured_statistics(by_logits[0], None, TARGETS).statistics
    b = captured_statistics(by_hidden[0], None, TARGETS).statistics
    assert_matches(b, ref64(out, TARGETS), torch.ones(2, 7, dtype=torch.bool))
    assert_matches(a, ref64(out, TARGETS), torch.ones(2, 7, dtype=torch.bool))


def test_every_forward_of_an_armed_step_is_measured_once():
    model = Owner()
    got = []
    report, _ = run(LogitsCapture(resolve_logits_source(model), got.append), None, lambda: (model(IDS), model(IDS[:1])))
    assert report.measured == 2 and [c.logits.shape[0] for c in got] == [2, 1]


def test_forced_logits_path_without_logits_is_no_logits():
    class DictOwner(Owner):
        def forward(self, ids: torch.Tensor, keep: int = 0) -> dict:
            return {"scores": super().forward(ids, keep)}  # neither a tensor, .logits nor [0]

    model = DictOwner()
    report, _ = run(LogitsCapture(resolve_logits_source(model), print, path="logits"), (2, 7), lambda: model(IDS))
    assert (report.measured, report.problem) == (0, "no_logits")
    assert "the head `lm_head` ran 1 time(s)" in report.message and "returned no logits" in report.message


def test_few_positions_without_full_hidden_states_is_named():
    """A plain model keeping the last positions: the head's input has as few positions as its output."""

    class Keeper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(V, D)
            self.lm_head = nn.Linear(D, V)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.tok(ids)[:, -1:])

    model = Keeper()
    report, _ = run(LogitsCapture(resolve_logits_source(model), print), (2, 7), lambda: model(IDS))
    assert (report.measured, report.problem) == (0, "few_positions")
    assert "logits of shape (2, 1, 40) where the batch has positions (2, 7)" in report.message
    assert "hidden_module=" in report.message


def test_a_hidden_module_of_another_width_is_skipped_for_one_that_fits():
    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(4)
            self.tok = nn.Embedding(V, D)
            self.up = nn.Linear(D, 2 * D)  # its input is (B, T, D) but the named module below sees 2 D
            self.probe = nn.Identity()
            self.lm_head = nn.Linear(D, V)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.tok(ids)
            self.probe(self.up(h))  # (B, T, 2 D): not the head's input width
            return self.lm_head(h[:, -1:])

    model = Wide()
    source = resolve_logits_source(model, hidden_module="probe")
    got = []
    report, _ = run(LogitsCapture(source, got.append), (2, 7), lambda: model(IDS))
    assert (report.measured, report.problem) == (0, "few_positions")  # the only full-length hidden is 2 D wide
    source = resolve_logits_source(model, hidden_module="up")
    report, _ = run(LogitsCapture(source, got.append), (2, 7), lambda: model(IDS))
    assert (report.measured, report.path, report.problem) == (1, "hidden", None)
    with torch.no_grad():
        full = model.lm_head(model.tok(IDS))
    assert_matches(captured_statistics(got[0], None, TARGETS).statistics, ref64(full, TARGETS), torch.ones(2, 7, dtype=torch.bool))


def test_a_head_without_a_matrix_cannot_take_the_hidden_path():
    class Bilinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scores = nn.Parameter(torch.randn(V, D))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h @ self.scores.T

    model = nn.Module()
    model.tok, model.out = nn.Embedding(V, D), Bilinear()
    source = resolve_logits_source(model, head="out", logits_module="out")
    report, _ = run(LogitsCapture(source, print, path="hidden"), (2, 7), lambda: model.out(model.tok(IDS)))
    assert (report.measured, report.problem) == (0, "no_logits")
    assert "the head `out` has no 2-D weight to project the hidden states" in report.message


def test_nothing_fired_detached_hooks_and_bad_arguments():
    model = Owner()
    source = resolve_logits_source(model)
    capture = LogitsCapture(source, print)
    capture.attach()
    capture.begin((2, 7))
    report = capture.end()
    assert (report.measured, report.problem) == (0, "not_fired") and "logits_module=" in report.message
    capture.detach()
    seen = []
    capture = LogitsCapture(source, seen.append)
    capture.attach()
    capture.detach()
    capture.begin((2, 7))
    with torch.no_grad():
        model(IDS)
    assert capture.end().problem == "not_fired" and not seen
    assert capture.end().problem is None  # not armed: nothing to report
    with pytest.raises(HeadwatchError, match="`consume` must be a callable taking a Captured, got 3"):
        LogitsCapture(source, 3)


# ---------------------------------------------------------------- gradient flows
class Scaled(nn.Embedding):
    """An embedding whose output is not a fixed multiple of its rows (a position term is added)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) + torch.linspace(0, 1, ids.shape[-1]).unsqueeze(-1)


def test_lookup_flow_of_an_output_that_is_not_a_multiple_of_the_rows_is_refused_with_the_cause():
    # was a warning that the measurement was skipped next to a published flow; from the output
    # alone headwatch cannot tell an offset (flow = plain lookup) from any other transform (flow wrong): refused
    torch.manual_seed(5)
    emb = Scaled(V, D)
    model = nn.Module()
    model.embed_tokens = emb
    capture = LookupFlowCapture(find_embedding_group(model)).attach()
    capture.active = True
    (emb(IDS).sin().sum()).backward()
    assert capture.error is None and "not a fixed multiple of the looked-up rows" in capture.refused
    assert capture.gradient is None and emb.weight.grad is not None  # nothing captured, training unaffected
    assert capture.looked_up.nonzero().flatten().tolist() == IDS.unique().tolist()
    capture.reset()
    assert capture.gradient is None and capture.looked_up is None and capture.sharded is None
    capture.detach()


def test_lookup_flow_into_a_sharded_accumulator_equals_autograd_and_failures_stay_in_the_hook():
    torch.manual_seed(6)
    model = nn.Module()
    model.embed_tokens = nn.Embedding(V, D, padding_idx=0)
    capture = LookupFlowCapture(find_embedding_group(model)).attach()
    capture.active = True
    capture.sharded = ShardedLookup()
    ids = IDS.clone()
    ids[0, :2] = 0
    (model.embed_tokens(ids) ** 2).sum().backward()
    assert capture.gradient is None and capture.error is None  # kept compact in the sharded accumulator
    rows = capture.sharded.rows(Rows(torch.zeros(V, D), 0, V, False), NoReducer())
    torch.testing.assert_close(rows.local, model.embed_tokens.weight.grad)

    class Broken:
        def add(self, *args):
            raise RuntimeError("accumulator failed")

    capture.reset()
    capture.sharded = Broken()
    model.embed_tokens.weight.grad = None
    (model.embed_tokens(ids) ** 2).sum().backward()  # the backward completes
    assert model.embed_tokens.weight.grad is not None
    assert isinstance(capture.error, RuntimeError) and "accumulator failed" in str(capture.error)
    capture.detach()


def test_head_flow_failure_is_recorded_not_raised_and_type_errors():
    torch.manual_seed(7)
    head = nn.Linear(D, V, bias=False)
    capture = HeadFlowCapture(head).attach()
    capture.active = True
    h = torch.randn(2, 3, D)
    head(h).sum().backward()
    torch.testing.assert_close(capture.gradient, head.weight.grad)
    capture.gradient = torch.zeros(V, D + 1)  # a wrong accumulator: the hook fails, the backward does not
    head(h).sum().backward()
    assert isinstance(capture.error, HeadwatchError) and "expected out of shape (40, 8)" in str(capture.error)
    capture.detach()
    with pytest.raises(HeadwatchError, match="`head` must be an nn.Module, got str"):
        HeadFlowCapture("lm_head")
    with pytest.raises(HeadwatchError, match="`group` must be an EmbeddingGroup"):
        LookupFlowCapture(nn.Embedding(V, D))
