"""Which matrix, whatever wraps it (docs/matrices.md): the gradient statistics and the tied split are exact,
or refused with the real cause, under torch.compile, under forward hooks that change the embedding's output
(NEFTune, on a plain and on a scaled-embedding family), under every PEFT adapter on the embedding or the head,
and for the hidden-state (fused loss) path under every FSDP2 resharding setting.

References: autograd on an untied twin (the tied matrix's two flows are the twin's two ``.grad``), float64
row norms of the real Parameter's ``.grad``, the adapted module's own forward, and a float64 recomputation of
the fused loss's logits at forward time. docs/matrices.md holds the table these tests back.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from typing import ClassVar

import pytest
import torch
from torch import nn

from headwatch.core.gradients import GradientDensity
from headwatch.integrations.loop import Headwatch
from tests.helpers.distributed import read_measured
from tests.helpers.matrices import D, V, tiny, twin_grads, untied_twin
from tests.helpers.paths import WORKERS

transformers = pytest.importorskip("transformers")

FSDP_WORKER = WORKERS / "fsdp_fused.py"


class Recording(GradientDensity):
    """Keeps the ``(V, d)`` flows the monitor measured on each logging step, to compare with the twin's ``.grad``."""

    def _flows(self, loss_scale):
        flows = super()._flows(loss_scale)
        self.recorded = getattr(self, "recorded", [])
        self.recorded.append({k: v.detach().clone().float() for k, v in flows.items() if isinstance(v, torch.Tensor)})
        return flows


def batches(n: int = 3) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (2, 10), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def train(model: nn.Module, data, forward=None, seed_each_forward: bool = False, lr: float = 0.0, monitors=None):
    """The plain-loop door, every step a logging step; returns (recording monitor, values, .grad of the shared weight, warnings)."""
    rec = Recording(frequency=None)
    forward = model if forward is None else forward
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hw = Headwatch(model, monitors=[rec, *(monitors or [])], log_every_n_steps=1, figure_every_n_steps=0)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
        values, grads = [], []
        for step, batch in enumerate(data):
            if seed_each_forward:
                torch.manual_seed(100 + step)
            hw.step_start(batch, step)
            forward(**batch).loss.backward()
            hw.before_optimizer_step()
            weight = model.get_input_embeddings().weight
            grads.append(weight.grad.clone() if isinstance(weight, torch.Tensor) and weight.grad is not None else None)
            opt.step()
            hw.after_optimizer_step()
            opt.zero_grad()
            values.append(hw.step_end())
        hw.close()
    said = [str(w.message) for w in caught if "headwatch" in str(w.message) or "Monitor" in str(w.message)]
    return rec, values, grads, said


def assert_flows_equal_twin(recorded, expected, atol: float = 1e-6) -> None:
    assert len(recorded) == len(expected)
    for got, want in zip(recorded, expected):
        assert set(got) == {"embedding", "head", "shared"}
        torch.testing.assert_close(got["embedding"], want["embedding"], rtol=1e-5, atol=atol)
        torch.testing.assert_close(got["head"], want["head"], rtol=1e-5, atol=atol)


def max_row_norm(grad: torch.Tensor) -> float:
    return float(grad.double().norm(dim=1).max())


# ---------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_compiled_before_attach_every_step_matches_the_untied_twin(family):
    """``model.compile(fullgraph=True)`` before headwatch: the lookup flow comes from a zero probe added inside the
    graph (aot_eager: AOTAutograd differentiates it like inductor does, without the C++ build)."""
    model, data = tiny(family), batches(2)
    expected = twin_grads(untied_twin(model), data)
    model.compile(backend="aot_eager", fullgraph=True)
    rec, values, grads, said = train(model, data)
    assert said == [], said  # measured, so nothing to say
    assert_flows_equal_twin(rec.recorded, expected)
    for step, want in enumerate(expected):
        assert values[step]["headwatch/grad/embedding_row_norm_max"] == pytest.approx(max_row_norm(want["embedding"]), rel=1e-5)
        assert values[step]["headwatch/grad/shared_row_norm_max"] == pytest.approx(max_row_norm(grads[step]), rel=1e-5)


