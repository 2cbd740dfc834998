"""Push-sum gossip averaging, as pure synchronous state the network layer can drive.

Source: Kempe, Dobra and Gehrke, "Gossip-Based Computation of Aggregate Information", FOCS 2003
(Protocol Push-Sum). Every node i holds a sum ``s_i`` (an array) and a weight ``w_i`` (initially
its value and 1). In every round each node splits ``(s_i, w_i)`` into ``fanout + 1`` equal shares,
keeps one and pushes one to each of ``fanout`` distinct peers drawn uniformly at random; then it
adds what it received. ``sum_i s_i`` and ``sum_i w_i`` are conserved, so every estimate
``s_i / w_i`` converges (exponentially fast) to ``sum_i v_i / n``, the mean of the initial values.

Membership is dynamic: a node learns its peers from a directory (the server's
:meth:`paramserver.core.aggregation.DistributedOptimizer.peers_of` under the
``GossipAverage`` strategy), a node that leaves hands its whole mass to one live peer
(:meth:`PushSumNode.leave`), and a share that cannot be delivered goes back to its sender
(:meth:`PushSumNode.reclaim`), so the sums stay conserved and the remaining nodes still converge
to the mean of all initial values.

Nothing here waits or speaks gRPC: :class:`PushSumNode` produces and consumes
:class:`PushSumMessage` s; :class:`GossipRound` runs synchronous rounds over in-process nodes
(tests, simulation, a single-process reference).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from paramserver.errors import InvalidArgument

__all__ = ["Directory", "GossipRound", "PushSumMessage", "PushSumNode"]

Array: TypeAlias = npt.NDArray[np.float64]
Directory: TypeAlias = Callable[[str], Sequence[str]]
"""Returns the current peers of a node (other live nodes), e.g. ``optimizer.peers_of``."""


@dataclass(frozen=True, eq=False)
class PushSumMessage:
    """One share of push-sum mass in flight.

    Attributes:
        sender: Node that pushed the share.
        receiver: Node it is addressed to.
        s: Read-only float64 sum share, the nodes' value shape.
        w: Weight share (> 0 unless the sender held no mass).
        round_index: Sender's round counter when the share was pushed.
    """

    sender: str
    receiver: str
    s: Array
    w: float
    round_index: int


class PushSumNode:
    """State of one push-sum node (Kempe et al. 2003).

    Args:
        node_id: The node's id (a worker id).
        value: Initial value, any shape; accumulated in float64.
        weight: Initial weight (1 for averaging; > 0).

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) a non-positive or non-finite weight, or a
            non-finite value.
    """

    def __init__(self, node_id: str, value: npt.ArrayLike, weight: float = 1.0) -> None:
        if not node_id:
            raise InvalidArgument("push-sum node id must be non-empty")
        if not np.isfinite(weight) or weight <= 0:
            raise InvalidArgument(f"push-sum node {node_id!r}: weight must be > 0, got {weight}")
        s = np.array(value, dtype=np.float64)
        if not np.isfinite(s).all():
            raise InvalidArgument(f"push-sum node {node_id!r}: initial value is not finite")
        s *= weight  # in place: a 0-d value stays an array
        self.node_id = node_id
        self.s: Array = s
        self.w: float = float(weight)
        self.rounds = 0
        self.departed = False

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the averaged value."""
        return tuple(self.s.shape)

    def estimate(self) -> Array:
        """Current estimate ``s / w`` of the mean (float64, the value's shape).

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) the node has left (it holds no mass).
        """
        self._check_live("estimate")
        return np.asarray(self.s / self.w)

    def push(
        self, peers: Sequence[str], fanout: int, rng: np.random.Generator
    ) -> list[PushSumMessage]:
        """Start a round: keep one share, return one message per chosen peer.

        ``k = min(fanout, len(peers))`` distinct peers are drawn uniformly with ``rng``;
        ``(s, w)`` is split into ``k + 1`` equal shares. With no peers nothing is sent.

        Args:
            peers: Current peers from the directory (the node itself is ignored if listed).
            fanout: Peers to push to; ``>= 1``.
            rng: Source of randomness (seed it for reproducible runs).

        Returns:
            Messages to deliver, in the order the peers were drawn.

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) ``fanout < 1`` or the node has left.
        """
        self._check_live("push")
        if fanout < 1:
            raise InvalidArgument(f"push-sum fanout must be >= 1, got {fanout}")
        candidates = [p for p in dict.fromkeys(peers) if p != self.node_id]
        round_index = self.rounds
        self.rounds += 1
        k = min(fanout, len(candidates))
        if k == 0:
            return []
        chosen = rng.choice(len(candidates), size=k, replace=False)
        self.s /= k + 1
        self.w /= k + 1
        share = self.s.copy()
        share.flags.writeable = False
        return [
            PushSumMessage(self.node_id, candidates[int(i)], share, self.w, round_index)
            for i in chosen
        ]

    def receive(self, message: PushSumMessage) -> None:
        """Add a share addressed to this node.

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) the message is for another node, has another
                shape, or this node has left (the sender should :meth:`reclaim` it).
        """
        if message.receiver != self.node_id:
            raise InvalidArgument(
                f"push-sum message from {message.sender!r} is addressed to "
                f"{message.receiver!r}, not {self.node_id!r}"
            )
        self._absorb(message)

    def reclaim(self, message: PushSumMessage) -> None:
        """Take back a share this node sent that could not be delivered (conserves mass).

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) the message was sent by another node.
        """
        if message.sender != self.node_id:
            raise InvalidArgument(
                f"push-sum node {self.node_id!r} cannot reclaim a share sent by {message.sender!r}"
            )
        self._absorb(message)

    def leave(self, peers: Sequence[str], rng: np.random.Generator) -> PushSumMessage | None:
        """Leave the group, handing the whole mass ``(s, w)`` to one live peer.

        Args:
            peers: Current live peers from the directory.
            rng: Source of randomness for the choice of the heir.

        Returns:
            The hand-over message (deliver it to ``message.receiver``), or None if there is no
            peer (the last node takes the mass with it).

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) the node has already left.
        """
        self._check_live("leave")
        candidates = [p for p in dict.fromkeys(peers) if p != self.node_id]
        self.departed = True
        if not candidates:
            return None
        heir = candidates[int(rng.integers(len(candidates)))]
        mass = self.s.copy()
        mass.flags.writeable = False
        message = PushSumMessage(self.node_id, heir, mass, self.w, self.rounds)
        self.s = np.zeros_like(self.s)
        self.w = 0.0
        return message

    def _absorb(self, message: PushSumMessage) -> None:
        self._check_live("receive")
        if message.s.shape != self.s.shape:
            raise InvalidArgument(
                f"push-sum message from {message.sender!r} to {message.receiver!r} has shape "
                f"{message.s.shape}; node {self.node_id!r} averages shape {self.s.shape}"
            )
        self.s += message.s
        self.w += message.w

    def _check_live(self, action: str) -> None:
        if self.departed:
            raise InvalidArgument(f"push-sum node {self.node_id!r} has left; cannot {action}")


