"""Finding the head and the embedding, their effective matrices and tie, and where the logits come from
(headwatch.model.find, .weights, .adapters, .sources): hand-built modules whose answer is known, tiny
``transformers`` models built from a config (no download), duck-typed adapters checked against
``W + s B A`` in float64, and every documented error."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from headwatch import HeadwatchError
from headwatch.model import weights as mweights
from headwatch.model.adapters import adapter_kind, effective_weight, matrix_signature, storage_weight, trainable_matrices
from headwatch.model.find import (
    find_head_and_embedding,
    find_input_embedding,
    find_output_head,
    logits_from_output,
    resolve_matrices,
)
from headwatch.model.sources import (
    LogitsSource,
    compiled_modules,
    final_logit_transform,
    model_alignment,
    resolve_logits_source,
)
from headwatch.model.weights import (
    config_tie,
    config_tie_mismatch,
    effective_tie,
    find_embedding_group,
    warn_config_tie_once,
)

transformers = pytest.importorskip("transformers")

V, D = 12, 4


def tiny_llama(tie: bool) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(config)


class Plain(nn.Module):
    """No getter, no conventional names: ``tok`` (V x D) and ``proj`` (D -> V)."""

    def __init__(self, vocab: int = V, tied: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, D)
        self.mid = nn.Linear(D, D)
        self.proj = nn.Linear(D, vocab, bias=False)
        if tied:
            self.proj.weight = self.tok.weight


class Getter(nn.Module):
    """A Hugging Face-like module: the getters say which modules are the head and the embedding."""

    def __init__(self, head: nn.Module | None = None, fail: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.score = head if head is not None else nn.Linear(D, V)
        self.fail = fail

    def get_output_embeddings(self) -> nn.Module:
        if self.fail:
            raise RuntimeError("this getter fails")
        return self.score

    def get_input_embeddings(self) -> nn.Module:
        if self.fail:
            raise RuntimeError("this getter fails")
        return self.emb


# ---------------------------------------------------------------- the output head
def test_a_failing_getter_falls_through_to_the_conventional_name():
    model = nn.Module()
    model.inner = Getter(fail=True)
    model.lm_head = nn.Linear(D, V)
    assert find_output_head(model) == ("lm_head", model.lm_head)


def test_several_getters_disagreeing_are_ambiguous_and_listed():
    model = nn.Module()
    model.a, model.b = Getter(), Getter()
    with pytest.raises(HeadwatchError, match=r"ambiguous \(several get_output_embeddings\(\) results\): a.score \(Linear 4 -> 12\), b.score"):
        find_output_head(model)


def test_several_conventional_names_are_ambiguous_and_describe_their_kinds():
    class Weighted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(V, D))

    model = nn.Module()
    model.output = nn.Embedding(V, D)
    model.head = Weighted()
    with pytest.raises(HeadwatchError, match=r"output \(Embedding 12 x 4\), head \(Weighted\)\. Pass one explicitly, e\.g\. head='output'"):
        find_output_head(model)


def test_several_linears_of_the_vocabulary_size_are_ambiguous():
    model = Plain()
    model.proj2 = nn.Linear(D, V)
    with pytest.raises(HeadwatchError, match=r"several Linear layers with out_features equal to an embedding's size\): proj \(Linear 4 -> 12\), proj2"):
        find_output_head(model)


def test_no_head_lists_embeddings_and_linears_truncated_at_twenty():
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(23)])
    with pytest.raises(HeadwatchError, match=r"embeddings: none\).*19 \(Linear 3 -> 3\), \.\.\. \(3 more\)"):
        find_output_head(model)
    only_embedding = nn.Module()
    only_embedding.e = nn.Embedding(7, 2)
    with pytest.raises(HeadwatchError, match=r"\(embeddings: \[7\]\)\. Linear layers found: none\."):
        find_output_head(only_embedding)


@pytest.mark.parametrize(
    "head, match",
    [
        (3, "`head` must be None, an nn.Module or a dotted name"),
        (nn.Linear(D, V), "not a submodule of Plain"),
        ("proj.missing", r"`head='proj.missing'` names no submodule of Plain.*Linear layers found: mid \(Linear 4 -> 4\)"),
    ],
)
def test_explicit_head_errors(head, match):
    with pytest.raises(HeadwatchError, match=match):
        find_output_head(Plain(), head)


def test_find_head_and_embedding_refuses_a_head_without_matrix_and_a_vocabulary_mismatch():
    model = Plain()
    model.act = nn.ReLU()
    with pytest.raises(HeadwatchError, match="the output head `act` has no 2-D `weight`"):
        find_head_and_embedding(model, head="act")
    model.other = nn.Embedding(V + 1, D)
    with pytest.raises(HeadwatchError, match=r"vocabulary mismatch: the input embedding `other` has weight \(13, 4\).*\(12, 4\)"):
        find_head_and_embedding(model, embedding="other")
    found = find_head_and_embedding(Plain(tied=True))
    assert (found.head_name, found.embedding_name, found.tied) == ("proj", "tok", True)
    assert find_head_and_embedding(Plain()).tied is False


# ---------------------------------------------------------------- the input embedding
def test_embedding_rules_in_order():
    model = Plain()
    model.extra = nn.Embedding(V + 3, D)
    assert find_input_embedding(model, vocab_size=V) == ("tok", model.tok)  # rule 4: the one with V rows
    with pytest.raises(HeadwatchError, match=r"several weights among nn.Embedding modules\): tok \(Embedding \(12, 4\)\); extra"):
        find_input_embedding(model)
    with pytest.raises(HeadwatchError, match=r"could not find the input embedding of Plain.*no nn.Embedding with num_embeddings == 99.*tok \(Embedding \(12, 4\)\)"):
        find_input_embedding(model, vocab_size=99)
    model.embed_tokens = nn.Embedding(V, D)  # rule 3 (a conventional name) decides before rule 4
    assert find_input_embedding(model) == ("embed_tokens", model.embed_tokens)
    getter = Getter()
    getter.embed_tokens = nn.Embedding(V, D)  # rule 2 (the getter) decides before the name
    assert find_input_embedding(getter) == ("emb", getter.emb)
    failing = Getter(fail=True)  # its getter raises: the other rules decide
    failing.second = nn.Embedding(V, D)
    with pytest.raises(HeadwatchError, match=r"several weights among nn.Embedding modules\): emb \(Embedding \(12, 4\)\); second"):
        find_embedding_group(failing)


def test_embeddings_named_alike_on_two_weights_are_ambiguous():
    model = nn.Module()
    model.enc, model.dec = nn.Module(), nn.Module()
    model.enc.embed_tokens, model.dec.embed_tokens = nn.Embedding(V, D), nn.Embedding(V, D)
    with pytest.raises(HeadwatchError, match=r"several weights among embeddings named like embed_tokens/wte.*Pass one explicitly, e.g. embedding='enc.embed_tokens'"):
        find_embedding_group(model)
    model.dec.embed_tokens.weight = model.enc.embed_tokens.weight  # one weight, two lookups: one group
    group = find_embedding_group(model)
    assert [n for n, _ in group.modules] == ["enc.embed_tokens", "dec.embed_tokens"] and group.weight is model.enc.embed_tokens.weight


@pytest.mark.parametrize(
    "embedding, match",
    [
        (nn.Embedding(V, D), r"not a submodule of Plain.*Embeddings found: tok \(Embedding \(12, 4\)\)"),
        (1.5, "`embedding` must be None, an nn.Module or a dotted name"),
        ("nope", r"`embedding='nope'` names no submodule of Plain"),
        ("norm", r"`embedding='norm'` has no 2-D `weight` \(got norm \(LayerNorm\)\)"),
    ],
)
def test_explicit_embedding_errors(embedding, match):
    model = Plain()
    model.norm = nn.LayerNorm(D)
    with pytest.raises(HeadwatchError, match=match):
        find_embedding_group(model, embedding)


def test_explicit_embedding_module_is_the_primary_member_of_its_group():
    model = Plain(tied=True)
    model.copy = nn.Embedding(V, D)
    model.copy.weight = model.tok.weight
    group = find_embedding_group(model, model.copy)
    assert group.module is model.copy and [n for n, _ in group.modules] == ["copy", "tok"]


# ---------------------------------------------------------------- the matrices of a real model
@pytest.mark.parametrize("tie", [True, False])
def test_resolve_matrices_of_a_tiny_llama(tie):
    model = tiny_llama(tie)
    m = resolve_matrices(model)
    assert (m.head_name, m.embedding.name) == ("lm_head", "model.embed_tokens")
    assert m.tie.tied is tie and m.tie.storage_tied is tie
    assert m.trains["head"].gradient_parameter is model.lm_head.weight and m.trains["embedding"].trains
    assert m.config_message is None
    assert m.tie.reason == ("one effective matrix: tied" if tie else "separate Parameters: untied")
    assert m.text() == f"head `lm_head` and embedding `model.embed_tokens` (12, 8): {m.tie.reason}."


def test_resolve_matrices_says_frozen_and_config_mismatch_in_its_text():
    model = tiny_llama(False)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied by hand; the config still says untied
    model.model.embed_tokens.weight.requires_grad_(False)
    m = resolve_matrices(model)
    assert m.tie.tied and not m.trains["head"].trains
    assert m.config_message is not None and "tie_word_embeddings=False" in m.config_message
    text = m.text()
    assert "`lm_head` is FROZEN" in text and "`model.embed_tokens` is FROZEN" in text and m.config_message in text


def test_resolve_matrices_errors():
    model = Plain()
    model.act = nn.ReLU()
    with pytest.raises(HeadwatchError, match="the output head `act` has no 2-D `weight`"):
        resolve_matrices(model, head="act")
    model.other = nn.Embedding(V + 1, D)
    with pytest.raises(HeadwatchError, match=r"the input embedding `other` has 13 rows but the output head `proj` has 12"):
        resolve_matrices(model, embedding="other")


# ---------------------------------------------------------------- tie state and config
def test_effective_tie_reasons():
    untied = Plain()
    assert effective_tie(untied.proj, untied.tok) == (False, False, "separate Parameters: untied")
    tied = Plain(tied=True)
    state = effective_tie(tied.proj, tied.tok)
    assert state == (True, True, "one effective matrix: tied")
    with pytest.raises(HeadwatchError, match="need a 2-D `weight`"):
        effective_tie(nn.ReLU(), tied.tok)


def test_separate_weights_on_the_meta_device_are_not_tied():
    """Meta tensors have no memory (every data pointer is 0): two separate Parameters are still two matrices."""
    with torch.device("meta"):
        untied, tied = Plain(), Plain(tied=True)
    assert matrix_signature(untied.proj) != matrix_signature(untied.tok)
    assert effective_tie(untied.proj, untied.tok) == (False, False, "separate Parameters: untied")
    assert effective_tie(tied.proj, tied.tok).tied
    assert matrix_signature(holding(tied.tok.weight.detach())) == matrix_signature(tied.tok)


def holding(weight: torch.Tensor) -> nn.Module:
    """A module whose ``weight`` is ``weight`` (its memory, not a copy)."""
    module = nn.Module()
    module.weight = nn.Parameter(weight, requires_grad=False)
    return module


def test_the_tie_compares_memory_not_values():
    w = torch.randn(V, D)
    same = matrix_signature(holding(w))
    assert same == matrix_signature(holding(w.view(V, D))) == matrix_signature(holding(w.detach()))
    assert matrix_signature(holding(w.clone())) != same  # equal values, other memory
    assert matrix_signature(holding(w[1:])) != matrix_signature(holding(w[:-1]))  # same storage, other offset
    assert matrix_signature(holding(w.view(D, V))) != same  # same memory, other shape


def test_config_tie_reads_the_text_config_and_warns_once_per_model():
    class Config:
        def get_text_config(self):
            return type("Text", (), {"tie_word_embeddings": True})()

    model = Plain()
    model.config = Config()
    assert config_tie(model) is True
    assert config_tie(Plain()) is None
    with pytest.warns(UserWarning, match="config says tie_word_embeddings=True, but the head and the embedding are stored as two separate"):
        first = warn_config_tie_once(model, storage_tied=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_config_tie_once(model, storage_tied=False) == first  # said once, the message still returned
        assert warn_config_tie_once(model, storage_tied=True) is None
    mweights._WARNED.discard((id(model), first))


def test_config_tie_mismatch_of_the_config_and_the_storage():
    tied = tiny_llama(True)
    untied = tiny_llama(False)
    head, emb = tied.lm_head, tied.model.embed_tokens
    assert config_tie_mismatch(tied, effective_tie(head, emb).storage_tied, head) is None
    tied.lm_head.weight = nn.Parameter(emb.weight.detach().clone())
    assert "says tie_word_embeddings=True, but the head and the embedding are stored as two separate Parameters" in (
        config_tie_mismatch(tied, effective_tie(tied.lm_head, emb).storage_tied, tied.lm_head)
    )
    untied.lm_head.weight = untied.model.embed_tokens.weight
    storage = effective_tie(untied.lm_head, untied.model.embed_tokens).storage_tied
    assert "says tie_word_embeddings=False, but the head and the embedding are stored as one shared Parameter" in (
        config_tie_mismatch(untied, storage, untied.lm_head)
    )
    assert config_tie_mismatch(Plain(), False) is None  # no config: nothing to disagree with


# ---------------------------------------------------------------- duck-typed adapters
class FakeLora(nn.Module):
    """PEFT's LoRA Linear layout: ``base_layer``, ``lora_A[name]``, ``lora_B[name]``, ``scaling[name]``."""

    def __init__(self, base: nn.Linear, adapters: dict[str, float], active: str | list[str], r: int = 2) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({a: nn.Linear(base.in_features, r, bias=False) for a in adapters})
        self.lora_B = nn.ModuleDict({a: nn.Linear(r, base.out_features, bias=False) for a in adapters})
        self.scaling = dict(adapters)
        self.active_adapter = active  # no `active_adapters`: the older single-name attribute

    def get_base_layer(self) -> nn.Module:
        return self.base_layer


