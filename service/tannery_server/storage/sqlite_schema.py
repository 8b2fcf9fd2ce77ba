"""The embedded catalog's schema: its tables, and the steps that bring an older catalog file
to the version this code reads and writes (``PRAGMA user_version``, :data:`SCHEMA_VERSION`),
all in one transaction when the catalog is opened."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Callable, Sequence

from .errors import CatalogTooNew

#: The first schema (version 0, before versions were kept): its block checksums are all
#: zlib CRC-32s.
SCHEMA_V0 = (
    """CREATE TABLE IF NOT EXISTS archives (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    created_ns INTEGER NOT NULL,
    entries INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    payload_bytes INTEGER NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS blobs (
    digest TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    block_size INTEGER NOT NULL,
    block_crcs BLOB NOT NULL
) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS entries (
    archive_id INTEGER NOT NULL REFERENCES archives(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    dtype TEXT NOT NULL,
    shape TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    payload_bytes INTEGER NOT NULL,
    data_offset INTEGER NOT NULL,
    digest TEXT NOT NULL REFERENCES blobs(digest),
    PRIMARY KEY (archive_id, name)
) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS entries_by_digest ON entries(digest)",
)


def _to_version_1(conn: sqlite3.Connection) -> None:
    """``blobs.checksum``: the algorithm of a blob's block checksums (:mod:`tannery_protocol.checksums`).
    The rows already there get ``'crc32'``, what they were computed with. (A new file gets the
    first schema here first.)"""
    for statement in SCHEMA_V0:
        conn.execute(statement)
    columns = {row[1] for row in conn.execute("PRAGMA table_info(blobs)")}
    if "checksum" not in columns:
        conn.execute("ALTER TABLE blobs ADD COLUMN checksum TEXT NOT NULL DEFAULT 'crc32'")


def _to_version_2(conn: sqlite3.Connection) -> None:
    """``archives.metadata``: an archive's string-to-string metadata as a JSON object (the rows
    already there get ``'{}'``, none)."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(archives)")}
    if "metadata" not in columns:
        conn.execute("ALTER TABLE archives ADD COLUMN metadata TEXT NOT NULL DEFAULT '{}'")


def _to_version_3(conn: sqlite3.Connection) -> None:
    """Packs (docs/packs.md): ``entries.blob`` (what was ``entries.digest``: the blob that holds
    the payload), ``entries.blob_offset`` (where in it the payload starts) and a new
    ``entries.digest``, the payload's own SHA-256. Every row already there is a payload in
    its own blob: offset 0, and its digest is its blob's."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(entries)")}
    if "blob" in columns:
        return
    conn.execute("ALTER TABLE entries RENAME COLUMN digest TO blob")
    conn.execute("ALTER TABLE entries ADD COLUMN blob_offset INTEGER NOT NULL DEFAULT 0")
    conn.execute("ALTER TABLE entries ADD COLUMN digest TEXT NOT NULL DEFAULT ''")
    conn.execute("UPDATE entries SET digest = blob")


def _to_version_4(conn: sqlite3.Connection) -> None:
    """Aliases (:mod:`.alias_sql`): a name pointing at an archive's name, and when it last moved."""
    conn.execute("""CREATE TABLE IF NOT EXISTS aliases (
    alias TEXT PRIMARY KEY,
    target TEXT NOT NULL,
    moved_ns INTEGER NOT NULL
) WITHOUT ROWID""")
    conn.execute("CREATE INDEX IF NOT EXISTS aliases_by_target ON aliases(target)")


def _to_version_5(conn: sqlite3.Connection) -> None:
    """Alias history (:mod:`.alias_sql`): every move of an alias, numbered by ``id``."""
    conn.execute("""CREATE TABLE IF NOT EXISTS alias_moves (
    id INTEGER PRIMARY KEY,
    alias TEXT NOT NULL,
    from_archive TEXT NOT NULL,
    to_archive TEXT NOT NULL,
    moved_ns INTEGER NOT NULL,
    moved_by TEXT NOT NULL
)""")
    conn.execute("CREATE INDEX IF NOT EXISTS alias_moves_by_alias ON alias_moves(alias, id)")


def _to_version_6(conn: sqlite3.Connection) -> None:
    """Lost blobs (:mod:`.lost_marks`): the blobs whose bytes ``tannery scrub --repair`` found gone,
    and when; Describe names the entries that use them."""
    conn.execute("CREATE TABLE IF NOT EXISTS lost_blobs (digest TEXT PRIMARY KEY, found_ns INTEGER NOT NULL) WITHOUT ROWID")


#: The steps of the schema, in order: ``MIGRATIONS[n]`` brings version ``n`` to ``n + 1``. Each
#: may be run again on a catalog it has already changed.
MIGRATIONS = (_to_version_1, _to_version_2, _to_version_3, _to_version_4, _to_version_5, _to_version_6)
#: The schema's version (``PRAGMA user_version``) this code reads and writes.
SCHEMA_VERSION = len(MIGRATIONS)


def schema_version(conn: sqlite3.Connection) -> int:
    return conn.execute("PRAGMA user_version").fetchone()[0]


def migrate(conn: sqlite3.Connection, path: Path, migrations: Sequence[Callable[[sqlite3.Connection], None]]) -> None:
    """Bring the catalog to the version of ``migrations`` (:data:`MIGRATIONS`), every step and the
    new version in one transaction: a failure (a full disk) leaves it as it was, to migrate at
    the next open."""
    version = schema_version(conn)
    if version == len(migrations):
        return  # the common case writes nothing (a full disk still opens its catalog)
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = schema_version(conn)  # as of this transaction
        if version > len(migrations):
            raise CatalogTooNew(
                f"{path}: catalog schema version {version} is newer than this tannery's ({len(migrations)}): "
                "run a newer tannery"
            )
        for step in migrations[version:]:
            step(conn)
        conn.execute(f"PRAGMA user_version = {len(migrations)}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        raise


__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "SCHEMA_V0", "migrate", "schema_version"]
