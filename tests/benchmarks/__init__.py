"""The benchmark suite (``make bench``, or ``python -m tests.benchmarks --help``); CI does not run it.

One module per case (``bench_<case>.py``, never collected by pytest), a shared
:mod:`.harness` (alternating competitors, repetitions, medians, spreads, ratios, servers
in subprocesses, RSS sampling, markdown tables), the competitors' servers in
:mod:`.peers` and their clients in :mod:`.clients`, and :mod:`.plots`. The report that
reads the figures is ``docs/benchmarks.md``.
"""
