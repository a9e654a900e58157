"""The order of a run: which variants, in what order, how many times (:func:`run_bench`).

Two phases, both side by side in this one process:

1. **first compiled call**: for every repeat the variants are measured one after the other (their
   order rotates from repeat to repeat), each from a fresh ``torch._dynamo.reset()``, after one
   discarded warm-up round of every variant;
2. **steady**: every variant is compiled once more, with code of its own
   (:func:`~paramfold.bench.measure.own_code`), and warmed up; then interleaved rounds (order
   rotating) time each variant's calls in turn, so that a change of machine load falls on every
   variant alike.

A variant that fails is recorded (``status="error"``) and the others still run.
:func:`run_sweep` runs both phases for each of several layer counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from paramfold.bench.config import BenchConfig, make_input
from paramfold.bench.measure import (
    Compiled,
    compiled_for_steady,
    environment,
    first_call,
    fresh_compile_state,
    heap_frozen,
    max_abs_diff,
    metrics_limit,
    num_threads,
    time_round,
)
from paramfold.bench.result import BenchResult, SweepResult, VariantResult
from paramfold.bench.variants import Variant, default_variants

__all__ = ["run_bench", "run_sweep"]

Progress = Callable[[int, int, str], None]


def _selected(config: BenchConfig, variants: Sequence[Variant] | None) -> list[Variant]:
    if variants is None:
        variants = default_variants()
    wanted = None if config.variants is None else {"baseline", "stock", *config.variants}
    chosen = [v for v in variants if wanted is None or v.name in wanted]
    names = [v.name for v in chosen]
    if "baseline" not in names or "stock" not in names:
        raise ValueError("variants must include 'baseline' and 'stock'")
    return chosen


def _applies(v: Variant, config: BenchConfig) -> bool:
    return not v.unavailable and not (v.eval_only and config.trainable)


def _steps(config: BenchConfig, active: int, first: bool, steady: bool) -> int:
    """How many progress steps a run makes (``on_progress``'s ``total``)."""
    firsts = (config.repeats + int(config.warmup_round)) * active if first else 0
    return firsts + ((active + config.steady_rounds) if steady else 0)


def _failed(res: VariantResult, exc: Exception, phase: str = "") -> None:
    res.status, res.note = "error", f"{phase}{type(exc).__name__}: {exc}"
    res.samples.clear()
    res.steady_rounds_s.clear()


def run_bench(
    config: BenchConfig,
    *,
    variants: Sequence[Variant] | None = None,
    on_progress: Progress | None = None,
    first_calls: bool = True,
    steady: bool = True,
) -> BenchResult:
    """Measure every variant of ``config`` side by side and return the samples.

    ``variants`` defaults to :func:`default_variants` filtered by ``config.variants`` (baseline and
    stock are always kept).  ``on_progress(done, total, label)`` is called before each step and
    once at the end.  ``first_calls=False`` or ``steady=False`` leaves out that phase.  A variant
    that fails is recorded with ``status="error"`` and the others still run.

    Example::

        >>> r = run_bench(BenchConfig(model="weight_norm", layers=2, repeats=1, steady_calls=1, steady_rounds=2,
        ...                           variants=("baseline", "stock")))
        >>> r.variant("baseline").proxies.graph_breaks
        0
        >>> len(r.variant("stock").steady_rounds_s) == r.config.steady_rounds
        True
    """
    config.check_device()
    chosen = _selected(config, variants)
    results = {v.name: VariantResult(v.name, v.description) for v in chosen}
    active: list[Variant] = []
    for v in chosen:
        if v.unavailable:
            results[v.name].status, results[v.name].note = "skipped", v.unavailable
        elif not _applies(v, config):
            results[v.name].status = "skipped"
            results[v.name].note = f"inference only: skipped for {config.phase.option}"
        else:
            active.append(v)

    x = make_input(config)
    total = _steps(config, len(active), first_calls, steady)
    done = 0

    def progress(label: str) -> None:
        nonlocal done
        if on_progress is not None:
            on_progress(done, total, label)
        done += 1

    with heap_frozen() as settle, metrics_limit(100_000), num_threads(config.threads):
        if first_calls:
            _first_calls(active, config, x, results, progress, settle)
        if steady:
            _steady_rounds(active, config, x, results, progress, settle)
        env = environment(config.device)
    torch._dynamo.reset()
    if on_progress is not None:
        on_progress(done, total, "done")
    return BenchResult(config, env, [results[v.name] for v in chosen])


def _first_calls(active: list[Variant], config: BenchConfig, x: torch.Tensor,
                 results: dict[str, VariantResult], progress: Callable[[str], None],
                 settle: Callable[[], None]) -> None:
    if config.warmup_round:
        # Pays the process's one-time costs (imports, dynamo's per-code-object caches, the
        # first tokenizing of each source file for FX stack traces) outside the samples, for
        # every variant: otherwise whichever variant first runs some code pays for it.
        for v in active:
            progress(f"warm-up (discarded): {v.name}")
            with contextlib.suppress(Exception):  # a failing variant is recorded below
                first_call(v, config, x, -1)
        settle()
    for repeat in range(config.repeats):
        shift = repeat % len(active)
        outputs: dict[str, torch.Tensor] = {}
        for v in active[shift:] + active[:shift]:
            progress(f"repeat {repeat + 1}/{config.repeats}: {v.name}")
            res = results[v.name]
            if res.status != "ok":
                continue
            try:
                sample, outputs[v.name] = first_call(v, config, x, repeat)
            except Exception as exc:  # recorded and shown; the other variants still run
                _failed(res, exc)
            else:
                res.samples.append(sample)
        stock_out = outputs.get("stock")
        for name, out in outputs.items():
            if stock_out is not None and results[name].samples:
                results[name].samples[-1].max_abs_diff = max_abs_diff(out, stock_out)


def _steady_rounds(active: list[Variant], config: BenchConfig, x: torch.Tensor,
                   results: dict[str, VariantResult], progress: Callable[[str], None],
                   settle: Callable[[], None]) -> None:
    with fresh_compile_state(config.cold_caches):
        ready: dict[str, Compiled] = {}
        for v in active:
            progress(f"steady: compile and warm up {v.name}")
            if results[v.name].status != "ok":
                continue
            try:
                ready[v.name] = compiled_for_steady(v, config, x)
            except Exception as exc:  # recorded and shown; the other variants still run
                _failed(results[v.name], exc, "steady phase: ")
        stock = ready.get("stock")
        for name, compiled in ready.items():
            if stock is not None:
                results[name].steady_max_abs_diff = max_abs_diff(compiled.first_out, stock.first_out)
        settle()
        names = list(ready)
        for r in range(config.steady_rounds):
            progress(f"steady: round {r + 1}/{config.steady_rounds}")
            shift = r % max(len(names), 1)
            for name in names[shift:] + names[:shift]:
                res = results[name]
                if res.status != "ok":
                    continue
                try:
                    seconds, compiles = time_round(ready[name], x, config)
                except Exception as exc:  # recorded and shown; the other variants still run
                    _failed(res, exc, "steady phase: ")
                else:
                    res.steady_rounds_s.append(seconds)
                    res.steady_compiles += compiles
        ready.clear()


def run_sweep(
    config: BenchConfig,
    layers: Sequence[int],
    *,
    variants: Sequence[Variant] | None = None,
    on_progress: Progress | None = None,
) -> SweepResult:
    """:func:`run_bench` for each layer count in ``layers`` (``config.layers`` is replaced).

    Only the first run has the discarded warm-up round (if ``config.warmup_round``): it pays the
    process's one-time costs for all. Progress labels start with ``layers=N:``; ``done`` and
    ``total`` count over the whole sweep.

    Example::

        >>> s = run_sweep(BenchConfig(repeats=1, steady_calls=1, steady_rounds=1,
        ...                           variants=("baseline", "stock")), [1, 2])
        >>> s.layers, [r.config.warmup_round for r in s.runs]
        ([1, 2], [True, False])
    """
    if not layers:
        raise ValueError("a sweep needs at least one layer count")
    configs = [replace(config, layers=n, warmup_round=config.warmup_round and i == 0)
               for i, n in enumerate(layers)]
    counts = [_steps(c, sum(_applies(v, c) for v in _selected(c, variants)), True, True)
              for c in configs]
    total, runs = sum(counts), []
    for i, c in enumerate(configs):
        offset = sum(counts[:i])

        def progress(done: int, _total: int, label: str, n: int = c.n_layers,
                     offset: int = offset) -> None:
            if on_progress is not None and label != "done":
                on_progress(offset + done, total, f"layers={n}: {label}")

        runs.append(run_bench(c, variants=variants, on_progress=progress))
    if on_progress is not None:
        on_progress(total, total, "done")
    return SweepResult(runs)
