"""``tannery.aio.Client``: the asyncio client, with the methods of ``tannery.Client``, awaitable.

::

    async with tannery.aio.Client("localhost:50051") as client:
        await client.store("resnet", model)
        weights = await client.archive("resnet")
        w = await weights.tensor("fc.weight", [10, 512], torch.float32)
        async with client.subscribe("frames") as frames:
            async for tensor in frames:
                ...

Create it inside the event loop that uses it. What is sent is built by :mod:`tannery.requests`
and what is received read by :mod:`tannery.readers`, as for the synchronous client; this module
only waits differently.

A refused Store or Publish reports the server's status: grpc.aio may replace it with
INTERNAL ("Failed execute_batch") when the server ends a client-streaming call while the
client is still writing (grpc/grpc#36066), so :class:`_FinalStatus` keeps the status the
call first ended with.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Awaitable, Coroutine, TypeVar

import grpc

from .archive import Archive, MemoryArchive
from .readers import EntryReader, PayloadReader, PieceReader, TensorPiece, check_fetched
from .records import ArchiveDescription, ArchiveInfo, Deleted, Published
from .requests import (
    Methods, Progress, archive_to_store, check_tensors, fetch_request, list_request, publish_messages, store_entries,
    store_begin, store_messages, union_request,
)
from .state_dict import plan_state_dict
from tannery_protocol import errors
from .connection import Connection, TLSLike, rpc_error, service_error
from tannery_protocol.datalink import TRANSPORT_KEY, LinkError, PeerFailed
from .remote import AsyncRemoteArchive
from .retries import RetryPolicy, call_name, resumed_request
from .transports import (
    STATUS_WAIT, Route, check_transport, choose, connect_call, link_failure, next_published, publish_over,
    receive_fetch, send_store, ticket_of,
)
from tannery_protocol.v1 import archives_pb2, channels_pb2
from tannery_protocol.wire import ABANDONED, encode_publish_request, encode_store_commit, encode_store_request

if TYPE_CHECKING:  # torch is imported where a tensor is made (tannery.readers, tannery.requests)
    import torch

T = TypeVar("T")


def _result_now(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """The result of a coroutine that completes without waiting (a finished call's status)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the call's status is not there yet")


class _FinalStatus:
    """The status a call ended with, taken the moment it ended.

    grpc.aio overwrites a call's status with INTERNAL when a write fails after the server
    ended the call (grpc/grpc#36066); the server's status, seen first, is kept here.
    """

    def __init__(self, call: grpc.aio.Call) -> None:
        self.status: tuple[grpc.StatusCode, str, Any] | None = None
        call.add_done_callback(self._ended)

    def _ended(self, call: grpc.aio.Call) -> None:
        try:
            self.status = (_result_now(call.code()), _result_now(call.details()), _result_now(call.trailing_metadata()))
        except RuntimeError:
            self.status = None

    def error(self, error: grpc.aio.AioRpcError, target: str) -> Exception:
        if self.status is not None and self.status[0] is not grpc.StatusCode.INTERNAL:
            return service_error(*self.status, target)
        return rpc_error(error, target)


class Client:
    """An asyncio connection to a tannery server: ``tannery.Client``'s methods, awaitable.

    Arguments as for :class:`tannery.Client`. Use ``async with`` or ``await close()``. On a
    data path (``transport``), the bytes move on worker threads (``asyncio.to_thread``), and
    a Store's ``progress`` is called from them.
    """

    def __init__(self, target: str | None = None, *, token: str | None = None, tls: TLSLike = None,
                 chunk_size: int | None = None, timeout: float | None = None, transport: str | None = None,
                 retries: int | None = None) -> None:
        self._transport = check_transport(transport)
        self._retries = RetryPolicy.resolve(retries)
        self._connection = Connection(target, token=token, tls=tls, chunk_size=chunk_size, timeout=timeout)
        self._channel = self._connection.aio_channel()
        self._methods = Methods(self._channel)
        self._route: Route | None = None
        self._route_known = False
        self._offered: archives_pb2.DataPathsResponse | None = None
        self._offered_known = False
        self._route_lock: asyncio.Lock | None = None

    @property
    def target(self) -> str:
        return self._connection.target

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"tannery.aio.Client({self._connection!r})"

    # -- plumbing ------------------------------------------------------------------------

    def _options(self, *, timeout: bool = True) -> dict[str, Any]:
        return {"metadata": self._connection.metadata, "timeout": self._connection.timeout if timeout else None}

    def _error(self, error: grpc.RpcError) -> Exception:
        return rpc_error(error, self._connection.target)

    async def _unary(self, method: Any, request: Any) -> Any:
        return await self._retrying(call_name(request), lambda retry: self._unary_once(method, request))

    async def _unary_once(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, **self._options())
        except grpc.RpcError as error:
            raise self._error(error) from None

    async def _retrying(self, what: str, attempt: Callable[[int], Awaitable[T]]) -> T:
        """As :meth:`tannery.Client._retrying`, waiting with asyncio."""
        retry = 0
        while True:
            try:
                return await attempt(retry)
            except errors.ServiceError as error:
                pause = self._retries.next_delay(retry, what, error)
            retry += 1
            await self._retry_after(pause)

    async def _retry_after(self, pause: float) -> None:
        """Wait, then forget what the server offered: a restarted one may offer other data paths."""
        await asyncio.sleep(pause)
        self._offered_known = self._route_known = False

    async def _send(self, method: Any, messages: Iterable[bytes] | AsyncIterable[bytes]) -> Any:
        """A client-streaming call: write ``messages``, then the server's answer or its status."""
        call = method(**self._options())
        final = _FinalStatus(call)
        try:
            ended = await _write_all(call, messages)
        except BaseException:
            call.cancel()  # the messages failed (or we were cancelled): the call ends, the error stands
            raise
        try:
            if not ended:
                await call.done_writing()
            return await call
        except grpc.aio.AioRpcError as error:
            raise final.error(error, self._connection.target) from None
        except asyncio.InvalidStateError:  # done_writing on a call that just ended
            try:
                return await call
            except grpc.aio.AioRpcError as error:
                raise final.error(error, self._connection.target) from None

    async def transport(self) -> str:
        """The transport Store and Fetch take: "local", "tcp" or "grpc" (settled now if it was not)."""
        route = await self._data_route()
        return route.kind if route is not None else "grpc"

    async def _data_paths(self) -> archives_pb2.DataPathsResponse | None:
        """As :meth:`tannery.Client._data_paths`: what the server offers, asked once."""
        if self._offered_known:
            return self._offered
        if self._route_lock is None:
            self._route_lock = asyncio.Lock()
        async with self._route_lock:
            if not self._offered_known:
                try:
                    self._offered = await self._methods.data_paths(archives_pb2.DataPathsRequest(),
                                                                   **self._options())
                except grpc.RpcError as error:
                    if error.code() is not grpc.StatusCode.UNIMPLEMENTED:
                        raise self._error(error) from None
                self._offered_known = True
        return self._offered

    async def _data_route(self) -> Route | None:
        """As :meth:`tannery.Client._data_route`: the data path, chosen once."""
        if self._transport == "grpc":
            return None
        if not self._route_known:
            offered = await self._data_paths()
            async with self._route_lock:
                if not self._route_known:
                    self._route = await asyncio.to_thread(choose, self._transport, offered, self.target,
                                                          self._connection.tls)
                    self._route_known = True
        return self._route

    async def _wants_digests(self) -> bool:
        """As :meth:`tannery.Client._wants_digests`."""
        try:
            offered = await self._data_paths()
        except errors.ServiceError:
            return False
        return offered is not None and offered.wants_digests

    def _over(self, route: Route) -> dict[str, Any]:
        return {"metadata": (*self._connection.metadata, (TRANSPORT_KEY, route.kind)),
                "timeout": self._connection.timeout}

    async def _broken(self, call: Any, exc: BaseException, route: Route) -> Exception:
        """The error of a call whose data connection broke: the call's own failure when it has one."""
        if not (isinstance(exc, PeerFailed) and exc.code == "PERMISSION_DENIED"):
            try:
                code = await asyncio.wait_for(call.code(), STATUS_WAIT)
            except asyncio.TimeoutError:
                code = None
            if code is not None and code is not grpc.StatusCode.OK:
                return service_error(code, await call.details(), await call.trailing_metadata(), self.target)
        return link_failure(exc, route)

    async def _entries(self, request: archives_pb2.FetchRequest, reader: EntryReader | PieceReader
                       ) -> AsyncIterator[Any]:
        """As :meth:`tannery.Client._entries`: resumed after the entries that came whole."""
        done: list[str] = []
        asked, retry = request, 0
        while True:
            try:
                async for item in self._entries_once(asked, reader):
                    whole = reader.whole(item)
                    if whole is not None:
                        done.append(whole)
                    yield item
                return
            except errors.ServiceError as error:
                pause = self._retries.next_delay(retry, f"Fetch of {request.archive!r}", error)
            retry += 1
            await self._retry_after(pause)
            reader.restart()
            listed = None if request.entries else [e.name for e in (await self.describe(request.archive)).entries]
            asked = resumed_request(request, done, listed)
            if asked is None:
                return

    async def _entries_once(self, request: archives_pb2.FetchRequest, reader: EntryReader | PieceReader
                            ) -> AsyncIterator[Any]:
        """One Fetch call's entries (:meth:`_entries`), on the data path or the gRPC stream."""
        route = await self._data_route()
        if route is not None:
            async for entry in self._entries_over(route, request, reader):
                yield entry
            return
        call = self._methods.fetch(request, **self._options())
        try:
            try:
                async for message in call:
                    for entry in reader.feed(message):
                        yield entry
            except grpc.RpcError as error:
                raise self._error(error) from None
            reader.close()
        finally:
            call.cancel()

    async def _entries_over(self, route: Route, request: archives_pb2.FetchRequest, reader: Any) -> AsyncIterator[Any]:
        """A Fetch checked over gRPC, its entries received on the data path (on a worker thread)."""
        call = self._methods.fetch(request, **self._over(route))
        link = None
        try:
            try:
                ticket = ticket_of(await call.initial_metadata())
                if ticket is None:  # the call failed before any byte: its status says why
                    async for _ in call:
                        pass
                    raise errors.ServiceError("the server answered a data-path Fetch without a ticket")
            except grpc.RpcError as error:
                raise self._error(error) from None
            # Unavailable at once when the connection cannot be made; the call is cancelled (finally).
            link = await asyncio.to_thread(connect_call, route, ticket)
            try:
                items = receive_fetch(link, pieces=reader.pieces, pool=reader.pool)
                while (item := await asyncio.to_thread(next, items, None)) is not None:
                    for entry in reader.arrived(item):
                        yield entry
            except (LinkError, OSError) as exc:
                raise await self._broken(call, exc, route) from None
            try:
                async for _ in call:  # the status: OK, or what stopped the transfer
                    pass
            except grpc.RpcError as error:
                raise self._error(error) from None
        finally:
            if link is not None:
                link.abort()  # a worker thread still reading returns at once
                link.close()
            call.cancel()

    async def _fetch(self, request: archives_pb2.FetchRequest, progress: Progress) -> list[tuple[str, torch.Tensor]]:
        return [entry async for entry in self._entries(request, EntryReader(progress))]

    def _transfer(self, archive: str, progress: Progress):
        async def transfer(asks: Sequence[archives_pb2.EntryAsk]) -> list[torch.Tensor]:
            got = await self._fetch(archives_pb2.FetchRequest(archive=archive, entries=asks), progress)
            return check_fetched([ask.name for ask in asks], got)

        return transfer

    # -- archives ------------------------------------------------------------------------

    async def store(self, name: str, value: Any, *, prefix: str = "", replace: bool = False,
                    progress: Progress = None, metadata: Mapping[str, str] | None = None,
                    skip_non_tensors: bool = False, allow_empty: bool = False) -> ArchiveInfo:
        """As :meth:`tannery.Client.store`."""
        archive, rest = archive_to_store(name, value, prefix, skip_non_tensors=skip_non_tensors,
                                         allow_empty=allow_empty)
        return await self._retrying(
            f"Store of {name!r}", lambda retry: self._store_once(name, archive, rest, replace, progress, metadata))

    async def _store_once(self, name: str, archive: Archive, rest: str, replace: bool, progress: Progress,
                          metadata: Mapping[str, str] | None) -> ArchiveInfo:
        """One Store call of the whole archive, on the data path or the gRPC stream."""
        route = await self._data_route()
        if route is not None:
            return await self._store_over(route, name, archive, rest, replace, progress, metadata)
        digests = await self._wants_digests()
        messages = store_messages(name, archive, rest, replace, self._connection.chunk_size, progress, metadata,
                                  digests)
        if digests:  # a message may wait for its entry's hash: not on the event loop
            messages = _made_in_thread(messages)
        return ArchiveInfo.of(await self._send(self._methods.store, messages))

    async def _store_over(self, route: Route, name: str, archive: Archive, prefix: str, replace: bool,
                          progress: Progress, metadata: Mapping[str, str] | None = None) -> ArchiveInfo:
        """A Store whose call carries begin and commit, its payloads sent on the data path."""
        begin = store_begin(name, replace, metadata)
        digests = await self._wants_digests()
        answer = await self._upload_over(
            route, self._methods.store, encode_store_request(begin=begin),
            lambda link: send_store(link, store_entries(archive, prefix, digests), progress),
            lambda sent: encode_store_commit(*sent))
        return ArchiveInfo.of(answer)

    async def _upload_over(self, route: Route, method: Any, first: bytes, transfer: Callable[[Any], tuple[int, int]],
                           last: Callable[[tuple[int, int]], bytes] | None = None) -> Any:
        """As :meth:`tannery.Client._upload_over`: the connection made and ``transfer`` run on
        worker threads."""
        sent: list[tuple[int, int]] = []
        finished = asyncio.Event()

        async def messages() -> AsyncIterator[bytes]:
            yield first
            await finished.wait()
            if sent and last is not None:  # no final message after a failed transfer
                yield last(sent[0])

        def run(link: Any) -> tuple[int, int]:
            with link:
                return transfer(link)

        call = method(messages(), **self._over(route))
        final = _FinalStatus(call)
        broken: BaseException | None = None
        try:
            ticket = ticket_of(await call.initial_metadata())
            if ticket is not None:
                # Unavailable at once when the connection cannot be made; the call is cancelled (below).
                link = await asyncio.to_thread(connect_call, route, ticket)
                try:
                    sent.append(await asyncio.to_thread(run, link))
                except (LinkError, OSError) as exc:
                    broken = exc
        except BaseException:
            call.cancel()
            raise
        finally:
            finished.set()
        try:
            if broken is not None:
                raise await self._broken(call, broken, route)
            return await call
        except grpc.aio.AioRpcError as error:
            raise final.error(error, self._connection.target) from None

    async def archive(self, name: str, *, progress: Progress = None) -> AsyncRemoteArchive:
        """As :meth:`tannery.Client.archive`; the reads of the archive are coroutines."""
        return AsyncRemoteArchive(await self.describe(name), self._transfer(name, progress))

    async def fetch(self, name: str, names: Iterable[str] | None = None, prefix: str | None = None, *,
                    progress: Progress = None) -> Archive:
        """As :meth:`tannery.Client.fetch`."""
        return MemoryArchive(dict(await self._fetch(fetch_request(name, names, prefix), progress)))

    def fetch_iter(self, name: str, names: Iterable[str] | None = None, prefix: str | None = None, *,
                   progress: Progress = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """As :meth:`tannery.Client.fetch_iter`, an async iterator: ``async for name, tensor in
        client.fetch_iter(...)``. Leaving the loop early (or ``aclose()``) cancels the call."""
        return self._entries(fetch_request(name, names, prefix), EntryReader(progress))

    def fetch_pieces(self, name: str, names: Iterable[str] | None = None, prefix: str | None = None, *,
                     progress: Progress = None) -> AsyncIterator[TensorPiece]:
        """As :meth:`tannery.Client.fetch_pieces`, an async iterator."""
        return self._entries(fetch_request(name, names, prefix), PieceReader(progress))

    async def union(self, target: str, sources: Mapping[str, str] | Sequence[str], *,
                    replace: bool = False, metadata: Mapping[str, str] | None = None) -> ArchiveInfo:
        """As :meth:`tannery.Client.union`."""
        return ArchiveInfo.of(await self._unary(self._methods.union, union_request(target, sources, replace, metadata)))

    async def describe(self, name: str) -> ArchiveDescription:
        """As :meth:`tannery.Client.describe`."""
        request = archives_pb2.DescribeRequest(archive=name)
        return ArchiveDescription.of(await self._unary(self._methods.describe, request))

    async def list(self, prefix: str = "") -> list[ArchiveInfo]:
        """As :meth:`tannery.Client.list`."""
        archives: list[ArchiveInfo] = []
        token = ""
        while True:
            page = await self._unary(self._methods.list, list_request(prefix, token))
            archives += (ArchiveInfo.of(info) for info in page.archives)
            token = page.next_page_token
            if not token:
                return archives

    async def delete(self, name: str) -> Deleted:
        """As :meth:`tannery.Client.delete`."""
        request = archives_pb2.DeleteRequest(archive=name)

        async def attempt(retry: int) -> Deleted:
            try:
                return Deleted.of(await self._unary_once(self._methods.delete, request))
            except errors.NotFound:
                if retry:
                    return Deleted.gone(name)
                raise

        return await self._retrying(f"Delete of {name!r}", attempt)

    async def load_state_dict(self, module: torch.nn.Module, name: str, prefix: str = "", strict: bool = True,
                              *, progress: Progress = None) -> Any:
        """As :meth:`tannery.Client.load_state_dict`."""
        plan = plan_state_dict(module, await self.describe(name), prefix, strict)
        tensors = await self._transfer(name, progress)(plan.asks) if plan.asks else []
        return plan.load(module, tensors, strict)

    # -- channels ------------------------------------------------------------------------

    async def publish(self, channel: str, tensors: Iterable[Any] | AsyncIterable[Any], *,
                      progress: Progress = None) -> Published:
        """As :meth:`tannery.Client.publish`; ``tensors`` may also be an async iterable."""
        check_tensors(tensors)
        route = await self._data_route()
        if route is not None and route.kind == "local":
            return await self._publish_over(route, channel, tensors, progress)
        chunk_size = self._connection.chunk_size

        async def messages():
            index = 0
            async for tensor in _aiter(tensors):
                for message in publish_messages(tensor, channel if index == 0 else None, chunk_size, progress, index):
                    yield message
                index += 1
            if index == 0:
                yield encode_publish_request(channel, [])

        return Published.of(await self._send(self._methods.publish, messages()))

    async def _publish_over(self, route: Route, channel: str, tensors: Iterable[Any] | AsyncIterable[Any],
                            progress: Progress) -> Published:
        """A Publish whose call names the channel, its payloads passed as sealed memory files
        (an async iterable of tensors is gathered first: the passing runs on a worker thread)."""
        if isinstance(tensors, AsyncIterable):
            tensors = [tensor async for tensor in tensors]
        answer = await self._upload_over(route, self._methods.publish, encode_publish_request(channel, []),
                                         lambda link: publish_over(link, tensors, progress))
        return Published.of(answer)

    def subscribe(self, channel: str, *, progress: Progress = None) -> "AsyncSubscription":
        """Subscribe to ``channel``: ``await`` it (or ``async with`` it) to register the
        subscription on the server, then ``async for`` the tensors published from then on."""
        return AsyncSubscription(self, channel, progress)


async def _aiter(items: Iterable[Any] | AsyncIterable[Any]):
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


async def _made_in_thread(messages: Iterator[bytes]) -> AsyncIterator[bytes]:
    """``messages``, each made on a worker thread (one at a time), the generator closed there too."""
    try:
        while (message := await asyncio.to_thread(next, messages, None)) is not None:
            yield message
    finally:
        try:
            await asyncio.to_thread(messages.close)
        except ValueError:
            pass  # cancelled while the worker still makes a message: it ends that one, then it is dropped


async def _write_all(call: Any, messages: Iterable[bytes] | AsyncIterable[bytes]) -> bool:
    """Write every message; True if the call ended first (its status says why)."""
    async for message in _aiter(messages):
        try:
            await call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return True
    return False


class AsyncSubscription:
    """The tensors published on a channel, in order: ``await`` it or ``async with`` it to
    register, then ``async for``; :meth:`close` (or leaving the block) ends it."""

    def __init__(self, client: Client, channel: str, progress: Progress) -> None:
        self._client = client
        self._channel = channel
        self._reader = PayloadReader(progress)
        self._call: Any = None
        self._ready: deque[torch.Tensor] = deque()
        self._closed = False
        #: The same-host connection the payloads come on (None: they come in the call's messages).
        self._link: Any = None
        self._route: Route | None = None

    async def _start(self) -> "AsyncSubscription":
        if self._call is None:
            request = channels_pb2.SubscribeRequest(channel=self._channel)
            route = await self._client._data_route()
            if route is not None and route.kind == "local":
                self._route = route
                metadata = (*self._client._connection.metadata, (TRANSPORT_KEY, route.kind))
                self._call = self._client._methods.subscribe(request, metadata=metadata)
            else:
                self._call = self._client._methods.subscribe(request, **self._client._options(timeout=False))
            metadata = await self._call.initial_metadata()  # sent once the subscription is registered
            if self._call.done() and await self._call.code() is not grpc.StatusCode.OK:
                code, details = await self._call.code(), await self._call.details()
                raise service_error(code, details, await self._call.trailing_metadata(), self._client.target)
            if self._route is not None:
                ticket = ticket_of(metadata)
                if ticket is None:
                    self._call.cancel()
                    raise errors.ServiceError("the server answered a same-host Subscribe without a ticket")
                try:
                    self._link = await asyncio.to_thread(connect_call, self._route, ticket)
                except BaseException:
                    self._call.cancel()  # the server would wait for the connection until its ticket expires
                    raise
        return self

    async def _next_over_link(self) -> list:
        """The tensors the next frame of the same-host connection completes (read on a worker thread)."""
        try:
            return await asyncio.to_thread(next_published, self._link, self._reader)
        except (LinkError, OSError) as exc:
            if self._closed:
                raise StopAsyncIteration from None
            raise await self._client._broken(self._call, exc, self._route) from None

    def __await__(self):
        return self._start().__await__()

    async def __aenter__(self) -> "AsyncSubscription":
        return await self._start()

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def __aiter__(self) -> "AsyncSubscription":
        return self

    async def __anext__(self) -> torch.Tensor:
        await self._start()
        while not self._ready:
            if self._closed:
                raise StopAsyncIteration
            if self._link is not None:
                self._ready.extend(await self._next_over_link())
                continue
            try:
                message = await self._call.read()
            except grpc.RpcError as error:
                if self._closed:
                    raise StopAsyncIteration from None
                raise self._client._error(error) from None
            except asyncio.CancelledError:
                if self._closed:
                    raise StopAsyncIteration from None
                raise
            if message is grpc.aio.EOF:
                raise StopAsyncIteration
            if message is ABANDONED:
                self._reader.discard()  # a torn payload is never returned
            else:
                self._ready.extend(self._reader.feed(message))
        return self._ready.popleft()

    def close(self) -> None:
        """End the subscription (the server forgets it); iterating stops."""
        self._closed = True
        if self._link is not None:
            self._link.abort()  # a worker thread reading it returns
        if self._call is not None:
            self._call.cancel()


__all__ = ["AsyncRemoteArchive", "AsyncSubscription", "Client"]
