"""``tannery serve``: flags, each with a ``TANNERY_*`` environment variable."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from .auth import TOKENS_HELP
from .config import IMAGE_METRICS_PORT, SIDE_PORTS, Config, env_name, parse_port, parse_value

if TYPE_CHECKING:
    from .storage.core import StorageBase
    from .storage.scrub import ScrubReport

# (field, help) for every setting a flag sets; defaults and environment variables are added.
_FLAGS = [
    ("host", "address to listen on; 0.0.0.0 for every interface"),
    ("port", "TCP port of gRPC; 0 picks a free one (the start line says which). One server per port: a port "
             "in use by another process stops the start"),
    ("data_dir", "directory of the catalog (catalog.sqlite3), blobs and the space reserve (reserve, see "
                 "--reserve-bytes); one server per directory"),
    ("catalog", "where the catalog lives: empty for DATA_DIR/catalog.sqlite3 (one server), or "
                "postgresql://USER@HOST:PORT/DB, shared by replicas (the password from PGPASSWORD or ~/.pgpass "
                "rather than the URL); the server creates and migrates its schema"),
    ("blobs", "where tensor bytes live: empty for DATA_DIR/blobs, or s3://BUCKET/PREFIX (endpoint and "
              "credentials from AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
              "AWS_SECRET_ACCESS_KEY, AWS_REGION: AWS S3, SeaweedFS, MinIO, Ceph RGW, R2)"),
    ("create_bucket", "with --blobs s3://: create the bucket at start when it does not exist (on AWS in "
                      "AWS_REGION); without it a missing bucket stops the start, naming it. Alone, the flag means on"),
    ("cache_dir", "a directory for a local read cache of blobs from a bucket (least recently used whole blobs, "
                  "checked like any read): a hot checkpoint is served at local-disk speed after its first Fetch"),
    ("cache_size", "most bytes the read cache holds"),
    ("gc_grace_seconds", "with a shared catalog: seconds an unreferenced blob is kept before the bucket's space "
                         "is freed (a Fetch already reading it has that long to finish)"),
    ("lease_seconds", "with a shared catalog: seconds a Store's hold on its blobs lasts unless its replica "
                      "renews it (what a replica killed mid-Store leaves is collected after this plus the grace)"),
    ("health_check_seconds", "seconds between checks that the catalog and blob store answer; gRPC health is "
                             "NOT_SERVING while one does not"),
    ("socket", "Unix socket of the same-host data path: clients on this host get Fetch as the stored files "
               "themselves (mapped, no byte copied through a socket) and Store through sealed memory files; "
               "empty for DATA_DIR/tannery.sock, 'off' for none"),
    ("socket_mode", "octal mode of the same-host socket: 0600 (the default) lets only the server's user "
                    "connect; 0660 lets a group connect as well, with the socket in a directory that group may "
                    "search (--socket /run/tannery/tannery.sock, made with install -d -m 2750 -g GROUP "
                    "/run/tannery: DATA_DIR is 0700). Users it keeps out fall back to the data port or gRPC"),
    ("fix_permissions", "on or off: at start, take the group's and others' access away from DATA_DIR and "
                        "everything in it (chmod -R go-rwx); off, a data directory others may read is only warned "
                        "about. Alone, the flag means on"),
    ("data_port", "TCP port of the direct data connection beside gRPC (on --host; TLS when gRPC is): a Store or "
                  "Fetch checked over gRPC moves its bytes there (sendfile). 'auto' (or 0) picks a free port: "
                  "clients learn it from the DataPaths call, the start line names it; a number is that port "
                  "(a port in use stops the start); 'off' (or empty) for none"),
    ("chunk_size", "bytes of tensor data per gRPC message the server sends (4096..3MiB)"),
    ("batched_entries", "on or off: small entries travel whole, several to a gRPC message, in Store (clients "
                        "learn it from DataPaths) and in Fetch (when the client asks); off answers as a server "
                        "from before them"),
    ("max_payload_bytes", "largest payload one entry may have, header included; larger ones are refused "
                          "(RESOURCE_EXHAUSTED) before any byte is stored"),
    ("max_rank", "largest rank of a stored tensor"),
    ("max_name_bytes", "longest archive or entry name, in UTF-8 bytes"),
    ("max_entries", "most entries in one archive"),
    ("alias_history", "moves each alias's history keeps (tannery log ALIAS), the oldest dropped first"),
    ("reserve_bytes", "most space kept back in DATA_DIR/reserve so that Delete works (and frees space) on a full "
                      "disk: the catalog's size, at least 1MiB, at most this and 1/32 of the disk; while it "
                      "cannot be kept, Stores are refused (RESOURCE_EXHAUSTED); 0 for none"),
    ("grace_seconds", "seconds calls in flight get to finish on SIGTERM/SIGINT"),
    ("log_format", "'text' or 'json': one line per call with method, archive or channel, bytes, status, "
                   "duration, peer"),
    ("channel_buffer_bytes", "bytes a channel subscriber may have queued before publishers wait for it"),
    ("channel_timeout_seconds", "seconds a publisher waits for a full subscriber before dropping it"),
    ("relay_fanout", "weight followers that relay pass each version on to this many others, so the server sends "
                     "it about once whatever their number: 1 (the default) is a chain, 2 or more a tree of that "
                     "fan-out, 0 turns relays off (every follower subscribes to this server)"),
    ("nats", "NATS server URLs, comma-separated (nats://[USER:PASS@]HOST:PORT, tls:// for TLS): channels "
             "across replicas, a payload published on any replica reaching subscribers on every replica; "
             "empty for channels within this server"),
    ("nats_creds", "a NATS credentials file (JWT and NKey seed), when the NATS server asks for one"),
    ("nats_channel_bytes", "with --nats: most bytes of payloads from other replicas one channel holds here "
                           "(being reassembled or waiting for subscribers), so the largest cross-replica payload; "
                           "subscribers here that fall that far behind are dropped (RESOURCE_EXHAUSTED)"),
    ("io_threads", "threads reading and writing blob files"),
    ("upload_memory", "with --blobs s3://: most bytes of payloads and packs held in memory before they go to the "
                      "bucket, across all Stores; beyond it they spill to unnamed temporary files in DATA_DIR"),
    ("tls_cert", "PEM file of the server's TLS certificate (and its chain): TLS when set, with --tls-key"),
    ("tls_key", "PEM file of the TLS certificate's private key (unencrypted)"),
    ("tls_client_ca", "PEM file of the CAs that sign client certificates: mutual TLS, every client must "
                      "present a certificate they signed"),
    ("tokens_file", "file of bearer tokens and their roles (format at the end); without tokens the server is open"),
    ("tokens", "tokens inline: 'tok1:write,sha256:<hex>:read' (prefer a file: environments leak)"),
    ("reflection", "on or off: gRPC server reflection (answers without a token)"),
    ("metrics", "on or off: Prometheus metrics over HTTP at /metrics"),
    ("metrics_tls", "as-grpc, on or off: the metrics endpoint over HTTPS with the server's certificate (and, with "
                    "--tls-client-ca, client certificates of that CA required, as gRPC asks): as-grpc does so when "
                    "the server has TLS; off serves plain HTTP even then (Prometheus's default scheme: anyone who "
                    "reaches the port reads the counters, which name no archive and no token)"),
    ("metrics_host", "address of the metrics endpoint; empty for the same as --host"),
    ("metrics_port", "port of the metrics endpoint: 'auto' (or 0) picks a free port, which the start line "
                     "names; a number is that port (a port in use stops the start; the container image uses "
                     f"{IMAGE_METRICS_PORT}, not 9090, Prometheus's own, nor an exporter's 9091..9999); 'off' "
                     "(or empty) for no endpoint, as --metrics off"),
    ("web_port", "port of the read-only web page onto the store (archives, entries and their statistics, the "
                 "server's health and traffic; docs/web.md): off (the default) for none, auto (or 0) for a free "
                 "port, which the start line names, or a number. It asks for a token when the server has tokens "
                 "(a read token suffices) and serves HTTPS when the server has TLS"),
    ("web_host", "address of the web page; loopback unless told otherwise (0.0.0.0 for every interface)"),
    ("web_allowed_hosts", "more host names the web page answers for, comma-separated (tannery.example.com): it "
                          "answers its --web-host, localhost and 127.0.0.1/::1 when on loopback, this host's name "
                          "and addresses when on every interface, and these; any other Host is refused (421), "
                          "against DNS rebinding. A form posted from another origin is refused (403)"),
]
#: Settings whose values are never shown (as defaults or anywhere else).
_SECRET = {"tokens"}


def _shown(name: str, default: object) -> str:
    """How the default of setting ``name`` is written in ``--help``."""
    if name in SIDE_PORTS:
        return {0: "auto", None: "off"}.get(default, str(default))  # type: ignore[call-overload]
    if isinstance(default, bool):
        return "on" if default else "off"
    if default is None or default == "":
        return "unset"
    return str(default)


def _flag_type(name: str) -> Callable[[str], object]:
    """The argparse ``type`` of setting ``name``: its value read from the flag's text, or an
    error naming the accepted forms (argparse prefixes the flag)."""

    def read(raw: str) -> object:
        try:
            if name in SIDE_PORTS:
                parse_port(raw)  # checked here, kept as text (Config reads it): 'off' is None, not "not given"
                return raw
            return parse_value(name, raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(env_name(name) + ": ")) from None

    return read


def build_parser(prog: str = "tannery") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="tannery: a gRPC tensor service")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the server",
        description="Run the tannery server (Archives and Channels, health, reflection) until SIGTERM or "
        "SIGINT. Each flag defaults to its TANNERY_* environment variable, then to the default shown. "
        "Sizes accept binary units: 1MiB, 64M, 2GiB.",
        epilog=TOKENS_HELP,
    )
    defaults = Config()
    scrub = commands.add_parser(
        "scrub",
        help="check every stored blob against its SHA-256, and find leaked bytes (server stopped)",
        description="Re-read every blob an archive references and compare its SHA-256 with its name. Fetch "
        "checks the cheaper per-block CRC-32Cs as it serves; this is the full check, for after a disk "
        "incident or on a schedule. It also looks the other way: bytes in the blob store (files, or objects "
        "of the bucket) that no catalog row references, older than the grace period (--gc-grace-seconds), "
        "are leaks; --repair deletes them. On a data directory it takes the directory's lock, so run it "
        "while the server is stopped; on a shared catalog and bucket (--catalog, --blobs) it runs beside the "
        "replicas. Exit status 0 when every blob matches and nothing leaked, 1 otherwise (each missing or "
        "damaged blob is listed with the archive entries that use it, each leak by its digest).",
    )
    _storage_flags(scrub, defaults)
    scrub.add_argument("--repair", action="store_true",
                       help="delete the leaks found (bytes no catalog row references, older than the grace period); "
                       "archives whose bytes are gone are listed, never changed")
    scrub.add_argument("--gc-grace-seconds", type=float, default=None,
                       help="a leak younger than this may be a Store under way and is left alone "
                       f"[env TANNERY_GC_GRACE_SECONDS; default {defaults.gc_grace_seconds:g}]")
    migrate = commands.add_parser(
        "migrate",
        help="copy a data directory into a PostgreSQL catalog and a bucket (resumable)",
        description="Copy every archive of an embedded data directory (--data-dir, its server stopped) into a "
        "shared catalog (--catalog postgresql://...) and blob store (--blobs s3://...), where replicas may "
        "already be serving. Each blob is hashed as it streams and must match its SHA-256; a blob the target "
        "has is not copied again, and an archive it has with the same entries is skipped, so running the "
        "command again resumes an interrupted migration. An archive the target has with other entries is "
        "left alone and reported; so is an archive damaged in the source (a blob that does not match its SHA-256): "
        "the migration goes on with the others and lists every archive it left out at the end. Each archive "
        "keeps its creation time and metadata. Exit status 0 when everything is in the target, 1 otherwise.",
    )
    _storage_flags(migrate, defaults, "create_bucket")
    for name, text in _FLAGS:
        serve.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=_flag_type(name),
            default=None,
            **_alone_means_on(name, defaults),
            help=f"{text} [env {env_name(name)}" + ("]" if name in _SECRET else f"; default {_shown(name, getattr(defaults, name))}]"),
        )
    return parser


#: The help of a storage flag where the tools (scrub, migrate) say other than ``serve``: they
#: take no --reserve-bytes, so their help must not send the reader there.
_TOOL_HELP = {"data_dir": "directory of the catalog (catalog.sqlite3) and blobs of a stopped server"}


def _alone_means_on(name: str, defaults: Config) -> dict:
    """argparse keywords that let an on/off setting's flag stand alone for on (``--create-bucket``)."""
    return {"nargs": "?", "const": True, "metavar": "on|off"} if isinstance(getattr(defaults, name), bool) else {}