def test_compile_learned_during_the_first_step_refuses_that_step_with_the_cause_then_measures():
    """``torch.compile(model)`` wraps the model from outside: headwatch sees it only inside the first compiled forward."""
    model, data = tiny("llama"), batches(3)
    expected = twin_grads(untied_twin(model), data)
    rec, values, grads, said = train(model, data, forward=torch.compile(model, backend="aot_eager"))
    assert len(said) == 1 and "torch.compile" in said[0] and "from the next logging step on" in said[0], said
    assert "token ids" not in said[0] and "skipped" not in said[0]  # the old, wrong causes
    assert set(rec.recorded[0]) == {"shared"}
    assert "headwatch/grad/embedding_row_density" not in values[0]  # refused: nothing published for the flows
    assert values[0]["headwatch/grad/shared_row_norm_max"] == pytest.approx(max_row_norm(grads[0]), rel=1e-5)
    assert_flows_equal_twin(rec.recorded[1:], expected[1:])


@pytest.mark.skipif(
    os.environ.get("HEADWATCH_SLOW_TESTS") != "1",
    reason="inductor's C++ build takes about 60 s on 2 shared CPU cores; set HEADWATCH_SLOW_TESTS=1 to run it",
)
def test_compiled_with_inductor_fullgraph_matches_the_untied_twin():
    model, data = tiny("llama"), batches(2)
    expected = twin_grads(untied_twin(model), data)
    model.compile(fullgraph=True)  # inductor, the default backend
    rec, _, _, said = train(model, data)
    assert said == [], said
    assert_flows_equal_twin(rec.recorded, expected, atol=1e-6)


# ---------------------------------------------------------------- hooks that change the embedding's output
@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("neftune_first", [False, True], ids=["neftune_after_attach", "neftune_before_attach"])
def test_neftune_noise_keeps_the_tied_split_exact(family, neftune_first):
    """HF's NEFTune hook adds uniform noise to the embedding's output (Trainer ``neftune_noise_alpha``); the
    lookup flow is still ``c * sum g`` with Gemma's ``c = sqrt(d_model)``: the twin, with the same noise, agrees."""
    from transformers.integrations.neftune import activate_neftune

    model, data = tiny(family), batches(2)
    twin = untied_twin(model)
    activate_neftune(twin, 5.0)
    expected = twin_grads(twin, data, seed_each_forward=True)
    if neftune_first:
        activate_neftune(model, 5.0)
        rec, values, _, said = train(model, data, seed_each_forward=True)
    else:
        original = Headwatch.__init__

        def attach_then_neftune(self, m, *args, **kwargs):  # as the Trainer: NEFTune's hook after headwatch's
            original(self, m, *args, **kwargs)
            activate_neftune(m, 5.0)

        Headwatch.__init__ = attach_then_neftune
        try:
            rec, values, _, said = train(model, data, seed_each_forward=True)
        finally:
            Headwatch.__init__ = original
    assert said == [], said
    assert_flows_equal_twin(rec.recorded, expected)
    assert values[0]["headwatch/grad/embedding_row_norm_max"] == pytest.approx(max_row_norm(expected[0]["embedding"]), rel=1e-5)


def test_a_hook_that_runs_before_headwatch_and_changes_the_output_is_refused_with_the_cause():
    """A hook prepended after headwatch's runs first: the output headwatch sees is no longer ``c * W[ids]``."""
    model, data = tiny("llama"), batches(2)
    original = Headwatch.__init__

    def attach_then_prepend(self, m, *args, **kwargs):
        original(self, m, *args, **kwargs)
        m.get_input_embeddings().register_forward_hook(lambda mod, args, out: out + 0.1, prepend=True)

    Headwatch.__init__ = attach_then_prepend
    try:
        rec, values, grads, said = train(model, data)
    finally:
        Headwatch.__init__ = original
    assert len(said) == 1 and "not a fixed multiple of the looked-up rows" in said[0], said
    assert "only the shared gradient" in said[0]
    assert all(set(r) == {"shared"} for r in rec.recorded)
    assert "headwatch/grad/embedding_row_density" not in values[0] and "headwatch/grad/head_row_density" not in values[0]
    assert values[1]["headwatch/grad/shared_row_norm_max"] == pytest.approx(max_row_norm(grads[1]), rel=1e-5)


