"""TLS, mutual TLS and bearer tokens with roles, on the real server (raw gRPC stubs).

Certificates are made here with ``cryptography``: a CA, a server certificate for
127.0.0.1/localhost, client certificates from that CA and from a stranger CA.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tannery_protocol.codec import encode_numpy
from tannery_protocol.v1 import archives_pb2 as pb
from tannery_protocol.v1 import archives_pb2_grpc, channels_pb2, channels_pb2_grpc
from tannery_server import healthcheck
from tannery_server.auth import READ_METHODS, TokenError, load_tokens, parse_tokens_file, parse_tokens_setting
from tannery_server.cli import main as cli_main
from tannery_server.config import Config
from tannery_server.tls import TLSError

from .server_harness import ServerProcess, collect_fetch, running_server, store_requests, wait_for

PAYLOAD = encode_numpy(np.arange(256, dtype=np.float32))
WRITE_TOKEN = "w-6c1f0e2d9b8a-token"
READ_TOKEN = "r-3a7b5c9d1e2f-token"
ENV_TOKEN = "e-8d2c4b6a0f1e-token"
UNKNOWN_TOKEN = "u-0000000000000-token"
Code = grpc.StatusCode


# Certificates ------------------------------------------------------------------------------

def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass
class Authority:
    """A CA that issues certificates into a directory."""

    directory: Path
    name: str

    def __post_init__(self) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder().subject_name(_name(self.name)).issuer_name(_name(self.name))
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)
        self.path = self.directory / f"{self.name}-ca.pem"
        self.path.write_bytes(self.pem)

    def issue(self, common_name: str, *, server: bool, names: tuple[str, ...] = ()) -> tuple[Path, Path]:
        """A certificate and key signed by this CA (server: for 127.0.0.1 and ``names``), as files."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(self.cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        )
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [*(x509.DNSName(n) for n in names), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        cert_path = self.directory / f"{common_name}.pem"
        key_path = self.directory / f"{common_name}-key.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(_pem_key(key))
        return cert_path, key_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca = Authority(directory, "tannery-test")
    server_cert, server_key = ca.issue("store", server=True, names=("store.test", "localhost"))
    client_cert, client_key = ca.issue("trainer", server=False)
    stranger = Authority(directory, "stranger")
    stranger_cert, stranger_key = stranger.issue("intruder", server=False)
    return {
        "ca": ca.path, "server_cert": server_cert, "server_key": server_key, "client_cert": client_cert,
        "client_key": client_key, "stranger_cert": stranger_cert, "stranger_key": stranger_key,
        "stranger_ca": stranger.path, "dir": directory,
    }


def secure_channel(target: str, ca: Path, cert: Path | None = None, key: Path | None = None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        ca.read_bytes(), key.read_bytes() if key else None, cert.read_bytes() if cert else None)
    return grpc.secure_channel(target, credentials)


def health_status(channel: grpc.Channel, metadata=()) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10,
                                                     metadata=metadata).status


SERVING = health_pb2.HealthCheckResponse.SERVING


# TLS ---------------------------------------------------------------------------------------

def test_tls_serves_clients_that_trust_its_ca_and_refuses_plaintext(tmp_path, pki):
    with running_server(tmp_path, tls_cert=pki["server_cert"], tls_key=pki["server_key"]) as server:
        with secure_channel(server.target, pki["ca"]) as channel:
            assert health_status(channel) == SERVING
            stub = archives_pb2_grpc.ArchivesStub(channel)
            stub.Store(store_requests("over-tls", {"w": PAYLOAD}), timeout=10)
            assert collect_fetch(stub.Fetch(pb.FetchRequest(archive="over-tls"), timeout=10)) == {"w": PAYLOAD}
        with grpc.insecure_channel(server.target) as plain:
            with pytest.raises(grpc.RpcError) as refused:
                health_status(plain)
            assert refused.value.code() == Code.UNAVAILABLE
        with secure_channel(server.target, pki["stranger_ca"]) as distrusting:
            with pytest.raises(grpc.RpcError) as refused:
                health_status(distrusting)
            assert refused.value.code() == Code.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate_of_the_client_ca(tmp_path, pki):
    with running_server(tmp_path, tls_cert=pki["server_cert"], tls_key=pki["server_key"],
                        tls_client_ca=pki["ca"]) as server:
        with secure_channel(server.target, pki["ca"], pki["client_cert"], pki["client_key"]) as channel:
            assert health_status(channel) == SERVING
            archives_pb2_grpc.ArchivesStub(channel).Store(store_requests("mtls", {"w": PAYLOAD}), timeout=10)
        for cert, key in ((None, None), (pki["stranger_cert"], pki["stranger_key"])):
            with secure_channel(server.target, pki["ca"], cert, key) as channel:
                with pytest.raises(grpc.RpcError) as refused:
                    archives_pb2_grpc.ArchivesStub(channel).List(pb.ListRequest(), timeout=10)
                assert refused.value.code() == Code.UNAVAILABLE


