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

All fix texts live in :data:`FIXES`.

What depends on the torch version (each read from that version's source):

* recompile causes: torch >= 2.7 puts ``recompile_reason`` in the compile metrics; on older torch the
  ``recompile_reasons`` artifact alone marks a recompile (it is logged for every recompile since 2.5).
* the recompile limit is ``config.recompile_limit`` from 2.7 on, ``config.cache_size_limit`` before;
  a hit is read from dynamo's own warning (2.5+), else from the failure in the metrics
  (``RecompileLimitExceeded``/"recompile_limit reached" on 2.8-2.10, ``Unsupported``/"recompile
  limit exceeded" from 2.11; 2.5 and 2.6 write no metrics for a refused compile, and 2.5's
  ``CacheLimitExceeded("cache_size_limit reached")`` shows only in ``counters``).
* graph breaks and dynamic dims: torch < 2.6 logs no ``dynamo_graph_break_reason`` and no
  ``create_symbol``; the report says so instead of showing 0 / none. A limit hit on 2.5 shows only
  in dynamo's own warning (no compile metrics for a refused compile): keep torch._dynamo's
  warnings on there.
* from 2.14, ``layer.compile()`` on a torch.nn module (whose forward dynamo would skip) wraps its
  ``_call_impl`` in ``torch._dynamo.external_utils.wrap_inline``: every such layer compiles one
  shared code object, ``inner``. The report names the module's own forward (``Linear.forward``)
  and says that those layers share one recompile limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import inspect
import os
import re
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

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

CATEGORIES = (
    "shape",
    "requires_grad",
    "training",
    "grad_mode",
    "dtype/device",
    "id/object identity",
    "limit hit",
    "other",
)

# The one table of fix texts. Keys are a category, optionally ":variant". Placeholders are filled
# from the failed guard: {tensor} {dim} {expected} {actual} {source} {state} {guard} {function}
# {limit_type} {limit}.
FIXES: dict[str, str] = {
    "shape": (
        "torch._dynamo.mark_dynamic({tensor}, {dim}) before the first call (or compile with "
        "dynamic=True); torch makes the dim dynamic by itself only after it changed once"
    ),
    "shape:size01": (
        "expected: sizes 0 and 1 are specialised; torch._dynamo.decorators.mark_unbacked({tensor}, "
        "{dim}) before the call lets one graph serve them too"
    ),
    "shape:symbolic": (
        "a shape relation the graph assumed no longer holds ({guard}); mark the dims involved with "
        "torch._dynamo.mark_dynamic, or keep the relation stable"
    ),
    "shape:parameter": (
        "parameter/buffer {tensor} changed shape; torch._dynamo.config."
        "force_parameter_static_shapes = False lets one graph serve both"
    ),
    "requires_grad": (
        "run frozen and trainable copies through paramfold.prepare(..., "
        "detach_params_under_no_grad=True) or keep requires_grad consistent"
    ),
    "requires_grad:input": (
        "input {tensor} requires grad in one call and not in another; make it consistent "
        "(.requires_grad_() or .detach()) or accept one graph each"
    ),
    "training": (
        "put models that share this code in the same train/eval mode ({source}.training differs)"
    ),
    "grad_mode": (
        "unavoidable: one graph per grad mode (no_grad/inference_mode vs grad); nothing to fix"
    ),
    "dtype/device": (
        "{tensor} arrived as {actual}, the graph was made for {expected}: cast it before the call, "
        "or accept one graph per dtype"
    ),
    "dtype/device:dispatch": (
        "{tensor} has another device or kind (e.g. cpu vs cuda, or an inference-mode tensor): pass "
        "one device and kind, or accept one graph each"
    ),
    "dtype/device:global": (
        "global {state} changed between calls (autocast / default dtype): call under one setting, "
        "or accept one graph per setting"
    ),
    "id/object identity": (
        "{source} is a different object than when the graph was made (rebound global, new "
        "function or closure, module of another class): reuse one object, or pass the varying "
        "value as a tensor"
    ),
    "limit hit": (
        "torch stopped compiling {function} at torch._dynamo.config.{limit_type}={limit} and runs "
        "it EAGER from now on: remove the causes above, or raise torch._dynamo.config.{limit_type}"
    ),
    "limit hit:shared": (
        "torch stopped compiling {function} at torch._dynamo.config.{limit_type}={limit} and runs "
        "it EAGER from now on. On torch >= 2.14 every torch.nn module compiled on its own "
        "(layer.compile()) runs through one shared wrapper code object "
        "(torch._dynamo.external_utils.wrap_inline), so all such layers share ONE recompile limit: "
        "compile the parent model once instead of each layer, or raise "
        "torch._dynamo.config.{limit_type}"
    ),
    "other": (
        "a Python value the compiled code depends on changed ({guard}): keep it constant, or pass "
        "it as a tensor"
    ),
    "other:global": "global torch state {state} changed between calls: keep it fixed",
    "other:backend": "compile every caller of this code with the same backend object",
}

_TENSOR_MISMATCH = re.compile(
    r"^tensor '(?P<tensor>.+)' (?P<what>size|stride) mismatch at index (?P<dim>\d+)\. "
    r"expected (?P<expected>\d+), actual (?P<actual>\d+)"
)
_RANK_MISMATCH = re.compile(
    r"^tensor '(?P<tensor>.+)' rank mismatch\. expected (?P<expected>\d+), actual (?P<actual>\d+)"
)
_REQUIRES_GRAD = re.compile(
    r"^tensor '(?P<tensor>.+)' requires_grad mismatch\. expected requires_grad=(?P<expected>[01])"
)
_DTYPE = re.compile(
    r"^tensor '(?P<tensor>.+)' dtype mismatch\. expected (?P<expected>\S+), actual (?P<actual>\S+)"
)
_DISPATCH = re.compile(r"^tensor '(?P<tensor>.+)' dispatch key set mismatch\.")
_DEVICE = re.compile(r"device (index )?mismatch", re.IGNORECASE)
_SYM_SIZE = re.compile(r"(?P<tensor>[\w.\[\]'\"]+?)\.size\(\)\[(?P<dim>\d+)\]")
_SYM_STRIDE = re.compile(r"\.(size|stride)\(\)\[\d+\]|\.storage_offset\(\)")
_TRAINING = re.compile(r"(?P<source>[\w.\[\]'\"]+)\.training\b")
_OBJ_ID = re.compile(r"___check_(obj|type)_id\((?P<source>[^,]+),")
_GLOBAL_STATE = "GLOBAL_STATE changed:"
_IDENTITY_MARKERS = ("GuardAccessor: Not a", "got deallocated", "Cache line invalidated")
_COMPILE_ID_PREFIX = re.compile(r"^(?P<cid>[^\s:]+): (?P<rest>.*)$", re.DOTALL)
_FUNC_INFO = re.compile(r"^'(?P<name>.*)' \((?P<file>.*):(?P<line>\d+)\)$")
_LIMIT_WARNING_PREFIX = "torch._dynamo hit config."
# How each torch version words a refused compile in the metrics (fail_type / fail_reason).
_LIMIT_FAIL_TYPES = ("FailOnRecompileLimitHit", "RecompileLimitExceeded", "CacheLimitExceeded")
_LIMIT_FAIL_REASON = re.compile(
    r"recompile limit|(?P<type>(?:accumulated_)?(?:recompile|cache_size)_limit) reached",
    re.IGNORECASE,
)
_TORCH_VERSION = tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2])
GRAPH_BREAKS_REPORTED = _TORCH_VERSION >= (2, 6)  # torch < 2.6: no graph-break, no create_symbol


