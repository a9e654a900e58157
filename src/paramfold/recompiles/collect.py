"""Collect every compile in a block from torch's own structured trace: :func:`recompiles`.

A handler on torch's trace log (``torch._logging.trace_structured``, the events tlparse reads) and a
filter on dynamo's recompile-limit warning turn each compile into a
:class:`~paramfold.recompiles.report.CompileRecord`; the guard text in it is classified by
:mod:`paramfold.recompiles.classify`. The events: ``compilation_metrics`` (function, compile id,
whether it recompiled, failure), the ``recompile_reasons`` artifact (every failed guard, one per
cached graph), ``dynamo_output_graph`` and ``create_symbol`` (graphs made, dims made dynamic),
``dynamo_graph_break_reason`` (graph breaks, including the data-dependent ones
``counters["graph_break"]`` misses), plus ``torch._dynamo.utils.counters["stats"]["unique_graphs"]``
for the total graph count.

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
  warnings on there. The graph-break message reads "Reason:" on 2.6, "Graph Break Reason:" from 2.7.
* ``torch.compile(m)`` of a module whose forward is torch's own (``nn.Sequential``, ``nn.Linear``)
  wraps the module itself in ``wrap_inline`` (read in 2.13): every module compiled that way, of
  whatever class, compiles ``inner`` and shares its recompile limit; the report names
  ``type(m).forward`` (``Sequential.forward``).
* from 2.14, ``layer.compile()`` on a torch.nn module (whose forward dynamo would skip) wraps its
  ``_call_impl`` in ``torch._dynamo.external_utils.wrap_inline``: every such layer compiles one
  shared code object, ``inner``. The report names the module's own forward (``Linear.forward``)
  and says that those layers share one recompile limit.
* a prepared model whose forward is torch's own runs that forward in a frame of paramfold's, one
  code object per such forward (``paramfold.classes.root_forward_of``): the report names the forward
  (``Sequential.forward``) and says that prepared models with it share one recompile limit.
* a forward decorated by a ``functools.wraps``-style decorator (transformers' ``wrapper``) compiles
  as the decorator's code, one code object for all it decorates: the report names the function the
  wrapper's ``__wrapped__`` holds (the function is found by the frame's closure cells, which
  ``_compile`` gets, same name in 2.5 .. 2.15) and says they share one recompile limit.
* a resume function (``torch_dynamo_resume_in_<fn>_at_<line>``, after a graph break) guards values
  of dynamo's stack (``___stack0``): its shape fix names the input that a compiled function running
  it (on the Python stack while it compiles) last recompiled on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import re
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from paramfold.errors import FoldError
from paramfold.recompiles.classify import CompiledFrame, GuardFailure, classify, fix_text, strip_local_scope
from paramfold.recompiles.report import CompileRecord, RecompileReport, short_path

__all__ = [
    "GRAPH_BREAKS_REPORTED",
    "RecompileLimitError",
    "RecompileLimitWarning",
    "is_limit_message",
    "is_recompile",
    "limit_config",
    "limit_message",
    "recompiles",
    "refused_at_limit",
]

_FUNC_INFO = re.compile(r"^'(?P<name>.*)' \((?P<file>.*):(?P<line>\d+)\)$")
_LIMIT_WARNING_PREFIX = "torch._dynamo hit config."
# How each torch version words a refused compile in the metrics (fail_type / fail_reason).
_LIMIT_FAIL_TYPES = ("FailOnRecompileLimitHit", "RecompileLimitExceeded", "CacheLimitExceeded")
_LIMIT_FAIL_REASON = re.compile(
    r"recompile limit|(?P<type>(?:accumulated_)?(?:recompile|cache_size)_limit) reached",
    re.IGNORECASE,
)
TORCH_VERSION = tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2])
GRAPH_BREAKS_REPORTED = TORCH_VERSION >= (2, 6)  # torch < 2.6: no graph-break, no create_symbol


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
    """Whether one of torch's ``CompilationMetrics`` is a recompile, as :func:`recompiles` counts
    them: a compile of a code object that already had a graph, not refused at the recompile limit
    (torch records a ``recompile_reason`` for that one too; the report counts it as a limit hit).

    torch >= 2.7 records ``recompile_reason``; before, a compile of a code object that already had
    a graph (frame compile id > 0 in ``compile_id`` "frame/compile") is one.
    """
    if refused_at_limit(getattr(metrics, "fail_type", None), getattr(metrics, "fail_reason", None)):
        return False
    if hasattr(metrics, "recompile_reason"):
        return bool(metrics.recompile_reason)
    return str(getattr(metrics, "compile_id", "") or "").rpartition("/")[2] not in ("", "0")


def refused_at_limit(fail_type: str | None, fail_reason: str | None) -> bool:
    """Whether a compile's metrics (``fail_type``, ``fail_reason``) say it was refused at the
    recompile limit (torch >= 2.8; 2.5 and 2.6 write no metrics for a refused compile)."""
    return fail_type in _LIMIT_FAIL_TYPES or is_limit_message(fail_reason or "")


class RecompileLimitWarning(UserWarning):
    """A function hit ``torch._dynamo.config.recompile_limit`` inside :func:`recompiles`."""


class RecompileLimitError(FoldError):
    """Raised by ``recompiles(strict=True)`` when a function hit the recompile limit.

    A ``RuntimeError`` (through ``FoldError``); ``exit_code`` is what ``paramfold recompiles
    --strict`` exits with.
    """

    exit_code = 3


@contextlib.contextmanager
def recompiles(*, strict: bool = False, warn: bool = True, torch_warning: bool = True) -> Iterator[RecompileReport]:
    """Record every compile and recompile in the block; yields a :class:`RecompileReport`.

    The report fills in as the block runs and is complete when it exits. If a function hits the
    recompile limit (after which torch runs it uncompiled), a :class:`RecompileLimitWarning` is
    issued at exit (``warn=False`` to silence it), or with ``strict=True`` a
    :class:`RecompileLimitError` is raised. ``torch_warning=False`` keeps dynamo's own multi-line
    warning about the hit from torch's log handlers while the block runs (the report holds the
    same event); other log records are untouched.

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
    if not GRAPH_BREAKS_REPORTED:
        report.graph_breaks = None
    collector = _Collector(report)
    trace_handler = _TraceHandler(collector)
    limit_filter = _LimitWarningFilter(collector, keep=torch_warning)
    limit_logger = logging.getLogger("torch._dynamo.convert_frame")

    graphs_before = counters["stats"]["unique_graphs"]
    old_level = trace_log.level
    trace_log.addHandler(trace_handler)
    if not trace_log.isEnabledFor(logging.DEBUG):
        trace_log.setLevel(logging.DEBUG)
    limit_logger.addFilter(limit_filter)
    try:
        yield report
    finally:
        trace_log.removeHandler(trace_handler)
        limit_logger.removeFilter(limit_filter)
        if not trace_log.handlers:
            trace_log.setLevel(old_level)
        report.graphs_total = counters["stats"]["unique_graphs"] - graphs_before
        collector.flush()
        if GRAPH_BREAKS_REPORTED:
            report.graph_breaks = sum(len(r.graph_breaks) for r in report.records)
    if report.limit_hit:
        msg = limit_message(report)
        if strict:
            raise RecompileLimitError(msg)
        if warn:
            warnings.warn(msg, RecompileLimitWarning, stacklevel=3)


