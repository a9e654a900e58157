"""Compile-time benchmark: baseline vs stock parametrized vs each paramfold mode.

This package is a library; ``paramfold bench`` (in :mod:`paramfold.cli`) only renders what
:func:`run_bench` returns. One run measures every variant side by side in the same process:

* ``baseline``: the same architecture without any parametrization, its tensors holding the values
  the parametrized model computes (same dtype);
* ``stock``: the parametrized model as ``torch.nn.utils.parametrize`` leaves it;
* ``hoist``, ``inline``, ``freeze``, ``auto``: the parametrized model after
  ``paramfold.prepare(model, mode=...)``.

For every repeat the variants are measured one after the other (their order rotates from repeat to
repeat), each from a fresh ``torch._dynamo.reset()``, a model rebuilt from the same seed and cold
inductor caches, after one discarded warm-up round of every variant. A measurement times the
first call (compile + run, with the cyclic GC paused as ``timeit`` does), in wall time and in CPU
time (steadier when other processes share the cores), and records deterministic proxies (graphs,
graph breaks, recompiles, captured calls) and the largest absolute difference between the
variant's output and the stock model's. Then the steady time (per call, or per training step) is
measured for all variants at once, in interleaved rounds. Every time is also reported as a ratio
to the baseline's; :func:`run_sweep` repeats it all for several layer counts.

One module per idea; this one re-exports their public names:

* :mod:`~paramfold.bench.zoo`: the parametrized models and :func:`unparametrize`;
* :mod:`~paramfold.bench.variants`: what is compared (:class:`Variant`);
* :mod:`~paramfold.bench.config`: what one run measures (:class:`BenchConfig`), its model and input;
* :mod:`~paramfold.bench.result`: what was measured, and the ``--json`` document;
* :mod:`~paramfold.bench.measure`: how one variant is timed;
* :mod:`~paramfold.bench.run`: in what order (:func:`run_bench`);
* :mod:`~paramfold.bench.render`: the table and progress lines;
* :mod:`~paramfold.bench.plot`: the ``--plot`` figures (matplotlib, imported only there).

Example::

    >>> from paramfold.bench import BenchConfig, run_bench
    >>> result = run_bench(BenchConfig(layers=2, repeats=1, steady_calls=1, steady_rounds=1, warmup_calls=0,
    ...                                variants=("baseline", "stock")))
    >>> [v.name for v in result.variants]
    ['baseline', 'stock']
    >>> result.variant("stock").max_abs_diff
    0.0
"""

from __future__ import annotations

import warnings
from typing import Any

from paramfold.bench.config import BACKENDS, ENTRIES, BenchConfig, build_model, make_input
from paramfold.bench.render import (
    describe_config,
    plain_progress,
    print_sweep,
    print_table,
    to_rich_table,
    to_sweep_tables,
)
from paramfold.bench.result import (
    SCHEMA_VERSION,
    BenchResult,
    Proxies,
    Sample,
    SweepResult,
    VariantResult,
)
from paramfold.bench.run import run_bench, run_sweep
from paramfold.bench.variants import VARIANT_NAMES, Variant, default_variants
from paramfold.bench.zoo import MODELS, CastToBFloat16, Layer, Stack, ZooModel, unparametrize

__all__ = [
    "BACKENDS",
    "ENTRIES",
    "MODELS",
    "SCHEMA_VERSION",
    "VARIANT_NAMES",
    "BenchConfig",
    "BenchResult",
    "CastToBFloat16",
    "Layer",
    "Proxies",
    "Sample",
    "Stack",
    "SweepResult",
    "Variant",
    "VariantResult",
    "ZooModel",
    "build_model",
    "default_variants",
    "describe_config",
    "make_input",
    "plain_progress",
    "print_sweep",
    "print_table",
    "run_bench",
    "run_sweep",
    "to_rich_table",
    "to_sweep_tables",
    "unparametrize",
]

_DEPRECATED = {"ModelSpec": ("ZooModel", ZooModel)}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        new, value = _DEPRECATED[name]
        warnings.warn(
            f"paramfold.bench.{name} is deprecated: use paramfold.bench.{new} (same class)",
            DeprecationWarning,
            stacklevel=2,
        )
        return value
    raise AttributeError(f"module 'paramfold.bench' has no attribute {name!r}")
