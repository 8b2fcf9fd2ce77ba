"""Store, whatever the transport: :func:`receive_store` writes a call's entries to its
:class:`~tannery_server.store_session.StoreSession`.

The call's gRPC messages are an adapter over the session's plain calls
(:func:`write_message`); on a data path they bring ``begin`` and ``commit``, and the
payloads come on the data connection (:mod:`.store_link`). The session is written on
worker threads, one step at a time (:class:`SessionSteps`), each message while the next
one is received: a message of many small whole entries (``StoreRequest.entries``) is one
step, not one per entry.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

from tannery_protocol.wire import StoreMessage, WholeEntry

from ..calllog import current_call
from ..failures import BadPayload, Malformed
from ..store_session import StoreSession
from ..workers import Workers, settle
from .plane import DataPlane
from .store_link import receive_over


class SessionSteps:
    """A Store session's steps on worker threads, one at a time: whatever ends the call waits
    for the step under way (it must be done with the session) before it aborts the session."""

    def __init__(self, workers: Workers, session: StoreSession) -> None:
        self.workers = workers
        self.session = session
        #: The step begun last (None before the first).
        self.pending: asyncio.Future | None = None

    def start(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        self.pending = self.workers.start(fn, *args)
        return self.pending

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A step, awaited; shielded: a cancelled call must not abandon a thread still writing the session."""
        return await asyncio.shield(self.start(fn, *args))

    async def abort(self) -> None:
        """Wait for the step under way, then remove what the session wrote."""
        await settle(self.pending)
        await self.workers.run(self.session.abort)


async def receive_store(plane: DataPlane, steps: SessionSteps, first: StoreMessage, requests: AsyncIterator,
                        context) -> None:
    """Every entry of a Store, from its first message (``begin``) to its last (``commit``),
    written to the session on the transport the call asks for; the archive is not committed
    yet (:meth:`StoreSession.finish`)."""
    session = steps.session
    transport = plane.transport(context)
    await steps.run(session.check_existing)
    # Each message is written by a worker thread while the next one is received.
    pending = steps.start(write_message, session, first, True)
    if transport is not None:
        # The payloads come on the data connection; the call brings begin and commit.
        await asyncio.shield(pending)
        await plane.over_link(transport, context, receive_over, session, start=steps.start)
        current_call().note("data_bytes", session.bytes_received)
    messages = aiter(requests)
    # Compared with an archive there, any message may be refused: say so at once.
    watch = session.existing is not None
    while (message := await _next_request(messages, pending, watch)) is not None:
        whole = await asyncio.shield(pending)
        pending = steps.start(write_message, session, message, False, whole)
    await asyncio.shield(pending)


def write_message(session: StoreSession, message: StoreMessage, first: bool = False,
                  after_whole: str | None = None) -> str | None:
    """One gRPC message of a Store, as the session's plain calls: its ``entry`` and ``chunk``,
    then each of its whole ``entries``. Returns the name of the whole entry it ended with
    (None: it did not), which the next message (``after_whole``) may not continue."""
    if session.committed:
        raise Malformed("a message after commit: commit must be the last message of Store")
    if message.commit is not None:
        if (message.begin is not None or message.entry or message.chunk.nbytes or message.sha256
                or message.entries):
            raise Malformed("commit must come alone, in the last message of Store")
        session.commit(message.commit.entries, message.commit.payload_bytes)
        return None
    if message.begin is not None and not first:
        raise Malformed("begin is allowed in the first message only")
    if message.entry:
        session.begin_entry(message.entry, message.sha256)
    elif message.sha256:
        raise Malformed("entry_sha256 without entry: a payload's SHA-256 comes with its entry's name")
    elif after_whole is not None and message.chunk.nbytes:
        raise BadPayload(f"entry {after_whole!r}: {message.chunk.nbytes} more bytes after it came whole "
                         "(StoreRequest.entries): a chunk continues only an entry sent by entry and chunk")
    session.write(message.chunk)
    return _write_whole(session, message.entries) if message.entries else None


def _write_whole(session: StoreSession, entries: list[WholeEntry]) -> str:
    """The whole entries of one message, in order; the name of the last."""
    if not session.config.batched_entries:
        raise Malformed(f"StoreRequest.entries ({len(entries)} entries, the first {entries[0].name!r}): this "
                        "server was started with batched entries off (--batched-entries); send each entry "
                        "with entry and chunk")
    for whole in entries:
        if not whole.payload.nbytes:
            raise BadPayload(f"entry {whole.name!r} came in StoreRequest.entries without a payload")
        session.begin_entry(whole.name, whole.sha256)
        session.write(whole.payload)
    return entries[-1].name


async def _next_request(messages: AsyncIterator, pending: asyncio.Future, watch: bool) -> Any:
    """The call's next request (None at its end), received while a worker thread writes the one
    before (``pending``). With ``watch``, a refusal of that one is raised as soon as it comes,
    without waiting for the next request (a client whose entry is refused at its name or its
    digest hears it before it sends the payload)."""
    if not watch or pending.done():
        return await anext(messages, None)
    receiving = asyncio.ensure_future(anext(messages, None))
    try:
        await asyncio.wait((receiving, pending), return_when=asyncio.FIRST_COMPLETED)
        if not receiving.done() and not pending.cancelled() and pending.exception() is not None:
            raise pending.exception()
        return await receiving
    finally:
        if not receiving.done():
            receiving.cancel()