def limit_config() -> str:
    """The name of this torch's per-function recompile limit in ``torch._dynamo.config``.

    ``recompile_limit`` from torch 2.7 on (``cache_size_limit`` stays as an alias there), only
    ``cache_size_limit`` before::

        >>> import torch
        >>> from paramfold.recompiles import limit_config
        >>> getattr(torch._dynamo.config, limit_config())
        8
    """
    from torch._dynamo import config

    return "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"


def is_limit_message(text: str) -> bool:
    """Whether a dynamo failure message (``fail_reason``, ``counters["unimplemented"]`` key) says a
    compile was refused at the recompile limit, in the wording of any torch from 2.5 to 2.15::

        >>> from paramfold.recompiles import is_limit_message
        >>> [is_limit_message(m) for m in ("cache_size_limit reached", "recompile_limit reached",
        ...                                "Dynamo recompile limit exceeded", "data-dependent branch")]
        [True, True, True, False]
    """
    return _LIMIT_FAIL_REASON.search(text) is not None


def is_recompile(metrics: Any) -> bool:
    """Whether one of torch's ``CompilationMetrics`` is a recompile.

    torch >= 2.7 records ``recompile_reason``; before, a compile of a code object that already had
    a graph (frame compile id > 0 in ``compile_id`` "frame/compile") is one.
    """
    if hasattr(metrics, "recompile_reason"):
        return bool(metrics.recompile_reason)
    return str(getattr(metrics, "compile_id", "") or "").rpartition("/")[2] not in ("", "0")


