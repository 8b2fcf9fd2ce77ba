"""The four pages (Archives, one archive, one entry, Server): each reads the catalog and storage
directly, in worker threads, never writes, and renders its template. A missing archive or entry
is a 404 page naming it."""

from __future__ import annotations

import asyncio
import json
import shlex
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web

from ..config import Config
from ..failures import Missing
from ..storage import AliasPage, ArchiveRecord, Damaged, Storage
from ..storage.factory import describe
from . import kept_files, plots, stats, tree
from .inputs import PageProblem, query, required
from .templates import Renderer
from .traffic import INTERVAL, KEPT, Traffic

#: Where the application keeps the :class:`Site` its pages read.
SITE: web.AppKey["Site"] = web.AppKey("site")
#: Archives listed on one page of the list (a link leads to the next ones).
LIST_PAGE = 500
#: Aliases shown on one page of the list, at most (an archive's own page shows all of its aliases).
ALIASES_SHOWN = 10 * LIST_PAGE
#: Entry statistics computed at the same time, at most.
STATISTICS_AT_ONCE = 2
#: Seconds a health check of the catalog or the bucket may take before it counts as failed.
HEALTH_SECONDS = 5.0


@dataclass
class Site:
    """What the pages read: the server's storage and settings, its channels and metrics."""

    storage: Storage
    config: Config
    #: The gRPC address clients use (host:port), for the commands the archive page shows.
    target: str
    renderer: Renderer
    traffic: Traffic
    #: The Channels servicer (its ``hub`` and ``fabric``), None without the Channels service.
    channels: Any = None
    #: Entry statistics computed at once, at most (each holds a few tens of MiB while it reads):
    #: more pages asking wait their turn, so the page's memory stays bounded however many ask.
    statistics: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(STATISTICS_AT_ONCE))

    async def run(self, call, *args):
        """A blocking storage call in a worker thread."""
        return await asyncio.to_thread(call, *args)

    def html(self, name: str, **context: Any) -> web.Response:
        return web.Response(text=self.renderer.page(name, **context), content_type="text/html")


def _limit(site: Site) -> int:
    return site.config.max_name_bytes


async def archives_page(request: web.Request) -> web.Response:
    """GET /archives?prefix=P&after=A: the archives whose names start with P, a page at a time."""
    site: Site = request.app[SITE]
    values = query(request.query, {"prefix": _limit(site), "after": _limit(site)}, "Archives")
    prefix, after = values.get("prefix", ""), values.get("after", "")
    catalog = site.storage.catalog
    found = await site.run(catalog.list_archives, prefix, after, LIST_PAGE + 1)
    shown = found[:LIST_PAGE]
    aliases: dict[str, list[str]] = {}
    if shown:  # only the aliases of the archives shown: one indexed read, whatever the server holds
        page = AliasPage(archives_from=shown[0].name, archives_to=shown[-1].name, limit=ALIASES_SHOWN)
        for alias in await site.run(catalog.aliases, "", "", page):
            aliases.setdefault(alias.archive, []).append(alias.alias)
    return site.html("archives", prefix=prefix, archives=shown, aliases=aliases,
                     next_after=shown[-1].name if len(found) > LIST_PAGE else "")


async def archive_page(request: web.Request) -> web.Response:
    """GET /archive?name=N[&open=all][&filter=TEXT]: one archive (or what alias N points at): its
    tensors as a tree, the top level open; deeper nodes come without their content, fetched from
    /tree when opened (a 10,000-entry archive's page stays small), or every node with it
    (open=all); with ``filter``, only the tensors whose names hold TEXT (any case), every node
    open. The files kept with it are listed apart, each viewable (/file)."""
    site: Site = request.app[SITE]
    values = query(request.query, {"name": _limit(site), "open": 3, "filter": _limit(site)}, "archive")
    name = required(values, "name", "archive", "/archive?name=resnet50")
    all_open = values.get("open", "") == "all"
    if values.get("open", "all") != "all":
        raise PageProblem(400, "Bad Request", f"parameter 'open' is {values['open']!r}",
                          "give open=all for every node opened, or leave it out")
    catalog = site.storage.catalog
    record = await find_archive(site, name)
    entries = await site.run(catalog.entries_under, record.name, "")
    if not entries and record.entries:
        raise PageProblem(404, "Not Found", f"archive {record.name!r} was deleted while this page read it",
                          "reload the Archives page")
    aliases = await site.run(lambda: catalog.aliases("", record.name))
    tensors, files = kept_files.split(entries)
    wanted = values.get("filter", "")
    shown = [e for e in tensors if wanted.casefold() in e.name.casefold()] if wanted else tensors
    all_open = all_open or bool(wanted)
    root = tree.build(shown)
    return site.html(
        "archive", asked=name, record=record, aliases=aliases, total_params=sum(map(tree.numel, tensors)),
        tensor_count=len(tensors), tensor_bytes=sum(e.nbytes for e in tensors), files=files, filter=wanted, shown_count=len(shown),
        by_dtype=tree.params_by_dtype(tensors), rows=tree.rows(root, None if all_open else 1),
        open_depth=1_000_000 if all_open else 1, all_open=all_open,
        cli=_cli(site, _target(site, request), record.name), python=_python(site, _target(site, request), record.name),
        archive_query=urllib.parse.quote(record.name, safe=""))


