"""The README's aliases walk-through ("Aliases and retention"), run as written against a real
server, twice in a row (its first lines remove what a run before it left): the Python block,
then the command-line block in a shell, each output checked against the ``text`` block after it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT
from .server_harness import running_server
from .test_readme_quickstart import _same

pytestmark = pytest.mark.slow


def walkthrough() -> tuple[str, str, str, str]:
    """The Python block and its output, the shell block and its output."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Aliases and retention"):text.index("**Watching an alias.**")]
    found = re.search(r"```python\n(.*?)```\n\n```text\n(.*?)```\n\n```sh\n(.*?)```\n\n```text\n(.*?)```", section, re.S)
    assert found, "README: the aliases walk-through (python, text, sh, text blocks)"
    return found.group(1), found.group(2), found.group(3), found.group(4)


def test_the_aliases_walkthrough_runs_as_written_twice(tmp_path: Path) -> None:
    code, expected, commands, shown = walkthrough()
    with running_server(tmp_path) as server:
        script = tmp_path / "aliases.py"
        script.write_text(code.replace("localhost:50051", server.target))
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANNERY_")}
        env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", TANNERY_TARGET=server.target)
        for run in (1, 2):
            done = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True,
                                  env=env, cwd=tmp_path, timeout=120)
            assert done.returncode == 0, f"run {run}: {done.stderr}"
            assert done.stdout == expected, f"run {run}"
            done = subprocess.run(["bash", "-c", commands], capture_output=True, text=True, env=env, cwd=tmp_path,
                                  timeout=120)
            assert done.returncode == 0, f"run {run}: {done.stderr}"
            assert _same(done.stdout, shown), f"run {run}:\n{done.stdout}"
