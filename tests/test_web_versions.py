"""The web page's fixes and pages of issue 39 over plain HTTP, against a real server: no inline
script or style and a policy without 'unsafe-inline'; an opaque sign-in cookie and sign-out; kept
files apart from the tensors and viewable as text; traffic by direction; the entry filter; the
diff page (its figures as Diff's) and an alias's history. tests/test_web_browser.py drives them
in a real browser."""

from __future__ import annotations

import html
import re
import urllib.parse

import pytest
import torch

import tannery

from .server_harness import running_server
from .test_web import get, web_port

READ_TOKEN, WRITE_TOKEN = "web39-read", "web39-write"
READ = {"Authorization": f"Bearer {READ_TOKEN}"}
CONFIG = b'{"hidden_size": 384, "note": "<script>alert(1)</script>"}'


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A server with the page on and tokens: a model in two versions (with kept files), an alias moved."""
    tmp = tmp_path_factory.mktemp("web39")
    with running_server(tmp, web_port=0, tokens=f"{READ_TOKEN}:read,{WRITE_TOKEN}:write") as server:
        with tannery.Client(server.target, token=WRITE_TOKEN, transport="local") as client:
            torch.manual_seed(0)
            v1 = {"enc.layer.0.w": torch.randn(64, 32), "enc.layer.1.w": torch.randn(64, 32), "head.w": torch.randn(4, 64)}
            v2 = {**v1, "head.w": v1["head.w"] + 0.5}
            for _ in range(3):  # three pushes of one model: received three times, sent little
                client.store("model/v1", v1, files={"config.json": CONFIG, "README.md": b"# a model\n"}, replace=True)
            client.store("model/v2", v2, files={"config.json": CONFIG.replace(b"384", b"512"), "README.md": b"# a model\n"})
            client.tag("prod", "model/v1")
            client.tag("prod", "model/v2")
        yield server


def _page(store, path: str) -> str:
    status, _, body = get(web_port(store), path, headers=READ)
    assert status == 200, (path, status, body[:500])
    return body


def test_no_inline_script_or_style_and_a_policy_without_unsafe_inline(store):
    port = web_port(store)
    for path in ("/archives", "/archive?name=model/v1", "/entry?archive=model/v1&name=head.w", "/server",
                 "/diff?a=model/v1&b=model/v2", "/alias?name=prod", "/file?archive=model/v1&name=@file:config.json"):
        status, headers, body = get(port, path, headers=READ)
        assert status == 200, path
        policy = headers["Content-Security-Policy"]
        assert "unsafe-inline" not in policy and "script-src 'self'" in policy and "style-src 'self'" in policy
        assert re.findall(r"<script[^>]*>", body) == ['<script src="/static/page.js" defer>'], path
        assert "<style" not in body and not re.search(r"\s(on[a-z]+|style)=", body), path
    for name, kind in (("page.js", "text/javascript"), ("style.css", "text/css")):
        status, headers, body = get(port, f"/static/{name}")  # no token: the sign-in page needs them
        assert status == 200 and headers["Content-Type"].startswith(kind) and len(body) > 100
    assert get(port, "/static/other.js")[0] == 404


def test_the_cookie_is_opaque_and_sign_out_ends_it(store):
    port = web_port(store)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, headers, _ = get(port, "/login", method="POST", headers=form,
                             body=urllib.parse.urlencode({"token": READ_TOKEN, "next": "/archives"}).encode())
    assert status == 303
    cookie = re.match(r"tannery_token=([^;]+)", headers["Set-Cookie"]).group(1)
    assert READ_TOKEN not in headers["Set-Cookie"] and len(cookie) >= 40
    status, _, body = get(port, "/archives", headers={"Cookie": f"tannery_token={cookie}"})
    assert status == 200 and 'id="sign-out"' in body
    status, headers, _ = get(port, "/logout", method="POST", headers={"Cookie": f"tannery_token={cookie}", **form})
    assert status == 303 and headers["Location"] == "/archives" and 'tannery_token=""' in headers["Set-Cookie"]
    status, _, body = get(port, "/archives", headers={"Cookie": f"tannery_token={cookie}"})
    assert status == 403 and "signed out" in body and 'id="login"' in body
    assert get(port, "/archives", headers={"Cookie": f"tannery_token={READ_TOKEN}"})[0] == 403  # the raw token: no


def test_kept_files_are_apart_from_the_tensors_and_shown_as_text(store):
    body = _page(store, "/archive?name=model/v1")
    params = 64 * 32 * 2 + 4 * 64
    assert f'id="param-total" data-value="{params}"' in body and 'id="entry-count">3<' in body
    assert 'data-dtype="uint8"' not in body and "@file:" not in body.split('id="tree"')[1]
    assert 'data-file="config.json"' in body and 'data-file="README.md"' in body
    assert f'id="tensor-bytes" data-value="{params * 4}"' in body  # float32: the files' bytes are not counted
    tree = _page(store, "/tree?name=model/v1&node=enc")
    assert "@file" not in tree
    shown = _page(store, "/file?archive=model/v1&name=%40file%3Aconfig.json")
    text = re.search(r'<pre class="file" id="file-text">(.*?)</pre>', shown, re.S).group(1)
    assert html.unescape(text) == CONFIG.decode() and "<script>alert" not in shown
    status, _, body = get(web_port(store), "/file?archive=model/v1&name=head.w", headers=READ)
    assert status == 404 and "keeps no file as entry 'head.w'" in html.unescape(body)


def test_traffic_counts_a_stores_bytes_as_received(store):
    body = _page(store, "/server")
    row = re.search(r'<tr data-method="Store" data-calls="(\d+)" data-received="(\d+)" data-sent="(\d+)">', body)
    calls, received, sent = map(int, row.groups())
    assert calls == 4 and received > 3 * 64 * 32 * 2 * 4 and sent < received / 50


def test_the_entry_filter_shows_the_tensors_that_hold_the_text(store):
    body = _page(store, "/archive?name=model/v1&filter=LAYER.1")
    assert 'data-entry="enc.layer.1.w"' in body and 'data-entry="enc.layer.0.w"' not in body
    assert 'id="filter-count">1 of 3 tensors hold' in body and 'data-entry="head.w"' not in body


def test_the_diff_page_shows_what_diff_computes(store):
    with tannery.Client(store.target, token=READ_TOKEN) as client:
        diff = client.diff("model/v1", "prod")
    body = _page(store, "/diff?a=model/v1&b=prod")
    (head,) = [e for e in diff.entries if e.name == "head.w"]
    assert f'data-entry="head.w" data-change="values"' in body
    assert f'data-key="max_abs" data-value="{head.values.max_abs}"' in body
    assert f'data-key="relative_l2" data-value="{head.values.relative_l2}"' in body
    assert 'data-entry="@file:config.json" data-change="values"' in body
    assert 'data-same="2" data-value-changed="1"' in body and 'data-files-changed="1"' in body
    assert body.index('id="changed"') < body.index('id="same"')  # changed first, the rest folded
    form = _page(store, "/diff")
    assert 'id="diff-form"' in form and 'id="changed"' not in form
    status, _, body = get(web_port(store), "/diff?a=model/v1&b=nope", headers=READ)
    assert status == 404 and "'nope' not found" in html.unescape(body)


def test_the_alias_page_lists_its_moves_with_diff_links(store):
    body = _page(store, "/alias?name=prod")
    assert 'id="alias-target">Points at <a href="/archive?name=model/v2">' in body
    rows = re.findall(r'<tr data-from="([^"]*)" data-to="([^"]*)">', body)
    assert rows == [("model/v1", "model/v2"), ("", "model/v1")]
    assert 'href="/diff?a=model/v1&amp;b=model/v2">diff</a>' in body
    assert "write token sha256:" in body
    assert 'href="/alias?name=prod"' in _page(store, "/archives")
    status, _, body = get(web_port(store), "/alias?name=nope", headers=READ)
    assert status == 404 and "alias 'nope' not found" in html.unescape(body)


def _download(store, path: str) -> tuple[dict, bytes]:
    import http.client

    from .server_harness import HOST

    conn = http.client.HTTPConnection(HOST, web_port(store), timeout=30)
    try:
        conn.request("GET", path, headers=READ)
        response = conn.getresponse()
        assert response.status == 200, (path, response.status)
        return dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_downloads_of_an_entry_and_of_an_archive(store, tmp_path):
    import io

    import numpy as np
    import safetensors.torch

    with tannery.Client(store.target, token=WRITE_TOKEN) as client:
        mixed = {"mask": torch.arange(37) % 3 == 0, "big": torch.randn(3, 1 << 20), "i": torch.arange(5),
                 "h": torch.randn(7).half(), "bf": torch.randn(9).to(torch.bfloat16)}
        client.store("downloads", mixed, metadata={"format": "pt"}, files={"config.json": b"{}"})
    headers, body = _download(store, "/download/entry?archive=downloads&name=big")
    assert headers["Content-Disposition"] == 'attachment; filename="big.npy"' and int(headers["Content-Length"]) == len(body)
    assert np.array_equal(np.load(io.BytesIO(body)), mixed["big"].numpy())
    _, body = _download(store, "/download/entry?archive=downloads&name=mask")
    assert np.array_equal(np.load(io.BytesIO(body)), mixed["mask"].numpy())
    status, _, page = get(web_port(store), "/download/entry?archive=downloads&name=bf", headers=READ)
    assert status == 400 and "which a .npy file cannot record" in page and "tannery get downloads bf -o bf.pt" in page
    headers, body = _download(store, "/download/archive?name=downloads")
    assert headers["Content-Disposition"] == 'attachment; filename="downloads.safetensors"'
    (tmp_path / "a.safetensors").write_bytes(body)
    loaded = safetensors.torch.load_file(str(tmp_path / "a.safetensors"))
    assert set(loaded) == set(mixed)  # the kept file is no tensor
    for name, tensor in mixed.items():
        assert torch.equal(loaded[name], tensor), name
    with open(tmp_path / "a.safetensors", "rb") as f:
        from safetensors import safe_open

        assert safe_open(f.name, "pt").metadata() == {"format": "pt"}


def test_a_log_scale_histogram(store):
    body = _page(store, "/entry?archive=model/v1&name=head.w&scale=log")
    heights = re.search(r'data-scale="log" data-heights="([^"]+)"', body).group(1)
    linear = re.search(r'data-scale="linear" data-heights="([^"]+)"',
                       _page(store, "/entry?archive=model/v1&name=head.w")).group(1)
    small = [(float(lg), float(ln)) for lg, ln in zip(heights.split(","), linear.split(",")) if 0 < float(ln) < 20]
    assert small and all(lg > ln for lg, ln in small)  # the tail's short bars grow on a log scale
    assert 'id="linear-scale"' in body
    status, _, page = get(web_port(store), "/entry?archive=model/v1&name=head.w&scale=cubic", headers=READ)
    assert status == 400 and "scale=log" in page
