"""A weight version's steps, written once for both clients: pushed (streamed on the channel,
stored: whole, or derived on the server from the version before when it streamed as a delta
from it; then the alias moved onto it) and applied (checked against the target, then
copied in place: from the channel as it came, or described and fetched from the store).

A version ``N`` of weights ``name`` is the archive ``name/vN`` (:func:`version_archive`),
with its number in its metadata (:data:`VERSION_KEY`); the alias ``name`` points at the
newest. These are the call core's steps (:mod:`tannery.rpc.waits`): ``tannery.weights`` runs
them blocking or awaiting, as the clients run their calls.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tannery_protocol.errors import (AliasError, AlreadyExists, ArchiveError, Cancelled, FormatError, NotFound,
                                     PermissionDenied, ResourceExhausted, ServiceError, Unauthenticated, Unavailable)
from tannery.records import ArchiveDescription, ArchiveInfo
from tannery.calls.retention import plan_prune
from tannery_protocol._lazy import lazy_module
from tannery_protocol.v1 import channels_pb2
from tannery.calls.state_dict import Rows, TargetPlan, plan_targets, target_tensors
from tannery.dataplane.memory_files import DEFAULT_BUDGET, MemoryFiles
from tannery.weights.deltas import Base, Change, apply_changes
from tannery.weights.stream import StreamedVersion, delta_payloads, version_payloads
from tannery.rpc.waits import Steps

if TYPE_CHECKING:
    from tannery.calls.core import CallCore

torch = lazy_module("torch")
log = logging.getLogger("tannery.weights")

#: The metadata key that holds a version's number.
VERSION_KEY = "tannery.weights.version"
#: The metadata key that holds the name of the weights a version belongs to.
WEIGHTS_KEY = "tannery.weights.name"
#: The metadata key that holds the id of the push that made a version (one per push: a
#: trainer started again that pushes a number once more makes another version of that number).
PUSH_KEY = "tannery.weights.push"


def version_archive(name: str, version: int) -> str:
    """The archive that holds version ``version`` of weights ``name``."""
    return f"{name}/v{version}"


def check_version(version: Any, latest: int | None, where: str) -> int:
    """``version`` as an int newer than ``latest`` (ValueError or TypeError naming both otherwise)."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"{where}: a version is an int, not {type(version).__name__}")
    if version < 0:
        raise ValueError(f"{where}: version {version} is negative (versions count up from 0)")
    if latest is not None and version <= latest:
        raise ValueError(f"{where}: version {version} is not newer than version {latest}, the latest "
                         "pushed: versions only go up (push the next number)")
    return version


def version_of(archive: str, metadata: dict[str, str] | None = None) -> int | None:
    """The version number an archive holds: from its metadata, else from its name (``.../vN``)."""
    if metadata and metadata.get(VERSION_KEY, "").isdigit():
        return int(metadata[VERSION_KEY])
    found = re.fullmatch(r".*/v(\d+)", archive)
    return int(found.group(1)) if found else None


def keep_last(keep: bool | int, where: str) -> int | None:
    """How many versions a publisher keeps: None for every one (``True``), 1 for the latest
    alone (``False``: a late joiner still starts from it), else ``keep`` itself."""
    if keep is True:
        return None
    if keep is False:
        return 1
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"{where}: keep is True (every version), False (the latest only) or a number of "
                         f"versions to keep, at least 1; not {keep!r}")
    return keep


@dataclass(frozen=True)
class Pushed:
    """A version pushed: its number, its archive (as stored), and the older versions deleted."""

    name: str
    version: int
    info: ArchiveInfo
    seconds: float
    pruned: tuple[str, ...] = ()
    #: Whether it went to the running followers on the channel too (not only through the store).
    streamed: bool = False
    #: Whether it went on the channel as a delta from the version before, and the tensor bytes
    #: the channel carried for it (0 when it was not streamed).
    delta: bool = False
    streamed_bytes: int = 0

    @property
    def archive(self) -> str:
        return self.info.name