def test_lora_effective_weight_with_the_single_name_attribute_and_a_missing_adapter():
    torch.manual_seed(1)
    lora = FakeLora(nn.Linear(D, V, bias=False), {"a": 0.5, "b": 2.0}, active="a")
    want = lora.base_layer.weight.double() + 0.5 * lora.lora_B["a"].weight.double() @ lora.lora_A["a"].weight.double()
    assert adapter_kind(lora) == "lora"
    torch.testing.assert_close(effective_weight(lora).double(), want, atol=1e-6, rtol=1e-6)
    assert storage_weight(lora) is lora.base_layer.weight
    lora.active_adapter = "not-loaded"  # active but absent: nothing added
    torch.testing.assert_close(effective_weight(lora), lora.base_layer.weight.detach())
    lora.merged = True
    assert adapter_kind(lora) == "lora_merged"
    lora.merged, lora.disable_adapters = False, True
    assert adapter_kind(lora) == "plain"


def test_an_active_adapter_that_does_not_target_the_head_adds_nothing_to_it():
    """PEFT activates adapter names on every LoRA layer; a layer skips those it lacks (its forward is the reference)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(False), peft.LoraConfig(r=2, target_modules=["lm_head"], init_lora_weights=False))
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    model.base_model.set_adapter(["default", "other"])
    head = model.get_output_embeddings()
    assert head.active_adapters == ["default", "other"] and "other" not in head.lora_A
    with torch.no_grad():
        rows = head(torch.eye(8)).T  # (V, d_model) as the forward computes them
    torch.testing.assert_close(effective_weight(head), rows, atol=1e-5, rtol=1e-5)
    assert len(matrix_signature(head)) == 2  # the base and the one adapter the head has


def test_trainability_of_a_frozen_lora_base():
    lora = FakeLora(nn.Linear(D, V, bias=False), {"a": 1.0}, active=["a"])
    emb = nn.Embedding(V, D)
    lora.base_layer.weight.requires_grad_(False)
    emb.weight.requires_grad_(False)
    got = trainable_matrices(lora, emb)
    assert got["head"] == (True, "lora", None)  # trains through its adapter; no Parameter holds W_eff's gradient
    assert got["embedding"] == (False, "plain", None)


class FakeSaved(nn.Module):
    """PEFT's ``modules_to_save`` wrapper: ``original_module`` and a trained copy per adapter."""

    def __init__(self, original: nn.Module, disabled: bool = False) -> None:
        super().__init__()
        self.original_module = original
        self.modules_to_save = nn.ModuleDict({"default": nn.Linear(original.in_features, original.out_features, bias=False)})
        with torch.no_grad():
            self.modules_to_save["default"].weight.copy_(original.weight * 3)
        self.active_adapter = "default"
        self.disable_adapters = disabled


