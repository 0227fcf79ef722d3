"""Pictures for TensorBoard's IMAGES tab. matplotlib is optional: ``pip install "headwatch[figures]"``.

Figures are ``matplotlib.figure.Figure`` objects built without pyplot (no global backend,
no GUI), so they are safe in training processes.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch
from torch import Tensor

from headwatch.errors import HeadwatchError

INSTALL_HINT = 'matplotlib is needed for headwatch figures: pip install "headwatch[figures]" (or pip install matplotlib)'


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def resolve_figure_interval(value: int | str | None, log_every: int, name: str = "figure_every_n_steps") -> int:
    """Steps between figures: ``"auto"`` is ten logging intervals when matplotlib is installed, else 0 (off).

    Raises:
        HeadwatchError: an explicit interval without matplotlib (with the install hint), or a bad value.
    """
    if value is None or value == 0:
        return 0
    if value == "auto":
        return 10 * log_every if matplotlib_available() and log_every > 0 else 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise HeadwatchError(f"`{name}` must be 'auto', None, or an int >= 0, got {value!r}")
    if not matplotlib_available():
        raise HeadwatchError(INSTALL_HINT)
    return value


def check_figure_argument(value: Any, name: str = "figure_every_n_steps") -> None:
    if value not in (None, "auto") and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise HeadwatchError(f"`{name}` must be 'auto', None, or an int >= 0, got {value!r}")
    if isinstance(value, int) and value > 0 and not matplotlib_available():
        raise HeadwatchError(INSTALL_HINT)


def _figure(width: float = 6.4, height: float = 4.2, layout: str | None = "constrained") -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout=layout)


def _title(fig: Any, ax: Any, text: str, fontsize: float = 10.0) -> int:
    """Set ``text`` as the axes' title, wrapped at spaces to fit the figure's width; returns its line count.

    (A constrained layout makes room for a title's height, never for its width: a long title was cut at both
    edges of the image.) The width in characters is the figure's width over 0.6 em, the mean width of a
    DejaVu Sans character being about 0.55 em."""
    import textwrap

    chars = max(20, int(fig.get_figwidth() * 72 * 0.95 / (0.6 * fontsize)))
    lines = textwrap.wrap(text, chars) or [""]
    ax.set_title("\n".join(lines), fontsize=fontsize)
    return len(lines)


def norm_vs_frequency_rank(counts: Tensor, valid: Tensor, norms: dict[str, Tensor], title: str) -> Any:
    """Per-row norm against frequency rank (1 = most frequent), log-log, one series per matrix (linear axes and a
    note when no seen row has a positive norm).

    Args:
        counts: ``(V,)`` token counts; valid: ``(V,)`` bool; norms: name -> ``(V,)`` row norms.
    """
    fig = _figure(layout=None)  # fixed margins: the constrained layout of log axes costs more than the plot
    ax = fig.add_subplot()
    lines = _title(fig, ax, title)
    fig.subplots_adjust(left=0.11, right=0.97, bottom=0.12, top=0.96 - 0.045 * lines)
    c = counts.detach().double().cpu()
    ok = valid.detach().cpu() & (c > 0)
    order = torch.argsort(-c.masked_fill(~ok, -1.0), stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(1, c.numel() + 1))
    plotted = 0
    for (name, values), marker in zip(norms.items(), ("o", "s", "^", "x")):
        v = values.detach().double().cpu()
        sel = ok & (v > 0)
        plotted += int(sel.sum())
        label = f"{name} ({int(sel.sum())} rows)"  # markers of one line: drawn in one pass, faster than scatter
        ax.plot(rank[sel].numpy(), v[sel].numpy(), linestyle="none", marker=marker, markersize=2, alpha=0.5, label=label)
    if plotted:
        ax.set_xscale("log")
        ax.set_yscale("log")
    else:  # a zero gradient (GRPO with equal rewards in every group): no point, and log axes would not draw
        ax.text(0.5, 0.5, "no seen row with a norm above 0 at this step", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("token frequency rank (1 = most frequent; seen tokens)")
    ax.set_ylabel("row L2 norm")
    ax.legend(loc="best", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return fig


def entropy_over_run(steps: list[int], histograms: list[Tensor], max_entropy: float) -> Any:
    """Heat map of the per-position entropy distribution at each logging step (each column sums to 1).

    The colour is the fraction of the step's positions in each entropy bin on a logarithmic scale from the
    smallest non-zero fraction of the run to the largest, so the run's whole range shows (on a linear scale
    the first steps, every position near ``log V``, took the top colour and the rest of the run was dark);
    a bin with no position is white.

    Args:
        steps: the logging steps, increasing; histograms: one ``(bins,)`` count vector per step
            (:func:`entropy_histogram`); max_entropy: ``log V`` in nats, the top of the entropy axis.
    """
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm

    fig = _figure(7.2, 4.2)
    ax = fig.add_subplot()
    h = torch.stack([x.detach().double().cpu() for x in histograms], dim=1)  # (bins, steps)
    h = h / h.sum(dim=0, keepdim=True).clamp(min=1)
    bins = h.shape[0]
    positive = h[h > 0]
    low = float(positive.min()) if positive.numel() else 1e-3
    high = float(h.max()) if positive.numel() else 1.0
    if high <= low:  # one value everywhere: a decade around it
        low, high = high / 10, high
    cmap = colormaps["viridis"].with_extremes(bad="white")
    x0, x1 = (steps[0], steps[-1] + 1) if len(steps) > 1 else (steps[0] - 0.5, steps[0] + 0.5)
    data = np.ma.masked_less_equal(h.numpy(), 0.0)
    image = ax.imshow(data, origin="lower", aspect="auto", extent=(x0, x1, 0.0, max_entropy), cmap=cmap,
                      norm=LogNorm(vmin=low, vmax=high), interpolation="nearest")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("entropy (nats)")
    _title(fig, ax, f"distribution of per-position entropy over the run ({bins} bins up to log V = {max_entropy:.2f} nats)")
    fig.colorbar(image, ax=ax, label="fraction of the step's positions (log scale; white: 0)")
    return fig


def nn_similarity_by_bucket(cosines: dict[str, Tensor], tau: float, title: str) -> Any:
    """Histograms of nearest-neighbour cosine, one per frequency bucket, with the threshold tau."""
    fig = _figure(layout=None)  # fixed margins: the constrained layout took a third of the drawing (two per probe)
    ax = fig.add_subplot()
    edges = torch.linspace(-1, 1, 81).numpy()
    for name, values in cosines.items():
        v = values.detach().double().cpu()
        v = v[torch.isfinite(v)]
        if v.numel():
            ax.hist(v.numpy(), bins=edges, histtype="step", density=True, label=f"{name} (n={v.numel()})")
    ax.axvline(tau, color="red", linestyle="--", label=f"tau = {tau}")
    ax.set_xlabel("cosine with the nearest other row")
    ax.set_ylabel("density")
    lines = _title(fig, ax, title)
    fig.subplots_adjust(left=0.11, right=0.97, bottom=0.12, top=0.96 - 0.045 * lines)
    ax.legend(loc="best", fontsize=8)
    return fig


def entropy_histogram(values: Tensor, max_entropy: float, bins: int = 50) -> Tensor:
    """Counts of per-position entropies in ``bins`` equal bins over ``[0, max_entropy]``, ``(bins,)`` float64
    on the device of ``values`` (no host sync). NaN and infinite values are not counted."""
    v = values.detach().float().reshape(-1)
    if v.numel() == 0:
        return torch.zeros(bins, dtype=torch.float64, device=v.device)
    return torch.histc(v, bins=bins, min=0.0, max=max(max_entropy, 1e-6)).double()  # skips NaN and values out of range


def log_v(vocab_size: int) -> float:
    return math.log(vocab_size) if vocab_size > 0 else 0.0
