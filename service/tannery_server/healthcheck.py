"""``python -m tannery_server.healthcheck``: exit 0 when the server's gRPC health service says SERVING.

The container's HEALTHCHECK. It reads the server's own ``TANNERY_*`` settings, so it
reaches the server the way the server listens: the port, and TLS when ``TANNERY_TLS_CERT``
is set. With TLS it trusts ``TANNERY_HEALTHCHECK_CA`` (default: the server's certificate
file, which works when that file holds the chain up to its root, or a self-signed
certificate) and checks the certificate for ``TANNERY_HEALTHCHECK_SERVER_NAME`` (default:
the certificate's first DNS name). With mutual TLS it presents
``TANNERY_HEALTHCHECK_CERT`` and ``TANNERY_HEALTHCHECK_KEY`` (default: the server's own,
which works when the client CA signed them for client use too). Health answers without a
token. Exit status: 0 serving, 1 not serving or unreachable, 2 bad settings.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from pathlib import Path
from typing import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .config import Config

_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def certificate_name(path: Path) -> str | None:
    """The first DNS name (else the common name) of the first certificate of a PEM file."""
    try:
        decoded = ssl._ssl._test_decode_cert(str(path))  # the stdlib's own PEM decoder (no extra package)
    except (AttributeError, OSError, ssl.SSLError, ValueError):
        return None
    for kind, value in decoded.get("subjectAltName", ()):
        if kind == "DNS":
            return value
    for rdn in decoded.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return None


def _target(config: Config) -> str:
    host = "127.0.0.1" if config.host in _WILDCARDS else config.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{config.port}"


def channel_for(config: Config, env: Mapping[str, str]) -> grpc.Channel:
    """A channel to the server described by ``config``, with TLS as it listens."""
    target = env.get("TANNERY_HEALTHCHECK_TARGET") or _target(config)
    if config.tls_cert is None:
        return grpc.insecure_channel(target)
    ca = Path(env.get("TANNERY_HEALTHCHECK_CA") or config.tls_cert)
    key = cert = None
    if config.tls_client_ca is not None:
        cert = Path(env.get("TANNERY_HEALTHCHECK_CERT") or config.tls_cert).read_bytes()
        key = Path(env.get("TANNERY_HEALTHCHECK_KEY") or config.tls_key).read_bytes()
    credentials = grpc.ssl_channel_credentials(ca.read_bytes(), key, cert)
    name = env.get("TANNERY_HEALTHCHECK_SERVER_NAME") or certificate_name(config.tls_cert)
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(target, credentials, options)


def check(config: Config, env: Mapping[str, str], service: str = "", timeout: float = 5.0) -> str:
    """The health status name of ``service`` ("" for the whole server); grpc.RpcError if unreachable."""
    with channel_for(config, env) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tannery_server.healthcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--service", default="", help="the service to ask about (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    env = os.environ if env is None else env
    try:
        config = Config.from_env(env)
    except ValueError as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 2
    try:
        status = check(config, env, args.service, args.timeout)
    except OSError as exc:
        print(f"healthcheck: cannot read a TLS file: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"healthcheck: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