def limit_message(report: RecompileReport) -> str:
    """What ``recompiles(strict=True)`` raises with (and ``paramfold recompiles --strict`` says)."""
    return "recompile limit hit: " + "; ".join(r.fix or r.location for r in report.limit_hits)


# ----------------------------------------------------------------------------------------------
# Collection


@dataclasses.dataclass
class _Pending:
    reasons: list[str] = dataclasses.field(default_factory=list)
    failed: list[GuardFailure] = dataclasses.field(default_factory=list)  # ``reasons``, classified
    graphs: int = 0
    dynamic: list[str] = dataclasses.field(default_factory=list)
    breaks: list[str] = dataclasses.field(default_factory=list)
    limit: tuple[str, int, str] | None = None  # (limit_type, value, "'name' (file:line)")
    recompile: bool = False  # a recompile_reasons artifact arrived (torch logs one per recompile)
    target: _Target | None = None  # the callable behind a shared wrapper code object
    # counters["stats"]["unique_graphs"] when the compile started (dynamo_start): the graphs it
    # made are what torch counted meanwhile. A graph dynamo logged (dynamo_output_graph) whose
    # backend then failed is no graph: torch counts it only once the backend returned.
    graphs_at_start: int | None = None


class _Collector:
    def __init__(self, report: RecompileReport) -> None:
        self.report = report
        self.pending: dict[tuple[Any, Any, Any], _Pending] = {}
        self.frames: dict[tuple[Any, Any], tuple[str, str, int | None]] = {}
        # frames whose code is a shared wrapper's (torch's wrap_inline, paramfold's root frame)
        self.shared: dict[tuple[Any, Any], _Target] = {}
        # (co_name, co_filename, co_firstlineno) of a compiled function -> (input, dim, location) of
        # the shape guard its last compile failed on, for the resume functions it runs
        self.shape_inputs: dict[tuple[str, str, int | None], tuple[str, int, str]] = {}

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
                p = self._pending(key)
                p.reasons = _decode_reasons(payload)
                # classified now, while the frame's values the guards failed on can be looked up
                args = _compiling()
                namespaces, frame = _namespaces(args), self._compiled_frame(args)
                p.failed = [classify(r, namespaces, frame) for r in p.reasons]
                p.recompile = True
            elif artifact == "dynamo_graph_break_reason" and payload is not None:
                summary = _graph_break_summary(payload)
                if summary not in self._pending(key).breaks:
                    self._pending(key).breaks.append(summary)
        elif name == "dynamo_start":
            if key[2] == 0:
                self._new_frame(key)
            from torch._dynamo.utils import counters

            self._pending(key).graphs_at_start = counters["stats"]["unique_graphs"]
            target = _wrapped_target()
            if target is not None:
                self._pending(key).target = target
        elif name == "dynamo_output_graph":
            self._pending(key).graphs += 1
        elif name == "create_symbol":
            source = metadata["create_symbol"].get("source")
            dynamic = self._pending(key).dynamic
            # dynamo logs the symbol again each time it restarts the analysis (a graph break)
            if source and strip_local_scope(source) not in dynamic:
                dynamic.append(strip_local_scope(source))
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

    def _compiled_frame(self, args: dict[str, Any] | None) -> CompiledFrame | None:
        """What is known of the code dynamo is compiling (``args``: its ``_compile``'s arguments,
        :func:`_compiling`): its name and free variables, the decorator's code it is (a function
        with ``__wrapped__``), and for a resume function, the input a compiled function running it
        last recompiled on."""
        code = args.get("code") if args is not None else None
        if not isinstance(code, types.CodeType):
            return None
        decorated = _decorated(args)
        wrapper = _code_location(code) if decorated is not None else None
        caller_input = None
        if code.co_name.startswith("torch_dynamo_resume_in_"):
            # the functions running it are on the stack, outside dynamo: the outermost compiled
            # one whose last compile failed on an input's size names the input to mark
            frame = sys._getframe(1)
            while frame is not None:
                c = frame.f_code
                caller_input = self.shape_inputs.get((c.co_name, c.co_filename, c.co_firstlineno), caller_input)
                frame = frame.f_back
        return CompiledFrame(code.co_name, tuple(code.co_freevars), wrapper, caller_input)

    def _pending(self, key: tuple[Any, Any, Any]) -> _Pending:
        return self.pending.setdefault(key, _Pending())

    def _new_frame(self, key: tuple[Any, Any, Any]) -> None:
        """Forget what was kept of an earlier frame with this frame id: the first compile of a
        frame (frame compile id 0) gets a new id, and ids start again from 0 after
        ``torch._dynamo.reset()`` (``convert_frame.FRAME_COUNTER``), so a frame id seen before in
        the block may now stand for another code object."""
        frame = key[:2]
        for stale in [k for k in self.pending if k[:2] == frame and k != key]:
            self._finish_unfinished(stale)
        self.frames.pop(frame, None)
        self.shared.pop(frame, None)

    def _finish(self, key: tuple[Any, Any, Any], m: dict[str, Any]) -> None:
        p = self.pending.pop(key, _Pending())
        frame = key[:2]
        if key[2] == 0 and p.target is None:  # a frame's first compile, not of a shared wrapper
            self.shared.pop(frame, None)
        name, filename, lineno = m.get("co_name"), m.get("co_filename"), m.get("co_firstlineno")
        code_key = (name, filename, lineno)
        if p.target is not None:
            name, filename, lineno = p.target.name, p.target.filename, p.target.lineno
            self.shared[frame] = p.target
        if name is None and p.limit is not None and (fm := _FUNC_INFO.match(p.limit[2])):
            name, filename, lineno = fm["name"], fm["file"], int(fm["line"])
        if name is None and frame in self.frames:
            name, filename, lineno = self.frames[frame]
        if name is not None:
            self.frames[frame] = (name, filename or "?", lineno)
        fail_type, fail_reason = m.get("fail_type"), m.get("fail_reason")
        reason_hit = _LIMIT_FAIL_REASON.search(fail_reason or "")
        limit_hit = p.limit is not None or refused_at_limit(fail_type, fail_reason)
        reasons = p.reasons or ([m["recompile_reason"]] if m.get("recompile_reason") else [])
        if limit_hit:
            kind = "limit hit"
        elif m.get("recompile_reason") is not None or p.recompile:
            kind = "recompile"
        else:
            kind = "first compile"
        shared = self.shared.get(frame)
        record = CompileRecord(
            compile_id=m.get("compile_id") or _format_key(key),
            function=name or "?",
            filename=filename or "?",
            lineno=lineno,
            kind=kind,
            failed_guards=p.failed if p.reasons else [classify(r) for r in reasons],
            graphs=self._graphs_made(p),
            dynamic=p.dynamic,
            graph_breaks=p.breaks,
            fail_type=fail_type,
            fail_reason=fail_reason,
            shared_code=shared.shared_code if shared else None,
        )
        if code_key[0] is not None and not code_key[0].startswith("torch_dynamo_resume_in_"):
            inputs = [
                (g.tensor, g.dim, record.location) for g in record.failed_guards
                if g.category == "shape" and g.tensor and g.dim is not None and not g.tensor.startswith("___")
                and "[" not in g.tensor and "." not in g.tensor
            ]
            if inputs:
                self.shape_inputs[code_key] = inputs[0]
            else:
                self.shape_inputs.pop(code_key, None)
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
            record.fix = fix_text(
                shared.limit_fix if shared else "limit hit",
                function=record.location, limit=record.limit, limit_type=limit_type,
                shared_code=shared.shared_code if shared else None,
            )
        self.report.records.append(record)

    @staticmethod
    def _graphs_made(p: _Pending) -> int:
        """The graphs a compile made, as torch counts them (``unique_graphs``): a graph whose
        backend failed is not one; where the compile's start was not seen, the graphs dynamo logged."""
        if p.graphs_at_start is None:
            return p.graphs
        from torch._dynamo.utils import counters

        return max(0, counters["stats"]["unique_graphs"] - p.graphs_at_start)

    def flush(self) -> None:
        """Pending compiles whose metrics never arrived (e.g. an exception escaped mid-compile)."""
        for key in list(self.pending):
            self._finish_unfinished(key)
        self.pending.clear()

    def _finish_unfinished(self, key: tuple[Any, Any, Any]) -> None:
        """A record for a compile whose metrics never arrived, where it left anything to say."""
        p = self.pending[key]
        p.graphs_at_start = None  # the counter has moved on since: the graphs dynamo logged
        if p.reasons or p.graphs or p.limit or p.breaks:
            first_reason = p.reasons[0] if p.reasons else None
            self._finish(key, {"compile_id": None, "recompile_reason": first_reason})
        else:
            del self.pending[key]


