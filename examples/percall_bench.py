"""Steady per-call time of the seed model: plain vs stock vs paramfold modes, side by side.

Eval, ``no_grad``, ``torch.compile(backend="eager")``, one thread; every variant is compiled and
warmed up first, then timed in interleaved rounds (median and min reported, as ratios to plain).
A mode may carry its freeze check: ``freeze:version``.

    python examples/percall_bench.py                      # freeze freeze:version auto hoist
    python examples/percall_bench.py --layers 8 auto
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import paramfold
from paramfold.bench import BenchConfig, build_model, make_input, unparametrize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modes", nargs="*", default=["freeze", "freeze:version", "auto", "hoist"])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20, help="calls per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = BenchConfig(layers=args.layers)
    x = make_input(config)

    def fresh() -> torch.nn.Module:
        torch.manual_seed(0)
        return build_model(config).eval().requires_grad_(False)

    variants = {"plain": unparametrize(fresh()), "stock": fresh()}
    for spec in args.modes:
        mode, _, check = spec.partition(":")
        variants[spec] = paramfold.prepare(fresh(), mode, **({"freeze_check": check} if check else {}))
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        compiled = {name: torch.compile(model, backend="eager") for name, model in variants.items()}
        expected = compiled["plain"](x)
        for name, fn in compiled.items():
            for _ in range(3):
                out = fn(x)
            assert torch.equal(out, expected), name  # same values as the plain model
        for _ in range(args.rounds):
            for name, fn in compiled.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn(x)
                times[name].append((time.perf_counter() - start) / args.calls)
    plain = statistics.median(times["plain"])
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:16s} median {median * 1e3:7.3f} ms  min {min(samples) * 1e3:7.3f} ms  x plain {median / plain:5.2f}")


if __name__ == "__main__":
    main()