# ---------------------------------------------------------------- PEFT adapters
peft_cases = {
    "lora_trainable_token_indices": lambda peft: peft.LoraConfig(target_modules=["q_proj"], trainable_token_indices=[1, 2, 3]),
    "trainable_tokens_config": lambda peft: peft.TrainableTokensConfig(target_modules=["embed_tokens"], token_indices=[1, 2, 3]),
}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("case", sorted(peft_cases))
def test_trainable_tokens_are_refused_once_and_training_goes_on(case, tied):
    """Only 3 rows train, as a separate (3, d) delta: no row statistic over V describes that. One message says so;
    no 'has no gradient', no config/storage contradiction, no error out of attach; the update of the effective
    matrix is measured: the rows that moved, by the adapted module's own forward, and only rows 1-3 can."""
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's own warnings about tied layers
        model = peft.get_peft_model(tiny("llama", tied), peft_cases[case](peft))
    emb = model.get_input_embeddings()
    before = emb(torch.arange(V)).detach().double()
    _, values, _, said = train(model, batches(1), lr=0.5, monitors=["logits", "collision"])
    after = emb(torch.arange(V)).detach().double()
    grad_said = [s for s in said if "GradientDensityMonitor" in s]
    assert len(grad_said) == 1 and "trainable tokens" in grad_said[0], said
    assert not any("has no gradient on this step" in s or "config says" in s for s in said), said
    moved = int(((after - before).abs().amax(dim=1) > 0).sum())
    assert moved == 3 if tied else moved <= 3  # tied: the scoring flow reaches rows 1-3; untied: those looked up
    name = "shared" if tied else "embedding"
    assert values[-1][f"headwatch/update/{name}_row_density"] == pytest.approx(moved / V)
    assert not any(k.startswith(("headwatch/grad/embedding_row", "headwatch/grad/shared_row")) for k in values[-1])
    assert math.isfinite(values[-1]["headwatch/logits/entropy"])


lora_cases = {
    "lora_embed_tokens": dict(target_modules=["embed_tokens"]),
    "lora_lm_head": dict(target_modules=["lm_head"]),
    "lora_both": dict(target_modules=["embed_tokens", "lm_head"]),
    "lora_both_ensure_weight_tying": dict(target_modules=["embed_tokens", "lm_head"], ensure_weight_tying=True),
}


@pytest.mark.parametrize("case", sorted(lora_cases))
def test_lora_on_a_tied_model_measures_the_effective_matrices_that_train(case):
    """Reference: an untied plain twin whose two matrices are the adapted modules' rows as their own forwards
    compute them (``emb(arange(V))``, ``head(I).T``), by autograd: its ``.grad`` are the effective matrices' gradients.
    (PEFT's merge_and_unload is no reference here: on a shared base it adds both deltas to the one Parameter.)"""
    peft = pytest.importorskip("peft")
    base = tiny("llama")
    twin = untied_twin(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **lora_cases[case]))
    with torch.no_grad():
        twin.get_input_embeddings().weight.copy_(model.get_input_embeddings()(torch.arange(V)))
        twin.lm_head.weight.copy_(model.get_output_embeddings()(torch.eye(D)).T)
    data = batches(1)
    expected = twin_grads(twin, data)[0]
    rec, values, _, said = train(model, data)
    grad_said = [s for s in said if "GradientDensityMonitor" in s]
    assert len(grad_said) <= 1 and not any("has no gradient on this step" in s or "token ids" in s for s in said), said
    got = rec.recorded[0]
    trains = rec.matrices.trains
    for role in ("embedding", "head"):
        if trains[role].trains:  # measured on the effective matrix: W + s B A, as autograd on the merged twin
            torch.testing.assert_close(got[role], expected[role], rtol=1e-4, atol=1e-6)
            assert values[0][f"headwatch/grad/{role}_row_norm_max"] == pytest.approx(max_row_norm(expected[role]), rel=1e-4)
        else:  # frozen: said once in the one message, nothing published
            assert role not in got and f"headwatch/grad/{role}_row_density" not in values[0]
            assert "FROZEN" in grad_said[0]