_WRAP_INLINE = "torch._dynamo.external_utils.wrap_inline"
_ROOT_FORWARD = "paramfold.classes._root_forward"


@dataclasses.dataclass(frozen=True)
class _Target:
    """What a compile of a shared wrapper code object (``wrap_inline``'s ``inner``, paramfold's
    frame for a prepared root whose forward is torch's own) really compiles, and how it got there."""

    name: str
    filename: str
    lineno: int | None
    limit_fix: str  # the FIXES key for a limit hit, by how the callable was compiled
    shared_code: str = _WRAP_INLINE  # the wrapper, as CompileRecord.shared_code names it


def _compiling() -> dict[str, Any] | None:
    """The arguments of dynamo's ``_compile(code, globals, locals, ...)`` (same names in torch 2.5
    .. 2.15) when called from a trace or log record emitted inside it, else None."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_compile" and code.co_filename.endswith("convert_frame.py"):
            return frame.f_locals
        frame = frame.f_back
    return None


def _namespaces(args: dict[str, Any] | None) -> tuple[Any, Any] | None:
    """The globals and locals of the frame dynamo is compiling (what its guards' ``G[...]`` and
    locals name), from its ``_compile``'s arguments (:func:`_compiling`)."""
    if args is None or args.get("globals") is None or args.get("locals") is None:
        return None
    return args["globals"], args["locals"]


