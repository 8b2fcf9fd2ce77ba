"""The README's quick start, run block by block as a new user would (the ``sh`` blocks in a
shell, against a real server), each block's output checked against the ``text`` block that
follows it, and the directory checked to be as empty at the end as it was at the start; then
followed again, top to bottom, against the same server, with the same output."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT
from .server_harness import running_server

README = ROOT / "README.md"
#: Creation times in ``tannery ls``: they differ from run to run.
_TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def quickstart_blocks() -> list[tuple[str, str]]:
    """The (kind, text) of each fenced block of the README's quick start, in order."""
    text = README.read_text()
    section = text[text.index("## Quick start"): text.index("## The Python library")]
    return re.findall(r"```(sh|text)\n(.*?)```", section, re.S)


def _commands(block: str) -> str:
    """A block's commands, less what the test does itself (make serve: the test's server;
    make setup: this interpreter's environment, set up by make test; activating .venv: this
    interpreter's bin directory is first on PATH)."""
    skipped = ("make serve", "make setup", ". .venv/bin/activate")
    return "".join(line + "\n" for line in block.splitlines() if line.strip() not in skipped)


def _same(shown: str, expected: str) -> bool:
    return _TIME.sub("<time>", shown).rstrip("\n") == _TIME.sub("<time>", expected).rstrip("\n")


def _follow(scratch: Path, env: dict[str, str]) -> None:
    """Run the quick start's blocks in order in ``scratch``, each output checked."""
    blocks = quickstart_blocks()
    subscriber = None
    index = 0
    while index < len(blocks):
        kind, block = blocks[index]
        assert kind == "sh", f"block {index}: a text block with no commands before it"
        commands = _commands(block)
        expected = blocks[index + 1][1] if index + 1 < len(blocks) and blocks[index + 1][0] == "text" else None
        index += 2 if expected is not None else 1
        if not commands.strip():
            continue
        if "tannery subscribe" in commands:  # terminal 3: runs while the next block publishes
            subscriber = subprocess.Popen(["bash", "-c", commands], cwd=scratch, env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            ready, _, _ = select.select([subscriber.stderr], [], [], 120)
            assert ready, "subscribe printed nothing"
            assert expected is not None and _same(subscriber.stderr.readline(), expected)
            continue
        result = subprocess.run(["bash", "-c", commands], cwd=scratch, env=env, text=True, timeout=300,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert result.returncode == 0, f"{commands}\n{result.stdout}"
        if subscriber is not None:  # the block after subscribe: its output is the subscriber's
            out, err = subscriber.communicate(timeout=120)
            assert subscriber.returncode == 0, err
            assert expected is not None and _same(out, expected), out
            subscriber = None
            continue
        if expected is not None:
            assert _same(result.stdout, expected), f"{commands}\n--- shown:\n{result.stdout}--- in the README:\n{expected}"


@pytest.mark.slow
def test_the_quick_start_runs_as_written_and_cleans_up_twice(tmp_path: Path) -> None:
    scratch = tmp_path / "clone"
    scratch.mkdir()
    with running_server(tmp_path) as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANNERY_")}
        env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", TANNERY_TARGET=server.target,
                   PYTHONUNBUFFERED="1")
        from tannery import Client

        for run in (1, 2):
            _follow(scratch, env)
            with Client(server.target) as client:
                assert client.list() == [], f"run {run}: the quick start left archives behind"
            assert sorted(p.name for p in scratch.iterdir()) == [], f"run {run}: the quick start left files behind"
