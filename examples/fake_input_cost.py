"""What dynamo pays, per graph input, for a tensor with an autograd history.

In grad mode a hoisted value is a non-leaf tensor that requires grad (it was computed from the
originals). When dynamo compiles, it turns every graph input into a fake tensor, and for such an
input it also fakes an autograd history (``MetaConverter._backward_error``: an autograd node
applied under ``FakeTensorMode``, two more dispatched ops per input). The plain model's
Parameters are leaves and skip that. This times ``FakeTensorMode().from_tensor`` alone, on the
seed's kind of input (a ``(width, width)`` bf16 cast of a float32 leaf), as leaves and as
non-leaves: the difference, times the number of hoisted inputs, is what a first compiled call in
grad mode cost more than under ``no_grad`` before paramfold handed dynamo leaf stand-ins while it
compiles (``paramfold/compile_leaves.py``).

    python examples/fake_input_cost.py                  # 64 inputs, as many as the seed hoists
    python examples/fake_input_cost.py --inputs 512 --rounds 5
"""

from __future__ import annotations

import argparse
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


def fakeify_seconds(tensors: list[torch.Tensor], rounds: int) -> float:
    """Fastest of ``rounds``: seconds to fake every tensor in a fresh ``FakeTensorMode``."""
    best = float("inf")
    for _ in range(rounds):
        mode = FakeTensorMode()
        t0 = time.perf_counter()
        for t in tensors:
            mode.from_tensor(t)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=64, help="graph inputs (the seed hoists 64)")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=20, help="the fastest round is reported")
    args = parser.parse_args()
    torch.set_num_threads(1)
    original = torch.randn(args.width, args.width, requires_grad=True)
    non_leaves = [original.to(torch.bfloat16) for _ in range(args.inputs)]
    leaves = [v.detach().requires_grad_() for v in non_leaves]
    assert all(not v.is_leaf for v in non_leaves) and all(v.is_leaf for v in leaves)
    # Alternate, so a change of machine speed falls on both.
    times = {"leaves": [], "non-leaves": []}
    for _ in range(2):
        times["leaves"].append(fakeify_seconds(leaves, args.rounds))
        times["non-leaves"].append(fakeify_seconds(non_leaves, args.rounds))
    leaf, non_leaf = min(times["leaves"]), min(times["non-leaves"])
    print(f"torch {torch.__version__}: faking {args.inputs} inputs of ({args.width}, {args.width}) bf16, "
          f"fastest of {2 * args.rounds} rounds")
    print(f"  leaves (the plain model's Parameters): {leaf * 1e3:7.2f} ms")
    print(f"  non-leaves (hoisted values, grad mode): {non_leaf * 1e3:7.2f} ms")
    print(f"  extra per non-leaf input: {(non_leaf - leaf) / args.inputs * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
