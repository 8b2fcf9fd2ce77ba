"""Versioned checkpoints for :mod:`tannery.dcp`: once a save is whole, an alias is moved to it,
then the older checkpoints of its run are pruned, in that order.

``Writer(target, "runs/7/step-3000", alias="runs/7/latest", keep_last=3)``:

1. When the save begins (the coordinator's ``prepare_global_plan``), :meth:`Versions.begin`
   notes where the alias points (nothing yet is fine) and refuses a name that is an archive's.
2. The checkpoint is committed whole (the Union), as any save.
3. :meth:`Versions.commit` moves the alias to it, compare-and-set against what it pointed at in
   step 1: if it moved meanwhile, another job writes the same alias, which is refused
   (AliasError, the checkpoint stays saved, nothing is pruned).
4. Then the run is pruned: the newest ``keep_last`` checkpoints under the prefix are kept, and
   every archive an alias points at. The prefix is ``prune_prefix``, else the checkpoint's name
   up to and including its last ``/`` (``runs/7/``). A DCP part left by a failed save
   (``*.rank-N.<id>``, ``*.metadata.<id>``) is not a checkpoint: never counted, and deleted
   once it is older than the oldest checkpoint kept (:mod:`tannery.calls.retention`), unless its
   save still runs in this process: a save registers its id before any part exists
   (``retention.saving``) and unregisters it once its Union is done or failed, so the prune of
   one ``async_save`` never deletes the parts of another still running.

A crash between any two steps leaves the alias on a whole checkpoint (the old one until step 3),
and nothing newer than it is ever deleted (the checkpoint the alias points at is kept).
``keep_last`` without ``alias`` prunes after the commit all the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from tannery_protocol.errors import AliasError, NotFound

from tannery.client import Client
from tannery.records import Pruned
from tannery.calls.retention import plan_prune

__all__ = ["Versions", "prune_checkpoints"]

@dataclass(frozen=True)
class Versions:
    """Where a :class:`tannery.dcp.Writer` moves an alias and what it prunes after a whole save."""

    alias: str | None = None
    keep_last: int | None = None
    prune_prefix: str | None = None

    def __post_init__(self) -> None:
        where = "tannery.dcp.Writer"
        if self.alias is not None and (not isinstance(self.alias, str) or not self.alias):
            raise ValueError(f"{where}: alias is the name of an alias (a non-empty str), not {self.alias!r}")
        if self.keep_last is not None:
            if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int):
                raise TypeError(f"{where}: keep_last is a whole number of checkpoints to keep, not "
                                f"{type(self.keep_last).__name__}")
            if self.keep_last < 1:
                raise ValueError(f"{where}: keep_last={self.keep_last} would delete the checkpoint just saved: give 1 "
                                 "or more (the newest N are kept), or leave keep_last out to prune nothing")
        if self.prune_prefix is not None and (not isinstance(self.prune_prefix, str) or not self.prune_prefix):
            raise ValueError(f"{where}: prune_prefix is a non-empty str (the run's prefix, e.g. 'runs/7/'), "
                             f"not {self.prune_prefix!r}")

    @property
    def wanted(self) -> bool:
        return self.alias is not None or self.keep_last is not None

    def prefix(self, archive: str) -> str:
        """The prefix pruned after a save of ``archive``."""
        if self.prune_prefix is not None:
            return self.prune_prefix
        head, slash, _ = archive.rpartition("/")
        if not slash:
            raise ValueError(f"tannery.dcp.Writer: keep_last with checkpoint {archive!r}, which has no '/': give "
                             "prune_prefix= (the prefix whose checkpoints are pruned), or name it 'run/step-N'")
        return head + slash

    def begin(self, client: Client, archive: str) -> str | None:
        """Where the alias points now ("" for nowhere; None without an alias), checked before a byte is written."""
        if self.keep_last is not None:
            self.prefix(archive)  # refused now rather than after the save
        if self.alias is None:
            return None
        if self.alias == archive:
            raise ValueError(f"tannery.dcp.Writer: alias {self.alias!r} is the checkpoint's own name: "
                             "give the alias a name of its own (e.g. 'runs/7/latest')")
        try:
            target = client.resolve(self.alias)
        except NotFound:
            return ""
        if target == self.alias:
            raise AliasError(f"tannery.dcp.Writer: {self.alias!r} is an archive, not an alias: give alias= a name "
                             "no archive has (e.g. 'runs/7/latest')")
        return target

    def commit(self, client: Client, archive: str, expect: str | None) -> Pruned | None:
        """After ``archive`` is whole: move the alias (compare-and-set against ``expect``), then prune."""
        if self.alias is not None:
            try:
                client.tag(self.alias, archive, expect=expect)
            except AliasError as exc:
                raise AliasError(
                    f"tannery.dcp.Writer: checkpoint {archive!r} is saved, but alias {self.alias!r} was not moved "
                    f"to it and nothing was pruned: the alias no longer points at "
                    f"{repr(expect) if expect else 'nothing'}, as it did when this save began ({exc}). Two jobs writing one alias is refused: give each job its own "
                    "alias, or move it by hand (client.tag)") from exc
        if self.keep_last is None:
            return None
        prefix = self.prefix(archive)
        try:
            return prune_checkpoints(client, prefix, self.keep_last)
        except Exception as exc:
            raise RuntimeError(f"tannery.dcp.Writer: checkpoint {archive!r} is saved"
                               f"{f' and {self.alias!r} points at it' if self.alias else ''}, but pruning {prefix!r} "
                               f"failed ({exc}); the next save prunes again") from exc


def prune_checkpoints(client: Client, prefix: str, keep_last: int) -> Pruned:
    """Delete all but the newest ``keep_last`` checkpoints under ``prefix`` (never an aliased one;
    parts of failed saves are not counted, and go once older than the oldest checkpoint kept)."""
    plan = plan_prune(list(client.list(prefix)), client.aliases(archive_prefix=prefix), keep_last)
    deleted, kept = [], list(plan.keep)
    for info in plan.delete:
        try:
            client.delete(info.name)
            deleted.append(info)
        except NotFound:  # deleted by someone else meanwhile
            deleted.append(info)
        except AliasError:  # an alias reached it after the List: kept, as aliased ones are
            kept.append(info)
    kept.sort(key=lambda info: (info.created, info.name), reverse=True)
    return Pruned(tuple(deleted), tuple(kept), plan.aliased)
