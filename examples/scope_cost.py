"""Where a steady call's scope spends its time, inside real calls and alone in a loop.

A prepared model's steady call opens its scope (checks the plan, claims the holders), runs the
compiled code, and closes the scope. This times each of those steps with ``perf_counter`` around
them while the seed model (eval, ``no_grad``, ``torch.compile(backend="eager")``, one thread) is
called over and over beside its plain twin, then the same scope steps again alone in a tight
loop. The difference between the two is what the model's own work costs the scope by pushing
the objects it reads out of the CPU caches. Each round also times the prepared model's calls
while a scope opened before them stays open: its compiled code alone, against plain's.

    python examples/scope_cost.py                        # freeze, freeze_check="version"
    python examples/scope_cost.py --mode auto --check content --layers 128
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import time

import torch

import paramfold
from paramfold.bench.zoo import _build_seed, unparametrize

scope = importlib.import_module("paramfold.scope")
scope_plan = importlib.import_module("paramfold.scope_plan")

STEPS = ("plan check", "claim", "release")


class Timers:
    """Seconds spent in each scope step, summed while ``on``."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys(STEPS, 0.0)
        self.on = False
        holds, claim, release = scope.holds, scope_plan.Plan.claim, scope_plan.Plan.release
        scope.holds = self._timed("plan check", holds)
        scope_plan.Plan.claim = self._timed("claim", claim)
        scope_plan.Plan.release = self._timed("release", release)

    def _timed(self, step, fn):
        def timed(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                if self.on:
                    self.spent[step] += time.perf_counter() - start

        return timed


def build(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return _build_seed(layers, width).eval().requires_grad_(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="freeze", choices=["freeze", "auto", "hoist"])
    parser.add_argument("--check", default="version", choices=["version", "content"])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--calls", type=int, default=5, help="calls per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    timers = Timers()
    plain = unparametrize(build(args.layers, args.width))
    prepared = paramfold.prepare(build(args.layers, args.width), args.mode, freeze_check=args.check)
    run_plain, run_prepared = (torch.compile(m, backend="eager") for m in (plain, prepared))
    x = torch.randn(8, args.width, dtype=torch.bfloat16)
    pairs = []
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(run_prepared(x), run_plain(x))
        if prepared.__dict__["_paramfold"].plan is None:
            raise SystemExit("this model has no steady plan (see paramfold.scope_plan.Plan.build)")
        gc.disable()
        try:
            for _ in range(args.rounds):
                times = []
                for fn, timed in ((run_plain, False), (run_prepared, True)):
                    timers.on = timed
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        fn(x)
                    times.append((time.perf_counter() - start) / args.calls)
                    timers.on = False
                # The compiled code alone: calls made while a scope opened beforehand is still
                # open (the entry is covered, so its call opens none) read the same values.
                opened = scope._open(prepared)
                start = time.perf_counter()
                for _ in range(args.calls):
                    run_prepared(x)
                times.append((time.perf_counter() - start) / args.calls)
                scope._close(*opened)
                pairs.append(times)
            inside = {step: spent / (args.rounds * args.calls) for step, spent in timers.spent.items()}
            timers.spent = dict.fromkeys(STEPS, 0.0)
            timers.on = True
            loops = 2000
            for _ in range(loops):
                scope._close(*scope._open(prepared))
            timers.on = False
            alone = {step: spent / loops for step, spent in timers.spent.items()}
        finally:
            gc.enable()
    plain_s = statistics.median(p for p, _, _ in pairs)
    print(f"seed {args.layers} layers, {args.mode}, freeze_check={args.check!r}: plain call "
          f"{plain_s * 1e6:.0f} us (median), prepared "
          f"{statistics.median(q / p for p, q, _ in pairs):.3f}x plain (median of paired rounds), "
          f"{statistics.median(q - p for p, q, _ in pairs) * 1e6:.0f} us more; its compiled code "
          f"alone (scope held open) {statistics.median(o / p for p, _, o in pairs):.3f}x plain")
    print(f"{'scope step':12s} {'in calls':>10s} {'alone':>10s}")
    for step in STEPS:
        print(f"{step:12s} {inside[step] * 1e6:8.1f} us {alone[step] * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
