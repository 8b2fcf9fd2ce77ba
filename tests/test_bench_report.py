"""The benchmark suite's report (``make bench``, tests/benchmarks/): where a run writes, the
looks of the plotted series, and that docs/benchmarks.md documents every case. Fast: no case
is run; a fake case with a tiny result stands in for them."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

import tests.benchmarks
from tests.benchmarks import __main__ as bench
from tests.benchmarks.harness import CaseResult, Table
from tests.benchmarks.styles import COLOURS, SERIES, SLOTS, looks

from .conftest import ROOT

DOC = ROOT / "docs" / "benchmarks.md"
COMMITTED_PLOTS = ROOT / "docs" / "bench"


@pytest.fixture
def fake_suite(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple[Path, Path]]:
    """The suite with one case, ``fake``, and a plot writer that records where it was asked to
    draw (matplotlib is not needed), run from ``tmp_path`` as ``make bench`` runs from the top
    of the tree. Returns the (results, plots) folders of each ``draw``."""
    case = ModuleType("tests.benchmarks.bench_fake")

    def run(options) -> CaseResult:
        result = CaseResult("fake", "Fake", "A case that measures nothing.")
        result.tables.append(Table("figures", ["size", "time"], [["1 MiB", "1 ms"]]))
        result.data = {"series": {"a": [[1, 2.0]]}}
        return result

    case.run = run
    monkeypatch.setitem(sys.modules, case.__name__, case)
    monkeypatch.setattr(bench, "CASES", {"fake": "bench_fake"})

    drawn: list[tuple[Path, Path]] = []
    plots = ModuleType("tests.benchmarks.plots")

    def draw(results: Path, out: Path, cases: list[str]) -> list[Path]:
        drawn.append((results, out))
        out.mkdir(parents=True, exist_ok=True)
        (out / "fake.png").write_bytes(b"not a png")
        return [out / "fake.png"]

    plots.draw = draw
    monkeypatch.setitem(sys.modules, plots.__name__, plots)
    monkeypatch.setattr(tests.benchmarks, "plots", plots, raising=False)
    monkeypatch.chdir(tmp_path)
    return drawn


def test_make_bench_writes_a_results_folder_and_leaves_the_committed_plots_alone(
        fake_suite: list[tuple[Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["--quick", "--cases", "fake"]) == 0  # what `make bench BENCH_ARGS=--quick` runs

    [(results, plots)] = fake_suite
    assert plots == results  # the plots beside the tables
    assert results.parent == Path("bench-results")  # a run's own folder, git-ignored
    assert "bench-results/" in (ROOT / ".gitignore").read_text().splitlines()
    assert not (tmp_path / "docs").exists()
    assert {p.name for p in (tmp_path / results).iterdir()} == {"fake.md", "fake.json", "fake.png"}
    assert json.loads((tmp_path / results / "fake.json").read_text())["data"] == {"series": {"a": [[1, 2.0]]}}
    assert f"tables in {results}/, plots in {results}/" in capsys.readouterr().out


def test_only_docs_writes_the_committed_plots(fake_suite: list[tuple[Path, Path]], tmp_path: Path) -> None:
    assert bench.main(["--cases", "fake", "--docs"]) == 0  # `make bench-docs`

    [(results, plots)] = fake_suite
    assert plots == Path("docs/bench") == COMMITTED_PLOTS.relative_to(ROOT)
    assert results.parent == Path("bench-results")
    assert (tmp_path / "docs" / "bench" / "fake.png").exists()
    assert {p.name for p in (tmp_path / results).iterdir()} == {"fake.md", "fake.json"}


def test_out_and_plots_choose_the_folders(fake_suite: list[tuple[Path, Path]], tmp_path: Path) -> None:
    assert bench.main(["--cases", "fake", "--out", "here", "--plots", "there"]) == 0
    assert bench.main(["--cases", "fake", "--out", "again", "--no-plots"]) == 0

    assert fake_suite == [(Path("here"), Path("there"))]
    assert (tmp_path / "here" / "fake.md").exists() and (tmp_path / "again" / "fake.md").exists()
    assert not (tmp_path / "docs").exists()
    with pytest.raises(SystemExit):
        bench.parse_args(["--docs", "--plots", "there"])


def test_every_series_has_a_look_of_its_own() -> None:
    registered = list(SLOTS)
    all_looks = looks(registered)
    assert len(set(all_looks.values())) == len(registered)  # no two series look the same anywhere
    for plot, names in SERIES.items():
        colours = [look.colour for look in looks(names).values()]
        assert len(set(colours)) == len(names), f"two series of the {plot} plot share a colour"
        for name in names:  # the same look in every plot, whatever else it holds
            assert looks([name])[name] == looks(names)[name] == all_looks[name]


def test_a_series_not_registered_still_gets_a_colour_of_its_own_in_its_plot() -> None:
    names = [*SERIES["transport"], "raw grpcio ceiling, 2 MiB messages"]
    chosen = looks(names)
    assert len({look.colour for look in chosen.values()}) == len(names) <= len(COLOURS)
    assert chosen == looks(names)  # the same every time
    assert chosen["raw grpcio ceiling"] == looks(["raw grpcio ceiling"])["raw grpcio ceiling"]


def test_every_case_is_documented_with_the_command_that_runs_it() -> None:
    doc = DOC.read_text()
    headings = re.findall(r"^## (.*)$", doc, re.M)
    for case, module in bench.CASES.items():
        assert (ROOT / "tests" / "benchmarks" / f"{module}.py").exists()
        assert any(f"`{case}`" in heading for heading in headings), f"no section of docs/benchmarks.md for {case}"
        assert re.search(rf"--cases {re.escape(case)}\b", doc), f"docs/benchmarks.md does not say how to run {case}"


def test_every_plot_the_docs_show_is_committed() -> None:
    shown = re.findall(r"\]\((?:docs/)?(bench/[\w.-]+\.png)\)", DOC.read_text() + (ROOT / "README.md").read_text())
    assert shown
    for path in shown:
        assert (ROOT / "docs" / path).exists(), path


def test_the_plots_are_drawn_where_asked(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # the bench extra
    from tests.benchmarks import plots

    results = tmp_path / "results"
    results.mkdir()
    series = {name: [[1 << 20, 1e8, 5e7, 2e8], [1 << 25, 1e9, 5e8, 2e9]] for name in SERIES["transport"]}
    (results / "transport.json").write_text(json.dumps(
        {"case": "transport", "environment": "a test", "seconds": 1,
         "data": {"series": {"upload": series, "download": series}, "sizes": [1 << 20, 1 << 25]}}))
    assert plots.draw(results, results, ["transport", "codec"]) == [results / "transport_throughput.png"]
    assert (results / "transport_throughput.png").read_bytes().startswith(b"\x89PNG")


def test_a_quick_run_labels_its_missed_targets_informational() -> None:
    from tests.benchmarks.harness import CaseResult

    result = CaseResult("transport", "Transport", "intro")
    result.target("TCP Fetch at 32 MiB vs Flight", 0.39, 1.0)
    result.target("local Fetch vs Flight", 9.3, 1.0)
    assert "**missed**" in result.markdown("full mode") and "informational" not in result.markdown("full mode")
    result.quick, result.load = True, "6.10 5.02 4.33"
    shown = result.markdown("quick mode")
    assert "### Targets (informational in a --quick run)" in shown
    assert "load average 6.10 5.02 4.33" in shown and "docs/benchmarks.md" in shown
    assert "**missed**" not in shown and "0.39x** (target ≥ 1x): missed (informational: --quick)" in shown
    assert "9.30x** (target ≥ 1x): met" in shown
