"""gRPC method handlers by call shape, for the server interceptors that run a method's behaviour
inside their own (the bearer-token check, the RPC metrics).

A handler has one of four call shapes, by whether its request and its response stream; the
behaviour sits in the handler attribute of that name, and ``grpc.<shape>_rpc_method_handler``
makes a handler of that shape.
"""

from __future__ import annotations

from typing import Any

import grpc

__all__ = ["behaviour_of", "same_shape"]

#: The handler attribute (and ``grpc.<shape>_rpc_method_handler``) of each call shape, by
#: (request streaming, response streaming).
_CALL_SHAPES = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}


def _call_shape(handler: grpc.RpcMethodHandler) -> str:
    """``"unary_unary"``, ``"unary_stream"``, ``"stream_unary"`` or ``"stream_stream"``."""
    return _CALL_SHAPES[(bool(handler.request_streaming), bool(handler.response_streaming))]


def behaviour_of(handler: grpc.RpcMethodHandler) -> Any:
    """The function that serves ``handler``'s calls (``(request, context)``; an async
    generator function for a streaming response written by ``yield``)."""
    return getattr(handler, _call_shape(handler))


def same_shape(handler: grpc.RpcMethodHandler, behaviour: Any) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s call shape and (de)serializers that runs ``behaviour``."""
    make = getattr(grpc, f"{_call_shape(handler)}_rpc_method_handler")
    return make(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
