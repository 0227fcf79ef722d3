"""The one batch reader (headwatch.model.batch.BatchFormat / BatchView), for each model kind
(``for_alignment``): hand-computed targets and masks for mappings, objects, tuples and user functions, lazy
reads, and the documented errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import BatchEncoding

from headwatch import HeadwatchError
from headwatch.model.batch import BatchFormat, BatchView, field
from tests.helpers import positions

IDS = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
LABELS = torch.tensor([[5, 6, 7, 8], [9, 10, -100, -100]])
ATTENTION = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
SHIFTED = torch.tensor([[6, 7, 8, -100], [10, -100, -100, -100]])  # labels[t + 1], ignore_index last


def _batch(**extra) -> dict:
    return {"input_ids": IDS, "labels": LABELS, "attention_mask": ATTENTION, **extra}


# ---------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ids_key=0), "`ids_key` must be a non-empty string, got 0"),
        (dict(labels_key=None), "`labels_key` must be a non-empty string, got None"),
        (dict(mask_key=b"mask"), "`mask_key` must be a non-empty string"),
        (dict(shift_labels=1), "`shift_labels` must be a bool, got 1"),
        (dict(ignore_index=True), "`ignore_index` must be an int, got True"),
        (dict(ignore_index=-100.0), "`ignore_index` must be an int, got -100.0"),
        (dict(ids_fn="input_ids"), "`ids_fn` must be None or a callable"),
        (dict(mask_fn=torch.ones(2)), "`mask_fn` must be None or a callable"),
        (dict(targets_fn=3), "`targets_fn` must be None or a callable"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(HeadwatchError, match=match):
        BatchFormat(**kwargs)


def test_format_is_frozen():
    fmt = BatchFormat()
    with pytest.raises(AttributeError):
        fmt.ignore_index = 0  # type: ignore[misc]


# ---------------------------------------------------------------- reading a mapping, an object, a tuple
@pytest.mark.parametrize("wrap", [dict, BatchEncoding, lambda d: SimpleNamespace(**d)], ids=["dict", "BatchEncoding", "object"])
def test_causal_batch_shifts_labels_and_masks_by_attention(wrap):
    view = BatchFormat().read(wrap(_batch()))
    assert torch.equal(view.ids, IDS)
    assert torch.equal(view.ids_mask, ATTENTION)
    assert torch.equal(view.mask, ATTENTION.bool())
    assert torch.equal(view.targets, SHIFTED)
    # every position the attention mask drops already holds -100 here (see the next test for the replacement)
    assert torch.equal(view.masked_targets(), torch.tensor([[6, 7, 8, -100], [10, -100, -100, -100]]))


def test_masked_targets_replace_masked_positions_with_ignore_index():
    attention = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0]])
    view = BatchFormat(ignore_index=-1).read(_batch(attention_mask=attention))
    assert torch.equal(view.targets, torch.tensor([[6, 7, 8, -1], [10, -100, -100, -1]]))
    assert torch.equal(view.masked_targets(), torch.tensor([[6, -1, 8, -1], [-1, -100, -100, -1]]))
    # a mask of another shape (e.g. a packed batch) is not applied: the targets come back as they are
    odd = BatchFormat().read(_batch(attention_mask=torch.ones(2, 3)))
    assert torch.equal(odd.masked_targets(), SHIFTED)
    assert BatchFormat().read({"input_ids": IDS}).masked_targets() is None


def test_labels_as_given_when_not_shifted():
    view = BatchFormat(shift_labels=False).read(_batch())
    assert torch.equal(view.targets, LABELS)
    assert view.targets.dtype == torch.long


def test_targets_of_int32_labels_are_long_and_one_dimensional_labels_shift_too():
    view = BatchFormat().read({"labels": torch.tensor([3, 4, 5], dtype=torch.int32)})
    assert view.targets.tolist() == [4, 5, -100] and view.targets.dtype == torch.long
    assert view.ids is None and view.mask is None


@pytest.mark.parametrize(
    "labels",
    [torch.tensor(3), torch.zeros(2, 4), [[1, 2]], None],
    ids=["scalar", "float", "list", "absent"],
)
def test_labels_that_are_not_integer_sequences_give_no_targets(labels):
    batch = {"input_ids": IDS} if labels is None else {"input_ids": IDS, "labels": labels}
    assert BatchFormat().read(batch).targets is None


def test_tuple_and_list_batches_give_ids_only():
    for batch in ((IDS, LABELS), [IDS, LABELS]):
        view = BatchFormat().read(batch)
        assert view.ids is IDS
        assert view.mask is None and view.targets is None and view.ids_mask is None
    assert BatchFormat().read(()).ids is None
    assert BatchFormat().read((torch.zeros(2, 3),)).ids is None  # float tensors are not token ids


def test_custom_keys_and_object_attributes():
    batch = SimpleNamespace(tokens=IDS, y=LABELS, pad=ATTENTION)
    fmt = BatchFormat(ids_key="tokens", labels_key="y", mask_key="pad")
    view = fmt.read(batch)
    assert torch.equal(view.ids, IDS) and torch.equal(view.targets, SHIFTED) and torch.equal(view.mask, ATTENTION.bool())
    assert BatchFormat().read(batch).ids is None  # default keys name nothing on this object


def test_field_reads_mappings_objects_and_not_tuples():
    assert field({"a": 1}, "a") == 1 and field({"a": 1}, "b") is None
    assert field(SimpleNamespace(a=2), "a") == 2 and field(SimpleNamespace(a=2), "b") is None
    assert field((1, 2), "a") is None and field({"a": 1}, None) is None


# ---------------------------------------------------------------- user functions
def test_user_functions_win_and_are_called_once_on_first_access():
    calls = {"ids": 0, "mask": 0, "targets": 0}

    def counted(name, value):
        def fn(batch):
            calls[name] += 1
            return value

        return fn

    fmt = BatchFormat(
        ids_fn=counted("ids", IDS + 1),
        mask_fn=counted("mask", torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])),
        targets_fn=counted("targets", torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)),
    )
    view = fmt.read(_batch())
    assert calls == {"ids": 0, "mask": 0, "targets": 0}  # lazy: nothing read yet
    assert torch.equal(view.ids, IDS + 1)
    assert view.ids_mask is None  # the ids do not come from the batch's own field
    assert view.mask.dtype == torch.bool and view.mask.tolist() == [[True, True, False, False], [True, False, False, False]]
    assert view.targets.dtype == torch.long
    assert torch.equal(view.targets, torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]))  # no shift applied to targets_fn
    assert torch.equal(view.masked_targets(), torch.tensor([[1, 2, -100, -100], [5, -100, -100, -100]]))
    for _ in range(3):
        view.ids, view.mask, view.targets
    assert calls == {"ids": 1, "mask": 1, "targets": 1}


def test_user_functions_returning_no_tensor_are_refused_on_access():
    view = BatchFormat(mask_fn=lambda b: [[1, 0]], targets_fn=lambda b: (1, 2)).read(_batch())
    assert torch.equal(view.ids, IDS)  # other fields still read
    with pytest.raises(HeadwatchError, match=r"mask_fn must return a \(B, T\) bool tensor, got list"):
        view.mask
    with pytest.raises(HeadwatchError, match=r"targets_fn must return a \(B, T\) tensor, got tuple"):
        view.targets
    with pytest.raises(HeadwatchError, match="what `ids_fn` returns must be an integer tensor of token ids"):
        _ = BatchFormat(ids_fn=lambda b: IDS.float()).read(_batch()).ids  # float ids are not token ids: said, not skipped


# ---------------------------------------------------------------- alignments
def test_for_alignment():
    fmt = BatchFormat(ignore_index=-1)
    assert fmt.for_alignment("causal") is fmt
    aligned = fmt.for_alignment("aligned")
    assert aligned.shift_labels is False and aligned.mask_key == "attention_mask" and aligned.ignore_index == -1
    seq2seq = fmt.for_alignment("seq2seq")
    assert seq2seq.shift_labels is False and seq2seq.mask_key == "decoder_attention_mask"
    own_mask = BatchFormat(mask_fn=lambda b: b["m"]).for_alignment("seq2seq")
    assert own_mask.shift_labels is False and own_mask.mask_key == "attention_mask"  # the user's mask_fn decides


def test_positions_by_alignment_by_hand():
    decoder = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    batch = _batch(decoder_attention_mask=decoder)
    mask, targets = positions(batch, "causal")
    assert torch.equal(mask, ATTENTION.bool()) and torch.equal(targets, SHIFTED)
    mask, targets = positions(batch, "aligned", ignore_index=-7)
    assert torch.equal(mask, ATTENTION.bool()) and torch.equal(targets, LABELS)
    mask, targets = positions(batch, "seq2seq")
    assert torch.equal(mask, decoder.bool()) and torch.equal(targets, LABELS)
    mask, targets = positions(_batch(), "seq2seq")  # no decoder mask: the encoder's is never used
    assert mask is None and torch.equal(targets, LABELS)
    assert positions((IDS, LABELS), "causal") == (None, None)


def test_the_causal_reader_shifts_with_its_ignore_index():
    mask, targets = positions(_batch(), ignore_index=-5)
    assert torch.equal(mask, ATTENTION.bool())
    assert torch.equal(targets, torch.tensor([[6, 7, 8, -5], [10, -100, -100, -5]]))
    mask, targets = positions(_batch(), shift_labels=False)
    assert torch.equal(targets, LABELS)
    assert positions((IDS,)) == (None, None)


def test_view_keeps_its_format_and_batch():
    fmt, batch = BatchFormat(), _batch()
    view = fmt.read(batch)
    assert isinstance(view, BatchView) and view.format is fmt and view.batch is batch


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.complex64])
def test_input_ids_must_be_an_integer_tensor(dtype):
    ids = torch.ones(2, 3).to(dtype)
    with pytest.raises(HeadwatchError, match=r"the batch's `input_ids` must be an integer tensor of token ids"):
        _ = BatchView(BatchFormat(), {"input_ids": ids}).ids
    with pytest.raises(HeadwatchError, match=r"what `ids_fn` returns must be an integer tensor"):
        _ = BatchView(BatchFormat(ids_fn=lambda b: b["x"]), {"x": ids}).ids
    assert BatchView(BatchFormat(), {"input_ids": torch.ones(2, 3, dtype=torch.int32)}).ids.dtype == torch.int32


def test_a_tuple_batchs_float_first_tensor_is_not_ids_but_a_bool_one_is_refused():
    assert BatchView(BatchFormat(), (torch.ones(2, 3), torch.ones(2))).ids is None  # features, not ids
    with pytest.raises(HeadwatchError, match="integer tensor of token ids"):
        _ = BatchView(BatchFormat(), (torch.ones(2, 3, dtype=torch.bool),)).ids


def test_bool_input_ids_raise_under_strict_and_warn_once_otherwise():
    import warnings

    from headwatch import Headwatch
    from tests.helpers import TinyCausalLM

    ids = torch.randint(0, 64, (2, 8))
    for strict in (True, False):
        model = TinyCausalLM(vocab_size=64, d_model=16)
        hw = Headwatch(model, log_every_n_steps=1, figure_every_n_steps=0, strict=strict)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if strict:
                with pytest.raises(HeadwatchError, match="`input_ids` must be an integer tensor"):
                    hw.step_start({"input_ids": ids.bool(), "labels": ids}, 0)
                continue
            hw.step_start({"input_ids": ids.bool(), "labels": ids}, 0)
        said = [str(w.message) for w in caught if "input_ids" in str(w.message)]
        assert len(said) == 1 and "not bool or float" in said[0], said
