"""The order of a run: which variants, in what order, how many times (:func:`run_bench`).

For every repeat the variants are measured one after the other (their order rotates from repeat
to repeat), each from a fresh ``torch._dynamo.reset()``, after one discarded warm-up round of
every variant. A variant that fails is recorded and the others still run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from paramfold.bench.config import BenchConfig, make_input
from paramfold.bench.measure import _environment, _max_abs_diff, _measure, _metrics_limit, _num_threads
from paramfold.bench.result import BenchResult, VariantResult
from paramfold.bench.variants import Variant, default_variants

__all__ = ["run_bench"]


def run_bench(
    config: BenchConfig,
    *,
    variants: Sequence[Variant] | None = None,
    on_progress: Callable[[int, int, str], None] | None = None,
) -> BenchResult:
    """Measure every variant of ``config`` side by side and return the samples.

    ``variants`` defaults to :func:`default_variants` filtered by ``config.variants`` (baseline and
    stock are always kept).  ``on_progress(done, total, label)`` is called before each measurement
    and once at the end.  A variant that fails is recorded with ``status="error"`` and the others
    still run.

    Example::

        >>> r = run_bench(BenchConfig(model="weight_norm", layers=2, repeats=1, steady_calls=1,
        ...                           variants=("baseline", "stock")))
        >>> r.variant("baseline").proxies.graph_breaks
        0
    """
    config.check_device()
    if variants is None:
        variants = default_variants()
    wanted = None if config.variants is None else {"baseline", "stock", *config.variants}
    variants = [v for v in variants if wanted is None or v.name in wanted]
    names = [v.name for v in variants]
    if "baseline" not in names or "stock" not in names:
        raise ValueError("variants must include 'baseline' and 'stock'")

    results = {v.name: VariantResult(v.name, v.description) for v in variants}
    active: list[Variant] = []
    for v in variants:
        if v.unavailable:
            results[v.name].status, results[v.name].note = "skipped", v.unavailable
        elif v.eval_only and config.train:
            results[v.name].status = "skipped"
            results[v.name].note = "inference only: skipped for --train"
        else:
            active.append(v)

    x = make_input(config)
    total = (config.repeats + int(config.warmup_round)) * len(active)
    done = 0

    def progress(label: str) -> None:
        if on_progress is not None:
            on_progress(done, total, label)

    with _metrics_limit(100_000), _num_threads(config.threads):
        if config.warmup_round:
            # Pays the process's one-time costs (imports, dynamo's per-code-object caches, the
            # first tokenizing of each source file for FX stack traces) outside the samples, for
            # every variant: otherwise whichever variant first runs some code pays for it.
            for v in active:
                progress(f"warm-up (discarded): {v.name}")
                with contextlib.suppress(Exception):  # a failing variant is recorded below
                    _measure(v, config, x, -1)
                done += 1
        for repeat in range(config.repeats):
            shift = repeat % len(active)
            order = active[shift:] + active[:shift]
            outputs: dict[str, torch.Tensor] = {}
            for v in order:
                progress(f"repeat {repeat + 1}/{config.repeats}: {v.name}")
                res = results[v.name]
                if res.status == "ok":
                    try:
                        sample, out = _measure(v, config, x, repeat)
                    except Exception as exc:  # recorded and shown; the other variants still run
                        res.status, res.note = "error", f"{type(exc).__name__}: {exc}"
                        res.samples.clear()
                    else:
                        res.samples.append(sample)
                        outputs[v.name] = out
                done += 1
            stock_out = outputs.get("stock")
            for name, out in outputs.items():
                if stock_out is not None and results[name].samples:
                    results[name].samples[-1].max_abs_diff = _max_abs_diff(out, stock_out)
        environment = _environment(config.device)
    torch._dynamo.reset()
    progress("done")
    return BenchResult(config, environment, [results[n] for n in names])
