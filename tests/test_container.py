"""The container image and both compose files, built and run with podman (issue 35).

`make test` (and so CI) sets the engine up first: ../shared/tools/container-env.sh installs
podman from Debian's packages and builds the local base image ``localhost/python-base:bookworm``
(Debian's python3), since this machine reaches no container registry. Then:

* docker/smoke-test.sh builds docker/Dockerfile and proves, on the image itself: health
  SERVING, its listeners on the documented ports, a push and a pull byte-exact (tensors and a
  real model), data kept across a restart, TLS, torch absent, a non-root user;
* docker/compose.yaml comes up healthy and serves;
* docker/compose.scale.yaml, with compose.scale.debian.yaml (PostgreSQL, SeaweedFS and NATS
  built from Debian's and PyPI's packages), comes up: a Store on one replica is fetched from
  the other, and a payload published on one reaches a subscriber of the other (NATS).

Without ../shared (no set-up script) or without podman these skip, naming what is missing;
under CI (``CI`` set) they fail instead. CONTAINER_ENGINE and BASE_IMAGE override the engine
and the base image.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

import tannery

from .needs import require

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
SET_UP = ROOT.parent / "shared" / "tools" / "container-env.sh"
ENGINE = os.environ.get("CONTAINER_ENGINE", "podman")
BASE_IMAGE = os.environ.get("BASE_IMAGE", "localhost/python-base:bookworm")
COMPOSE = [sys.executable, "-m", "podman_compose"]

pytestmark = [pytest.mark.slow, pytest.mark.external]


@pytest.fixture(scope="module")
def engine() -> str:
    """The container engine, ready with the base image; skips (fails under CI) naming what is absent."""
    require(SET_UP.is_file() or shutil.which(ENGINE) is not None,
            f"{SET_UP} is absent (no ../shared) and {ENGINE} is not installed: nothing sets up a container engine")
    require(shutil.which(ENGINE) is not None,
            f"{ENGINE} is not installed: run {SET_UP} (make test does), which installs it from Debian's packages")
    present = subprocess.run([ENGINE, "image", "exists", BASE_IMAGE], capture_output=True).returncode == 0
    require(present, f"the base image {BASE_IMAGE} is absent: run {SET_UP} (make test does), which builds it")
    return ENGINE


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(command: list[str], *, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=DOCKER,
                            env={**os.environ, **(env or {})})
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(command)} failed ({result.returncode}):\n{output[-6000:]}"
    return output


def _wait_healthy(engine: str, container: str, seconds: float = 120) -> None:
    """Until the container's health check passes (podman without systemd runs no timer: run it here)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if subprocess.run([engine, "healthcheck", "run", container], capture_output=True).returncode == 0:
            return
        time.sleep(1)
    logs = subprocess.run([engine, "logs", "--tail", "30", container], capture_output=True, text=True)
    pytest.fail(f"{container} not healthy after {seconds:.0f} s; its log:\n{logs.stdout}{logs.stderr}")


class Compose:
    """One compose project, brought up with ``--build`` and always taken down with its volumes."""

    def __init__(self, engine: str, files: list[str], env: dict[str, str]) -> None:
        self.engine = engine
        self.project = f"tannery-test-{uuid.uuid4().hex[:8]}"
        self.command = [*COMPOSE, "-p", self.project] + [arg for f in files for arg in ("-f", f)]
        self.env = {"BASE_IMAGE": BASE_IMAGE, **env}

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def __enter__(self) -> "Compose":
        try:
            _run([*self.command, "up", "-d", "--build"], env=self.env)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run([*self.command, "down", "-v", "-t", "5"], capture_output=True, cwd=DOCKER, env={**os.environ, **self.env},
                       timeout=300)


@pytest.mark.timeout(1200)
def test_the_smoke_test_passes_on_the_image(engine):
    output = _run([str(DOCKER / "smoke-test.sh")], env={"CONTAINER_ENGINE": engine, "BASE_IMAGE": BASE_IMAGE},
                  timeout=1200)
    for line in ("gRPC 50051, data 50052 and /data/tannery.sock, metrics 20051, as uid 10001",
                 "encoder: encoder.safetensors pushed and pulled back, 24 tensors identical",
                 "encoder: the same file after the restart", "4 tensors identical after the restart",
                 "4 tensors identical over TLS", "PASSED"):
        assert line in output, f"the smoke test did not say {line!r}:\n{output[-4000:]}"


@pytest.mark.timeout(900)
def test_compose_yaml_comes_up_healthy_and_serves(engine):
    port = _free_port()
    env = {"TANNERY_HOST_PORT": str(port), "TANNERY_HOST_DATA_PORT": str(_free_port()),
           "TANNERY_HOST_METRICS_PORT": str(_free_port())}
    with Compose(engine, ["compose.yaml"], env) as compose:
        _wait_healthy(engine, compose.container("store"))
        weights = {"w": torch.randn(64, 32), "b": torch.arange(7, dtype=torch.int16)}
        with tannery.Client(f"127.0.0.1:{port}", transport="grpc") as client:
            client.store("compose", weights)
            archive = client.fetch("compose")
            assert all(torch.equal(archive.find(name), value) for name, value in weights.items())


@pytest.mark.timeout(1200)
def test_compose_scale_yaml_serves_one_store_from_two_replicas(engine):
    port_a, port_b = _free_port(), _free_port()
    env = {"TANNERY_REPLICA_A_PORT": str(port_a), "TANNERY_REPLICA_B_PORT": str(port_b)}
    with Compose(engine, ["compose.scale.yaml", "compose.scale.debian.yaml"], env) as compose:
        _wait_healthy(engine, compose.container("replica-a"), 180)
        _wait_healthy(engine, compose.container("replica-b"), 180)
        torch.manual_seed(3)
        weights = {f"layer{i}.weight": torch.randn(128, 96) for i in range(4)} | {"step": torch.tensor([41])}
        with tannery.Client(f"127.0.0.1:{port_a}", transport="grpc") as a, \
                tannery.Client(f"127.0.0.1:{port_b}", transport="grpc") as b:
            info = a.store("scaled", weights)
            assert info.entries == len(weights)
            fetched = b.fetch("scaled")  # the other replica: the same catalog and bucket
            assert sorted(fetched.names()) == sorted(weights)
            assert all(torch.equal(fetched.find(name), value) for name, value in weights.items())
            # A channel spans the replicas through NATS: published on a, heard on b.
            sent = torch.linspace(0, 1, 1000)
            with b.subscribe("across") as subscription:
                heard: list[torch.Tensor] = []
                listener = threading.Thread(target=lambda: heard.append(next(iter(subscription))), daemon=True)
                listener.start()
                deadline = time.monotonic() + 30
                while listener.is_alive() and time.monotonic() < deadline:
                    a.publish("across", [sent])
                    listener.join(1)
            assert heard and torch.equal(heard[0], sent), "a payload published on one replica never reached the other"
