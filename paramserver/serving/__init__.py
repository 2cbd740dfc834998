"""What every paramserver daemon shares: the gRPC bootstrap (:mod:`~paramserver.serving.bootstrap`),
the error mapping of servicers (:mod:`~paramserver.serving.error_status`,
:mod:`~paramserver.serving.early_refusal`), the RPC metrics and the metrics endpoint
(:mod:`~paramserver.serving.metrics`), the dashboard (:mod:`~paramserver.serving.dashboard`) and
the lease reaper (:mod:`~paramserver.serving.lease_reaper`).

The parameter-server shard, the reduction server and a rank server stand on it; it knows none of
them (a rank server loads no parameter-server module).
"""
