"""Why did it recompile? Record every ``torch.compile`` compile and recompile, with cause and fix.

``torch.compile`` guards each graph it makes; when a guard fails on a later call, dynamo compiles
the function again. :func:`recompiles` records, for every compile in its block, the function, the
compile id, whether it was a first compile, a recompile or a hit of the recompile limit, the guards
that failed (verbatim, one per cached graph, as torch reports them), a category for each failed
guard and a concrete fix for that category::

    >>> import torch, paramfold
    >>> def step(x):
    ...     return torch.relu(x) * 2
    >>> compiled = torch.compile(step, backend="eager")
    >>> with paramfold.recompiles() as report:
    ...     _ = compiled(torch.randn(2, 8))
    ...     _ = compiled(torch.randn(2, 8, dtype=torch.float64))
    ...     with torch.no_grad():
    ...         _ = compiled(torch.randn(2, 8))
    >>> [(r.kind, r.cause) for r in report.records]
    [('first compile', None), ('recompile', 'dtype/device'), ('recompile', 'grad_mode')]
    >>> list(report.graphs_per_function().values())
    [3]
    >>> report.print()  # doctest: +SKIP

The data comes from torch's own structured trace (the events ``TORCH_TRACE``/tlparse read):
``compilation_metrics`` (function, compile id, whether it recompiled, failure), the
``recompile_reasons`` artifact (every failed guard, one per cached graph), ``dynamo_output_graph``
and ``create_symbol`` (graphs made, dims made dynamic), ``dynamo_graph_break_reason`` (graph breaks,
including the data-dependent ones ``counters["graph_break"]`` misses), plus
``torch._dynamo.utils.counters["stats"]["unique_graphs"]`` for the total graph count. Only the guard
text itself is parsed, to pick a category and name the tensor and dim in the fix. Torch reports
the *first* failing guard of each cached graph, so a graph can differ in more ways than the one
shown.

The package:

* :mod:`~paramfold.recompiles.collect`: :func:`recompiles` itself, reading torch's trace events
  and counters, with the notes on what each torch version logs;
* :mod:`~paramfold.recompiles.classify`: the guard-failure text -> category and fix (every fix text
  is in :data:`FIXES`), the version-fragile patterns with their notes;
* :mod:`~paramfold.recompiles.report`: :class:`CompileRecord`, :class:`RecompileReport`, its JSON
  and tables;
* :mod:`~paramfold.recompiles.script`: ``paramfold recompiles -- python script.py``.

Every name below is importable from ``paramfold.recompiles`` as before. ``paramfold.recompiles``
*as an attribute* is the function (``with paramfold.recompiles():``), not this package: the
package's name is the function's, and the function wins (see ``paramfold._Package``). Reach the
package through ``from paramfold.recompiles import ...`` or ``importlib.import_module``.
"""

from __future__ import annotations

from paramfold.recompiles.classify import CATEGORIES, FIXES, GuardFailure
from paramfold.recompiles.collect import GRAPH_BREAKS_REPORTED  # noqa: F401 (public, not in __all__)
from paramfold.recompiles.collect import (
    RecompileLimitError,
    RecompileLimitWarning,
    is_limit_message,
    is_recompile,
    limit_config,
    recompiles,
)
from paramfold.recompiles.report import CompileRecord, RecompileReport

__all__ = [
    "CATEGORIES",
    "FIXES",
    "CompileRecord",
    "GuardFailure",
    "RecompileLimitError",
    "RecompileLimitWarning",
    "RecompileReport",
    "is_limit_message",
    "is_recompile",
    "limit_config",
    "recompiles",
]
