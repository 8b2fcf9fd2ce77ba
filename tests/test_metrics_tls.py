"""Issue 42: /metrics over HTTPS when the server has TLS (``--metrics-tls as-grpc``, the default),
with the server's certificate, and client certificates required on a mutual-TLS server; plain
HTTP on request (``off``) or without TLS. Real servers, real HTTPS requests."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request

import pytest

from tannery_server.config import Config

from .server_harness import HOST, running_server
from .test_security import pki  # noqa: F401  (the test CA, server and client certificates)


def scrape(url: str, context: ssl.SSLContext | None = None) -> str:
    return urllib.request.urlopen(url, timeout=10, context=context).read().decode()


def trusting(pki, client: bool = False) -> ssl.SSLContext:
    """A client context trusting the test CA (the certificate names localhost), with the
    client certificate when ``client``."""
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    if client:
        context.load_cert_chain(str(pki["client_cert"]), str(pki["client_key"]))
    return context


def test_metrics_are_https_with_the_servers_certificate_when_it_has_tls(tmp_path, pki):
    with running_server(tmp_path, tls_cert=pki["server_cert"], tls_key=pki["server_key"]) as server:
        port = server.metrics_port
        assert "tannery_archives" in scrape(f"https://localhost:{port}/metrics", trusting(pki))
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            scrape(f"http://{HOST}:{port}/metrics")  # plaintext gets no counters


def test_a_mutual_tls_server_asks_the_scraper_for_a_client_certificate(tmp_path, pki):
    with running_server(tmp_path, tls_cert=pki["server_cert"], tls_key=pki["server_key"],
                        tls_client_ca=pki["ca"]) as server:
        url = f"https://localhost:{server.metrics_port}/metrics"
        assert "tannery_archives" in scrape(url, trusting(pki, client=True))
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            scrape(url, trusting(pki))


def test_metrics_tls_off_keeps_plain_http_and_on_needs_a_certificate(tmp_path, pki):
    with running_server(tmp_path, tls_cert=pki["server_cert"], tls_key=pki["server_key"],
                        metrics_tls="off") as server:
        assert "tannery_archives" in scrape(f"http://{HOST}:{server.metrics_port}/metrics")
    with pytest.raises(ValueError, match="metrics_tls on needs tls_cert"):
        Config(metrics_tls="on")
    with pytest.raises(ValueError, match="metrics_tls 'yes' is not as-grpc, on or off"):
        Config(metrics_tls="yes")
    assert not Config().metrics_over_tls
