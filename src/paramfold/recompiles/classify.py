"""Read torch's guard-failure text: which category a recompile belongs to, and the fix for it.

``torch.compile`` guards each graph; when one fails, torch reports the failed check as text (the
``recompile_reasons`` trace artifact, ``torch._dynamo.utils.guard_failures``). That text is the only
thing paramfold parses: :func:`classify` picks one of :data:`CATEGORIES` for it, names the tensor
and dim where it can, and fills in the fix from :data:`FIXES` (the one table of fix texts). The text
does not say what a tensor reached as a module's attribute is (``self.cache``, and paramfold's value
of a parametrized weight, ``self._modules['lin'].weight``, are spelled alike): given the namespaces
of the frame whose guard failed, :func:`classify` looks the module up (``_stands_for_parameter``).

The wording is torch's, not a promise, so each pattern below says where it comes from. All of them
were checked against the real messages of torch 2.5 to 2.15: ``tests/test_recompiles.py`` causes
each category for real and compares paramfold's reasons with torch's own ``guard_failures`` (run on
every version of the nox matrix; README's version table). What differs between those versions:

* torch < 2.7 spells locals ``L['x']``, 2.7+ ``x``; :func:`strip_local_scope` reports the newer
  spelling on all.
* the tensor checks (``tensor 'x' size mismatch at index 1. expected 8, actual 1``, ``stride``,
  ``rank``, ``requires_grad``, ``dtype``, ``dispatch key set``, ``device index``) are the C++
  ``TensorGuards`` wording (``torch/csrc/dynamo/guards.cpp``), the same in 2.5 to 2.15.
* ``GLOBAL_STATE changed: grad_mode ...`` is the C++ ``GlobalStateGuard``; ``___check_obj_id`` /
  ``___check_type_id`` are the Python code parts of ID_MATCH / TYPE_MATCH; "GuardAccessor: Not a",
  "got deallocated" and "Cache line invalidated" come from the guard manager
  (``torch/_dynamo/guards.py``), all present in 2.5 to 2.15.
* an input marked with ``torch._dynamo.mark_dynamic`` & co. when the graph's was not (or marked
  otherwise): 2.13 words it ``_has_dynamo_dim_marking is present on runtime tensor but was absent
  at compile time`` or ``_dynamo_dynamic_indices not a subset: ...`` (C++, naming no tensor), older
  torch as the Python code part ``hasattr(x, '_dynamo_dynamic_indices') == False``; both name a
  ``_dynamo_*_indices`` attribute or ``_has_dynamo_dim_marking``.
* a ``___check_type_id`` guard names the class it wanted, ``type=<class '...'>`` (2.13; where torch
  leaves that out, it gets the generic identity fix): a class of torch's parametrize
  (``torch.nn.utils.parametrize.Parametrized<Cls>``, one per parametrized module) gets the
  ``paramfold.prepare`` fix. paramfold's own classes are named as the class they were made from,
  so the guard's id is looked up (``paramfold.classes.class_by_id``): the guard text then says it
  is paramfold's class, and a module whose class train()/eval() of its stateful chain swapped gets
  ``training``.
* a bool or None the graph was made for (a flag read in the code) is ``x == True`` / ``x is None``
  in 2.13 (BOOL_MATCH / NONE_MATCH, guards.py's CONSTANT_MATCH), an ID_MATCH on ``True``, ``False``
  or ``None`` in older torch (``___check_obj_id`` of their id, read in this process): both get the
  flag fix, which does not say "pass it as a tensor" (a branch on a tensor's value breaks the graph).
* a module's hook dicts (``_forward_hooks``, ``_forward_pre_hooks``, ``_backward_hooks``, the
  global ``_global_forward_hooks`` & co.) are guarded only with
  ``torch._dynamo.config.skip_nnmodule_hook_guards = False`` (2.13: ``not
  self._modules['l']._forward_hooks``); any guard naming one is ``hooks``.
* a symbolic-shape guard is the shape expression itself (``2 <= x.size()[1]``, with
  "0/1 specialization" in its comment from 2.6 on).

If torch rewords one of these, that guard falls through to ``other`` (with the verbatim guard in the
fix) instead of its own category: the report stays right about what failed, only less specific.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["CATEGORIES", "FIXES", "CompiledFrame", "GuardFailure", "classify", "fix_text", "strip_local_scope"]

CATEGORIES = (
    "shape",
    "requires_grad",
    "training",
    "grad_mode",
    "dtype/device",
    "hooks",
    "id/object identity",
    "limit hit",
    "other",
)

# The one table of fix texts. Keys are a category, optionally ":variant". Placeholders are filled
# from the failed guard: {tensor} {dim} {expected} {actual} {source} {cls} {state} {guard}
# {function} {limit_type} {limit}.
# The two fixes of a resume function's shape guard (shape:resume, shape:resume_input) differ only
# in what they say of the input the value follows.
_RESUME_FIX_HEAD = (
    "{tensor} is {what} in {function}, the resume function dynamo compiled after a graph break "
    "in {parent}, which gets every value live at the break as an input of its own: "
    "torch._dynamo.mark_dynamic cannot reach {tensor} there (an intermediate no code of yours "
    "names, or a tensor whose marked dim it ties to a static one: ConstraintViolationError). "
    "Compile with dynamic=True (one graph for every size from the first call on, except where "
    "a weight's shape fixes that dim, as each layer's channel count: one graph per width, "
    "whatever is marked); "
)
_RESUME_FIX_TAIL = (
    "with neither, torch makes the dim dynamic by itself after it changed once (unless compiled "
    "with dynamic=False). Removing the graph break removes the resume function"
)

FIXES: dict[str, str] = {
    "shape": (
        "torch._dynamo.mark_dynamic({tensor}, {dim}) before the first call (or compile with "
        "dynamic=True; with neither, torch makes the dim dynamic by itself after it changed once, "
        "unless compiled with dynamic=False); where a weight's shape fixes that dim (models of "
        "different widths called through one compiled function), marking it raises "
        "ConstraintViolationError: that is one graph per width"
    ),
    "shape:resume": (
        _RESUME_FIX_HEAD + "marking the dim of the compiled function's input it follows "
        "(torch._dynamo.maybe_mark_dynamic) removes that function's own recompile, not this one "
        "(torch 2.13); " + _RESUME_FIX_TAIL
    ),
    "shape:resume_input": (
        _RESUME_FIX_HEAD + "{caller}, which runs it, last recompiled on its input {input} dim "
        "{input_dim}: torch._dynamo.maybe_mark_dynamic({input}, {input_dim}) before the first call "
        "removes that recompile, not this one (torch 2.13); " + _RESUME_FIX_TAIL
    ),
    "shape:size01": (
        "expected: sizes 0 and 1 are specialised, even on a dim marked dynamic; "
        "torch._dynamo.decorators.mark_unbacked({tensor}, {dim}) before the first call lets one "
        "graph serve them too"
    ),
    "shape:symbolic": (
        "a shape relation the graph assumed no longer holds ({guard}); mark the dims involved with "
        "torch._dynamo.mark_dynamic, or keep the relation stable"
    ),
    "shape:marking": (
        "the input's dim marks (torch._dynamo.mark_dynamic / maybe_mark_dynamic / mark_static / "
        "mark_unbacked) differ from those of the call the graph was made for ({guard}): mark it "
        "the same way on every call, starting before the first call"
    ),
    "shape:stride": (
        "{tensor} arrived with other strides than the graph was made for (a transposed, sliced or "
        "otherwise non-contiguous view, or the other way round; marking dims dynamic does not "
        "change this): pass it in one layout on every call, e.g. {tensor}.contiguous(), or accept "
        "one graph per layout"
    ),
    "shape:rank": (
        "{tensor} has {actual} dims, the graph was made for {expected}: no setting lets one graph "
        "serve inputs of different ranks (mark_dynamic neither); pass one rank on every call "
        "(reshape/unsqueeze before the call), or accept one graph per rank"
    ),
    "shape:parameter": (
        "parameter/buffer {tensor} changed shape; before the first call set "
        "torch._dynamo.config.force_parameter_static_shapes = False (and "
        "force_nn_module_property_static_shapes = False where it belongs to a module of torch's "
        "own, nn.Linear & co.) and torch._dynamo.mark_dynamic(...) dim {dim} of the "
        "parameter/buffer there before the first call and of every new one put there: one graph "
        "serves all shapes; with the settings alone, the first change still recompiles and later "
        "ones reuse its graph"
    ),
    "requires_grad": (
        "a parameter's requires_grad differs from the call the graph was made for (frozen vs "
        "trainable): under torch.no_grad()/inference_mode, run the models through "
        "paramfold.prepare(..., detach_params_under_no_grad=True) and one graph serves both; with "
        "grad mode on nothing removes it: keep requires_grad consistent, or accept one graph per "
        "requires_grad setting"
    ),
    "requires_grad:inline": (
        "parametrization original {tensor}, read by mode \"inline\"'s getter inside the graph, "
        "requires grad in one call and not in another (frozen vs trainable copies): "
        "detach_params_under_no_grad does not reach it; under torch.no_grad()/inference_mode "
        "prepare the models with \"auto\" or \"hoist\" and detach_params_under_no_grad=True "
        "(their values carry no requires_grad there) and one graph serves both, or accept one "
        "graph per requires_grad setting"
    ),
    "requires_grad:attribute": (
        "{tensor}, a tensor attribute of a module (not a parameter or buffer), requires grad in one "
        "call and not in another (a cache or running value set from tensors with grad in one call and "
        "without in another): set it the same way in every call, or accept one graph each; .detach() "
        "where it is set only where no gradient has to flow back through it: it cuts the gradient to "
        "everything that computed it"
    ),
    "requires_grad:input": (
        "input {tensor} requires grad in one call and not in another: call .requires_grad_() on the "
        "input where it does not (layers compiled one by one: on the model's input, which the first "
        "layer gets without grad and the next ones as an activation with it), or accept one graph "
        "each; .detach() only where no gradient has to flow back through it: it cuts the gradient "
        "to everything that computed it"
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
        "function or closure, module of another class): reuse one object, or accept one graph "
        "per object"
    ),
    "id/object identity:decorator": (
        "{source} is (part of) the function that the decorator's code {wrapper} wraps: what it "
        "decorates (the forwards of several models) run through this ONE code object, which gets "
        "a graph per wrapped function and ONE recompile limit for all of them "
        "(torch._dynamo.config.{limit_type}): past it the later ones run EAGER, and compiling each "
        "model on its own (torch.compile(model), model.compile()) does not separate them. Raise "
        "torch._dynamo.config.{limit_type} above the graphs they need, or compile a module inside "
        "each model whose forward is not decorated"
    ),
    "hooks": (
        "a module hook was registered or removed after the graph was made ({source}): register "
        "the hooks before the first call and keep them (add or remove none between calls), or "
        "accept one graph per set of hooks"
    ),
    "training:paramfold": (
        "the graph was made with {source} in {mode} mode: paramfold.prepare gives a module whose "
        "stateful chain (spectral_norm's power iteration) trains one class of paramfold's while "
        "it trains and another in eval, both named as {cls} is, so switching train()/eval() "
        "recompiles here, as stock's .training guard does: put models that share this code in "
        "the same train/eval mode"
    ),
    "id/object identity:parametrize": (
        "{source} is a module of another class ({cls}): torch's parametrize "
        "(register_parametrization, weight_norm, spectral_norm, ...) gives every parametrized "
        "module a class of its own, so modules of one architecture recompile one after another; "
        "paramfold.prepare(model) before compiling gives them one class per architecture, which "
        "removes this guard; modules that differ otherwise (a conv's stride or padding, a weight's "
        "shape) still get a graph each, which the next guard then shows"
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
    "limit hit:shared_module": (
        "torch stopped compiling {function} at torch._dynamo.config.{limit_type}={limit} and runs "
        "it EAGER from now on. torch.compile(module) of a module whose forward is torch's own "
        "(nn.Sequential, nn.Linear, ...) runs it through one shared wrapper code object "
        "(torch._dynamo.external_utils.wrap_inline), so every module compiled that way, of any "
        "class, shares ONE recompile limit: compile the parent model that calls them once "
        "instead of each, or raise torch._dynamo.config.{limit_type}"
    ),
    "limit hit:shared_callable": (
        "torch stopped compiling {function} at torch._dynamo.config.{limit_type}={limit} and runs "
        "it EAGER from now on. torch.compile runs it through one shared wrapper code object "
        "(torch._dynamo.external_utils.wrap_inline), as it does every callable it cannot trace "
        "as a frame of its own, so all of them share ONE recompile limit: compile the function "
        "that calls it instead, or raise torch._dynamo.config.{limit_type}"
    ),
    "limit hit:shared_decorator": (
        "torch stopped compiling {function} at torch._dynamo.config.{limit_type}={limit} and runs "
        "it EAGER from now on. It runs through a decorator's code, {shared_code}, one code object "
        "for every function it decorates (the forwards of several models), so all of them share "
        "ONE recompile limit, and compiling each model on its own (torch.compile(model), "
        "model.compile()) does not separate them: raise torch._dynamo.config.{limit_type} above "
        "the graphs they need, or compile a module inside each model whose forward is not "
        "decorated"
    ),
    "limit hit:shared_root": (
        "torch stopped compiling {function} at torch._dynamo.config.{limit_type}={limit} and runs "
        "it EAGER from now on. paramfold.prepare runs the forward of a model whose forward is "
        "torch's own (nn.Sequential, nn.Linear, ...) in a frame of its own, one code object per "
        "such forward (paramfold.classes._root_forward), so every prepared model with this "
        "forward compiled on its own (torch.compile(model)) shares ONE recompile limit, as "
        "instances of one class share their forward's: compile the parent model that calls them "
        "once instead of each, or raise torch._dynamo.config.{limit_type}"
    ),
    "other": (
        "a Python value the compiled code depends on changed ({guard}): keep it constant between "
        "calls, or accept one graph per value; a number the code only computes with can be "
        "passed as a tensor argument instead, one it branches on (if/while) cannot: a branch on "
        "a tensor's value breaks the graph"
    ),
    "other:flag": (
        "{source} is a flag (True/False/None) and the graph was made for one value of it: one "
        "graph per value is expected (two for a bool), each reused from then on; keep it fixed "
        "while the compiled code runs to have one. Passing it as a tensor does not help: a branch "
        "on a tensor's value breaks the graph"
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
    r"^tensor '(?P<tensor>.+)' dtype mismatch\. expected (?P<expected>[^\s,.]+),? actual (?P<actual>[^\s,.]+)"
)
_DISPATCH = re.compile(r"^tensor '(?P<tensor>.+)' dispatch key set mismatch\.")
_DEVICE = re.compile(r"device (index )?mismatch", re.IGNORECASE)
_DIM_MARKING = re.compile(r"_has_dynamo_dim_marking|_dynamo_\w*_indices\b")
_MARKED_TENSOR = re.compile(r"hasattr\((?P<tensor>[^,]+), '_dynamo_")
_SYM_SIZE = re.compile(r"(?P<tensor>[\w.\[\]'\"]+?)\.size\(\)\[(?P<dim>\d+)\]")
_SYM_STRIDE = re.compile(r"\.(size|stride)\(\)\[\d+\]|\.storage_offset\(\)")
_TRAINING = re.compile(r"(?P<source>[\w.\[\]'\"]+)\.training\b")
_OBJ_ID = re.compile(r"___check_(obj|type)_id\((?P<source>[^,]+),\s*(?P<id>\d+)?")
_TYPE_NAMED = re.compile(r"type=<class '[^']*'>")
# The class torch.nn.utils.parametrize._inject_new_class makes for each parametrized module.
_PARAMETRIZED_TYPE = re.compile(r"type=<class 'torch\.nn\.utils\.parametrize\.(?P<cls>Parametrized\w*)'>")
# An original as inline's getter reads it: the dict it lives in, kept on the module as
# ``_paramfold_<name>_<original>`` (paramfold.inline.ref_keys, DictRef's ``d``).
_INLINE_ORIGINAL = re.compile(r"\._paramfold_\w+\.d\[")
# BOOL_MATCH / NONE_MATCH (``x == True``, ``x is None``; torch 2.13, guards.py CONSTANT_MATCH);
# older torch guards them with ID_MATCH on True, False or None (see _categorize).
_FLAG = re.compile(r"^(?P<source>.+?) (?:== (?:True|False)|is None)$")
# A module's hook dicts (Module._forward_hooks & co., and the global ones of
# torch.nn.modules.module), guarded with torch._dynamo.config.skip_nnmodule_hook_guards=False.
_HOOKS = re.compile(r"(?P<source>[\w.\[\]'\"]*_(?:global_)?(?:forward|backward)(?:_pre)?_hooks\w*)")
# A resume function dynamo makes after a graph break (torch/_dynamo/resume_execution.py, the same
# name in 2.5 to 2.15); its guards name values on dynamo's stack as ``___stack0``.
_RESUME = re.compile(r"^torch_dynamo_resume_in_(?P<parent>.+)_at_(?P<line>\d+)$")
_STACK_VALUE = re.compile(r"^___stack\d+$")
_GLOBAL_STATE = "GLOBAL_STATE changed:"
_IDENTITY_MARKERS = ("GuardAccessor: Not a", "got deallocated", "Cache line invalidated")
_COMPILE_ID_PREFIX = re.compile(r"^(?P<cid>[^\s:]+): (?P<rest>.*)$", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class CompiledFrame:
    """What the collector knows of the code whose guard failed, beyond its namespaces."""

    name: str  # the code object's name (``forward``, ``torch_dynamo_resume_in_forward_at_12``)
    freevars: tuple[str, ...] = ()
    # "wrapper (file:line)" where the code is a decorator's, shared by the functions it decorates
    wrapper: str | None = None
    # for a resume function: (input, dim, "function (file:line)") where a compiled function running
    # it last recompiled on the size of one of its inputs
    caller_input: tuple[str, int, str] | None = None


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


def classify(
    reason: str,
    namespaces: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None,
    frame: CompiledFrame | None = None,
) -> GuardFailure:
    """One entry of torch's guard-failure text (``"0/1: tensor 'x' dtype mismatch. ..."``) classified.

    ``namespaces``: the globals and locals of the frame whose guard failed (what dynamo's ``G[...]``
    and locals name), there to tell a tensor a guard reaches as a module's attribute that stands for
    a parameter or buffer from a plain one (``_stands_for_parameter``); without them, only
    ``._parameters[...]`` and ``._buffers[...]`` are taken for parameters and buffers. ``frame``:
    what is known of that frame's code (a resume function after a graph break, whose shape guards
    name values no code of the user's names; a decorator's code shared by the functions it wraps).

    Example::

        >>> g = classify("0/0: tensor 'x' dtype mismatch. expected Float, actual Double")
        >>> g.cached_compile_id, g.category, g.tensor
        ('0/0', 'dtype/device', 'x')
    """
    m = _COMPILE_ID_PREFIX.match(reason)
    cid, rest = (m["cid"], m["rest"]) if m else ("?", reason)
    # torch < 2.7 spells locals L['x']; 2.7+ spells them x: report the newer spelling on all.
    guard = strip_local_scope(rest.split("\nUser stack trace:", 1)[0].split("\n", 1)[0].rstrip())
    # Code-part guards carry "  # <user source line>" comments; match on the check alone.
    expr = re.split(r"\s+# ", guard, maxsplit=1)[0].strip()
    category, variant, fields = _categorize(expr, guard, namespaces)
    if frame is not None:
        variant = _in_frame(frame, category, variant, fields)
    if note := fields.pop("note", None):  # torch names paramfold's class as the one it was made from
        guard = _TYPE_NAMED.sub(lambda t: f"{t[0]} ({note})", guard, count=1)
    fields.setdefault("guard", expr)
    key = f"{category}:{variant}" if variant else category
    return GuardFailure(
        cached_compile_id=cid,
        reason=reason,
        guard=guard,
        category=category,
        fix=fix_text(key, **fields),
        tensor=fields.get("tensor") or fields.get("source"),
        dim=int(fields["dim"]) if fields.get("dim") is not None else None,
    )


def _categorize(
    expr: str, guard: str, namespaces: tuple[Mapping, Mapping] | None
) -> tuple[str, str | None, dict[str, Any]]:
    if m := _REQUIRES_GRAD.match(expr):
        f = m.groupdict()
        if _INLINE_ORIGINAL.search(f["tensor"]):
            return "requires_grad", "inline", f
        kind = _tensor_kind(f["tensor"], namespaces)
        return "requires_grad", None if kind == "parameter" else kind, f
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
        if _tensor_kind(f["tensor"], namespaces) == "parameter":
            return "shape", "parameter", f
        # A backed size of 0 or 1 becomes a constant (ShapeEnv.create_symbol's specialize_zero_one,
        # marked dynamic or not): a graph made for one serves no other size, nor one made for
        # other sizes 0 or 1. Only an unbacked dim escapes that.
        if f["what"] == "size" and (int(f["actual"]) in (0, 1) or int(f["expected"]) in (0, 1)):
            return "shape", "size01", f
        if f["what"] == "stride":
            return "shape", "stride", {"tensor": f["tensor"], "dim": f["dim"]}
        return "shape", None, f
    if _DIM_MARKING.search(expr):
        m = _MARKED_TENSOR.search(expr)
        return "shape", "marking", {"tensor": m["tensor"].strip()} if m else {}
    if m := _RANK_MISMATCH.match(expr):
        return "shape", "rank", m.groupdict()
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
    if m := _HOOKS.search(expr):
        return "hooks", None, m.groupdict()
    if m := _TRAINING.search(expr):
        return "training", None, m.groupdict()
    if m := _FLAG.match(expr):
        return "other", "flag", m.groupdict()
    if m := _OBJ_ID.search(expr):
        source = m["source"].strip()
        if m[1] == "obj" and m["id"] and int(m["id"]) in (id(True), id(False), id(None)):
            return "other", "flag", {"source": source}
        if m[1] == "type" and m["id"] and (pf := _paramfold_class(int(m["id"]))) is not None:
            base, role = pf
            f = {"source": source, "cls": base.__qualname__, "mode": role}
            f["note"] = f"paramfold's class of that {base.__qualname__}" + (f", for {role}" if role else "")
            if role:  # paramfold swaps a module's class only on train()/eval() of a stateful chain
                return "training", "paramfold", f
            return "id/object identity", None, f
        if m[1] == "type" and (p := _PARAMETRIZED_TYPE.search(expr)):
            return "id/object identity", "parametrize", {"source": source, "cls": p["cls"]}
        return "id/object identity", None, {"source": source}
    if any(t in expr for t in _IDENTITY_MARKERS):
        source = expr.rsplit(" on ", 1)[-1] if " on " in expr else expr
        return "id/object identity", None, {"source": source}
    if expr.startswith("BACKEND_MATCH"):
        return "other", "backend", {}
    return "other", None, {}


def _in_frame(frame: CompiledFrame, category: str, variant: str | None, fields: dict[str, Any]) -> str | None:
    """The fix variant where the frame's code says more than the guard: a shape guard of a resume
    function (``___stack0``, a local of the function that broke), an identity guard on the function
    a shared decorator's code wraps (its free variable). Fills in the fields that variant needs."""
    if category == "shape" and variant in (None, "size01", "symbolic") and fields.get("tensor"):
        resume = _RESUME.match(frame.name)
        stack = _STACK_VALUE.match(fields["tensor"]) is not None
        if resume is None and not stack:
            return variant
        parent = f"{resume['parent']} (line {resume['line']})" if resume else "the compiled function"
        fields["function"] = frame.name
        fields["parent"] = parent
        fields["what"] = (
            "a value on dynamo's stack (an intermediate result that was live at the graph break)" if stack
            else f"a value of {resume['parent'] if resume else 'the function'} live at the graph break"
        )
        if frame.caller_input is None:
            return "resume"
        fields["input"], fields["input_dim"], fields["caller"] = frame.caller_input
        return "resume_input"
    if category == "id/object identity" and variant is None and frame.wrapper and fields.get("source"):
        head = re.match(r"[A-Za-z_]\w*", fields["source"])
        if head and head[0] in frame.freevars:
            fields["wrapper"] = frame.wrapper
            from torch._dynamo import config

            fields["limit_type"] = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            return "decorator"
    return variant


