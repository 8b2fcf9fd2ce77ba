"""The shared catalog's schema in PostgreSQL: its tables, and the steps that bring an older
database to the version this code reads and writes (table ``schema_version``), in one
transaction under an advisory lock, so replicas starting at once migrate one after the other."""

from __future__ import annotations

import logging
from typing import Callable

from .errors import CatalogTooNew
from .postgres_pool import Cursor

log = logging.getLogger("tannery_server.storage.postgres_catalog")

_SCHEMA_V1 = (
    """CREATE TABLE archives (
    id bigserial PRIMARY KEY,
    name text COLLATE "C" CONSTRAINT archives_name UNIQUE,  -- NULL while its transaction builds it
    created_ns bigint NOT NULL,
    entries bigint NOT NULL,
    nbytes bigint NOT NULL,
    payload_bytes bigint NOT NULL
)""",
    """CREATE TABLE blobs (
    digest text COLLATE "C" PRIMARY KEY,
    size bigint NOT NULL,
    block_size bigint NOT NULL,
    block_crcs bytea NOT NULL,
    checksum text NOT NULL,
    touched_ns bigint NOT NULL
)""",
    "CREATE INDEX blobs_by_touched ON blobs (touched_ns)",
    """CREATE TABLE entries (
    archive_id bigint NOT NULL REFERENCES archives (id) ON DELETE CASCADE,
    name text COLLATE "C" NOT NULL,
    dtype text NOT NULL,
    shape text NOT NULL,
    nbytes bigint NOT NULL,
    payload_bytes bigint NOT NULL,
    data_offset bigint NOT NULL,
    digest text COLLATE "C" NOT NULL REFERENCES blobs (digest),
    PRIMARY KEY (archive_id, name)
)""",
    "CREATE INDEX entries_by_digest ON entries (digest)",
    """CREATE TABLE leases (
    digest text COLLATE "C" NOT NULL REFERENCES blobs (digest) ON DELETE CASCADE,
    replica text NOT NULL,
    holder text NOT NULL,
    expires_ns bigint NOT NULL,
    PRIMARY KEY (digest, replica, holder)
)""",
    "CREATE INDEX leases_by_holder ON leases (replica, holder)",
)


def _to_version_1(cur: Cursor) -> None:
    """The first schema: archives, entries, blobs (with ``touched_ns``) and leases. Names sort
    by their bytes (``COLLATE "C"``), as SQLite sorts them."""
    for statement in _SCHEMA_V1:
        cur.execute(statement)


def _to_version_2(cur: Cursor) -> None:
    """``archives.metadata``: an archive's string-to-string metadata as a JSON object in text
    (the rows already there get ``'{}'``, none)."""
    cur.execute("ALTER TABLE archives ADD COLUMN IF NOT EXISTS metadata text NOT NULL DEFAULT '{}'")


def _to_version_3(cur: Cursor) -> None:
    """Packs (docs/packs.md): ``entries.blob`` (what was ``entries.digest``: the blob that holds
    the payload, which collection counts references to), ``entries.blob_offset`` and a new
    ``entries.digest``, the payload's own SHA-256 (the rows already there: their blob's)."""
    cur.execute("ALTER TABLE entries RENAME COLUMN digest TO blob")
    cur.execute("ALTER INDEX entries_by_digest RENAME TO entries_by_blob")
    cur.execute("ALTER TABLE entries ADD COLUMN blob_offset bigint NOT NULL DEFAULT 0")
    cur.execute('ALTER TABLE entries ADD COLUMN digest text COLLATE "C"')
    cur.execute("UPDATE entries SET digest = blob")
    cur.execute("ALTER TABLE entries ALTER COLUMN digest SET NOT NULL")


def _to_version_4(cur: Cursor) -> None:
    """Aliases (:mod:`.alias_sql`): a name pointing at an archive's name, and when it last moved."""
    cur.execute("""CREATE TABLE aliases (
    alias text COLLATE "C" PRIMARY KEY,
    target text COLLATE "C" NOT NULL,
    moved_ns bigint NOT NULL
)""")
    cur.execute("CREATE INDEX aliases_by_target ON aliases (target)")


def _to_version_5(cur: Cursor) -> None:
    """Alias history (:mod:`.alias_sql`): every move of an alias, numbered by ``id``."""
    cur.execute("""CREATE TABLE alias_moves (
    id bigserial PRIMARY KEY,
    alias text COLLATE "C" NOT NULL,
    from_archive text COLLATE "C" NOT NULL,
    to_archive text COLLATE "C" NOT NULL,
    moved_ns bigint NOT NULL,
    moved_by text NOT NULL
)""")
    cur.execute("CREATE INDEX alias_moves_by_alias ON alias_moves (alias, id)")


def _to_version_6(cur: Cursor) -> None:
    """``blobs.collecting_until_ns``: a collection's claim on the row while it deletes the bytes
    outside any transaction (0: none); a lease waits for a live claim to end."""
    cur.execute("ALTER TABLE blobs ADD COLUMN IF NOT EXISTS collecting_until_ns bigint NOT NULL DEFAULT 0")


def _to_version_7(cur: Cursor) -> None:
    """Lost blobs (:mod:`.lost_marks`): the blobs whose bytes ``tannery scrub --repair`` found gone,
    and when; Describe names the entries that use them."""
    cur.execute('CREATE TABLE IF NOT EXISTS lost_blobs (digest text COLLATE "C" PRIMARY KEY, found_ns bigint NOT NULL)')


#: ``MIGRATIONS[n]`` brings schema version ``n`` to ``n + 1`` (0: an empty database).
MIGRATIONS: tuple[Callable[[Cursor], None], ...] = (_to_version_1, _to_version_2, _to_version_3, _to_version_4,
                                                    _to_version_5, _to_version_6, _to_version_7)
SCHEMA_VERSION = len(MIGRATIONS)
#: The advisory lock (two-key form, apart from the names' one-key locks) of schema changes.
_SCHEMA_LOCK = (0x7A77, 1)

def migrate(cur: Cursor, name: str) -> None:
    """Bring the schema to :data:`SCHEMA_VERSION` in this transaction, under the schema lock
    (replicas starting at once migrate one after the other; the later ones find it done);
    ``name`` names the catalog in messages."""
    cur.execute("SELECT pg_advisory_xact_lock(%s, %s)", _SCHEMA_LOCK)
    cur.execute("CREATE TABLE IF NOT EXISTS schema_version (version integer NOT NULL)")
    version = cur.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise CatalogTooNew(
            f"{name}: catalog schema version {version} is newer than this tannery's ({SCHEMA_VERSION}): "
            "run a newer tannery"
        )
    if version == SCHEMA_VERSION:
        return
    for step in MIGRATIONS[version:]:
        step(cur)
    cur.execute("DELETE FROM schema_version")
    cur.execute("INSERT INTO schema_version (version) VALUES (%s)", (SCHEMA_VERSION,))
    log.info("catalog %s: schema migrated from version %d to %d", name, version, SCHEMA_VERSION)


__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "migrate"]
