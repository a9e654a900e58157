"""The first compiled call's work, counted in Python function calls: plain vs stock vs paramfold modes.

Wall-clock compile times on a shared 2-core VM move by 20% or more between runs; the number of
Python function calls dynamo makes while it compiles and runs the first call does not (it is the
same from run to run, for a given torch). Each variant is built afresh after
``torch._dynamo.reset()``, compiled with ``torch.compile(model, backend=...)`` and called once
under ``cProfile``, after one uncounted round of every variant (the first compile in a process
also pays one-time set-up); the count is ``pstats.Stats.total_calls``. Calls are not time (a C call into
the fake-tensor machinery costs more than a dict lookup), so read the ratios as the share of
tracing work, next to the timed ratios of ``paramfold bench``.

    python examples/compile_python_calls.py                         # seed model, eval, all modes
    python examples/compile_python_calls.py --grad inline hoist     # a forward that records autograd
    python examples/compile_python_calls.py --layers 2 plain inline
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats

import torch

import paramfold
from paramfold.bench import BenchConfig
from paramfold.bench.config import build_model, make_input
from paramfold.bench.measure import compile_model, own_code
from paramfold.bench.variants import default_variants

DEFAULT = ["plain", "stock", "hoist", "inline", "freeze", "auto"]


def python_calls(variant: str, config: BenchConfig) -> int:
    """Python function calls made by the first compiled call of ``variant`` on ``config``'s model."""
    stock = {v.name: v.prepare for v in default_variants()}
    if variant in ("plain", "stock"):
        prepare = stock["baseline" if variant == "plain" else "stock"]
    else:
        prepare = lambda m: paramfold.prepare(m, variant)  # noqa: E731
    torch._dynamo.reset()
    gc.collect()
    model = prepare(own_code(build_model(config)))
    fn = compile_model(model, config)
    x = make_input(config)
    profile = cProfile.Profile()
    with torch.set_grad_enabled(config.grad):
        profile.enable()
        fn(x)
        profile.disable()
    return pstats.Stats(profile).total_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", default=DEFAULT)
    parser.add_argument("--model", default="seed")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--grad", action="store_true", help="training mode, recording autograd (freeze skipped)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = BenchConfig(model=args.model, layers=args.layers, backend=args.backend, grad=args.grad)
    variants = [v for v in args.variants if not (args.grad and v == "freeze")]
    if "plain" not in variants:
        variants.insert(0, "plain")
    for v in variants:  # the first compile in a process also pays one-time set-up: not counted
        python_calls(v, config)
    counts = {v: python_calls(v, config) for v in variants}
    print(f"first compiled call, Python function calls  (model={args.model} layers={config.n_layers} "
          f"backend={args.backend} {'grad' if args.grad else 'eval, no_grad'}; torch {torch.__version__})")
    for v, n in counts.items():
        print(f"  {v:<8} {n:>10,}  x plain {n / counts['plain']:.3f}")


if __name__ == "__main__":
    main()
