"""Every public constructor, fed invalid values one argument at a time (hypothesis): it accepts the value or raises
HeadwatchError, never a bare TypeError, ValueError or anything else; a number argument refuses a string and NaN.

The classes are enumerated from ``__all__`` of ``headwatch`` and its subpackages; those a user configures are
built here (with the fewest valid arguments each needs), the others are records headwatch returns (listed in
``RECORDS``, which the enumeration test keeps complete).
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import pkgutil
import tempfile
import typing
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headwatch
from headwatch import HeadwatchError
from tests.helpers import TinyCausalLM

_DIR = tempfile.mkdtemp(prefix="headwatch-constructors-")


def _model() -> TinyCausalLM:
    return TinyCausalLM(vocab_size=16, d_model=8, tie_weights=True)


def _writer():
    from headwatch.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=os.path.join(_DIR, "w"))


def _rules():
    from headwatch.alerts import CollapseRules

    return CollapseRules(entropy_floor=1.0)


class _Sink:
    def scalar(self, tag, value, step):
        pass

    def text(self, tag, text, step):
        pass


# class name -> the fewest valid arguments (built afresh for each call)
REQUIRED = {
    "Headwatch": lambda: {"model": _model()},
    "AlertEngine": lambda: {"rules": _rules()},
    "JsonlLog": lambda: {"path": os.path.join(_DIR, "a.jsonl")},
    "OnCritical": lambda: {"name": "n", "fn": print},
    "CheckpointOnCritical": lambda: {"save": print},
    "SinkMarker": lambda: {"sink": _Sink()},
    "SummaryWriterSink": lambda: {"writer": _writer()},
    "WebhookSender": lambda: {"url": "http://127.0.0.1:9/hook"},
    "GradientDensity": lambda: {"frequency": __import__("headwatch.core", fromlist=["TokenCounts"]).TokenCounts()},
    "Schedule": lambda: {"every": 1},
    "HeadWarmup": lambda: {"warmup_steps": 2},
    "HeadWarmupCore": lambda: {"warmup_steps": 2},
    "TiedOutputProjection": lambda: {"weight": torch.nn.Parameter(torch.randn(16, 8))},
    "GuardedFileWriter": lambda: {"inner": _writer().file_writer},
    "MarkerSink": lambda: {"writers": list},
    "WriterSink": lambda: {"writers": list},
    "SummaryWriter": lambda: {"log_dir": os.path.join(_DIR, "s")},
    "TensorBoardLogger": lambda: {"save_dir": _DIR},
}
BUILT = [
    "BatchFormat", "GradientDensityMonitor", "Headwatch", "LogitStatsMetric", "LogitStatsMonitor", "SharpnessCollapseAlert",
    "SynonymCollisionMonitor", "TensorBoardLogger", "TokenFrequency", "AlertEngine", "CollapseRules", "JsonlLog",
    "OnCritical", "SinkMarker", "SummaryWriterSink", "WebhookSender", "GradientDensity", "LogitStats", "Schedule",
    "SynonymCollision", "TokenCounts", "TorchDistributedReducer", "HeadWarmup", "HeadWarmupCore", "TiedOutputProjection",
    "GuardedFileWriter", "MarkerSink", "SummaryWriter", "WriterSink", "ConsoleWarning", "CheckpointOnCritical",
]  # fmt: skip
RECORDS = {
    "Alert", "AlertEvent", "AlertSink", "BatchView", "Media", "Monitor", "NoReducer", "Reducer", "FrequencySnapshot",
    "LogitStatSums", "LogitStatistics", "Neighbours", "Summary", "CalibrationSums", "CorrectedCollision",
    "DriftCorrection", "Pairable", "FixedCollision", "UntieReport", "AlertRecord", "Comparison", "Difference",
    "GroupStats", "Headline", "MetricComparison", "RunData", "RunDir",
}  # fmt: skip
"""Records headwatch returns (results, events, report rows), protocols and base classes: not configured by users."""


def public_classes() -> dict[str, type]:
    found: dict[str, type] = {}
    names = ["headwatch"] + [f"headwatch.{m.name}" for m in pkgutil.iter_modules(headwatch.__path__) if m.ispkg]
    for module_name in names:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            if inspect.isclass(obj) and not issubclass(obj, BaseException):
                found.setdefault(name, obj)
    return found


CLASSES = public_classes()


def test_every_public_class_is_built_here_or_is_a_record():
    assert set(CLASSES) == set(BUILT) | RECORDS, (set(CLASSES) ^ (set(BUILT) | RECORDS))


def _parameters(cls: type) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(cls).parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _numeric(cls: type, name: str) -> bool:
    """Whether ``name`` is annotated as a number only (int or float, or None)."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - an annotation that cannot be resolved: no claim made
        return False
    args = set(typing.get_args(hints.get(name))) or {hints.get(name)}
    return bool(args) and args <= {int, float, type(None)} and args & {int, float} != set()


INVALID = st.one_of(
    st.text(max_size=4),
    st.sampled_from([math.nan, math.inf, -math.inf, -1, 0, -(2**63), 2**63, 2**80, 1e300, -0.5, True, False, None]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.builds(object),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.tuples(st.floats(), st.floats()),
)


@pytest.mark.parametrize("name", BUILT)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_an_invalid_argument_is_accepted_or_refused_with_a_headwatch_error(name, data):
    cls = CLASSES[name]
    params = _parameters(cls)
    param = data.draw(st.sampled_from(params), label="argument")
    value = data.draw(INVALID, label="value")
    kwargs = REQUIRED.get(name, dict)()
    kwargs[param.name] = value
    cwd = os.getcwd()
    os.chdir(_DIR)  # a string drawn for a folder argument makes that folder here
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cls(**kwargs)
    except HeadwatchError:
        return
    except Exception as err:  # noqa: BLE001 - the property under test
        pytest.fail(f"{name}({param.name}={value!r}) raised a bare {type(err).__name__}: {err}")
    finally:
        os.chdir(cwd)
    bad_number = isinstance(value, str) or (isinstance(value, float) and math.isnan(value))
    assert not (bad_number and _numeric(cls, param.name)), f"{name}({param.name}={value!r}) was accepted"
