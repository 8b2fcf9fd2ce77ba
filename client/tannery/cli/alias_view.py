"""How ``ls`` and ``show`` show aliases: which aliases point at each archive, in one call."""

from __future__ import annotations

import os
from typing import Any, Sequence

from tannery_protocol import errors


def aliases_by_archive(client: Any, archive: str | None = None, shown: Sequence[str] = ()) -> dict[str, list[str]]:
    """The aliases pointing at each archive (only at ``archive`` when given; at the archives
    ``shown``, sorted names, when given), sorted; none from a server from before aliases (it
    does not know the call). For ``shown`` only the aliases of archives under the names' common
    prefix are read, not every alias on the server."""
    try:
        if shown:
            wanted = set(shown)
            found = [a for a in client.aliases(archive_prefix=os.path.commonprefix([shown[0], shown[-1]]))
                     if a.archive in wanted]
        else:
            found = client.aliases(archive=archive)
    except errors.ServiceError as error:
        if getattr(error, "code", None) == "UNIMPLEMENTED":
            return {}
        raise
    named: dict[str, list[str]] = {}
    for alias in found:
        named.setdefault(alias.archive, []).append(alias.alias)
    return named


def alias_line(asked: str, archive: str, aliases: list[str]) -> str:
    """``show``'s line naming the archive an alias led to and its aliases; "" when there are none."""
    if asked != archive:
        return f"archive: {archive} (alias {asked}" + (f"; aliases: {', '.join(aliases)})" if len(aliases) > 1 else ")")
    return f"aliases: {', '.join(aliases)}" if aliases else ""


__all__ = ["alias_line", "aliases_by_archive"]