def _storage_flags(parser: argparse.ArgumentParser, defaults: Config, *extra: str) -> None:
    """--data-dir, --catalog and --blobs (and ``extra``), as ``serve`` reads them (the help without
    serve-only flags)."""
    for name, text in _FLAGS:
        if name in ("data_dir", "catalog", "blobs", *extra):
            text = _TOOL_HELP.get(name, text)
            parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                                type=_flag_type(name), **_alone_means_on(name, defaults),
                                help=f"{text} [env {env_name(name)}; default {_shown(name, getattr(defaults, name))}]")


def main(argv: Sequence[str] | None = None, prog: str = "tannery") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.command in ("scrub", "migrate"):
        try:
            config = Config.from_env(data_dir=args.data_dir, catalog=args.catalog, blobs=args.blobs,
                                     create_bucket=getattr(args, "create_bucket", None),
                                     gc_grace_seconds=getattr(args, "gc_grace_seconds", None))
        except ValueError as exc:
            parser.error(str(exc))
        return scrub(config, args.repair) if args.command == "scrub" else migrate(config)
    if args.command == "serve":
        try:
            config = Config.from_env(**{name: getattr(args, name) for name, _ in _FLAGS})
        except ValueError as exc:
            parser.error(str(exc))
        from . import app
        from .auth import TokenError
        from .calllog import configure_logging
        from .storage import CatalogTooNew, DataDirectoryInUse, StorageUnavailable, WrongBlobStore
        from .tls import TLSError

        configure_logging(config.log_format)
        try:
            app.run(config)
        except (CatalogTooNew, DataDirectoryInUse, TokenError, TLSError, StorageUnavailable, WrongBlobStore) as exc:
            # StorageUnavailable: the catalog or bucket unreachable at start, or the bucket missing
            print(f"tannery serve: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:  # an address in use, for the gRPC, data or metrics port
            print(f"tannery serve: {os_error_text(exc)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            pass
    return 0


def os_error_text(exc: OSError) -> str:
    """An OSError in words, without Python's ``[Errno 98]`` prefix: its message (which names the
    address or file and says what to do, where tannery raised it), then the file it names."""
    if not exc.strerror:
        return str(exc)
    return f"{exc.filename}: {exc.strerror}" if exc.filename is not None else exc.strerror


def _embedded(config: Config) -> bool:
    return not config.catalog or config.catalog.startswith("sqlite:")


def _open(command: str, config: Config):
    """The storage a tool works on, or None after saying why it cannot be opened."""
    from .storage import CatalogTooNew, DataDirectoryInUse, StorageUnavailable, WrongBlobStore
    from .storage.factory import open_storage

    if _embedded(config) and not (config.data_dir / "catalog.sqlite3").is_file():
        print(f"tannery {command}: {config.data_dir}: no tannery data directory (no catalog.sqlite3); "
              "set --data-dir (or --catalog and --blobs)", file=sys.stderr)
        return None
    try:
        return open_storage(config, collecting=False, offer_create=command == "migrate")
    except DataDirectoryInUse as exc:
        print(f"tannery {command}: {exc}; stop the server first", file=sys.stderr)
    except (CatalogTooNew, StorageUnavailable, WrongBlobStore, ValueError, ModuleNotFoundError) as exc:
        print(f"tannery {command}: {exc}", file=sys.stderr)
    return None


def scrub(config: Config, repair: bool = False) -> int:
    """``tannery scrub``: every referenced blob re-hashed, and the blob store searched for bytes no
    catalog row references; 0 when all match and nothing leaked, 1 otherwise."""
    from .storage.scrub import scrub_store

    storage = _open("scrub", config)
    if storage is None:
        return 1
    try:
        report = scrub_store(storage, config.gc_grace_seconds, repair)
        _print_faults(storage, report.damaged, "is missing or no longer matches its SHA-256")
        _print_faults(storage, report.missing, "is missing: its bytes are gone from the blob store",
                      "; marked" if repair else "")
        for digest in report.cleared:
            print(f"blob {digest} is no longer missing; its lost mark cleared")
        for digest in report.leaked:
            done = "; removed" if digest in report.removed else "" if not repair else "; not removed (a Store took it)"
            print(f"blob {digest} leaked: no catalog row references it (older than the grace period of "
                  f"{config.gc_grace_seconds:g} s){done}")
    finally:
        storage.close()
    print(_scrub_summary(report))
    return 0 if report.sound else 1


def _print_faults(storage: StorageBase, digests: list[str], problem: str, done: str = "") -> None:
    """One line per blob: what is wrong, the archive entries that use it, and what ``--repair`` did."""
    for digest in digests:
        users = ", ".join(f"{archive}:{entry}" for archive, entry in storage.catalog.referrers(digest))
        print(f"blob {digest} {problem}; used by {users}{done}")


def _scrub_summary(report: ScrubReport) -> str:
    """The last line of ``tannery scrub``: what was checked and what was found."""
    found = [f"{len(items)} {what}" for items, what in ((report.damaged, "damaged"), (report.missing, "missing"),
                                                        (report.leaked, "leaked"), (report.removed, "removed"))
             if items]
    return f"checked {report.checked} blobs: {', '.join(found) if found else 'all match'}"


def migrate(config: Config) -> int:
    """``tannery migrate``: the data directory's archives copied into the shared store."""
    from .migrate import MigrationError, migrate as copy_all
    from .storage import Storage, StorageUnavailable
    from .storage.shared_storage import SharedStorage

    if _embedded(config):
        print("tannery migrate: the target must be a shared catalog: set --catalog postgresql://USER@HOST:PORT/DB "
              "and --blobs s3://BUCKET/PREFIX", file=sys.stderr)
        return 1
    if not (config.data_dir / "catalog.sqlite3").is_file():
        print(f"tannery migrate: {config.data_dir}: no tannery data directory (no catalog.sqlite3); set --data-dir",
              file=sys.stderr)
        return 1
    target = _open("migrate", config)
    if target is None:
        return 1
    assert isinstance(target, SharedStorage)
    source = _open("migrate", config.replace(catalog="", blobs=""))
    if source is None:
        target.close()
        return 1
    assert isinstance(source, Storage)
    try:
        done = copy_all(source, target, progress=print)
    except (MigrationError, StorageUnavailable) as exc:
        print(f"tannery migrate: {exc}", file=sys.stderr)
        print("hint: fix the cause and run the same command again: it resumes", file=sys.stderr)
        return 1
    finally:
        source.close()
        target.close()
    return _migration_report(done)


def _migration_report(done) -> int:
    """Print what a migration did and every archive it left out; 0 when everything is in the target."""
    from .migrate import plural

    print(f"migrated {plural(done.archives, 'archive')} ({plural(done.blobs, 'blob')}, "
          f"{plural(done.bytes, 'byte')} copied, {plural(done.reused, 'blob')} already there); "
          f"{plural(done.skipped, 'archive')} {'was' if done.skipped == 1 else 'were'} there already")
    if done.conflicts:
        print(f"{plural(len(done.conflicts), 'archive')} NOT migrated: the target has archives of these names with "
              f"other entries: {', '.join(done.conflicts)} (delete or rename them there, then run this again)")
    if done.damaged:
        print(f"tannery migrate: {plural(len(done.damaged), 'archive')} NOT migrated, damaged in the source:",
              file=sys.stderr)
        for name, reason in done.damaged:
            print(f"  {name}: {reason}", file=sys.stderr)
        print("hint: fix the cause (tannery scrub on the source names every damaged blob), then run the same "
              "command again: it resumes", file=sys.stderr)
    if done.conflicts or done.damaged:
        return 1
    return 0
