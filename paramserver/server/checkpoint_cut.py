"""Where a shard's checkpoint sits in the cluster: shard identity and the cut it belongs to.

Every checkpoint manifest carries a ``"shard"`` section (written by
:meth:`paramserver.server.checkpoint.CheckpointManager.snapshot`)::

    {"shard_index": 1, "num_shards": 3, "addresses": [...], "slice_bytes": 4194304,
     "placement": "blake2b-64/v1", "epoch": 0, "cut_step": 40, "exact_cut": true}

``cut_step`` names the step boundary the state sits on. Under BSP the parameters and optimizer
state change only when a step closes, so a checkpoint taken while step t is open holds exactly
"steps 0..t-1 applied" in its parameters (gradients queued for step t, which a checkpoint also
keeps for a restart of the same shard, are not applied yet; resharding drops them and the new
cluster redoes step t), and every shard closes
the same steps because every worker clocks on every shard: ``exact_cut`` is true and the
checkpoints of all shards with the same ``cut_step`` form one consistent cut of the cluster.
Periodic checkpoints (``checkpoint_every_steps``) are requested the moment a step closes, so with
the same period every shard writes one at every multiple of it.

Under SSP/ASP pushes are applied on arrival: ``cut_step`` is the live minimum clock t, the state
holds every update of clocks < t and possibly some of clocks t..t+s (``exact_cut`` false, which
SSP's guarantees allow a reader to see; a restore may re-apply those).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict, cast

from paramserver.core.sharding import PLACEMENT, ShardMap, parse_addresses

if TYPE_CHECKING:
    from paramserver.core.shard import ServerCore
    from paramserver.server.config import ServerConfig


class ShardSection(TypedDict):
    """The ``"shard"`` section of a checkpoint manifest: where the shard sat in its cluster
    and the cut its checkpoint belongs to (the BSP step, or the minimum clock)."""

    shard_index: int
    num_shards: int
    addresses: list[str]
    slice_bytes: int
    placement: str
    epoch: int
    consistency: str
    cut_step: int
    exact_cut: bool


def shard_manifest(core: ServerCore) -> ShardSection:
    """The ``"shard"`` section of a checkpoint manifest of ``core`` (call without yielding)."""
    cfg = cast("ServerConfig", core.config)  # the server built the core with its config
    if core.aggregator is not None:
        step = core.bsp_step
        exact = True
    else:
        step = core.cluster.min_clock()
        exact = False
    return {
        "shard_index": cfg.shard_index,
        "num_shards": cfg.num_shards,
        "addresses": list(parse_addresses(cfg.shard_addresses)) if cfg.shard_addresses else [],
        "slice_bytes": cfg.slice_bytes,
        "placement": PLACEMENT,
        "epoch": cfg.shard_map_epoch,
        "consistency": core.consistency.value,
        "cut_step": step,
        "exact_cut": exact,
    }


def shard_map_of(config: ServerConfig, address: str) -> ShardMap:
    """The shard map a shard serves: its configured cluster, or itself alone at ``address``."""
    addresses = parse_addresses(config.shard_addresses) if config.shard_addresses else (address,)
    return ShardMap(addresses, slice_bytes=config.slice_bytes, epoch=config.shard_map_epoch)
