"""Would hoisted chains run faster as compiled code? The experiment behind README's answer (no, on CPU).

hoist computes each parametrized tensor eagerly before the compiled graph runs. The idea tried
here: one ``torch.compile``d function per chain signature, shared by every site (dynamo compiles
it once for all same-shape layers), called instead of the eager chain in the steady call path.
It is an experiment, patched into paramfold's private call-scope code, not a mode.

Two measurements on spectral_norm N x Linear(W, W), training (forward + backward):

* per site: forward and backward of the chain alone, eager against compiled;
* per step: the steady phase of ``paramfold bench --model spectral_norm --train`` (interleaved
  rounds, medians as ratios to plain) for plain, stock, inline, hoist and hoist with compiled
  chains, all compiled with the same backend.

    python examples/compiled_chain_bench.py                     # inductor, 16 x 64
    python examples/compiled_chain_bench.py --backend aot_eager
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
import weakref

import torch

import paramfold
from paramfold.bench import BenchConfig, Variant, default_variants, run_bench
from paramfold.bench.zoo import _build_spectral_norm
from paramfold.frames import run_eagerly_as_frame
from paramfold.scope_plan import Plan

scope = importlib.import_module("paramfold.scope")


def chain_value(chain, originals):
    value = chain[0](*originals)
    for module in chain[1:]:
        value = module(value)
    return value


class CompiledChains:
    """For the models in ``models``, the steady call path computes hoisted values with
    ``compiled(chain, originals)``; every other prepared model keeps paramfold's eager chains."""

    def __init__(self, compiled):
        self.compiled, self.models, self.calls = compiled, weakref.WeakSet(), 0
        self._on, self._pending = False, []
        self._claim, self._open = Plan.claim, scope._open
        Plan.claim = lambda plan: self._claim_then_defer(plan)
        # Where the scope opens (with dynamo's callback off, under torch.compile(model)); the
        # compiled chains then run as frames of their own (a compiled function sets its callback).
        scope._open = run_eagerly_as_frame(self._open_then_compute)

    def _claim_then_defer(self, plan):
        if not self._on:
            return self._claim(plan)
        plan.enter()
        self._pending.append(plan.hoisted)

    def _open_then_compute(self, entry):
        self._on = entry in self.models
        try:
            opened = self._open(entry)
        finally:
            self._on = False
        while self._pending:
            for values, name, _holder, originals, chain, *_ in self._pending.pop():
                values[name] = self.compiled(chain, [d[k] for d, k in originals])
                self.calls += 1
        return opened


def per_site(compiled, layers: int, width: int, repeats: int) -> None:
    torch.manual_seed(0)
    model = paramfold.prepare(_build_spectral_norm(layers, width), "hoist")
    sites = [layer.linear._paramfold.sites["weight"] for layer in model.seq]

    def run(fn):
        t0 = time.perf_counter()
        values = [fn(s.chain, [d[k] for d, k in s.originals]) for s in sites]
        t1 = time.perf_counter()
        torch.autograd.backward(values, [torch.ones_like(v) for v in values])
        return (t1 - t0) / len(sites), (time.perf_counter() - t1) / len(sites)

    for name, fn in (("eager chain", chain_value), ("compiled chain", compiled)):
        for _ in range(3):
            run(fn)
        times = [run(fn) for _ in range(repeats)]
        fwd, bwd = (statistics.median(t[i] for t in times) * 1e6 for i in (0, 1))
        print(f"per site  {name:15s} forward {fwd:6.1f} us  backward {bwd:6.1f} us")


def per_step(chains: CompiledChains, args) -> None:
    """The steady phase of ``paramfold bench --train`` with one more variant."""

    def hoist_with_compiled_chains(model):
        chains.models.add(paramfold.prepare(model, "hoist"))
        return model

    config = BenchConfig(model="spectral_norm", layers=args.layers, width=args.width, backend=args.backend,
                         train=True, steady_rounds=args.rounds, steady_calls=args.steps, warmup_calls=3)
    variants = [v for v in default_variants() if v.name in ("baseline", "stock", "inline", "hoist")]
    variants.append(Variant("hoist+compiled chains", hoist_with_compiled_chains, "hoist, chains compiled"))
    result = run_bench(config, variants=variants, first_calls=False)
    for v in result.variants:
        assert v.status == "ok", (v.name, v.note)
        name = "plain" if v.name == "baseline" else v.name
        print(f"per step  {name:22s} median {v.steady_call_median * 1e3:7.3f} ms  "
              f"x plain {result.ratio(v.name, 'steady_median'):5.2f}")
    assert chains.calls, "the compiled chains were never used"
    print(f"compiled chain calls: {chains.calls}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20, help="training steps per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    compiled = torch.compile(chain_value, backend=args.backend)
    chains = CompiledChains(compiled)
    per_site(compiled, args.layers, args.width, repeats=10 * args.rounds)
    per_step(chains, args)


if __name__ == "__main__":
    main()
