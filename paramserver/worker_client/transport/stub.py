"""The parameter-server stub the worker client calls through.

The generated stub, except that Push requests are written and Pull responses read by
:mod:`paramserver.protocol.wire` (tensor frames without protobuf copies of their payload), and
so are the row streams' chunk messages. The bytes on the wire are protobuf's own, so either end
may be a plain protobuf peer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.api.v1 import tables_pb2 as tpb
from paramserver.protocol import wire

__all__ = ["ParameterServerStub"]

if TYPE_CHECKING:  # the generated stubs type an aio channel's stub as a class of its own
    _GeneratedStub = pb_grpc.ParameterServerAsyncStub
else:
    _GeneratedStub = pb_grpc.ParameterServerStub


class ParameterServerStub(_GeneratedStub):
    """The generated stub, with Push requests written and Pull responses read by
    :mod:`paramserver.protocol.wire` (tensor frames without protobuf copies of their payload; the
    same bytes on the wire, so either end may be a plain protobuf peer), and the row streams'
    chunks likewise."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        super().__init__(channel)
        service = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
        self.Push = channel.stream_unary(
            f"/{service}/Push",
            request_serializer=wire.serialize,
            response_deserializer=pb.PushResponse.FromString,
        )
        self.Pull = channel.unary_stream(
            f"/{service}/Pull",
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=wire.deserializer(pb.PullResponse),
        )
        # The row streams: chunk messages are sent as wire bytes and read in place.
        self.PullRows = channel.stream_stream(
            f"/{service}/PullRows",
            request_serializer=wire.serialize,
            response_deserializer=wire.rows_deserializer(tpb.PullRowsResponse),
        )
        self.PushRows = channel.stream_unary(
            f"/{service}/PushRows",
            request_serializer=wire.serialize,
            response_deserializer=tpb.PushRowsResponse.FromString,
        )
        self.PushPullRows = channel.stream_stream(
            f"/{service}/PushPullRows",
            request_serializer=wire.serialize,
            response_deserializer=wire.rows_deserializer(tpb.PushPullRowsResponse),
        )
        self.PullRowsMany = channel.stream_stream(
            f"/{service}/PullRowsMany",
            request_serializer=wire.serialize,
            response_deserializer=wire.rows_deserializer(tpb.PullRowsManyResponse),
        )
        self.PushRowsMany = channel.stream_unary(
            f"/{service}/PushRowsMany",
            request_serializer=wire.serialize,
            response_deserializer=tpb.PushRowsManyResponse.FromString,
        )
