"""Weight versions on a channel: how a publisher streams a version to the followers running
now, and how a follower puts the payloads back together into whole versions.

A version is published on the channel named like the weights as one *manifest* payload (a
1-D uint8 tensor: :data:`MAGIC` and then JSON: the version, the push's id, and each entry's
name, dtype and shape in the order they follow), then each entry's tensor, then an *end*
payload (:data:`END`: the push's id, the count of tensors and each one's CRC-32C, which a
follower checks before applying: the bytes may have passed through relays), in one Publish. A version sent
as a delta (:mod:`tannery.weights.deltas`) has a *delta manifest* instead (:data:`DELTA`: the base's
version and push, and each entry's kind, digest and count of changed elements), followed by
what each change carries; a follower of an older release, which knows no delta manifest,
ignores the version and takes it from the store. A channel
keeps one publisher's payloads in order and hands a subscriber only whole payloads, but two
publishers' payloads may interleave between payloads: :class:`Assembler` completes a version
only when its end names the push its manifest named, after exactly the tensors the manifest
lists, each of its dtype and shape. A follower that subscribed in the middle of a version,
whose publisher was cut off (killed), or that got another push's payloads in between, never
completes it. So a follower applies only whole versions of one push.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tannery_protocol._lazy import lazy_module
from tannery.records import ArchiveDescription, ArchiveInfo, EntryDescription
from .deltas import Change, _pool, bits_layout, digest, index_dtype

torch = lazy_module("torch")

#: How every manifest payload begins, and every end payload.
MAGIC = b"tannery.weights/1 manifest\n"
END = b"tannery.weights/1 end\n"
#: How every delta manifest begins.
DELTA = b"tannery.weights/1 delta\n"


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _control(head: bytes, found: dict[str, Any]) -> Any:
    body = head + json.dumps(found).encode()
    return torch.frombuffer(bytearray(body), dtype=torch.uint8)


def version_payloads(version: int, push: str, state: Mapping[str, Any]) -> Iterator[Any]:
    """What a publisher sends for one version: its manifest, each tensor (as it is), its end,
    which carries each tensor's CRC-32C (computed on other threads while the tensors go, so a
    follower checks what came, through however many relays, before it applies anything)."""
    entries = [[name, _dtype_name(t), list(t.shape)] for name, t in state.items()]
    pool = _pool()
    digests = [pool.submit(digest, t) for t in state.values()]
    try:
        yield _control(MAGIC, {"version": version, "push": push, "entries": entries})
        yield from state.values()
        yield _control(END, {"push": push, "count": len(entries), "digests": [d.result() for d in digests]})
    finally:
        for pending in digests:
            pending.cancel()


def delta_payloads(version: int, push: str, base: tuple[int, str], state: Mapping[str, Any],
                   changes: list[Change]) -> Iterator[Any]:
    """What a publisher sends for a version as changes from ``base`` (version, push): its delta
    manifest, each change's payloads, its end."""
    entries = [[c.name, _dtype_name(state[c.name]), list(state[c.name].shape), c.kind, c.digest,
                c.payloads[0].numel() if c.kind == "delta" else 0] for c in changes]
    yield _control(DELTA, {"version": version, "push": push, "base": list(base), "entries": entries})
    count = 0
    for change in changes:
        count += len(change.payloads)
        yield from change.payloads
    yield _control(END, {"push": push, "count": count})


def read_control(tensor: Any) -> dict[str, Any] | None:
    """The manifest (``kind`` "manifest" or "delta") or end (``kind`` "end") a payload holds, or
    None when it holds neither (a tensor of the version)."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.numel() < len(END):
        return None
    head = tensor[:len(MAGIC)].numpy().tobytes()  # a large uint8 tensor is not copied to find out
    kinds = {"manifest": MAGIC, "delta": DELTA, "end": END}
    kind = next((kind for kind, magic in kinds.items() if head.startswith(magic)), None)
    if kind is None:
        return None
    body = tensor.numpy().tobytes()[len(kinds[kind]):]
    try:
        found = json.loads(body)
        control: dict[str, Any] = {"kind": kind, "push": str(found["push"])}
        if kind == "end":
            control["count"] = int(found["count"])
            control["digests"] = [int(d) for d in found["digests"]] if "digests" in found else None
            return control
        control["version"] = int(found["version"])
        control["entries"] = [(str(name), str(dtype), tuple(int(d) for d in shape), *_change_of(kind, rest))
                              for name, dtype, shape, *rest in found["entries"]]
        control["base"] = (int(found["base"][0]), str(found["base"][1])) if kind == "delta" else None
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    return control


def _change_of(kind: str, rest: list[Any]) -> tuple[str, int, int]:
    """An entry's (change kind, digest, count) from a manifest's row: a whole version's are all whole."""
    if kind == "manifest":
        return ("whole", 0, 0)
    change, digest, count = rest
    if change not in ("same", "delta", "whole"):
        raise ValueError(f"unknown change {change!r}")
    return (str(change), int(digest), int(count))


