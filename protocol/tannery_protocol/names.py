"""Entry names of archives: dotted paths and which names a prefix owns. Torch-free.

The client (``tannery.archive``) and the server apply the same two rules, so they live
here, in a module the server can import without torch:

- a value's leaf is named by its path, keys and indices joined with dots, under a
  prefix; an empty prefix is left out with its dot (:func:`join`);
- under a prefix ``p`` the entries that ``p`` owns are ``p`` itself and the names that
  start with ``p`` and a dot; an empty prefix owns every name (:func:`owns`).

A message about a name that is not there suggests the close ones (:func:`did_you_mean`).
"""

from __future__ import annotations

from typing import Iterable

SEPARATOR = "."


def join(prefix: str, *parts: str) -> str:
    """``parts`` joined with dots under ``prefix``: ``join("model", "blocks", "0")`` is ``"model.blocks.0"``.

    An empty prefix is left out with its dot, so ``join("", "w")`` is ``"w"``; with
    no parts the name is the prefix itself (``""`` when both are empty).
    """
    return SEPARATOR.join((prefix, *parts) if prefix else parts)


def owns(prefix: str, name: str) -> bool:
    """Whether ``prefix`` owns the entry ``name``: it is the prefix, or starts with it and a dot.

    ``owns("model", "model.w")`` and ``owns("model", "model")`` are true,
    ``owns("model", "models.w")`` is false, and ``owns("", name)`` is always true.
    """
    if not prefix:
        return True
    return name == prefix or (name.startswith(prefix) and name[len(prefix) : len(prefix) + 1] == SEPARATOR)


def owned(prefix: str, names: Iterable[str]) -> list[str]:
    """The names of ``names`` that ``prefix`` owns, in their order."""
    return [name for name in names if owns(prefix, name)]


def did_you_mean(name: str, names: Iterable[str]) -> str:
    """``"; did you mean 'a', 'b'?"`` with up to three names close to ``name`` (difflib's
    closeness), ``""`` when none is: what a message about a missing name ends with, in the
    command and in the library alike."""
    import difflib

    close = difflib.get_close_matches(name, list(names), n=3)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""


__all__ = ["SEPARATOR", "did_you_mean", "join", "owned", "owns"]