def _wrapped_target() -> _Target | None:
    """The callable behind a shared wrapper when dynamo is compiling that wrapper, else None.

    ``wrap_inline(fn)`` returns ``inner``, one code object for every wrapped ``fn``; its closure
    holds ``fn``. A prepared root whose forward is torch's own runs that forward in a frame of
    paramfold's (``classes.root_forward_of``), one code object per such forward. Called from a
    trace or log record emitted inside dynamo's ``_compile(code, locals, ...)``, whose arguments
    (same names in torch 2.5 .. 2.15) say what it compiles.
    """
    from torch._dynamo import external_utils

    from paramfold.classes import root_forward_of

    inner = external_utils.wrap_inline(_wrapped_target).__code__
    args = _compiling()
    if args is None:
        return None
    compiled = args.get("code")
    if compiled is inner:
        fn = (args.get("locals") or {}).get("fn")
        return _describe_callable(fn) if fn is not None else None
    forward = root_forward_of(compiled)
    if forward is None:
        decorated = _decorated(args)
        if decorated is None:
            return None
        target = _describe_callable(decorated)
        return dataclasses.replace(target, limit_fix="limit hit:shared_decorator", shared_code=_code_location(compiled))
    target = _describe_callable(forward)
    return dataclasses.replace(target, limit_fix="limit hit:shared_root", shared_code=_ROOT_FORWARD)


