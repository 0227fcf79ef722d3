"""Argument checks live in the core, whatever the door.

Property tests over the public constructors: for every argument, values of the wrong type (a bool
where an int is expected, a float where a bool is), out of range, NaN or infinite, empty strings
and unknown choices raise :class:`HeadwatchError` whose message names the argument (in backticks)
and shows the value given (its ``repr``; a tensor by dtype and shape); valid values construct.
The same invalid values are tried through the doors that pass the argument on: the Lightning
adapters, the plain loop (``Headwatch``) and the Hugging Face callback.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import headwatch
from headwatch.alerts import AlertEngine, CollapseRules, WebhookSender, standard_actions
from headwatch.core import BatchFormat, GradientDensity, LogitStats, Schedule, SynonymCollision, TokenCounts
from headwatch.core.metrics import LogitStatsMetric
from headwatch.core.metrics_evidence import FrequencyCalibrationMetric
from headwatch.errors import HeadwatchError, check_int, check_optional, check_range, check_sequence
from headwatch.model.capture import PATHS
from headwatch.model.sources import ALIGNMENTS
from headwatch.remedies import HeadWarmup, HeadWarmupCore, TiedOutputProjection, install_tied_projection, untie_output_head
from headwatch.remedies.cost import untie_cost
from tests.helpers import TinyCausalLM

BAD = settings(max_examples=20, deadline=None)
DOOR = settings(max_examples=10, deadline=None)  # the same strategies as the core's, through a door
GOOD = settings(max_examples=10, deadline=None)

# ---------------------------------------------------------------------------- strategies
TEXT = st.text(max_size=6)
LISTS = st.lists(st.integers(-3, 3), min_size=1, max_size=2)
NONFINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def bad_bool() -> st.SearchStrategy:
    return st.one_of(st.integers(), st.floats(allow_nan=True), TEXT, LISTS, st.none())


def bad_int(minimum: int | None = None, maximum: int | None = None, optional: bool = False) -> st.SearchStrategy:
    """Bools, floats (integral ones too, NaN, infinities), strings, lists, ints out of range; None unless ``optional``."""
    parts = [st.booleans(), st.floats(allow_nan=True, allow_infinity=True), TEXT, LISTS]
    if minimum is not None:
        parts.append(st.integers(max_value=minimum - 1))
    if maximum is not None:
        parts.append(st.integers(min_value=maximum + 1))
    return st.one_of(parts) if optional else st.one_of(*parts, st.none())


def good_int(minimum: int | None = None, maximum: int | None = None, optional: bool = False) -> st.SearchStrategy:
    # an int argument is an int64 (errors.check_int): torch holds nothing wider
    ints = st.integers(min_value=-(2**63) if minimum is None else minimum, max_value=2**63 - 1 if maximum is None else maximum)
    return st.one_of(ints, st.none()) if optional else ints


def bad_number(low: float | None = None, high: float | None = None, *, low_open: bool = False,
               high_open: bool = False, optional: bool = False) -> st.SearchStrategy:
    """Bools, strings, lists, NaN and infinities, numbers outside the interval (ints too); None unless ``optional``."""
    parts = [st.booleans(), TEXT, LISTS, NONFINITE]
    if low is not None:
        parts.append(st.floats(max_value=low, exclude_max=not low_open, allow_nan=False, allow_infinity=False))
        parts.append(st.integers(max_value=math.ceil(low) - (0 if low_open else 1)))
    if high is not None:
        parts.append(st.floats(min_value=high, exclude_min=not high_open, allow_nan=False, allow_infinity=False))
        parts.append(st.integers(min_value=math.floor(high) + (0 if high_open else 1)))
    return st.one_of(parts) if optional else st.one_of(*parts, st.none())


def good_number(low: float | None = None, high: float | None = None, *, low_open: bool = False,
                high_open: bool = False, optional: bool = False) -> st.SearchStrategy:
    floats = st.floats(min_value=low, max_value=high, exclude_min=low_open and low is not None,
                       exclude_max=high_open and high is not None, allow_nan=False, allow_infinity=False)
    return st.one_of(floats, st.none()) if optional else floats


def bad_choice(allowed: tuple, optional: bool = False) -> st.SearchStrategy:
    parts = [TEXT.filter(lambda s: s not in allowed), st.integers(), st.booleans()]
    return st.one_of(parts) if optional else st.one_of(*parts, st.none())


BAD_PREFIX = st.one_of(st.just(""), TEXT.map(lambda s: s + "/"), st.integers(), st.booleans(), st.none())
GOOD_PREFIX = st.text(min_size=1, max_size=6).filter(lambda s: not s.endswith("/"))
BAD_STR = st.one_of(st.just(""), st.integers(), st.booleans(), st.none(), LISTS)
GOOD_STR = st.text(min_size=1, max_size=6)
BAD_MODULE = st.one_of(st.integers(), st.floats(), st.booleans(), LISTS)  # None, str and modules are fine
GOOD_MODULE = st.one_of(st.none(), TEXT, st.just(nn.Linear(2, 2)))
BAD_CALLABLE = st.one_of(st.integers(), TEXT, st.booleans(), LISTS)  # None is allowed where these are used
GOOD_CALLABLE = st.one_of(st.none(), st.just(lambda batch: batch))
BAD_FORMAT = st.one_of(st.integers(), TEXT, st.booleans(), st.just({"ids_key": "input_ids"}))
BAD_COUNTS = st.one_of(st.integers(), TEXT, st.booleans(), LISTS)  # no snapshot() method
BAD_MASK = st.sampled_from([torch.zeros(4), torch.ones(2, 2, dtype=torch.bool), [True, False], 3])
GOOD_MASK = st.one_of(st.none(), st.integers(1, 5).map(lambda n: torch.ones(n, dtype=torch.bool)))
BAD_GROUPS = st.one_of(
    st.text(min_size=1, max_size=4), st.integers(),
    st.lists(st.lists(st.one_of(st.floats(), st.booleans(), st.none()), min_size=1, max_size=2), min_size=1, max_size=2),
    st.lists(st.integers(), min_size=1, max_size=2),  # ids not in groups
)
GOOD_GROUPS = st.one_of(st.none(), st.lists(st.lists(st.one_of(st.integers(0, 50), GOOD_STR), max_size=3), max_size=3))
BAD_THRESHOLD = st.one_of(
    TEXT, st.booleans(), NONFINITE, st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)),
    st.just({"severe": 1.0}), st.just({"warning": "1"}),
)


# ---------------------------------------------------------------------------- the contract
def expected_text(value: Any) -> str:
    """How the message shows ``value``: a tensor by dtype and shape, anything else by its repr."""
    if isinstance(value, torch.Tensor):
        kind = "nn.Parameter" if isinstance(value, nn.Parameter) else "tensor"
        return f"{str(value.dtype).replace('torch.', '')} {kind} of shape {tuple(value.shape)}"
    return repr(value)


def assert_refused(build: Callable[..., Any], name: str, value: Any) -> str:
    """``build(name=value)`` raises HeadwatchError naming the argument and showing the value; returns the message."""
    with pytest.raises(HeadwatchError) as info:
        build(**{name: value})
    message = str(info.value)
    assert f"`{name}`" in message, message
    assert expected_text(value) in message, message
    assert "must be" in message, message
    return message


def grad_density(**kwargs: Any) -> GradientDensity:
    return GradientDensity(**{"frequency": None, **kwargs})


# (door, build, argument, invalid values[, the name the message uses])
MODULE_ARGS = [("head", BAD_MODULE), ("logits_module", BAD_MODULE), ("hidden_module", BAD_MODULE)]
LOGIT_STATS = [
    *MODULE_ARGS,
    ("batch_format", BAD_FORMAT), ("log_histogram", bad_bool()), ("figure_every", bad_int(0)),
    ("max_chunk_bytes", bad_int(1)), ("prefix", BAD_PREFIX), ("strict", bad_bool()),
    ("alignment", bad_choice(ALIGNMENTS, optional=True)), ("path", bad_choice(PATHS)),
    ("vocab_size", bad_int(1, optional=True)), ("frequency", st.one_of(st.integers(), TEXT, st.just(object()))),
    ("ece_bins", bad_int(1, 2**22)),
]
GRADIENTS = [
    ("frequency", BAD_COUNTS), ("head", BAD_MODULE), ("embedding", BAD_MODULE), ("update_density", bad_bool()),
    ("log_histogram", bad_bool()), ("figure_every", bad_int(0)), ("prefix", BAD_PREFIX), ("strict", bad_bool()),
]
COLLISION = [
    ("frequency", BAD_COUNTS), ("tau", bad_number(-1, 1)), ("max_rare", bad_int(1, optional=True)), ("max_per_bucket", bad_int(1)),
    ("top_pairs", bad_int(1)), ("synonym_groups", BAD_GROUPS), ("head", BAD_MODULE), ("embedding", BAD_MODULE),
    ("seed", st.one_of(st.booleans(), st.floats(), TEXT, st.none())), ("max_chunk_bytes", bad_int(1)),
    ("figures", bad_bool()), ("on_epoch_end", bad_bool()), ("prefix", BAD_PREFIX), ("strict", bad_bool()),
    ("batch_format", BAD_FORMAT), ("k", bad_int(1, optional=True)), ("include_unseen", bad_bool()),
    ("every_n_steps", bad_int(1, optional=True)),
]
TOKENS = [
    ("vocab_size", bad_int(1, optional=True)), ("valid_token_mask", BAD_MASK), ("embedding", BAD_MODULE),
    ("rare_max_count", bad_int(1, optional=True)), ("rare_fraction", bad_number(0, 1, low_open=True)),
    ("prefix", BAD_PREFIX), ("batch_format", BAD_FORMAT),
]
BATCH = [
    ("ids_key", BAD_STR), ("labels_key", BAD_STR), ("mask_key", BAD_STR), ("shift_labels", bad_bool()),
    ("ignore_index", st.one_of(st.booleans(), st.floats(), TEXT, st.none())),
    ("ids_fn", BAD_CALLABLE), ("mask_fn", BAD_CALLABLE), ("targets_fn", BAD_CALLABLE),
]
RULES = [
    *[(rule, BAD_THRESHOLD) for rule in ("entropy_floor", "kl_ceiling", "entropy_drop", "entropy_ceiling", "rare_nll_rise")],
    ("entropy_drop", st.one_of(st.floats(max_value=0), st.floats(min_value=1, allow_infinity=False))),
    ("rare_nll_rise", st.floats(max_value=0)),
    ("window", bad_int(1)), ("rare_window", bad_int(1)), ("for_steps", bad_int(1)), ("warmup_steps", bad_int(0)),
    ("val_dataloader_idx", bad_int(0)), ("patience", bad_int(1, optional=True)),
    ("alpha", bad_number(0, 1, low_open=True)), ("margin", bad_number(0, 1, high_open=True)),
    ("delta", bad_number(0)), ("min_entropy_drop", bad_number(0)),
    *[(m, BAD_STR) for m in ("entropy_metric", "kl_metric", "val_metric", "val_entropy_metric", "rare_nll_metric", "nll_metric")],
]
RULES_OK = CollapseRules(entropy_floor=1.0)
ALERT_NAMES = {"alpha": "smoothing", "margin": "rearm_margin", "delta": "val_delta", "min_entropy_drop": "val_min_entropy_drop"}
"""CollapseRules fields that SharpnessCollapseAlert sets from an argument of another name."""
ENGINE = [
    ("rules", st.one_of(st.integers(), TEXT, st.none(), st.just({"entropy_floor": 1.0}))),
    ("actions", st.one_of(st.integers(), st.text(min_size=1, max_size=4), LISTS)),
    ("reduce_bool", st.one_of(BAD_CALLABLE, st.none())), ("main_process", bad_bool()), ("strict", bad_bool()),
    ("warn", BAD_CALLABLE), ("info", BAD_CALLABLE), ("name", BAD_STR),
]
URL = "http://127.0.0.1:9/hook"
WEBHOOK = [("timeout", bad_number(0, 2, low_open=True)), ("retries", bad_int(0, 5)), ("on_failure", BAD_CALLABLE)]
METRIC = [("ignore_index", st.one_of(st.booleans(), st.floats(), TEXT, st.none())), ("max_chunk_bytes", bad_int(1)),
          ("keep_entropies", bad_bool())]
CALIBRATION = [
    ("bucket_names", st.one_of(st.text(max_size=4), st.just(()), LISTS, st.just(["tail", 2]))), ("n_bins", bad_int(1, 2**22)),
    ("ignore_index", st.one_of(st.booleans(), st.floats(), TEXT, st.none())), ("max_chunk_bytes", bad_int(1)),
]
WARMUP = [("warmup_steps", bad_int(0)), ("head_lr", bad_number(0, low_open=True, optional=True)), ("untie", bad_bool())]
COST = [("vocab_size", bad_int(1)), ("d_model", bad_int(1)), ("params", bad_int(1, optional=True)),
        ("tied", st.one_of(st.integers(), TEXT, st.floats())), ("world_size", bad_int(1))]

CORE_CASES = [
    *[("LogitStats", LogitStats, a, s) for a, s in LOGIT_STATS],
    *[("GradientDensity", grad_density, a, s) for a, s in GRADIENTS],
    *[("SynonymCollision", SynonymCollision, a, s) for a, s in COLLISION],
    *[("TokenCounts", TokenCounts, a, s) for a, s in TOKENS],
    *[("BatchFormat", BatchFormat, a, s) for a, s in BATCH],
    ("Schedule", Schedule, "every", bad_int(0)),
    *[("LogitStatsMetric", LogitStatsMetric, a, s) for a, s in METRIC],
    *[("FrequencyCalibrationMetric", FrequencyCalibrationMetric, a, s) for a, s in CALIBRATION],
    *[("CollapseRules", CollapseRules, a, s) for a, s in RULES],
    *[("AlertEngine", functools.partial(AlertEngine, RULES_OK), a, s) for a, s in ENGINE if a != "rules"],
    ("AlertEngine", AlertEngine, "rules", ENGINE[0][1]),
    ("standard_actions", standard_actions, "prefix", BAD_PREFIX),
    ("standard_actions", standard_actions, "callables", st.one_of(st.integers(), LISTS)),
    ("standard_actions", standard_actions, "save_checkpoint", BAD_CALLABLE),
    *[("WebhookSender", functools.partial(WebhookSender, URL), a, s) for a, s in WEBHOOK],
    *[("HeadWarmupCore", lambda **kw: HeadWarmupCore(**{"warmup_steps": 1, **kw}), a, s) for a, s in WARMUP],
    *[("HeadWarmup", lambda **kw: HeadWarmup(**{"warmup_steps": 1, **kw}), a, s) for a, s in [*WARMUP, ("head", BAD_MODULE)]],
    *[("untie_cost", lambda **kw: untie_cost(**{"vocab_size": 8, "d_model": 4, **kw}), a, s) for a, s in COST],
]


@pytest.mark.parametrize(("door", "build", "name", "values"), CORE_CASES, ids=[f"{c[0]}-{c[2]}" for c in CORE_CASES])
@BAD
@given(data=st.data())
def test_the_core_refuses_invalid_arguments(door, build, name, values, data):
    message = assert_refused(build, name, data.draw(values, label=name))
    if door == "CollapseRules" and name in ALERT_NAMES:  # the field, and the Lightning alert's argument that sets it
        assert f"`{name}` (`{ALERT_NAMES[name]}`) must be" in message, message


# ---------------------------------------------------------------------------- valid values construct
VALID = {
    "LogitStats": (LogitStats, {
        "head": GOOD_MODULE, "logits_module": GOOD_MODULE, "hidden_module": GOOD_MODULE,
        "batch_format": st.one_of(st.none(), st.just(BatchFormat(shift_labels=False))), "log_histogram": st.booleans(),
        "figure_every": good_int(0), "max_chunk_bytes": good_int(1), "prefix": GOOD_PREFIX, "strict": st.booleans(),
        "alignment": st.one_of(st.none(), st.sampled_from(ALIGNMENTS)), "path": st.sampled_from(PATHS),
        "vocab_size": good_int(1, optional=True), "frequency": st.one_of(st.none(), st.builds(TokenCounts)),
    }),
    "GradientDensity": (grad_density, {
        "frequency": st.one_of(st.none(), st.builds(TokenCounts)), "head": GOOD_MODULE, "embedding": GOOD_MODULE,
        "update_density": st.booleans(), "log_histogram": st.booleans(), "figure_every": good_int(0),
        "prefix": GOOD_PREFIX, "strict": st.booleans(),
    }),
    "SynonymCollision": (SynonymCollision, {
        "frequency": st.one_of(st.none(), st.builds(TokenCounts)), "tau": st.one_of(good_number(-1, 1), st.integers(-1, 1)),
        "max_rare": good_int(1, optional=True), "max_per_bucket": good_int(1), "top_pairs": good_int(1), "synonym_groups": GOOD_GROUPS,
        "head": GOOD_MODULE, "embedding": GOOD_MODULE, "seed": good_int(), "max_chunk_bytes": good_int(1),
        "figures": st.booleans(), "on_epoch_end": st.booleans(), "prefix": GOOD_PREFIX, "strict": st.booleans(),
        "k": good_int(1, optional=True), "include_unseen": st.booleans(), "every_n_steps": good_int(1, optional=True),
    }),
    "TokenCounts": (TokenCounts, {
        "vocab_size": good_int(1, optional=True), "valid_token_mask": GOOD_MASK, "embedding": GOOD_MODULE,
        "rare_max_count": good_int(1, optional=True), "rare_fraction": good_number(0, 1, low_open=True),
        "prefix": GOOD_PREFIX,
    }),
    "BatchFormat": (BatchFormat, {
        "ids_key": GOOD_STR, "labels_key": GOOD_STR, "mask_key": GOOD_STR, "shift_labels": st.booleans(),
        "ignore_index": good_int(), "ids_fn": GOOD_CALLABLE, "mask_fn": GOOD_CALLABLE, "targets_fn": GOOD_CALLABLE,
    }),
    "Schedule": (lambda **kw: Schedule(**{"every": 1, **kw}), {"every": good_int(0)}),
    "CollapseRules": (CollapseRules, {
        "entropy_floor": st.one_of(st.none(), good_number()), "kl_ceiling": st.one_of(st.none(), good_number()),
        "entropy_drop": st.one_of(st.none(), good_number(0, 1, low_open=True, high_open=True)),
        "rare_nll_rise": st.one_of(st.none(), good_number(0, low_open=True)),
        "window": good_int(1), "rare_window": good_int(1), "for_steps": good_int(1), "warmup_steps": good_int(0),
        "val_dataloader_idx": good_int(0), "patience": good_int(1, optional=True),
        "alpha": good_number(0, 1, low_open=True), "margin": good_number(0, 1, high_open=True),
        "delta": good_number(0), "min_entropy_drop": good_number(0), "val_metric": GOOD_STR,
    }),
    "AlertEngine": (functools.partial(AlertEngine, RULES_OK), {
        "actions": st.lists(st.just(print), max_size=2), "reduce_bool": st.just(lambda fired: fired),
        "main_process": st.booleans(), "strict": st.booleans(), "warn": st.one_of(st.none(), st.just(print)),
        "name": GOOD_STR,
    }),
    "WebhookSender": (functools.partial(WebhookSender, URL), {
        "timeout": good_number(0, 2, low_open=True), "retries": good_int(0, 5), "on_failure": GOOD_CALLABLE,
    }),
    "HeadWarmupCore": (lambda **kw: HeadWarmupCore(**{"warmup_steps": 1, **kw}), {"warmup_steps": good_int(0), "head_lr": good_number(0, low_open=True, optional=True)}),
    "LogitStatsMetric": (LogitStatsMetric, {"ignore_index": good_int(), "max_chunk_bytes": good_int(1),
                                            "keep_entropies": st.booleans()}),
}


@pytest.mark.parametrize("door", sorted(VALID))
@GOOD
@given(data=st.data())
def test_valid_arguments_construct(door, data):
    build, strategies = VALID[door]
    kwargs = data.draw(st.fixed_dictionaries({}, optional=strategies), label="kwargs")
    build(**kwargs)


# ---------------------------------------------------------------------------- the doors pass the same checks on
LIGHTNING = [
    *[("LogitStatsMonitor", a, s) for a, s in LOGIT_STATS if a not in ("figure_every", "frequency")],
    *[("LogitStatsMonitor", a, s) for a, s in BATCH if a in ("shift_labels", "ignore_index", "mask_fn", "targets_fn")],
    ("LogitStatsMonitor", "validation", bad_bool()), ("LogitStatsMonitor", "log_every_n_steps", bad_int(1, optional=True)),
    *[("GradientDensityMonitor", a, s) for a, s in GRADIENTS if a not in ("figure_every", "frequency")],
    ("GradientDensityMonitor", "log_every_n_steps", bad_int(1, optional=True)),
    *[("SynonymCollisionMonitor", a, s) for a, s in COLLISION if a not in ("figures", "frequency")],
    ("SynonymCollisionMonitor", "figures", st.one_of(st.integers(), TEXT.filter(lambda s: s != "auto"), st.none())),
    ("SynonymCollisionMonitor", "every_n_steps", bad_int(1, optional=True)),
    *[("TokenFrequency", a, s) for a, s in TOKENS],
    ("TokenFrequency", "ids_fn", BAD_CALLABLE), ("TokenFrequency", "log_every_n_steps", bad_int(1, optional=True)),
    *[("SharpnessCollapseAlert", ALERT_NAMES.get(a, a), s) for a, s in RULES],
    ("SharpnessCollapseAlert", "prefix", BAD_PREFIX), ("SharpnessCollapseAlert", "strict", bad_bool()),
]


@pytest.mark.parametrize(("door", "name", "values"), LIGHTNING, ids=[f"{c[0]}-{c[1]}" for c in LIGHTNING])
@DOOR
@given(data=st.data())
def test_the_lightning_adapters_refuse_the_same_values(door, name, values, data):
    value = data.draw(values, label=name)
    assert_refused(getattr(headwatch, door), name, value)


MODEL = TinyCausalLM()
PASSED_THROUGH = [("prefix", BAD_PREFIX), ("batch_format", BAD_FORMAT)]


@pytest.mark.parametrize(("name", "values"), PASSED_THROUGH, ids=[c[0] for c in PASSED_THROUGH])
@DOOR
@given(data=st.data())
def test_the_plain_loop_refuses_the_same_values(name, values, data):
    value = data.draw(values, label=name)
    assert_refused(lambda **kw: headwatch.Headwatch(MODEL, **kw), name, value)


@pytest.mark.parametrize(("name", "values"), PASSED_THROUGH, ids=[c[0] for c in PASSED_THROUGH])
@DOOR
@given(data=st.data())
def test_the_hugging_face_callback_refuses_the_same_values(name, values, data):
    transformers_door = pytest.importorskip("headwatch.integrations.transformers")
    value = data.draw(values, label=name)
    assert_refused(transformers_door.HeadwatchCallback, name, value)


# ---------------------------------------------------------------------------- remedies that take a model
@pytest.mark.parametrize(
    ("build", "name", "values"),
    [
        (untie_output_head, "model", st.one_of(st.integers(), TEXT, st.none())),
        (lambda **kw: untie_output_head(TinyCausalLM(tie_weights=True), **kw), "init", bad_choice(("copy", "normal"))),
        (lambda **kw: untie_output_head(TinyCausalLM(tie_weights=True), **kw), "std", bad_number(0, low_open=True, optional=True)),
        (lambda **kw: untie_output_head(TinyCausalLM(tie_weights=True), **kw), "head", BAD_MODULE),
        (lambda **kw: install_tied_projection(TinyCausalLM(tie_weights=True), **kw), "embedding", BAD_MODULE),
        (lambda **kw: TiedOutputProjection(**{"weight": nn.Parameter(torch.zeros(4, 2)), **kw}), "weight",
         st.sampled_from([nn.Parameter(torch.zeros(4)), torch.zeros(4, 2), 3, "w"])),
        (lambda **kw: TiedOutputProjection(nn.Parameter(torch.zeros(4, 2)), **kw), "bias",
         st.sampled_from([3, "b", torch.zeros(4, 1)])),
    ],
    ids=["untie-model", "untie-init", "untie-std", "untie-head", "projection-embedding", "projection-weight", "projection-bias"],
)
@BAD
@given(data=st.data())
def test_the_remedies_refuse_invalid_arguments(build, name, values, data):
    assert_refused(build, name, data.draw(values, label=name))


# ---------------------------------------------------------------------------- the check functions themselves
def test_a_webhook_url_that_is_not_a_string_is_refused_without_echo():
    with pytest.raises(HeadwatchError, match="webhook URL must be a str, got a bytes") as info:
        WebhookSender(b"https://host/SECRET")  # type: ignore[arg-type]
    assert "SECRET" not in str(info.value)


def test_messages_say_none_is_allowed_and_cut_long_values():
    with pytest.raises(HeadwatchError, match=r"^`k` must be None or an int >= 1, got 0$"):
        check_optional(check_int, "k", 0, minimum=1)
    with pytest.raises(HeadwatchError, match=r"^`tau` must be a number in \[-1, 1\], got 5.0$"):
        check_range("tau", 5.0, -1, 1)
    with pytest.raises(HeadwatchError, match=r"^`x` must be a finite number > 0, got nan$"):
        check_range("x", math.nan, 0, low_open=True)
    with pytest.raises(HeadwatchError) as info:
        check_int("n", "x" * 1000)
    assert len(str(info.value)) < 250 and str(info.value).endswith("...")


def test_a_generator_is_read_once_and_shown_as_read():
    assert check_sequence("g", (n for n in (1, 2)), "ints", lambda v: isinstance(v, int)) == [1, 2]
    with pytest.raises(HeadwatchError, match=r"`g` must be a sequence of ints, got \[1, 'a'\]"):
        check_sequence("g", (n for n in (1, "a")), "ints", lambda v: isinstance(v, int))


def test_the_lightning_adapters_keep_their_own_checks_and_the_core_the_rest():
    """Each check is written once: the adapters check only the arguments the core does not have."""
    import inspect

    from headwatch.integrations.lightning import collision, frequency, gradient_density, logit_stats

    for module in (logit_stats, gradient_density, collision, frequency):
        source = inspect.getsource(module)
        for core_check in ("check_module_or_name", "check_positive_int", "check_prefix"):
            assert core_check not in source, (module.__name__, core_check)
