"""One line chart per metric, drawn by matplotlib, ready to inline in an HTML page.

matplotlib is optional (``pip install matplotlib``, or ``pip install "headwatch[figures]"``):
it is imported inside the functions, and :func:`have_matplotlib` tells the page whether
charts can be drawn at all. The figures use matplotlib's object API (``Figure``), never
``pyplot``, so the global backend and state are left alone. Both formats are self-contained:
``svg`` is matplotlib's SVG backend output inlined as an ``<svg>`` element (text kept as
text, no metadata, no external references); ``png`` is a base64 ``data:`` URI.
"""

from __future__ import annotations

import base64
import html
import importlib.util
import io
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from headwatch.errors import HeadwatchError
from headwatch.report.events import Points
from headwatch.report.safe import printable

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22")
"""matplotlib's ``tab10`` colors, one per run, reused by the HTML legend."""

INSTALL_HINT = 'charts need matplotlib: pip install matplotlib (or pip install "headwatch[figures]")'
FORMATS = ("svg", "png")


def have_matplotlib() -> bool:
    """Whether matplotlib can be imported (checked without importing it)."""
    return importlib.util.find_spec("matplotlib") is not None


PALETTE_LIGHT = ("#aec7e8", "#ff9896", "#98df8a", "#ffbb78", "#c5b0d5", "#c49c94", "#f7b6d2", "#9edae5", "#c7c7c7", "#dbdb8d")
"""The light half of matplotlib's ``tab20``: the 11th to 20th colors."""


def color(i: int) -> str:
    """The color of the ``i``-th run (or group); every ``i`` gets its own color.

    ``tab10`` for the first 10, the light ``tab20`` colors for the next 10, then hues spaced by the
    golden angle at three lightness levels (no two equal: checked against all earlier ones).

    Raises:
        HeadwatchError: ``i`` is negative.
    """
    if i < 0:
        raise HeadwatchError(f"`i` must be >= 0, got {i!r}")
    return _colors(i + 1)[i]


def _colors(n: int) -> list[str]:
    import colorsys

    out = list(PALETTE + PALETTE_LIGHT)[:n]
    k = 0
    while len(out) < n:
        hue = (k * 0.618033988749895) % 1.0
        rgb = colorsys.hls_to_rgb(hue, (0.35, 0.5, 0.65)[k % 3], 0.65)
        k += 1
        candidate = "#" + "".join(f"{round(255 * c):02x}" for c in rgb)
        if candidate not in out:
            out.append(candidate)
    return out


def _figure(
    series: Mapping[str, Points],
    colors: Mapping[str, str],
    alert_steps: Mapping[str, Sequence[int]] | None,
    labels: Mapping[str, str] | None = None,
) -> Any:
    try:
        from matplotlib.figure import Figure  # no pyplot: leaves the global backend alone
    except ImportError as err:
        raise HeadwatchError(INSTALL_HINT) from err
    fig = Figure(figsize=(4.8, 2.6), dpi=100)
    ax = fig.subplots()
    finite = False
    shown: set[str] = set()
    for name, pts in series.items():
        steps = [s for s, _ in pts]
        values = [v if math.isfinite(v) else float("nan") for _, v in pts]  # non-finite values break the line
        finite = finite or any(math.isfinite(v) for v in values)
        marker = "o" if len(pts) <= 3 else None  # a run with one point is still visible
        label = printable((labels or {}).get(name, name))
        legend, shown = ("_nolegend_" if label in shown else label), shown | {label}  # one entry per label
        ax.plot(steps, values, color=colors[name], label=legend, linewidth=1.4, marker=marker, markersize=4)
        for step in (alert_steps or {}).get(name, []):
            ax.axvline(step, color=colors[name], linestyle="--", alpha=0.6, linewidth=1)
    if not finite:
        ax.text(0.5, 0.5, "no finite values", transform=ax.transAxes, ha="center", va="center", color="#888")
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


_SVG_START = re.compile(r"^.*?(<svg\b)", re.S)
_XMLNS = re.compile(r'\s+xmlns(:\w+)?="[^"]*"')


def render_chart(
    series: Mapping[str, Points],
    colors: Mapping[str, str],
    *,
    fmt: str = "svg",
    title: str = "",
    alert_steps: Mapping[str, Sequence[int]] | None = None,
    labels: Mapping[str, str] | None = None,
) -> str:
    """One chart of ``series`` (run name -> points): a line per run, alert steps as dashed lines.

    Non-finite values break the line; runs with at most 3 points get markers; a chart with no
    finite value says so.

    Args:
        series: run name -> ``(step, value)`` points.
        colors: run name -> color.
        fmt: ``"svg"`` (an inline ``<svg>`` element) or ``"png"`` (an ``<img>`` with a base64 data URI).
        title: the accessible label of the chart.
        alert_steps: run name -> steps where the run raised an alert.
        labels: run name -> its legend label (default: the run name); a label shared by
            several runs (their group) appears once in the legend.

    Raises:
        HeadwatchError: ``fmt`` is not ``"svg"`` or ``"png"``, or matplotlib is not installed.
    """
    if fmt not in FORMATS:
        raise HeadwatchError(f"`fmt` must be one of {FORMATS}, got {fmt!r}")
    try:
        from matplotlib import rc_context
    except ImportError as err:
        raise HeadwatchError(INSTALL_HINT) from err
    title = printable(title)
    buf = io.BytesIO()
    # labels are run names, shown as written: "$" starts no mathtext ("exp_$USER_$HOST" is a name);
    # SVG text as <text> (not glyph paths), ids salted by the title so that several charts inline
    # in one page never share an id with different content
    with rc_context({"text.parse_math": False, "svg.fonttype": "none", "svg.hashsalt": title or "headwatch"}):
        fig = _figure(series, colors, alert_steps, labels)
        if fmt == "png":
            fig.savefig(buf, format="png")
            data = base64.b64encode(buf.getvalue()).decode("ascii")
            return f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}"/>'
        fig.savefig(buf, format="svg", metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    svg = _SVG_START.sub(r"\1", buf.getvalue().decode("utf-8"), count=1)  # drop the XML prolog and DOCTYPE
    head, _, rest = svg.partition(">")
    head = _XMLNS.sub("", head)  # HTML5 puts an inline <svg> in the SVG namespace by itself
    return f'{head} role="img" aria-label="{html.escape(title)}">{rest}'
