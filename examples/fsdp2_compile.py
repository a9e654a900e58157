"""The first compiled training step of an FSDP2-sharded weight_norm model: stock against paramfold.

Two ranks on a gloo group on 127.0.0.1 (CPU), each block and the root ``fully_shard``-ed, then
``paramfold.prepare`` (after ``fully_shard``, torchtitan's order) and
``torch.compile(backend="aot_eager")``. Rank 0 times the first step (forward, backward) of each
variant in a fresh compile state, rotating the order, and counts the Python calls of one more
(cProfile: a deterministic proxy of dynamo's work).

    python examples/fsdp2_compile.py                    # 8 blocks, 3 timed repeats
    python examples/fsdp2_compile.py --blocks 16 --repeats 5
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import os
import pstats
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import paramfold

VARIANTS = ("stock", "auto", "inline")
WIDTH = 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = weight_norm(nn.Linear(WIDTH, WIDTH))

    def forward(self, x):
        return torch.tanh(self.proj(x)) + x


class Model(nn.Module):
    def __init__(self, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def sharded(variant: str, blocks: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Model(blocks)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if variant != "stock":
        paramfold.prepare(model, variant)
    return model


def first_step(variant: str, blocks: int, x: torch.Tensor, profile: bool) -> tuple[float, int]:
    """Seconds of the first compiled step in a fresh compile state, and its Python calls if ``profile``."""
    torch._dynamo.reset()
    fn = torch.compile(sharded(variant, blocks), backend="aot_eager")
    dist.barrier()
    prof = cProfile.Profile() if profile else None
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        fn(x).pow(2).mean().backward()
        if prof is not None:
            prof.disable()
        seconds = time.perf_counter() - t0
    finally:
        gc.enable()
    return seconds, pstats.Stats(prof).total_calls if prof is not None else 0


def rank_main(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    try:
        torch.set_num_threads(1)
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(rank))
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        calls = {v: first_step(v, args.blocks, x, profile=True)[1] for v in VARIANTS}
        for r in range(args.repeats):
            for v in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
                times[v].append(first_step(v, args.blocks, x, profile=False)[0])
        if rank == 0:
            print(f"FSDP2, 2 ranks, {args.blocks} weight_norm blocks, aot_eager, torch {torch.__version__}: "
                  f"first compiled step, min of {args.repeats}")
            for v in VARIANTS:
                print(f"  {v:7s} {min(times[v]):7.3f} s  ({min(times[v]) / min(times['stock']):.2f}x stock)"
                      f"  Python calls {calls[v]:,}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port, args), nprocs=2)


if __name__ == "__main__":
    main()
