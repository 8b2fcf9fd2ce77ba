"""The server's settings: one frozen dataclass, filled from flags and ``TANNERY_*`` variables."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Config:
    """Everything the server reads at start-up.

    Each field ``x`` has an environment variable ``TANNERY_X`` and a flag ``--x`` (with
    dashes); see :mod:`tannery_server.cli` for what each one means.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    data_dir: Path = Path("./tannery-data")
    #: Where the catalog lives: empty (or ``sqlite:``) for ``data_dir/catalog.sqlite3``,
    #: ``postgresql://USER@HOST:PORT/DB`` for one that replicas share.
    catalog: str = ""
    #: Where blobs live: empty (or ``file:``) for ``data_dir/blobs``, ``s3://BUCKET/PREFIX``
    #: for a bucket (endpoint and credentials from the AWS_* variables).
    blobs: str = ""
    #: With ``blobs`` in a bucket: create the bucket at start when it does not exist (else a
    #: missing bucket fails the start, naming it and the remedy).
    create_bucket: bool = False
    #: A local read cache of blobs from a bucket: its directory (None: no cache) and size.
    cache_dir: Path | None = None
    cache_size: int = 10 * GiB
    #: A shared store: seconds an unreferenced blob is kept before it is collected (and a
    #: Fetch reading it when its archive went away still finds it).
    gc_grace_seconds: float = 600.0
    #: A shared store: seconds a Store's hold on its blobs lasts unless renewed (a replica
    #: renews its own; those of a replica that died expire after this).
    lease_seconds: float = 120.0
    #: Seconds between two checks that the catalog and blob store answer (gRPC health
    #: follows: NOT_SERVING while one does not).
    health_check_seconds: float = 5.0
    #: Unix socket of the same-host data path: empty for ``data_dir/tannery.sock``, "off" for none.
    socket: str = ""
    #: Octal mode of the same-host socket: 0600 (its own user only) unless told otherwise
    #: (0660 with a group, the socket in a directory that group may search).
    socket_mode: str = "0600"
    #: At start, take the group's and others' access away from the data directory (else a
    #: data directory they may read is only warned about).
    fix_permissions: bool = False
    #: TCP port of the direct data connection (on ``host``): 0 for a free one the OS picks
    #: (``auto``, the default: clients learn it from the DataPaths call), None for none (``off``).
    #: Given as text (``"off"``, ``"auto"``, ``"50052"``), it is read by :func:`parse_port`.
    data_port: int | None = 0
    #: Bytes of tensor data per message the server sends (Fetch, Subscribe). 1 MiB: 2 MiB
    #: cost the server a little less CPU per byte (docs/benchmarks.md, "Fetch path") but let a
    #: client that writes what it receives to disk (tannery pull) hold about twice as many
    #: bytes in gRPC's buffers, over the 64 MiB its memory test allows. At most 3 MiB.
    chunk_size: int = MiB
    #: Take and send small entries whole, several to a gRPC message (``StoreRequest.entries``,
    #: ``FetchResponse.entries``), and say so in DataPaths. Off: a server as before them
    #: (Store refuses the field, Fetch sends one entry per message).
    batched_entries: bool = True
    #: Largest payload (header included) an archive entry may have.
    max_payload_bytes: int = 256 * GiB
    #: Largest rank of a stored tensor.
    max_rank: int = 64
    #: Longest archive or entry name, in UTF-8 bytes.
    max_name_bytes: int = 1024
    #: Most entries in one archive.
    max_entries: int = 1_000_000
    #: Moves an alias's history keeps (Tag, Untag, a forced Delete), the oldest dropped first.
    alias_history: int = 1000
    #: Most bytes the space reserve (``<data_dir>/reserve``) holds back so that Delete works
    #: on a full disk; it follows the catalog's size (see :mod:`.storage.reserve`); 0 for none.
    reserve_bytes: int = 64 * MiB
    #: Seconds in-flight calls get to finish on SIGTERM/SIGINT.
    grace_seconds: float = 30.0
    #: "text" or "json" log lines.
    log_format: str = "text"
    #: Bytes a channel subscriber may have queued before publishers wait for it.
    channel_buffer_bytes: int = 64 * MiB
    #: Seconds a publisher waits for a full subscriber before that subscriber is dropped.
    channel_timeout_seconds: float = 10.0
    #: Followers each relay member passes a channel's payloads on to (1: a chain; 0: no relays,
    #: every follower subscribes to this server): docs/weight-sync.md, "Relays".
    relay_fanout: int = 1
    #: NATS server URLs, comma-separated (``nats://[USER:PASS@]HOST:PORT``, ``tls://`` for TLS):
    #: channels across replicas (:mod:`.nats_fabric`); empty for channels in this server only.
    nats: str = field(default="", repr=False)
    #: A NATS credentials file (JWT and NKey seed), when NATS asks for one.
    nats_creds: Path | None = None
    #: Bytes of payloads from other replicas one channel may hold here (being reassembled, or
    #: whole and waiting for the subscribers' buffers): also the largest cross-replica payload.
    nats_channel_bytes: int = 256 * MiB
    #: Threads that read and write blob files (many Fetch calls proceed in parallel).
    io_threads: int = 16
    #: With a bucket: most bytes of payloads and packs this server holds in memory before they
    #: go to the bucket, whatever the number of Stores; beyond it they spill to unnamed
    #: temporary files in the data directory (:mod:`.storage.upload_memory`).
    upload_memory: int = 256 * MiB
    #: PEM files of the server's certificate (with its chain) and private key: TLS when set.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: PEM file of the CAs that sign client certificates: mutual TLS when set.
    tls_client_ca: Path | None = None
    #: A file of bearer tokens and their roles (see :mod:`tannery_server.auth`).
    tokens_file: Path | None = None
    #: Tokens given inline, ``token:role,sha256:<hex>:role`` (never printed).
    tokens: str = field(default="", repr=False)
    #: Serve gRPC server reflection (answers without a token).
    reflection: bool = True
    #: Serve Prometheus metrics over HTTP.
    metrics: bool = True
    #: Whether the metrics endpoint is HTTPS: ``as-grpc`` (when the server has TLS: its certificate,
    #: and its client CA, whose certificates are then required), ``on`` (the same, TLS needed) or
    #: ``off`` (plain HTTP, as Prometheus scrapes by default).
    metrics_tls: str = "as-grpc"
    #: Address of the metrics endpoint; empty for the same as ``host``.
    metrics_host: str = ""
    #: Port of the metrics endpoint: 0 for a free one the OS picks (``auto``, the default: the
    #: start line says which), None for none (``off``, as ``metrics`` off). Text as for
    #: ``data_port``. The container image sets 20051 (:data:`IMAGE_METRICS_PORT`).
    metrics_port: int | None = 0
    #: Port of the read-only web page (:mod:`.web`): None for none (``off``, the default), 0 for
    #: a free one the OS picks (``auto``: the start line says which), else that port.
    web_port: int | None = None
    #: Address of the web page: loopback unless told otherwise (the page shows what the store holds).
    web_host: str = "127.0.0.1"
    #: More names the web page answers for, comma-separated (beside its address, and localhost
    #: on loopback): any other Host header is refused (421), against DNS rebinding.
    web_allowed_hosts: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        for name in SIDE_PORTS:
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    object.__setattr__(self, name, parse_port(value))
                except ValueError as exc:
                    raise ValueError(f"bad configuration: {name} {exc}") from None
        for name in _PATH_FIELDS:
            value = getattr(self, name)
            object.__setattr__(self, name, Path(value) if value not in (None, "") else None)
        problems = []
        for name in SIDE_PORTS:
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                problems.append(f"{name} {value} is not in 0..65535 (or off)")
        if (self.tls_cert is None) != (self.tls_key is None):
            problems.append("tls_cert and tls_key go together: set both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            problems.append("tls_client_ca (mutual TLS) needs tls_cert and tls_key as well")
        if self.reserve_bytes < 0:
            problems.append(f"reserve_bytes {self.reserve_bytes} is negative")
        if not 0 <= self.port <= 65535:
            problems.append(f"port {self.port} is not in 0..65535")
        if self.data_port and self.data_port == self.port:
            problems.append(f"data_port {self.data_port} is the gRPC port too: choose another, auto for a free one, "
                            "or off for none")
        if not 4096 <= self.chunk_size <= 3 * MiB:
            problems.append(f"chunk_size {self.chunk_size} is not in 4096..{3 * MiB} (gRPC messages stay under 4 MiB)")
        for name in ("max_payload_bytes", "max_rank", "max_name_bytes", "max_entries", "channel_buffer_bytes",
                     "io_threads", "nats_channel_bytes", "alias_history", "upload_memory"):
            if getattr(self, name) < 1:
                problems.append(f"{name} {getattr(self, name)} must be at least 1")
        if self.max_rank > 255:
            problems.append(f"max_rank {self.max_rank} is over 255, the most a payload can carry")
        if self.catalog and self.catalog.split(":", 1)[0] not in CATALOG_SCHEMES:
            problems.append(f"catalog {without_password(self.catalog)!r} is not a sqlite: or postgresql:// URL")
        if self.blobs and self.blobs.split(":", 1)[0] not in BLOB_SCHEMES:
            problems.append(f"blobs {self.blobs!r} is not a file: or s3:// URL")
        for url in filter(None, (u.strip() for u in self.nats.split(","))):
            if url.split(":", 1)[0] not in NATS_SCHEMES or "://" not in url:
                problems.append(f"nats {without_password(url)!r} is not a nats:// or tls:// URL")
        if self.cache_size < 0:
            problems.append(f"cache_size {self.cache_size} is negative")
        if self.health_check_seconds <= 0:
            problems.append(f"health_check_seconds {self.health_check_seconds} must be positive")
        if self.lease_seconds <= 0:
            problems.append(f"lease_seconds {self.lease_seconds} must be positive")
        if self.relay_fanout < 0:
            problems.append(f"relay_fanout {self.relay_fanout} is negative (0 turns relays off)")
        for name in ("grace_seconds", "channel_timeout_seconds", "gc_grace_seconds"):
            if getattr(self, name) < 0:
                problems.append(f"{name} {getattr(self, name)} is negative")
        if self.metrics_tls not in ("as-grpc", "on", "off"):
            problems.append(f"metrics_tls {self.metrics_tls!r} is not as-grpc, on or off")
        elif self.metrics_tls == "on" and self.tls_cert is None:
            problems.append("metrics_tls on needs tls_cert and tls_key (the metrics endpoint serves the server's "
                            "certificate): set them, or metrics_tls as-grpc or off")
        if socket_mode_problem(self.socket_mode):
            problems.append(socket_mode_problem(self.socket_mode))
        if self.log_format not in ("text", "json"):
            problems.append(f"log_format {self.log_format!r} is not 'text' or 'json'")
        if problems:
            raise ValueError("bad configuration: " + "; ".join(problems))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
        """Defaults, then ``TANNERY_*`` variables of ``env`` (os.environ), then ``overrides``
        (None: not given). An empty variable counts as unset, but for a side port, where it is off."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(env_name(f.name))
            if raw is not None and (raw != "" or f.name in SIDE_PORTS):
                values[f.name] = parse_value(f.name, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    @property
    def socket_permissions(self) -> int:
        """``socket_mode`` as a number (0o600 by default)."""
        return int(self.socket_mode, 8)

    @property
    def metrics_over_tls(self) -> bool:
        """Whether the metrics endpoint is HTTPS (``metrics_tls`` on, or as-grpc on a server with TLS)."""
        return self.metrics_tls == "on" or (self.metrics_tls == "as-grpc" and self.tls_cert is not None)

    @property
    def serves_metrics(self) -> bool:
        """Whether the metrics endpoint listens: ``metrics`` on and ``metrics_port`` not off."""
        return self.metrics and self.metrics_port is not None


#: The schemes of ``catalog`` and ``blobs`` URLs (:mod:`.storage.factory` opens them).
CATALOG_SCHEMES = ("sqlite", "postgresql", "postgres")
BLOB_SCHEMES = ("file", "s3")
#: The schemes of ``nats`` URLs (:mod:`.fabric` opens them).
NATS_SCHEMES = ("nats", "tls")


def socket_mode_problem(mode: str) -> str:
    """What is wrong with ``mode`` as the socket's octal mode ("" when it is good)."""
    try:
        value = int(mode, 8)
    except ValueError:
        return f"socket_mode {mode!r} is not an octal mode such as 0600 or 0660"
    if not 0o600 <= value <= 0o777 or value & 0o600 != 0o600:
        return f"socket_mode {mode!r} must let the server's own user read and write (0600..0777, such as 0600 or 0660)"
    return ""


def without_password(url: str) -> str:
    """A URL fit for messages and logs: ``user:secret@`` becomes ``user@``."""
    head, at, rest = url.rpartition("@")
    if not at or "//" not in head:
        return url
    scheme, _, user = head.partition("//")
    return f"{scheme}//{user.split(':', 1)[0]}@{rest}"


#: The ports of the listeners beside gRPC: a number, a free one (``auto`` or 0) or none (``off``).
SIDE_PORTS = ("data_port", "metrics_port", "web_port")
#: How a side port may be written, for help texts and error messages.
PORT_FORMS = "a port 1..65535, auto (or 0) for a free one the OS picks, or off (or empty) for none"
#: The metrics port of the container image (docker/Dockerfile sets it): no common service's
#: default, not 9090 (Prometheus's own) nor in 9091..9999 (exporters' allocations in
#: Prometheus's list of default ports), and below Linux's ephemeral ports (32768..60999).
IMAGE_METRICS_PORT = 20051


def parse_port(raw: str) -> int | None:
    """A side port written as text: None for ``off`` or empty (no listener), 0 for ``auto``
    or ``0`` (a free port), else the number; ValueError saying the accepted forms."""
    word = raw.strip().lower()
    if word in ("", "off"):
        return None
    if word == "auto":
        return 0
    if not word.isdigit() or int(word) > 65535:
        raise ValueError(f"{raw!r} is not {PORT_FORMS}")
    return int(word)


#: Settings that name a file; unset (None) by default.
_PATH_FIELDS = ("tls_cert", "tls_key", "tls_client_ca", "tokens_file", "cache_dir", "nats_creds")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_name(field_name: str) -> str:
    return "TANNERY_" + field_name.upper()


_DEFAULTS = Config()


def parse_value(field_name: str, raw: str) -> Any:
    """The value of field ``field_name`` written as text (ValueError naming the field)."""
    default = getattr(_DEFAULTS, field_name)
    if field_name in SIDE_PORTS:
        try:
            return parse_port(raw)
        except ValueError as exc:
            raise ValueError(f"{env_name(field_name)}: {exc}") from None
    try:
        if isinstance(default, bool):
            word = raw.strip().lower()
            if word not in _TRUE + _FALSE:
                raise ValueError(word)
            return word in _TRUE
        if isinstance(default, int):
            return parse_size(raw)
        if isinstance(default, float):
            return float(raw)
        if isinstance(default, Path):
            return Path(raw)
        return raw
    except ValueError:
        if isinstance(default, bool):
            raise ValueError(f"{env_name(field_name)}: {raw!r} is not on or off (also 1/0, true/false, yes/no)") from None
        raise ValueError(f"{env_name(field_name)}: cannot read {raw!r} as {type(default).__name__}") from None


_UNITS = {"k": 1 << 10, "ki": 1 << 10, "kib": 1 << 10, "m": MiB, "mi": MiB, "mib": MiB, "g": GiB, "gi": GiB,
          "gib": GiB, "t": 1 << 40, "ti": 1 << 40, "tib": 1 << 40}


def parse_size(raw: str) -> int:
    """An integer, optionally with a binary unit: ``1048576``, ``1MiB``, ``64M``, ``2GiB``."""
    text = raw.strip().lower().replace("_", "")
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(digits):].strip()
    if unit and unit not in _UNITS:
        raise ValueError(f"unknown unit {unit!r}")
    return int(digits) * _UNITS.get(unit, 1)


__all__ = ["IMAGE_METRICS_PORT", "PORT_FORMS", "SIDE_PORTS", "Config", "env_name", "parse_port", "parse_size",
           "parse_value", "without_password"]
