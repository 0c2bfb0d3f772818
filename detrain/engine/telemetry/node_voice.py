"""What a node other than node 0 says on its own terminal: that it joined, and a line per epoch for its ranks.

Rank 0 prints the run and writes its files; without this, every other node's terminal stayed empty from start to
end, so whoever watches that machine could not tell a node that trains from one that hangs. The node's lowest rank
speaks for the node (its other ranks stay quiet), from numbers every rank already has: the layout gathered at start
and the per-rank epoch numbers gathered for the straggler check. Nothing is written to disk.

>>> layout = [{"rank": 0, "node": 0, "host": "a"}, {"rank": 1, "node": 1, "host": "b"}, {"rank": 2, "node": 1,
...     "host": "b"}]
>>> voice = NodeVoice.of(1, layout)
>>> voice.joined_line(10, 0)
'node 1 (b): ranks 1-2 of 3 joined; epochs 1-10; node 0 (a) prints the run'
>>> stats = [{"rank": r, "step_s": 0.25, "wait_s": 0.05 * r} for r in range(3)]
>>> voice.epoch_line(2, 10, stats)
'node 1 epoch 3/10: ranks 1-2, 4.0 steps/s, data wait 30% (rank 2 40%)'
>>> NodeVoice.of(0, layout) is None, NodeVoice.of(2, layout) is None
(True, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from detrain.log import console


def _span(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


class NodeVoice:
    """The lines of one node's lowest rank (see the module)."""

    def __init__(self, node: int, host: str, ranks: list[int], world_size: int, main_host: str) -> None:
        self.node, self.host, self.ranks, self.world_size, self.main_host = node, host, ranks, world_size, main_host

    @classmethod
    def of(cls, rank: int, layout: list[dict[str, Any]]) -> NodeVoice | None:
        """The voice of ``rank``'s node when ``rank`` is that node's lowest and the node is not node 0, else None."""
        me = next((p for p in layout if p.get("rank") == rank), None)
        if me is None or me.get("node", 0) == 0:
            return None
        ranks = sorted(int(p["rank"]) for p in layout if p.get("node") == me["node"])
        if rank != ranks[0]:
            return None
        main = next((p for p in layout if p.get("rank") == 0), {})
        return cls(int(me["node"]), str(me.get("host", "?")), ranks, len(layout), str(main.get("host", "?")))

    def joined_line(self, epochs: int, first_epoch: int) -> str:
        return (
            f"node {self.node} ({self.host}): {_span(self.ranks)} of {self.world_size} joined; epochs "
            f"{first_epoch + 1}-{epochs}; node 0 ({self.main_host}) prints the run"
        )

    def epoch_line(self, epoch: int, epochs: int, stats: list[dict[str, Any]]) -> str:
        """``epoch`` (0-based) of ``epochs``: this node's steps per second (its slowest rank's) and data-wait share
        (the mean over its ranks, and its worst rank's where the node has several)."""
        mine = [s for s in stats if s.get("rank") in self.ranks]
        step = max((float(s.get("step_s") or 0.0) for s in mine), default=0.0)
        shares = {int(s["rank"]): float(s.get("wait_s") or 0.0) / step if step > 0 else 0.0 for s in mine}
        rate = f"{1 / step:.1f} steps/s" if step > 0 else "no steps"
        line = f"node {self.node} epoch {epoch + 1}/{epochs}: {_span(self.ranks)}, {rate}"
        if shares:
            line += f", data wait {sum(shares.values()) / len(shares):.0%}"
            if len(shares) > 1:
                worst = max(shares, key=lambda r: shares[r])
                line += f" (rank {worst} {shares[worst]:.0%})"
        return line

    def joined(self, epochs: int, first_epoch: int) -> None:
        console.print(self.joined_line(epochs, first_epoch))

    def epoch(self, epoch: int, epochs: int, stats: list[dict[str, Any]]) -> None:
        console.print(self.epoch_line(epoch, epochs, stats))
