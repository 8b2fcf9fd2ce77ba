"""Every command a message names exists: each ``tannery WORD`` in a string the client, the
server or the protocol can print (every string literal of their sources but docstrings: errors,
hints, remedies, help texts) names a subcommand whose ``tannery WORD --help`` succeeds. A hint
that sends a user to a command that is not there (issue 41: "tannery resolve") fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tannery.cli import main

from .conftest import ROOT

#: Words that follow "tannery" in prose, not as a command ("another tannery server", "no tannery
#: data directory", "a dtype tannery reads").
PROSE = frozenset({"server", "data", "reads"})
_NAMED = re.compile(r"\btannery ([a-z][\w-]*)")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants of ``tree`` (module, class and function docstrings)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def named_commands() -> dict[str, list[str]]:
    """Each word a printable string names as ``tannery WORD``, with where (file:line)."""
    named: dict[str, list[str]] = {}
    for top in ("client", "service", "protocol"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            tree = ast.parse(path.read_text(), str(path))
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                    for word in _NAMED.findall(node.value):
                        named.setdefault(word, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return named


NAMED = named_commands()


def test_the_scan_finds_the_hints_it_is_for() -> None:
    # the alias conflict's remedy (the server's) and the CLI's own hints are among what is walked
    assert {"resolve", "tag", "rm", "serve", "scrub", "ls"} <= set(NAMED)


@pytest.mark.parametrize("word", sorted(set(NAMED) - PROSE))
def test_each_command_a_message_names_parses(word: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([word, "--help"])
    out, err = capsys.readouterr()
    assert exited.value.code in (0, None), f"tannery {word} (named at {', '.join(NAMED[word])}): {err}"
    assert "usage:" in out
