"""The shared harness of the benchmark suite: timing, servers, memory, tables and results.

Every case measures its competitors in the same run, alternating: repetition ``r`` runs
them in an order rotated by ``r``, so drift (other processes on a shared machine, page
cache, thermal state) spreads over all of them. Reported per figure: the median, the
spread (min – max) and the ratio of medians against the baseline of the same run.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
HOST = "127.0.0.1"


# -- options ------------------------------------------------------------------------------


@dataclass
class Options:
    """What ``python -m tests.benchmarks`` was asked (see ``__main__``)."""

    quick: bool = False
    #: Sizes in bytes, overriding a case's defaults (None: the case's own, quick or full).
    sizes: list[int] | None = None
    #: Repetitions of each competitor (None: 3 in quick mode, 5 otherwise).
    reps: int | None = None
    #: Temporary data goes under here (a fresh directory, removed at the end).
    tmp: Path = field(default_factory=lambda: Path(tempfile.gettempdir()))
    #: Run only the competitors whose names contain one of these (baselines always run).
    only: list[str] | None = None

    def select(self, competitors: dict[str, Any], *baselines: str) -> dict[str, Any]:
        if not self.only:
            return competitors
        return {name: c for name, c in competitors.items()
                if name in baselines or any(word.lower() in name.lower() for word in self.only)}

    def repetitions(self, size: int = 0) -> int:
        """Fewer repetitions for the largest sizes (each takes seconds), never fewer than 3."""
        reps = self.reps or (3 if self.quick else 5)
        return reps if size < 512 * MiB or self.reps else max(3, reps - 2)

    def pick_sizes(self, full: list[int], quick: list[int]) -> list[int]:
        return sorted(self.sizes) if self.sizes else (quick if self.quick else full)


def parse_size(text: str) -> int:
    """``4KiB``, ``64MiB``, ``1GiB``, ``512`` (bytes); also k/M/G."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(i?B?)\s*", text)
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 4KiB, 64MiB, 1GiB)")
    unit = {"": 1, "k": KiB, "m": MiB, "g": GiB}[match.group(2).lower()]
    return int(match.group(1)) * unit


def fmt_size(nbytes: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit} {name}"
    return f"{nbytes} B"


def fmt_time(seconds: float) -> str:
    if seconds >= 10:
        return f"{seconds:.1f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def fmt_rate(nbytes: int, seconds: float) -> str:
    rate = nbytes / seconds
    return f"{rate / 1e9:.2f} GB/s" if rate >= 1e8 else f"{rate / 1e6:.1f} MB/s"