async def tree_part(request: web.Request) -> web.Response:
    """GET /tree?name=N&node=P: the content of node P of archive N's tree (its nodes, without
    their content, and its entries): what the archive page fetches when a node is opened."""
    site: Site = request.app[SITE]
    values = query(request.query, {"name": _limit(site), "node": _limit(site)}, "tree")
    name = required(values, "name", "tree", "/tree?name=resnet50&node=layer1")
    path = required(values, "node", "tree", "/tree?name=resnet50&node=layer1")
    catalog = site.storage.catalog
    record = await find_archive(site, name)
    entries = kept_files.tensors_only(await site.run(catalog.entries_under, record.name, path))
    node = tree.find(tree.build(entries), path)
    if node is None:
        raise PageProblem(404, "Not Found", f"archive {record.name!r} has no entry under {path!r}",
                          f"see its entries on /archive?name={record.name}")
    html = site.renderer.page("tree_rows", rows=tree.rows(node, 0), open_depth=0,
                              archive_query=urllib.parse.quote(record.name, safe=""))
    return web.Response(text=html, content_type="text/html")


async def find_archive(site: Site, name: str) -> ArchiveRecord:
    """The archive ``name`` denotes now (an archive, or what an alias points at), or a 404 page naming it."""
    record = await site.run(site.storage.catalog.lookup, name)
    if record is None:
        raise PageProblem(404, "Not Found", f"archive {name!r} not found",
                          "check the name on the Archives page (names and aliases are case-sensitive)")
    return record


def _target(site: Site, request: web.Request) -> str:
    """The gRPC address a reader of the page reaches the server at: the server's own, or, when it
    listens on every interface (0.0.0.0, ::), the host the page was opened at, with gRPC's port."""
    host, _, port = site.target.rpartition(":")
    if host.strip("[]") not in ("0.0.0.0", "::", ""):
        return site.target
    seen = request.url.host or "localhost"
    return f"[{seen}]:{port}" if ":" in seen else f"{seen}:{port}"


def _cli(site: Site, target: str, name: str) -> str:
    """The command that fetches archive ``name`` into a safetensors file."""
    token = " TANNERY_TOKEN=..." if _has_tokens(site.config) else ""
    tls = " TANNERY_TLS=1" if site.config.tls_cert else ""
    out = shlex.quote(name.replace("/", "_") + ".safetensors")
    return f"TANNERY_TARGET={target}{tls}{token} tannery pull {shlex.quote(name)} -o {out}"


def _python(site: Site, target: str, name: str) -> str:
    """The Python that fetches archive ``name``."""
    token = ', token="..."' if _has_tokens(site.config) else ""
    tls = ", tls=True" if site.config.tls_cert else ""
    return (f"import tannery\n\nwith tannery.Client({json.dumps(target)}{tls}{token}) as client:\n"
            f"    archive = client.fetch({json.dumps(name)})   # every entry, as a tannery.Archive\n"
            f"    print(archive.names())")


def _has_tokens(config: Config) -> bool:
    return bool(config.tokens or config.tokens_file)


async def entry_page(request: web.Request) -> web.Response:
    """GET /entry?archive=A&name=E: one entry and its statistics, computed now over its stored bytes."""
    site: Site = request.app[SITE]
    values = query(request.query, {"archive": _limit(site), "name": _limit(site), "scale": 6}, "entry")
    log_scale = values.get("scale", "linear") == "log"
    if values.get("scale", "linear") not in ("linear", "log"):
        raise PageProblem(400, "Bad Request", f"parameter 'scale' is {values['scale']!r}",
                          "give scale=log for a log-scale histogram, scale=linear (or nothing) for a linear one")
    archive = required(values, "archive", "entry", "/entry?archive=resnet50&name=fc.weight")
    name = required(values, "name", "entry", "/entry?archive=resnet50&name=fc.weight")
    catalog = site.storage.catalog
    record = await find_archive(site, archive)
    found = await site.run(catalog.entries, record.name, [name])
    entry = found.get(name)
    if entry is None:
        raise PageProblem(404, "Not Found", f"archive {record.name!r} has no entry {name!r}",
                          f"see its entries on /archive?name={record.name}")
    async with site.statistics:
        result = await _read_stored(site, f"entry {name!r}", stats.entry_stats, site.storage, record.name, entry)
    return site.html("entry", archive=record.name, entry=entry, stats=result.__dict__, log_scale=log_scale,
                     histogram=plots.histogram(result.edges, result.counts, log_scale))


