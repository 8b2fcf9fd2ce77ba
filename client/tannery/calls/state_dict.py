"""Where fetched tensors go: a module's (or a state dict's) tensors checked against an
archive's description before anything is fetched.

:func:`plan_targets` pairs each key of the target with the entry that fills it and says what
to fetch (only those entries; only a shard's rows), what is missing and what is unexpected,
and refuses a version that does not fit, naming the entry, before a byte moves. Both
``Client.load_state_dict`` and the weight followers (:mod:`tannery.weights`) use it.

Tied parameters (one tensor under two keys, as transformers ties ``lm_head.weight`` to the
embeddings, and ``save_pretrained`` stores it once) are filled once, from whichever of
their keys the archive holds, and never reported missing (as ``safetensors.torch.load_model``
does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tannery_protocol._lazy import lazy_module
from tannery_protocol.codec import format_shape
from tannery_protocol.errors import ArchiveError
from tannery_protocol.names import join, owned
from tannery.records import ArchiveDescription, EntryDescription
from tannery.rpc.requests import entry_ask
from tannery_protocol.v1 import archives_pb2

torch = lazy_module("torch")

#: Rows of a parameter a target holds (tensor parallel): key -> (start, stop) of its first dimension.
Rows = Mapping[str, tuple[int, int]]


@dataclass
class Slot:
    """One tensor of the target and the entry that fills it."""

    entry: str
    key: str
    tensor: Any  # torch.Tensor: the target's own (copied into in place)
    #: Keys tied to ``key`` (the same tensor), filled by the same copy.
    tied: list[str] = field(default_factory=list)
    #: The rows of the entry the target holds (None: all of it).
    rows: tuple[int, int] | None = None


@dataclass
class TargetPlan:
    """What to fetch for a target (``slots``, with their ``asks`` in the same order) and which of
    its keys the archive lacks (``missing``) or which entries it has no key for (``unexpected``)."""

    slots: list[Slot]
    missing: list[str]
    unexpected: list[str]
    asks: list[archives_pb2.EntryAsk]

    @property
    def nbytes(self) -> int:
        """The tensor bytes the target receives (each tied tensor once)."""
        return sum(slot.tensor.numel() * slot.tensor.element_size() for slot in self.slots)

    def apply(self, tensors: Sequence[Any]) -> None:
        """Copy the fetched tensors (``asks``' order) into the target's own tensors, in place
        (casting to their dtype); nothing is allocated for the target."""
        with torch.no_grad():
            for slot, tensor in zip(self.slots, tensors, strict=True):
                slot.tensor.copy_(tensor)

    def apply_whole(self, tensors: Mapping[str, Any]) -> None:
        """:meth:`apply` of whole entries by name (a streamed version): a shard takes its rows."""
        self.apply([tensors[slot.entry] if slot.rows is None else tensors[slot.entry][slot.rows[0]:slot.rows[1]]
                    for slot in self.slots])

    def load(self, module: Any, tensors: Sequence[Any], strict: bool) -> Any:
        """``module.load_state_dict`` of the fetched tensors (tied keys given theirs, so none is
        missing); torch's (missing_keys, unexpected_keys) as the plan found them."""
        state = {}
        for slot, tensor in zip(self.slots, tensors, strict=True):
            state[slot.key] = tensor
            state.update((key, tensor) for key in slot.tied)
        result = module.load_state_dict(state, strict=strict)
        return result._replace(missing_keys=list(self.missing), unexpected_keys=list(self.unexpected))


def target_tensors(target: Any, where: str) -> dict[str, Any]:
    """The tensors of ``target`` by key: an ``nn.Module``'s state_dict (its tensors' own
    storage) or a mapping of names to tensors; TypeError naming what it is otherwise."""
    if isinstance(target, torch.nn.Module):
        return target.state_dict()
    if isinstance(target, Mapping):
        for key, value in target.items():
            if not isinstance(key, str) or not isinstance(value, torch.Tensor):
                raise TypeError(f"{where}: a state dict maps str to torch.Tensor, not {type(key).__name__} to "
                                f"{type(value).__name__} (at {key!r})")
        return dict(target)
    raise TypeError(f"{where}: {type(target).__name__} is neither a torch.nn.Module nor a state dict")


def _ties(state: Mapping[str, Any]) -> dict[str, list[str]]:
    """Keys that are the same tensor (same memory, shape, strides and dtype), each group by its
    first key in ``state``'s order."""
    groups: dict[tuple, list[str]] = {}
    for key, tensor in state.items():
        if tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        identity = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                    tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        groups.setdefault(identity, []).append(key)
    return {keys[0]: keys[1:] for keys in groups.values() if len(keys) > 1}


def _dtype_problem(entry: EntryDescription, tensor: Any, noun: str) -> str | None:
    """Why ``entry`` cannot be copied into ``tensor`` (None when it can): floats cast among
    themselves; any other dtype must match, since a cast would change what the numbers mean."""
    wanted = str(tensor.dtype).removeprefix("torch.")
    if entry.dtype == wanted:
        return None
    stored = getattr(torch, entry.dtype, None)
    if isinstance(stored, torch.dtype) and stored.is_floating_point and tensor.dtype.is_floating_point:
        return None
    return f"{entry.name}: dtype {entry.dtype} in the archive cannot be cast to the {noun}'s {wanted}"


def _shape_problem(entry: EntryDescription, tensor: Any, rows: tuple[int, int] | None, noun: str) -> str | None:
    """Why ``entry`` (or its ``rows``) does not fit ``tensor``'s shape (None when it does)."""
    shape = tuple(tensor.shape)
    if rows is None:
        if entry.shape == shape:
            return None
        return f"{entry.name}: shape {format_shape(entry.shape)} in the archive, {format_shape(shape)} in the {noun}"
    start, stop = rows
    if not entry.shape or not 0 <= start < stop <= entry.shape[0]:
        return (f"{entry.name}: rows [{start}, {stop}) asked of shape {format_shape(entry.shape)} in the archive "
                f"(a row range within its first dimension)")
    if (stop - start, *entry.shape[1:]) != shape:
        return (f"{entry.name}: rows [{start}, {stop}) of shape {format_shape(entry.shape)} are "
                f"{format_shape((stop - start, *entry.shape[1:]))}, the {noun}'s is {format_shape(shape)}")
    return None


def names_text(names: Sequence[str], limit: int = 10) -> str:
    """Names quoted and joined, the first ``limit`` of them and a count beyond."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > limit else shown


def plan_targets(state: Mapping[str, Any], description: ArchiveDescription, prefix: str = "", *,
                 strict: bool = True, rows: Rows | None = None, check_dtypes: bool = False,
                 where: str = "Client.load_state_dict", noun: str = "module") -> TargetPlan:
    """Pair the tensors of ``state`` with the entries of an archive under ``prefix``.

    Every key needs an entry ``prefix.key`` of its shape (or, for a key in ``rows``, of which
    those rows have its shape); with ``strict``, every key must have an entry and every entry
    under ``prefix`` a key; with ``check_dtypes``, an entry must have the key's dtype or both
    must be floats (the copy casts). Tied keys are filled once. ArchiveError naming the
    entries, the shapes and the dtypes otherwise (``noun`` names the target in it): nothing
    has been fetched then.
    """
    if not isinstance(prefix, str):
        raise TypeError(f"{where}: prefix is a str, not {type(prefix).__name__}")
    rows = dict(rows or {})
    if unknown := sorted(set(rows) - set(state)):
        raise KeyError(f"{where}: rows given for keys the {noun} does not have: {names_text(unknown)}")
    entries = {entry.name: entry for entry in description}
    ties = _ties(state)
    tied_away = {key for keys in ties.values() for key in keys}
    slots: list[Slot] = []
    missing: list[str] = []
    problems: list[str] = []
    for key, tensor in state.items():
        if key in tied_away:
            continue
        group = [key, *ties.get(key, ())]
        held = [k for k in group if join(prefix, k) in entries]
        if not held:
            missing += group
            continue
        source = held[0]
        entry = entries[join(prefix, source)]
        problem = _shape_problem(entry, tensor, rows.get(source), noun)
        if problem is None and check_dtypes:
            problem = _dtype_problem(entry, tensor, noun)
        if problem is not None:
            problems.append(problem)
        else:
            slots.append(Slot(entry.name, source, tensor, [k for k in group if k != source], rows.get(source)))
    known = {join(prefix, key) for key in state}
    unexpected = [
        name[len(prefix) + 1 :] if prefix and name != prefix else name
        for name in owned(prefix, entries) if name not in known
    ]
    under = f"archive {description.name!r}" + (f" under prefix {prefix!r}" if prefix else "")
    if problems:
        raise ArchiveError(f"{where}: {under}: " + "; ".join(problems))
    if strict and (missing or unexpected):
        found = []
        if missing:
            found.append(f"no entries for the {noun}'s keys {names_text(missing)}")
        if unexpected:
            found.append(f"entries the {noun} has no key for: {names_text(unexpected)}")
        raise ArchiveError(f"{where}: {under}: " + "; ".join(found) + " (strict=False to load the rest)")
    asks = [entry_ask(entries[slot.entry], rows=slot.rows) for slot in slots]
    return TargetPlan(slots, missing, unexpected, asks)


def plan_state_dict(module: Any, description: ArchiveDescription, prefix: str, strict: bool) -> TargetPlan:
    """``load_state_dict``'s plan: as torch's, with strict checks of keys and shapes (dtypes may
    differ: torch casts when it copies), and tied parameters filled once, never missing."""
    where = "Client.load_state_dict"
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{where}: {type(module).__name__} is not a torch.nn.Module")
    return plan_targets(module.state_dict(), description, prefix, strict=strict, where=where)


__all__ = ["Rows", "Slot", "TargetPlan", "names_text", "plan_state_dict", "plan_targets", "target_tensors"]