def test_bad_tls_files_are_named_at_start(tmp_path, pki):
    other_cert, other_key = Authority(tmp_path, "other").issue("other", server=True)
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    cases = [
        (dict(tls_cert=pki["server_cert"], tls_key=other_key), "do not load together"),
        (dict(tls_cert=tmp_path / "absent.pem", tls_key=pki["server_key"]), "cannot read the TLS certificate"),
        (dict(tls_cert=not_pem, tls_key=pki["server_key"]), "is not a PEM file"),
        (dict(tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=not_pem),
         "client CA file .*not.pem .*is not a PEM file"),
    ]
    for settings, message in cases:
        with pytest.raises(TLSError, match=message):
            with running_server(tmp_path, **settings):
                pass
        # Refused before the storage opened: the data directory is free for the next server.
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        Config(tls_cert=pki["server_cert"])
    with pytest.raises(ValueError, match="tls_client_ca .* needs tls_cert"):
        Config(tls_client_ca=pki["ca"])


def test_healthcheck_command_speaks_tls_and_mutual_tls(tmp_path, pki, capsys):
    chain = tmp_path / "chain.pem"  # the leaf, then the CA: the healthcheck's default trust
    chain.write_bytes(pki["server_cert"].read_bytes() + pki["ca"].read_bytes())
    with running_server(tmp_path, tls_cert=chain, tls_key=pki["server_key"]) as server:
        env = {"TANNERY_PORT": str(server.port), "TANNERY_TLS_CERT": str(chain),
               "TANNERY_TLS_KEY": str(pki["server_key"])}
        assert healthcheck.main([], env) == 0
        assert capsys.readouterr().out.strip() == "SERVING"
        # gRPC also trusts the leaf alone; a CA that did not sign it is refused.
        assert healthcheck.main([], {**env, "TANNERY_HEALTHCHECK_CA": str(pki["server_cert"])}) == 0
        assert healthcheck.main([], {**env, "TANNERY_HEALTHCHECK_CA": str(pki["ca"])}) == 0
        assert healthcheck.main([], {**env, "TANNERY_HEALTHCHECK_CA": str(pki["stranger_ca"])}) == 1
        # The name checked is the certificate's first DNS name; another one is refused.
        assert healthcheck.main([], {**env, "TANNERY_HEALTHCHECK_SERVER_NAME": "elsewhere.test"}) == 1
    with running_server(tmp_path, tls_cert=pki["server_cert"], tls_key=pki["server_key"],
                        tls_client_ca=pki["ca"]) as server:
        env = {"TANNERY_PORT": str(server.port), "TANNERY_TLS_CERT": str(pki["server_cert"]),
               "TANNERY_TLS_KEY": str(pki["server_key"]), "TANNERY_TLS_CLIENT_CA": str(pki["ca"]),
               "TANNERY_HEALTHCHECK_CA": str(pki["ca"])}
        # The server's certificate is for server use only: the client CA refuses it as a client's.
        assert healthcheck.main([], env) == 1
        assert healthcheck.main([], {**env, "TANNERY_HEALTHCHECK_CERT": str(pki["client_cert"]),
                                     "TANNERY_HEALTHCHECK_KEY": str(pki["client_key"])}) == 0
    capsys.readouterr()
    assert healthcheck.main([], {"TANNERY_PORT": str(server.port)}) == 1  # stopped: unreachable
    assert "UNAVAILABLE" in capsys.readouterr().err
    assert healthcheck.main([], {"TANNERY_PORT": "x"}) == 2


