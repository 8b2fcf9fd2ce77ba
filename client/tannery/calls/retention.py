"""Retention: which archives under a prefix a prune deletes, decided from one List and the aliases.

The newest ``keep_last`` archives (by creation time; the name breaks a tie, the later one counting
as newer) are kept, and so is every archive an alias points at, whatever its age. The rest are
deleted by the call core (:meth:`tannery.calls.core.CallCore._prune`) one Delete each; the server
refuses a Delete of an archive an alias points at, so one that an alias reached after the List
is kept too.

The parts a ``tannery.dcp`` save stores before its final Union (``NAME.rank-N.<id>``,
``NAME.metadata.<id>``) are no checkpoints: they are not counted, so a part a killed save left
behind never pushes a whole checkpoint out; those older than the oldest archive kept (their save
began before it and never ended) are deleted with the rest, but never the parts of a save this
process is running (:func:`saving`): two overlapping saves, the first one's prune would otherwise
delete the parts of the second before its Union.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from tannery.records import Alias, ArchiveInfo


#: The name of a part a ``tannery.dcp`` save stores before its Union (``.rank-N.<id>``, ``.metadata.<id>``).
_PART = re.compile(r"\.(?:rank-\d+|metadata)\.([0-9a-f]{16})$")
#: The ids of the ``tannery.dcp`` saves this process runs now: no prune here deletes their parts.
_running: set[str] = set()
_running_lock = threading.Lock()


def is_save_part(name: str) -> bool:
    """Whether ``name`` is a part of a ``tannery.dcp`` save (not a checkpoint)."""
    return _PART.search(name) is not None


def save_id_of(name: str) -> str | None:
    """The id of the save whose part ``name`` is (None for a checkpoint)."""
    match = _PART.search(name)
    return match.group(1) if match else None


def saving(save_id: str) -> None:
    """Save ``save_id`` runs in this process: its parts are kept by every prune here until :func:`saved`."""
    with _running_lock:
        _running.add(save_id)


def saved(save_id: str) -> None:
    """Save ``save_id`` is over (whole or failed): its parts left behind are pruned as any."""
    with _running_lock:
        _running.discard(save_id)


def running_saves() -> frozenset[str]:
    """The ids of the saves this process runs now."""
    with _running_lock:
        return frozenset(_running)


def check_prune(prefix: str, keep_last: object) -> int:
    """``keep_last`` as a count of 1 or more; TypeError or ValueError naming what is wrong and the remedy."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int):
        raise TypeError(f"prune: keep_last is a whole number of archives to keep, not {type(keep_last).__name__}")
    if keep_last < 1:
        raise ValueError(f"prune {prefix!r}: keep_last {keep_last} keeps nothing: give 1 or more (prune keeps the "
                         "newest N archives; to delete them all, delete them by name)")
    if not prefix:
        raise ValueError("prune: an empty prefix would prune every archive on the server: give the prefix of one "
                         "series (for example 'runs/7/')")
    return keep_last


@dataclass(frozen=True)
class PrunePlan:
    """The archives to delete and to keep, newest first, and the aliases of the kept ones."""

    delete: tuple[ArchiveInfo, ...]
    keep: tuple[ArchiveInfo, ...]
    aliased: dict[str, tuple[str, ...]]


def plan_prune(archives: Sequence[ArchiveInfo], aliases: Iterable[Alias], keep_last: int,
               running: Collection[str] | None = None) -> PrunePlan:
    """What a prune of ``archives`` (one List's) deletes and keeps, given every alias; the parts
    of the saves ``running`` (default: those this process runs, :func:`running_saves`) are
    left alone, whatever their age."""
    running = running_saves() if running is None else running
    aliased: dict[str, tuple[str, ...]] = {}
    for alias in aliases:
        aliased[alias.archive] = (*aliased.get(alias.archive, ()), alias.alias)
    newest_first = sorted(archives, key=lambda info: (info.created, info.name), reverse=True)
    whole = [info for info in newest_first if not is_save_part(info.name)]
    keep = tuple(info for index, info in enumerate(whole) if index < keep_last or info.name in aliased)
    kept_names = {info.name for info in keep}
    oldest_kept = min((info.created for info in keep), default=None)
    delete = tuple(info for info in newest_first if info.name not in kept_names and (
        not is_save_part(info.name) or (oldest_kept is not None and info.created < oldest_kept
                                        and save_id_of(info.name) not in running)))
    return PrunePlan(delete, keep, {info.name: aliased[info.name] for info in keep if info.name in aliased})


__all__ = ["PrunePlan", "check_prune", "is_save_part", "plan_prune", "running_saves", "save_id_of", "saved", "saving"]