def _paramfold_class(cls_id: int) -> tuple[type, str] | None:
    """(class made from, what for) where the id a type guard names is one of paramfold's classes,
    which torch names as the class they were made from (``classes.class_by_id``)."""
    from paramfold.classes import class_by_id

    return class_by_id(cls_id)


def _tensor_kind(source: str, namespaces: tuple[Mapping, Mapping] | None) -> str:
    """``"parameter"`` (a parameter or buffer, or a tensor standing for one), ``"attribute"`` (a
    plain tensor attribute of a module) or ``"input"`` (anything else) for a guard's tensor."""
    if "._parameters[" in source or "._buffers[" in source:
        return "parameter"
    found = _owner(source, namespaces) if namespaces is not None else None
    if found is None or not isinstance(found[0], torch.nn.Module):
        return "input"
    return "parameter" if _stands_for_parameter(*found) else "attribute"


def _stands_for_parameter(module: torch.nn.Module, name: str) -> bool:
    """Whether ``module.<name>``, a tensor in the module's ``__dict__`` (which is how a guard reaches
    it as ``self._modules['lin'].weight``), stands for one of its parameters or buffers: the value
    that paramfold's hoist, freeze or auto computed for a parametrized tensor (one of the module's
    sites), or a parameter paramfold presents detached under no_grad. A plain tensor attribute
    (``self.cache = torch.cat(...)``) does not: dynamo treats it as any tensor, so the parameter
    settings (``force_parameter_static_shapes``) do nothing for it."""
    from paramfold.state import state_of

    state = state_of(module)
    return name in module._parameters or name in module._buffers or (state is not None and name in state.sites)


