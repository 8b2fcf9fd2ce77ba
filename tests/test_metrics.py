"""Prometheus metrics scraped from the real server's HTTP endpoint, and the call log's fields."""

from __future__ import annotations

import json
import logging
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tannery_protocol.codec import encode_numpy
from tannery_protocol.v1 import archives_pb2 as pb
from tannery_protocol.v1 import channels_pb2, channels_pb2_grpc
from tannery_server.calllog import JsonFormatter
from tannery_server.config import Config

from .server_harness import collect_fetch, running_server, store_requests, wait_for

PAYLOAD = encode_numpy(np.arange(1000, dtype=np.float32))
OTHER = encode_numpy(np.arange(500, dtype=np.int64))
KiB, MiB = 1 << 10, 1 << 20


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Every sample of the endpoint, by (name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_calls_bytes_and_durations_by_method_and_code(server):
    stub = server.archives()
    info = stub.Store(store_requests("counted", {"w": PAYLOAD}, chunk_size=1000))
    assert collect_fetch(stub.Fetch(pb.FetchRequest(archive="counted"))) == {"w": PAYLOAD}
    with pytest.raises(grpc.RpcError):
        stub.Describe(pb.DescribeRequest(archive="absent"))
    stub.List(pb.ListRequest())
    health_pb2_grpc.HealthStub(server.channel()).Check(health_pb2.HealthCheckRequest())

    assert wait_for(lambda: value(scrape(server.metrics_port), "tannery_calls_total", method="List", code="OK") == 1)
    samples = scrape(server.metrics_port)
    calls = {labels: v for (name, labels), v in samples.items() if name == "tannery_calls_total"}
    assert calls == {
        frozenset({("method", "Store"), ("code", "OK")}): 1,
        frozenset({("method", "Fetch"), ("code", "OK")}): 1,
        frozenset({("method", "Describe"), ("code", "NOT_FOUND")}): 1,
        frozenset({("method", "List"), ("code", "OK")}): 1,
    }, "every call once, health checks not counted"
    # Store: the payload plus the framing of its messages; its answer is the ArchiveInfo.
    stored_in = value(samples, "tannery_received_bytes_total", method="Store")
    assert len(PAYLOAD) < stored_in < len(PAYLOAD) + 200
    assert value(samples, "tannery_sent_bytes_total", method="Store") == info.ByteSize()
    assert len(PAYLOAD) < value(samples, "tannery_sent_bytes_total", method="Fetch") < len(PAYLOAD) + 200
    assert value(samples, "tannery_received_bytes_total", method="Fetch") == pb.FetchRequest(
        archive="counted").ByteSize()
    assert value(samples, "tannery_received_bytes_total", method="Describe") == len(b"absent") + 2
    assert value(samples, "tannery_sent_bytes_total", method="Describe") == 0
    for method in ("Store", "Fetch", "Describe", "List"):
        assert value(samples, "tannery_call_duration_seconds_count", method=method) == 1
        assert value(samples, "tannery_call_duration_seconds_sum", method=method) > 0
        assert value(samples, "tannery_call_duration_seconds_bucket", method=method, le="+Inf") == 1
    assert value(samples, "process_resident_memory_bytes") > 0


def test_catalog_gauges_follow_stores_and_deletes(server):
    stub = server.archives()
    port = server.metrics_port
    assert [value(scrape(port), f"tannery_{n}") for n in ("archives", "archive_bytes", "blobs", "stored_bytes")] == [
        0, 0, 0, 0]
    # Payloads over 1 MiB, each a blob of its own, stored once whatever archives hold it (small
    # ones share their Store's pack instead: docs/packs.md).
    PAYLOAD = encode_numpy(np.arange(300_000, dtype=np.float32))
    OTHER = encode_numpy(np.arange(150_000, dtype=np.int64))
    first = stub.Store(store_requests("first", {"a": PAYLOAD, "b": OTHER}))
    second = stub.Store(store_requests("second", {"same": PAYLOAD}))  # the same payload, stored once
    samples = scrape(port)
    assert value(samples, "tannery_archives") == 2
    assert value(samples, "tannery_archive_bytes") == first.payload_bytes + second.payload_bytes
    assert value(samples, "tannery_blobs") == 2
    assert value(samples, "tannery_stored_bytes") == len(PAYLOAD) + len(OTHER)
    stub.Delete(pb.DeleteRequest(archive="first"))
    samples = scrape(port)
    assert (value(samples, "tannery_archives"), value(samples, "tannery_blobs"),
            value(samples, "tannery_stored_bytes")) == (1, 1, len(PAYLOAD))
    stub.Delete(pb.DeleteRequest(archive="second"))
    samples = scrape(port)
    assert (value(samples, "tannery_archives"), value(samples, "tannery_stored_bytes")) == (0, 0)


def test_channel_subscribers_and_dropped_subscribers(tmp_path):
    with running_server(tmp_path, channel_buffer_bytes=MiB, channel_timeout_seconds=0.5) as server:
        port = server.metrics_port
        stub = channels_pb2_grpc.ChannelsStub(server.channel())
        idle = stub.Subscribe(channels_pb2.SubscribeRequest(channel="idle"))
        slow = stub.Subscribe(channels_pb2.SubscribeRequest(channel="busy"))
        idle.initial_metadata(), slow.initial_metadata()  # both registered
        samples = scrape(port)
        assert (value(samples, "tannery_channel_subscribers"), value(samples, "tannery_channels")) == (2, 2)
        assert value(samples, "tannery_channel_dropped_subscribers_total") == 0
        # The slow subscriber reads nothing: its buffer fills and it is dropped.
        payload = encode_numpy(np.zeros(16 * KiB, dtype=np.float32))
        messages = (channels_pb2.PublishRequest(channel="busy", chunk=payload) for _ in range(80))
        assert stub.Publish(messages, timeout=60).dropped_subscribers == 1
        with pytest.raises(grpc.RpcError) as dropped:
            for _ in slow:
                pass
        assert dropped.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        idle.cancel()
        assert wait_for(lambda: value(scrape(port), "tannery_channel_subscribers") == 0)
        samples = scrape(port)
        assert value(samples, "tannery_channel_dropped_subscribers_total") == 1
        assert value(samples, "tannery_channels") == 0
        assert value(samples, "tannery_calls_total", method="Subscribe", code="RESOURCE_EXHAUSTED") == 1
        assert value(samples, "tannery_calls_total", method="Subscribe", code="CANCELLED") == 1
        assert value(samples, "tannery_received_bytes_total", method="Publish") > 80 * len(payload)


def test_refused_calls_are_counted(tmp_path):
    with running_server(tmp_path, tokens="reader-token-0123:read") as server:
        stub = server.archives()
        with pytest.raises(grpc.RpcError):
            stub.List(pb.ListRequest())
        with pytest.raises(grpc.RpcError):
            stub.Delete(pb.DeleteRequest(archive="x"), metadata=(("authorization", "Bearer reader-token-0123"),))
        # A call is counted once its handler is over, which may be just after its client heard.
        assert wait_for(lambda: value(scrape(server.metrics_port), "tannery_calls_total", method="Delete",
                                      code="PERMISSION_DENIED") == 1)
        samples = scrape(server.metrics_port)
        assert value(samples, "tannery_calls_total", method="List", code="UNAUTHENTICATED") == 1
        assert value(samples, "tannery_calls_total", method="Delete", code="PERMISSION_DENIED") == 1


def test_metrics_can_be_switched_off(tmp_path):
    with running_server(tmp_path, metrics=False) as server:
        assert server.metrics_port is None
        server.archives().List(pb.ListRequest())  # calls work without the observer
    assert Config.from_env({"TANNERY_METRICS": "off"}).metrics is False
    assert Config.from_env({"TANNERY_METRICS_PORT": "9100"}).metrics_port == 9100
    with pytest.raises(ValueError, match="metrics_port 70000 is not in 0..65535"):
        Config(metrics_port=70000)


def test_a_busy_metrics_port_stops_the_start(tmp_path):
    with running_server(tmp_path / "one") as first:
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{first.metrics_port}: .*--metrics-port"):
            with running_server(tmp_path / "two", metrics_port=first.metrics_port):
                pass


def test_log_line_fields_text_and_json(server, caplog):
    caplog.set_level(logging.INFO, logger="tannery_server")
    stub = server.archives()
    stub.Store(store_requests("logged", {"w": PAYLOAD}))
    assert wait_for(lambda: any(r.name == "tannery_server.calls" for r in caplog.records))
    record = next(r for r in caplog.records if r.name == "tannery_server.calls")
    text = record.getMessage()
    assert " peer=ipv4:127.0.0.1:" in text and "method=Store" in text and "archive=logged" in text
    line = json.loads(JsonFormatter().format(record))
    assert line["method"] == "Store" and line["archive"] == "logged" and line["status"] == "OK"
    assert line["peer"].startswith("ipv4:127.0.0.1:")
    assert line["bytes"] == line["bytes_in"] + line["bytes_out"] and line["bytes_in"] > len(PAYLOAD)
    assert line["duration_ms"] > 0 and line["level"] == "INFO"


@pytest.mark.usefixtures("no_client_environment")
def test_bytes_moved_on_the_data_paths_are_counted_by_method_and_transport(tmp_path):
    import tannery

    tensor = np.arange(1 << 18, dtype=np.float32)
    payload_bytes = len(encode_numpy(tensor))
    with running_server(tmp_path) as server:
        for transport in ("local", "tcp"):
            with tannery.Client(server.target, transport=transport) as client:
                client.store(f"moved-{transport}", {"w": __import__("torch").from_numpy(tensor)})
                client.fetch(f"moved-{transport}", ["w"])
        assert wait_for(lambda: value(scrape(server.metrics_port), "tannery_data_path_bytes_total",
                                      method="Fetch", transport="tcp", direction="out") is not None)
        samples = scrape(server.metrics_port)
        for transport in ("local", "tcp"):
            assert value(samples, "tannery_data_path_bytes_total", method="Store", transport=transport,
                         direction="in") == payload_bytes
            assert value(samples, "tannery_data_path_bytes_total", method="Fetch", transport=transport,
                         direction="out") == payload_bytes
