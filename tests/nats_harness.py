"""A private NATS server for the tests: Debian's ``nats-server`` on 127.0.0.1 and a free port,
which a test may stop and start again on the same port (``make test`` installs it when absent).

It runs with a ``max_payload`` of :data:`MAX_PAYLOAD` (256 KiB, below NATS's 1 MiB default) so
that the tests' payloads of a few MiB cross it in many chunks.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

MAX_PAYLOAD = 256 << 10


def nats_server_bin() -> str | None:
    """The ``nats-server`` binary (PATH, then Debian's /usr/sbin), or None when not installed."""
    return shutil.which("nats-server") or (str(Path("/usr/sbin/nats-server"))
                                           if Path("/usr/sbin/nats-server").is_file() else None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class NatsServer:
    """One nats-server: :meth:`start`, :meth:`stop` and :meth:`start` again on the same port."""

    def __init__(self, binary: str | None = None, max_payload: int = MAX_PAYLOAD) -> None:
        found = binary or nats_server_bin()
        if found is None:
            raise FileNotFoundError("nats-server not found: install Debian's nats-server package")
        self.binary = found
        self.root = Path(tempfile.mkdtemp(prefix="tannery-nats-"))
        self.port = _free_port()
        self.max_payload = max_payload
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10) -> "NatsServer":
        config = self.root / "nats.conf"
        config.write_text(f"listen: 127.0.0.1:{self.port}\nmax_payload: {self.max_payload}\n")
        self.process = subprocess.Popen([self.binary, "-c", str(config)], stdout=subprocess.DEVNULL,
                                        stderr=open(self.root / "server.log", "ab"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode}: "
                                   + (self.root / "server.log").read_text(errors="replace")[-2000:])
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nats-server did not listen on port {self.port} within {timeout} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
