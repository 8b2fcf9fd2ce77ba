"""A private PostgreSQL for the tests: a cluster in a temporary directory, on 127.0.0.1 and a
free port, with trust authentication, that a test may stop and start again.

It uses Debian's ``postgresql`` package (``make test`` installs it when absent): the binaries
are looked for in ``$TANNERY_POSTGRES_BIN``, on ``PATH``, then in ``/usr/lib/postgresql/*/bin``
(Debian keeps them off ``PATH``). PostgreSQL refuses to run as root, so as root every
command runs as the ``postgres`` user (``runuser``), which owns the temporary directory.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

#: The cluster's superuser, who owns every database the tests create.
SUPERUSER = "postgres"
#: The system user that runs PostgreSQL when the tests run as root.
SYSTEM_USER = "postgres"


def postgres_bin() -> Path | None:
    """The directory of ``initdb`` and ``pg_ctl``, or None when PostgreSQL is not installed."""
    configured = os.environ.get("TANNERY_POSTGRES_BIN")
    if configured:
        return Path(configured) if (Path(configured) / "initdb").is_file() else None
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                      key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
    return versions[-1].parent if versions else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PostgresServer:
    """One cluster: :meth:`start` (``initdb`` the first time), :meth:`create_database`,
    :meth:`stop` and :meth:`start` again on the same data and port, :meth:`close` removes it."""

    def __init__(self, bin_dir: Path | None = None) -> None:
        found = bin_dir or postgres_bin()
        if found is None:
            raise FileNotFoundError("PostgreSQL's initdb and pg_ctl not found: install Debian's postgresql package")
        self.bin_dir = Path(found)
        self.as_root = os.geteuid() == 0
        self.root = Path(tempfile.mkdtemp(prefix="tannery-pg-"))
        if self.as_root:
            entry = pwd.getpwnam(SYSTEM_USER)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self.data_dir = self.root / "data"
        self.log_file = self.root / "server.log"
        self.host = "127.0.0.1"
        self.port = _free_port()
        self.running = False

    def _command(self, program: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        argv = [str(self.bin_dir / program), *args]
        if self.as_root:
            argv = ["runuser", "-u", SYSTEM_USER, "--", *argv]
        done = subprocess.run(argv, cwd=self.root, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            output = done.stderr.strip() or done.stdout.strip()
            raise RuntimeError(f"{program} {' '.join(args)} exited with {done.returncode}: {output}{self._log_tail()}")
        return done

    def _log_tail(self) -> str:
        try:
            lines = self.log_file.read_text(errors="replace").splitlines()[-10:]
        except OSError:
            return ""
        return "\nserver log:\n" + "\n".join(lines) if lines else ""

    def start(self) -> None:
        """Create the cluster (first start) and start it; returns once it accepts connections."""
        if not (self.data_dir / "PG_VERSION").exists():
            self._command("initdb", "-D", str(self.data_dir), "-U", SUPERUSER, "-A", "trust", "-E", "UTF8",
                          "--locale=C", "--no-sync")
        options = (f"-c listen_addresses={self.host} -p {self.port} -k {self.root} -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._command("pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_file), "-o", options, "-w", "-t", "60",
                      "start")
        self.running = True

    def stop(self) -> None:
        """Stop the cluster (``-m fast``: open connections are ended), keeping its data."""
        if self.running:
            self._command("pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "-t", "60", "stop")
            self.running = False

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@{self.host}:{self.port}/{database}"

    def _admin(self, statement: str) -> None:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(statement)

    def create_database(self, name: str, encoding: str | None = None) -> str:
        """A new empty database (in ``encoding``, such as "SQL_ASCII", the default of an
        ``initdb`` without a UTF-8 locale; else the cluster's UTF8); returns its URL."""
        options = f" ENCODING '{encoding}' TEMPLATE template0 LC_COLLATE 'C' LC_CTYPE 'C'" if encoding else ""
        self._admin(f'CREATE DATABASE "{name}"{options}')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop it, ending the connections a test left open."""
        self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def close(self) -> None:
        """Stop the cluster and remove its directory."""
        try:
            if self.running:
                self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "PostgresServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
