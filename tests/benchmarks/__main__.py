"""Run the benchmark suite: ``python -m tests.benchmarks [--quick] [--cases ...] [--sizes ...]``.

Each run writes into a folder of its own, ``bench-results/<UTC time>/`` (git-ignored; ``--out``
to choose another): per case ``<case>.md`` (printed too) and ``<case>.json``, and the PNG
plots drawn from the JSON (``--no-plots`` to skip). The committed plots in ``docs/bench/``
are written only when asked, with ``--docs`` (``make bench-docs``). ``make bench`` runs this
with ``BENCH_ARGS``, for example ``make bench BENCH_ARGS="--quick --cases transport"``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from .harness import Options, environment, free_memory, load_average, parse_size

#: Where each run's folder goes, and where ``--docs`` puts the plots (committed, shown by the
#: README and docs/benchmarks.md): relative to the current directory, the top of the tree.
RESULTS = Path("bench-results")
DOCS_PLOTS = Path("docs/bench")

#: Case name -> module (each has ``run(options) -> CaseResult``), in the order they run.
CASES = {
    "codec": "bench_codec",
    "transport": "bench_transport",
    "first-fetch": "bench_first_fetch",
    "fetch": "bench_fetch_by_name",
    "channels": "bench_channels",
    "channel-fanout": "bench_channel_fanout",
    "memory": "bench_memory",
    "scale": "bench_scale",
    "latency": "bench_latency",
    "replicas": "bench_replicas",
    "dcp": "bench_dcp",
    "small-entries": "bench_small_entries",
    "weight-sync": "bench_weight_sync",
    "relays": "bench_relays",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), metavar="CASE",
                        help=f"cases to run (default all: {' '.join(CASES)})")
    parser.add_argument("--quick", action="store_true", help="small sizes and 3 repetitions (how long: docs/benchmarks.md)")
    parser.add_argument("--sizes", nargs="+", type=parse_size, metavar="SIZE",
                        help="sizes for the cases that take sizes (e.g. 1MiB 64MiB 1GiB), instead of their own")
    parser.add_argument("--reps", type=int, help="repetitions of each competitor (default 5, 3 with --quick)")
    parser.add_argument("--only", nargs="+", metavar="WORD",
                        help="only the competitors whose names contain one of these words (baselines always run)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where the tables go (default: a new folder {RESULTS}/<UTC time>/)")
    plots = parser.add_mutually_exclusive_group()
    plots.add_argument("--plots", type=Path, default=None, help="where the PNG plots go (default: --out)")
    plots.add_argument("--docs", action="store_true",
                       help=f"draw the plots into {DOCS_PLOTS}/, replacing the committed ones (make bench-docs)")
    plots.add_argument("--no-plots", action="store_true")
    parser.add_argument("--tmp", type=Path, default=None, help="parent of the temporary data (default: $TMPDIR)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = RESULTS / datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    if args.plots is None:
        args.plots = DOCS_PLOTS if args.docs else args.out
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = Options(quick=args.quick, sizes=args.sizes, reps=args.reps, only=args.only)
    if args.tmp is not None:
        options.tmp = args.tmp
    started = time.perf_counter()
    print(f"# tannery benchmarks ({'quick' if args.quick else 'full'}): {' '.join(args.cases)}", flush=True)
    print(environment(), flush=True)
    written = []
    for case in args.cases:
        module = importlib.import_module(f"{__package__}.{CASES[case]}")
        print(f"\n... {case} (load average {load_average()})", flush=True)
        case_started = time.perf_counter()
        result = module.run(options)
        result.seconds = time.perf_counter() - case_started
        result.quick, result.load = args.quick, load_average()
        path = result.write(args.out, environment(f"{'quick' if args.quick else 'full'} mode"))
        print(path.read_text(), flush=True)
        written.append(path)
        free_memory()
    if not args.no_plots:
        from . import plots

        for path in plots.draw(args.out, args.plots, args.cases):
            print(f"plot: {path}")
    plotted = "" if args.no_plots else f", plots in {args.plots}/"
    print(f"\n{len(written)} cases in {time.perf_counter() - started:.0f} s; tables in {args.out}/{plotted}; "
          f"load average {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
