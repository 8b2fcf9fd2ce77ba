"""The web page (issue 31) over plain HTTP, against a real server on loopback: off unless asked,
tokens and TLS honoured, bad input refused naming the problem, nothing written, an entry's
statistics (whole and sampled) against numpy, a 10,000-entry archive's page in under a second.
tests/test_web_browser.py drives the same pages in a real browser."""

from __future__ import annotations

import dataclasses
import http.client
import math
import os
import re
import subprocess
import sys
import ssl
import time
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
import torch

import tannery
from tannery_server.cli import build_parser
from tannery_server.config import Config
from tannery_server.storage import EntryRecord
from tannery_server.web import stats, tree

from .server_harness import HOST, ServerProcess, running_server
from .test_security import pki  # noqa: F401  (the test CA and certificates)

READ_TOKEN, WRITE_TOKEN = "web-read-token", "web-write-token"


def get(port: int, path: str, *, method: str = "GET", headers: dict | None = None, body: bytes | None = None,
        context: ssl.SSLContext | None = None) -> tuple[int, dict, str]:
    """One request sent as written (no client-side normalising of ``path``): status, headers, body."""
    conn = (http.client.HTTPSConnection(HOST, port, context=context, timeout=30) if context
            else http.client.HTTPConnection(HOST, port, timeout=30))
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read().decode("utf-8", "replace")
    finally:
        conn.close()


