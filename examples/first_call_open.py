"""Where paramfold's own time goes in the first compiled call: the scope's open, timed inside it.

The first compiled call of a prepared model opens a call scope before dynamo compiles: it computes
every value (hoist), or computes, fingerprints and checks it (freeze, auto), and builds the steady
plan that later calls check instead (``scope._replan``). This times those two parts inside the
first call of the seed model (eval, ``no_grad``, ``torch.compile(backend="eager")``, one thread),
each variant built afresh after ``torch._dynamo.reset()``, best of ``--repeats`` by the whole call,
after one uncounted round. The whole call is mostly dynamo's compile, which ``paramfold bench``
measures against the plain model.

    python examples/first_call_open.py                       # 128 layers: hoist freeze auto
    python examples/first_call_open.py --layers 512 hoist freeze
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import Counter

import torch

import paramfold
from paramfold import scope
from paramfold.bench import BenchConfig
from paramfold.bench.config import build_model, make_input
from paramfold.bench.measure import compile_model, own_code

PARTS = {"_open_holders": "values", "_replan": "plan"}


def _timed(spent: Counter) -> None:
    """Wrap the scope's parts (run eagerly inside its disabled open) so that each adds its time to ``spent``."""
    for name, label in PARTS.items():
        inner = getattr(scope, name)

        def timed(*args, _inner=inner, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_label] += time.perf_counter() - start

        setattr(scope, name, timed)


def first_call(mode: str, config: BenchConfig, spent: Counter) -> tuple[float, dict[str, float]]:
    """Seconds of the first compiled call of the seed model prepared with ``mode``, and of its parts."""
    torch._dynamo.reset()
    gc.collect()
    model = paramfold.prepare(own_code(build_model(config)), mode)
    fn, x = compile_model(model, config), make_input(config)
    spent.clear()
    with torch.no_grad():
        start = time.perf_counter()
        fn(x)
        total = time.perf_counter() - start
    return total, dict(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modes", nargs="*", default=["hoist", "freeze", "auto"])
    parser.add_argument("--layers", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = BenchConfig(model="seed", layers=args.layers, backend="eager")
    spent: Counter = Counter()
    _timed(spent)
    for mode in args.modes:  # the first compile in a process also pays one-time set-up: not counted
        first_call(mode, config, spent)
    print(f"first compiled call, seed model, {args.layers} layers ({2 * args.layers} sites), eval, no_grad; "
          f"best of {args.repeats}; torch {torch.__version__}")
    for mode in args.modes:
        total, parts = min((first_call(mode, config, spent) for _ in range(args.repeats)), key=lambda r: r[0])
        shown = "  ".join(f"{label} {parts.get(label, 0.0) * 1e3:7.1f} ms" for label in PARTS.values())
        print(f"  {mode:<7} call {total * 1e3:8.1f} ms   scope open: {shown}")


if __name__ == "__main__":
    main()
