"""The server as a program: health, reflection, logs, settings, shutdown, one server per
data directory, and no torch."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tannery_protocol.codec import encode_numpy
from tannery_protocol.v1 import archives_pb2 as pb
from tannery_server.cli import main as cli_main
from tannery_server.config import Config, parse_size

from .server_harness import ServerProcess, collect_fetch, commit_request, store_requests, wait_for

ROOT = Path(__file__).resolve().parents[1]
PAYLOAD = encode_numpy(__import__("numpy").arange(1000, dtype="float32"))


def test_health_is_serving_and_reflection_lists_the_services(server):
    channel = server.channel()
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tannery.v1.Archives"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    services = {s.name for s in next(iter(responses)).list_services_response.service}
    assert {"tannery.v1.Archives", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    if (ROOT / "service" / "tannery_server" / "channels.py").exists():
        assert "tannery.v1.Channels" in services


def test_one_log_line_per_call(server, caplog):
    caplog.set_level(logging.INFO, logger="tannery_server")
    stub = server.archives()
    stub.Store(store_requests("logged", {"w": PAYLOAD}, chunk_size=1000))
    collect_fetch(stub.Fetch(pb.FetchRequest(archive="logged")))
    with pytest.raises(grpc.RpcError):
        stub.Describe(pb.DescribeRequest(archive="absent"))
    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "tannery_server.calls"]

    assert wait_for(lambda: len(lines()) == 3), lines()  # a line is written once the call is over
    lines = lines()
    store, fetch, describe = (dict(field.split("=", 1) for field in line.split()) for line in lines)
    assert store["method"] == "Store" and store["archive"] == "logged" and store["status"] == "OK"
    assert int(store["bytes"]) >= len(PAYLOAD) and float(store["duration_ms"]) > 0
    assert fetch["method"] == "Fetch" and int(fetch["bytes"]) >= len(PAYLOAD)
    assert describe == {**describe, "method": "Describe", "archive": "absent", "status": "NOT_FOUND"}


def test_json_logs_and_sigterm_lets_a_call_in_flight_finish(tmp_path):
    with ServerProcess(tmp_path / "data", log_format="json", grace_seconds=20) as proc:
        stub = proc.archives()
        sent, release = threading.Event(), threading.Event()

        def slow_store():
            yield pb.StoreRequest(begin=pb.StoreBegin(archive="in-flight"))
            yield pb.StoreRequest(entry="w", chunk=PAYLOAD[:100])
            sent.set()
            release.wait(30)
            yield pb.StoreRequest(chunk=PAYLOAD[100:])
            yield commit_request(1, len(PAYLOAD))

        future = stub.Store.future(slow_store())
        assert sent.wait(30)
        # Once the server has begun writing the payload, the call is in flight there.
        assert wait_for(lambda: any((tmp_path / "data" / "tmp").iterdir()))
        proc.signal(signal.SIGTERM)
        assert _wait_for_line(proc, "shutting down")
        release.set()
        assert future.result(30).entries == 1, "the call in flight completes during the grace period"
        assert proc.wait(30) == 0
        records = [json.loads(line) for line in proc.log_lines if line.startswith("{")]
        calls = [r for r in records if r.get("method") == "Store"]
        assert calls and calls[0]["archive"] == "in-flight" and calls[0]["status"] == "OK"
        assert calls[0]["bytes"] >= len(PAYLOAD)
        proc.start()
        assert collect_fetch(proc.archives().Fetch(pb.FetchRequest(archive="in-flight"))) == {"w": PAYLOAD}


def _wait_for_line(proc: ServerProcess, text: str) -> bool:
    return wait_for(lambda: any(text in line for line in proc.log_lines), timeout=20)


def test_one_server_per_data_directory(tmp_path):
    with ServerProcess(tmp_path / "data") as first:
        second = ServerProcess(tmp_path / "data")
        with pytest.raises(RuntimeError, match=f"is in use by another tannery server \\(pid {first.pid}\\)"):
            second.start(timeout=30)
        assert second.process.wait(10) == 1
        first.archives().Store(store_requests("still-serving", {"w": PAYLOAD}))


def test_the_server_never_imports_torch(tmp_path):
    script = f"""
import asyncio, sys
from pathlib import Path
import grpc
from tannery_server import app, cli, archives, fetching, storage
from tannery_server.config import Config
from tannery_protocol.v1 import archives_pb2 as pb, archives_pb2_grpc
sys.path.insert(0, {str(ROOT)!r})
from tests.server_harness import store_requests

async def main():
    running = await app.start(Config(port=0, metrics_port=0, data_port=None, data_dir=Path({str(tmp_path / "data")!r})))
    async with grpc.aio.insecure_channel(running.target) as channel:
        stub = archives_pb2_grpc.ArchivesStub(channel)
        await stub.Store(store_requests("a", {{"w": {PAYLOAD!r}}}))
        async for _ in stub.Fetch(pb.FetchRequest(archive="a", entries=[pb.EntryAsk(name="w", cast="bfloat16")])):
            pass
    await running.stop()

