"""gRPC server reflection under both of its names: ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

grpcurl (1.9 and later), Postman and the reflection clients of grpc-go and grpc-java ask for
``grpc.reflection.v1.ServerReflection`` first; older tools ask for v1alpha. grpcio-reflection (the pinned
1.85) serves v1alpha only. v1 is the same protocol under another package (grpc-proto's
``grpc/reflection/v1/reflection.proto``: the same messages with the same field numbers), so one v1alpha
servicer answers both names, its messages read and written as the same bytes. v1's file descriptor is
v1alpha's with the package renamed, added to the default descriptor pool so that reflection describes its
own v1 service too (``grpcurl describe grpc.reflection.v1.ServerReflection``).
"""

from __future__ import annotations

from typing import Sequence

import grpc
from google.protobuf import descriptor, descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
SERVICE_NAMES: tuple[str, ...] = (V1_SERVICE_NAME, reflection.SERVICE_NAME)
"""The reflection services a server serves, each listed by reflection itself."""


def v1_descriptor() -> descriptor.FileDescriptor:
    """``grpc/reflection/v1/reflection.proto``'s descriptor in the default pool (added on the first call, from
    grpcio-reflection's v1alpha file with the package renamed; the one already there when another library added
    the file under that name)."""
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(V1_FILE)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.ClearField("options")  # v1alpha's: java and go package names, and deprecated
    for message in proto.message_type:  # no nested types in this file
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = f".{V1_PACKAGE}.{field.type_name[len(old):]}"
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, f".{V1_PACKAGE}.", 1)
            method.output_type = method.output_type.replace(old, f".{V1_PACKAGE}.", 1)
    pool.AddSerializedFile(proto.SerializeToString())
    return pool.FindFileByName(V1_FILE)


def enable_server_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection on ``server`` under v1 and v1alpha, listing ``service_names`` and both reflection names
    (:data:`SERVICE_NAMES`)."""
    v1_descriptor()
    servicer = reflection.aio.ReflectionServicer([*service_names, *SERVICE_NAMES])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString),
    }),))
