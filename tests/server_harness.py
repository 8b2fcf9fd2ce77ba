"""The real tannery server for tests, on 127.0.0.1 with a free port and its own data directory.

Two ways to run it:

- :func:`running_server` starts it in this process, on an event loop in a background
  thread, and yields an :class:`InProcessServer` (``.target``, ``.data_dir``, ``.config``,
  ``.stop()``, ``.archives()``, ``.channel()``, and ``.storage`` and ``.hub`` for white-box
  checks)::

      with running_server(tmp_path, chunk_size=4096) as server:
          stub = server.archives()

- :class:`ServerProcess` runs ``python -m tannery_server serve`` as a subprocess, for
  restarts, kill -9, signals and resource limits::

      with ServerProcess(tmp_path / "data") as proc:
          ...; proc.kill()      # SIGKILL
      proc.start()              # same data directory, a new port

Helpers for raw stubs: :func:`store_requests` splits payloads into ``StoreRequest``s and
:func:`collect_fetch` gathers a ``Fetch`` stream back into payloads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import grpc

from tannery_protocol.v1 import archives_pb2, archives_pb2_grpc

HOST = "127.0.0.1"


class InProcessServer:
    """A server started by :func:`running_server`."""

    def __init__(self, config: Any) -> None:
        from tannery_server import app

        self.config = config
        self.data_dir: Path = config.data_dir
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tannery-test-server", daemon=True)
        self._thread.start()
        try:
            self._running = self._call(app.start(config))
        except BaseException:
            self._close_loop()
            raise
        self.port: int = self._running.port
        self.target = f"{HOST}:{self.port}"
        self._channels: list[grpc.Channel] = []

    def _call(self, coroutine, timeout: float | None = 60) -> Any:
        """Run ``coroutine`` on the server's loop; past ``timeout``, every thread's stack and the
        loop's tasks are printed (a hung stop says where it hangs), then TimeoutError."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            import faulthandler
            import sys

            print(f"server_harness: {coroutine} took over {timeout} s; the threads and tasks now:", file=sys.stderr)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            for task in asyncio.all_tasks(self._loop):
                task.print_stack(limit=8, file=sys.stderr)
            raise

    @property
    def storage(self):
        """The server's :class:`tannery_server.storage.Storage` (for white-box checks)."""
        return self._running.storage

    @property
    def data_paths(self):
        """The server's :class:`tannery_server.dataplane.listeners.DataPaths` (its socket, data port and
        the tickets waiting; for white-box checks)."""
        from tannery_server.dataplane.listeners import DataPaths

        for close in self._running._closers:
            if isinstance(getattr(close, "__self__", None), DataPaths):
                return close.__self__
        raise AssertionError("this server has no data paths")

    @property
    def hub(self):
        """The Channels servicer's :class:`tannery_server.hub.Hub` (for white-box checks:
        ``.subscribers``, ``.dropped_subscribers``, ``.channels``)."""
        if self._running.channels is None:
            raise AssertionError("this server has no Channels service")
        return self._running.channels.hub

    @property
    def metrics_port(self) -> int | None:
        """Port of the server's metrics endpoint (None when metrics are off)."""
        return self._running.metrics_port

    def channel(self) -> grpc.Channel:
        """A new channel to the server, closed by :meth:`stop`."""
        channel = grpc.insecure_channel(self.target)
        self._channels.append(channel)
        return channel

    def archives(self) -> archives_pb2_grpc.ArchivesStub:
        return archives_pb2_grpc.ArchivesStub(self.channel())

    def stop(self, grace: float | None = 5.0) -> None:
        """Drain and stop the server (idempotent) and close the channels it handed out."""
        if self._loop.is_closed():
            return
        for channel in self._channels:
            channel.close()
        try:
            with _waking(self.metrics_port):
                self._call(self._running.stop(grace))
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()