def test_modules_to_save_is_the_copy_unless_disabled_and_unties_a_tie():
    model = Plain(tied=True)
    saved = FakeSaved(model.proj)
    assert storage_weight(saved) is model.tok.weight  # the stored Parameter a tie would share
    torch.testing.assert_close(effective_weight(saved), model.tok.weight.detach() * 3)
    state = effective_tie(saved, model.tok)
    assert state == (False, True, "one stored Parameter, but modules_to_save trains a copy of the head: untied")
    off = FakeSaved(model.proj, disabled=True)
    assert effective_weight(off).data_ptr() == model.tok.weight.data_ptr()  # the original, no copy
    assert effective_tie(off, model.tok).tied


def test_unknown_adapters_and_matrixless_modules_are_refused():
    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base_layer = nn.Linear(D, V)

        def get_base_layer(self) -> nn.Module:
            return self.base_layer

    with pytest.raises(HeadwatchError, match="Wrapped is an adapter layer headwatch does not know"):
        effective_weight(Wrapped())
    with pytest.raises(HeadwatchError, match="ReLU has no 2-D `weight`"):
        effective_weight(nn.ReLU())

    class SelfBase(nn.Linear):
        base_layer = None

        def get_base_layer(self) -> nn.Module:
            return self  # a wrapper that is its own base: no loop

    layer = SelfBase(D, V)
    assert storage_weight(layer) is layer.weight and adapter_kind(layer) == "plain"


