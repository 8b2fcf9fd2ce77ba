"""The ``tannery`` command as a separate process: the installed script, ``serve`` without
torch, failures and Ctrl-C without tracebacks, progress bars on a terminal, and two
processes streaming tensors through a channel."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

SCRIPT = Path(sys.executable).with_name("tannery")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANNERY_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def tannery(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "tannery.cli"]
    return subprocess.run([*command, *argv], capture_output=True, text=True, timeout=timeout, env=_env())


def spawn(*argv: str, interruptible: bool = False) -> subprocess.Popen:
    """``tannery argv`` as a process with pipes. ``interruptible``: SIGINT back to its default
    first, through a small wrapper that then execs the command (a suite run as a background job
    ignores SIGINT, and a child inherits that; ``preexec_fn`` is unsafe beside gRPC's threads)."""
    command = [sys.executable, "-m", "tannery.cli", *argv]
    if interruptible:
        command = [sys.executable, "-c", _WITH_SIGINT, *command]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


#: Runs ``argv[1:]`` with SIGINT at its default disposition (which exec keeps).
_WITH_SIGINT = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"


def _read_line(stream, timeout: float = 60) -> str:
    """The next line of ``stream`` within ``timeout`` seconds. A thread reads it: ``select`` on
    the pipe misses a line the text wrapper already holds (two lines written together are read
    in one go), and waited for the next write, or 60 s."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert got, "no line in time"
    return got[0]


# Blocks the client extra (torch, safetensors, rich: what the server image lacks) from being
# imported, then runs the command.
_WITHOUT_TORCH = """
import sys
import threading
for name in ("torch", "safetensors", "rich"):
    sys.modules[name] = None  # any import of it now raises ImportError
from tannery.cli import main
code = main(sys.argv[1:])
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None], "torch was imported"
sys.exit(code)
"""


@pytest.mark.parametrize("argv", [["serve", "--help"], ["--help"], ["ls", "--help"], ["push", "--help"]])
def test_help_needs_no_torch(argv: list[str]) -> None:
    result = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *argv], capture_output=True, text=True,
                            timeout=60, env=_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: tannery") and result.stderr == ""
    if argv[0] == "serve":
        assert "--data-dir" in result.stdout


def test_a_client_command_without_torch_says_which_extra_to_install(tmp_path: Path) -> None:
    """The server image has no torch: a client subcommand that makes tensors (publish reads
    its files into torch tensors) names the remedy there, in one line."""
    np.save(tmp_path / "x.npy", np.zeros(3, np.float32))
    result = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH.replace('assert "torch"', "# "), "publish", "c",
                             str(tmp_path / "x.npy")], capture_output=True, text=True, timeout=60, env=_env())
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == ["tannery publish: error: torch is not installed, and this command needs it",
                                          'hint: install the client extra: pip install ".[client]" in a clone of tannery, or '
                                          'the wheel make dist builds with [client] (README: "Install without make")']


def test_serve_runs_without_torch(tmp_path: Path) -> None:
    """`tannery serve` itself starts (and stops on SIGTERM) with torch unimportable."""
    process = subprocess.Popen(
        [sys.executable, "-c", _WITHOUT_TORCH, "serve", "--host", "127.0.0.1", "--port", "0", "--data-dir",
         str(tmp_path / "data"), "--metrics", "off"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:
            line = _read_line(process.stdout, max(0.1, deadline - time.monotonic()))
            lines.append(line)
            if "serving on" in line or not line:
                break
        served = [re.search(r"serving on (127\.0\.0\.1:\d+)", line) for line in lines]
        target = next(m.group(1) for m in served if m)
        # A call answered means the server's loop runs, past installing its signal handlers.
        from tannery import Client

        with Client(target) as client:
            assert client.list() == []
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        process.kill()
        process.wait()


def test_the_installed_script_and_version() -> None:
    """``[project.scripts]`` names ``tannery``, and installing the project (``make test``'s
    setup) put that script beside this Python: no fallback to ``python -m tannery.cli``."""
    import tomllib

    import tannery as package

    from .conftest import ROOT

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("scripts", {})
    assert scripts.get("tannery") == "tannery.cli:main", f"pyproject.toml's [project.scripts]: {scripts}"
    assert SCRIPT.is_file(), f"no {SCRIPT}: the project is not installed with its script (run make setup)"
    result = subprocess.run([str(SCRIPT), "--version"], capture_output=True, text=True, timeout=120, env=_env())
    assert (result.returncode, result.stdout, result.stderr) == (0, f"tannery {package.__version__}\n", "")


def test_unreachable_server_exits_1_with_the_remedy() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{s.getsockname()[1]}"
    result = tannery("show", "model", "--target", target, "--retries", "1")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines()[0].startswith(
        f"tannery: Describe of 'model': cannot reach the server at {target} (connection refused); retry 1 of 1 in ")
    assert result.stderr.splitlines()[1:] == [
        f"tannery show: error: cannot reach the server at {target} (connection refused)",
        f"hint: is a server running at {target} (given by --target)? Start one with 'tannery serve', "
        "or give its address with --target HOST:PORT (or TANNERY_TARGET)"]


def test_usage_error_exits_2() -> None:
    result = tannery("pull", "model")
    assert result.returncode == 2 and "the following arguments are required: -o/--output" in result.stderr


@pytest.mark.slow
def test_ctrl_c_exits_130_without_a_traceback(server) -> None:
    process = spawn("subscribe", "nobody-publishes", "--target", server.target, interruptible=True)
    try:
        assert _read_line(process.stderr).startswith("subscribed to nobody-publishes")
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130
    assert err == "tannery: interrupted\n" and out == ""


@pytest.mark.slow
def test_two_processes_stream_through_a_channel(server, tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(12, dtype=np.float32).reshape(3, 4))
    torch.save({"x": torch.ones(2, 2, dtype=torch.bfloat16), "y": torch.tensor([1, 2, 3])}, tmp_path / "b.pt")
    subscriber = spawn("subscribe", "pipe", "-n", "3", "-o", str(tmp_path / "got"), "--target", server.target)
    try:
        assert _read_line(subscriber.stderr) == "subscribed to pipe; waiting for 3 tensors\n"
        published = tannery("publish", "pipe", str(tmp_path / "a.npy"), str(tmp_path / "b.pt"),
                            "--target", server.target)
        assert published.returncode == 0, published.stderr
        assert published.stdout == "published 3 tensors (80 B) on pipe\n"
        out, err = subscriber.communicate(timeout=60)
    finally:
        subscriber.kill()
    assert subscriber.returncode == 0, err
    got = tmp_path / "got"
    assert out.splitlines() == [f"000000  float32  [3, 4]  48 B  {got / '000000.npy'}",
                                f"000001  bfloat16  [2, 2]  8 B  {got / '000001.pt'}",
                                f"000002  int64  [3]  24 B  {got / '000002.npy'}"]
    assert np.array_equal(np.load(got / "000000.npy"), np.arange(12, dtype=np.float32).reshape(3, 4))
    assert torch.equal(torch.load(got / "000001.pt", weights_only=True), torch.ones(2, 2, dtype=torch.bfloat16))
    assert np.array_equal(np.load(got / "000002.npy"), [1, 2, 3])


def _on_a_terminal(argv: list[str], timeout: float = 120) -> tuple[int, str]:
    """Run ``tannery argv`` with stdout and stderr on a pseudo-terminal: (status, what it showed)."""
    controller, terminal = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "tannery.cli", *argv], stdin=subprocess.DEVNULL,
                               stdout=terminal, stderr=terminal, env={**_env(), "COLUMNS": "120", "TERM": "xterm"})
    os.close(terminal)
    shown = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], 0.5)
        if ready:
            try:
                data = os.read(controller, 65536)
            except OSError:  # the process closed the terminal
                break
            if not data:
                break
            shown += data
        elif process.poll() is not None:
            break
    os.close(controller)
    return process.wait(30), shown.decode("utf-8", "replace")


@pytest.mark.slow
def test_progress_bars_on_a_terminal(server, tmp_path: Path) -> None:
    import safetensors.torch

    safetensors.torch.save_file({"w": torch.zeros(1024, 1024)}, tmp_path / "m.safetensors")
    code, shown = _on_a_terminal(["push", str(tmp_path / "m.safetensors"), "--as", "m", "--target", server.target])
    assert code == 0, shown
    assert "push m" in shown and "4.0/4.0 MiB" in shown and "/s" in shown
    assert "pushed " in shown
    code, shown = _on_a_terminal(["pull", "m", "-o", str(tmp_path / "back.safetensors"), "--target", server.target])
    assert code == 0 and "pull m" in shown and "4.0/4.0 MiB" in shown
    code, shown = _on_a_terminal(["pull", "m", "-o", str(tmp_path / "quiet.safetensors"), "--quiet",
                                  "--target", server.target])
    # --quiet: no bar; the result still prints.
    assert (code, shown) == (0, f"pulled m into {tmp_path / 'quiet.safetensors'}: 1 entry, 4.0 MiB\r\n")
