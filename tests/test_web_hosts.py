"""Issue 42: the web page answers only the names it was started for (421 for any other Host,
against DNS rebinding, tokens or not), and a form posted from another origin is refused (403).
Over real HTTP against a real server on loopback."""

from __future__ import annotations

import urllib.parse

import pytest
import torch

import tannery
from tannery_server.web.hosts import AllowedHosts, host_name

from .server_harness import running_server
from .test_web import get, web_port

TOKEN = "hosts-read-token"
FOREIGN = "rebind.attacker.example"
#: Every kind of path: the pages, a part, a download, a static file, the forms.
PATHS = ["/archives", "/archive?name=m", "/entry?archive=m&name=w", "/tree?name=m&node=", "/server",
         "/download/entry?archive=m&name=w", "/static/style.css", "/"]


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    """A server without tokens, its web page on loopback, an archive "m"; tannery.example allowed."""
    with running_server(tmp_path_factory.mktemp("hosts"), web_port=0, web_allowed_hosts="Tannery.Example") as server:
        with tannery.Client(server.target) as client:
            client.store("m", {"w": torch.arange(6.0)})
        yield server


def test_a_foreign_host_is_refused_with_421_on_every_path_and_says_how_to_allow_it(open_server):
    port = web_port(open_server)
    for path in PATHS:
        status, _, body = get(port, path, headers={"Host": f"{FOREIGN}:{port}"})
        assert status == 421, (path, status)
        assert "/archive?name=m" not in body and "float32" not in body  # neither names nor metadata
        assert FOREIGN in body and "--web-allowed-hosts" in body and "DNS-rebinding" in body
    status, _, _ = get(port, "/login", method="POST", body=b"token=x",
                       headers={"Host": FOREIGN, "Content-Type": "application/x-www-form-urlencoded"})
    assert status == 421


def test_the_names_it_was_started_for_are_answered(open_server):
    port = web_port(open_server)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}", f"tannery.example:{port}"):
        status, _, body = get(port, "/archive?name=m", headers={"Host": host})
        assert status == 200 and "w" in body, host


def test_a_foreign_host_is_refused_with_a_valid_token_too(tmp_path):
    with running_server(tmp_path, web_port=0, tokens=f"{TOKEN}:read") as server:
        port = web_port(server)
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert get(port, "/archives", headers=bearer)[0] == 200
        assert get(port, "/archives", headers={**bearer, "Host": FOREIGN})[0] == 421


def _sign_in(port: int, origin: str | None, extra: dict | None = None) -> tuple[int, dict, str]:
    headers = {"Content-Type": "application/x-www-form-urlencoded", **(extra or {})}
    if origin is not None:
        headers["Origin"] = origin
    body = urllib.parse.urlencode({"token": TOKEN, "next": "/archives"}).encode()
    return get(port, "/login", method="POST", body=body, headers=headers)


def test_a_cross_site_sign_in_is_refused_with_403_and_sets_no_cookie(tmp_path):
    with running_server(tmp_path, web_port=0, tokens=f"{TOKEN}:read") as server:
        port = web_port(server)
        for origin in ("http://evil.example", f"http://localhost.evil.example:{port}", "null",
                       f"https://127.0.0.1:{port}"):
            status, headers, body = _sign_in(port, origin)
            assert status == 403 and "Set-Cookie" not in headers, origin
            assert "posted from another site" in body and "sign in from this server&#39;s own page" in body
            assert get(port, "/logout", method="POST", headers={"Origin": origin})[0] == 403
        status, headers, _ = _sign_in(port, "null", {"Sec-Fetch-Site": "cross-site"})
        assert status == 403 and "Set-Cookie" not in headers
        assert _sign_in(port, f"http://127.0.0.1:{port}", {"Sec-Fetch-Site": "same-site"})[0] == 403
        # The page itself (a browser under no-referrer sends Origin null beside Sec-Fetch-Site);
        # no browser page at all.
        for origin, fetch in ((f"http://127.0.0.1:{port}", {}), ("null", {"Sec-Fetch-Site": "same-origin"}),
                              (None, {})):
            status, headers, _ = _sign_in(port, origin, fetch)
            assert status == 303 and "tannery_token=" in headers.get("Set-Cookie", ""), origin


def test_which_names_each_bind_address_answers():
    loopback = AllowedHosts("127.0.0.1")
    assert loopback.allows("127.0.0.1:80") and loopback.allows("localhost") and loopback.allows("[::1]:1")
    assert not loopback.allows("10.0.0.1") and not loopback.allows(FOREIGN)
    everywhere = AllowedHosts("0.0.0.0", "tannery.example")
    assert everywhere.allows("10.1.2.3:8080") and everywhere.allows("[fe80::1]") and everywhere.allows("tannery.example")
    assert not everywhere.allows(FOREIGN) and not everywhere.allows("127.0.0.1.nip.io")
    one = AllowedHosts("10.0.0.5")
    assert one.allows("10.0.0.5:1234") and not one.allows("localhost") and not one.allows("10.0.0.6")
    assert host_name("[::1]:80") == "::1" and host_name("::1") == "::1" and host_name("A.b:1") == "a.b"