@dataclass(frozen=True)
class Applied:
    """A version applied to a follower's target: whole, in place. ``previous`` is the version
    applied before (None for the first): a follower that fell behind skips the versions between."""

    name: str
    version: int
    archive: str
    entries: int
    nbytes: int
    seconds: float
    previous: int | None = None
    #: Where it came from: "channel" (streamed by the publisher) or "store" (fetched).
    via: str = "store"
    #: Whether it came as a delta onto the version before (applied, then every digest checked).
    delta: bool = False


class FromStore:
    """What :func:`apply_streamed` answers for a delta it cannot apply (this follower lacks its
    base, holds only some rows, or a digest failed and the changes were undone): the version
    is to be fetched whole from the store."""


FROM_STORE = FromStore()


class Pushing:
    """What a publisher holds between pushes: the weights' name, what to keep, whether to
    stream (and deltas), the alias's target as it left it (None: not asked yet; "": nothing
    pushed), and the version it streamed last, to send the next as a delta from it."""

    def __init__(self, name: str, keep: bool | int, stream: bool, delta: bool = True,
                 ready_bytes: int = DEFAULT_BUDGET) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Publisher: the weights' name is a non-empty str, not {name!r}")
        self.name = name
        self.where = f"Publisher of {name!r}"
        self.keep = keep_last(keep, self.where)
        self.stream = stream
        self.delta = delta and stream
        self.base = Base()
        self.current: str | None = None
        #: The push id of :attr:`current` when this publisher stored it ("": not known).
        self.current_push = ""
        self.version: int | None = None
        #: Held by the push under way: a second push meanwhile (another thread, another task)
        #: fails at once instead of waiting (:func:`push_steps`).
        self.lock = threading.Lock()
        #: Whether the server derives (False once it answered Derive UNIMPLEMENTED).
        self.derives = True
        #: On the same host: memory files made ready, between pushes, for the next version's payloads.
        self.files = MemoryFiles(ready_bytes) if stream and ready_bytes > 0 else None

    @property
    def busy(self) -> bool:
        """Whether a push is under way."""
        return self.lock.locked()

    def learn(self, core: CallCore) -> Steps[None]:
        """Ask where the alias points, once (a publisher started again goes on from there)."""
        if self.current is None:
            try:
                self.current = yield from core._resolve(self.name)
            except NotFound:
                self.current = ""
            self.version = version_of(self.current) if self.current else None


def push_steps(core: CallCore, pushing: Pushing, state: Any, version: int) -> Steps[Pushed]:
    """Push version ``version`` of ``state``: with ``pushing.stream``, first on the channel of
    the weights' name to the followers running now (whole or not at all: :mod:`.stream`);
    then stored as an archive (whole or not at all; derived on the server from the stored
    version before when it streamed as a delta from that one), the alias moved onto it if it still points
    where this publisher left it (AliasError naming where it points otherwise: another
    publisher), and all but the newest ``pushing.keep`` versions deleted (None: keep every one).
    One push at a time per publisher (RuntimeError for a second one meanwhile)."""
    # Taken without waiting, checked and held in one step: two threads pushing at once cannot
    # both find the publisher free (a flag read, then set, could).
    if not pushing.lock.acquire(blocking=False):
        raise RuntimeError(f"{pushing.where}: a push is under way; push one version at a time")
    try:
        return (yield from _push(core, pushing, state, version))
    finally:
        pushing.lock.release()


