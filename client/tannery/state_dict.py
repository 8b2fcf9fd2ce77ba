"""``load_state_dict``'s plan: a module's state_dict checked against an archive's description
before anything is fetched (what to fetch, what is missing, what is unexpected)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tannery_protocol._lazy import lazy_module
from tannery_protocol.codec import format_shape
from tannery_protocol.errors import ArchiveError
from tannery_protocol.names import join, owned
from .records import ArchiveDescription
from .requests import entry_ask
from tannery_protocol.v1 import archives_pb2

torch = lazy_module("torch")


@dataclass
class StateDictPlan:
    """What ``load_state_dict`` fetches (archive entry names, by the module key they fill)
    and which keys are missing from the archive or unexpected in it."""

    fetch: dict[str, str]
    missing: list[str]
    unexpected: list[str]
    #: The asks of the entries to fetch, in ``fetch``'s order (checked again by the server).
    asks: list[archives_pb2.EntryAsk]

    def load(self, module: torch.nn.Module, tensors: Sequence[torch.Tensor], strict: bool) -> Any:
        """Copy the fetched tensors into ``module``; torch's (missing_keys, unexpected_keys)."""
        state = dict(zip(self.fetch.values(), tensors))
        result = module.load_state_dict(state, strict=strict)
        return result._replace(missing_keys=list(self.missing), unexpected_keys=list(self.unexpected))


def _names_text(names: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > limit else shown


def plan_state_dict(module: torch.nn.Module, description: ArchiveDescription, prefix: str, strict: bool
                    ) -> StateDictPlan:
    """Check a module's state_dict against an archive before anything is fetched.

    As torch's ``load_state_dict``: with ``strict``, every key of the module must have an
    entry under ``prefix`` and every entry there a key; a shape that differs is an error
    either way; dtypes may differ (torch casts when it copies). ArchiveError naming the
    entries otherwise.
    """
    where = "Client.load_state_dict"
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{where}: {type(module).__name__} is not a torch.nn.Module")
    if not isinstance(prefix, str):
        raise TypeError(f"{where}: prefix is a str, not {type(prefix).__name__}")
    entries = {entry.name: entry for entry in description}
    state = module.state_dict()
    fetch: dict[str, str] = {}
    missing: list[str] = []
    problems: list[str] = []
    for key, tensor in state.items():
        name = join(prefix, key)
        entry = entries.get(name)
        if entry is None:
            missing.append(key)
        elif entry.shape != tuple(tensor.shape):
            problems.append(
                f"{name}: shape {format_shape(entry.shape)} in the archive, {format_shape(tensor.shape)} in the module"
            )
        else:
            fetch[name] = key
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
            found.append(f"no entries for the module's keys {_names_text(missing)}")
        if unexpected:
            found.append(f"entries the module has no key for: {_names_text(unexpected)}")
        raise ArchiveError(f"{where}: {under}: " + "; ".join(found) + " (strict=False to load the rest)")
    return StateDictPlan(fetch, missing, unexpected, [entry_ask(entries[name]) for name in fetch])


__all__ = ["StateDictPlan", "plan_state_dict"]
