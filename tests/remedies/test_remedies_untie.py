"""untie_output_head on plain modules and Hugging Face models: exact logits, config, round trips."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headwatch import HeadwatchError
from headwatch.remedies import untie_output_head
from tests.helpers import TinyCausalLM, loader
from tests.helpers.lightning_runs import make_trainer

V, D = 64, 16


def _llama(tied: bool = True, **kw):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=tied, **kw,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_copy_keeps_logits_exactly_on_a_plain_module():
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=V, d_model=D, tie_weights=True)
    ids = torch.randint(0, V, (4, 12))
    before = model(ids).detach()
    old = model.lm_head.weight
    report = untie_output_head(model, init="copy")
    after = model(ids).detach()
    assert (after - before).abs().max().item() == 0.0
    head = model.lm_head.weight
    assert head is not model.embed_tokens.weight and model.embed_tokens.weight is old
    assert (head.shape, head.dtype, head.device, head.requires_grad) == (old.shape, old.dtype, old.device, True)
    assert head.data_ptr() != old.data_ptr()
    assert (report.params_added, report.bytes_added) == (V * D, V * D * 4)
    assert (report.head_name, report.embedding_name, report.hf_config_updated) == ("lm_head", "embed_tokens", False)
    # the model now has exactly V * D more parameters
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in TinyCausalLM(V, D, True).parameters()) + V * D


def test_bf16_bytes_and_bias_kept():
    class Biased(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(V, D, dtype=torch.bfloat16)
            self.lm_head = nn.Linear(D, V, bias=True, dtype=torch.bfloat16)
            self.lm_head.weight = self.embed_tokens.weight

        def forward(self, ids):
            return self.lm_head(self.embed_tokens(ids))

    model = Biased()
    bias = model.lm_head.bias
    ids = torch.randint(0, V, (2, 5))
    before = model(ids).detach()
    report = untie_output_head(model)
    assert torch.equal(model(ids).detach(), before)
    assert model.lm_head.bias is bias and model.lm_head.weight.dtype == torch.bfloat16
    assert report.bytes_added == V * D * 2 == 2048


def test_normal_init_uses_the_given_std_and_requires_one_on_plain_modules():
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=512, d_model=64, tie_weights=True)
    with pytest.raises(HeadwatchError, match="initializer_range.*std="):
        untie_output_head(model, init="normal")
    report = untie_output_head(model, init="normal", std=0.5)
    w = model.lm_head.weight.detach().double()
    assert report.std == 0.5
    assert abs(w.mean().item()) < 0.01 and abs(w.std().item() - 0.5) < 0.01  # 32768 draws: std error ~0.002


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"init": "zeros"}, r"`init` must be one of \('copy', 'normal'\), got 'zeros'"), ({"std": -1.0}, "`std` must be")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(HeadwatchError, match=match):
        untie_output_head(TinyCausalLM(V, D, tie_weights=True), **kwargs)


def test_refuses_an_untied_model():
    with pytest.raises(HeadwatchError, match="not tied.*nothing to untie"):
        untie_output_head(TinyCausalLM(V, D, tie_weights=False))


def test_refuses_a_quantised_or_sharded_head():
    model = TinyCausalLM(V, D, tie_weights=True)
    shared = nn.Parameter(torch.zeros(V, D, dtype=torch.int8), requires_grad=False)
    model.embed_tokens.weight = shared
    model.lm_head.weight = shared
    with pytest.raises(HeadwatchError, match="quantised weight.*int8"):
        untie_output_head(model)
    model = TinyCausalLM(V, D, tie_weights=True)
    model.lm_head.weight._is_flat_param = True  # what FSDP's FlatParameter carries
    with pytest.raises(HeadwatchError, match="sharded weight.*before FSDP"):
        untie_output_head(model)


def test_hf_copy_exact_and_tie_weights_keeps_it_untied():
    model = _llama()
    ids = torch.randint(0, V, (2, 7))
    before = model(ids).logits.detach()
    report = untie_output_head(model)
    assert report.hf_config_updated and not model.config.tie_word_embeddings
    assert (model(ids).logits.detach() - before).abs().max().item() == 0.0
    model.tie_weights()  # recomputes the tie map from the config: must not tie again
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.all_tied_weights_keys == {}


def test_the_write_ups_model_attribute_does_not_survive_tie_weights():
    """Control: a flag on the model object (not its config) is ignored and tie_weights() ties again."""
    model = _llama()
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    model.tie_word_embeddings = False
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_hf_save_reload_and_resize_stay_untied(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _llama(initializer_range=0.3)
    untie_output_head(model, init="normal")  # std from config.initializer_range
    assert abs(model.lm_head.weight.std().item() - 0.3) < 0.05
    model.save_pretrained(tmp_path)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight is not reloaded.model.embed_tokens.weight
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
    assert torch.equal(reloaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert not torch.equal(reloaded.lm_head.weight, reloaded.model.embed_tokens.weight)
    reloaded.resize_token_embeddings(V + 16)
    assert reloaded.lm_head.weight is not reloaded.model.embed_tokens.weight
    assert reloaded.lm_head.weight.shape == (V + 16, D)
    assert torch.equal(reloaded.lm_head.weight[:V], model.lm_head.weight)


class UntieInConfigureModel(TinyCausalLM):
    """The Lightning path: untie in configure_model, which runs before configure_optimizers."""

    def configure_model(self):
        if self.lm_head.weight is self.embed_tokens.weight:
            untie_output_head(self)

    def configure_optimizers(self):
        self.optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return self.optimizer


def test_lightning_path_puts_the_new_head_in_the_optimizer(tmp_path):
    torch.manual_seed(0)
    model = UntieInConfigureModel(vocab_size=V, d_model=D, tie_weights=True)
    start = model.embed_tokens.weight.detach().clone()
    make_trainer(tmp_path, [], max_steps=2).fit(model, loader(n=16))
    head = model.lm_head.weight
    assert any(p is head for g in model.optimizer.param_groups for p in g["params"])
    assert not torch.equal(head.detach(), start)  # trained
    assert not torch.equal(head.detach(), model.embed_tokens.weight.detach())  # and apart from the embedding


def test_multimodal_model_text_sub_config(tmp_path):
    """Llava: the tie lives in the text sub-config and the language model's embedding; both handled."""
    transformers = pytest.importorskip("transformers")
    text = transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=True,
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=D, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
    )
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=V - 1)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    ids = torch.randint(0, V - 4, (1, 5))
    before = model(input_ids=ids).logits.detach()
    report = untie_output_head(model)
    assert report.embedding_name == "model.language_model.embed_tokens"
    assert not model.config.get_text_config().tie_word_embeddings
    assert torch.equal(model(input_ids=ids).logits.detach(), before)
    model.tie_weights()
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    model.save_pretrained(tmp_path)
    reloaded = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight is not reloaded.get_input_embeddings().weight
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)


def test_report_is_logged_once(caplog):
    model = TinyCausalLM(V, D, tie_weights=True)
    with caplog.at_level("INFO"):
        report = untie_output_head(model)
    lines = [r.getMessage() for r in caplog.records if "untied `lm_head`" in r.getMessage()]
    assert lines == [str(report)] and f"+{V * D:,} parameters, +{V * D * 4:,} bytes" in lines[0]