def _push(core: CallCore, pushing: Pushing, state: Any, version: int) -> Steps[Pushed]:
    yield from pushing.learn(core)
    version = check_version(version, pushing.version, pushing.where)
    started = time.perf_counter()
    name, current, push = pushing.name, pushing.current or "", uuid.uuid4().hex[:16]
    tensors = target_tensors(state, pushing.where)
    streamed, changes, base = None, None, (pushing.base.version, pushing.base.push)
    metadata = {VERSION_KEY: str(version), WEIGHTS_KEY: name, PUSH_KEY: push}
    info = None
    if pushing.stream:
        yield from _check_alias(core, name, current)  # before any follower sees a byte of it
        changes = pushing.base.changes(tensors) if pushing.delta else None
        if changes is None:  # whole: the server stores what the channel carries (its bytes sent once)
            payloads = version_payloads(version, push, tensors)
            store_as = channels_pb2.StoreAs(archive=version_archive(name, version), metadata=metadata,
                                            entries=["", *tensors, ""])
        else:
            payloads = delta_payloads(version, push, (pushing.base.version, pushing.base.push), tensors, changes)
            store_as = None
        try:
            streamed = yield from core._publish(name, payloads, None, store_as, pushing.files)
        except (Unavailable, ResourceExhausted):
            pass  # the channel cannot carry it now: the followers take it from the store, a moment later
        if streamed is not None and pushing.delta:
            pushing.base.take(version, push, tensors, changes)  # what the running followers hold now
        if streamed is not None and store_as is not None:
            info = streamed.stored
            if info is None:
                log.info("%s: version %d was streamed, not stored by the server (%s): storing it",
                         pushing.where, version, streamed.store_error or "a server from before store_as")
    if changes is not None and streamed is not None:
        info = yield from _derived(core, pushing, version, base, changes, metadata)
    if info is None:
        info = yield from core._store(version_archive(name, version), tensors, "", False, None, metadata, False,
                                      False)
    try:
        yield from core._tag(name, info.name, current)
    except AliasError:
        if not info.already_stored:  # another publisher moved the alias: leave no stray version
            yield from core._delete(info.name)
        raise
    except BaseException:
        pushing.current = None  # the Tag's outcome is unknown: ask where the alias points next time
        raise
    pushing.current, pushing.current_push, pushing.version = info.name, push, version
    pruned = (yield from _prune_versions(core, name, pushing.keep)) if pushing.keep is not None else ()
    sent = 0 if streamed is None else (sum(c.nbytes for c in changes) if changes is not None
                                       else sum(t.numel() * t.element_size() for t in tensors.values()))
    return Pushed(name, version, info, time.perf_counter() - started, pruned, streamed is not None,
                  changes is not None and streamed is not None, sent)


def _derived(core: CallCore, pushing: Pushing, version: int, base: tuple[int | None, str], changes: list[Change],
             metadata: dict[str, str]) -> Steps[ArchiveInfo | None]:
    """Version ``version``, streamed as ``changes`` from version ``base`` (its number and push), stored
    by the server from the stored base and those changes (Derive: only the changes travel), when the
    alias points at exactly that base as this publisher stored it. None when it cannot be: the
    version is then stored whole (an older server, a base deleted meanwhile, a delta refused). A
    refusal a Store would meet as well (the name taken, an alias there, a token's role) is raised."""
    base_version, base_push = base
    base_archive = version_archive(pushing.name, base_version) if base_version is not None else None
    if not pushing.derives or base_archive is None or pushing.current != base_archive or \
            pushing.current_push != base_push:
        return None
    listed = [(c.name, c.kind, c.digest, c.payloads) for c in changes]
    try:
        return (yield from core._derive(version_archive(pushing.name, version), base_archive, listed, metadata, False))
    except _REFUSALS:
        raise
    except (ServiceError, FormatError) as error:
        if getattr(error, "code", "") == "UNIMPLEMENTED":
            pushing.derives = False  # a server from before Derive: whole versions from now on
        else:
            log.warning("%s: version %d could not be derived from version %d on the server (%s): stored whole",
                        pushing.where, version, base_version, error)
        return None


#: What a Derive answers that a Store would answer too: not worth a Store of the whole version.
_REFUSALS = (AlreadyExists, AliasError, PermissionDenied, Unauthenticated, Cancelled)


