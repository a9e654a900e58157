"""Steady per-call work of the seed model, counted in CPU instructions: plain vs paramfold modes.

Wall-clock timings on a shared 2-core VM move by 15% or more between runs; instruction counts do
not. Each variant runs twice under valgrind's callgrind (same build, compile and warm-up, then
``--calls`` A and B steady calls: eval, ``no_grad``, ``torch.compile(backend="eager")``, one
thread), counting only the steady calls (a two-line C shim, built with ``gcc`` against
valgrind's ``callgrind.h``, switches counting on and off); the difference of the two counts
divided by B - A is one steady call. Needs ``valgrind`` and ``gcc``; about a minute per variant.

    python examples/percall_instructions.py                        # plain stock freeze freeze:version auto hoist
    python examples/percall_instructions.py --layers 8 plain freeze:version
    python examples/percall_instructions.py --scenario update plain stock freeze auto
    python examples/percall_instructions.py --uncompiled plain stock auto   # eager calls, no torch.compile
    python examples/percall_instructions.py --cache plain freeze   # also data cache misses per call

Instructions are not time (the matmuls run many per cycle, the per-call checks touch memory the
forward evicted), so read the ratios as the share of work, next to the timed ratios of
``examples/percall_bench.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile

DEFAULT = ["plain", "stock", "freeze", "freeze:version", "auto", "hoist"]


#: What happens between calls: nothing (``steady``); every parameter ``add_(1e-6)`` under
#: ``no_grad`` before a ``no_grad`` call, as an EMA or target model is updated (``update``);
#: ``no_grad`` and grad calls in turn, weights unchanged, as rollouts between training steps
#: (``alternate``; freeze, inference only, makes only ``no_grad`` calls).
SCENARIOS = ("steady", "update", "alternate")


def _calls(variant: str, layers: int, calls: int, scenario: str = "steady", uncompiled: bool = False) -> None:
    """The measured program: build, compile, warm up, then ``calls`` calls of ``scenario``."""
    import gc

    import torch

    import paramfold
    from paramfold.bench import BenchConfig
    from paramfold.bench.config import build_model, make_input
    from paramfold.bench.measure import compile_model, own_code
    from paramfold.bench.variants import default_variants

    torch.set_num_threads(1)
    config = BenchConfig(layers=layers)
    stock = {v.name: v.prepare for v in default_variants()}
    mode, _, check = variant.partition(":")
    if variant == "plain":
        prepare = stock["baseline"]
    elif variant == "stock":
        prepare = stock["stock"]
    else:
        prepare = lambda m: paramfold.prepare(m, mode, **({"freeze_check": check} if check else {}))  # noqa: E731
    model = prepare(own_code(build_model(config)))
    fn = model if uncompiled else compile_model(model, config)
    x = make_input(config)
    params = list(model.parameters())
    grad_modes = (False, True) if scenario == "alternate" and mode != "freeze" else (False,)

    def call(i: int) -> None:
        if scenario == "steady":  # inside one no_grad block, below
            fn(x)
            return
        if scenario == "update":
            with torch.no_grad():
                for p in params:
                    p.add_(1e-6)
        with torch.set_grad_enabled(grad_modes[i % len(grad_modes)]):
            fn(x)

    shim = ctypes.CDLL(os.environ["PARAMFOLD_CALLGRIND_SHIM"])
    with torch.no_grad() if scenario == "steady" else contextlib.nullcontext():
        for i in range(5 if scenario == "steady" else 40):  # past compiling, and freeze's first periods
            call(i)
        gc.collect()
        gc.disable()
        shim.start()
        for i in range(calls):
            call(i)
        shim.stop()


_SHIM = """#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void stop(void) { CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION; }
"""


def _shim(folder: str) -> str:
    source, library = os.path.join(folder, "shim.c"), os.path.join(folder, "shim.so")
    with open(source, "w") as f:
        f.write(_SHIM)
    done = subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", library, source], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"could not build the callgrind shim (valgrind's headers?):\n{done.stderr}")
    return library


#: What ``--cache`` reports of callgrind's cache simulation: instructions, first-level data read
#: misses, last-level data read misses (callgrind's event names).
CACHE_EVENTS = ("Ir", "D1mr", "DLmr")


def _instructions(variant: str, layers: int, calls: int, shim: str, scenario: str = "steady",
                  uncompiled: bool = False, cache: bool = False) -> tuple[int, ...]:
    """The counts of ``calls`` steady calls: ``(instructions,)``, or with ``cache`` those of
    :data:`CACHE_EVENTS` (valgrind's simulated caches)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONHASHSEED": "0", "PARAMFOLD_CALLGRIND_SHIM": shim}
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={tmp}/out",
               *(["--cache-sim=yes"] if cache else []),
               sys.executable, __file__, "--run", variant, "--layers", str(layers), "--calls", str(calls),
               "--scenario", scenario, *(["--uncompiled"] if uncompiled else [])]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        dumps = [f for f in os.listdir(tmp) if f.startswith("out.")]  # the one the shim's stop() wrote
        if done.returncode != 0 or len(dumps) != 1:
            raise SystemExit(f"{variant}: the measured run failed:\n{done.stderr[-2000:]}")
        with open(os.path.join(tmp, dumps[0])) as f:
            text = f.read()
        events = re.search(r"^events: (.+)$", text, re.MULTILINE)
        found = re.search(r"^(?:summary|totals): ([\d ]+)$", text, re.MULTILINE)
        if found is None or events is None:
            raise SystemExit(f"{variant}: callgrind wrote no total")
        counts = dict(zip(events.group(1).split(), map(int, found.group(1).split())))
        return tuple(counts[e] for e in CACHE_EVENTS) if cache else (counts["Ir"],)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", default=DEFAULT)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--calls", default="10,30", help="the two numbers of steady calls, A,B")
    parser.add_argument("--scenario", choices=SCENARIOS, default="steady",
                        help="what happens between calls (see SCENARIOS in the source)")
    parser.add_argument("--uncompiled", action="store_true", help="call the models eagerly, without torch.compile")
    parser.add_argument("--cache", action="store_true",
                        help="also simulate the caches: first- and last-level data read misses per call "
                             "(the memory a call's checks touch that its matmuls evicted; several times slower)")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # the measured program itself
    args = parser.parse_args()
    if args.run:
        _calls(args.run, args.layers, int(args.calls), args.scenario, args.uncompiled)
        return
    low, high = map(int, args.calls.split(","))
    for tool in ("valgrind", "gcc"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not on the PATH (Debian: apt-get install valgrind gcc)")
    per_call = {}
    with tempfile.TemporaryDirectory() as tmp:
        shim = _shim(tmp)
        for variant in args.variants:
            counts = [_instructions(variant, args.layers, n, shim, args.scenario, args.uncompiled, args.cache)
                      for n in (high, low)]
            per_call[variant] = [(a - b) / (high - low) for a, b in zip(*counts)]
    base = per_call.get("plain")
    for variant, ns in per_call.items():
        ratio = f"  x plain {ns[0] / base[0]:5.3f}" if base else ""
        line = f"{variant:16s} {ns[0]:14,.0f} instructions per call{ratio}"
        for name, n, b in zip(CACHE_EVENTS[1:], ns[1:], base[1:] if base else [None] * 2):
            line += f"  {name} {n:9,.0f}" + (f" (+{n - b:,.0f})" if b is not None else "")
        print(line)


if __name__ == "__main__":
    main()
