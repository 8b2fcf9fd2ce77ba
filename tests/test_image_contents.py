"""docker/Dockerfile and .dockerignore hold every package `pip install .` holds (issue 35).

The image once left out ``tannery_protocol`` (the Dockerfile copied two package folders by name)
and its server died at start. These checks need no container engine: they read
``[tool.setuptools.packages.find]`` from pyproject.toml, find its packages as setuptools does,
and hold the build context (.dockerignore, read with Docker's rules) and the build stage's
COPY and install steps to them. tests/test_container.py then builds and runs the image itself.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


def package_dirs() -> dict[str, Path]:
    """Every package of ``packages.find``: its dotted name -> its folder (a folder with an
    ``__init__.py`` under a "where", its parents packages too, as setuptools' find_packages)."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    found: dict[str, Path] = {}
    for where in find["where"]:
        base = ROOT / where
        for init in sorted(base.rglob("__init__.py")):
            folder = init.parent
            parts = folder.relative_to(base).parts
            if all((base.joinpath(*parts[:depth]) / "__init__.py").is_file() for depth in range(1, len(parts) + 1)):
                found[".".join(parts)] = folder
    return found


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex over a slash-separated path (Go's filepath.Match
    plus ``**``, as Docker's patternmatcher reads it)."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def ignored(path: str, lines: list[str]) -> bool:
    """Whether .dockerignore ``lines`` leave ``path`` (relative, slash-separated) out of the
    build context: the last pattern that matches the path or one of its parent folders decides."""
    prefixes = ["/".join(path.split("/")[:n]) for n in range(1, path.count("/") + 2)]
    verdict = False
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        pattern = line.lstrip("!").strip().strip("/")
        regex = _pattern_regex(pattern)
        if any(regex.match(prefix) for prefix in prefixes):
            verdict = not keep
    return verdict


def build_stage() -> list[tuple[str, list[str]]]:
    """The first stage of the Dockerfile: (instruction, its arguments) in order, continuation
    lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    steps: list[tuple[str, list[str]]] = []
    stages = 0
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            stages += 1
            if stages > 1:
                break
        steps.append((word.upper(), shlex.split(rest, comments=False)))
    return steps


def test_packages_find_names_every_package_folder():
    packages = package_dirs()
    assert {"tannery", "tannery_protocol", "tannery_server"} <= packages.keys(), sorted(packages)


def test_every_package_file_is_in_the_build_context():
    lines = DOCKERIGNORE.read_text().splitlines()
    left_out = []
    for name, folder in package_dirs().items():
        for source in sorted(folder.glob("*")):
            if source.is_file() and source.suffix in {".py", ".pyi", ".html", ".css", ".js", ".typed"}:
                rel = source.relative_to(ROOT).as_posix()
                if ignored(rel, lines):
                    left_out.append(f"{rel} (package {name})")
    assert not left_out, ".dockerignore leaves out files of the project's packages: " + ", ".join(left_out)


def test_what_pip_reads_is_in_the_build_context_and_the_rest_is_not():
    lines = DOCKERIGNORE.read_text().splitlines()
    for needed in ("pyproject.toml", "README.md", "constraints.txt"):
        assert not ignored(needed, lines), f".dockerignore leaves out {needed}, which pip install . reads"
    for heavy in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "docs/architecture.md",
                  "client/tannery/__pycache__/client.cpython-311.pyc", "tannery.egg-info/PKG-INFO"):
        assert ignored(heavy, lines), f".dockerignore lets {heavy} into the build context"


def test_the_build_stage_copies_the_context_whole_and_installs_it_with_pip():
    steps = build_stage()
    copies = [(i, args) for i, (word, args) in enumerate(steps) if word == "COPY"]
    installs = [i for i, (word, args) in enumerate(steps)
                if word == "RUN" and re.search(r"pip install (?:[^&|;]* )?\.(?:\s|$)", " ".join(args))]
    assert installs, "the build stage has no `pip install ... .` of the project"
    whole = [i for i, args in copies if args[:-1] == ["."] or "." in args[:-1]]
    assert whole and whole[0] < installs[-1], (
        "the build stage must COPY the whole context (COPY . .) before `pip install .`, so the "
        f"packages are those of pyproject.toml, not a list of its own: COPY steps {[a for _, a in copies]}")


@pytest.mark.parametrize("path, rules, expected", [
    ("client/tannery/x.py", ["*", "!client/"], False),
    ("client/tannery/x.py", ["*", "!client/tannery/"], False),
    ("protocol/tannery_protocol/x.py", ["*", "!client/tannery/"], True),
    ("client/tannery/__pycache__/a.pyc", ["*", "!client/", "**/__pycache__"], True),
    ("README.md", ["*"], True),
])
def test_the_dockerignore_reading_follows_dockers_rules(path, rules, expected):
    assert ignored(path, rules) is expected
