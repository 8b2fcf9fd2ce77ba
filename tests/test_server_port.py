"""One server per port, and the metrics endpoint's default port.

gRPC turns SO_REUSEPORT on by default: a second server then binds a port beside a running
one and clients get answers from either at random. The server turns it off, so a busy
port fails the start with a message naming it and the remedy.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tannery_protocol.codec import encode_numpy
from tannery_protocol.v1 import archives_pb2 as pb
from tannery_server import app
from tannery_server.cli import build_parser
from tannery_server.config import IMAGE_METRICS_PORT, Config

from .server_harness import HOST, InProcessServer, ServerProcess, free_port, running_server, store_requests

ROOT = Path(__file__).resolve().parents[1]
PAYLOAD = encode_numpy(__import__("numpy").arange(16, dtype="float32"))
BUSY = r"cannot listen on 127\.0\.0\.1:{port}: the port is already in use by another process.*--port or TANNERY_PORT"


def test_a_second_server_on_a_busy_port_fails_to_start(tmp_path):
    with running_server(tmp_path / "one") as first:
        second = Config(host=HOST, port=first.port, metrics_port=0, data_dir=tmp_path / "two" / "data")
        with pytest.raises(app.AddressInUse, match=BUSY.format(port=first.port)):
            InProcessServer(second).stop()
        # The first server still answers every call, and they all reach it.
        for n in range(5):
            first.archives().Store(store_requests(f"a{n}", {"w": PAYLOAD}))
        names = [a.name for a in first.archives().List(pb.ListRequest()).archives]
        assert names == [f"a{n}" for n in range(5)]
    assert not list((tmp_path / "two" / "data" / "blobs").rglob("*")), "the refused server stored nothing"


def test_tannery_serve_on_a_busy_port_prints_one_line_and_exits_non_zero(tmp_path):
    with ServerProcess(tmp_path / "first") as first:
        port = int(first.target.rsplit(":", 1)[1])
        env = {**os.environ, "TANNERY_METRICS_PORT": "0"}
        result = subprocess.run(
            [sys.executable, "-m", "tannery_server", "serve", "--host", HOST, "--port", str(port),
             "--data-dir", str(tmp_path / "second")],
            capture_output=True, text=True, timeout=60, env=env,
        )
        assert result.returncode == 1, result.stderr
        lines = [line for line in result.stderr.splitlines() if line.startswith("tannery serve:")]
        assert len(lines) == 1, result.stderr
        assert re.fullmatch("tannery serve: " + BUSY.format(port=port), lines[0]), lines[0]
        assert "Traceback" not in result.stderr and "add_port" not in result.stderr, result.stderr
        first.archives().List(pb.ListRequest())  # the first one is untouched


class _FakeServer:
    """Stands for a grpc.aio.Server whose add_insecure_port fails as grpcio does."""

    def __init__(self, answer: object) -> None:
        self.answer = answer

    def add_insecure_port(self, address: str) -> int:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer  # type: ignore[return-value]


@pytest.mark.parametrize("answer", [RuntimeError("Failed to bind to address"), 0], ids=["raises", "returns-0"])
def test_a_port_taken_between_the_probe_and_the_bind_is_named_too(monkeypatch, answer):
    probes = iter([False, True])  # free when probed first, taken when gRPC binds
    monkeypatch.setattr(app, "port_in_use", lambda host, port: next(probes))
    with pytest.raises(app.AddressInUse, match=BUSY.format(port=50999)):
        app.bind(_FakeServer(answer), "127.0.0.1", 50999, None)


@pytest.mark.parametrize("answer", [RuntimeError("Failed to bind to address"), 0], ids=["raises", "returns-0"])
def test_other_bind_failures_name_the_address(monkeypatch, answer):
    monkeypatch.setattr(app, "port_in_use", lambda host, port: False)
    with pytest.raises(OSError, match="cannot listen on 127.0.0.1:50999") as caught:
        app.bind(_FakeServer(answer), "127.0.0.1", 50999, None)
    assert not isinstance(caught.value, app.AddressInUse)


def test_port_in_use_sees_a_listening_socket():
    import socket

    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert app.port_in_use(HOST, port)
    assert not app.port_in_use(HOST, port)
    assert not app.port_in_use(HOST, 0)


def _serve_help() -> str:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return " ".join(serve.format_help().split())


def test_the_side_ports_default_to_free_ones_and_the_image_metrics_port_is_no_common_default():
    assert (Config().data_port, Config().metrics_port) == (0, 0)  # auto: the OS picks
    assert "--data-port DATA_PORT" in _serve_help() and _serve_help().count("default auto]") == 2
    port = IMAGE_METRICS_PORT
    assert port == 20051
    assert not 9090 <= port <= 9999, "Prometheus's own port and the exporters' allocations"
    assert port < 32768, "below Linux's ephemeral ports"
    assert port != Config().port


def test_the_docker_files_keep_their_fixed_ports():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"^EXPOSE 50051 50052 20051$", dockerfile, re.M)  # gRPC, the data port, metrics
    assert f"TANNERY_METRICS_PORT={IMAGE_METRICS_PORT}" in dockerfile
    assert "TANNERY_DATA_PORT=50052" in dockerfile and "TANNERY_PORT=50051" in dockerfile
    # published on the host's 20051 unless TANNERY_HOST_METRICS_PORT says otherwise (the tests do)
    assert '"${TANNERY_HOST_METRICS_PORT:-20051}:20051"' in (ROOT / "docker" / "compose.yaml").read_text()
    for name in ("Dockerfile", "compose.yaml", "smoke-test.sh"):
        assert "9090" not in (ROOT / "docker" / name).read_text().replace("not 9090", ""), name


# Side ports: the data port and metrics default to free ones, so servers never collide ---------

#: The start line: every address the server listens on, with the ports actually bound.
START_LINE = re.compile(r"serving on 127\.0\.0\.1:(?P<grpc>\d+) \(gRPC\), data port (?:127\.0\.0\.1:(?P<data>\d+)|off), "
                        r"socket (?P<socket>\S+), metrics (?:http://127\.0\.0\.1:(?P<metrics>\d+)/metrics|off)"
                        r"(?:, web page http://127\.0\.0\.1:(?P<web>\d+)/)?; ")


def _listeners(process: ServerProcess) -> dict[str, str | None]:
    """The addresses named by the start line of ``process``."""
    matches = [START_LINE.search(line) for line in process.log_lines]
    found = [m.groupdict() for m in matches if m]
    assert len(found) == 1, process.log_lines
    return found[0]


def _with_defaults(data_dir: Path, *flags: str) -> ServerProcess:
    """``tannery serve --host 127.0.0.1 --data-dir DATA_DIR FLAGS``, no TANNERY_* variable set:
    every other setting at its default."""
    process = ServerProcess(data_dir)
    process.command = lambda: [sys.executable, "-m", "tannery_server", "serve", "--host", HOST,  # type: ignore[method-assign]
                               "--data-dir", str(data_dir), *flags]
    process.environment = lambda: {k: v for k, v in os.environ.items()  # type: ignore[method-assign]
                                   if not k.startswith("TANNERY_")}
    return process


def _metrics_answer(port: int) -> bool:
    import urllib.request

    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as response:
        return response.status == 200 and b"tannery_calls_total" in response.read()


@pytest.mark.usefixtures("no_client_environment")
def test_servers_differing_only_in_port_all_start_each_listener_on_a_port_of_its_own(tmp_path):
    import torch

    import tannery

    ports = [str(free_port()), str(free_port()), "0"]
    processes = [_with_defaults(tmp_path / f"d{n}", "--port", port) for n, port in enumerate(ports)]
    try:
        for process in processes:
            process.start()
        seen: list[int] = []
        for port, process in zip(ports, processes):
            at = _listeners(process)
            assert port == "0" or at["grpc"] == port, at
            assert at["socket"] == str((process.data_dir / "tannery.sock").absolute())
            numbers = [int(at["grpc"]), int(at["data"]), int(at["metrics"])]  # every one bound: no "off"
            assert 0 not in numbers and len(set(numbers)) == 3, at
            seen += numbers
            # The data port bound is what DataPaths tells clients, and a Store and Fetch go through it.
            assert process.archives().DataPaths(pb.DataPathsRequest()).data_port == int(at["data"])
            with tannery.Client(process.target, transport="tcp") as client:
                client.store("w", {"w": torch.arange(10)})
                assert torch.equal(client.fetch("w").find("w"), torch.arange(10))
                assert client.transport == "tcp"
            assert [a.name for a in process.archives().List(pb.ListRequest()).archives] == ["w"]
            assert _metrics_answer(int(at["metrics"]))
        assert len(set(seen)) == len(seen), "no two listeners share a port"
        for process in processes:
            assert process.stop() == 0
    finally:
        for process in processes:
            process.kill()


def test_the_start_line_names_the_web_page_when_it_is_on(tmp_path):
    import urllib.request

    with ServerProcess(tmp_path / "web", web_port=0) as server:
        at = _listeners(server)
        assert at["web"] is not None and int(at["web"]) not in (0, int(at["grpc"]), int(at["metrics"]))
        with urllib.request.urlopen(f"http://{HOST}:{at['web']}/", timeout=10) as page:
            assert page.status == 200


def test_off_turns_a_side_listener_off_and_0_picks_a_free_port(tmp_path):
    with ServerProcess(tmp_path / "off", data_port="off", metrics_port="off", socket="off") as off:
        assert _listeners(off) == {"grpc": off.target.rsplit(":", 1)[1], "data": None, "socket": "off", "metrics": None,
                                   "web": None}
        answer = off.archives().DataPaths(pb.DataPathsRequest())
        assert (answer.data_port, answer.socket_path) == (0, "")
        assert not any("metrics on" in line for line in off.log_lines)
    with ServerProcess(tmp_path / "free", data_port=0, metrics_port=0) as free:
        at = _listeners(free)
        assert int(at["data"]) and int(at["metrics"])
        assert free.archives().DataPaths(pb.DataPathsRequest()).data_port == int(at["data"])
        assert _metrics_answer(int(at["metrics"]))
    # The environment says the same as the flags; an empty value is off there too.
    with ServerProcess(tmp_path / "env", env={"TANNERY_DATA_PORT": "", "TANNERY_METRICS_PORT": "off"}) as env:
        at = _listeners(env)
        assert (at["data"], at["metrics"]) == (None, None)


@pytest.mark.parametrize("flag, value", [("--data-port", "abc"), ("--data-port", "70000"), ("--metrics-port", "-1"),
                                         ("--metrics-port", "none")])
def test_a_bad_side_port_is_refused_in_one_line_naming_the_flag_and_the_forms(capsys, flag, value):
    from tannery_server.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", flag, value])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert errors == [f"tannery serve: error: argument {flag}: {value!r} is not a port 1..65535, auto (or 0) for a "
                      "free one the OS picks, or off (or empty) for none"], errors


def test_an_explicit_side_port_in_use_stops_the_start_naming_the_flag(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind((HOST, 0))
        busy.listen()
        port = busy.getsockname()[1]
        for flag in ("--data-port", "--metrics-port"):
            process = _with_defaults(tmp_path / flag.strip("-"), "--port", "0", flag, str(port))
            result = subprocess.run(process.command(), capture_output=True, text=True, timeout=60,
                                    env=process.environment())
            assert result.returncode == 1, result.stderr
            lines = [line for line in result.stderr.splitlines() if line.startswith("tannery serve:")]
            assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and flag in lines[0], result.stderr
            assert "auto for a free one, or off for none" in lines[0] and "Traceback" not in result.stderr