# A guard source as torch writes it: a local (``self``; ``L['self']`` before torch 2.7, spelled the
# newer way by strip_local_scope) or a global (``G['model']``), then attributes and subscripts.
_SOURCE_HEAD = re.compile(r"G\[(['\"])(?P<glob>[^'\"]+)\1\]|(?P<local>[A-Za-z_]\w*)")
_SOURCE_STEP = re.compile(r"\.(?P<attr>[A-Za-z_]\w*)|\[(['\"])(?P<key>[^'\"]*)\2\]|\[(?P<index>-?\d+)\]")


def _owner(source: str, namespaces: tuple[Mapping, Mapping]) -> tuple[Any, str] | None:
    """The object whose attribute ``source`` ends with and the attribute's name, looked up without
    running user code (instance ``__dict__`` entries, dict/list items, slots); None where it is not
    found so."""
    m = _SOURCE_HEAD.match(source)
    steps = list(_SOURCE_STEP.finditer(source, m.end())) if m else []
    if not m or not steps or steps[-1]["attr"] is None or "".join(s[0] for s in steps) != source[m.end():]:
        return None
    try:
        obj = namespaces[0][m["glob"]] if m["glob"] else namespaces[1][m["local"]]
        for step in steps[:-1]:
            if step["attr"] is not None:
                obj = _plain_attribute(obj, step["attr"])
            else:
                if not isinstance(obj, (dict, list, tuple)):
                    return None
                obj = obj[step["key"] if step["key"] is not None else int(step["index"])]
    except (KeyError, IndexError, AttributeError, TypeError):
        return None
    return obj, steps[-1]["attr"]


def _plain_attribute(obj: Any, name: str) -> Any:
    """``obj.<name>`` where it is an instance ``__dict__`` entry or a slot / C-level attribute
    (``__closure__``, ``cell_contents``), whose read runs no user code; AttributeError otherwise."""
    try:
        own = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        own = None
    if isinstance(own, dict) and name in own:
        return own[name]
    found = inspect.getattr_static(obj, name)
    if isinstance(found, (types.MemberDescriptorType, types.GetSetDescriptorType)):
        return found.__get__(obj, type(obj))
    raise AttributeError(name)


class _Blank(dict):
    def __missing__(self, key: str) -> str:
        return "?"


def fix_text(key: str, **fields: Any) -> str:
    """The fix of :data:`FIXES` for ``category[:variant]``, its placeholders filled (``?`` if unknown)."""
    template = FIXES.get(key) or FIXES[key.split(":", 1)[0]]
    return template.format_map(_Blank({k: v for k, v in fields.items() if v is not None}))


def strip_local_scope(s: str) -> str:
    """``L['x'].size()[1]`` (torch < 2.7) -> ``x.size()[1]`` (2.7+)."""
    return re.sub(r"L\[\s*['\"](.*?)['\"]\s*\]", r"\1", s)