class RecompileLimitWarning(UserWarning):
    """A function hit ``torch._dynamo.config.recompile_limit`` inside :func:`recompiles`."""


class RecompileLimitError(RuntimeError):
    """Raised by ``recompiles(strict=True)`` when a function hit the recompile limit."""


@dataclasses.dataclass
class GuardFailure:
    """One failed guard of one cached graph, as torch reported it."""

    cached_compile_id: str  # the cached graph whose guard failed, e.g. "0/1"
    reason: str  # verbatim, as torch reported it (including any "User stack trace")
    guard: str  # the first line of ``reason`` without the compile id: the failed check itself
    # (locals spelled ``x`` as torch >= 2.7 does, not ``L['x']``)
    category: str
    fix: str
    tensor: str | None = None  # the tensor / attribute the guard names, when it names one
    dim: int | None = None


@dataclasses.dataclass
class CompileRecord:
    """One compile of one function (a first compile, a recompile, or a refused one: limit hit)."""

    compile_id: str
    function: str
    filename: str
    lineno: int | None
    kind: str  # "first compile" | "recompile" | "limit hit"
    failed_guards: list[GuardFailure]
    graphs: int  # FX graphs dynamo produced in this compile
    dynamic: list[str]  # sizes that became symbolic (dynamic) in this compile, e.g. "x.size()[1]"
    graph_breaks: list[str] = dataclasses.field(default_factory=list)  # "at file:line: reason"
    limit_type: str | None = None
    limit: int | None = None
    fix: str | None = None  # for "limit hit"
    fail_type: str | None = None
    fail_reason: str | None = None
    # "torch._dynamo.external_utils.wrap_inline" when the compiled code object is torch's shared
    # wrapper around a callable dynamo would not trace itself; ``function`` then names that callable.
    shared_code: str | None = None

    @property
    def location(self) -> str:
        """``name (file:line)``, the key used by :meth:`RecompileReport.graphs_per_function`."""
        return f"{self.function} ({_short_path(self.filename)}:{self.lineno})"

    @property
    def cause(self) -> str | None:
        """Category of the guard torch names first (its ``recompile_reason``), or ``limit hit``."""
        if self.kind == "limit hit":
            return "limit hit"
        if self.kind != "recompile":
            return None
        return self.failed_guards[0].category if self.failed_guards else "other"

    @property
    def categories(self) -> list[str]:
        """The categories of the failed guards (and ``limit hit``), in :data:`CATEGORIES` order."""
        found = {g.category for g in self.failed_guards}
        if self.kind == "limit hit":
            found.add("limit hit")
        return [c for c in CATEGORIES if c in found]


