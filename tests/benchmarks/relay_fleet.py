"""A fleet on simulated hosts (:mod:`tests.netns`), for the relay benchmark and tests: a server and
a trainer in host 0's namespace, one weight worker per other host, every link shaped. The
workers reach the server over TCP (its same-host socket is off: the shaped links are the path).

    with Hosts(5) as hosts, Fleet(hosts, tmp_path, size=64 << 20) as fleet:
        workers = [fleet.worker(i) for i in range(1, 5)]
        fleet.push(1)                 # the trainer's line: when the push started, the version's SHA-256
        fleet.applied(1, workers)     # each worker's line for version 1 (waited for)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from tests.netns import Hosts

#: Ports inside host 0's namespace (a fresh network namespace: nothing else listens there).
GRPC_PORT, DATA_PORT, METRICS_PORT, GLOO_PORT = 50051, 50052, 50053, 50054


class Proc:
    """A process whose stdout lines are read on a thread of its own (JSON ones parsed); its stderr
    goes to a file, shown when it fails."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, merged: bool = False) -> None:
        self.log = log
        self._stderr = open(log, "w")
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT if merged else self._stderr,
                                        text=True, env={**os.environ, **env})
        self.lines: list[Any] = []
        self._arrived = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            line = line.strip()
            try:
                item: Any = json.loads(line) if line.startswith("{") else line
            except ValueError:
                item = line
            with self._arrived:
                self.lines.append(item)
                self._arrived.notify_all()
        with self._arrived:
            self._arrived.notify_all()

    def wait_for(self, wanted: Callable[[Any], bool], timeout: float = 120, what: str = "a line") -> Any:
        """The first line ``wanted`` accepts (waited for); RuntimeError naming the process's
        stderr when it ends or the time passes first."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while True:
                found = next((line for line in self.lines if wanted(line)), None)
                if found is not None:
                    return found
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self._stderr.flush()
                    said = self.log.read_text()[-3000:] or "\n".join(map(str, self.lines[-30:]))
                    raise RuntimeError(f"{self.process.args[-6:]} gave no {what} (exit {self.process.poll()}): {said}")
                self._arrived.wait(0.5)

    def tell(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)
        self._stderr.close()


class Fleet:
    """The server, the trainer and the workers of one run, on ``hosts``."""

    def __init__(self, hosts: Hosts, workdir: Path, size: int, count: int = 16, name: str = "policy",
                 server_flags: dict[str, Any] | None = None) -> None:
        self.hosts, self.workdir, self.size, self.count, self.name = hosts, Path(workdir), size, count, name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.target = f"{hosts.address(0)}:{GRPC_PORT}"
        self.server_flags = server_flags or {}
        self.procs: list[Proc] = []
        self.server: Proc | None = None
        self.trainer: Proc | None = None

    def __enter__(self) -> Fleet:
        try:
            return self._start_all()
        except BaseException:
            self.close()
            raise

    def _start_all(self) -> Fleet:
        self.start_server()
        self.trainer = self._start("trainer", 0, ["-m", "tests.benchmarks.relay_trainer", self.target, self.name,
                                                  str(self.size), str(self.count),
                                                  f"http://{self.hosts.address(0)}:{METRICS_PORT}/metrics"], {})
        self.trainer.wait_for(lambda line: isinstance(line, dict) and line.get("ready"), what="ready line")
        return self

    def start_server(self) -> Proc:
        """Start (or start again, on the same data) the server in host 0."""
        flags = {"data_port": DATA_PORT, "socket": "off", "metrics_port": METRICS_PORT, **self.server_flags}
        argv = ["-m", "tannery_server", "serve", "--host", self.hosts.address(0), "--port", str(GRPC_PORT),
                "--data-dir", str(self.workdir / "server")]
        for key, value in flags.items():
            argv += ["--" + key.replace("_", "-"), str(value)]
        self.server = self._start("server", 0, argv, {"TANNERY_METRICS_PORT": str(METRICS_PORT)}, stdout_log=True)
        self.server.wait_for(lambda line: "serving on" in str(line), what="start line")
        return self.server

    def _start(self, label: str, host: int, args: list[str], env: dict[str, str], stdout_log: bool = False) -> Proc:
        log = self.workdir / f"{label}-{len(self.procs)}.log"
        # One intra-op thread per process: each namespace stands for a host of its own, and torch's
        # thread pool spinning on cores the simulated hosts all share would bill one host's copies to all.
        proc = Proc(self.hosts.command(host, [sys.executable, *args]),
                    {"PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1", **env}, log, merged=stdout_log)
        self.procs.append(proc)
        return proc

    def worker(self, host: int, relay: bool | None = True, digest: bool = True, wait: bool = False,
               ready: bool = True) -> Proc:
        """A weight worker in ``host`` following the trainer's versions over TCP; its lines say
        each version applied (time, via, SHA-256). ``wait``: it follows once told ``go`` (:meth:`chain`)."""
        env = {"TANNERY_TRANSPORT": "tcp", "TANNERY_BENCH_DIGEST": "1" if digest else "0",
               "TANNERY_RELAY": {True: "on", False: "off", None: ""}[relay], "TANNERY_BENCH_WAIT": "1" if wait else "0"}
        proc = self._start(f"worker{host}", host, ["-m", "tests.benchmarks.weight_sync_worker", "tannery",
                                                   str(self.size), str(self.count), self.target, self.name], env)
        if ready:
            proc.wait_for(lambda line: isinstance(line, dict) and line.get("ready"), what="ready line")
        return proc

    def chain(self, hosts: list[int], version: int = 0, relay: bool | None = True, digest: bool = True) -> list[Proc]:
        """Workers in ``hosts`` (started together) that join one after the other, each once the one
        before holds ``version``: the plan's order is theirs (a chain: each feeds the next)."""
        workers = [self.worker(host, relay, digest, wait=True, ready=False) for host in hosts]
        for worker in workers:
            worker.wait_for(lambda line: isinstance(line, dict) and line.get("ready"), what="ready line")
            worker.tell("go")
            self.applied(version, [worker])
        return workers

    def push(self, version: int, delta: bool = False, timeout: float = 300) -> dict[str, Any]:
        """Push ``version`` (whole, or a delta from the last): the trainer's line once ``push`` returned."""
        self.start_push(version, delta)
        return self.pushed(version, timeout)

    def start_push(self, version: int, delta: bool = False) -> None:
        """Tell the trainer to push ``version``, without waiting (:meth:`pushed` waits)."""
        assert self.trainer is not None
        self.trainer.tell(f"push {version}{' delta' if delta else ''}")

    def pushed(self, version: int, timeout: float = 300) -> dict[str, Any]:
        assert self.trainer is not None
        return self.trainer.wait_for(lambda line: isinstance(line, dict) and line.get("kind") == "pushed"
                                     and line["version"] == version, timeout, f"push of version {version}")

    def member(self, host: int, module: str, *args: str) -> Proc:
        """Another process of the tests in ``host`` (``python -m module TARGET NAME *args``), once it said ready."""
        proc = self._start(module.rsplit(".", 1)[-1], host, ["-m", module, self.target, self.name, *args], {})
        proc.wait_for(lambda line: isinstance(line, dict) and line.get("ready"), what="ready line")
        return proc

    def applied(self, version: int, workers: list[Proc], timeout: float = 120) -> list[dict[str, Any]]:
        """Each worker's line for ``version`` (or a newer one), waited for."""
        return [worker.wait_for(lambda line: isinstance(line, dict) and line.get("version", -1) >= version,
                                timeout, f"version {version}") for worker in workers]

    def egress(self) -> float:
        """Payload bytes the server has handed channel subscribers so far."""
        assert self.trainer is not None
        trainer = self.trainer

        def answers() -> list[dict[str, Any]]:
            return [line for line in list(trainer.lines) if isinstance(line, dict) and line.get("kind") == "out"]

        before = len(answers())
        trainer.tell("out")
        trainer.wait_for(lambda _: len(answers()) > before, what="egress")
        return float(answers()[before]["bytes"])

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["Fleet", "GLOO_PORT", "Proc"]
