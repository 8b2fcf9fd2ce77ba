"""Listings that do not grow with the store (issue 43): with 100,000 archives and 100,000 aliases
beside a 10-archive series, ``tannery ls PREFIX``, a prune's dry run and the web page's Archives
page take no more than twice their time with one alias (each reads only the aliases it shows or
keeps, by an indexed range), and every listing (every alias, every archive, ``tannery ls``)
answers in pages, none failing however many there are. The bulk rows go straight into the
server's SQLite catalog (one transaction: a second, not 200,000 calls)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

import tannery
from tannery.cli import main

from .server_harness import running_server
from .test_web import get, web_port

#: Archives and aliases added in bulk; the series measured has SERIES archives and one alias.
BULK = 100_000
SERIES = 10


def fastest(call: Callable[[], object], runs: int = 7) -> float:
    """The least of ``runs`` timings of ``call`` (seconds): the one least disturbed by the
    machine's other work, so two such figures compare what the call itself costs."""
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


def _bulk_rows(count: int) -> tuple[list[tuple], list[tuple]]:
    """``count`` empty archives and an alias of each, half sorting before the series and half after
    (a scan from the start, or from the series on, would meet them)."""
    names = [f"{'a' if i % 2 else 'z'}/{i:06d}" for i in range(count)]
    return ([(n, i + 1, 0, 0, 0) for i, n in enumerate(names)],
            [(f"{n[0]}-alias/{n[2:]}", n, i + 1) for i, n in enumerate(names)])


def add_in_bulk(catalog_file: Path, count: int) -> None:
    """:func:`_bulk_rows` in the SQLite catalog, in one transaction."""
    archives, aliases = _bulk_rows(count)
    conn = sqlite3.connect(catalog_file, timeout=30)
    try:
        with conn:
            conn.executemany("INSERT INTO archives (name, created_ns, entries, nbytes, payload_bytes) "
                             "VALUES (?, ?, ?, ?, ?)", archives)
            conn.executemany("INSERT INTO aliases (alias, target, moved_ns) VALUES (?, ?, ?)", aliases)
    finally:
        conn.close()


def add_in_bulk_postgres(url: str, count: int) -> None:
    """:func:`_bulk_rows` in the PostgreSQL catalog, each table in one COPY."""
    import psycopg

    archives, aliases = _bulk_rows(count)
    with psycopg.connect(url, autocommit=True) as conn, conn.cursor() as cur:
        with conn.transaction():
            with cur.copy("COPY archives (name, created_ns, entries, nbytes, payload_bytes) FROM STDIN") as copy:
                for row in archives:
                    copy.write_row(row)
            with cur.copy("COPY aliases (alias, target, moved_ns) FROM STDIN") as copy:
                for row in aliases:
                    copy.write_row(row)
        cur.execute("VACUUM ANALYZE archives")  # now, not by autovacuum in the middle of the timings
        cur.execute("VACUUM ANALYZE aliases")


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_listings_stay_fast_and_paged_at_100000_aliases_and_archives(tmp_path, capsys, request, backend):
    """SQLite at 100,000 archives and aliases; the shared catalog (PostgreSQL and a bucket) at
    20,000, to keep the test short (its queries are the same ranges of the same indexes)."""
    bulk = BULK if backend == "sqlite" else BULK // 5
    shared = {}
    if backend == "postgres":
        shared = {"catalog": request.getfixturevalue("postgres_url"), "blobs": request.getfixturevalue("s3_url")}
    with running_server(tmp_path, web_port=0, **shared) as server, tannery.Client(server.target) as client:
        for i in range(SERIES):
            client.store(f"fixed/{i}", {"w": torch.full((4,), float(i))})
        client.tag("fixed-prod", "fixed/0")

        def ls() -> str:
            capsys.readouterr()
            assert main(["--target", server.target, "ls", "fixed/"]) == 0
            return capsys.readouterr().out

        def prune() -> object:
            return client.prune("fixed/", keep_last=3, dry_run=True)

        def page() -> str:
            status, _, body = get(web_port(server), "/archives?prefix=fixed/")
            assert status == 200, body
            return body

        steps = {"ls": ls, "prune": prune, "page": page}
        for step in steps.values():
            step()  # connections made, pages compiled
        alone = {name: fastest(step) for name, step in steps.items()}

        started = time.perf_counter()
        if backend == "sqlite":
            add_in_bulk(server.data_dir / "catalog.sqlite3", bulk)
        else:
            add_in_bulk_postgres(shared["catalog"], bulk)
        report = [f"{backend}: added {bulk} archives and aliases in {time.perf_counter() - started:.2f} s"]
        crowded = {name: fastest(step) for name, step in steps.items()}
        report += [f"{name}: {alone[name] * 1000:.1f} ms with one alias, {crowded[name] * 1000:.1f} ms with {bulk}"
                   for name in steps]
        for name in steps:
            assert crowded[name] <= 2 * alone[name], (name, alone, crowded)

        # What each shows is still right: only the series, its one alias, the aliased one kept.
        out = ls()
        assert out.count("fixed/") == SERIES and "fixed-prod" in out and "a/0" not in out
        plan = prune()
        assert {i.name for i in plan.kept} == {"fixed/0", "fixed/9", "fixed/8", "fixed/7"}
        assert dict(plan.aliased) == {"fixed/0": ("fixed-prod",)}
        assert "fixed-prod" in page()

        # Listings of everything page through it: none fails, none is cut short.
        started = time.perf_counter()
        every = client.aliases()
        report.append(f"client.aliases(): {len(every)} in {time.perf_counter() - started:.2f} s")
        assert len(every) == bulk + 1 and [a.alias for a in every] == sorted(a.alias for a in every)
        assert len(client.aliases("a-alias/")) == bulk // 2
        under = client.aliases(archive_prefix="z/")
        assert len(under) == bulk // 2 and all(a.archive.startswith("z/") for a in under)
        started = time.perf_counter()
        assert len(client.list()) == bulk + SERIES
        report.append(f"client.list(): {bulk + SERIES} in {time.perf_counter() - started:.2f} s")
        with capsys.disabled():
            print("\n" + "\n".join(report))

        capsys.readouterr()
        assert main(["--target", server.target, "ls"]) == 0
        out, err = capsys.readouterr()
        assert len(out.splitlines()) == 1 + 1000 + 1  # header, the first 1,000, the note
        assert "there are more" in out and "--limit 0" in out
        assert main(["--target", server.target, "ls", "--limit", "0", "--json"]) == 0
        assert capsys.readouterr().out.count('"name"') == bulk + SERIES


def test_ls_limit_refuses_what_is_no_count(server, capsys):
    assert main(["--target", server.target, "ls", "--limit", "-1"]) != 0
    assert "--limit -1 is negative" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse's usage error
        main(["--target", server.target, "ls", "--limit", "x"])
    assert "--limit: invalid int value" in capsys.readouterr().err