def web_port(server) -> int:
    return server._running.web.port


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: its size and modification time (what a write would change)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A server with the web page on, tokens required, and a small archive with an alias."""
    tmp = tmp_path_factory.mktemp("web")
    with running_server(tmp, web_port=0, tokens=f"{READ_TOKEN}:read,{WRITE_TOKEN}:write") as server:
        with tannery.Client(server.target, token=WRITE_TOKEN) as client:
            torch.manual_seed(0)
            weights = {"layers.0.w": torch.randn(32, 16), "layers.1.w": torch.randn(32, 16),
                       "odd": torch.tensor([1.0, float("nan"), float("inf"), -2.0])}
            client.store("small", weights)
            client.tag("small-prod", "small")
        yield server


READ = {"Authorization": f"Bearer {READ_TOKEN}"}


def test_the_page_is_off_unless_asked_and_its_flags(tmp_path):
    assert Config().web_port is None and Config().web_host == "127.0.0.1"
    args = build_parser().parse_args(["serve", "--web-port", "auto", "--web-host", "::1"])
    assert (args.web_port, args.web_host) == ("auto", "::1")
    assert Config(web_port="auto").web_port == 0 and Config(web_port="off").web_port is None
    with running_server(tmp_path) as server:
        assert server._running.web is None


def test_a_page_asks_for_a_token_refuses_a_wrong_one_and_opens_with_a_read_token(store):
    port = web_port(store)
    status, _, body = get(port, "/archives")
    assert status == 401 and 'id="login"' in body and "asks for a token" in body
    status, headers, body = get(port, "/archives", headers={"Authorization": "Bearer not-a-token"})
    assert status == 403 and "refused" in body and "TANNERY_TOKENS_FILE" in body
    status, _, body = get(port, "/archives", headers={"Cookie": "tannery_token=not-a-token"})
    assert status == 403
    status, _, body = get(port, "/archives", headers=READ)
    assert status == 200 and "small" in body
    # The form: a known token is kept in a cookie; a wrong one is refused; the way back stays on this site.
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, headers, _ = get(port, "/login", method="POST", headers=form,
                             body=urllib.parse.urlencode({"token": READ_TOKEN, "next": "/server"}).encode())
    assert status == 303 and headers["Location"] == "/server"
    assert "tannery_token=" in headers["Set-Cookie"] and "HttpOnly" in headers["Set-Cookie"]
    status, headers, _ = get(port, "/login", method="POST", headers=form,
                             body=urllib.parse.urlencode({"token": READ_TOKEN, "next": "//evil.example/"}).encode())
    assert status == 303 and headers["Location"] == "/archives"
    status, _, body = get(port, "/login", method="POST", headers=form,
                          body=urllib.parse.urlencode({"token": "wrong", "next": "/server"}).encode())
    assert status == 403 and "refused" in body


def test_missing_archive_or_entry_is_a_404_page_naming_it(store):
    port = web_port(store)
    status, _, body = get(port, "/archive?name=no-such-archive", headers=READ)
    assert status == 404 and "archive &#39;no-such-archive&#39; not found" in body
    status, _, body = get(port, "/entry?archive=small&name=no.such.entry", headers=READ)
    assert status == 404 and "archive &#39;small&#39; has no entry &#39;no.such.entry&#39;" in body
    status, _, body = get(port, "/entry?archive=gone&name=x", headers=READ)
    assert status == 404 and "archive &#39;gone&#39; not found" in body


HOSTILE = [
    ("/../../../../etc/passwd", 404),
    ("/%2e%2e/%2e%2e/etc/passwd", 404),
    ("/archive/..%2f..%2fetc%2fpasswd", 404),
    ("/archive?name=..%2F..%2Fetc%2Fpasswd", 404),
    ("/archive?name=a%00b", 400),
    ("/archive?name=a%0d%0aSet-Cookie:%20x=1", 400),
    ("/archive?name=" + "x" * 5000, 400),
    ("/archive?name=small&name=other", 400),
    ("/archive?name=small&debug=1", 400),
    ("/archive", 400),
    ("/entry?archive=small", 400),
    ("/archives?prefix=%ff%fe", 200),  # undecodable bytes are replaced: a prefix no name has
    ("/server?x=1", 400),
    ("/archive?name=small&open=yes", 400),
    ("/tree?name=small", 400),
    ("/tree?name=small&node=no.such.node", 404),
    ("/tree?name=gone&node=layers", 404),
]


@pytest.mark.parametrize("path, status", HOSTILE)
def test_hostile_paths_and_parameters_are_refused_and_nothing_is_written(store, path, status):
    before = snapshot(store.data_dir)
    got, headers, body = get(web_port(store), path, headers=READ)
    assert got == status, body
    assert "root:" not in body and "Set-Cookie" not in headers
    if status != 200:
        assert 'id="message"' in body and 'id="remedy"' in body  # what is wrong, and what to do
    assert snapshot(store.data_dir) == before


def test_names_are_escaped_and_writes_are_not_answered(store):
    port = web_port(store)
    status, _, body = get(port, "/archive?name=%3Cscript%3Ealert(1)%3C/script%3E", headers=READ)
    assert status == 404 and "<script>alert" not in body and "&lt;script&gt;alert(1)" in body
    for method in ("POST", "PUT", "DELETE"):
        status, _, body = get(port, "/archive?name=small", method=method, headers=READ)
        assert status == 405 and "read-only" in body
    status, headers, _ = get(port, "/archives", headers=READ)
    assert "default-src 'none'" in headers["Content-Security-Policy"]


def test_pages_show_the_archive_its_alias_and_the_server(store):
    port = web_port(store)
    before = snapshot(store.data_dir)
    status, _, body = get(port, "/archive?name=small-prod", headers=READ)
    assert status == 200 and 'id="archive-name">small<' in body and "small-prod" in body
    assert 'data-value="1028"' in body  # 32*16*2 + 4 parameters
    assert f"TANNERY_TARGET={store.target}" in body and "tannery pull small" in body
    status, _, body = get(port, "/tree?name=small-prod&node=layers.1", headers=READ)
    assert status == 200 and 'data-entry="layers.1.w"' in body and "<html" not in body  # a part of the page
    status, _, body = get(port, "/entry?archive=small&name=odd", headers=READ)
    assert status == 200
    assert 'data-key="nan" data-value="1"' in body and 'data-key="inf" data-value="1"' in body
    assert 'data-key="min" data-value="-2.0"' in body and 'data-key="max" data-value="1.0"' in body
    status, _, body = get(port, "/server", headers=READ)
    assert status == 200 and 'data-part="catalog"' in body and "answers" in body
    assert snapshot(store.data_dir) == before  # every page read, nothing written


def test_a_server_on_every_interface_names_the_host_the_page_was_opened_at(store):
    """The commands the archive page shows name where the reader reaches the server (no server
    here listens beyond loopback: the address is given as a server on every interface has it)."""
    from aiohttp.test_utils import make_mocked_request

    from tannery_server.web import pages

    site = store._running.web.site
    opened_at = make_mocked_request("GET", "/archive?name=m", headers={"Host": "store.example:8080"})
    assert pages._target(site, opened_at) == store.target  # a server on one address names it
    everywhere = dataclasses.replace(site, target="0.0.0.0:50051")
    assert pages._target(everywhere, opened_at) == "store.example:50051"
    assert pages._target(dataclasses.replace(site, target="[::]:50051"), opened_at) == "store.example:50051"


def test_https_when_the_server_has_tls(tmp_path, pki):  # noqa: F811
    with running_server(tmp_path, web_port=0, tls_cert=pki["server_cert"], tls_key=pki["server_key"]) as server:
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        context.check_hostname = False
        status, _, body = get(web_port(server), "/archives", context=context)
        assert status == 200 and "Archives" in body
        with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
            get(web_port(server), "/archives")  # plain HTTP to the HTTPS port gets no page


def test_mutual_tls_asks_the_browser_for_a_client_certificate(tmp_path, pki):  # noqa: F811
    with running_server(tmp_path, web_port=0, tls_cert=pki["server_cert"], tls_key=pki["server_key"],
                        tls_client_ca=pki["ca"]) as server:
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        context.check_hostname = False
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            get(web_port(server), "/archives", context=context)  # no client certificate
        context.load_cert_chain(str(pki["client_cert"]), str(pki["client_key"]))
        status, _, _ = get(web_port(server), "/archives", context=context)
        assert status == 200


def test_tree_merges_single_child_chains_and_counts_parameters():
    entries = [EntryRecord(name, dtype, shape, 4 * math.prod(shape), 0, 0, "0" * 64) for name, dtype, shape in [
        ("model.layers.10.w", "float32", (2, 3)), ("model.layers.2.w", "float32", (4,)),
        ("model.layers.2.b", "bfloat16", (5,)), ("head", "float32", ())]]
    rows = list(tree.rows(tree.build(entries)))
    shown = [(r.kind, r.depth, r.label) for r in rows]
    assert shown == [("open", 0, "model.layers"), ("open", 1, "2"), ("leaf", 2, "b"), ("leaf", 2, "w"),
                     ("close", 1, ""), ("leaf", 1, "10.w"), ("close", 0, ""), ("leaf", 0, "head")]
    lazy = [(r.kind, r.depth, r.label, r.lazy) for r in tree.rows(tree.build(entries), 1)]
    assert lazy == [("open", 0, "model.layers", False), ("open", 1, "2", True), ("close", 1, "", False),
                    ("leaf", 1, "10.w", False), ("close", 0, "", False), ("leaf", 0, "head", False)]
    assert tree.find(tree.build(entries), "model.layers.2").entry_count == 2  # type: ignore[union-attr]
    assert tree.find(tree.build(entries), "model.nope") is None
    assert tree.params_by_dtype(entries) == {"float32": (11, 44), "bfloat16": (5, 20)}


def test_statistics_of_a_large_entry_are_a_sample_and_say_so(tmp_path, monkeypatch):
    monkeypatch.setattr(stats, "FULL_BYTES", 1 << 20)
    monkeypatch.setattr(stats, "WINDOWS", 4)
    monkeypatch.setattr(stats, "WINDOW_BYTES", 64 << 10)
    values = np.random.default_rng(1).standard_normal(1 << 20).astype(np.float32)  # 4 MiB
    with running_server(tmp_path) as server:
        with tannery.Client(server.target) as client:
            client.store("big", {"w": torch.from_numpy(values)})
        catalog = server.storage.catalog
        entry = catalog.entries("big", ["w"])["w"]
        result = stats.entry_stats(server.storage, "big", entry)
        whole = stats.entry_stats(server.storage, "big", entry, seconds=60)
    assert result.sampled and not result.cut_short and result.bytes_read == 4 * (64 << 10)
    per = (64 << 10) // 4
    stride = ((4 << 20) - (64 << 10)) / 3
    starts = [int(i * stride) // 4 for i in range(4)]
    sample = np.concatenate([values[s : s + per] for s in starts]).astype(np.float64)
    assert result.summarised == sample.size and result.count == values.size
    assert result.min == sample.min() and result.max == sample.max()
    assert result.mean == pytest.approx(sample.mean(), rel=1e-9) and result.std == pytest.approx(sample.std(), rel=1e-9)
    assert sum(result.counts) == result.histogram_values == sample.size
    assert whole.sampled  # the size decides, not the time


def test_statistics_of_a_small_entry_cover_every_element(store):
    catalog = store.storage.catalog
    entry = catalog.entries("small", ["layers.0.w"])["layers.0.w"]
    result = stats.entry_stats(store.storage, "small", entry)
    assert not result.sampled and result.summarised == result.count == 512 and result.bytes_read == 2048


def test_a_10000_entry_archive_page_renders_in_under_a_second(tmp_path):
    with running_server(tmp_path, web_port=0) as server:
        weights = {f"model.layers.{i // 100}.block.{i % 100}.weight": torch.zeros(4) for i in range(10_000)}
        with tannery.Client(server.target) as client:
            client.store("ten-thousand", weights)
        for path, leaves, nodes in [("/archive?name=ten-thousand", 0, 101),  # model.layers open, its 100 nodes N.block closed
                                    ("/archive?name=ten-thousand&open=all", 10_000, 101),
                                    ("/tree?name=ten-thousand&node=model.layers.7.block", 100, 0)]:
            times = []
            for _ in range(3):
                started = time.perf_counter()
                status, _, body = get(web_port(server), path)
                times.append(time.perf_counter() - started)
                assert status == 200 and body.count('class="leaf"') == leaves and body.count("<details") == nodes
            print(f"{path}: best {min(times) * 1000:.0f} ms of {[round(t * 1000) for t in times]} ms, "
                  f"{len(body) / 1024:.0f} KiB")
            assert min(times) < 1.0


def test_the_archive_pages_read_no_tensor_byte_and_a_damaged_entry_is_named(tmp_path):
    with running_server(tmp_path, web_port=0) as server:
        with tannery.Client(server.target) as client:
            client.store("model", {"a.w": torch.randn(64, 64), "a.b": torch.randn(64), "c": torch.randn(300, 300)})
        blobs = [p for p in (server.data_dir / "blobs").rglob("*") if p.is_file()]
        assert blobs
        for blob in blobs:  # every stored byte gone: the pages that show none of them still open
            blob.unlink()
        port = web_port(server)
        status, _, body = get(port, "/archive?name=model")
        assert status == 200 and body.count('class="leaf"') == 3
        assert get(port, "/archives")[0] == 200 and get(port, "/server")[0] == 200
        status, _, body = get(port, "/entry?archive=model&name=c")
        assert status == 500 and "the stored bytes of entry &#39;c&#39;" in body and "is missing" in body
        assert "tannery scrub" in body


def test_statistics_of_every_dtype_match_what_tannery_get_computes(tmp_path):
    """The server's statistics (over stored bytes) against the client's (``tannery get --json``'s,
    over the tensor fetched), for every dtype of the format."""
    from tannery.cli.stats import statistics

    rng = np.random.default_rng(7)
    arrays = {
        "f32": rng.standard_normal(1000).astype(np.float32), "f64": rng.standard_normal((10, 30)),
        "f16": np.array([1.5, np.nan, np.inf, -np.inf, -2.0], np.float16),
        "i8": rng.integers(-128, 127, 77).astype(np.int8), "u64": rng.integers(0, 2**40, 50).astype(np.uint64),
        "i64": np.arange(-5, 500, dtype=np.int64), "b": rng.random(37) > 0.4,
        "c64": (rng.standard_normal(20) + 1j * rng.standard_normal(20)).astype(np.complex64),
        "empty": np.zeros((0, 4), np.float32), "scalar": np.array(3.25, np.float32),
    }
    import ml_dtypes

    arrays["bf16"] = rng.standard_normal(99).astype(ml_dtypes.bfloat16)
    arrays["f8"] = rng.standard_normal(64).astype(ml_dtypes.float8_e4m3fn)
    with running_server(tmp_path) as server:
        with tannery.Client(server.target) as client:
            client.store("dtypes", arrays)
        found = server.storage.catalog.entries("dtypes", list(arrays))
        for name, array in arrays.items():
            ours = stats.entry_stats(server.storage, "dtypes", found[name])
            theirs = statistics(array).as_dict()
            for key in ("count", "of", "nan", "inf"):
                assert getattr(ours, key) == theirs[key], (name, key)
            for key in ("min", "max", "mean", "std"):
                if theirs[key] is None:
                    assert getattr(ours, key) is None, (name, key)
                else:
                    assert getattr(ours, key) == pytest.approx(theirs[key], rel=1e-9, abs=1e-12), (name, key)
            assert type(ours.min) is type(theirs["min"]), name


def test_tannery_serve_web_port_auto_names_the_page_and_a_busy_port_stops_the_start(tmp_path):
    with ServerProcess(tmp_path / "data", web_port="auto") as process:
        found = [re.search(r"web page on http://127\.0\.0\.1:(\d+)/", line) for line in process.log_lines]
        ports = [int(m.group(1)) for m in found if m]
        assert len(ports) == 1, process.log_lines
        status, _, body = get(ports[0], "/archives")
        assert status == 200 and "No archive" in body
        assert process.stop() == 0
    with socket_held() as busy:
        done = subprocess.run([sys.executable, "-m", "tannery_server", "serve", "--port", "0", "--data-dir",
                               str(tmp_path / "other"), "--web-port", str(busy)], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "TANNERY_DATA_PORT": "auto", "TANNERY_METRICS_PORT": "auto"})
    assert done.returncode == 1
    assert f"cannot serve the web page on 127.0.0.1:{busy}" in done.stderr and "--web-port" in done.stderr


class socket_held:
    """A port of 127.0.0.1 held by a listening socket while the ``with`` body runs."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind((HOST, 0))
        self.sock.listen()
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()
