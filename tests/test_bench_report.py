"""The benchmark suite's report (``make bench``, tests/benchmarks/): where a run writes. Fast:
no case is run; a fake case with a tiny result stands in for them."""

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

from .conftest import ROOT

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
