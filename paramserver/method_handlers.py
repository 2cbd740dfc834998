"""gRPC method handlers by call shape, for the server interceptors that run a method's behaviour
inside their own (the bearer-token check, the RPC metrics), and the servicer context type.

A handler has one of four call shapes, by whether its request and its response stream; the
behaviour sits in the handler attribute of that name, and ``grpc.<shape>_rpc_method_handler``
makes a handler of that shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias, cast

import grpc

__all__ = ["Handler", "ServicerContext", "behaviour_of", "same_shape"]

#: A method handler of any service: an interceptor sees every method's request and response types.
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"

#: The context of a call a servicer serves, whatever its method: the servicer reads requests and
#: writes responses through their own typed paths, never through the context.
ServicerContext: TypeAlias = "grpc.aio.ServicerContext[object, object]"

#: A handler's behaviour: ``(request or request iterator, context)`` to a response, an awaitable
#: of one, or an async iterator of responses.
Behaviour: TypeAlias = Callable[..., object]

#: The handler attribute (and ``grpc.<shape>_rpc_method_handler``) of each call shape, by
#: (request streaming, response streaming).
_CALL_SHAPES = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}


def _call_shape(handler: Handler) -> str:
    """``"unary_unary"``, ``"unary_stream"``, ``"stream_unary"`` or ``"stream_stream"``."""
    return _CALL_SHAPES[(bool(handler.request_streaming), bool(handler.response_streaming))]


def behaviour_of(handler: Handler) -> Behaviour:
    """The function that serves ``handler``'s calls (``(request, context)``; an async
    generator function for a streaming response written by ``yield``)."""
    return cast(Behaviour, getattr(handler, _call_shape(handler)))


def same_shape(handler: Handler, behaviour: Behaviour) -> Handler:
    """A handler of ``handler``'s call shape and (de)serializers that runs ``behaviour``."""
    make: Callable[..., Handler] = getattr(grpc, f"{_call_shape(handler)}_rpc_method_handler")
    return make(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