@contextmanager
def _waking(port: int | None) -> Iterator[None]:
    """While the body runs, connect to ``port`` now and then (an HTTP server's that is stopping).

    The metrics endpoint (prometheus_client's ``start_http_server``) checks for its shutdown
    every 0.5 s, between waits for a connection: each stop of a test server waited that long
    (2 minutes of a quick run). A connection ends the wait at once; the stop is otherwise the same.
    """
    if port is None:
        yield
        return
    import socket

    done = threading.Event()

    def knock() -> None:
        while not done.is_set():
            try:
                socket.create_connection((HOST, port), timeout=0.2).close()
            except OSError:  # closed already
                pass
            done.wait(0.01)

    knocker = threading.Thread(target=knock, name="tannery-test-metrics-waker", daemon=True)
    knocker.start()
    try:
        yield
    finally:
        done.set()
        knocker.join(5)


def free_port() -> int:
    """A TCP port on HOST that nothing listens on now (for a test that names the port itself)."""
    import socket

    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


@contextmanager
def running_server(tmp_path: Path, **config: Any) -> Iterator[InProcessServer]:
    """A server in this process with data in ``tmp_path / "data"`` (or ``data_dir=``): gRPC, the
    data port and metrics each on a free port the OS picks (unless ``config`` says otherwise)."""
    from tannery_server.config import Config

    config.setdefault("data_dir", Path(tmp_path) / "data")
    server = InProcessServer(Config(host=HOST, **{"port": 0, "data_port": 0, "metrics_port": 0,
                                                  "grace_seconds": 5.0, **config}))
    try:
        yield server
    finally:
        server.stop()


class ServerProcess:
    """``python -m tannery_server serve`` in a subprocess: gRPC, the data port and metrics each on
    a free port the OS picks, unless ``config`` or ``env`` says otherwise.

    ``config`` keys are flags (``chunk_size=4096`` is ``--chunk-size 4096``);
    ``fsize_limit`` sets RLIMIT_FSIZE in the child, so writes past it fail with EFBIG.
    Output (the log) is collected in :attr:`log_lines`.
    """

    def __init__(self, data_dir: Path, *, fsize_limit: int | None = None, env: Mapping[str, str] | None = None,
                 **config: Any) -> None:
        self.data_dir = Path(data_dir)
        self.fsize_limit = fsize_limit
        self.env = dict(env) if env is not None else None
        self.config = config
        self.process: subprocess.Popen | None = None
        self.target = ""
        self.log_lines: list[str] = []
        self._reader: threading.Thread | None = None

    def command(self) -> list[str]:
        args = [sys.executable, "-m", "tannery_server", "serve", "--host", HOST, "--port", "0",
                "--data-dir", str(self.data_dir)]
        for key, value in self.config.items():
            args += ["--" + key.replace("_", "-"), str(value)]
        if self.fsize_limit is not None:
            # The limit set by a small Python that then becomes the server (exec), not by a
            # preexec_fn: that makes Popen fork, and a fork while another thread of the test
            # process is in gRPC can kill the child before exec ("epoll_wait error: Bad file
            # descriptor", grpc/grpc#43055).
            limit = (f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, "
                     f"({self.fsize_limit}, {self.fsize_limit})); os.execv(sys.executable, sys.argv[1:])")
            args = [sys.executable, "-c", limit, *args]
        return args

    def environment(self) -> dict[str, str]:
        """The server's environment: the caller's, with the data port and metrics on free ports
        and the socket in its own data directory (over any TANNERY_* naming them there) unless
        this server's own ``env`` names them."""
        return {**os.environ, "TANNERY_DATA_PORT": "auto", "TANNERY_METRICS_PORT": "auto", "TANNERY_SOCKET": "",
                **(self.env or {})}

    def start(self, timeout: float = 60) -> "ServerProcess":
        env = self.environment()
        self.log_lines = []
        ready = threading.Event()
        self.process = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                        text=True)

        def read(stream) -> None:
            for line in stream:
                self.log_lines.append(line.rstrip("\n"))
                match = re.search(r"serving on (\S+):(\d+)", line)
                if match:
                    self.target = f"{HOST}:{match.group(2)}"
                    ready.set()
            ready.set()

        self._reader = threading.Thread(target=read, args=(self.process.stdout,), daemon=True)
        self._reader.start()
        if not ready.wait(timeout) or not self.target:
            self.kill()
            raise RuntimeError("the server did not start:\n" + "\n".join(self.log_lines))
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def archives(self) -> archives_pb2_grpc.ArchivesStub:
        return archives_pb2_grpc.ArchivesStub(grpc.insecure_channel(self.target))

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        assert self.process is not None
        code = self.process.wait(timeout)
        if self._reader is not None:
            self._reader.join(10)
        return code

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM and wait: the exit code (0 after a graceful shutdown)."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: the server dies at once, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start() if self.process is None or self.process.poll() is not None else self

    def __exit__(self, *exc: Any) -> None:
        self.kill()