def _expected(manifest: dict[str, Any]) -> list[tuple[str, str, tuple[int, ...]]]:
    """The payloads a manifest announces, in order: (entry, dtype, shape) of each (ValueError
    for a change that cannot be: an unknown dtype, more changed elements than there are)."""
    expected = []
    for name, dtype, shape, change, _, count in manifest["entries"]:
        if change == "whole":
            expected.append((name, dtype, shape))
        elif change == "delta":
            found = getattr(torch, dtype, None)
            if not isinstance(found, torch.dtype):
                raise ValueError(f"{name}: unknown dtype {dtype!r}")
            element, elements = bits_layout(found, math.prod(shape))
            if not 0 < count <= elements:
                raise ValueError(f"{name}: {count} changed elements of {elements}")
            expected += [(name, _dtype_name(torch.empty(0, dtype=index_dtype(elements))), (count,)),
                         (name, _dtype_name(torch.empty(0, dtype=element)), (count,))]
    return expected


@dataclass
class StreamedVersion:
    """A version as it came whole on the channel: the received tensors by entry name; or, for
    a delta, the base it applies onto and each entry's change (whose payloads came)."""

    name: str
    version: int
    push: str
    tensors: dict[str, Any]
    #: A delta's base (version, push), None for a whole version.
    base: tuple[int, str] | None = None
    changes: list[Change] | None = None
    #: Each entry's (dtype, shape) as the publisher holds it (a delta's tensors are not all here).
    shapes: dict[str, tuple[str, tuple[int, ...]]] | None = None
    #: A whole version's CRC-32C of each tensor as the publisher sent it (None: a publisher from
    #: before them); a delta carries its own, checked after applying.
    digests: dict[str, int] | None = None

    def torn(self) -> list[str]:
        """The entries of a whole version whose bytes are not what the publisher sent."""
        if self.digests is None or self.changes is not None:
            return []
        return [name for name, tensor in self.tensors.items() if digest(tensor) != self.digests.get(name)]

    def description(self) -> ArchiveDescription:
        """What :func:`~tannery.calls.state_dict.plan_targets` checks a target against."""
        shapes = self.shapes or {name: (_dtype_name(t), tuple(t.shape)) for name, t in self.tensors.items()}
        entries = []
        for name, (dtype, shape) in shapes.items():
            itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
            entries.append(EntryDescription(name, dtype, shape, math.prod(shape) * itemsize, 0, ""))
        info = ArchiveInfo(f"{self.name} (version {self.version}, streamed)", len(entries),
                           sum(e.nbytes for e in entries), 0, None)
        return ArchiveDescription(info, tuple(entries))

    @property
    def nbytes(self) -> int:
        """The tensor bytes that came on the channel for it."""
        if self.changes is not None:
            return sum(change.nbytes for change in self.changes)
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class Assembler:
    """The payloads of a weights channel, in order, put back together into whole versions (or
    whole deltas)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._manifest: dict[str, Any] | None = None
        self._expected: list[tuple[str, str, tuple[int, ...]]] = []
        self._payloads: list[Any] = []
        #: Versions begun and never completed (cut off, or joined midway), and payloads ignored.
        self.dropped = 0

    @property
    def pending(self) -> int | None:
        """The version being put together now (its manifest came, not its end), if any."""
        return None if self._manifest is None else self._manifest["version"]

    def add(self, tensor: Any) -> StreamedVersion | None:
        """Take the next payload; the version it completes, if it does."""
        control = read_control(tensor)
        if control is not None and control["kind"] != "end":
            self._drop()  # one begun before never ended: its publisher was cut off
            try:
                self._expected = _expected(control)
            except ValueError:
                self.dropped += 1
                return None
            self._manifest, self._payloads = control, []
            return None
        if self._manifest is None:
            return None  # the rest of a version begun before this follower subscribed
        if control is not None:  # an end: this push's, after all its payloads, or the version is torn
            whole = (control["push"] == self._manifest["push"]
                     and control["count"] == len(self._payloads) == len(self._expected))
            version = self._version() if whole else None
            if version is None:
                self._drop()
            elif control["digests"] is not None and version.changes is None:
                if len(control["digests"]) != len(version.tensors):
                    self._drop()
                    version = None
                else:
                    version.digests = dict(zip(version.tensors, control["digests"]))
            self._manifest, self._payloads = None, []
            return version
        if len(self._payloads) == len(self._expected):
            self._drop()  # a payload more than the manifest lists: another push's
            return None
        _, dtype, shape = self._expected[len(self._payloads)]
        if _dtype_name(tensor) != dtype or tuple(tensor.shape) != shape:
            self._drop()
            return None
        self._payloads.append(tensor)
        return None

    def _version(self) -> StreamedVersion:
        manifest = self._manifest
        assert manifest is not None
        payloads = iter(self._payloads)
        if manifest["kind"] == "manifest":
            tensors = {name: next(payloads) for name, *_ in manifest["entries"]}
            return StreamedVersion(self.name, manifest["version"], manifest["push"], tensors)
        changes, shapes = [], {}
        for name, dtype, shape, change, digest, _ in manifest["entries"]:
            shapes[name] = (dtype, shape)
            carried = {"same": 0, "delta": 2, "whole": 1}[change]
            changes.append(Change(name, change, digest, [next(payloads) for _ in range(carried)]))
        return StreamedVersion(self.name, manifest["version"], manifest["push"], {}, manifest["base"], changes, shapes)

    def _drop(self) -> None:
        if self._manifest is not None:
            self.dropped += 1
        self._manifest, self._expected, self._payloads = None, [], []


__all__ = ["Assembler", "DELTA", "END", "MAGIC", "StreamedVersion", "delta_payloads", "read_control", "version_payloads"]
