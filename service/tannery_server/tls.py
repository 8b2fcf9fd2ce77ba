"""The server's TLS credentials from PEM files: certificate and key, optionally a client CA.

The files are checked with the standard library's :mod:`ssl` first (a missing file, a
file that is not PEM, or a key that does not match the certificate), so a mistake is
named at start instead of surfacing as gRPC's handshake failures.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from .config import Config


class TLSError(ValueError):
    """A TLS file that is missing, unreadable or does not fit; the message names it."""


def _read(path: Path, what: str, setting: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TLSError(f"cannot read the {what} {path} ({setting}): {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise TLSError(f"the {what} {path} ({setting}) is not a PEM file (no '-----BEGIN' line)")
    return data


def check_files(config: Config) -> None:
    """TLSError unless the certificate and key load together and the client CA loads."""
    assert config.tls_cert is not None and config.tls_key is not None
    _read(config.tls_cert, "TLS certificate", "TANNERY_TLS_CERT")
    _read(config.tls_key, "TLS private key", "TANNERY_TLS_KEY")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    except ssl.SSLError as exc:
        raise TLSError(f"the TLS certificate {config.tls_cert} and key {config.tls_key} do not load together: "
                       f"{exc.reason or exc} (is the key the certificate's, and unencrypted?)") from None
    if config.tls_client_ca is not None:
        _read(config.tls_client_ca, "client CA file", "TANNERY_TLS_CLIENT_CA")
        try:
            context.load_verify_locations(cafile=config.tls_client_ca)
        except ssl.SSLError as exc:
            raise TLSError(f"the client CA file {config.tls_client_ca} has no usable certificate: "
                           f"{exc.reason or exc}") from None


def server_credentials(config: Config) -> grpc.ServerCredentials | None:
    """TLS credentials (requiring client certificates when a client CA is set), or None without TLS."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    check_files(config)
    key = _read(config.tls_key, "TLS private key", "TANNERY_TLS_KEY")
    chain = _read(config.tls_cert, "TLS certificate", "TANNERY_TLS_CERT")
    client_ca = None
    if config.tls_client_ca is not None:
        client_ca = _read(config.tls_client_ca, "client CA file", "TANNERY_TLS_CLIENT_CA")
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


__all__ = ["TLSError", "check_files", "server_credentials"]
