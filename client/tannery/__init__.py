"""tannery: store, serve and stream tensors as tannic payloads.

The names below load their modules on first use, so that ``import tannery_protocol.codec``
(what the server does) never imports torch. Note that ``tannery.torch`` is a
submodule; this package never binds the name ``torch`` itself.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "FormatError": "tannery_protocol.errors",
    "ArchiveError": "tannery_protocol.errors",
    "ServiceError": "tannery_protocol.errors",
    "NotFound": "tannery_protocol.errors",
    "AlreadyExists": "tannery_protocol.errors",
    "AliasError": "tannery_protocol.errors",
    "InvalidArgument": "tannery_protocol.errors",
    "ResourceExhausted": "tannery_protocol.errors",
    "PermissionDenied": "tannery_protocol.errors",
    "Unauthenticated": "tannery_protocol.errors",
    "Unavailable": "tannery_protocol.errors",
    "DataLoss": "tannery_protocol.errors",
    "Cancelled": "tannery_protocol.errors",
    "Archive": "tannery.archive",
    "TensorInfo": "tannery.archive",
    "save_safetensors": "tannery.formats.files",
    "load_safetensors": "tannery.formats.files",
    "save_tannic": "tannery.formats.files",
    "load_tannic": "tannery.formats.files",
    "Client": "tannery.client",
    "Subscription": "tannery.client",
    "RemoteArchive": "tannery.remote",
    "TLS": "tannery.rpc.connection",
    "ArchiveInfo": "tannery.records",
    "ArchiveDescription": "tannery.records",
    "EntryDescription": "tannery.records",
    "Alias": "tannery.records",
    "Tagged": "tannery.records",
    "Pruned": "tannery.records",
    "TensorPiece": "tannery.dataplane.received",
    "ArchiveDiff": "tannery.calls.diff",
    "EntryChange": "tannery.calls.diff",
    "ValueChange": "tannery.calls.diff",
    "AliasMove": "tannery.calls.history",
}


#: Submodules reachable as attributes without importing them first (``tannery.aio.Client``).
_SUBMODULES = {"aio", "dcp", "weights"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tannery' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)


__all__ = sorted(_EXPORTS)
