"""The pages that compare and trace versions: /diff (two archives, changed entries first with
their figures, the rest folded) and /alias (an alias's target and its history of moves, each
move linked to the diff between its two archives). Both read through the server's own Diff and
catalog, in worker threads, and write nothing."""

from __future__ import annotations

from aiohttp import web

from tannery_protocol.v1 import archives_pb2

from ..diffing import diff_archives
from ..failures import Failure, Missing
from ..storage import Damaged
from .inputs import PageProblem, query
from .pages import SITE, Site

#: Moves of an alias the page shows (the newest).
HISTORY_SHOWN = 200
CHANGE_WORDS = {archives_pb2.EntryDiff.ADDED: "added", archives_pb2.EntryDiff.REMOVED: "removed",
                archives_pb2.EntryDiff.TYPE: "dtype/shape", archives_pb2.EntryDiff.VALUE: "values",
                archives_pb2.EntryDiff.SAME: "same"}


async def diff_page(request: web.Request) -> web.Response:
    """GET /diff[?a=A&b=B]: how archive (or alias) B differs from A; without them, the form."""
    site: Site = request.app[SITE]
    limit = site.config.max_name_bytes
    values = query(request.query, {"a": limit, "b": limit}, "diff")
    a, b = values.get("a", ""), values.get("b", "")
    if not (a and b):
        return site.html("diff", a=a, b=b, diff=None, changed=[], same=[], words=CHANGE_WORDS)
    ask = archives_pb2.DiffRequest(a=a, b=b, list_same=True)
    try:
        async with site.statistics:  # it reads tensor bytes: as many at once as statistics
            answer = await site.run(diff_archives, site.storage, ask, lambda: None)
    except Missing as exc:
        raise PageProblem(404, "Not Found", str(exc), "check the names on the Archives page") from None
    except Damaged as exc:
        raise PageProblem(500, "Damaged", f"a stored block failed its check: {exc}",
                          "run tannery scrub to list every damaged blob") from None
    except Failure as exc:
        raise PageProblem(400, "Bad Request", str(exc), "give two archives' names or aliases") from None
    changed = [e for e in answer.entries if e.change != archives_pb2.EntryDiff.SAME]
    same = [e for e in answer.entries if e.change == archives_pb2.EntryDiff.SAME]
    return site.html("diff", a=a, b=b, diff=answer, changed=changed, same=same, words=CHANGE_WORDS)


async def alias_page(request: web.Request) -> web.Response:
    """GET /alias?name=N: where alias N points now and its moves, newest first, each with a diff link."""
    site: Site = request.app[SITE]
    values = query(request.query, {"name": site.config.max_name_bytes}, "alias")
    name = values.get("name", "")
    if not name:
        raise PageProblem(400, "Bad Request", "the alias page needs the parameter 'name'",
                          "give it in the address, e.g. /alias?name=prod")
    catalog = site.storage.catalog
    current = await site.run(catalog.alias, name)
    moves = await site.run(catalog.history, name, HISTORY_SHOWN)
    if current is None and not moves:
        raise PageProblem(404, "Not Found", f"alias {name!r} not found, and no move of it is recorded",
                          "see the aliases on the Archives page")
    return site.html("alias", alias=name, current=current, moves=moves, most=HISTORY_SHOWN)


__all__ = ["alias_page", "diff_page"]