# ---------------------------------------------------------------- where the logits come from
def test_logits_from_output_forms():
    x = torch.zeros(2, 3, V)
    assert logits_from_output(x) is x
    assert logits_from_output(transformers.modeling_outputs.CausalLMOutput(logits=x)) is x
    assert logits_from_output((x, "cache")) is x and logits_from_output([x]) is x
    assert logits_from_output(torch.zeros(2, 3, dtype=torch.long)) is None
    assert logits_from_output(()) is None and logits_from_output(None) is None


def test_final_logit_transform_composes_the_declared_steps_in_order():
    class Broken:
        final_logit_softcapping = 10.0
        logit_scale = 2.0
        logits_scaling = 4.0

        def get_text_config(self):
            raise RuntimeError("an odd config")  # read the top level instead

    transform = final_logit_transform(Broken())  # the scale first (the first one declared), then the softcap
    x = torch.linspace(-40, 40, 9, dtype=torch.float64)
    torch.testing.assert_close(transform(x), 10.0 * torch.tanh(x * 2.0 / 10.0))
    assert transform.description == "x * 2.0 (logit_scale) then 10.0 * tanh(x / 10.0) (final_logit_softcapping)"

    class Neutral:
        final_logit_softcapping = True  # a bool is no cap
        logit_scale = 1
        logits_scaling = 0

    assert final_logit_transform(Neutral()) is None and final_logit_transform(None) is None


