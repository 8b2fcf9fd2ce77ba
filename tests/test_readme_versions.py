"""The README's "Versions" walk-through, run as written against a real server, twice in a row
(its first lines remove what a run before it left): a training loop that checkpoints with an
alias and keep_last, a resume from the alias, and the blessing of the newest checkpoint for
serving; its output checked against the ``text`` block after it each time, and torch's warnings
on stderr against the block the README shows them in."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT
from .server_harness import running_server

pytestmark = pytest.mark.slow


def walkthrough() -> tuple[str, str, list[str]]:
    """The walk-through's Python block, the output the README shows for it and the warnings it
    says torch prints."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Versions"):]
    found = re.search(r"A walk-through that runs as written.*?```python\n(.*?)```\n\n```text\n(.*?)```\n\n"
                      r"On stderr, torch.*?```text\n(.*?)```", section, re.S)
    assert found, "README: the Versions walk-through, its output block and torch's warnings"
    return found.group(1), found.group(2), found.group(3).splitlines()


def test_the_versions_walkthrough_runs_as_written_twice(tmp_path: Path) -> None:
    code, expected, warnings = walkthrough()
    with running_server(tmp_path) as server:
        script = tmp_path / "walkthrough.py"
        script.write_text(code.replace("localhost:50051", server.target))
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANNERY_") and k != "PYTHONWARNINGS"}
        for run in (1, 2):
            done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                                  env=env, cwd=tmp_path, timeout=300)
            assert done.returncode == 0, f"run {run}: {done.stderr}"
            assert done.stdout == expected, f"run {run}"
            shown = [line.split(": ", 1)[1] for line in done.stderr.splitlines() if "Warning: " in line]
            assert shown == warnings, f"run {run}: {done.stderr}"
