"""Would hoisted chains run faster as compiled code? The experiment behind README's answer (no, on CPU).

hoist computes each parametrized tensor eagerly before the compiled graph runs. The idea tried
here: one ``torch.compile``d function per chain signature, shared by every site (dynamo compiles
it once for all same-shape layers), called instead of the eager chain in the steady call path.
It is an experiment, patched into paramfold's private call-scope code, not a mode.

Two measurements on spectral_norm N x Linear(W, W), training (forward + backward):

* per site: forward and backward of the chain alone, eager against compiled;
* per step: plain, stock, inline, hoist and hoist with compiled chains, compiled with the same
  backend, interleaved rounds, medians as ratios to plain.

    python examples/compiled_chain_bench.py                     # inductor, 16 x 64
    python examples/compiled_chain_bench.py --backend aot_eager
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch
from torch.nn.utils import parametrize

import paramfold
from paramfold.bench.measure import own_code
from paramfold.bench.zoo import _build_spectral_norm
from paramfold.frames import run_eagerly_as_frame

scope = importlib.import_module("paramfold.scope")


def chain_value(chain, originals):
    value = chain[0](*originals)
    for module in chain[1:]:
        value = module(value)
    return value


class CompiledChains:
    """While ``on``, the steady call path computes hoisted values with ``compiled(chain, originals)``."""

    def __init__(self, compiled):
        self.compiled, self.on, self.calls, self.pending = compiled, False, 0, []
        self._claim, self._open_scope = scope._Plan.claim, scope._open_scope
        scope._Plan.claim = lambda plan: self._claim_then_defer(plan)
        # The compiled call must run outside the disabled scope code, as a frame dynamo skips.
        scope._open_scope = run_eagerly_as_frame(self._open_then_compute)

    def _claim_then_defer(self, plan):
        if not self.on:
            return self._claim(plan)
        for holder, hs, _, _, installed, shareable in plan.holders:
            object.__setattr__(holder, "__class__", hs.prepared_class)
            hs.users, hs.installed, hs.shareable = 1, installed, shareable
        self.pending.append(plan.hoisted)
        return plan.claimed

    def _open_then_compute(self, entry):
        opened = self._open_scope(entry)
        while self.pending:
            for values, name, _holder, originals, chain in self.pending.pop():
                values[name] = self.compiled(chain, [d[k] for d, k in originals])
                self.calls += 1
        return opened


def build(kind: str, layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = own_code(_build_spectral_norm(layers, width))
    if kind == "plain":
        for layer in model.seq:
            parametrize.remove_parametrizations(layer.linear, "weight")
    elif kind == "inline":
        paramfold.prepare(model, "inline")
    elif kind.startswith("hoist"):
        paramfold.prepare(model, "hoist")
    return model


def per_site(compiled, layers: int, width: int, repeats: int) -> None:
    model = build("hoist", layers, width)
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
    x = torch.randn(8, args.width)
    kinds = ["plain", "stock", "inline", "hoist", "hoist+compiled chains"]
    models = {}
    for kind in kinds:
        model = build(kind, args.layers, args.width)
        fn = torch.compile(model, backend=args.backend)
        chains.on = kind == "hoist+compiled chains"
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            fn(x).mean().backward()
        models[kind] = (model, fn)
    rounds = {kind: [] for kind in kinds}
    for r in range(args.rounds):
        for kind in kinds[r % len(kinds):] + kinds[: r % len(kinds)]:
            model, fn = models[kind]
            chains.on = kind == "hoist+compiled chains"
            t0 = time.perf_counter()
            for _ in range(args.steps):
                model.zero_grad(set_to_none=True)
                fn(x).mean().backward()
            rounds[kind].append((time.perf_counter() - t0) / args.steps)
    chains.on = False
    plain = statistics.median(rounds["plain"])
    for kind in kinds:
        median = statistics.median(rounds[kind])
        print(f"per step  {kind:22s} median {median * 1e3:7.3f} ms  x plain {median / plain:5.2f}")
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
