"""What ``paramfold.prepare`` costs before the first compiled call: CPU time, and where it goes.

``paramfold bench`` times the first compiled call, not ``prepare`` before it (its ``--wide``
columns show prepare). For torch's own parametrizations prepare is small; a parametrization
class paramfold does not know (the seed model's ``CastToBFloat16``) is probed at prepare, a few
calls per site on copies (``paramfold.probe``). This prints prepare's CPU time on the seed model
(eval), min and median over ``--repeats`` fresh models after one uncounted prepare, the
probes' checks of the global generators per probed site (one per probe: the thread's calls of
Python's and torch's generators watched while it runs, NumPy's state read before and after it,
:class:`paramfold.held.GlobalGenerators`; a count that does not vary) and what one check costs
around an empty probe (the watch's cost per call the chain makes is in prepare's time).

    python examples/prepare_cost.py                          # 32 layers: freeze hoist
    python examples/prepare_cost.py --layers 128 --repeats 5 freeze
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import timeit

import paramfold
import paramfold.probe as probe
import paramfold.sites as sites
from paramfold.bench import BenchConfig
from paramfold.bench.config import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modes", nargs="*", default=["freeze", "hoist"])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = BenchConfig(layers=args.layers)
    paramfold.prepare(build_model(BenchConfig(layers=2)).eval(), args.modes[0])  # imports, first-use caches

    checks = []
    real = probe.GlobalGenerators

    class Counted(real):
        __slots__ = ()

        def __init__(self) -> None:
            checks.append(1)
            super().__init__()

    probe.GlobalGenerators = Counted
    try:
        model = build_model(config).eval()
        probed = sum(any(map(sites.probed, site.chain)) for site in paramfold.find(model))
    finally:
        probe.GlobalGenerators = real
    one = timeit.timeit(lambda: real().moved(), number=200) / 200
    print(f"seed model, {args.layers} layers: {probed} sites probed, "
          f"{len(checks) / max(probed, 1):.1f} generator checks per probed site, {one * 1e6:.0f} us each")

    for mode in args.modes:
        times = []
        for _ in range(args.repeats):
            model = build_model(config).eval()
            gc.collect()
            start = time.process_time()
            paramfold.prepare(model, mode)
            times.append(time.process_time() - start)
        print(f"prepare {mode:<8} CPU time  min {min(times):.3f} s  median {statistics.median(times):.3f} s")


if __name__ == "__main__":
    main()
