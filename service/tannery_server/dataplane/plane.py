"""Which transport a call's bytes take, and the data connection that carries them.

A call asks for a data path in its metadata (``tannery-transport``); gRPC otherwise. The
one refusal of a transport this server does not offer is :meth:`DataPlane.transport`'s.
A call on a data path sends its ticket in its initial metadata, waits for the client's
connection (:meth:`DataPlane.link`) and moves its bytes on a worker thread
(:meth:`DataPlane.over_link`).
"""

from __future__ import annotations

import asyncio
import traceback
from typing import Any, Callable, Sequence

from tannery_protocol.datalink import DATA_TRANSPORTS, TICKET_KEY, TRANSPORT_KEY, Link

from ..calllog import current_call
from ..failures import Cancelled, Failure, Malformed, Mismatch
from ..workers import Workers, settle
from .links import LINK_ERRORS, fail, link_failure
from .listeners import DataPaths


class DataPathOff(Failure):
    """A call asked for a data path this server does not offer."""

    code = Mismatch.code  # FAILED_PRECONDITION: the server's settings, not the request, say no


#: The setting that turns each data path off.
_SETTINGS = {"local": "--socket / TANNERY_SOCKET", "tcp": "--data-port / TANNERY_DATA_PORT"}


class DataPlane:
    """The data paths of one service (``paths``; None: gRPC only) and the threads its transfers run on."""

    def __init__(self, paths: DataPaths | None, workers: Workers, service: str = "",
                 offered: tuple[str, ...] = DATA_TRANSPORTS,
                 failure_of: Callable[[BaseException], BaseException] = lambda exc: exc) -> None:
        self.paths = paths
        self.workers = workers
        #: The failure (with its status) a transfer's exception stands for: the servicer's
        #: mapping of storage errors, so that the peer's failure frame says what the status says.
        self.failure_of = failure_of
        #: What the service is called in a refusal ("channels"; empty: the archives).
        self.service = service
        #: The data paths the service takes at all.
        self.offered = offered

    def transport(self, context) -> str | None:
        """The data path a call asks for (None: the gRPC stream), noted in its log line;
        DataPathOff when this server does not offer it, Malformed for an unknown one."""
        transport = requested_transport(context)
        if transport is None:
            return None
        current_call().note("transport", transport)
        if transport not in self.offered:
            why = f"{self.service} take the {' or '.join(self.offered)} data path or gRPC"
        elif self.paths is None:
            why = "it serves gRPC only"
        elif not self.paths.offers(transport):
            why = f"{_SETTINGS[transport]} is off"
        else:
            return transport
        for_service = f" for {self.service}" if self.service else ""
        raise DataPathOff(f"this server offers no {transport} data path{for_service} ({why}): ask for transport "
                          "'auto' or 'grpc'")

    async def link(self, transport: str, context, metadata: Sequence[tuple[str, str]] = ()) -> Link:
        """The call's ticket sent in its initial metadata (with ``metadata``), its data connection
        once the client opens it."""
        assert self.paths is not None
        ticket = self.paths.ticket(transport)
        try:
            await context.send_initial_metadata(((TICKET_KEY, ticket.hex), *metadata))
            return await ticket.connection()
        finally:
            ticket.withdraw()

    async def over_link(self, transport: str, context, move: Callable[..., Any], *args: Any,
                        start: Callable[..., asyncio.Future] | None = None,
                        metadata: Sequence[tuple[str, str]] = ()) -> Any:
        """Give the call a ticket (in initial metadata with ``metadata``), wait for its data
        connection, run ``move(link, *args)`` on a worker thread (through ``start``, that a
        caller may track it: a Store's session steps). A cancelled call breaks the connection
        and waits for the thread."""
        link = await self.link(transport, context, metadata)
        job = (start or self.workers.start)(move, link, *args)
        try:
            return await asyncio.shield(job)
        except BaseException as exc:
            if isinstance(exc, LINK_ERRORS):  # the connection's, not the storage's: no "storage error"
                failure: BaseException = link_failure(transport, exc)
            else:
                cancelled = isinstance(exc, asyncio.CancelledError)
                failure = Cancelled("the call was cancelled") if cancelled else self.failure_of(exc)
            fail(link, failure)
            await asyncio.shield(settle(job))
            # The transfer's frames hold its buffers (mapped memory files, receive windows):
            # let them go now, not when gRPC drops the aborted call (a dead client's, later).
            traceback.clear_frames(exc.__traceback__)
            if isinstance(exc, LINK_ERRORS):
                raise failure from None
            raise
        finally:
            link.close()


def requested_transport(context) -> str | None:
    """The data path a call's metadata asks for, None for the gRPC stream; Malformed for an unknown one."""
    for key, value in context.invocation_metadata() or ():
        if key == TRANSPORT_KEY:
            if value not in DATA_TRANSPORTS:
                raise Malformed(f"{TRANSPORT_KEY} {value!r} is not one of {', '.join(DATA_TRANSPORTS)} (leave it out "
                                "for the gRPC stream)")
            return value
    return None