# ---------------------------------------------------------------- FSDP2, hidden-state path
def _free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def test_fused_loss_hidden_path_under_every_fsdp2_resharding_setting(tmp_path):
    """2 CPU processes (gloo): every value equals one process's on the same global batches, and the logits
    statistics equal float64 ones recomputed from the fused loss's own hidden states and weight at forward time,
    with the fused loss named by ``hidden_module=`` and without it (a Hugging Face-shaped model: its base model's
    ``last_hidden_state``, measured before the root's resharding frees the whole head weight)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(FSDP_WORKER), str(tmp_path), _free_port()], env=env, capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rank0 = read_measured(tmp_path / "fused_rank0.json")
    rank1 = read_measured(tmp_path / "fused_rank1.json")
    assert len(rank0) == 20
    for run, other in zip(rank0, rank1):
        setting = {k: run[k] for k in ("named", "tied", "root", "layer", "before")}
        for s in range(len(run["single"])):
            single, got0, got1 = run["single"][s], run["sharded"][s], other["sharded"][s]
            assert set(single) == set(got0) == set(got1), (setting, set(single) ^ set(got0))
            wrong = {k: (single[k], got0[k], got1[k]) for k in single if not (_close(single[k], got0[k]) and _close(single[k], got1[k]))}
            assert not wrong, (setting, s, wrong)
            reference = run["reference"][s]
            assert got0["headwatch/logits/entropy"] == pytest.approx(reference["entropy"], rel=1e-5), setting
            assert got0["headwatch/logits/target_nll"] == pytest.approx(reference["target_nll"], rel=1e-5), setting
            assert ("headwatch/grad/embedding_row_density" in got0) == run["tied"] or not run["tied"]
        assert not any("failed" in w or "sharded" in w for w in run["warnings"]), (setting, run["warnings"])


def _close(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)


# ---------------------------------------------------------------- the HF Trainer flag itself
class Rows(torch.utils.data.Dataset):
    """The two rows of ``batches(1)[0]``, for a Trainer."""

    def __init__(self):
        self.batch = batches(1)[0]

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.batch.items()}


def trainer_args(out, **kw):
    from transformers import TrainingArguments

    opts = {
        "output_dir": str(out), "max_steps": 1, "logging_steps": 1, "per_device_train_batch_size": 2, "learning_rate": 0.0,
        "max_grad_norm": 0.0, "report_to": "none", "use_cpu": True, "save_strategy": "no", "disable_tqdm": True,
    }  # fmt: skip
    return TrainingArguments(**{**opts, **kw})


def test_trainer_with_trainable_tokens_trains_and_says_it_once(tmp_path):
    """Was: a HeadwatchError out of on_train_begin ("an adapter layer headwatch does not know") stopped train()."""
    peft = pytest.importorskip("peft")
    from transformers import Trainer

    from headwatch.integrations.transformers import HeadwatchCallback

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(tiny("llama"), peft.TrainableTokensConfig(target_modules=["embed_tokens"], token_indices=[1, 2, 3]))
    cb = HeadwatchCallback(figure_every_n_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(model=model, args=trainer_args(tmp_path, learning_rate=0.1), train_dataset=Rows(), callbacks=[cb]).train()
    said = [str(w.message) for w in caught if "GradientDensityMonitor" in str(w.message)]
    assert len(said) == 1 and "trainable tokens" in said[0], said
    values = dict(cb.latest)
    assert math.isfinite(values["headwatch/logits/entropy"]) and "headwatch/update/shared_row_density" in values
    assert not any(k.startswith("headwatch/grad/shared_row") for k in values)


def test_trainer_neftune_noise_alpha_on_a_scaled_embedding_family(tmp_path):
    """``TrainingArguments(neftune_noise_alpha=5)`` on tied Gemma 2: the Trainer registers NEFTune's hook in
    ``train()``; headwatch's tied split equals the ``.grad`` of an untied twin trained by the same Trainer set-up
    (same seed, so the same noise), to float64 row norms."""
    from transformers import Trainer, TrainerCallback

    from headwatch.integrations.transformers import HeadwatchCallback

    class GradRecorder(TrainerCallback):
        grads: ClassVar[dict[str, torch.Tensor]] = {}
        neftune: ClassVar[bool] = False

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            emb = model.get_input_embeddings()
            GradRecorder.grads = {"embedding": emb.weight.grad.clone(), "head": model.lm_head.weight.grad.clone()}
            GradRecorder.neftune = getattr(emb, "neftune_noise_alpha", None) == 5.0 and len(emb._forward_hooks) >= 2

    def run(model, out):
        args = trainer_args(out, neftune_noise_alpha=5.0, seed=7)
        rec = Recording(frequency=None)
        cb = HeadwatchCallback(monitors=[rec], figure_every_n_steps=0)  # the Trainer's logging_steps=1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[cb, GradRecorder()]).train()
        said = [str(w.message) for w in caught if "headwatch" in str(w.message) or "Monitor" in str(w.message)]
        return rec, dict(cb.latest), dict(GradRecorder.grads), said

    model = tiny("gemma2")
    twin = untied_twin(model)
    rec, values, grads, said = run(model, tmp_path / "tied")
    assert GradRecorder.neftune  # the Trainer's NEFTune hook was on the embedding during the step
    _, _, want, _ = run(twin, tmp_path / "twin")
    assert not [s for s in said if "GradientDensityMonitor" in s], said
    got = rec.recorded[0]
    torch.testing.assert_close(got["embedding"], want["embedding"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["head"], want["head"], rtol=1e-5, atol=1e-6)
    assert values["headwatch/grad/embedding_row_norm_max"] == pytest.approx(max_row_norm(want["embedding"]), rel=1e-5)
    assert values["headwatch/grad/shared_row_norm_max"] == pytest.approx(max_row_norm(grads["embedding"]), rel=1e-5)
    scale = model.config.hidden_size**0.5  # the old failure: the lookup flow 1/sqrt(d_model) of the truth
    assert not torch.allclose(got["embedding"] * scale, want["embedding"])


def test_lora_under_compile_embedding_measured_head_refused_with_the_cause():
    """LoRA on both sides of a tied Llama (effectively untied), compiled: the embedding's effective gradient comes
    from the probe (exact); the LoRA head's needs its output gradient, which compiled code does not give: refused."""
    peft = pytest.importorskip("peft")
    base = tiny("llama")
    twin = untied_twin(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["embed_tokens", "lm_head"]))
    with torch.no_grad():
        twin.get_input_embeddings().weight.copy_(model.get_input_embeddings()(torch.arange(V)))
        twin.lm_head.weight.copy_(model.get_output_embeddings()(torch.eye(D)).T)
    data = batches(1)
    expected = twin_grads(twin, data)[0]
    model.compile(backend="aot_eager")
    rec, values, _, said = train(model, data)
    assert len(said) == 1 and "torch.compile" in said[0] and "head's gradient statistics are not reported" in said[0], said
    torch.testing.assert_close(rec.recorded[0]["embedding"], expected["embedding"], rtol=1e-5, atol=1e-6)
    assert "head" not in rec.recorded[0] and "headwatch/grad/head_row_density" not in values[0]


