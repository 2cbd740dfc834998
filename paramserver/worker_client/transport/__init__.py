"""How the worker client reaches a shard: every way behind one
:class:`~paramserver.worker_client.transport.base.Transport` interface (:mod:`.base`, with the
choice between them), the chunked gRPC streams (:mod:`.streams`), the ``Session`` stream with
shared-memory slots (:mod:`.session_stream`) and the same-host local link it can move onto
(:mod:`.link_client`)."""
