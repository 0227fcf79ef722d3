"""After ``compute``: the one host transfer of a logging step, and the :class:`Sink` protocol every output follows.

Everything a run publishes goes through the orchestrator's sinks, on every door: TensorBoard writers, the
trainer's own logging (``Trainer.log``, Lightning's loggers and ``pl_module.log``), the alert engine and the
end-of-training summary. A sink only listens: it receives the numbers already moved to the host, on every
rank, and writes what its rank writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from headwatch.core.monitor import Media


@runtime_checkable
class Sink(Protocol):
    """Where a run's values go: :meth:`publish` is called on every rank after the one host transfer.

    It is called once per logging step of the run (the door's logging interval) and once per evaluation,
    also when no monitor had a value for it (``numbers`` empty: a monitor failed everywhere, or the run has
    no monitor due then), so that a sink that takes a decision across processes (the alert engine) is called
    on every rank on the same steps. A sink that writes skips an empty publication.

    ``numbers``: full names -> floats (the same keys on every rank); ``media``: the monitors' histograms
    (on the host), texts and figures (rank zero's); ``step``: the door's x axis; ``val``: the values of an
    evaluation. A sink writes what its rank writes (media on rank zero) and flushes its writers once.

    A sink that fails is warned about once and the run goes on; a sink whose ``strict`` attribute is True
    raises instead (as does any sink of a run made with ``strict=True``).

    Optional methods, called when present: ``end(step)`` once when training ends (the door's end event:
    ``on_train_end``, Lightning's ``on_fit_end``, the plain loop's ``close()``); ``close()`` when the run's
    objects are released (after ``end``).
    """

    def publish(self, numbers: dict[str, float], media: list[Media], step: int, val: bool) -> None: ...


def to_host(scalars: dict[str, Tensor | float], media: Sequence[Media] = ()) -> dict[str, float]:
    """Scalars as Python floats and every histogram of ``media`` on the host, in ONE device-to-host transfer.

    The scalars are stacked (float64) and concatenated with the flattened histogram values; the
    one ``.cpu()`` of that buffer is the logging step's host-device sync. Histograms are replaced
    in place by float64 CPU tensors of their original shape, the ``host`` tensors (read by the
    monitors' ``published``) by CPU tensors of their original shape and dtype.
    """
    hist = [(m.histograms, tag, v, False) for m in media for tag, v in m.histograms.items() if isinstance(v, Tensor)]
    hist += [(m.host, tag, v, True) for m in media for tag, v in m.host.items() if isinstance(v, Tensor)]
    on_device = [k for k, v in scalars.items() if isinstance(v, Tensor)]
    numbers = {k: float(v) for k, v in scalars.items() if not isinstance(v, Tensor)}  # Python numbers: no transfer
    tensors = [scalars[k] for k in on_device] + [v for _, _, v, _ in hist]
    if tensors:
        devices = [t.device for t in tensors if t.device.type != "cpu"]
        device = devices[0] if devices else torch.device("cpu")
        parts = [scalars[k].detach().to(device=device, dtype=torch.float64).reshape(1) for k in on_device]
        parts += [v.detach().to(device=device, dtype=torch.float64).reshape(-1) for _, _, v, _ in hist]
        flat = torch.cat(parts).cpu()  # the one host transfer
        numbers.update(zip(on_device, flat[: len(on_device)].tolist()))
        offset = len(on_device)
        for where, tag, v, own_dtype in hist:  # histograms float64; `host` tensors their own dtype (ids < 2**53 exact)
            moved = flat[offset : offset + v.numel()].reshape(v.shape)
            where[tag] = moved.to(v.dtype) if own_dtype else moved
            offset += v.numel()
    numbers = {k: numbers[k] for k in scalars}  # the scalars' order
    return numbers


def named_evaluation(numbers: dict[str, float], media: Sequence[Media], name: str | None, prefix: str) -> dict[str, float]:
    """The values of an evaluation the trainer names ``name`` (None: its default one): every validation name
    under ``<prefix>/val/`` gets the suffix ``/<name>``, media tags too (in place). Other names are kept."""
    if name is None:
        return numbers
    val = f"{prefix}/val/"
    for m in media:
        m.histograms = {(f"{k}/{name}" if k.startswith(val) else k): v for k, v in m.histograms.items()}
    return {(f"{k}/{name}" if k.startswith(val) else k): v for k, v in numbers.items()}


def withhold(numbers: dict[str, float], parts: Sequence[Any], check_prefix: str) -> dict[str, float]:
    """``numbers`` without the figures withheld on this step (the key-set rule, ``docs/distributed.md``): each of
    ``parts`` (the published monitors and the self-check of the split) names them in ``withheld(numbers)`` from
    values already reduced over processes, so every rank withholds the same ones. With the self-check's values
    (under ``check_prefix``: ``<prefix>`` in training, ``<prefix>/val`` in evaluation), their count is published as
    ``<check_prefix>/check/withheld``. A part that fails follows its failure policy (``fail``)."""
    withheld: dict[str, str] = {}
    for part in parts:
        try:
            withheld.update(part.withheld(numbers))
        except Exception as err:  # a monitoring failure never stops training
            if getattr(err, "strict", False) is True:  # a misconfigured run (the processes disagree): raised on purpose
                raise
            part.fail(err, "deciding which figures to withhold")
    kept = {k: v for k, v in numbers.items() if k not in withheld}
    if f"{check_prefix}/debug/capture/positions" in numbers:
        kept[f"{check_prefix}/check/withheld"] = float(sum(k in numbers for k in withheld))
    return kept
