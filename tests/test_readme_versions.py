"""The README's "Versions" walk-through, run as written against a real server: a training loop
that checkpoints with an alias and keep_last, a resume from the alias, and the blessing of the
newest checkpoint for serving; its output checked against the ``text`` block after it."""

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


def walkthrough() -> tuple[str, str]:
    """The walk-through's Python block and the output the README shows for it."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Versions"):]
    found = re.search(r"A walk-through that runs as written.*?```python\n(.*?)```\n\n```text\n(.*?)```", section, re.S)
    assert found, "README: the Versions walk-through and its output block"
    return found.group(1), found.group(2)


def test_the_versions_walkthrough_runs_as_written(tmp_path: Path) -> None:
    code, expected = walkthrough()
    with running_server(tmp_path) as server:
        script = tmp_path / "walkthrough.py"
        script.write_text(code.replace("localhost:50051", server.target))
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANNERY_")}
        done = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout == expected
