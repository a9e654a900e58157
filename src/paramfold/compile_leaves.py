"""Hoisted values look like leaves to dynamo while it compiles, and are the values when code runs.

In grad mode a hoisted value is a non-leaf tensor: it was computed from the originals, and its
autograd history is how their gradients arrive. Dynamo turns every graph input into a fake
tensor when it compiles, and for one with an autograd history it fakes one too
(``MetaConverter._backward_error``, about 0.5 ms per input: ``examples/fake_input_cost.py``),
which the plain model's Parameters, leaves, do not cost: 1.1x-1.2x the plain model's first
compiled call on the seed's 64 hoisted inputs.

So while dynamo compiles a frame on a thread, every hoisted value that the scopes open on that
thread have installed in a module's ``__dict__`` is replaced there by a *stand-in*: the same
tensor detached, then requiring grad (a leaf on the same storage, with the same dtype, shape,
strides and ``requires_grad``; one stand-in per value, so inputs that were one tensor stay one).
Dynamo fakes and guards the stand-ins; their guards (dispatch keys, dtype, device, shape,
strides, ``requires_grad``) hold for the values too, since none looks at autograd history. The
values are put back as soon as the frame's code is made (dynamo's bytecode hook, on the same
thread) or the compile ends without code (its end callback): before any compiled code runs, so
that code reads the values and the originals' gradients arrive through their histories, exactly
as before.

Dynamo's compile callbacks run only for the first of overlapping compiles anywhere in the
process (one counter for all threads): a stand-in is installed only when dynamo itself compiles
a frame (not a lazily compiled backward, a CUDA graph recording or an export). Where a compile
still ended without putting its stand-ins back — it made no code and another thread's compile
was running meanwhile, so its end callback ran there — they are *stranded*: seen when this
thread's next compile starts or ends, or as the scope closes, and the call, which may have run
on them, is refused as its scope closes (:func:`restore_stranded`): its gradients would have
stopped at a stand-in.

A compile may also clear the write marks of the frozen values it reads
(:func:`paramfold.write_marks.arm`): inductor's ``freezing`` packs each weight, through a writable
pointer, and keeps a view of it. With ``freeze_check="version"``, marks that stood as the compile
began and that it cleared with nothing written are set again as it ends (same callbacks), where
later calls would otherwise take the view for an array a caller made and hash the value's bytes
at every call (as the content check does).

While it compiles, every plain-tensor value (and ``detach_params_under_no_grad``'s alias of a
plain parameter) is also marked static (``_dynamo_static_indices``, as ``torch._dynamo.mark_static``
marks), the mark taken off again as the compile ends: the tensors they stand for are Parameters
or buffers, which dynamo keeps static under ``torch.compile(dynamic=True)``, where a plain tensor
in a module's ``__dict__`` of the user's own class (not torch.nn's) would get symbolic sizes, and
an input dim of the same size would be tied to one (a graph made for one sequence length, and a
recompile at the next one, which stock does not make). A dim marked at compile time and unmarked
when the code runs passes dynamo's guard on the marks, so no call has to mark its values.

``torch._dynamo.config.install_free_tensors`` and ``prepare_freezing`` make dynamo copy a
module's tensor attributes into the graph, where a value (a stand-in, or a value of one call)
would stay: a compile under a scope with either on is refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from paramfold.errors import FoldError
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.site_values import freezing_now
from paramfold.state import CALLS, STATE_ATTR
from paramfold.state import innermost_transform as _transform
from paramfold.write_marks import rearm_compiled, standing_marks

_dynamo = torch._dynamo
_handler = getattr(_dynamo, "callback_handler", None)
_callback = getattr(_dynamo, "callback", None)
_DYNAMO = getattr(getattr(_callback, "CallbackTrigger", None), "DYNAMO", None)
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


class _Local(threading.local):
    #: The claims (holders lists, or plans with ``.claimed``) of the scopes open on this thread,
    #: innermost first: ``(claimed, (outer_claimed, (..., ())))``.
    claims: tuple = ()
    #: ``(module, name, value, stand_in)`` for every stand-in installed now on this thread, and
    #: the compile that installed them.
    swapped: list | tuple = ()
    compile_id: object = None
    #: Whether stand-ins outlived the compile that installed them (code may have run on them):
    #: the scope that closes next refuses its call.
    stranded: bool = False
    #: The write marks of the frozen values this thread's scopes serve that stood as the compile
    #: began (:func:`paramfold.write_marks.standing_marks`): set again as it ends, where it cleared them;
    #: and that compile.
    marks: list | tuple = ()
    marks_for: object = None
    #: The values this thread's compile marked static (:func:`_mark_static`), to unmark as it ends.
    static: list | tuple = ()


#: ``paramfold.scope.calls_lock``, set by that module (which imports this one): marks are set under it.
scope_lock: Callable[[], Any] | None = None


local = _Local()


def ensure_registered() -> None:
    """Register the compile callbacks (again: ``torch._dynamo.reset()`` clears them). A scope
    checks ``on_compile_start in START_CALLBACKS`` first, which costs no Python frame."""
    if _handler is None or _DYNAMO is None:
        return
    if on_compile_start not in _handler.start_callbacks:
        _handler.register_start_callback(on_compile_start)
    if _on_compile_end not in _handler.end_callbacks:
        _handler.register_end_callback(_on_compile_end)


def on_compile_start(args: object = None) -> None:
    """Dynamo's compile start callback: install the stand-ins of this thread's open scopes."""
    if getattr(args, "callback_trigger", None) is not _DYNAMO or _is_exporting():
        return
    if local.swapped:  # an earlier compile's, never put back
        _strand()
    claims = local.claims
    if not claims:
        return
    local.marks, local.marks_for = standing_marks(claimed_holders(claims)), getattr(args, "compile_id", None)
    if not torch.is_grad_enabled() and freezing_now():
        _end_hoisting_plans(claims)
    if _bakes_module_tensors() and _any_value_installed(claims):
        raise FoldError(
            "torch._dynamo.config.install_free_tensors (or prepare_freezing) makes dynamo copy a "
            "module's tensor attributes into the compiled graph, and the values paramfold puts in "
            "a prepared model's modules change from call to call: compiled code would keep the "
            "first. Turn the option off while compiling this model, or paramfold.restore(model)."
        )
    if _transform() is not None:
        # Inside a torch.func transform (grad(functional_call(compiled, ...))): the values are
        # its wrappers, and it refuses requires_grad_() on any tensor. Dynamo fakes the values
        # as they are (stock's compile of such a frame is skipped by dynamo itself).
        return
    local.compile_id = getattr(args, "compile_id", None)
    swapped = local.swapped = []
    stand_ins: dict[int, torch.Tensor] = {}
    static = local.static = list(local.static)
    for holder in claimed_holders(claims):
        _swap_in(holder, swapped, stand_ins)
        _mark_static(holder, static)


def _mark_static(holder: nn.Module, marked: list) -> None:
    """Mark each plain-tensor value (or parameter alias) ``holder`` holds now static, as
    ``torch._dynamo.mark_static`` does, where stock's dynamo keeps what it stands for static: a
    parameter or a module's buffer, under ``force_parameter_static_shapes``, whatever dim marks
    it carries (an alias of a parameter shares its marks). Its marks before are noted in
    ``marked``, to be put back by :func:`_unmark_static`."""
    if not torch._dynamo.config.force_parameter_static_shapes:
        return  # stock's parameters take sizes as any input: so do the values
    values = holder.__dict__
    state = values[STATE_ATTR]
    tensors = [values.get(name) for name in (*state.sites, *(n for n, _ in state.detached))]
    # inline's getters read a buffer original from its dict (inline.DictRef), where dynamo takes
    # it for a plain tensor, not a module's buffer
    tensors += [d.get(k) for site in state.sites.values() if site.original_refs for d, k in site.originals]
    for t in tensors:
        if type(t) is torch.Tensor:
            marks = t.__dict__
            marked.append((marks, {a: marks.pop(a) for a in _DIM_MARKS if a in marks}))
            marks["_dynamo_static_indices"] = set(range(t.dim()))


#: The attributes dynamo reads a tensor's dim marks from (``torch._dynamo.decorators``).
_DIM_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_unbacked_indices",
              "_dynamo_strict_unbacked_indices", "_dynamo_static_indices")


def _unmark_static() -> None:
    marked, local.static = local.static, ()
    for marks, before in reversed(marked):  # an alias's marks are its parameter's: noted once each
        for a in _DIM_MARKS:
            marks.pop(a, None)
        marks.update(before)


def _end_hoisting_plans(claims: tuple) -> None:
    """Under inductor's freezing this compile keys its code on each value's identity: a steady
    plan built while freezing was off, which computes hoist's values afresh at every call, gives
    way at the next call to the general path, which freezes them (site_values.freezing_now)."""
    while claims:
        claimed, claims = claims
        if getattr(claimed, "freezing", None) is False:
            claimed.until = CALLS[0]


def claimed_holders(claims: tuple) -> Iterator[nn.Module]:
    """The holders every scope in ``claims`` (see :class:`_Local`) claimed."""
    while claims:
        claimed, claims = claims
        yield from getattr(claimed, "claimed", claimed)


def _any_value_installed(claims: tuple) -> bool:
    for holder in claimed_holders(claims):
        values = holder.__dict__
        if any(isinstance(values.get(name), torch.Tensor) for name in values[STATE_ATTR].sites):
            return True
    return False


def _swap_in(holder: nn.Module, swapped: list, stand_ins: dict[int, torch.Tensor]) -> None:
    values = holder.__dict__
    for name in values[STATE_ATTR].sites:
        value = values.get(name)
        # Plain tensors only (a subclass's detach may not keep its metadata), and no views: a
        # view's base is part of what dynamo fakes for it.
        if type(value) is not torch.Tensor or value.grad_fn is None or value._base is not None:
            continue
        stand_in = stand_ins.get(id(value))
        if stand_in is None:
            stand_in = stand_ins[id(value)] = value.detach().requires_grad_()
        values[name] = stand_in
        swapped.append((holder, name, value, stand_in))


def _restore() -> None:
    swapped = local.swapped
    while swapped:
        holder, name, value, stand_in = swapped.pop()
        values = holder.__dict__
        if values.get(name) is stand_in:
            values[name] = value


#: Called as dynamo's compile ends, after the new code's guards were checked on the frame
#: (``paramfold.compile_reads`` drops its marks there).
END_HOOKS: list[Callable[[], None]] = []


def _on_compile_end(args: object = None) -> None:
    for hook in END_HOOKS:
        hook()
    if local.static:
        _unmark_static()
    if local.swapped:
        _restore_after(getattr(args, "compile_id", None))
    if local.marks:
        _rearm(getattr(args, "compile_id", None))


def _on_bytecode(code: object, new_code: object) -> None:
    if local.static:
        _unmark_static()
    if local.swapped:
        _restore_after(str(_current_compile_id()))
    if local.marks:
        _rearm(str(_current_compile_id()))


def _rearm(compile_id: object) -> None:
    """Set again the marks the compile that noted them cleared (:func:`paramfold.write_marks.rearm_compiled`).
    Marks another compile noted (whose end this thread did not see: its end callback ran in
    another thread) are dropped, not set: code ran since. Where another thread holds the scope
    lock (which may be waiting for this compile to end), they are left cleared: the next call
    hashes those values' bytes instead, exact either way."""
    marks, local.marks = local.marks, ()
    if local.marks_for is not None and compile_id != local.marks_for:
        return
    lock = scope_lock() if scope_lock is not None else None
    if lock is not None and lock.acquire(blocking=False):
        try:
            rearm_compiled(marks)
        finally:
            lock.release()