class GossipRound:
    """Runs synchronous push-sum rounds over in-process nodes.

    In each round every node (in id order) pushes from its state at the start of the round,
    then all shares are delivered; a share addressed to a node that is not in ``nodes`` goes
    back to its sender. Randomness comes from one seeded :class:`numpy.random.Generator`, so a
    run is reproducible.

    Args:
        fanout: Peers each node pushes to per round; ``>= 1``.
        seed: Seed (or a Generator) for peer selection.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) ``fanout < 1``.
    """

    def __init__(self, fanout: int, seed: int | np.random.Generator | None = 0) -> None:
        if fanout < 1:
            raise InvalidArgument(f"push-sum fanout must be >= 1, got {fanout}")
        self.fanout = fanout
        self.rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        self.rounds = 0

    def run(
        self,
        nodes: MutableMapping[str, PushSumNode],
        directory: Directory | None = None,
    ) -> list[PushSumMessage]:
        """Run one round.

        Args:
            nodes: Live nodes by id.
            directory: Peer lookup; default: every other node in ``nodes``.

        Returns:
            The messages of the round (delivered or returned to their senders).
        """
        lookup = directory if directory is not None else _all_others(nodes)
        messages: list[PushSumMessage] = []
        for node_id in sorted(nodes):
            messages.extend(nodes[node_id].push(lookup(node_id), self.fanout, self.rng))
        for message in messages:
            receiver = nodes.get(message.receiver)
            if receiver is not None and not receiver.departed:
                receiver.receive(message)
            else:
                nodes[message.sender].reclaim(message)
        self.rounds += 1
        return messages

    def leave(
        self,
        nodes: MutableMapping[str, PushSumNode],
        node_id: str,
        directory: Directory | None = None,
    ) -> PushSumMessage | None:
        """Remove a node between rounds, handing its mass to a live peer.

        Args:
            nodes: Live nodes by id; ``node_id`` is removed from it.
            node_id: The leaving node.
            directory: Peer lookup; default: every other node in ``nodes``. Called before the
                node is removed from any external directory.

        Returns:
            The hand-over message (already delivered), or None if it was the last node.

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) ``node_id`` is not in ``nodes``.
        """
        node = nodes.get(node_id)
        if node is None:
            raise InvalidArgument(f"push-sum node {node_id!r} is not in the group")
        lookup = directory if directory is not None else _all_others(nodes)
        peers = [p for p in lookup(node_id) if p in nodes]
        message = node.leave(peers, self.rng)
        del nodes[node_id]
        if message is not None:
            nodes[message.receiver].receive(message)
        return message


def _all_others(nodes: MutableMapping[str, PushSumNode]) -> Directory:
    def lookup(node_id: str) -> list[str]:
        return [n for n in sorted(nodes) if n != node_id]

    return lookup
