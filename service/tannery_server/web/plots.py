"""The pages' plots as inline SVG: a histogram and a line of rates. Only numbers go in (no
user data), formatted here; the result is marked safe for the templates."""

from __future__ import annotations

import math

from markupsafe import Markup

from .templates import number, size

WIDTH, HEIGHT, PAD = 520, 200, 34


def histogram(edges: list[float], counts: list[int], log: bool = False) -> Markup:
    """Bars of ``counts`` between ``edges`` (one more edge than counts), with the range below;
    ``log``: heights by log(1 + count), so that a long tail's few values show."""
    if not counts:
        return Markup('<p class="note" id="histogram">No finite value to draw.</p>')
    top = max(counts) or 1
    inner_w, inner_h = WIDTH - 2 * PAD, HEIGHT - 2 * PAD
    bar = inner_w / len(counts)
    bars = []
    scale = (lambda c: math.log1p(c) / math.log1p(top)) if log else (lambda c: c / top)
    for i, c in enumerate(counts):
        h = inner_h * scale(c)
        x, y = PAD + i * bar, PAD + inner_h - h
        bars.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(bar - 1, 0.5):.1f}" height="{h:.1f}" fill="#4b7bc0">'
                    f'<title>[{number(edges[i])}, {number(edges[i + 1])}): {c}</title></rect>')
    axis = (f'<line x1="{PAD}" y1="{PAD + inner_h}" x2="{PAD + inner_w}" y2="{PAD + inner_h}" stroke="#555"/>'
            f'<text x="{PAD}" y="{HEIGHT - 10}" font-size="11">{number(edges[0])}</text>'
            f'<text x="{PAD + inner_w}" y="{HEIGHT - 10}" font-size="11" text-anchor="end">{number(edges[-1])}</text>'
            f'<text x="{PAD}" y="{PAD - 8}" font-size="11">{top} in the tallest bin</text>')
    return Markup(f'<svg id="histogram" data-bins="{len(counts)}" data-scale="{"log" if log else "linear"}" '
                  f'data-heights="{",".join(f"{inner_h * scale(c):.1f}" for c in counts)}" width="{WIDTH}" height="{HEIGHT}" '
                  f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="histogram">{"".join(bars)}{axis}</svg>')


def rates(points: list[tuple[float, float]], span: float) -> Markup:
    """A line of bytes per second over the last ``span`` seconds: ``points`` are (seconds ago, rate)."""
    if len(points) < 2:
        return Markup('<p class="note" id="rates">Not enough samples yet for a plot (one every few seconds).</p>')
    top = max(rate for _, rate in points) or 1.0
    inner_w, inner_h = WIDTH - 2 * PAD, HEIGHT - 2 * PAD
    xy = " ".join(f"{PAD + inner_w * (1 - ago / span):.1f},{PAD + inner_h * (1 - rate / top):.1f}"
                  for ago, rate in points)
    return Markup(f'<svg id="rates" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
                  f'aria-label="bytes per second"><polyline points="{xy}" fill="none" stroke="#4b7bc0" stroke-width="2"/>'
                  f'<line x1="{PAD}" y1="{PAD + inner_h}" x2="{PAD + inner_w}" y2="{PAD + inner_h}" stroke="#555"/>'
                  f'<text x="{PAD}" y="{HEIGHT - 10}" font-size="11">-{span:.0f} s</text>'
                  f'<text x="{PAD + inner_w}" y="{HEIGHT - 10}" font-size="11" text-anchor="end">now</text>'
                  f'<text x="{PAD}" y="{PAD - 6}" font-size="11">{size(top)}/s</text></svg>')


__all__ = ["histogram", "rates"]
