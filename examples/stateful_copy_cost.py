"""What copying a training spectral_norm's state costs a steady training step.

hoist and auto copy the buffers of every training stateful chain before computing its value, to
put them back where the call does not read it (``paramfold/unread.py``). This times steady
training steps (forward, backward) of a stack of spectral_norm Linear layers with the copies on
and off, switched on the same steady plan, interleaved round by round in one process, and counts
the Python calls of one step each way (``sys.setprofile``, deterministic).

    python examples/stateful_copy_cost.py                    # eager model, 16 layers
    python examples/stateful_copy_cost.py --backend eager    # torch.compile(model, backend="eager")
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

import paramfold
from paramfold.state import STATE_ATTR


def _calls(step) -> int:
    count = [0]

    def profile(frame, event, arg):
        if event == "call":
            count[0] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return count[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--mode", default="auto", choices=["auto", "hoist"])
    parser.add_argument("--backend", default=None, help="torch.compile backend (default: the eager model)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [m for _ in range(args.layers) for m in (spectral_norm(nn.Linear(args.width, args.width)), nn.Tanh())]
    model = paramfold.prepare(nn.Sequential(*layers), args.mode)
    run = torch.compile(model, backend=args.backend) if args.backend else model
    x = torch.randn(8, args.width)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        run(x).square().sum().backward()

    for _ in range(5):
        step()
    plan = model.__dict__[STATE_ATTR].plan
    if plan is None or not plan.copied_sites:
        raise SystemExit("no steady plan with copied state: nothing to measure")
    on, off = plan.copied_sites, ()
    calls = {}
    times: dict[str, list[float]] = {"copies on": [], "copies off": []}
    try:
        for label, sites in (("copies on", on), ("copies off", off)):
            plan.copied_sites = sites
            calls[label] = _calls(step)
        for r in range(args.rounds):
            order = (("copies on", on), ("copies off", off))
            for label, sites in order if r % 2 else order[::-1]:
                plan.copied_sites = sites
                step()
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                times[label].append((time.perf_counter() - start) / args.steps * 1e3)
    finally:
        plan.copied_sites = on
    if model.__dict__[STATE_ATTR].plan is not plan:
        raise SystemExit("the plan was rebuilt during the measurement: rerun")
    for label, values in times.items():
        print(f"{label:11s} min {min(values):.3f} ms  median {statistics.median(values):.3f} ms  "
              f"Python calls per step {calls[label]}")
    print(f"copies on / off: min {min(times['copies on']) / min(times['copies off']):.3f}x  "
          f"median {statistics.median(times['copies on']) / statistics.median(times['copies off']):.3f}x  "
          f"({len(on)} sites, {args.layers} layers, backend {args.backend or 'none (eager model)'})")


if __name__ == "__main__":
    main()
