"""The end-of-training summary: a :class:`~headwatch.core.publish.Sink` that keeps each value's first and last
published figure and, when training ends, says in a few lines what the run showed, each figure beside its
reference (log V for the entropy, the vocabulary seen for the row densities, the raw-cosine drift for the
collision rate, the tolerance for the self-check's gap).

Every door adds one to its run (``summary=False`` leaves it out); its text is printed on rank zero and kept in
:attr:`SummarySink.text`, its figures in :attr:`SummarySink.figures`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


class SummarySink:
    """Keep the first and last training figure of every published value; at :meth:`end`, one summary.

    Args:
        prefix: the run's metric prefix.
        rank: returns this process's rank (the summary is said on rank zero).
        alerts: returns the alerts raised so far (objects with ``step``, ``rule``, ``severity``), or None.
        out: how the summary is said (default ``print``).
    """

    def __init__(self, prefix: str = "headwatch", rank: Callable[[], int] = lambda: 0,
                 alerts: Callable[[], Sequence[Any] | None] | None = None, out: Callable[[str], Any] | None = None) -> None:  # fmt: skip
        self.prefix, self.rank, self.alerts, self.out = prefix, rank, alerts, out or print
        self.first: dict[str, tuple[int, float]] = {}
        self.last: dict[str, tuple[int, float]] = {}
        self.val_last: dict[str, tuple[int, float]] = {}
        self.text: str | None = None
        """The last summary said (None before :meth:`end`)."""
        self.figures: dict[str, Any] = {}
        """The summary's figures by short name (``entropy_first``, ``entropy_last``, ``log_v``, ...)."""
        self.budget: float | None = None
        """The run's overhead budget (set by the door), shown beside ``overhead/fraction_run``."""

    def reset(self) -> None:
        """A new run with the same door: forget the figures."""
        self.first, self.last, self.val_last, self.text, self.figures = {}, {}, {}, None, {}

    def sink_state(self) -> dict[str, Any]:
        """The figures kept so far (saved with the run's state, so that a resumed run's summary starts at the
        first step of the whole run, not of the resume)."""
        return {"version": 1, "first": dict(self.first), "last": dict(self.last), "val_last": dict(self.val_last)}

    def load_sink_state(self, state: Any) -> str | None:
        """Take the figures of :meth:`sink_state`; returns the problem (and keeps nothing) when ``state`` is not one."""
        parts = ("first", "last", "val_last")
        if not isinstance(state, dict) or not all(isinstance(state.get(p), dict) for p in parts):
            return f"the summary's state must be a dict of {', '.join(parts)}, got {type(state).__name__}"
        kept = {}
        for part in parts:
            kept[part] = {}
            for name, pair in state[part].items():
                if not (isinstance(name, str) and isinstance(pair, (tuple, list)) and len(pair) == 2
                        and isinstance(pair[0], int) and not isinstance(pair[0], bool) and _finite(pair[1])):
                    return f"the summary's state holds an invalid {part} entry {name!r}: {pair!r}; it starts from empty"
                kept[part][name] = (pair[0], float(pair[1]))
        self.first, self.last, self.val_last = kept["first"], kept["last"], kept["val_last"]
        return None

    def publish(self, numbers: dict[str, float], media: Any, step: int, val: bool) -> None:
        kept = self.val_last if val else self.last
        for name, value in numbers.items():
            if _finite(value):
                if not val:
                    self.first.setdefault(name, (step, float(value)))
                kept[name] = (step, float(value))

    def _get(self, name: str, where: dict[str, tuple[int, float]] | None = None) -> float | None:
        found = (self.last if where is None else where).get(f"{self.prefix}/{name}")
        return found[1] if found is not None else None

    def end(self, step: int) -> None:
        """Training ended at ``step``: build the summary and say it on rank zero."""
        lines, figures = summary_lines(self, step)
        self.figures, self.text = figures, "\n".join(lines)
        if self.rank() == 0 and len(lines) > 1:
            self.out(self.text)


def _latest_gradients(s: SummarySink) -> Callable[[str], float | None]:
    """``s._get`` where a ``grad/`` value counts only when published on the last step that published gradient
    values (after an untie, the shared matrix's and the tied flows' values stop: their last ones are stale)."""
    marker = f"{s.prefix}/grad/"
    steps = [step for name, (step, _) in s.last.items() if name.startswith(marker)]
    latest = max(steps) if steps else None

    def get(name: str) -> float | None:
        found = s.last.get(f"{s.prefix}/{name}")
        if found is None or (name.startswith("grad/") and found[0] != latest):
            return None
        return found[1]

    return get


