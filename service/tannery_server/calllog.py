"""One log line per call: method, what it worked on (archive or channel), bytes, status,
duration and peer.

:class:`CallLogInterceptor` wraps every handler (health and reflection calls excepted). It
counts the bytes of the messages received and sent itself (serialized sizes); a servicer
names what the call works on with ``current_call().note("archive", name)``. Observers
given to the interceptor (the metrics) see each finished call once, with the same record;
starters see each call's record as it starts (its byte counts grow while the call runs, so
the metrics can count a long stream's bytes before it ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import grpc

log = logging.getLogger("tannery_server.calls")

_QUIET_SERVICES = ("/grpc.health.v1.", "/grpc.reflection.")


@dataclass
class CallRecord:
    method: str
    fields: dict[str, Any] = field(default_factory=dict)
    #: Serialized bytes of the messages received from and sent to the client.
    received: int = 0
    sent: int = 0
    peer: str = ""

    @property
    def bytes(self) -> int:
        return self.received + self.sent

    def note(self, key: str, value: Any) -> None:
        self.fields[key] = value


#: Told of every finished call: its record, status name and duration in seconds.
CallObserver = Callable[[CallRecord, str, float], None]
#: Told of every call as it starts, with its record (before any message is counted in it).
CallStarter = Callable[[CallRecord], None]


_current: contextvars.ContextVar[CallRecord | None] = contextvars.ContextVar("tannery_call", default=None)


def current_call() -> CallRecord:
    """The record of the call being handled (a throwaway one outside a call)."""
    record = _current.get()
    return record if record is not None else CallRecord("-")


def _status(exc: BaseException | None, context: grpc.aio.ServicerContext) -> str:
    # A call its client cancelled is CANCELLED whatever the handler went on to do.
    # A response stream closed before its end (GeneratorExit) could not be written to it.
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)) or context.cancelled():
        return "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if exc is None:
        return "OK"
    return "UNKNOWN"


def _emit(record: CallRecord, status: str, started: float, observers: Sequence[CallObserver]) -> None:
    duration = time.perf_counter() - started
    fields = {"method": record.method, **record.fields, "bytes": record.bytes, "bytes_in": record.received,
              "bytes_out": record.sent, "status": status, "duration_ms": round(duration * 1000, 3),
              "peer": record.peer}
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    log.info(text, extra={"fields": fields})
    for observe in observers:
        try:
            observe(record, status, duration)
        except Exception:  # an observer's bug must not fail the call
            log.exception("call observer %r failed", observe)


def _counting_requests(fn: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """A request deserializer that also adds the size of each message to the current call."""
    if fn is None:
        return None

    def wrapped(data: bytes) -> Any:
        record = _current.get()
        if record is not None:
            record.received += len(data)
        return fn(data)

    return wrapped


def _counting_responses(fn: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    """A response serializer that also adds the size of each message to the current call."""
    if fn is None:
        return None

    def wrapped(message: Any) -> bytes:
        data = fn(message)
        record = _current.get()
        if record is not None:
            record.sent += len(data)
        return data

    return wrapped


def _size(message: Any) -> int:
    """The serialized size of a unary message (its (de)serializer runs outside the call's context)."""
    if isinstance(message, (bytes, bytearray, memoryview)):
        return len(message)
    byte_size = getattr(message, "ByteSize", None)
    return byte_size() if byte_size is not None else 0


def _start(method: str, request: Any, context: grpc.aio.ServicerContext, request_streaming: bool,
           starters: Sequence[CallStarter]) -> CallRecord:
    record = CallRecord(method, peer=context.peer() or "")
    for started in starters:
        try:
            started(record)
        except Exception:  # a starter's bug must not fail the call
            log.exception("call starter %r failed", started)
    if not request_streaming:
        record.received = _size(request)
    _current.set(record)
    return record


@contextlib.contextmanager
def _observed(method: str, request: Any, context: grpc.aio.ServicerContext, request_streaming: bool,
              observers: Sequence[CallObserver], starters: Sequence[CallStarter] = ()) -> Iterator[CallRecord]:
    """The record of one call (told to ``starters`` as it starts), logged (and told to
    ``observers``) with its status once it is over."""
    record = _start(method, request, context, request_streaming, starters)
    started, error = time.perf_counter(), None
    try:
        yield record
    except BaseException as exc:
        error = exc
        raise
    finally:
        _emit(record, _status(error, context), started, observers)


def _wrap(behavior: Callable, method: str, request_streaming: bool, observers: Sequence[CallObserver],
          starters: Sequence[CallStarter] = ()) -> Callable:
    if inspect.isasyncgenfunction(behavior):

        async def streaming(request: Any, context: grpc.aio.ServicerContext):
            with _observed(method, request, context, request_streaming, observers, starters):
                async for item in behavior(request, context):
                    yield item

        return streaming

    async def unary(request: Any, context: grpc.aio.ServicerContext):
        with _observed(method, request, context, request_streaming, observers, starters) as record:
            response = await behavior(request, context)
            record.sent += _size(response)
            return response

    return unary


class CallLogInterceptor(grpc.aio.ServerInterceptor):
    """Logs each call (and tells ``observers``) once it is over; tells ``starters`` as it starts."""

    def __init__(self, observers: Sequence[CallObserver] = (), starters: Sequence[CallStarter] = ()) -> None:
        self.observers = tuple(observers)
        self.starters = tuple(starters)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method_path = handler_call_details.method
        if handler is None or method_path.startswith(_QUIET_SERVICES):
            return handler
        method = method_path.rsplit("/", 1)[-1]
        kind = ("stream_" if handler.request_streaming else "unary_") + (
            "stream" if handler.response_streaming else "unary"
        )
        changes = {kind: _wrap(getattr(handler, kind), method, handler.request_streaming, self.observers,
                               self.starters)}
        if handler.request_streaming:
            changes["request_deserializer"] = _counting_requests(handler.request_deserializer)
        if handler.response_streaming:
            changes["response_serializer"] = _counting_responses(handler.response_serializer)
        return handler._replace(**changes)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a call's fields are top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(log_format: str, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("tannery_server")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