def _prune_versions(core: CallCore, name: str, keep: int) -> Steps[tuple[str, ...]]:
    """Delete all but the newest ``keep`` versions of weights ``name`` (archives ``name/vN``
    only: ``name/value-head`` is somebody else's), never one an alias points at."""
    pattern = re.compile(re.escape(name) + r"/v\d+")
    versions = [info for info in (yield from core._list(name + "/v")) if pattern.fullmatch(info.name)]
    plan = plan_prune(versions, (yield from core._aliases("", None, name + "/v")), keep)
    deleted = []
    for info in plan.delete:
        try:
            yield from core._delete(info.name)
        except NotFound:
            continue  # deleted meanwhile (another publisher's prune)
        deleted.append(info.name)
    return tuple(deleted)


def _check_alias(core: CallCore, name: str, current: str) -> Steps[None]:
    """AliasError when alias ``name`` no longer points at ``current`` (another publisher moved it)."""
    try:
        now = yield from core._resolve(name)
    except NotFound:
        now = ""
    if now != current:
        raise AliasError(f"Publisher of {name!r}: the alias {name!r} points at {now or 'nothing'!r}, not at "
                         f"{current or 'nothing'!r} as this publisher left it: another publisher pushes these "
                         "weights (one publisher per name)")


@dataclass
class Following:
    """What a follower applies versions to, and how."""

    name: str
    target: Any
    prefix: str = ""
    strict: bool = True
    rows: Rows | None = None
    #: The version applied last (None: none yet), and the id of the push that made it.
    version: int | None = None
    push: str = ""
    #: The (version, push) refused last: not tried again from the other source.
    refused: tuple[int, str] | None = None
    #: Whether the target holds exactly the bits of (version, push), so a delta onto it may be
    #: applied (not when it holds only some rows); and, by entry, a copy in the publisher's
    #: dtype of each tensor the target holds cast (a delta applies to that, then is cast in).
    exact: bool = False
    mirrors: dict[str, Any] = field(default_factory=dict)

    def wants(self, version: int, push: str) -> bool:
        """Whether to apply ``version`` of push ``push``: newer than the one applied, or the same
        number from another push (a trainer started again that pushed that number once more)."""
        if (version, push) == self.refused:
            return False
        return self.version is None or version > self.version or (version == self.version and push != self.push)

    @property
    def where(self) -> str:
        return f"Follower of {self.name!r}"

    def check(self) -> None:
        """Refuse a target that is not one, or rows for keys it does not have, before any call."""
        state = target_tensors(self.target, self.where)
        if unknown := sorted(set(self.rows or ()) - set(state)):
            raise KeyError(f"{self.where}: rows given for keys the target does not have: {', '.join(unknown)}")


def apply_steps(core: CallCore, following: Following, archive: str) -> Steps[Applied | None]:
    """Apply the version in ``archive`` to the follower's target, whole: described, checked
    (ArchiveError naming the entry, nothing applied), every entry fetched, then copied in place.
    None when it is not newer than the version applied last."""
    started = time.perf_counter()
    description: ArchiveDescription = yield from core._describe(archive)
    version = version_of(description.name, description.metadata)
    if version is None:
        raise ArchiveError(f"{following.where}: {description.name!r} holds no version number (metadata "
                           f"{VERSION_KEY!r}, or a name ending /vN): point {following.name!r} at a pushed version")
    push = description.metadata.get(PUSH_KEY, "")
    if not following.wants(version, push):
        return None
    plan = _plan(following, description, version, push)
    tensors = (yield from core._transferred(description.name, plan.asks, None)) if plan.asks else []
    plan.apply(tensors)  # every byte is here and checked: the version goes in whole
    _keep_base(following, plan, dict(zip((slot.entry for slot in plan.slots), tensors)))
    return _applied(following, version, push, description.name, plan, started)