def test_logits_source_of_a_hugging_face_model_and_its_description():
    model = tiny_llama(True)
    src = resolve_logits_source(model)
    assert (src.kind, src.owner, src.head, src.alignment) == ("model_logits", model, model.lm_head, "causal")
    assert src.base is model.model and src.base_name == "model" and src.embedding is model.model.embed_tokens
    text = src.describe()
    assert "the `logits` returned by `<root>` (LlamaForCausalLM" in text and "labels shifted by one" in text
    named = resolve_logits_source(model, logits_module=model.lm_head, hidden_module="model.norm", alignment="aligned")
    assert (named.kind, named.owner_name, named.hidden_name, named.hidden_module) == ("named_module", "lm_head", "model.norm", model.model.norm)
    assert "named by logits_module=" in named.describe() and "labels as given (already aligned" in named.describe()


def test_logits_source_of_a_plain_module_is_the_head_output():
    model = Plain()
    src = resolve_logits_source(model)
    assert (src.kind, src.owner, src.base, src.transform, src.alignment) == ("head_output", model.proj, None, None, "causal")
    assert src.describe().startswith("the output of the head `proj` (Linear)")
    seq = resolve_logits_source(model, alignment="seq2seq")
    assert "decoder_attention_mask" in seq.describe()
    assert isinstance(src, LogitsSource)


def test_logits_source_with_ambiguous_embedding_still_resolves():
    model = Plain()
    model.twin = nn.Embedding(V, D)  # two embeddings of the head's size: only the diagnosis is less precise
    assert resolve_logits_source(model).embedding is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(alignment="shifted"), r"`alignment` must be None or one of \('causal', 'seq2seq', 'aligned'\)"),
        (dict(logits_module=nn.Linear(2, 2)), "`logits_module` is a Linear that is not a submodule of the model"),
        (dict(hidden_module="nowhere"), r"`hidden_module='nowhere'` names no submodule of Plain"),
        (dict(logits_module=7), "`logits_module` must be None, an nn.Module or its dotted name, got int"),
    ],
)
def test_logits_source_errors(kwargs, match):
    with pytest.raises(HeadwatchError, match=match):
        resolve_logits_source(Plain(), **kwargs)


def test_the_owner_is_the_innermost_module_whose_getter_returns_the_head():
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Getter()
            self.broken = Getter(fail=True)

        def get_output_embeddings(self) -> nn.Module:
            return self.inner.score  # a wrapper forwarding the getter

    model = Outer()
    src = resolve_logits_source(model, head="inner.score")
    assert src.owner is model.inner and src.owner_name == "inner"


def test_model_alignment_and_no_compiled_module():
    t5 = type("T5", (nn.Module,), {})()
    t5.config = type("C", (), {"is_encoder_decoder": True})()
    assert model_alignment(t5) == "seq2seq" and model_alignment(Plain()) == "causal"
    assert compiled_modules(Plain()) == []