asyncio.run(main())
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, loaded
print("no torch")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "no torch" in result.stdout


def test_settings_from_environment_and_flags(monkeypatch):
    config = Config.from_env({"TANNERY_PORT": "6000", "TANNERY_CHUNK_SIZE": "64KiB", "TANNERY_DATA_DIR": "/srv/t",
                              "TANNERY_GRACE_SECONDS": "2.5", "TANNERY_LOG_FORMAT": "json"}, port=7000)
    assert (config.port, config.chunk_size, config.data_dir, config.grace_seconds, config.log_format) == (
        7000, 65536, Path("/srv/t"), 2.5, "json")
    assert Config.from_env({}) == Config()
    assert parse_size("2GiB") == 2 << 30 and parse_size("1_000") == 1000
    with pytest.raises(ValueError, match="TANNERY_PORT: cannot read 'x' as int"):
        Config.from_env({"TANNERY_PORT": "x"})
    with pytest.raises(ValueError, match="chunk_size 1073741824 is not in 4096..3145728"):
        Config(chunk_size=1 << 30)
    with pytest.raises(ValueError, match="log_format 'xml' is not 'text' or 'json'"):
        Config(log_format="xml")


def test_serve_help_names_every_environment_variable(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for variable in ("TANNERY_HOST", "TANNERY_PORT", "TANNERY_DATA_DIR", "TANNERY_CHUNK_SIZE",
                     "TANNERY_MAX_PAYLOAD_BYTES", "TANNERY_MAX_RANK", "TANNERY_MAX_NAME_BYTES", "TANNERY_MAX_ENTRIES",
                     "TANNERY_GRACE_SECONDS", "TANNERY_LOG_FORMAT", "TANNERY_CHANNEL_BUFFER_BYTES",
                     "TANNERY_CHANNEL_TIMEOUT_SECONDS"):
        assert variable in text
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", "--chunk-size", "1GiB"])
    assert exit_info.value.code == 2
    assert "chunk_size 1073741824 is not in" in capsys.readouterr().err


def test_the_tannery_command_serves(tmp_path):
    """``tannery serve`` (what ``make serve`` runs), with settings from the environment."""
    tannery = Path(sys.executable).parent / "tannery"
    # Installed by make's setup from [project.scripts]: missing, the command make serve runs is broken.
    assert tannery.is_file(), f"no {tannery}: the project is not installed with its script (run make setup)"
    proc = ServerProcess(tmp_path / "data", env={"TANNERY_CHUNK_SIZE": "8KiB"})
    proc.command = lambda: [str(tannery), "serve", "--port", "0", "--data-dir", str(tmp_path / "data")]
    with proc:
        stub = proc.archives()
        big = encode_numpy(__import__("numpy").zeros(10_000, dtype="float32"))
        stub.Store(store_requests("a", {"w": big}))
        responses = list(stub.Fetch(pb.FetchRequest(archive="a")))
        assert max(len(r.chunk) for r in responses) == 8192
        assert proc.stop() == 0


def test_health_follows_the_storage_not_serving_while_it_is_away_then_serving_again(tmp_path):
    from .server_harness import running_server

    with running_server(tmp_path, health_check_seconds=0.1) as server:
        health = health_pb2_grpc.HealthStub(server.channel())

        def status(service: str = "") -> int:
            return health.Check(health_pb2.HealthCheckRequest(service=service)).status

        blobs = tmp_path / "data" / "blobs"
        blobs.rename(tmp_path / "elsewhere")
        try:
            assert wait_for(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=10)
            assert status("tannery.v1.Archives") == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            (tmp_path / "elsewhere").rename(blobs)
        assert wait_for(lambda: status() == health_pb2.HealthCheckResponse.SERVING, timeout=10)
        assert status("tannery.v1.Archives") == health_pb2.HealthCheckResponse.SERVING


def test_storage_urls_of_an_unknown_kind_are_refused_naming_them_without_their_password(tmp_path):
    with pytest.raises(ValueError, match=r"catalog 'mysql://u@h/db' is not a sqlite: or postgresql:// URL") as bad:
        Config(catalog="mysql://u:secret@h/db")
    assert "secret" not in str(bad.value)
    with pytest.raises(ValueError, match=r"blobs 'gs://bucket' is not a file: or s3:// URL"):
        Config(blobs="gs://bucket")


def test_an_embedded_catalog_or_blob_directory_outside_the_data_directory_is_refused(tmp_path):
    from tannery_server.storage.factory import open_storage

    config = Config(data_dir=tmp_path / "data", catalog=f"sqlite://{tmp_path}/elsewhere/catalog.sqlite3")
    with pytest.raises(ValueError, match="keeps its catalog and blobs in the data directory"):
        open_storage(config)
    with pytest.raises(ValueError, match="set --data-dir instead"):
        open_storage(Config(data_dir=tmp_path / "data", blobs=f"file://{tmp_path}/elsewhere"))
    same = open_storage(Config(data_dir=tmp_path / "data", blobs=f"file://{tmp_path}/data"))
    same.close()
