"""Requests that do not parse are INVALID_ARGUMENT naming their message, on every service.

grpc parses a request with the handler's ``request_deserializer`` before any
servicer code runs, and answers any exception it raises UNKNOWN "Unexpected
<class 'DecodeError'>". :class:`DecodeRefusal`, the innermost interceptor of
every server (common/server.py ``start_server``), puts in its place a handler
of the same kind that takes the raw bytes and parses them itself, with the
call's context at hand to abort by name. Interceptor plumbing, as
common/grpc_tracing.py is: the servicer's own code is unchanged.
"""

from __future__ import annotations

import inspect
from typing import AsyncIterator

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.message import DecodeError

from switchyard.common.errors import InvalidArgument, abort


class DecodeRefusal(grpc.aio.ServerInterceptor):
    """Answers a request message that does not parse (corrupt wire format, a string field that is not UTF-8)
    INVALID_ARGUMENT naming the message, where grpc answered UNKNOWN "Unexpected <class 'DecodeError'>".

    grpc parses a request with the handler's ``request_deserializer`` before any servicer code runs, and
    answers any exception it raises UNKNOWN. This puts a handler of the same kind in its place that takes the
    raw bytes and parses them itself, with the call's context at hand to abort by name (the request stream of
    a streaming call is parsed message by message as the servicer reads it).

    Args:
        service: the hop named in the refusal's origin trailer.
    """

    def __init__(self, service: str) -> None:
        self.service = service
        self._made: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        """Per method: the servicer's handler and the one made in its place (grpc asks for a handler on every
        call: it is made once, not rebuilt per call)."""

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        made = self._made.get(method)
        if made is None or made[0] is not handler:
            made = (handler, _parsing_handler(handler, self.service, _input_type(method)))
            self._made[method] = made
        return made[1]


def _input_type(method: str) -> str:
    """The request message's full name of ``method`` (``/agent.AgentService/SubmitTask``), from the protobuf
    descriptor pool the generated modules register in; "request" for a method it does not know."""
    service, _, name = method.lstrip("/").rpartition("/")
    try:
        return descriptor_pool.Default().FindMethodByName(f"{service}.{name}").input_type.full_name
    except KeyError:
        return "request"


def _parsing_handler(handler: grpc.RpcMethodHandler, service: str, name: str) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer

    async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> object:
        try:
            return parse(raw)
        except DecodeError as exc:
            await abort(context, InvalidArgument("request", f"a well-formed {name} message", str(exc)), service)

    async def parsed_stream(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
        async for raw in raws:
            yield await parsed(raw, context)

    if handler.request_streaming and handler.response_streaming:
        original, make = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        original, make = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        original, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        original, make = handler.unary_unary, grpc.unary_unary_rpc_method_handler
    read = parsed_stream if handler.request_streaming else parsed

    if inspect.isasyncgenfunction(original):
        async def behaviour(raw, context):  # type: ignore[no-untyped-def]
            request = read(raw, context) if handler.request_streaming else await read(raw, context)
            async for reply in original(request, context):
                yield reply
    else:  # a coroutine (a streaming reply written with context.write), or a plain function
        async def behaviour(raw, context):  # type: ignore[no-untyped-def]
            request = read(raw, context) if handler.request_streaming else await read(raw, context)
            result = original(request, context)
            return await result if inspect.isawaitable(result) else result

    return make(behaviour, request_deserializer=None, response_serializer=handler.response_serializer)