def _restore_after(compile_id: object) -> None:
    """Put the values back as a compile ends; stand-ins another compile installed outlived it
    (where dynamo names its compiles to callbacks)."""
    if local.compile_id is not None and compile_id != local.compile_id:
        _strand()
    else:
        _restore()


def _strand() -> None:
    _restore()
    local.stranded = True


def _current_compile_id() -> object:
    return torch._guards.CompileContext.current_compile_id()


def _bakes_module_tensors() -> bool:
    config = _dynamo.config
    return bool(getattr(config, "install_free_tensors", False) or getattr(config, "prepare_freezing", False))


#: The list dynamo keeps its start callbacks in (``reset()`` empties it in place); where this
#: torch has none, a list that always holds ours, so nothing is registered.
START_CALLBACKS: list = (
    _handler.start_callbacks if _handler is not None and _DYNAMO is not None else [on_compile_start]
)


def restore_stranded() -> bool:
    """As a scope closes with stand-ins still installed on this thread, or some that outlived
    their compile: put the values back, and whether the call may have run on stand-ins (see the
    module docstring)."""
    stranded = local.stranded or bool(local.swapped)
    _restore()
    if local.static:
        _unmark_static()
    local.stranded = False
    return stranded


def stranded_error() -> FoldError:
    return FoldError(
        "dynamo compiled code for this prepared model's call while another thread was compiling "
        "(a backward graph or a CUDA graph), and its compile callbacks did not run here: the call "
        "ran on stand-ins of its hoisted values that carry no gradient to the originals, so it "
        "was refused. Call it again (the code is compiled now), or compile on one thread."
    )


if hasattr(_dynamo, "convert_frame") and hasattr(_dynamo.convert_frame, "register_bytecode_hook"):
    # Kept for the process: torch._dynamo.reset() leaves bytecode hooks registered.
    _dynamo.convert_frame.register_bytecode_hook(_on_bytecode)

run_module_eagerly_as_frames(globals())
