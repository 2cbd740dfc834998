"""How the worker client reaches a shard besides plain gRPC calls: the ``Session`` stream
(:mod:`.session_stream`) and the same-host local link (:mod:`.link_client`)."""