def test_healthcheck_of_a_plaintext_server(server, capsys):
    assert healthcheck.main(["--service", "tannery.v1.Archives"], {"TANNERY_PORT": str(server.port)}) == 0
    assert capsys.readouterr().out.strip() == "SERVING"


# Tokens: parsing ---------------------------------------------------------------------------

def sha256_hex(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def test_tokens_file_and_setting_formats(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"# deploy tokens\n{WRITE_TOKEN} write\n\n  sha256:{sha256_hex(READ_TOKEN).upper()}  read  "
                    f"# the reader\n")
    tokens = load_tokens(path, f"{ENV_TOKEN}:read, sha256:{sha256_hex('other')}:write")
    assert [tokens.role_of(t) for t in (WRITE_TOKEN, READ_TOKEN, ENV_TOKEN, "other", UNKNOWN_TOKEN, "")] == [
        "write", "read", "read", "write", None, None]
    assert (tokens.count("write"), tokens.count("read")) == (2, 2)
    assert not load_tokens(None, "")


@pytest.mark.parametrize(("text", "message"), [
    (f"{WRITE_TOKEN} admin\n", "line 1: role 'admin' is not 'read' or 'write'"),
    (f"# one\n{WRITE_TOKEN}\n", "line 2: expected a token and a role separated by white space, found 1 field"),
    (f"{WRITE_TOKEN} write extra\n", "found 3 fields"),
    ("sha256:abcd read\n", "line 1: 'sha256:' must be followed by 64 hex digits \\(got 4 characters\\)"),
    (f"{WRITE_TOKEN} write\n{WRITE_TOKEN} read\n", "the same token is listed twice \\(as write and as read\\)"),
    ("# nothing but comments\n\n", "lists no token"),
])
def test_a_malformed_tokens_file_is_refused_without_showing_a_token(tmp_path, text, message):
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(TokenError, match=message) as error:
        load_tokens(path)
    assert WRITE_TOKEN not in str(error.value)


def test_malformed_token_settings(tmp_path):
    with pytest.raises(TokenError, match="TANNERY_TOKENS, item 2: expected <token>:<role>"):
        parse_tokens_setting(f"{READ_TOKEN}:read,{WRITE_TOKEN}")
    with pytest.raises(TokenError, match="item 1: role 'writer'"):
        parse_tokens_setting(f"{WRITE_TOKEN}:writer")
    with pytest.raises(TokenError, match="cannot read the tokens file"):
        load_tokens(tmp_path / "absent")
    assert parse_tokens_file("") == []


@pytest.fixture
def restore_logging():
    """``tannery serve`` configures the server's logger; later tests need it as it was."""
    logger = logging.getLogger("tannery_server")
    saved = (logger.handlers[:], logger.propagate, logger.level)
    yield
    logger.handlers[:], logger.propagate, logger.level = saved[0], saved[1], saved[2]


def test_a_bad_tokens_file_stops_tannery_serve_before_it_listens(tmp_path, capsys, restore_logging):
    path = tmp_path / "tokens"
    path.write_text(f"{WRITE_TOKEN} root\n")
    code = cli_main(["serve", "--port", "0", "--metrics", "off", "--data-dir", str(tmp_path / "data"),
                     "--tokens-file", str(path)])
    err = capsys.readouterr().err
    assert code == 1 and "role 'root' is not 'read' or 'write'" in err and WRITE_TOKEN not in err
    assert not (tmp_path / "data").exists(), "nothing is opened before the tokens are read"


# Tokens: every RPC, every case ------------------------------------------------------------

@dataclass(frozen=True)
class Rpc:
    name: str
    #: Makes the call with ``metadata``; returns the status code it ended with.
    call: Callable[[grpc.Channel, tuple], grpc.StatusCode]
    #: The code when the token may make the call (what the servicer answers).
    allowed: grpc.StatusCode


def _code(thunk: Callable[[], object]) -> grpc.StatusCode:
    try:
        thunk()
    except grpc.RpcError as error:
        return error.code()
    return Code.OK


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _admin_store(channel: grpc.Channel, name: str) -> None:
    archives_pb2_grpc.ArchivesStub(channel).Store(store_requests(name, {"w": PAYLOAD}), timeout=10,
                                                  metadata=(("authorization", f"Bearer {WRITE_TOKEN}"),))


def _store(channel, metadata):
    stub = archives_pb2_grpc.ArchivesStub(channel)
    return _code(lambda: stub.Store(store_requests(_unique("stored"), {"w": PAYLOAD}), timeout=10, metadata=metadata))


def _union(channel, metadata):
    request = pb.UnionRequest(target=_unique("union"), sources=[pb.UnionSource(archive="base", prefix="copy")])
    return _code(lambda: archives_pb2_grpc.ArchivesStub(channel).Union(request, timeout=10, metadata=metadata))


def _fetch(channel, metadata):
    stub = archives_pb2_grpc.ArchivesStub(channel)
    return _code(lambda: collect_fetch(stub.Fetch(pb.FetchRequest(archive="base"), timeout=10, metadata=metadata)))


def _describe(channel, metadata):
    stub = archives_pb2_grpc.ArchivesStub(channel)
    return _code(lambda: stub.Describe(pb.DescribeRequest(archive="base"), timeout=10, metadata=metadata))


def _list(channel, metadata):
    return _code(lambda: archives_pb2_grpc.ArchivesStub(channel).List(pb.ListRequest(), timeout=10, metadata=metadata))


def _delete(channel, metadata):
    name = _unique("doomed")
    _admin_store(channel, name)
    stub = archives_pb2_grpc.ArchivesStub(channel)
    return _code(lambda: stub.Delete(pb.DeleteRequest(archive=name), timeout=10, metadata=metadata))


def _tag(channel, metadata):
    stub = archives_pb2_grpc.ArchivesStub(channel)
    return _code(lambda: stub.Tag(pb.TagRequest(alias=_unique("alias"), archive="base"), timeout=10, metadata=metadata))


def _untag(channel, metadata):
    alias = _unique("untagged")
    stub = archives_pb2_grpc.ArchivesStub(channel)
    stub.Tag(pb.TagRequest(alias=alias, archive="base"), timeout=10, metadata=(("authorization", f"Bearer {WRITE_TOKEN}"),))
    return _code(lambda: stub.Untag(pb.UntagRequest(alias=alias), timeout=10, metadata=metadata))


def _resolve(channel, metadata):
    stub = archives_pb2_grpc.ArchivesStub(channel)
    return _code(lambda: stub.Resolve(pb.ResolveRequest(name="base"), timeout=10, metadata=metadata))


def _list_aliases(channel, metadata):
    stub = archives_pb2_grpc.ArchivesStub(channel)
    return _code(lambda: stub.ListAliases(pb.ListAliasesRequest(), timeout=10, metadata=metadata))


def _watch(channel, metadata):
    """An allowed watch answers the alias's target, then waits for a move that never comes:
    DEADLINE_EXCEEDED."""
    alias = _unique("watched")
    stub = archives_pb2_grpc.ArchivesStub(channel)
    stub.Tag(pb.TagRequest(alias=alias, archive="base"), timeout=10, metadata=(("authorization", f"Bearer {WRITE_TOKEN}"),))
    return _code(lambda: list(stub.Watch(pb.WatchRequest(alias=alias), timeout=0.5, metadata=metadata)))


def _diff(channel, metadata):
    stub = archives_pb2_grpc.ArchivesStub(channel)
    return _code(lambda: stub.Diff(pb.DiffRequest(a="base", b="base"), timeout=10, metadata=metadata))


def _history(channel, metadata):
    alias = _unique("traced")
    stub = archives_pb2_grpc.ArchivesStub(channel)
    stub.Tag(pb.TagRequest(alias=alias, archive="base"), timeout=10, metadata=(("authorization", f"Bearer {WRITE_TOKEN}"),))
    return _code(lambda: stub.History(pb.HistoryRequest(alias=alias), timeout=10, metadata=metadata))


def _data_paths(channel, metadata):
    stub = archives_pb2_grpc.ArchivesStub(channel)
    return _code(lambda: stub.DataPaths(pb.DataPathsRequest(), timeout=10, metadata=metadata))


def _publish(channel, metadata):
    stub = channels_pb2_grpc.ChannelsStub(channel)
    messages = [channels_pb2.PublishRequest(channel="news", chunk=PAYLOAD)]
    return _code(lambda: stub.Publish(iter(messages), timeout=10, metadata=metadata))


def _subscribe(channel, metadata):
    """An allowed subscription waits for payloads that never come: DEADLINE_EXCEEDED."""
    stub = channels_pb2_grpc.ChannelsStub(channel)
    return _code(lambda: list(stub.Subscribe(channels_pb2.SubscribeRequest(channel="quiet"), timeout=0.5,
                                             metadata=metadata)))


def _route(channel, metadata):
    """An allowed member gets its route, then waits for the next that never comes: DEADLINE_EXCEEDED."""
    stub = channels_pb2_grpc.ChannelsStub(channel)
    request = channels_pb2.RouteRequest(channel="quiet", address="127.0.0.1:9", key=bytes(32), member="m")
    return _code(lambda: list(stub.Route(request, timeout=0.5, metadata=metadata)))


RPCS = [
    Rpc("Store", _store, Code.OK),
    Rpc("Union", _union, Code.OK),
    Rpc("Fetch", _fetch, Code.OK),
    Rpc("Describe", _describe, Code.OK),
    Rpc("List", _list, Code.OK),
    Rpc("Delete", _delete, Code.OK),
    Rpc("DataPaths", _data_paths, Code.OK),
    Rpc("Tag", _tag, Code.OK),
    Rpc("Untag", _untag, Code.OK),
    Rpc("Resolve", _resolve, Code.OK),
    Rpc("ListAliases", _list_aliases, Code.OK),
    Rpc("Watch", _watch, Code.DEADLINE_EXCEEDED),
    Rpc("Diff", _diff, Code.OK),
    Rpc("History", _history, Code.OK),
    Rpc("Publish", _publish, Code.OK),
    Rpc("Subscribe", _subscribe, Code.DEADLINE_EXCEEDED),
    Rpc("Route", _route, Code.DEADLINE_EXCEEDED),
]
#: Route too: a follower relays with the token it subscribes with (docs/weight-sync.md, "Whom a relay trusts").
READERS = {"List", "Describe", "Fetch", "Subscribe", "DataPaths", "Resolve", "ListAliases", "Watch", "Diff", "History",
           "Route"}

#: (case, metadata, role the server should grant: None, "read" or "write")
TOKEN_CASES = [
    ("no token", (), None),
    ("unknown token", (("authorization", f"Bearer {UNKNOWN_TOKEN}"),), None),
    ("empty bearer", (("authorization", "Bearer "),), None),
    ("not a bearer", (("authorization", f"Basic {WRITE_TOKEN}"),), None),
    ("the token's hash", (("authorization", f"Bearer {sha256_hex(READ_TOKEN)}"),), None),
    ("read token", (("authorization", f"Bearer {READ_TOKEN}"),), "read"),
    ("lower-case scheme", (("authorization", f"bearer {READ_TOKEN}"),), "read"),
    ("read token from the environment", (("authorization", f"Bearer {ENV_TOKEN}"),), "read"),
    ("write token", (("authorization", f"Bearer {WRITE_TOKEN}"),), "write"),
]


def expected_code(rpc: Rpc, role: str | None) -> grpc.StatusCode:
    if role is None:
        return Code.UNAUTHENTICATED
    if role == "read" and rpc.name not in READERS:
        return Code.PERMISSION_DENIED
    return rpc.allowed


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A server with a write token (raw) and a read token (hashed) in a file and one in the setting."""
    directory = tmp_path_factory.mktemp("guarded")
    tokens = directory / "tokens"
    tokens.write_text(f"{WRITE_TOKEN} write\nsha256:{sha256_hex(READ_TOKEN)} read\n")
    with running_server(directory, tokens_file=tokens, tokens=f"{ENV_TOKEN}:read") as server:
        with server.channel() as channel:
            _admin_store(channel, "base")
        yield server


def test_read_methods_are_those_of_the_issue():
    assert {m.rsplit("/", 1)[-1] for m in READ_METHODS} == READERS


@pytest.mark.parametrize("rpc", RPCS, ids=[r.name for r in RPCS])
@pytest.mark.parametrize(("case", "metadata", "role"), TOKEN_CASES, ids=[c[0] for c in TOKEN_CASES])
def test_every_rpc_with_every_token(guarded, rpc, case, metadata, role):
    with grpc.insecure_channel(guarded.target) as channel:
        assert rpc.call(channel, metadata) == expected_code(rpc, role)


def test_refusals_say_why(guarded):
    stub = archives_pb2_grpc.ArchivesStub(guarded.channel())
    with pytest.raises(grpc.RpcError) as missing:
        stub.List(pb.ListRequest(), timeout=10)
    assert "needs a token" in missing.value.details() and "authorization: Bearer" in missing.value.details()
    with pytest.raises(grpc.RpcError) as unknown:
        stub.List(pb.ListRequest(), timeout=10, metadata=(("authorization", f"Bearer {UNKNOWN_TOKEN}"),))
    assert unknown.value.details() == "the token is not one this server knows"
    with pytest.raises(grpc.RpcError) as read_only:
        stub.Delete(pb.DeleteRequest(archive="base"), timeout=10,
                    metadata=(("authorization", f"Bearer {READ_TOKEN}"),))
    assert read_only.value.details() == "Delete needs a write token; this token's role is read"
    # The refused Delete deleted nothing.
    assert stub.Describe(pb.DescribeRequest(archive="base"), timeout=10,
                         metadata=(("authorization", f"Bearer {READ_TOKEN}"),)).info.entries == 1


def test_health_and_reflection_answer_without_a_token(guarded):
    channel = guarded.channel()
    assert health_status(channel) == SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    services = {s.name for s in next(iter(responses)).list_services_response.service}
    assert "tannery.v1.Archives" in services


def test_reflection_can_be_switched_off(tmp_path):
    with running_server(tmp_path, reflection=False) as server:
        channel = server.channel()
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.RpcError) as off:
            next(iter(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                list_services="")]))))
        assert off.value.code() == Code.UNIMPLEMENTED
        assert health_status(channel) == SERVING
    assert Config.from_env({"TANNERY_REFLECTION": "off"}).reflection is False
    with pytest.raises(ValueError, match="TANNERY_REFLECTION: 'of' is not on or off"):
        Config.from_env({"TANNERY_REFLECTION": "of"})


def test_tokens_and_mutual_tls_together(tmp_path, pki):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{READ_TOKEN} read\n")
    with running_server(tmp_path, tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["ca"],
                        tokens_file=tokens) as server:
        with secure_channel(server.target, pki["ca"], pki["client_cert"], pki["client_key"]) as channel:
            stub = archives_pb2_grpc.ArchivesStub(channel)
            assert _code(lambda: stub.List(pb.ListRequest(), timeout=10)) == Code.UNAUTHENTICATED
            read = (("authorization", f"Bearer {READ_TOKEN}"),)
            assert _code(lambda: stub.List(pb.ListRequest(), timeout=10, metadata=read)) == Code.OK
            assert _code(lambda: stub.Store(store_requests("no", {"w": PAYLOAD}), timeout=10,
                                            metadata=read)) == Code.PERMISSION_DENIED


# Start-up warnings and logs ----------------------------------------------------------------

def test_an_open_server_says_so(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tannery_server")
    with running_server(tmp_path):
        pass
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no tokens configured: the server is open" in w for w in warnings), warnings
    serving = [r.getMessage() for r in caplog.records if "serving on" in r.getMessage()]
    assert "plaintext, no tokens" in serving[0]


def test_tokens_without_tls_are_warned_about(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tannery_server")
    with running_server(tmp_path, tokens=f"{WRITE_TOKEN}:write"):
        pass
    messages = [r.getMessage() for r in caplog.records]
    assert any("tokens are configured without TLS" in m for m in messages)
    assert not any("the server is open" in m for m in messages)
    assert any("plaintext, 1 write and 0 read tokens" in m for m in messages)


def test_no_token_reaches_the_logs_and_refusals_are_logged(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{WRITE_TOKEN} write\n{READ_TOKEN} read\n")
    with ServerProcess(tmp_path / "data", log_format="json", tokens_file=tokens,
                       env={"TANNERY_TOKENS": f"{ENV_TOKEN}:read"}) as proc:
        channel = grpc.insecure_channel(proc.target)
        stub = archives_pb2_grpc.ArchivesStub(channel)
        for token in (WRITE_TOKEN, READ_TOKEN, ENV_TOKEN, UNKNOWN_TOKEN):
            metadata = (("authorization", f"Bearer {token}"),)
            _code(lambda: stub.Store(store_requests(_unique("a"), {"w": PAYLOAD}), timeout=10, metadata=metadata))
            _code(lambda: stub.List(pb.ListRequest(), timeout=10, metadata=metadata))
        _code(lambda: stub.List(pb.ListRequest(), timeout=10))
        channel.close()
        assert wait_for(lambda: sum('"method": "' in line for line in proc.log_lines) >= 9)
        assert proc.stop() == 0
    text = "\n".join(proc.log_lines)
    for token in (WRITE_TOKEN, READ_TOKEN, ENV_TOKEN, UNKNOWN_TOKEN):
        assert token not in text and sha256_hex(token) not in text
    calls = [json.loads(line) for line in proc.log_lines if '"method"' in line]
    statuses = sorted((c["method"], c["status"]) for c in calls)
    assert statuses == sorted([("Store", "OK"), ("Store", "PERMISSION_DENIED"), ("Store", "PERMISSION_DENIED"),
                               ("Store", "UNAUTHENTICATED"), ("List", "OK"), ("List", "OK"), ("List", "OK"),
                               ("List", "UNAUTHENTICATED"), ("List", "UNAUTHENTICATED")])
    assert all(c["peer"].startswith("ipv4:127.0.0.1:") for c in calls)


def test_the_config_never_shows_inline_tokens():
    config = Config(tokens=f"{WRITE_TOKEN}:write")
    assert WRITE_TOKEN not in repr(config) and WRITE_TOKEN not in str(config)


def test_serve_help_explains_the_tokens_file(capsys):
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    text = capsys.readouterr().out
    for words in ("TANNERY_TLS_CERT", "TANNERY_TLS_KEY", "TANNERY_TLS_CLIENT_CA", "TANNERY_TOKENS_FILE",
                  "TANNERY_TOKENS", "TANNERY_REFLECTION", "TANNERY_METRICS_PORT", "sha256:<64 hex",
                  "authorization: Bearer"):
        assert words in text, words


def test_tannery_client_with_mutual_tls_and_tokens(tmp_path, pki):
    torch = pytest.importorskip("torch")
    import tannery

    tokens = tmp_path / "tokens"
    tokens.write_text(f"{WRITE_TOKEN} write\n{READ_TOKEN} read\n")
    tls = tannery.TLS(ca=pki["ca"], cert=pki["client_cert"], key=pki["client_key"])
    tensors = {"w": torch.randn(8, 4), "b": torch.arange(4, dtype=torch.int16)}
    with running_server(tmp_path, tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["ca"],
                        tokens_file=tokens) as server:
        with tannery.Client(server.target, token=WRITE_TOKEN, tls=tls) as writer:
            assert writer.store("model", tensors).entries == 2
        with tannery.Client(server.target, token=READ_TOKEN, tls=tls) as reader:
            fetched = reader.fetch("model")
            assert all(torch.equal(fetched.find(name), tensor) for name, tensor in tensors.items())
            with pytest.raises(tannery.PermissionDenied, match="Delete needs a write token"):
                reader.delete("model")
        with tannery.Client(server.target, tls=tls) as anonymous:
            with pytest.raises(tannery.Unauthenticated, match="needs a token"):
                anonymous.list()
        with tannery.Client(server.target, token=READ_TOKEN, tls=tannery.TLS(ca=pki["ca"])) as no_certificate:
            with pytest.raises(tannery.Unavailable):
                no_certificate.list()
