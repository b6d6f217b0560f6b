"""The gRPC method handlers of the parameter service: the generated ones, except that a request
that does not parse is answered INVALID_ARGUMENT, as the protocol promises, instead of the
INTERNAL that grpcio gives a request deserializer's exception.

Each method's deserializer here never raises: bytes that are not its request message become
:data:`UNPARSEABLE`, and the handler (unary requests) or the request iterator the handler reads
(streamed requests, each message in turn) answers INVALID_ARGUMENT when it meets one. The
methods, their message types and their kinds come from the .proto's service descriptor, so a
method added there is served here without an edit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from distsgd.ps.auth import MAKE_HANDLER
from distsgd.ps.service_errors import abort
from distsgd.transport.proto import distsgd_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["ParameterServer"]


class _Unparseable:
    """What a request deserializer returns for bytes that are not its message."""


UNPARSEABLE = _Unparseable()


def _deserializer(message: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except Exception:  # protobuf's DecodeError, or a field out of range
            return UNPARSEABLE

    return parse


def _refuse(context: grpc.ServicerContext, name: str) -> None:
    """Answer INVALID_ARGUMENT for an unparseable ``name`` message; raises :class:`Aborted`."""
    abort(
        context,
        grpc.StatusCode.INVALID_ARGUMENT,
        f"a malformed {name}: its bytes are not that protocol message; "
        "run the same distsgd version on every task",
    )


def _checked(messages: Iterator[Any], context: grpc.ServicerContext, name: str) -> Iterator[Any]:
    for message in messages:
        if message is UNPARSEABLE:
            _refuse(context, name)
        yield message


def _handler(method: Any, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    request = getattr(pb, method.input_type.name)
    response = getattr(pb, method.output_type.name)
    name = method.input_type.name
    wrapped: Callable[[Any, grpc.ServicerContext], Any]
    if method.client_streaming:

        def streamed(messages: Iterator[Any], context: grpc.ServicerContext) -> Any:
            return behavior(_checked(messages, context, name), context)

        wrapped = streamed
    else:

        def unary(message: Any, context: grpc.ServicerContext) -> Any:
            if message is UNPARSEABLE:
                _refuse(context, name)
            return behavior(message, context)

        wrapped = unary
    make = MAKE_HANDLER[(bool(method.client_streaming), bool(method.server_streaming))]
    return make(
        wrapped,
        request_deserializer=_deserializer(request),
        response_serializer=response.SerializeToString,
    )


def add_to_server(servicer: Any, server: grpc.Server) -> None:
    """Serve ``servicer``'s methods on ``server`` (as the generated
    ``add_ParameterServerServicer_to_server`` does, with the deserializers above)."""
    handlers = {m.name: _handler(m, getattr(servicer, m.name)) for m in SERVICE.methods}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    register = getattr(server, "add_registered_method_handlers", None)  # grpcio >= 1.63
    if register is not None:
        register(SERVICE.full_name, handlers)