def fmt_ratio(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio < 100 else f"{ratio:.0f}x"


# -- timing -------------------------------------------------------------------------------


@dataclass
class Samples:
    """Seconds of one measured quantity, one per repetition."""

    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    def spread(self) -> str:
        return f"{fmt_time(self.low)} – {fmt_time(self.high)}"

    def rate_spread(self, nbytes: int) -> str:
        """Throughput spread: the slowest to the fastest repetition."""
        return f"{fmt_rate(nbytes, self.high)} – {fmt_rate(nbytes, self.low)}"


#: A competitor's round: returns the seconds it measured, by quantity ("upload",
#: "download"...), or a float for a single quantity named "time".
Round = Callable[[], Mapping[str, float] | float]


def alternate(competitors: Mapping[str, Round], reps: int, between: Callable[[], None] | None = None
              ) -> dict[str, dict[str, Samples]]:
    """Run every competitor ``reps`` times, the order rotated each repetition.

    The garbage collector is run before and disabled during each round. ``between`` runs
    after every round (for instance to drop a server's data).
    """
    names = list(competitors)
    results: dict[str, dict[str, Samples]] = {name: {} for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            gc.disable()
            try:
                started = time.perf_counter()
                measured = competitors[name]()
                elapsed = time.perf_counter() - started
            finally:
                gc.enable()
            if measured is None:
                measured = {"time": elapsed}
            elif not isinstance(measured, Mapping):
                measured = {"time": float(measured)}
            for quantity, seconds in measured.items():
                results[name].setdefault(quantity, Samples()).values.append(seconds)
            if between is not None:
                between()
    return results


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes (its result dropped)."""
    started = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - started
    del result
    return elapsed


def repeat_timed(fn: Callable[[], Any], min_seconds: float = 0.02, max_calls: int = 10_000) -> float:
    """Seconds per call, averaged over enough calls to last ``min_seconds`` (for fast calls)."""
    once = timed(fn)
    calls = max(1, min(max_calls, int(min_seconds / max(once, 1e-7))))
    if calls == 1:
        return once
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# -- memory and CPU of processes ----------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, VmHWM of a process, in bytes (empty once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                    out[key] = int(rest.split()[0]) * KiB
    except FileNotFoundError:
        pass
    return out


class PeakRss:
    """Samples a process's RSS (all of it, and anonymous only) every few ms while in use."""

    def __init__(self, pid: int, interval: float = 0.005) -> None:
        self.pid, self.interval = pid, interval
        self.rss = self.anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)

    def sample(self) -> None:
        status = proc_status(self.pid)
        self.rss = max(self.rss, status.get("VmRSS", 0))
        self.anon = max(self.anon, status.get("RssAnon", 0))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> "PeakRss":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process (all its threads) has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def io_written(pid: int) -> int:
    """Bytes a process has caused to be written to storage (``/proc/PID/io`` write_bytes)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


# -- servers in subprocesses --------------------------------------------------------------


class Subprocess:
    """A server started as ``python -m <module> ...`` that prints ``serving on HOST:PORT``."""

    def __init__(self, *args: str, env: Mapping[str, str] | None = None, timeout: float = 60) -> None:
        self.args = [sys.executable, *args]
        self.process = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        ready = threading.Event()
        self.target = ""

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.lines.append(line.rstrip("\n"))
                match = re.search(r"serving on (\S+):(\d+)", line)
                if match and not self.target:
                    self.target = f"{HOST}:{match.group(2)}"
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or not self.target:
            self.close()
            raise RuntimeError(f"{' '.join(args)} did not start:\n" + "\n".join(self.lines[-30:]))

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def port(self) -> int:
        return int(self.target.rsplit(":", 1)[1])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "Subprocess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def free_port() -> int:
    """A TCP port on HOST that nothing listens on now (the OS's pick; a server binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def tannery_server(data_dir: Path, env: Mapping[str, str] | None = None, **flags: Any) -> Subprocess:
    """``python -m tannery_server serve`` on a free port with its own data directory, as
    configured by default (metrics on, on a free port too; no tokens, no TLS), with both
    data paths: its same-host socket (``DATA_DIR/tannery.sock``, the default) and a data
    port on a free port (``auto``, the default, said again over any TANNERY_DATA_PORT)."""
    flags.setdefault("data_port", "auto")
    args = ["-m", "tannery_server", "serve", "--host", HOST, "--port", "0", "--data-dir", str(data_dir),
            "--log-format", "json"]
    for key, value in flags.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    return Subprocess(*args, env={"TANNERY_METRICS_PORT": "auto", **(env or {})})


@contextmanager
def scratch(options: Options, name: str) -> Iterator[Path]:
    """A fresh temporary directory for one case, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=f"tannery-bench-{name}-", dir=options.tmp))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- results --------------------------------------------------------------------------------


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""

    def add(self, *cells: Any) -> None:
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        if self.note:
            lines += [self.note, ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "---|" * len(self.columns))
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"


@dataclass
class CaseResult:
    """What a case reports: tables, verdicts against the targets, and data for the plots."""

    case: str
    title: str
    intro: str
    tables: list[Table] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: JSON-able figures the plots are drawn from.
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    #: Set by the runner: a --quick run (small sizes), and the load average when the case ended.
    #: Its missed targets are then informational: the targets are for the full sizes.
    quick: bool = False
    load: str = ""

    def target(self, what: str, value: float, goal: float, higher_is_better: bool = True, unit: str = "x") -> bool:
        met = value >= goal if higher_is_better else value <= goal
        sign = "≥" if higher_is_better else "≤"
        self.targets.append(f"- {what}: **{value:.2f}{unit}** (target {sign} {goal:g}{unit}): "
                            f"{'met' if met else '**missed**'}")
        return met

    def markdown(self, environment: str) -> str:
        parts = [f"## {self.title}", "", self.intro, "", f"_{environment}; this case took {self.seconds:.0f} s._", ""]
        for table in self.tables:
            parts.append(table.markdown())
        if self.targets:
            parts += self._targets_markdown()
        if self.notes:
            parts += ["### Notes", "", *[f"- {n}" for n in self.notes], ""]
        return "\n".join(parts)

    def _targets_markdown(self) -> list[str]:
        """The targets' lines; in a --quick run, a missed target is labelled informational, with
        the sizes and load it ran under and where the figures of record are."""
        if not self.quick:
            return ["### Targets", "", *self.targets, ""]
        lines = [line.replace("**missed**", "missed (informational: --quick)") for line in self.targets]
        note = (f"_A --quick run: small sizes and 3 repetitions, here at load average {self.load or '?'}. The "
                "targets are set for the full sizes on a quiet machine, so a miss here is informational, not a "
                "regression; the figures of record are full runs, in docs/benchmarks.md._")
        return ["### Targets (informational in a --quick run)", "", note, "", *lines, ""]

    def write(self, out_dir: Path, environment: str) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{self.case}.md"
        path.write_text(self.markdown(environment))
        (out_dir / f"{self.case}.json").write_text(json.dumps(
            {"case": self.case, "environment": environment, "seconds": self.seconds, "data": self.data}, indent=1))
        return path


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def environment(extra: str = "") -> str:
    """One line: the machine, the load, and the versions that matter."""
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    versions = []
    for package in ("grpcio", "numpy", "torch", "pytannic", "safetensors", "pyarrow"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            pass
    return (f"{cpu}, {len(os.sched_getaffinity(0))} CPUs, {memory:.0f} GiB RAM, {platform.system()} "
            f"{platform.release()}; Python {platform.python_version()}, {', '.join(versions)}; "
            f"load average {load_average()}" + (f"; {extra}" if extra else ""))


def free_memory() -> None:
    """Collect garbage and hand freed heap back to the system, so the next case starts lean."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