def test_lora_dropout_on_the_head_refuses_its_gradient_statistics_with_the_cause():
    """LoRA with ``lora_dropout > 0`` on the head: in training the adapter branch sees ``dropout(h)`` and the base
    ``h``, so no one matrix's gradient is what the loss trained; the head's gradient statistics are refused with one
    warning naming the fix. The embedding (PEFT's LoRA embedding applies no dropout) is exact against an untied twin
    of the effective matrices; without dropout the head is measured (the premise: the refusal is the dropout's)."""
    peft = pytest.importorskip("peft")

    def adapted(dropout: float):
        base = tiny("llama")
        twin = untied_twin(base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
                                     target_modules=["embed_tokens", "lm_head"])  # fmt: skip
            model = peft.get_peft_model(base, config)
        with torch.no_grad():
            twin.get_input_embeddings().weight.copy_(model.get_input_embeddings()(torch.arange(V)))
            twin.lm_head.weight.copy_(model.get_output_embeddings()(torch.eye(D)).T)
        return model, twin

    data = batches(1)
    model, twin = adapted(0.5)
    expected = twin_grads(twin, data)[0]  # the twin's embedding gradient does not depend on the head's dropout mask
    torch.manual_seed(0)
    rec, values, _, said = train(model, data)
    assert len(said) == 1 and "lora_dropout=0.5" in said[0] and "head's gradient statistics are not reported" in said[0]
    assert "head" not in rec.recorded[0] and "headwatch/grad/head_row_density" not in values[0]
    assert "headwatch/grad/embedding_row_density" in values[0]
    # the embedding's flow: only the head's dropout mask differs from the twin, which reaches the embedding through h
    model, twin = adapted(0.0)
    rec, values, _, said = train(model, data)
    assert said == [] and "headwatch/grad/head_row_density" in values[0]
    torch.testing.assert_close(rec.recorded[0]["head"], twin_grads(twin, data)[0]["head"], rtol=1e-5, atol=1e-6)
    assert expected["embedding"].shape == rec.recorded[0]["embedding"].shape
