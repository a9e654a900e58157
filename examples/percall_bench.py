"""Steady per-call time of the seed model: plain vs stock vs paramfold modes, side by side.

Eval, ``no_grad``, ``torch.compile(backend="eager")``, one thread: the steady phase of
``paramfold bench`` (every variant compiled with code of its own and warmed up, then timed in
interleaved rounds; median and min reported, as ratios to plain, and the median of each round's
ratio to plain's in the same round, ``paired``, which a drifting machine moves least), for modes with options too: a
mode may carry its freeze check, ``freeze:version``. Each variant's first output is checked equal
to stock's.

    python examples/percall_bench.py                      # freeze freeze:version auto hoist
    python examples/percall_bench.py --layers 8 auto
    python examples/percall_bench.py --trainable hoist auto   # parameters left requiring grad
"""

from __future__ import annotations

import argparse
import dataclasses

import paramfold
from paramfold.bench import BenchConfig, Variant, default_variants, run_bench


def mode_variant(spec: str) -> Variant:
    """``"freeze:version"`` -> ``prepare(model, "freeze", freeze_check="version")``."""
    mode, _, check = spec.partition(":")
    options = {"freeze_check": check} if check else {}
    return Variant(spec, lambda model: paramfold.prepare(model, mode, **options), f"prepare {spec}")


def _trainable(prepare):
    return lambda model: prepare(model.requires_grad_(True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modes", nargs="*", default=["freeze", "freeze:version", "auto", "hoist"])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20, help="calls per round")
    parser.add_argument("--trainable", action="store_true",
                        help="leave the parameters requiring grad (model.eval() and no_grad only, as "
                             "inference code usually does); freeze refuses such a model")
    args = parser.parse_args()
    config = BenchConfig(layers=args.layers, steady_rounds=args.rounds, steady_calls=args.calls,
                         warmup_calls=3)
    plain_and_stock = [v for v in default_variants() if v.name in ("baseline", "stock")]
    variants = [*plain_and_stock, *map(mode_variant, args.modes)]
    if args.trainable:
        variants = [dataclasses.replace(v, prepare=_trainable(v.prepare)) for v in variants]
    result = run_bench(config, variants=variants, first_calls=False)
    for v in result.variants:
        assert v.status == "ok" and v.steady_max_abs_diff == 0.0, (v.name, v.note)
        name = "plain" if v.name == "baseline" else v.name
        print(f"{name:16s} median {v.steady_call_median * 1e3:7.3f} ms  "
              f"min {v.steady_call_min * 1e3:7.3f} ms  "
              f"x plain {result.ratio(v.name, 'steady_median'):5.2f}  "
              f"paired {result.ratio(v.name, 'steady_paired'):5.2f}")


if __name__ == "__main__":
    main()
