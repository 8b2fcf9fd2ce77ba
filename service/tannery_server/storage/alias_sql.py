"""Aliases in SQL, written once for the SQLite and PostgreSQL catalogs: the table's rules, run in
the caller's transaction (which holds the locks its catalog takes for a write of a name).

An alias is a row ``(alias, target, moved_ns)``; ``target`` is an archive's name. Aliases and
archives share one namespace: no alias is an archive's name, no alias points at an alias, every
alias points at an archive that exists (a Delete of its target is refused, or with ``force``
removes it too). Every read resolves a name in the query that finds its archive
(:data:`LOOKUP`), so a call reads one version whole however the alias moves meanwhile.

Every move (a Tag that changes the target, an Untag, a forced Delete that removes aliases) adds
a row to the alias's history (``alias_moves``: from, to, when, by whom), in the same transaction,
and trims it to the newest ``MoveNote.keep`` rows. Rows are ordered by their id, which the
catalog numbers (no per-alias counter two writers could both take).

The queries take the catalog's placeholder as ``mark`` (``?`` or ``%s``).
"""

from __future__ import annotations

from typing import Callable, Sequence

from .base import AliasMove, AliasPage, AliasRecord, MoveNote
from .errors import AliasConflict, NoSuchArchive

#: Runs ``(sql, args)`` in the caller's transaction: the rows (none for a statement without).
Query = Callable[[str, tuple], Sequence[tuple]]

#: The archive a name denotes (its own, or its alias's target), for ``WHERE name = {LOOKUP}``
#: with the name given twice.
LOOKUP = "coalesce((SELECT target FROM aliases WHERE alias = {0}), {0})"
ALIAS_COLUMNS = "alias, target, moved_ns"
MOVE_COLUMNS = "alias, from_archive, to_archive, moved_ns, moved_by"


def lookup_sql(mark: str) -> str:
    """``name = ...`` resolving an alias (two arguments: the name, twice)."""
    return "name = " + LOOKUP.format(mark)


def target_of(query: Query, mark: str, name: str) -> str | None:
    rows = query(f"SELECT target FROM aliases WHERE alias = {mark}", (name,))
    return rows[0][0] if rows else None


def alias_of(query: Query, mark: str, name: str) -> AliasRecord | None:
    rows = query(f"SELECT {ALIAS_COLUMNS} FROM aliases WHERE alias = {mark}", (name,))
    return AliasRecord(*rows[0]) if rows else None


def aliases(query: Query, mark: str, prefix: str, archive: str, ask: AliasPage = AliasPage()) -> list[AliasRecord]:
    """The aliases under ``prefix`` (pointing at ``archive`` if given), narrowed and paged as
    ``ask`` says: by name, or by target then name when a target is asked for (``archive``,
    ``ask.archive_prefix``, ``ask.archives_from``/``archives_to``). Each bound is a range of an
    index (the primary key, ``aliases_by_target``): names sort by their bytes in both catalogs,
    so the names a prefix owns lie between the prefix and :func:`prefix_end`."""
    where: list[str] = []
    args: list = []

    def at_least(column: str, low: str, high: str | None, inclusive: bool = False) -> None:
        where.append(f"{column} >= {mark}")
        args.append(low)
        if high is not None:
            where.append(f"{column} {'<=' if inclusive else '<'} {mark}")
            args.append(high)

    if prefix:
        at_least("alias", prefix, prefix_end(prefix))
    if archive:
        where.append(f"target = {mark}")
        args.append(archive)
    if ask.archive_prefix:
        at_least("target", ask.archive_prefix, prefix_end(ask.archive_prefix))
    if ask.archives_from or ask.archives_to is not None:
        at_least("target", ask.archives_from, ask.archives_to, inclusive=True)
    by_target = ask.by_target(archive)
    if ask.after is not None:
        after_target, after_alias = ask.after
        if by_target:
            where.append(f"target >= {mark} AND (target > {mark} OR alias > {mark})")
            args += [after_target, after_target, after_alias]
        else:
            where.append(f"alias > {mark}")
            args.append(after_alias)
    sql = f"SELECT {ALIAS_COLUMNS} FROM aliases"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY target, alias" if by_target else " ORDER BY alias"
    if ask.limit:
        sql += f" LIMIT {int(ask.limit)}"
    return [AliasRecord(*row) for row in query(sql, tuple(args))]


def prefix_end(prefix: str) -> str | None:
    """The least string after every string that starts with ``prefix`` (code point order, which
    is UTF-8's byte order); None when there is none (``prefix`` all U+10FFFF)."""
    chars = list(prefix)
    while chars:
        point = ord(chars.pop()) + 1
        if point <= 0x10FFFF:
            if 0xD800 <= point <= 0xDFFF:  # no surrogate is text in either catalog
                point = 0xE000
            return "".join(chars) + chr(point)
    return None


def refuse_alias_name(query: Query, mark: str, name: str, what: str) -> None:
    """AliasConflict when ``name`` (the archive a Store or Union would write) is an alias."""
    target = target_of(query, mark, name)
    if target is not None:
        raise alias_name_refusal(name, target, what)


def alias_name_refusal(name: str, target: str, what: str = "archive") -> AliasConflict:
    """The refusal of a write of archive ``name``, which is an alias of ``target``."""
    return AliasConflict(
        f"{what} {name!r}: that name is an alias (of archive {target!r}), and aliases and archives share one "
        f"namespace: write under another name (then move the alias there: tannery tag {name} NEW), or "
        f"remove the alias first (tannery untag {name})")