def store_requests(
    archive: str, entries: Mapping[str, bytes] | Iterable[tuple[str, bytes]], chunk_size: int = 1 << 20,
    replace: bool = False, commit: bool = True,
) -> Iterator[archives_pb2.StoreRequest]:
    """The ``StoreRequest``s of an archive: begin, then each entry's name with its payload in
    chunks, then the commit with the counts (``commit=False`` leaves it out)."""
    yield archives_pb2.StoreRequest(begin=archives_pb2.StoreBegin(archive=archive, replace=replace))
    items = entries.items() if isinstance(entries, Mapping) else entries
    count = sent = 0
    for name, payload in items:
        view = memoryview(payload).cast("B")
        first = True
        for start in range(0, max(len(view), 1), chunk_size):
            chunk = bytes(view[start : start + chunk_size])
            yield archives_pb2.StoreRequest(entry=name, chunk=chunk) if first else archives_pb2.StoreRequest(chunk=chunk)
            first = False
            sent += len(chunk)
        count += 1
    if commit:
        yield commit_request(count, sent)


def commit_request(entries: int, payload_bytes: int) -> archives_pb2.StoreRequest:
    """The last ``StoreRequest`` of a Store: the client's word that it sent ``entries`` entries
    of ``payload_bytes`` bytes in all."""
    return archives_pb2.StoreRequest(commit=archives_pb2.StoreCommit(entries=entries, payload_bytes=payload_bytes))


def collect_fetch(responses: Iterable[archives_pb2.FetchResponse]) -> dict[str, bytes]:
    """The payloads of a ``Fetch`` stream, by entry name, in the order they came."""
    out: dict[str, bytearray] = {}
    current = None
    for response in responses:
        if response.entry:
            current = out.setdefault(response.entry, bytearray())
        assert current is not None, "payload bytes before any entry name"
        current += response.chunk
    return {name: bytes(data) for name, data in out.items()}


def wait_for(condition, timeout: float = 10, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


@contextmanager
def mounted_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``6m``, or bytes) mounted at ``mount_point`` (created), unmounted at the end:
    a small disk to fill. Skips the test unless the mount works (it needs root)."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount_point.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


class CallLog(logging.Handler):
    """The fields of every call the in-process servers log (``tannery_server.calls``); add it to
    that logger at INFO."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", None)
        if fields:
            self.records.append(dict(fields))

    def of(self, method: str, archive: str) -> list[dict[str, Any]]:
        """The logged calls of ``method`` on ``archive``, in order."""
        return [r for r in self.records if r["method"] == method and r.get("archive") == archive]

    def last(self, method: str, archive: str) -> dict[str, Any]:
        """The last logged call of ``method`` on ``archive`` (waits for its line: the log is
        written once the handler has returned, after the client has its answer)."""
        assert wait_for(lambda: bool(self.of(method, archive)), timeout=5), f"no {method} of {archive!r} in the call log"
        return self.of(method, archive)[-1]
