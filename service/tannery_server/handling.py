"""What every servicer shares: requests decoded without raising, the RPC table derived from a
service's descriptor, and the one place where a handler's exceptions become statuses.

grpc.aio answers a request deserializer's exception with UNKNOWN (for a stream of requests
it raises it inside the handler), and a handler's unexpected exception with UNKNOWN too.
Here undecodable bytes become an :class:`Undecodable` the handler refuses with
INVALID_ARGUMENT, and every exception a handler raises is answered with its failure's status.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Awaitable, Callable, Mapping

import grpc
from google.protobuf.descriptor import FieldDescriptor

from tannery_protocol.wire import WireError, length_delimited_fields

from .calllog import current_call
from .failures import Failure, Internal, Malformed, trailing_metadata

log = logging.getLogger("tannery_server.handling")


@dataclass(frozen=True)
class Undecodable:
    """A request whose bytes are not a valid message: what the deserializers give instead of raising."""

    message_type: str
    #: Why, naming the field when it can.
    reason: str
    nbytes: int

    def failure(self, where: str) -> Malformed:
        return Malformed(f"{where} is not a valid {self.message_type} ({self.nbytes} bytes): {self.reason}")


def _why_undecodable(message_class: Any, data: bytes, error: Exception) -> str:
    """Name the problem: a string field that is not UTF-8, protobuf's own words otherwise."""
    strings = {f.number: f.name for f in message_class.DESCRIPTOR.fields if f.type == FieldDescriptor.TYPE_STRING}
    try:
        for number, value in length_delimited_fields(data):
            if number in strings:
                try:
                    str(value, "utf-8")
                except UnicodeDecodeError as bad:
                    return (f"field {strings[number]} {bytes(value[:64])!r} is not valid UTF-8 "
                            f"({bad.reason} at byte {bad.start})")
    except WireError:
        pass
    return str(error)


def tolerant(message_class: Any) -> Callable[[bytes], Any]:
    """The deserializer of ``message_class`` that returns an :class:`Undecodable` instead of raising."""
    name = message_class.DESCRIPTOR.full_name

    def decode(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except Exception as error:  # DecodeError, and whatever else bad bytes make the parser raise
            return Undecodable(name, _why_undecodable(message_class, data, error), len(data))

    return decode


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_service(server: grpc.aio.Server, servicer: Any, module: ModuleType, service: str,
                hand_written: Mapping[str, Mapping[str, Callable]] = {}) -> None:
    """Register every RPC of ``service`` (in the generated ``module``), derived from its descriptor:
    tolerant request deserializers, generated response serializers, and the ``hand_written``
    (de)serializers of the methods that read or write tensor bytes without copies."""
    descriptor = module.DESCRIPTOR.services_by_name[service]
    handlers = {}
    for method in descriptor.methods:
        options = {"request_deserializer": tolerant(getattr(module, method.input_type.name)),
                   "response_serializer": getattr(module, method.output_type.name).SerializeToString,
                   **hand_written.get(method.name, {})}
        kind = _HANDLER_KINDS[method.client_streaming, method.server_streaming]
        handlers[method.name] = kind(getattr(servicer, method.name), **options)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))


def internal(exc: BaseException) -> Failure:
    """What to answer for an exception that is no Failure: a bug, logged with its traceback, INTERNAL."""
    if isinstance(exc, Failure):
        return exc
    if isinstance(exc, WireError):  # tannery_protocol.wire's parse of a hand-read message
        return Malformed(str(exc))
    log.error("unexpected error in %s", current_call().method, exc_info=exc)
    return Internal(f"internal error ({type(exc).__name__}: {exc}); the server logged it")


def answering_failures(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Answer whatever a servicer method raises with its status: the servicer's ``failure_of(exc)``
    names the failure (a Failure passes as it is). An undecodable unary request is refused
    before the method runs (a stream's undecodable messages are refused where they are read)."""

    @functools.wraps(method)
    async def answering(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if isinstance(request, Undecodable):
                raise request.failure(f"the {method.__name__} request")
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            failure = internal(self.failure_of(exc))
            await context.abort(failure.code, str(failure), trailing_metadata=trailing_metadata(failure))

    return answering
