"""Weight versions on a channel: how a publisher streams a version to the followers running
now, and how a follower puts the payloads back together into whole versions.

A version is published on the channel named like the weights as one *manifest* payload (a
1-D uint8 tensor: :data:`MAGIC` and then JSON: the version, and each entry's name, dtype and
shape in the order they follow), then each entry's tensor, in one Publish. A channel keeps
one publisher's payloads in order and hands a subscriber only whole payloads; a follower
that subscribed in the middle of a version, or whose publisher was cut off (killed), never
completes it: :class:`Assembler` drops it at the next manifest. A payload that does not
match its manifest entry drops the version too. So a follower applies only whole versions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tannery_protocol._lazy import lazy_module
from .records import ArchiveDescription, ArchiveInfo, EntryDescription

torch = lazy_module("torch")

#: How every manifest payload begins.
MAGIC = b"tannery.weights/1\n"


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def manifest(version: int, state: Mapping[str, Any]) -> Any:
    """The manifest payload of ``version`` of ``state`` (name to tensor)."""
    entries = [[name, _dtype_name(t), list(t.shape)] for name, t in state.items()]
    body = MAGIC + json.dumps({"version": version, "entries": entries}).encode()
    return torch.frombuffer(bytearray(body), dtype=torch.uint8)


def version_payloads(version: int, state: Mapping[str, Any]) -> Iterator[Any]:
    """What a publisher sends for one version: its manifest, then each tensor (as it is)."""
    yield manifest(version, state)
    yield from state.values()


def read_manifest(tensor: Any) -> dict[str, Any] | None:
    """The manifest a payload holds, or None when it is not one."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.numel() < len(MAGIC):
        return None
    body = tensor.numpy().tobytes()
    if not body.startswith(MAGIC):
        return None
    try:
        found = json.loads(body[len(MAGIC):])
        version = found["version"]
        entries = [(str(name), str(dtype), tuple(int(d) for d in shape)) for name, dtype, shape in found["entries"]]
    except (ValueError, KeyError, TypeError):
        return None
    return {"version": int(version), "entries": entries}


@dataclass
class StreamedVersion:
    """A whole version as it came on the channel: the received tensors by entry name."""

    name: str
    version: int
    tensors: dict[str, Any]

    def description(self) -> ArchiveDescription:
        """What :func:`~tannery.state_dict.plan_targets` checks a target against."""
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
        """The version being put together now (its manifest came, not all its tensors), if any."""
        return None if self._manifest is None else self._manifest["version"]

    def add(self, tensor: Any) -> StreamedVersion | None:
        """Take the next payload; the version it completes, if it does."""
        found = read_manifest(tensor)
        if found is not None:
            if self._manifest is not None:
                self.dropped += 1  # the one before never completed: its publisher was cut off
            self._manifest, self._tensors = found, {}
            return self._complete()
        if self._manifest is None:
            return None  # the rest of a version begun before this follower subscribed
        name, dtype, shape = self._manifest["entries"][len(self._tensors)]
        if _dtype_name(tensor) != dtype or tuple(tensor.shape) != shape:
            self.dropped += 1
            self._manifest = None
            return None
        self._tensors[name] = tensor
        return self._complete()

    def _complete(self) -> StreamedVersion | None:
        assert self._manifest is not None
        if len(self._tensors) < len(self._manifest["entries"]):
            return None
        version = StreamedVersion(self.name, self._manifest["version"], self._tensors)
        self._manifest, self._tensors = None, {}
        return version


__all__ = ["Assembler", "MAGIC", "StreamedVersion", "manifest", "read_manifest", "version_payloads"]
