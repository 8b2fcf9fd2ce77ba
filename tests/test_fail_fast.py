"""A forgotten server fails fast at a terminal: when stderr is a terminal (a pty here) and the
command has not reached the server yet, a refused connection is an error at once, with its
hint, not after 6 to 12 s of retries. ``--retries`` overrides that; a script (stderr not a
terminal) and every call after the server first answered keep their retries."""

from __future__ import annotations

import logging
import os
import pty
import select
import subprocess
import sys
import time

import pytest

import tannery
from tannery.rpc.retries import RetryPolicy

from .server_harness import ServerProcess, free_port


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TANNERY_")}


def _at_a_terminal(*argv: str) -> tuple[int, str, float]:
    """Run ``tannery argv`` with stderr on a pty: its exit status, what it wrote there, and
    how long it took."""
    master, slave = pty.openpty()
    began = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "tannery.cli", *argv], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=slave, env=_env())
    os.close(slave)
    shown = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 60)
            assert ready, f"tannery {' '.join(argv)}: silent for 60 s"
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the process closed its end
                break
            if not data:
                break
            shown += data
        code = process.wait(60)
    finally:
        process.kill()
        os.close(master)
    return code, shown.decode().replace("\r\n", "\n"), time.monotonic() - began


def test_at_a_terminal_a_server_never_reached_fails_within_2_s_with_the_hint() -> None:
    target = f"127.0.0.1:{free_port()}"
    code, shown, took = _at_a_terminal("ls", "--target", target)
    assert code == 1 and took < 2.0, (took, shown)
    assert shown.splitlines() == [
        f"tannery ls: error: cannot reach the server at {target} (connection refused)",
        f"hint: is a server running at {target} (given by --target)? Start one with 'tannery serve', or give its "
        "address with --target HOST:PORT (or TANNERY_TARGET)"]


def test_at_a_terminal_retries_given_are_made() -> None:
    target = f"127.0.0.1:{free_port()}"
    code, shown, _ = _at_a_terminal("ls", "--target", target, "--retries", "1")
    assert code == 1 and "retry 1 of 1" in shown and "error: cannot reach the server" in shown, shown


def test_a_script_keeps_its_retries() -> None:
    process = subprocess.Popen([sys.executable, "-m", "tannery.cli", "ls", "--target", f"127.0.0.1:{free_port()}"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=_env())
    try:
        assert "retry 1 of 5" in process.stderr.readline()  # stderr a pipe: the default 5 retries
    finally:
        process.kill()
        process.wait(60)


def test_after_the_first_answer_a_lost_server_is_retried(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tannery.client")
    quick = dict(first_delay=0.01, max_delay=0.02, until_reached=True)
    with ServerProcess(tmp_path / "data", port=free_port()) as server:
        with tannery.Client(server.target, retries=RetryPolicy(2, **quick)) as client:
            assert client.list() == []  # the server answered once
            server.kill()
            with pytest.raises(tannery.Unavailable, match="gave up after 2 retries"):
                client.list()
        assert sum("retry" in r.getMessage() for r in caplog.records) == 2
        caplog.clear()
        with tannery.Client(server.target, retries=RetryPolicy(2, **quick)) as never:
            with pytest.raises(tannery.Unavailable) as failed:
                never.list()
        assert "gave up" not in str(failed.value) and not caplog.records  # never reached: no retry
