"""PNG plots (matplotlib) of the cases' JSON results: ``<results>/<case>.json`` -> ``<out>/<plot>.png``.

``python -m tests.benchmarks.plots RESULTS [OUT]`` redraws them from a run's folder (into
that folder unless OUT is given; OUT ``docs/bench`` replaces the committed plots).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any, Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.ticker import FuncFormatter  # noqa: E402

from .styles import looks  # noqa: E402

MiB = 1 << 20


def _size_label(value: float, _pos: Any = None) -> str:
    for unit, name in ((1 << 30, "GiB"), (MiB, "MiB"), (1 << 10, "KiB")):
        if value >= unit:
            return f"{value / unit:g} {name}"
    return f"{value:g} B"


def _sizes_axis(ax) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(_size_label))
    ax.grid(True, which="both", alpha=0.3)


def _title(fig, title: str, environment: str) -> None:
    fig.suptitle(title, fontsize=11)
    fig.text(0.5, 0.005, "\n".join(textwrap.wrap(environment, 200)), ha="center", va="bottom", fontsize=6,
             color="grey")


def _throughput_lines(ax, series: dict[str, list], label_y: str) -> None:
    style = looks(series)
    for name, points in series.items():
        xs = [p[0] for p in points]
        ax.plot(xs, [p[1] / 1e9 for p in points], label=name, **style[name].line())
        if len(points[0]) >= 4:
            ax.fill_between(xs, [p[2] / 1e9 for p in points], [p[3] / 1e9 for p in points],
                            color=style[name].colour, alpha=0.12)
    _sizes_axis(ax)
    ax.set_ylabel(label_y)


def transport(data: dict, environment: str, out: Path) -> list[Path]:
    fig, axes = plt.subplots(1, 2, figsize=(13, 7), sharey=True)
    for ax, direction in zip(axes, ("upload", "download")):
        _throughput_lines(ax, data["series"][direction], "GB/s (median; band: slowest – fastest)")
        ax.set_yscale("log")  # the same-host Fetch runs 5-10x the others
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
        ax.set_title(f"{direction} of one float32 tensor, loopback")
        ax.set_xlabel("tensor size")
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, bbox_to_anchor=(0.5, 0.04))
    _title(fig, "Transport: throughput against size", environment)
    fig.tight_layout(rect=(0, 0.2, 1, 0.96))
    return [_save(fig, out / "transport_throughput.png")]


def codec(data: dict, environment: str, out: Path) -> list[Path]:
    fig, ax = plt.subplots(figsize=(9, 5.5))
    _throughput_lines(ax, data["series"], "GB/s of tensor bytes, round trip (median)")
    ax.set_xlabel("tensor size")
    ax.legend(fontsize=7)
    _title(fig, "Codec: tensor → bytes → tensor", environment)
    return [_save(fig, out / "codec_throughput.png")]


def fetch(data: dict, environment: str, out: Path) -> list[Path]:
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    for ax, kind, title in ((axes[0], "small", "the 4 KiB entry"), (axes[1], "big", "the 64 MiB entry")):
        style = looks(data["series"][kind])
        for name, points in data["series"][kind].items():
            ax.plot([p[0] for p in points], [p[1] * 1e3 for p in points], label=name, **style[name].line())
        _sizes_axis(ax)
        ax.set_yscale("log")
        ax.set_xlabel("archive size")
        ax.set_ylabel("ms per fetch (median)")
        ax.set_title(f"Fetching {title} by name")
    axes[0].legend(fontsize=7)
    _title(fig, "Fetch by name against archive size", environment)
    return [_save(fig, out / "fetch_by_name.png")]


def channels(data: dict, environment: str, out: Path) -> list[Path]:
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    style = looks([*data["throughput"], *data["latency"]])
    for name, points in data["throughput"].items():
        axes[0].plot([p[0] for p in points], [p[1] / MiB for p in points], label=name, **style[name].line())
    axes[0].set_xscale("log", base=2)
    counts = [p[0] for p in next(iter(data["throughput"].values()))]
    axes[0].set_xticks(counts, [str(c) for c in counts])
    axes[0].set_xlabel("subscribers")
    axes[0].set_ylabel("MiB/s per subscriber (median)")
    axes[0].set_title("Throughput, one publisher")
    axes[0].grid(True, alpha=0.3)
    axes[0].legend()
    names = list(data["latency"])
    quantiles = list(data["latency"][names[0]])
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        values = [data["latency"][name][q] * 1e6 for q in quantiles]
        axes[1].bar([i + index * width for i in range(len(quantiles))], values, width, label=name,
                    color=style[name].colour)
    axes[1].set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(quantiles))])
    axes[1].set_xticklabels([f"p{q}" for q in quantiles])
    axes[1].set_yscale("log")
    axes[1].set_ylabel("µs, publish to receive")
    axes[1].set_title("Latency percentiles of a 4 KiB payload")
    axes[1].legend()
    _title(fig, "Channels", environment)
    return [_save(fig, out / "channels.png")]


def memory(data: dict, environment: str, out: Path) -> list[Path]:
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    labels = sorted(data["peaks"])
    ys = range(len(labels))
    rss = [data["peaks"][k][0] / MiB for k in labels]
    anon = [data["peaks"][k][1] / MiB for k in labels]
    growth = [data["peaks"][k][2] / MiB for k in labels]
    axes[0].barh([y + 0.2 for y in ys], rss, 0.4, label="peak RSS")
    axes[0].barh([y - 0.2 for y in ys], anon, 0.4, label="peak anonymous RSS")
    axes[0].axvline(300, color="red", linestyle="--", linewidth=1, label="server target (300 MiB anonymous)")
    axes[0].set_title("Peak RSS (the client process also holds the archive's tensors)", fontsize=10)
    axes[1].barh(list(ys), growth, 0.6, color="tab:green", label="peak growth over the call's start")
    axes[1].axvline(data["total"] / MiB, color="grey", linestyle=":", linewidth=1, label="the archive's size")
    axes[1].set_title("What the call itself added", fontsize=10)
    axes[0].set_yticks(list(ys))
    axes[0].set_yticklabels([k.replace("|", ": ") for k in labels], fontsize=8)
    for ax in axes:
        ax.set_xlabel("MiB")
        ax.legend(fontsize=8)
    _title(fig, f"Memory storing and fetching a {_size_label(data['total'])} archive", environment)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    return [_save(fig, out / "memory.png")]


def scale(data: dict, environment: str, out: Path) -> list[Path]:
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    style = looks([*data.get("growth", {}), *data.get("concurrency", {})])
    for name, points in data.get("growth", {}).items():
        axes[0].plot([p[0] for p in points], [p[1] for p in points], label=name, **style[name].line())
    _sizes_axis(axes[0])
    axes[0].set_yscale("log")
    axes[0].set_xlabel("entry size")
    axes[0].set_ylabel("seconds (median)")
    axes[0].set_title("Time against size (Store/Fetch vs Sink/Source ceiling)")
    axes[0].legend()
    for name, points in data.get("concurrency", {}).items():
        axes[1].plot([p[0] for p in points], [p[1] / 1e9 for p in points], label=name, **style[name].line())
    axes[1].set_xscale("log", base=2)
    if data.get("concurrency"):
        counts = [p[0] for p in next(iter(data["concurrency"].values()))]
        axes[1].set_xticks(counts, [str(c) for c in counts])
    axes[1].set_xlabel("concurrent clients")
    axes[1].set_ylabel("aggregate GB/s (median)")
    axes[1].set_title("Concurrent clients")
    axes[1].grid(True, alpha=0.3)
    axes[1].legend()
    _title(fig, "Scale", environment)
    return [_save(fig, out / "scale.png")]


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not fig.get_layout_engine():
        fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


DRAWERS: dict[str, Callable[[dict, str, Path], list[Path]]] = {
    "codec": codec, "transport": transport, "fetch": fetch, "channels": channels, "memory": memory, "scale": scale,
}


def draw(results: Path, out: Path, cases: list[str]) -> list[Path]:
    """Plots of the cases whose JSON is in ``results``."""
    paths = []
    for case in cases:
        source = results / f"{case}.json"
        if case in DRAWERS and source.exists():
            content = json.loads(source.read_text())
            paths += DRAWERS[case](content["data"], content["environment"], out)
    return paths


if __name__ == "__main__":
    import sys

    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m tests.benchmarks.plots RESULTS [OUT]")
    results = Path(sys.argv[1])
    for written in draw(results, Path(sys.argv[2]) if len(sys.argv) == 3 else results, list(DRAWERS)):
        print(written)