def apply_streamed(following: Following, streamed: StreamedVersion) -> Applied | FromStore | None:
    """Apply a version that came whole on the channel (as :func:`apply_steps` does one stored),
    or a delta onto the version the target holds: FROM_STORE when it cannot be (another base,
    only some rows here, a digest that failed after applying: then nothing of it stays)."""
    started = time.perf_counter()
    if not following.wants(streamed.version, streamed.push):
        return None
    plan = _plan(following, streamed.description(), streamed.version, streamed.push)
    archive = version_archive(following.name, streamed.version)
    if streamed.changes is None:
        if torn := streamed.torn():  # checked before anything is copied: the target keeps its version
            log.warning("%s: version %d came on the channel with bytes that are not the publisher's (%s): the "
                        "version is taken whole from the store", following.where, streamed.version, ", ".join(torn[:5]))
            return FROM_STORE
        plan.apply_whole(streamed.tensors)
        _keep_base(following, plan, streamed.tensors)
        return _applied(following, streamed.version, streamed.push, archive, plan, started, "channel")
    if not following.exact or streamed.base != (following.version, following.push):
        return FROM_STORE
    dtypes = {name: getattr(torch, dtype) for name, (dtype, _) in (streamed.shapes or {}).items()}
    targets = {}
    for slot in plan.slots:
        own = slot.tensor.dtype == dtypes[slot.entry] and slot.tensor.is_contiguous()
        targets[slot.entry] = slot.tensor if own else following.mirrors.get(slot.entry)
        if targets[slot.entry] is None:
            return FROM_STORE
    changes = [change for change in streamed.changes if change.name in targets]
    failed = apply_changes(targets, changes)
    if failed:
        log.warning("%s: version %d came as a delta whose result fails its digest (%s): undone, the version is "
                    "taken whole from the store", following.where, streamed.version, ", ".join(failed[:5]))
        return FROM_STORE
    with torch.no_grad():
        for slot in plan.slots:
            if slot.entry in following.mirrors:
                slot.tensor.copy_(following.mirrors[slot.entry])
    return _applied(following, streamed.version, streamed.push, archive, plan, started, "channel", True)


def _keep_base(following: Following, plan: TargetPlan, tensors: dict[str, Any]) -> None:
    """After a whole version: whether the next delta can apply onto the target, and a copy in
    the publisher's dtype of each tensor the target holds cast (the target's own bits are not
    the publisher's: a delta could not be checked against them)."""
    following.mirrors = {}
    following.exact = all(slot.rows is None for slot in plan.slots)
    if not following.exact:
        return
    for slot in plan.slots:
        received = tensors[slot.entry]
        if slot.tensor.dtype != received.dtype or not slot.tensor.is_contiguous():
            following.mirrors[slot.entry] = received.detach().clone(memory_format=torch.contiguous_format)


def _plan(following: Following, description: ArchiveDescription, version: int, push: str) -> TargetPlan:
    state = target_tensors(following.target, following.where)
    noun = "module" if isinstance(following.target, torch.nn.Module) else "state dict"
    try:
        return plan_targets(state, description, following.prefix, strict=following.strict, rows=following.rows,
                            check_dtypes=True, where=f"{following.where} (version {version})", noun=noun)
    except ArchiveError:
        following.refused = (version, push)  # the other source's copy of it is not tried again
        raise


def _applied(following: Following, version: int, push: str, archive: str, plan: TargetPlan, started: float,
             via: str = "store", delta: bool = False) -> Applied:
    previous, following.version, following.push = following.version, version, push
    return Applied(following.name, version, archive, len(plan.slots), plan.nbytes, time.perf_counter() - started,
                   previous, via, delta)


__all__ = ["Applied", "FROM_STORE", "FromStore", "Following", "Pushed", "VERSION_KEY", "WEIGHTS_KEY", "PUSH_KEY", "Pushing", "apply_steps", "apply_streamed", "check_version",
           "keep_last", "push_steps", "version_archive", "version_of"]
