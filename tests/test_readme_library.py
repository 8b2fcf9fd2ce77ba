"""The README's library example, run as written against a real server: a whole training state
(a model, AdamW, a scheduler, three RNG states) as an archive, in a safetensors file and a .tannic
pair, stored through the client without skip_non_tensors, and restored from ``to_value()``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import tannery

from .conftest import ROOT
from .server_harness import running_server


def example() -> str:
    """The Python block of the README's Archives paragraph."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("**Archives** (`tannery.Archive`)"):]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, "README: the Archives example"
    return found.group(1)


def test_the_library_example_runs_as_written(tmp_path: Path) -> None:
    code = example()
    assert "skip_non_tensors" not in code and "client.store(" in code and ".to_value()" in code
    with running_server(tmp_path) as server:
        script = tmp_path / "example.py"
        script.write_text(code.replace("localhost:50051", server.target))
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANNERY_")}
        done = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr
        with tannery.Client(server.target) as client:
            assert client.describe("runs/8/step-1").values[0].entry == "@values"
