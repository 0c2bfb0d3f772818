"""How a checkpoint's per-rank state grows with the world: ``last.pt``'s size and the bytes each rank receives per
save, at 1, 2, 4, 8 and 16 ranks of a model (issue 36 item 3).

Before: every save carried, per rank, its random generators and (in a group) its model's and EMA's floating buffers
(BatchNorm statistics), in one ``all_gather_object`` of every rank's state to every rank (each rank received and
unpickled W - 1 pickled states). Now: the ranks take rank 0's BatchNorm statistics at each update
(distributed/parallel.share_main_buffers), so only the generators are per rank, and one tensor ``gather`` brings each
rank's packed as bytes to rank 0 (engine/train/state/rank_state.py); the other ranks receive nothing.

The sizes are those of the real payloads of this model (its buffers, this process's generators): the pickled
state as ``all_gather_object`` sent it, the packed tensor as ``gather`` sends it, and a checkpoint holding W ranks'
entries as ``torch.save`` writes it (model, EMA, SGD optimizer state, the per-rank entries).

    python scripts/bench_rank_state.py --model n.yaml
"""

from __future__ import annotations

import argparse
import copy
import io
import pickle

import torch

from detrain.engine.train.reproduce import rng_state
from detrain.engine.train.state import rank_state
from detrain.nn.model import DetectionModel

WORLDS = (1, 2, 4, 8, 16)


def float_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    saved = module.state_dict()
    return {k: v.detach().clone() for k, v in module.named_buffers() if v.is_floating_point() and k in saved}


def per_rank(model: torch.nn.Module, ema: torch.nn.Module, buffers: bool) -> dict:
    """One rank's entry: its generators, and (before, in a group) its model's and EMA's floating buffers."""
    mine: dict = {"rng": rng_state()}
    if buffers:
        mine["buffers"] = {"model": float_buffers(model), "ema": float_buffers(ema)}
    return mine


def checkpoint_bytes(model: torch.nn.Module, ema: torch.nn.Module, world: int, buffers: bool) -> int:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # momentum buffers, as a checkpoint after training has them
    # each rank's entry its own tensors (torch.save stores a storage shared by several entries once)
    ranks = [copy.deepcopy(per_rank(model, ema, buffers and world > 1)) for _ in range(world)]
    state = {
        "model": {"state_dict": model.state_dict()},
        "ema": {"state_dict": ema.state_dict()},
        "optimizer": optimizer.state_dict(),
        "rng_per_rank": {str(r): ranks[r]["rng"] for r in range(world)},
    }
    if buffers and world > 1:
        state["buffers_per_rank"] = {str(r): ranks[r]["buffers"] for r in range(1, world)}
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.tell()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="n.yaml")
    args = p.parse_args()
    model = DetectionModel(args.model, nc=80)
    ema = copy.deepcopy(model)
    pickled = len(pickle.dumps(per_rank(model, ema, True)))
    packed = rank_state.packed_size(per_rank(model, ema, False))
    base = checkpoint_bytes(model, ema, 1, False)
    print(
        f"model {args.model} (nc=80); one rank's state: before {pickled / 1e3:.1f} kB pickled (generators and "
        f"buffers), now {packed / 1e3:.1f} kB packed (generators)"
    )
    print()
    print(
        "| ranks | before: last.pt MB | now: last.pt MB | now vs 1 rank | before: MB received per rank per save "
        "| now: rank 0 MB | now: other ranks |"
    )
    print("|---|---|---|---|---|---|---|")
    for w in WORLDS:
        old, size = checkpoint_bytes(model, ema, w, True), checkpoint_bytes(model, ema, w, False)
        before = (w - 1) * pickled / 1e6
        print(
            f"| {w} | {old / 1e6:.2f} | {size / 1e6:.2f} | {size / base:.3f}x | {before:.2f} "
            f"| {(w - 1) * packed / 1e6:.3f} | 0 |"
        )


if __name__ == "__main__":
    main()
