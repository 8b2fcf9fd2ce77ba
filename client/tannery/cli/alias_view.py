"""How ``ls`` and ``show`` show aliases: which aliases point at each archive, in one call."""

from __future__ import annotations

from typing import Any

from tannery_protocol import errors


def aliases_by_archive(client: Any, archive: str | None = None) -> dict[str, list[str]]:
    """The aliases pointing at each archive (only at ``archive`` when given), sorted; none from a
    server from before aliases (it does not know the call)."""
    try:
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
