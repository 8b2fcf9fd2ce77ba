"""What each call asks, shared by both clients: the RPC table and the requests.

:class:`Methods` is the table of both services' calls on a channel, derived from the
generated descriptors (with the hand-written codecs of the calls that carry tensors). The rest
builds the requests of Describe, Fetch, Union and List. The message streams of a Store or a
Publish, which carry tensor bytes, are the data plane's (:mod:`tannery.dataplane.messages`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any, Callable, Optional

from tannery_protocol import wire
from tannery.records import EntryDescription
from tannery_protocol.v1 import archives_pb2, channels_pb2

#: Called with the number of tensor bytes (payload bytes) just sent or received.
Progress = Optional[Callable[[int], Any]]


# -- methods ---------------------------------------------------------------------------------


def _encoded(message: bytes) -> bytes:
    return message


#: The (de)serializers written by hand, by RPC: Store and Publish send messages encoded by
#: :mod:`tannery_protocol.wire`; Fetch and Subscribe answers are decoded as views of the received bytes.
_HAND_WRITTEN: dict[str, dict[str, Callable]] = {
    "Store": {"request_serializer": _encoded},
    "Fetch": {"response_deserializer": wire.parse_fetch_response},
    "Publish": {"request_serializer": _encoded},
    "Subscribe": {"response_deserializer": wire.parse_subscribe_response},
}

_CALL_KINDS = {(False, False): "unary_unary", (False, True): "unary_stream",
               (True, False): "stream_unary", (True, True): "stream_stream"}

#: The services whose calls :class:`Methods` holds: generated module, service name.
_SERVICES: tuple[tuple[ModuleType, str], ...] = ((archives_pb2, "Archives"), (channels_pb2, "Channels"))


def _snake_case(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


class Methods:
    """The calls of both services on a channel, sync or aio (the same factory methods): one
    attribute per RPC (``store``, ``fetch``, ..., ``subscribe``), derived from the generated
    descriptors, with the generated serializers but for :data:`_HAND_WRITTEN`."""

    def __init__(self, channel: Any) -> None:
        for module, service in _SERVICES:
            descriptor = module.DESCRIPTOR.services_by_name[service]
            for method in descriptor.methods:
                options = {
                    "request_serializer": getattr(module, method.input_type.name).SerializeToString,
                    "response_deserializer": getattr(module, method.output_type.name).FromString,
                    **_HAND_WRITTEN.get(method.name, {}),
                }
                factory = getattr(channel, _CALL_KINDS[method.client_streaming, method.server_streaming])
                setattr(self, _snake_case(method.name), factory(f"/{descriptor.full_name}/{method.name}", **options))


# -- requests --------------------------------------------------------------------------------


def entry_ask(entry: EntryDescription, cast: str | None = None, rows: tuple[int, int] | None = None
              ) -> archives_pb2.EntryAsk:
    """An ask for ``entry`` that the server checks against what the client saw (the archive
    may have been replaced since it was described)."""
    ask = archives_pb2.EntryAsk(name=entry.name, shape=archives_pb2.Shape(dims=entry.shape), dtype=entry.dtype)
    if cast:
        ask.cast = cast
    if rows is not None:
        ask.rows.start, ask.rows.stop = rows
    return ask


def fetch_request(archive: str, names: Iterable[str] | None = None, prefix: str | None = None
                  ) -> archives_pb2.FetchRequest:
    """Entries by name (in that order), or those a prefix owns, or all of them."""
    if names is not None and prefix is not None:
        raise ValueError("Client.fetch: give names or a prefix, not both")
    if isinstance(names, str):
        raise TypeError("Client.fetch: names is a list of entry names, not one str")
    request = archives_pb2.FetchRequest(archive=archive, prefix=prefix or "")
    if names is not None:
        names = list(names)
        if not names:
            raise ValueError("Client.fetch: an empty list of names (give None for every entry)")
        request.entries.extend(archives_pb2.EntryAsk(name=n) for n in names)
    return request


def describe_request(archive: str, names: Iterable[str] | None = None) -> archives_pb2.DescribeRequest:
    """A Describe of every entry (``names`` None), of the entries named, or of none (an empty
    ``names``: the archive's info and metadata only)."""
    if isinstance(names, str):
        raise TypeError("Client.describe: names is a list of entry names, not one str")
    request = archives_pb2.DescribeRequest(archive=archive)
    if names is not None:
        request.names.extend(names)
        request.no_entries = not request.names
    return request


def check_metadata(what: str, metadata: Mapping[str, str] | None) -> dict[str, str]:
    """An archive's metadata as the request carries it (the server checks its bounds)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"{what}: metadata is a mapping of str to str, not {type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"{what}: metadata maps str to str; {key!r}: {value!r} is not")
    return dict(metadata)


def union_request(target: str, sources: Mapping[str, str] | Sequence[str], replace: bool,
                  metadata: Mapping[str, str] | None = None) -> archives_pb2.UnionRequest:
    """Sources as a mapping of prefix to archive name, or a list of archive names (no prefixes)."""
    if isinstance(sources, str):
        raise TypeError("Client.union: sources is a list of archive names or a mapping of prefix to name, not a str")
    if isinstance(sources, Mapping):
        pairs = [(archive, prefix) for prefix, archive in sources.items()]
    else:
        pairs = [(archive, "") for archive in sources]
    if not pairs:
        raise ValueError("Client.union: no sources")
    return archives_pb2.UnionRequest(
        target=target, replace=replace, metadata=check_metadata("Client.union", metadata),
        sources=[archives_pb2.UnionSource(archive=a, prefix=p) for a, p in pairs],
    )


#: The largest page a server sends (List and ListAliases): the clients ask for it, so listing
#: 50,000 archives takes 50 round trips, not the 500 of the server's default page of 100.
LARGEST_PAGE = 1000


def list_request(prefix: str, page_token: str, page_size: int = LARGEST_PAGE) -> archives_pb2.ListRequest:
    if not isinstance(prefix, str):
        raise TypeError(f"Client.list: prefix is a str, not {type(prefix).__name__}")
    return archives_pb2.ListRequest(prefix=prefix, page_token=page_token, page_size=page_size)


def list_limit(limit: object) -> int | None:
    """``Client.list``'s ``limit``: None (every archive) or a count of 1 or more; TypeError or
    ValueError naming the remedy."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"Client.list: limit is a whole number of archives (or None for all), not "
                        f"{type(limit).__name__}")
    if limit < 1:
        raise ValueError(f"Client.list: limit {limit} lists nothing: give 1 or more, or None for every archive")
    return limit


def aliases_request(prefix: str, archive: str | None, archive_prefix: str | None,
                    page_token: str) -> archives_pb2.ListAliasesRequest:
    for what, value in (("prefix", prefix), ("archive", archive), ("archive_prefix", archive_prefix)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"Client.aliases: {what} is a str, not {type(value).__name__}")
    return archives_pb2.ListAliasesRequest(prefix=prefix, archive=archive or "", archive_prefix=archive_prefix or "",
                                           page_size=LARGEST_PAGE, page_token=page_token)


__all__ = ["LARGEST_PAGE", "Methods", "Progress", "aliases_request", "check_metadata", "describe_request", "entry_ask", "fetch_request", "list_limit", "list_request",
           "union_request"]
