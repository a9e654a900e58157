"""Per-call time of stock ``torch.export`` vs ``paramfold.export`` on three parametrized models.

Both programs are run through ``ExportedProgram.module()`` on the same input, interleaved (one call
of each in turn, so machine noise hits both alike), under ``no_grad``, one intra-op thread by default; min and median per call.

    python examples/export_bench.py            # the README table
    python examples/export_bench.py --repeats 5 --models seed   # a quick look
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

import paramfold

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def models() -> dict:
    from helpers import seed_model
    from test_export import Discriminator, Vocoder

    torch.manual_seed(0)
    return {
        "vocoder (weight_norm)": lambda: (Vocoder(channels=64).eval(), (torch.randn(1, 8, 256),)),
        "discriminator (spectral_norm)": lambda: (Discriminator().eval(), (torch.randn(8, 3, 16, 16),)),
        "seed (unsafe bf16 cast)": lambda: (seed_model(n=16, width=256), (torch.randn(8, 256, dtype=torch.bfloat16),)),
    }


def measure(model, args, repeats: int) -> dict[str, float]:
    stock = torch.export.export(model, args).module()
    folded = paramfold.export(model, args).module()
    with torch.no_grad():
        assert torch.equal(stock(*args), folded(*args))
        for _ in range(3):  # warm-up: first calls of a program allocate and dispatch slowly
            stock(*args), folded(*args)
        runs = {"stock": [], "paramfold": []}
        gc.disable()
        try:
            for _ in range(repeats):
                for name, fn in (("stock", stock), ("paramfold", folded)):
                    start = time.perf_counter()
                    fn(*args)
                    runs[name].append(time.perf_counter() - start)
        finally:
            gc.enable()
    return {
        f"{name} {stat}": fn(times) * 1e6
        for name, times in runs.items()
        for stat, fn in (("min", min), ("median", statistics.median))
    }


def main(argv: list[str] | None = None) -> list[tuple[str, dict[str, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--models", default="", help="substring selecting models")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise on a shared machine)")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    rows = []
    print("| model | stock min / median (µs) | paramfold min / median (µs) | median speed-up |")
    print("|---|---|---|---|")
    for name, make in models().items():
        if opts.models not in name:
            continue
        model, args = make()
        r = measure(model, args, opts.repeats)
        rows.append((name, r))
        print(
            f"| {name} | {r['stock min']:.0f} / {r['stock median']:.0f} | "
            f"{r['paramfold min']:.0f} / {r['paramfold median']:.0f} | "
            f"{r['stock median'] / r['paramfold median']:.2f}x |"
        )
    return rows


if __name__ == "__main__":
    main()
