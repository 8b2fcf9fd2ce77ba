"""Modules imported on first use: torch (and what needs it) costs over a second to import.

``torch = lazy_module("torch")`` binds a stand-in that imports torch the first time one of
its attributes is read (``torch.Tensor``, ``torch.frombuffer``), so a module can name torch
throughout and still be imported without it: ``tannery ls`` and the other commands that
move no tensors never pay for torch, and torch is imported where a tensor is made. Type
annotations cost nothing (every module has ``from __future__ import annotations``).

The stand-in never puts anything in ``sys.modules``: until first use, ``"torch" in
sys.modules`` stays False, and a missing package raises its ModuleNotFoundError there.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    """A module imported by the first read of one of its attributes; later reads go straight to it."""

    __slots__ = ("_name", "_module")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def _load(self) -> ModuleType:
        """The module, imported now if it was not yet (ModuleNotFoundError when it is not installed)."""
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return module

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._load(), attribute)

    def __dir__(self) -> list[str]:
        return dir(self._load())

    def __repr__(self) -> str:
        state = "imported" if self._module is not None else "not imported yet"
        return f"<lazy module {self._name!r} ({state})>"


def lazy_module(name: str) -> Any:
    """A stand-in for module ``name`` that imports it on first use (see :class:`LazyModule`)."""
    return LazyModule(name)


__all__ = ["LazyModule", "lazy_module"]
