"""A small HTTP proxy in front of the real S3 server (SeaweedFS) that refuses what a test asks:
fault injection for the bucket, the real server behind it doing everything else.

Requests are forwarded byte for byte with their headers (the Host header too, so AWS
signatures still match); :attr:`S3Proxy.refuse_delete` names a substring of the object keys
whose DELETE is answered ``403 AccessDenied`` instead, and :attr:`refused` counts those;
:attr:`slow_delete` one whose DELETE is held :attr:`slow_seconds` before it is forwarded."""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
           b"<Message>refused by the test's proxy</Message></Error>")
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}


class S3Proxy:
    """The proxy, listening on loopback; :attr:`endpoint` is what a client points at."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.refuse_delete: str | None = None
        self.refused = 0
        self.slow_delete: str | None = None
        self.slow_seconds = 0.0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-proxy", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "DELETE" and proxy.refuse_delete and proxy.refuse_delete in self.path:
                    proxy.refused += 1
                    self._answer(403, [("Content-Type", "application/xml")], _DENIED)
                    return
                if self.command == "DELETE" and proxy.slow_delete and proxy.slow_delete in self.path:
                    time.sleep(proxy.slow_seconds)
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        if name.lower() not in _HOP:
                            upstream.putheader(name, value)
                    upstream.endheaders(body)
                    reply = upstream.getresponse()
                    data = reply.read()
                    headers = [(k, v) for k, v in reply.getheaders() if k.lower() not in _HOP]
                    self._answer(reply.status, headers, data, head=self.command == "HEAD")
                finally:
                    upstream.close()

            def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes, head: bool = False) -> None:
                self.send_response(status)
                for name, value in headers:
                    if name.lower() != "content-length" or head:
                        self.send_header(name, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler
