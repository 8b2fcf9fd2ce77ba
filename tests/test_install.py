"""The README's install lines ("Install without make"), run as written in fresh virtual
environments: ``pip install ".[client]"`` from a copy of the clone, ``make dist``, and
``pip install`` of the wheel it built with its extras; then ``import tannery``, ``tannery --help``
and ``tannery serve --help``, each checked to come from what was installed, not the source tree.

To stay fast and offline, each install takes ``--no-deps``, and the fresh environment sees the
dependencies (torch, grpcio...) of this test's own environment through a ``.pth`` file naming a
directory of links to them, every one but tannery's own (its editable install): so the only
tannery that environment can import is the one pip installed there. The extras are checked in
the installed metadata (what pip would fetch with them)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from .conftest import ROOT


#: What a clone holds that the build reads.
_SOURCES = ("pyproject.toml", "README.md", "Makefile", "constraints.txt", "client", "protocol", "service")
_JUNK = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")


def install_lines() -> list[str]:
    """The commands of the README's install block."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Install without make"):]
    found = re.search(r"```sh\n(.*?)```", section, re.S)
    assert found, "README: the install block"
    return [line for line in found.group(1).splitlines() if line.strip()]


def _clone(tmp_path: Path) -> Path:
    """A copy of what a clone holds for the build (the test never builds in the repository)."""
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in _SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, clone / name, ignore=_JUNK)
        else:
            shutil.copy2(source, clone / name)
    return clone


def _dependencies(tmp_path: Path) -> Path:
    """A directory of links to every package of this environment but tannery itself."""
    site = Path(sysconfig.get_paths()["purelib"])
    links = tmp_path / "deps"
    links.mkdir()
    for entry in site.iterdir():
        if entry.name.startswith(("tannery", "__editable__", "_tannery")) or entry.suffix == ".pth":
            continue
        (links / entry.name).symlink_to(entry)
    return links


def _fresh_venv(path: Path, deps: Path) -> Path:
    """A new virtual environment (no pip of its own: this one's installs into it) that sees ``deps``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=30)
    python = path / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "deps.pth").write_text(f"{deps}\n")
    return python


def _pip_install(python: Path, line: str, cwd: Path) -> None:
    """Run a README ``pip install ...`` line into the environment of ``python``, without dependencies."""
    assert line.startswith("pip install "), line
    spec = line.removeprefix("pip install ").strip().strip('"')
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                           "--disable-pip-version-check", "--no-deps", "--no-build-isolation", spec],
                          cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"


def _check_installed(venv: Path, cwd: Path) -> None:
    """``import tannery`` (and the server's and the protocol's packages), ``tannery --help`` and
    ``tannery serve --help`` work, each from ``venv``; the extras are in the metadata."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",) and not k.startswith("TANNERY_")}
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import importlib.metadata as m, tannery, tannery_server, tannery_protocol, tannery.torch\n"
         "print(tannery.__file__, tannery_server.__file__, tannery_protocol.__file__, sep='\\n')\n"
         "print(m.metadata('tannery').get_all('Provides-Extra'))"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    *files, extras = where.stdout.strip().splitlines()
    for file in files:
        assert Path(file).resolve().is_relative_to(venv.resolve()), f"{file}: not the installed one"
    assert {"client", "scale"} <= set(eval(extras))
    for argv in (["--help"], ["serve", "--help"]):
        shown = subprocess.run([str(venv / "bin" / "tannery"), *argv], cwd=cwd, env=env, capture_output=True,
                               text=True, timeout=60)
        assert shown.returncode == 0 and shown.stdout.startswith("usage: tannery"), shown.stderr


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_readme_install_lines_work_in_fresh_environments(tmp_path: Path) -> None:
    lines = install_lines()
    assert lines == ['pip install ".[client]"', "make dist", next(l for l in lines if ".whl" in l)], lines
    clone, deps = _clone(tmp_path), _dependencies(tmp_path)
    venv = Path(sys.executable).parents[1]

    from_clone = tmp_path / "from-clone"
    _pip_install(_fresh_venv(from_clone, deps), lines[0], clone)
    _check_installed(from_clone, tmp_path)

    # make dist with this environment (already set up: its stamp taken as it is)
    made = subprocess.run(["make", "dist", f"VENV={venv}", "-o", f"{venv}/.server-stamp"], cwd=clone,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    wheel = lines[2].removeprefix("pip install ").strip('"').split("[")[0]
    assert (clone / wheel).is_file(), f"{wheel}: not what make dist built ({made.stdout})"
    from_wheel = tmp_path / "from-wheel"
    _pip_install(_fresh_venv(from_wheel, deps), lines[2], clone)
    _check_installed(from_wheel, tmp_path)


def test_the_readme_names_every_core_dependency_make_serve_installs() -> None:
    import tomllib

    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=\[ ;]", requirement)[0].lower().replace("_", "-") for requirement in core}
    text = (ROOT / "README.md").read_text()
    said = text[text.index("- `make serve` installs the server alone"):text.index("- `make test` (and `make setup`")]
    said = said.lower().replace("_", "-")
    missing = sorted(name for name in names if name not in said)
    assert not missing, f"README's set-up leaves out core dependencies: {missing}"