def tag(query: Query, mark: str, alias: str, archive: str, expect: str | None, now_ns: int,
        note: MoveNote = MoveNote()) -> AliasRecord:
    """Point ``alias`` at ``archive`` (see :meth:`~.base.Catalog.tag`)."""
    if query(f"SELECT 1 FROM archives WHERE name = {mark}", (alias,)):
        raise AliasConflict(
            f"alias {alias!r}: that name is an archive's, and aliases and archives share one namespace: "
            "choose another name for the alias")
    chained = target_of(query, mark, archive)
    if chained is not None:
        raise AliasConflict(
            f"alias {alias!r}: {archive!r} is itself an alias (of {chained!r}), and an alias points at an "
            f"archive: tag {chained!r} instead")
    if not query(f"SELECT 1 FROM archives WHERE name = {mark}", (archive,)):
        raise NoSuchArchive(f"archive {archive!r} not found: alias {alias!r} must point at an archive that exists")
    current = alias_of(query, mark, alias)
    if current is not None and current.archive == archive:  # a retry whose answer was lost, or no move
        return AliasRecord(alias, archive, current.moved_ns, previous=archive, changed=False)
    if expect is not None and (current.archive if current else "") != expect:
        raise AliasConflict(_not_expected(alias, current, expect))
    if current is None:
        query(f"INSERT INTO aliases ({ALIAS_COLUMNS}) VALUES ({mark}, {mark}, {mark})", (alias, archive, now_ns))
    else:
        query(f"UPDATE aliases SET target = {mark}, moved_ns = {mark} WHERE alias = {mark}", (archive, now_ns, alias))
    record_move(query, mark, AliasMove(alias, current.archive if current else "", archive, now_ns, note.by), note)
    return AliasRecord(alias, archive, now_ns, previous=current.archive if current else "", changed=True)


def _not_expected(alias: str, current: AliasRecord | None, expect: str) -> str:
    if current is None:
        return (f"alias {alias!r} does not exist, not pointing at {expect!r} as expected: tag it without "
                "expect to create it")
    wanted = f"{expect!r} as expected" if expect else "no archive (expected no such alias yet)"
    return (f"alias {alias!r} points at {current.archive!r}, not at {wanted}: another writer moved it; "
            f"resolve it again (tannery resolve) and decide, or tag without expect to move it regardless")


def untag(query: Query, mark: str, alias: str, now_ns: int, note: MoveNote = MoveNote()) -> AliasRecord | None:
    found = alias_of(query, mark, alias)
    if found is not None:
        query(f"DELETE FROM aliases WHERE alias = {mark}", (alias,))
        record_move(query, mark, AliasMove(alias, found.archive, "", now_ns, note.by), note)
    return found


def release_target(query: Query, mark: str, archive: str, force: bool, now_ns: int,
                   note: MoveNote = MoveNote()) -> tuple[str, ...]:
    """Before archive ``archive`` is deleted: the aliases pointing at it, removed when ``force``,
    else AliasConflict naming them and the remedies."""
    names = tuple(row[0] for row in query(f"SELECT alias FROM aliases WHERE target = {mark} ORDER BY alias",
                                          (archive,)))
    if not names:
        return ()
    if not force:
        listed = ", ".join(repr(n) for n in names)
        raise AliasConflict(
            f"archive {archive!r} is what alias{'es' if len(names) > 1 else ''} {listed} point"
            f"{'' if len(names) > 1 else 's'} at: move {'them' if len(names) > 1 else 'it'} first "
            f"(tannery tag {names[0]} OTHER) or untag, or delete with force (tannery rm --force, "
            "delete(name, force=True)) to remove the aliases too")
    query(f"DELETE FROM aliases WHERE target = {mark}", (archive,))
    for name in names:
        record_move(query, mark, AliasMove(name, archive, "", now_ns, note.by), note)
    return names


def record_move(query: Query, mark: str, move: AliasMove, note: MoveNote) -> None:
    """Add ``move`` to its alias's history, then drop all but the newest ``note.keep`` moves."""
    if not note.record:
        return
    query(f"INSERT INTO alias_moves ({MOVE_COLUMNS}) VALUES ({mark}, {mark}, {mark}, {mark}, {mark})",
          (move.alias, move.previous, move.archive, move.moved_ns, move.by))
    query(f"DELETE FROM alias_moves WHERE alias = {mark} AND id <= (SELECT id FROM alias_moves WHERE alias = {mark} "
          f"ORDER BY id DESC LIMIT 1 OFFSET {mark})", (move.alias, move.alias, max(note.keep, 1)))


def history(query: Query, mark: str, alias: str, limit: int) -> list[AliasMove]:
    """The newest ``limit`` moves of ``alias``, newest first."""
    rows = query(f"SELECT {MOVE_COLUMNS} FROM alias_moves WHERE alias = {mark} ORDER BY id DESC LIMIT {mark}",
                 (alias, limit))
    return [AliasMove(*row) for row in rows]


def import_moves(query: Query, mark: str, moves: Sequence[AliasMove]) -> int:
    """Add ``moves`` (oldest first) to the history of each alias that has none yet; the moves added."""
    added = 0
    known: dict[str, bool] = {}
    for move in moves:
        if move.alias not in known:
            known[move.alias] = not query(f"SELECT 1 FROM alias_moves WHERE alias = {mark} LIMIT 1", (move.alias,))
        if known[move.alias]:
            query(f"INSERT INTO alias_moves ({MOVE_COLUMNS}) VALUES ({mark}, {mark}, {mark}, {mark}, {mark})",
                  (move.alias, move.previous, move.archive, move.moved_ns, move.by))
            added += 1
    return added


__all__ = ["ALIAS_COLUMNS", "LOOKUP", "MOVE_COLUMNS", "Query", "alias_name_refusal", "alias_of", "aliases", "history",
           "import_moves", "lookup_sql", "prefix_end", "record_move", "refuse_alias_name", "release_target", "tag", "target_of",
           "untag"]
