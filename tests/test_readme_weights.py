"""The README's weight-sync example, run as written, twice in a row against one server (its
clean-up first each time): two worker processes follow "policy" while the trainer pushes four
versions; each worker ends on version 3, in order, and holds the trainer's last weights, cast
to bf16."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import ROOT
from .server_harness import running_server

pytestmark = pytest.mark.slow


def blocks() -> tuple[str, str, str, str]:
    """The clean-up's, the worker's and the trainer's Python blocks and the output the README shows."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Weight sync: a trainer and its fleet"):]
    found = re.search(r"```python\n(# clean\.py.*?)```\n\n```python\n(# worker\.py.*?)```\n\n"
                      r"```python\n(# trainer\.py.*?)```\n\n```text\n(.*?)```", section, re.S)
    assert found, "README: the weight-sync clean-up, worker, trainer and output blocks"
    return found.group(1), found.group(2), found.group(3), found.group(4)


def _run(server, tmp_path: Path, env: dict[str, str]) -> tuple[list[tuple[str, str]], list]:
    """The clean-up, then two workers and the trainer: each worker's output, and the trainer's last weights."""
    done = subprocess.run([sys.executable, "-W", "ignore", "clean.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    workers = [subprocess.Popen([sys.executable, "-W", "ignore", "worker.py"], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 60  # both workers following (subscribed) before the trainer starts
        while server.hub.subscribers < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in workers), "workers not ready"
            time.sleep(0.05)
        done = subprocess.run([sys.executable, "-W", "ignore", "trainer.py"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        trained = eval(done.stdout.strip().splitlines()[-1])
        return [process.communicate(timeout=60) for process in workers], trained
    finally:
        for process in workers:
            process.kill()


def test_the_weight_sync_example_runs_as_written_twice(tmp_path: Path) -> None:
    import torch

    clean, worker, trainer, expected = blocks()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANNERY_")}
    with running_server(tmp_path) as server:
        (tmp_path / "clean.py").write_text(clean.replace("localhost:50051", server.target))
        for name, code in (("worker.py", worker), ("trainer.py", trainer)):
            shown = "\nprint(model.weight.tolist())\n"  # what each holds at the end, to compare
            (tmp_path / name).write_text(code.replace("localhost:50051", server.target) + shown)
        for run in (1, 2):
            outputs, trained = _run(server, tmp_path, env)
            for out, err in outputs:
                *served, weights = out.strip().splitlines()
                assert served == expected.strip().splitlines(), f"run {run}: {err}"  # every version, in order, whole
                assert torch.equal(torch.tensor(eval(weights)), torch.tensor(trained).to(torch.bfloat16).float())