def summary_lines(s: SummarySink, step: int) -> tuple[list[str], dict[str, Any]]:
    """The summary's lines and figures (see :class:`SummarySink`)."""
    g = s._get
    fig: dict[str, Any] = {}
    lines = [f"headwatch: training ended at step {step}"]
    h_first, h_last, kl = s.first.get(f"{s.prefix}/logits/entropy"), g("logits/entropy"), g("logits/kl_to_uniform")
    if h_first is not None and h_last is not None:
        log_v = h_last + kl if kl is not None else None
        fig.update(entropy_first=h_first[1], entropy_last=h_last, log_v=log_v)
        ref = f" of log V = {log_v:.3g} (0: one token, log V: uniform)" if log_v is not None else ""
        fall = (h_first[1] - h_last) / h_first[1] if h_first[1] > 0 else float("nan")
        moved = f"fell {fall:.0%}" if not fall < 0 else f"rose {-fall:.0%}"
        lines.append(f"  entropy          {h_first[1]:.3g} -> {h_last:.3g} nats{ref}; {moved} since step {h_first[0]}")
    nll = g("logits/target_nll")
    # the self-check's figures of the NLL's own step: a later step's non-finite loss publishes none, and an earlier
    # step's are not those of the same tokens
    at = s.last.get(f"{s.prefix}/logits/target_nll", (None, None))[0]
    def of_at(name: str) -> float | None:
        return g(name) if s.last.get(f"{s.prefix}/{name}", (None,))[0] == at else None

    ref_nll, gap = of_at("debug/check/reference_nll"), of_at("check/nll_gap")
    if nll is not None:
        fig["target_nll"] = nll
        if ref_nll is not None and gap is not None:
            # the self-check's own verdict: its tolerance follows the dtype the loss scored (docs/self_check.md)
            verdict = "BEYOND" if (of_at("check/mismatch") or 0.0) > 0 else "within"  # a later step's is not this one's
            fig.update(reference_nll=ref_nll, nll_gap=gap)
            temperature = g("rl/temperature")
            if temperature is not None:  # an RL run: the labels are the sampled tokens, the reference not the loss
                lines.append(f"  sampled NLL      {nll:.4g} nats at the last logging step, of the sampled tokens at T = "
                             f"{temperature:.3g} (not a label NLL, not the RL loss); the trainer's NLL of the same tokens "
                             f"{ref_nll:.4g} (gap {gap:.2g}, {verdict} the self-check's tolerance)")
            else:
                lines.append(f"  target NLL       {nll:.4g} nats at the last logging step; the loss computed on it "
                             f"{ref_nll:.4g} (gap {gap:.2g}, {verdict} the self-check's tolerance)")
        else:
            failed = s.last.get(f"{s.prefix}/check/mismatch")
            if failed is not None and failed[1] > 0 and failed[0] > at:  # a failed check withholds its step's logits/*
                lines.append(f"  target NLL       {nll:.4g} nats at step {at}; the self-check failed at step {failed[0]}, "
                             f"beyond its tolerance (that step's logits/* withheld)")
            elif f"{s.prefix}/debug/check/reference_nll" in s.last:
                lines.append(f"  target NLL       {nll:.4g} nats (no trainer loss of that step to compare)")
            else:
                lines.append(f"  target NLL       {nll:.4g} nats (no trainer loss to compare)")
    val_nll = g("val/logits/target_nll", s.val_last)
    if val_nll is not None:
        fig["val_target_nll"] = val_nll
        lines.append(f"  validation NLL   {val_nll:.4g} nats")
    seen = g("tokens/seen_fraction")
    g = _latest_gradients(s)  # a value of a matrix the run no longer has (untied since) is not its last word
    densities = [(name, g(f"grad/{name}_row_density")) for name in ("embedding", "head", "shared")]
    densities = [(n, d) for n, d in densities if d is not None]
    if densities:
        fig.update({f"{n}_row_density": d for n, d in densities})
        parts = ", ".join(f"{n} {d:.3g}" for n, d in densities)
        ref = f" (the run has seen {seen:.3g} of the vocabulary)" if seen is not None else ""
        lines.append(f"  rows with grad   {parts} of the valid rows{ref}")
    conflict, cosine = g("grad/tied_flow_conflict_fraction"), g("grad/tied_flow_cosine_mean")
    if conflict is not None:
        fig["tied_flow_conflict_fraction"] = conflict
        extra = f", flow cosine mean {cosine:.3g}" if cosine is not None else ""
        lines.append(f"  tied flows       {conflict:.3g} of the rows pulled both ways (lookup against scoring){extra}")
    rate, raw = g("collision/rare_rate_head"), g("collision/drift/raw_rate_head")
    if rate is not None:
        fig["collision_rate_head"] = rate
        ref = f"; {raw:.3g} before the rows' common drift is removed" if raw is not None else ""
        lines.append(f"  collision        {rate:.3g} of rare head rows near-duplicate beyond drift{ref}")
    spent, interval, probes = g("overhead/fraction_run"), g("overhead/probe_interval"), g("overhead/probe_fraction_run")
    if spent is not None:
        fig["overhead_fraction_run"] = spent
        budget = f" (budget {s.budget:.2%})" if getattr(s, "budget", None) is not None else ""
        # the probes' share is of the wall time too: a part of `spent`, said in points so that it reads as one
        share = f", {100 * probes:.2f} points of it the probes (the first, the periodic, the end)" if probes is not None else ""
        every = f"; periodic probes every {interval:.0f} steps" if interval is not None else ""
        if interval is not None and interval > step + 1:  # the interval of a short run: longer than the run itself
            every = f"; no periodic probe (their interval, {interval:.0f} steps, is longer than the run)"
        lines.append(f"  overhead         {spent:.2%} of the wall time over the run{budget}{share}{every}")
    alerts = s.alerts() if s.alerts is not None else None
    if alerts is not None:
        fig["alerts"] = len(alerts)
        shown = ", ".join(f"{a.rule} ({a.severity}) at {a.step}" for a in list(alerts)[:4])
        more = f" and {len(alerts) - 4} more" if len(alerts) > 4 else ""
        lines.append(f"  alerts           {len(alerts)} fired" + (f": {shown}{more}" if alerts else ""))
    return lines, fig