async def _read_stored(site: Site, what: str, read: Callable[..., Any], *args: Any) -> Any:
    """``read(*args)`` of stored bytes on the page's threads; a blob gone meanwhile (404) or
    failing its check (500) is the page's problem, naming ``what`` and the remedy."""
    try:
        return await site.run(read, *args)
    except Missing as exc:
        raise PageProblem(404, "Not Found", str(exc), "reload the archive's page") from None
    except Damaged as exc:
        raise PageProblem(500, "Damaged", f"the stored bytes of {what} failed their check: {exc}",
                          "run tannery scrub to list every damaged blob; push the archive again") from None


async def file_page(request: web.Request) -> web.Response:
    """GET /file?archive=A&name=E: a file kept with archive A (entry E, ``@file:...``) as text,
    its first MiB (a binary file is said to be one, with its size)."""
    site: Site = request.app[SITE]
    values = query(request.query, {"archive": _limit(site), "name": _limit(site)}, "file")
    archive = required(values, "archive", "file", "/file?archive=minilm&name=@file:config.json")
    name = required(values, "name", "file", "/file?archive=minilm&name=@file:config.json")
    record = await find_archive(site, archive)
    entry = (await site.run(site.storage.catalog.entries, record.name, [name])).get(name)
    kept = kept_files.split([entry])[1] if entry is not None else []
    if not kept:
        raise PageProblem(404, "Not Found", f"archive {record.name!r} keeps no file as entry {name!r}",
                          f"see its files on /archive?name={record.name}")
    shown = await _read_stored(site, f"file {kept[0].name!r}", kept_files.read_text, site.storage, record.name,
                               entry)
    return site.html("file", archive=record.name, file=kept[0], shown=shown, most=kept_files.SHOWN_BYTES)


async def server_page(request: web.Request) -> web.Response:
    """GET /server: the health of the catalog, the blob store and NATS; traffic by RPC; channels."""
    site: Site = request.app[SITE]
    query(request.query, {}, "Server")
    health = [
        await _check("catalog", site.storage.catalog.check, _catalog_name(site.config)),
        await _check("blob store", site.storage.blobs.check, site.config.blobs or f"files in {site.config.data_dir}"),
        _nats(site),
        _Part("replicas", None, "shared store" if site.config.catalog.startswith("postgres") else "one server",
              f"{describe(site.config)}; this replica serves gRPC on {site.target}"),
    ]
    traffic = site.traffic.now() if site.traffic.metrics is not None else None
    channels = None
    if site.channels is not None:
        channels = [_Channel(c.name, len(c.subscriptions), c.publishers, c.payloads)
                    for c in sorted(site.channels.hub.channels.values(), key=lambda c: c.name)]
    return site.html("server", target=site.target, health=health, traffic=traffic, channels=channels,
                     interval=INTERVAL, plot=plots.rates(site.traffic.history(), INTERVAL * KEPT))


@dataclass
class _Part:
    name: str
    ok: bool | None
    state: str
    detail: str


@dataclass
class _Channel:
    name: str
    subscribers: int
    publishers: int
    payloads: int


def _catalog_name(config: Config) -> str:
    from ..config import without_password

    return without_password(config.catalog) if config.catalog else f"{config.data_dir}/catalog.sqlite3"


async def _check(name: str, check, where: str) -> _Part:
    """One part's health: answers, or the error it gave (a hang past HEALTH_SECONDS fails)."""
    try:
        await asyncio.wait_for(asyncio.to_thread(check), HEALTH_SECONDS)
    except Exception as exc:  # StorageUnavailable names the part; a hang is a failure too
        return _Part(name, False, "not answering", str(exc) or f"no answer in {HEALTH_SECONDS:.0f} s ({where})")
    return _Part(name, True, "answers", where)


def _nats(site: Site) -> _Part:
    """NATS: connected or not, with its traffic; 'not used' without --nats."""
    if not site.config.nats:
        return _Part("NATS", None, "not used", "channels stay within this server (no --nats)")
    fabric = getattr(site.channels, "fabric", None)
    found = fabric.stats() if fabric is not None else {}
    if not found.get("connected"):
        return _Part("NATS", False, "disconnected", getattr(fabric, "name", "NATS") + ": reconnecting")
    return _Part("NATS", True, "connected", f"{getattr(fabric, 'name', 'NATS')}: {found['payloads_out']} payloads out, "
                 f"{found['payloads_in']} in")


__all__ = ["Site", "archive_page", "archives_page", "entry_page", "file_page", "server_page", "tree_part"]
