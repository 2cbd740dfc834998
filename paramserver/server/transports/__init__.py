"""Transports of a server shard: the gRPC servicer, the Session stream, the same-host local link and
the table RPCs. Each decodes a request, calls the shard, and encodes the answer.
"""
