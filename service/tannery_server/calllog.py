"""One log line per call: method, what it worked on (archive or channel), bytes, status, duration.

:class:`CallLogInterceptor` wraps every handler (health and reflection calls excepted). It
counts the bytes of streamed messages itself; a servicer names what the call works on
with ``current_call().note("archive", name)`` and may add to ``current_call().bytes``
what the interceptor cannot see.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

log = logging.getLogger("tannery_server.calls")

_QUIET_SERVICES = ("/grpc.health.v1.", "/grpc.reflection.")


@dataclass
class CallRecord:
    method: str
    fields: dict[str, Any] = field(default_factory=dict)
    bytes: int = 0

    def note(self, key: str, value: Any) -> None:
        self.fields[key] = value


_current: contextvars.ContextVar[CallRecord | None] = contextvars.ContextVar("tannery_call", default=None)


def current_call() -> CallRecord:
    """The record of the call being handled (a throwaway one outside a call)."""
    record = _current.get()
    return record if record is not None else CallRecord("-")


def _status(exc: BaseException | None, context: grpc.aio.ServicerContext) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if exc is None:
        return "OK"
    return "UNKNOWN"


def _emit(record: CallRecord, status: str, started: float) -> None:
    duration = time.perf_counter() - started
    fields = {"method": record.method, **record.fields, "bytes": record.bytes, "status": status,
              "duration_ms": round(duration * 1000, 3)}
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    log.info(text, extra={"fields": fields})


def _counting(fn: Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
    """A (de)serializer that also adds the size of each message to the current call."""
    if fn is None:
        return None

    def wrapped(value: Any) -> Any:
        result = fn(value)
        record = _current.get()
        if record is not None:
            record.bytes += len(value if isinstance(value, (bytes, bytearray)) else result)
        return result

    return wrapped


def _wrap(behavior: Callable, method: str) -> Callable:
    if inspect.isasyncgenfunction(behavior):

        async def streaming(request: Any, context: grpc.aio.ServicerContext):
            record = CallRecord(method)
            _current.set(record)
            started, error = time.perf_counter(), None
            try:
                async for item in behavior(request, context):
                    yield item
            except BaseException as exc:
                error = exc
                raise
            finally:
                _emit(record, _status(error, context), started)

        return streaming

    async def unary(request: Any, context: grpc.aio.ServicerContext):
        record = CallRecord(method)
        _current.set(record)
        started, error = time.perf_counter(), None
        try:
            return await behavior(request, context)
        except BaseException as exc:
            error = exc
            raise
        finally:
            _emit(record, _status(error, context), started)

    return unary


class CallLogInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method_path = handler_call_details.method
        if handler is None or method_path.startswith(_QUIET_SERVICES):
            return handler
        method = method_path.rsplit("/", 1)[-1]
        kind = ("stream_" if handler.request_streaming else "unary_") + (
            "stream" if handler.response_streaming else "unary"
        )
        changes = {kind: _wrap(getattr(handler, kind), method)}
        if handler.request_streaming:
            changes["request_deserializer"] = _counting(handler.request_deserializer)
        if handler.response_streaming:
            changes["response_serializer"] = _counting(handler.response_serializer)
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
