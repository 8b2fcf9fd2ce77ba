"""Weight versions on a channel: how a publisher streams a version to the followers running
now, and how a follower puts the payloads back together into whole versions.

A version is published on the channel named like the weights as one *manifest* payload (a
1-D uint8 tensor: :data:`MAGIC` and then JSON: the version, the push's id, and each entry's
name, dtype and shape in the order they follow), then each entry's tensor, then an *end*
payload (:data:`END`: the push's id and the count of tensors), in one Publish. A channel
keeps one publisher's payloads in order and hands a subscriber only whole payloads, but two
publishers' payloads may interleave between payloads: :class:`Assembler` completes a version
only when its end names the push its manifest named, after exactly the tensors the manifest
lists, each of its dtype and shape. A follower that subscribed in the middle of a version,
whose publisher was cut off (killed), or that got another push's payloads in between, never
completes it. So a follower applies only whole versions of one push.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tannery_protocol._lazy import lazy_module
from tannery.records import ArchiveDescription, ArchiveInfo, EntryDescription

torch = lazy_module("torch")

#: How every manifest payload begins, and every end payload.
MAGIC = b"tannery.weights/1 manifest\n"
END = b"tannery.weights/1 end\n"


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _control(head: bytes, found: dict[str, Any]) -> Any:
    body = head + json.dumps(found).encode()
    return torch.frombuffer(bytearray(body), dtype=torch.uint8)


def version_payloads(version: int, push: str, state: Mapping[str, Any]) -> Iterator[Any]:
    """What a publisher sends for one version: its manifest, each tensor (as it is), its end."""
    entries = [[name, _dtype_name(t), list(t.shape)] for name, t in state.items()]
    yield _control(MAGIC, {"version": version, "push": push, "entries": entries})
    yield from state.values()
    yield _control(END, {"push": push, "count": len(entries)})


def read_control(tensor: Any) -> dict[str, Any] | None:
    """The manifest (``kind`` "manifest") or end (``kind`` "end") a payload holds, or None when
    it holds neither (a tensor of the version)."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.numel() < len(END):
        return None
    head = tensor[:len(MAGIC)].numpy().tobytes()  # a large uint8 tensor is not copied to find out
    kind = "manifest" if head.startswith(MAGIC) else "end" if head.startswith(END) else None
    if kind is None:
        return None
    body = tensor.numpy().tobytes()[len(MAGIC if kind == "manifest" else END):]
    try:
        found = json.loads(body)
        control: dict[str, Any] = {"kind": kind, "push": str(found["push"])}
        if kind == "manifest":
            control["version"] = int(found["version"])
            control["entries"] = [(str(name), str(dtype), tuple(int(d) for d in shape))
                                  for name, dtype, shape in found["entries"]]
        else:
            control["count"] = int(found["count"])
    except (ValueError, KeyError, TypeError):
        return None
    return control


@dataclass
class StreamedVersion:
    """A whole version as it came on the channel: the received tensors by entry name."""

    name: str
    version: int
    push: str
    tensors: dict[str, Any]

    def description(self) -> ArchiveDescription:
        """What :func:`~tannery.calls.state_dict.plan_targets` checks a target against."""
        entries = tuple(EntryDescription(name, _dtype_name(t), tuple(t.shape), t.numel() * t.element_size(), 0, "")
                        for name, t in self.tensors.items())
        info = ArchiveInfo(f"{self.name} (version {self.version}, streamed)", len(entries),
                           sum(e.nbytes for e in entries), 0, None)
        return ArchiveDescription(info, entries)


class Assembler:
    """The payloads of a weights channel, in order, put back together into whole versions."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._manifest: dict[str, Any] | None = None
        self._tensors: dict[str, Any] = {}
        #: Versions begun and never completed (cut off, or joined midway), and payloads ignored.
        self.dropped = 0

    @property
    def pending(self) -> int | None:
        """The version being put together now (its manifest came, not its end), if any."""
        return None if self._manifest is None else self._manifest["version"]

    def add(self, tensor: Any) -> StreamedVersion | None:
        """Take the next payload; the version it completes, if it does."""
        control = read_control(tensor)
        if control is not None and control["kind"] == "manifest":
            self._drop()  # one begun before never ended: its publisher was cut off
            self._manifest, self._tensors = control, {}
            return None
        if self._manifest is None:
            return None  # the rest of a version begun before this follower subscribed
        entries = self._manifest["entries"]
        if control is not None:  # an end: this push's, after all its tensors, or the version is torn
            whole = control["push"] == self._manifest["push"] and control["count"] == len(self._tensors) == len(entries)
            version = (StreamedVersion(self.name, self._manifest["version"], self._manifest["push"], self._tensors)
                       if whole else None)
            if version is None:
                self._drop()
            self._manifest, self._tensors = None, {}
            return version
        if len(self._tensors) == len(entries):
            self._drop()  # a tensor more than the manifest lists: another push's
            return None
        name, dtype, shape = entries[len(self._tensors)]
        if _dtype_name(tensor) != dtype or tuple(tensor.shape) != shape:
            self._drop()
            return None
        self._tensors[name] = tensor
        return None

    def _drop(self) -> None:
        if self._manifest is not None:
            self.dropped += 1
        self._manifest, self._tensors = None, {}


__all__ = ["Assembler", "END", "MAGIC", "StreamedVersion", "read_control", "version_payloads"]
