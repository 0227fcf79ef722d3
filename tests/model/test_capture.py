"""Finding the output head, and reading prediction positions from a batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headwatch import HeadwatchError, find_output_head
from tests.helpers import positions


class Named(nn.Module):
    def __init__(self, head_name="lm_head", vocab=11, d=4):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)
        setattr(self, head_name, nn.Linear(d, vocab))


class HFLike(nn.Module):
    """Hugging Face style: the head is declared by get_output_embeddings()."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(11, 4)
        self.score = nn.Linear(4, 11)
        self.lm_head = nn.Linear(4, 11)  # a decoy name: get_output_embeddings wins

    def get_output_embeddings(self):
        return self.score


class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.model = inner


@pytest.mark.parametrize("head_name", ["lm_head", "output", "head"])
def test_conventional_names(head_name):
    model = Wrapper(Named(head_name))
    name, module = find_output_head(model)
    assert name == f"model.{head_name}" and module is getattr(model.model, head_name)


def test_hugging_face_get_output_embeddings():
    model = Wrapper(HFLike())
    assert find_output_head(model) == ("model.score", model.model.score)


def test_linear_matching_embedding_size():
    model = Named("decoder")  # no conventional name: found as the Linear with out_features == 11
    assert find_output_head(model) == ("decoder", model.decoder)


def test_explicit_head_by_name_and_module():
    model = Wrapper(Named())
    assert find_output_head(model, "model.proj")[1] is model.model.proj
    assert find_output_head(model, model.model.proj) == ("model.proj", model.model.proj)


def test_missing_head_error_lists_candidates():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(HeadwatchError, match=r"could not find the output head.*0 \(Linear 4 -> 8\).*head="):
        find_output_head(model)


def test_ambiguous_head_error_lists_candidates():
    model = nn.Module()
    model.a = Named()
    model.b = Named()
    with pytest.raises(HeadwatchError, match=r"ambiguous.*a\.lm_head.*b\.lm_head.*head='a\.lm_head'"):
        find_output_head(model)
    model2 = Named("decoder")
    model2.decoder2 = nn.Linear(4, 11)
    with pytest.raises(HeadwatchError, match="ambiguous.*decoder.*decoder2"):
        find_output_head(model2)


def test_bad_explicit_head():
    model = Named()
    with pytest.raises(HeadwatchError, match="names no submodule"):
        find_output_head(model, "nope.lm_head")
    with pytest.raises(HeadwatchError, match="not a submodule"):
        find_output_head(model, nn.Linear(2, 2))
    with pytest.raises(HeadwatchError, match="must be None"):
        find_output_head(model, 3)


def test_positions_shift_labels():
    labels = torch.tensor([[5, 6, 7, -100], [1, -100, 2, 3]])
    attention = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    mask, targets = positions({"labels": labels, "attention_mask": attention})
    assert targets.tolist() == [[6, 7, -100, -100], [-100, 2, 3, -100]]
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]
    _, aligned = positions({"labels": labels}, shift_labels=False)
    assert aligned.tolist() == labels.tolist()


def test_positions_from_object_and_tuple():
    class Batch:
        labels = torch.tensor([[1, 2]])

    assert positions(Batch())[1].tolist() == [[2, -100]]
    assert positions((torch.zeros(2, 3), torch.zeros(2, 3))) == (None, None)