class RecompileReport:
    """What :func:`recompiles` saw: ``.records``, counts, ``.to_json()``, ``.print()``.

    Also a rich renderable: ``rich.print(report)``.
    """

    def __init__(self) -> None:
        self.records: list[CompileRecord] = []
        self.graphs_total = 0  # counters["stats"]["unique_graphs"] delta over the block
        # graph breaks dynamo logged in the block (dynamo_graph_break_reason); None on torch < 2.6,
        # which logs no such event
        self.graph_breaks: int | None = 0 if GRAPH_BREAKS_REPORTED else None
        self.collection_errors: list[str] = []

    @property
    def recompiles(self) -> list[CompileRecord]:
        return [r for r in self.records if r.kind == "recompile"]

    @property
    def limit_hits(self) -> list[CompileRecord]:
        return [r for r in self.records if r.kind == "limit hit"]

    @property
    def limit_hit(self) -> bool:
        return bool(self.limit_hits)

    def graphs_per_function(self) -> dict[str, int]:
        """Graphs made per compiled function, keyed ``"name (file:line)"``."""
        out: dict[str, int] = {}
        for r in self.records:
            out[r.location] = out.get(r.location, 0) + r.graphs
        return out

    def recompiles_per_function(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.recompiles:
            out[r.location] = out.get(r.location, 0) + 1
        return out

    def causes(self) -> dict[str, int]:
        """Recompiles (and limit hits) per cause, in :data:`CATEGORIES` order."""
        c = Counter(r.cause for r in self.records if r.cause)
        return {k: c[k] for k in CATEGORIES if c[k]}

    def to_dict(self) -> dict[str, Any]:
        functions = []
        for loc, graphs in self.graphs_per_function().items():
            recs = [r for r in self.records if r.location == loc]
            functions.append(
                {
                    "function": recs[0].function,
                    "filename": recs[0].filename,
                    "lineno": recs[0].lineno,
                    "graphs": graphs,
                    "recompiles": sum(r.kind == "recompile" for r in recs),
                    "limit_hit": any(r.kind == "limit hit" for r in recs),
                    "causes": dict(Counter(r.cause for r in recs if r.cause)),
                }
            )
        return {
            "torch_version": torch.__version__,
            "graphs": self.graphs_total,
            "graph_breaks": self.graph_breaks,
            "compiles": len(self.records),
            "recompiles": len(self.recompiles),
            "limit_hit": self.limit_hit,
            "causes": self.causes(),
            "functions": functions,
            "records": [
                {**dataclasses.asdict(r), "cause": r.cause, "categories": r.categories}
                for r in self.records
            ],
            "collection_errors": self.collection_errors,
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The report as JSON (``limit_hit`` is a top-level flag)."""
        return json.dumps(self.to_dict(), indent=indent)

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        parts: list[Any] = []
        recs_per = self.recompiles_per_function()
        for loc, graphs in self.graphs_per_function().items():
            table = Table(
                title=f"{loc}: {graphs} graphs, {recs_per.get(loc, 0)} recompiles",
                title_justify="left",
                expand=False,
            )
            for col, kw in (
                ("id", {"no_wrap": True}),
                ("event", {}),
                ("failed guard (cached graph: check)", {"overflow": "fold", "ratio": 1}),
                ("category", {"no_wrap": True}),
                ("fix", {"overflow": "fold", "ratio": 1}),
            ):
                table.add_column(col, **kw)
            for r in self.records:
                if r.location == loc:
                    self._add_rows(table, r)
            parts.append(table)

        summary = Table(title="per function", title_justify="left")
        for col in ("function", "graphs", "recompiles", "causes of recompiles"):
            summary.add_column(col)
        for loc, graphs in self.graphs_per_function().items():
            causes = Counter(r.cause for r in self.records if r.location == loc and r.cause)
            summary.add_row(
                loc, str(graphs), str(recs_per.get(loc, 0)),
                ", ".join(f"{k} x{causes[k]}" for k in CATEGORIES if causes[k]) or "-",
            )
        parts.append(summary)
        breaks = (
            f"{self.graph_breaks} graph breaks" if self.graph_breaks is not None
            else "graph breaks and dynamic dims not reported by torch < 2.6"
        )
        parts.append(
            Text(
                f"{self.graphs_total} graphs, {len(self.recompiles)} recompiles, {breaks} in "
                f"{len(self.records)} compiles (torch {torch.__version__})"
            )
        )
        shared = sorted({r.location for r in self.records if r.shared_code})
        if shared:
            parts.append(
                Text(
                    f"{', '.join(shared)}: compiled through torch's one shared wrapper code object "
                    f"({_WRAP_INLINE}); all of them count "
                    "against one recompile limit",
                    style="yellow",
                )
            )
        for r in self.limit_hits:
            parts.append(Text(f"RECOMPILE LIMIT HIT: {r.fix}", style="bold red"))
        for err in self.collection_errors:
            parts.append(Text(f"paramfold could not read a torch trace event: {err}", style="red"))
        return Group(*parts)

    @staticmethod
    def _add_rows(table: Any, r: CompileRecord) -> None:
        from rich.text import Text

        event = r.kind
        if r.graphs == 0 and r.kind == "first compile":
            event += " (no graph)"
        if r.dynamic:
            event += "\ndynamic: " + ", ".join(r.dynamic)
        for b in r.graph_breaks:
            event += f"\ngraph break {b}"
        style = "bold red" if r.kind == "limit hit" else ("yellow" if r.kind == "recompile" else "")
        # One row per distinct failed check, prefixed by the cached graphs it failed on.
        grouped: dict[tuple[str, str, str], list[str]] = {}
        for g in r.failed_guards:
            grouped.setdefault((g.guard, g.category, g.fix), []).append(g.cached_compile_id)
        rows = [
            (f"{', '.join(ids)}: {guard}", cat, fix) for (guard, cat, fix), ids in grouped.items()
        ]
        if r.kind == "limit hit":
            rows.append(("", "limit hit", r.fix or ""))
        if not rows:
            rows = [("-", "", "")]
        seen: set[tuple[str, str]] = set()
        for i, (guard, cat, fix) in enumerate(rows):
            table.add_row(
                r.compile_id if i == 0 else "",
                Text(event, style=style) if i == 0 else "",
                guard,
                Text(cat, style="bold red" if cat == "limit hit" else ""),
                "same as above" if (cat, fix) in seen else fix,
                end_section=i == len(rows) - 1,
            )
            seen.add((cat, fix))

    def print(self, console: Any = None) -> None:
        """Print the tables (to stdout, or to the given ``rich.console.Console``)."""
        from rich.console import Console

        if console is None:
            console = Console()
            if not console.is_terminal and "COLUMNS" not in os.environ:
                console = Console(width=160)  # a file or pipe: don't squeeze the table to 80
        console.print(self)

    def __repr__(self) -> str:
        return (
            f"RecompileReport(compiles={len(self.records)}, graphs={self.graphs_total}, "
            f"recompiles={len(self.recompiles)}, limit_hit={self.limit_hit})"
        )


@contextlib.contextmanager
def recompiles(*, strict: bool = False, warn: bool = True) -> Iterator[RecompileReport]:
    """Record every compile and recompile in the block; yields a :class:`RecompileReport`.

    The report fills in as the block runs and is complete when it exits. If a function hits the
    recompile limit (after which torch runs it uncompiled), a :class:`RecompileLimitWarning` is
    issued at exit (``warn=False`` to silence it), or with ``strict=True`` a
    :class:`RecompileLimitError` is raised.

    Example::

        >>> import torch, paramfold
        >>> f = torch.compile(lambda x: x * 2, backend="eager")
        >>> with paramfold.recompiles() as report:
        ...     _ = f(torch.ones(4)); _ = f(torch.ones(4, dtype=torch.float64))
        >>> [(r.kind, r.cause) for r in report.records]
        [('first compile', None), ('recompile', 'dtype/device')]
    """
    from torch._dynamo.utils import counters
    from torch._logging._internal import trace_log

    report = RecompileReport()
    collector = _Collector(report)
    trace_handler = _TraceHandler(collector)
    limit_handler = _LimitWarningHandler(collector)
    limit_logger = logging.getLogger("torch._dynamo.convert_frame")

    graphs_before = counters["stats"]["unique_graphs"]
    old_level = trace_log.level
    trace_log.addHandler(trace_handler)
    if not trace_log.isEnabledFor(logging.DEBUG):
        trace_log.setLevel(logging.DEBUG)
    limit_logger.addHandler(limit_handler)
    try:
        yield report
    finally:
        trace_log.removeHandler(trace_handler)
        limit_logger.removeHandler(limit_handler)
        if not trace_log.handlers:
            trace_log.setLevel(old_level)
        report.graphs_total = counters["stats"]["unique_graphs"] - graphs_before
        collector.flush()
        if GRAPH_BREAKS_REPORTED:
            report.graph_breaks = sum(len(r.graph_breaks) for r in report.records)
    if report.limit_hit:
        msg = "recompile limit hit: " + "; ".join(r.fix or r.location for r in report.limit_hits)
        if strict:
            raise RecompileLimitError(msg)
        if warn:
            warnings.warn(msg, RecompileLimitWarning, stacklevel=3)


# ----------------------------------------------------------------------------------------------
# Collection


@dataclasses.dataclass
class _Pending:
    reasons: list[str] = dataclasses.field(default_factory=list)
    graphs: int = 0
    dynamic: list[str] = dataclasses.field(default_factory=list)
    breaks: list[str] = dataclasses.field(default_factory=list)
    limit: tuple[str, int, str] | None = None  # (limit_type, value, "'name' (file:line)")
    recompile: bool = False  # a recompile_reasons artifact arrived (torch logs one per recompile)
    target: tuple[str, str, int | None] | None = None  # the callable behind torch's wrap_inline


class _Collector:
    def __init__(self, report: RecompileReport) -> None:
        self.report = report
        self.pending: dict[tuple[Any, Any, Any], _Pending] = {}
        self.frames: dict[tuple[Any, Any], tuple[str, str, int | None]] = {}
        self.shared: set[tuple[Any, Any]] = set()  # frames whose code is torch's wrap_inline

    def on_trace(self, metadata: dict[str, Any], payload: str | None) -> None:
        name = next(iter(metadata))
        key = (
            metadata.get("compiled_autograd_id"),
            metadata.get("frame_id"),
            metadata.get("frame_compile_id"),
        )
        if name == "artifact":
            artifact = metadata["artifact"].get("name")
            if artifact == "recompile_reasons" and payload is not None:
                self._pending(key).reasons = _decode_reasons(payload)
                self._pending(key).recompile = True
            elif artifact == "dynamo_graph_break_reason" and payload is not None:
                summary = _graph_break_summary(payload)
                if summary not in self._pending(key).breaks:
                    self._pending(key).breaks.append(summary)
        elif name == "dynamo_start":
            target = _wrapped_target()
            if target is not None:
                self._pending(key).target = target
        elif name == "dynamo_output_graph":
            self._pending(key).graphs += 1
        elif name == "create_symbol":
            source = metadata["create_symbol"].get("source")
            if source:
                self._pending(key).dynamic.append(_strip_local_scope(source))
        elif name == "compilation_metrics":
            self._finish(key, metadata["compilation_metrics"])

    def on_limit_warning(self, args: tuple[Any, ...]) -> None:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        if cid is None or len(args) < 3:
            return
        # CompileId.compiled_autograd_id exists from torch 2.7 on.
        key = (getattr(cid, "compiled_autograd_id", None), cid.frame_id, cid.frame_compile_id)
        p = self._pending(key)
        p.limit = (str(args[0]), int(args[1]), str(args[2]))
        if p.target is None:
            p.target = _wrapped_target()

    def _pending(self, key: tuple[Any, Any, Any]) -> _Pending:
        return self.pending.setdefault(key, _Pending())

    def _finish(self, key: tuple[Any, Any, Any], m: dict[str, Any]) -> None:
        p = self.pending.pop(key, _Pending())
        frame = key[:2]
        name, filename, lineno = m.get("co_name"), m.get("co_filename"), m.get("co_firstlineno")
        if p.target is not None:
            name, filename, lineno = p.target
        if name is None and p.limit is not None and (fm := _FUNC_INFO.match(p.limit[2])):
            name, filename, lineno = fm["name"], fm["file"], int(fm["line"])
        if name is None and frame in self.frames:
            name, filename, lineno = self.frames[frame]
        if name is not None:
            self.frames[frame] = (name, filename or "?", lineno)
        fail_type, fail_reason = m.get("fail_type"), m.get("fail_reason")
        reason_hit = _LIMIT_FAIL_REASON.search(fail_reason or "")
        limit_hit = p.limit is not None or fail_type in _LIMIT_FAIL_TYPES or reason_hit is not None
        reasons = p.reasons or ([m["recompile_reason"]] if m.get("recompile_reason") else [])
        if limit_hit:
            kind = "limit hit"
        elif m.get("recompile_reason") is not None or p.recompile:
            kind = "recompile"
        else:
            kind = "first compile"
        shared = p.target is not None or frame in self.shared
        if shared:
            self.shared.add(frame)
        record = CompileRecord(
            compile_id=m.get("compile_id") or _format_key(key),
            function=name or "?",
            filename=filename or "?",
            lineno=lineno,
            kind=kind,
            failed_guards=[_classify(r) for r in reasons],
            graphs=p.graphs,
            dynamic=p.dynamic,
            graph_breaks=p.breaks,
            fail_type=fail_type,
            fail_reason=fail_reason,
            shared_code=_WRAP_INLINE if shared else None,
        )
        if limit_hit:
            from torch._dynamo import config

            if p.limit:
                limit_type = p.limit[0]
            elif reason_hit is not None and reason_hit["type"]:
                limit_type = reason_hit["type"]
            else:
                limit_type = limit_config()
            record.limit_type = limit_type
            record.limit = p.limit[1] if p.limit else getattr(config, limit_type, None)
            record.fix = _fix(
                "limit hit:shared" if shared else "limit hit",
                function=record.location, limit=record.limit, limit_type=limit_type,
            )
        self.report.records.append(record)

    def flush(self) -> None:
        """Pending compiles whose metrics never arrived (e.g. an exception escaped mid-compile)."""
        for key in list(self.pending):
            p = self.pending[key]
            if p.reasons or p.graphs or p.limit or p.breaks:
                first_reason = p.reasons[0] if p.reasons else None
                self._finish(key, {"compile_id": None, "recompile_reason": first_reason})
        self.pending.clear()


_WRAP_INLINE = "torch._dynamo.external_utils.wrap_inline"


def _wrapped_target() -> tuple[str, str, int | None] | None:
    """The callable behind ``wrap_inline`` when dynamo is compiling that wrapper, else None.

    ``wrap_inline(fn)`` returns ``inner``, one code object for every wrapped ``fn``; its closure
    holds ``fn``. Called from a trace or log record emitted inside dynamo's ``_compile(code,
    locals, ...)``, whose arguments (same names in torch 2.5 .. 2.15) say what it compiles.
    """
    from torch._dynamo import external_utils

    inner = external_utils.wrap_inline(_wrapped_target).__code__
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_compile" and code.co_filename.endswith("convert_frame.py"):
            if frame.f_locals.get("code") is not inner:
                return None
            fn = (frame.f_locals.get("locals") or {}).get("fn")
            return _describe_callable(fn) if fn is not None else None
        frame = frame.f_back
    return None


def _describe_callable(fn: Any) -> tuple[str, str, int | None]:
    """``(qualified name, file, first line)`` of what a wrapped ``fn`` runs."""
    owner = getattr(fn, "__self__", None)
    if getattr(fn, "__name__", "") in ("_call_impl", "_wrapped_call_impl") and isinstance(
        owner, torch.nn.Module
    ):
        fn = type(owner).forward  # what Module._call_impl runs
    code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    if code is None:
        return name, getattr(fn, "__module__", None) or "?", None
    return name, code.co_filename, code.co_firstlineno


class _TraceHandler(logging.Handler):
    """Receives torch's structured trace events (``torch._logging.trace_structured``)."""

    def __init__(self, collector: _Collector) -> None:
        super().__init__(logging.DEBUG)
        self.collector = collector

    def emit(self, record: logging.LogRecord) -> None:
        metadata = getattr(record, "metadata", None)
        if not isinstance(metadata, dict) or not metadata:
            return
        try:
            self.collector.on_trace(metadata, getattr(record, "payload", None))
        except Exception as e:  # never break the user's compile; say it in the report instead
            self.collector.report.collection_errors.append(f"{type(e).__name__}: {e}")


class _LimitWarningHandler(logging.Handler):
    """Catches dynamo's own "hit config.recompile_limit" warning; its args are structured."""

    def __init__(self, collector: _Collector) -> None:
        super().__init__(logging.WARNING)
        self.collector = collector

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith(_LIMIT_WARNING_PREFIX):
            try:
                self.collector.on_limit_warning(tuple(record.args or ()))
            except Exception as e:
                self.collector.report.collection_errors.append(f"{type(e).__name__}: {e}")


# ----------------------------------------------------------------------------------------------
# Classification of torch's guard-failure text


def _classify(reason: str) -> GuardFailure:
    m = _COMPILE_ID_PREFIX.match(reason)
    cid, rest = (m["cid"], m["rest"]) if m else ("?", reason)
    # torch < 2.7 spells locals L['x']; 2.7+ spells them x: report the newer spelling on all.
    guard = _strip_local_scope(rest.split("\nUser stack trace:", 1)[0].split("\n", 1)[0].rstrip())
    # Code-part guards carry "  # <user source line>" comments; match on the check alone.
    expr = re.split(r"\s+# ", guard, maxsplit=1)[0].strip()
    category, variant, fields = _categorize(expr, guard)
    fields.setdefault("guard", expr)
    key = f"{category}:{variant}" if variant else category
    return GuardFailure(
        cached_compile_id=cid,
        reason=reason,
        guard=guard,
        category=category,
        fix=_fix(key, **fields),
        tensor=fields.get("tensor") or fields.get("source"),
        dim=int(fields["dim"]) if fields.get("dim") is not None else None,
    )


def _categorize(expr: str, guard: str) -> tuple[str, str | None, dict[str, Any]]:
    if m := _REQUIRES_GRAD.match(expr):
        f = m.groupdict()
        return "requires_grad", None if _is_param(f["tensor"]) else "input", f
    if expr.startswith(_GLOBAL_STATE):
        states = expr[len(_GLOBAL_STATE):].split()
        others = [s for s in states if s != "grad_mode"]
        if not others:
            return "grad_mode", None, {"state": "grad_mode"}
        if all(s.startswith("autocast") or s == "default_dtype" for s in others):
            return "dtype/device", "global", {"state": ", ".join(others)}
        return "other", "global", {"state": ", ".join(others)}
    if m := _TENSOR_MISMATCH.match(expr):
        f = m.groupdict()
        if _is_param(f["tensor"]):
            return "shape", "parameter", f
        if f["what"] == "size" and int(f["actual"]) in (0, 1):
            return "shape", "size01", f
        if f["what"] == "stride":
            return "shape", "symbolic", {"tensor": f["tensor"], "dim": f["dim"]}
        return "shape", None, f
    if m := _RANK_MISMATCH.match(expr):
        return "shape", "symbolic", m.groupdict()
    if _SYM_STRIDE.search(expr):
        f: dict[str, Any] = {}
        if m := _SYM_SIZE.search(expr):
            f = m.groupdict()
        if "0/1 specialization" in guard or re.match(r"^2 <= \S+\.size\(\)\[\d+\]$", expr):
            return "shape", "size01", f
        return "shape", "symbolic", f
    if m := _DTYPE.match(expr):
        return "dtype/device", None, m.groupdict()
    if m := _DISPATCH.match(expr):
        return "dtype/device", "dispatch", m.groupdict()
    if _DEVICE.search(expr):
        return "dtype/device", "dispatch", {"tensor": expr}
    if m := _TRAINING.search(expr):
        return "training", None, m.groupdict()
    if m := _OBJ_ID.search(expr):
        return "id/object identity", None, {"source": m["source"].strip()}
    if any(t in expr for t in _IDENTITY_MARKERS):
        source = expr.rsplit(" on ", 1)[-1] if " on " in expr else expr
        return "id/object identity", None, {"source": source}
    if expr.startswith("BACKEND_MATCH"):
        return "other", "backend", {}
    return "other", None, {}


def _is_param(source: str) -> bool:
    return "._parameters[" in source or "._buffers[" in source


class _Blank(dict):
    def __missing__(self, key: str) -> str:
        return "?"


def _fix(key: str, **fields: Any) -> str:
    template = FIXES.get(key) or FIXES[key.split(":", 1)[0]]
    return template.format_map(_Blank({k: v for k, v in fields.items() if v is not None}))


def _decode_reasons(payload: str) -> list[str]:
    # trace_structured logs a one-element list as the bare string, longer lists as JSON lines.
    if payload.startswith("[\n"):
        try:
            value = json.loads(payload)
        except ValueError:
            return [payload]
        if isinstance(value, list):
            return [str(v) for v in value]
    return [payload]


def _graph_break_summary(payload: str) -> str:
    """``at FILE:LINE: REASON`` from dynamo's graph-break message (its first lines)."""
    lines = [ln.strip() for ln in payload.splitlines() if ln.strip()]
    where_prefix = "Graph break in user code at "
    reason_prefixes = ("Graph Break Reason: ", "Reason: ")  # torch >= 2.7, torch 2.6
    where = next((ln for ln in lines if ln.startswith(where_prefix)), None)
    i = next((k for k, ln in enumerate(lines) if ln.startswith(reason_prefixes)), None)
    if where is None or i is None:
        return lines[0] if lines else "graph break"
    prefix = next(p for p in reason_prefixes if lines[i].startswith(p))
    reason = lines[i][len(prefix):]
    if reason.endswith(":") and i + 1 < len(lines):  # "...attempting to trace CALL...:" + cause
        i += 1
        reason = lines[i]
    if i + 1 < len(lines) and lines[i + 1].startswith("Explanation: "):
        reason += f" ({lines[i + 1][len('Explanation: '):]})"
    return f"at {_short_path_loc(where[len(where_prefix):])}: {reason}"


def _short_path_loc(loc: str) -> str:
    path, sep, line = loc.rpartition(":")
    return f"{_short_path(path)}:{line}" if sep else loc


def _strip_local_scope(s: str) -> str:
    return re.sub(r"L\[\s*['\"](.*?)['\"]\s*\]", r"\1", s)


def _format_key(key: tuple[Any, Any, Any]) -> str:
    ca, frame_id, frame_compile_id = key
    base = f"{frame_id}/{frame_compile_id}"
    return f"!{ca}/{base}" if ca is not None else base


def _short_path(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path