def _decorated(args: dict[str, Any]) -> Any:
    """The function a decorator's code wraps, where dynamo compiles that code: a closure
    (``functools.wraps``-style ``wrapper``, as transformers' ``merge_with_config_defaults`` & co.)
    whose function has ``__wrapped__``. Its code object is one for every function it decorates.
    The function is found as an attribute of the first argument's class (a decorated method,
    ``self``'s forward) or else among the referrers of the code, by the closure cells of the frame."""
    code, closure = args.get("code"), args.get("closure")
    if not isinstance(code, types.CodeType) or not closure or not code.co_freevars:
        return None
    if not any(inspect.isroutine(_cell_contents(c)) for c in closure):  # nothing wrapped in there
        return None

    def wraps_here(fn: Any) -> bool:
        return (
            isinstance(fn, types.FunctionType) and fn.__code__ is code and fn.__closure__ is not None
            and len(fn.__closure__) == len(closure) and all(a is b for a, b in zip(fn.__closure__, closure))
            and "__wrapped__" in fn.__dict__
        )

    found = None
    local = args.get("locals") or {}
    if code.co_argcount and code.co_varnames[0] in local:
        for cls in type(local[code.co_varnames[0]]).__mro__:
            found = next((v for v in vars(cls).values() if wraps_here(v)), None)
            if found is not None:
                break
    if found is None:
        import gc

        found = next((r for r in gc.get_referrers(code) if wraps_here(r)), None)
    return found.__dict__["__wrapped__"] if found is not None else None


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _code_location(code: types.CodeType) -> str:
    return f"{code.co_name} ({short_path(code.co_filename)}:{code.co_firstlineno})"


def _describe_callable(fn: Any) -> _Target:
    """Name, file and first line of what a wrapped ``fn`` runs, and the limit fix for its entry."""
    owner = getattr(fn, "__self__", None)
    if isinstance(fn, torch.nn.Module):
        # torch.compile(m) where m's forward is torch's own (nn.Sequential, nn.Linear, ...):
        # OptimizedModule wraps the module itself (seen in torch 2.13's OptimizedModule._initialize).
        fn, limit_fix = type(fn).forward, "limit hit:shared_module"
    elif getattr(fn, "__name__", "") in ("_call_impl", "_wrapped_call_impl") and isinstance(
        owner, torch.nn.Module
    ):
        # layer.compile() on a torch.nn module, torch >= 2.14: what Module._call_impl runs
        fn, limit_fix = type(owner).forward, "limit hit:shared"
    else:
        limit_fix = "limit hit:shared_callable"
    code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    if code is None:
        return _Target(name, getattr(fn, "__module__", None) or "?", None, limit_fix)
    return _Target(name, code.co_filename, code.co_firstlineno, limit_fix)


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


class _LimitWarningFilter(logging.Filter):
    """Catches dynamo's own "hit config.recompile_limit" warning (its args are structured) before
    any handler sees it; ``keep=False`` then stops it there."""

    def __init__(self, collector: _Collector, *, keep: bool) -> None:
        super().__init__()
        self.collector = collector
        self.keep = keep

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(_LIMIT_WARNING_PREFIX)):
            return True
        try:
            self.collector.on_limit_warning(tuple(record.args or ()))
        except Exception as e:
            self.collector.report.collection_errors.append(f"{type(e).__name__}: {e}")
        return self.keep


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
    return f"{short_path(path)}:{line}" if sep else loc


def _format_key(key: tuple[Any, Any, Any]) -> str:
    ca, frame_id, frame_compile_id = key
    base = f"{frame_id}/{frame_compile_id}"
    return f"!{ca}/{base}" if ca is not None else base
