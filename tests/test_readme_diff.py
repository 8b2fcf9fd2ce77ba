"""The README's "Compare versions, trace an alias" blocks, run as written against a real server:
two versions of a model stored and an alias moved (the Python block), then tannery diff, log and
tag --back (the sh block), their output checked against the text block (times masked)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT
from .server_harness import running_server

#: Local times in tannery log: they differ from run to run.
_TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def blocks() -> tuple[str, str, str]:
    """The section's Python block, its sh block and the output the README shows for it."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Compare versions, trace an alias"):]
    found = re.search(r"```python\n(.*?)```\n\n```sh\n(.*?)```\n\n```text\n(.*?)```", section, re.S)
    assert found, "README: the diff and log blocks and their output"
    return found.group(1), found.group(2), found.group(3)


def test_the_diff_and_log_blocks_run_as_written(tmp_path: Path) -> None:
    code, commands, expected = blocks()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANNERY_")}
    with running_server(tmp_path) as server:
        script = tmp_path / "versions.py"
        script.write_text(code.replace("localhost:50051", server.target))
        done = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr
        env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", TANNERY_TARGET=server.target)
        shown = subprocess.run(["bash", "-e", "-c", commands], capture_output=True, text=True, env=env, cwd=tmp_path,
                               timeout=300)
        assert shown.returncode == 0, shown.stderr
    assert _TIME.sub("<time>", shown.stdout) == _TIME.sub("<time>", expected), shown.stdout
