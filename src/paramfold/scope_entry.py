"""How each entry point's call reaches a call scope (:mod:`paramfold.scope`), and how a call
nested in an open scope is checked.

:mod:`paramfold.scope` opens and closes scopes: plans, installed values, claims across threads,
``os.fork()``, release and the checks made when a call ends. This module holds the other half: the
code a prepared entry runs on every call to get there (the root's ``__call__``, the
``_compiled_call_impl`` property every entry class carries), which decides whether a call opens a
scope, runs nested in one already open (this thread's, or an enclosing scope of another prepared
model's), or runs as the restored model's. It imports :mod:`paramfold.scope`, never the other way
round; it reads that module's lock and its ``_open``/``_close`` through the module, so that a
patch of them there (tests, ``examples/compiled_chain_bench.py``) is seen here too.

How each entry point reaches a scope:

* ``model(x)`` eagerly, or ``model.compile()``: the root's ``__call__`` opens it.
* ``torch.compile(model)``: dynamo's first frame is the root's ``__call__``, whose code is
  registered with ``skip_code``: dynamo runs that frame eagerly (opening the scope) and compiles
  the frames it calls.
* ``layer.compile()`` on any entry (torchtune style): ``nn.Module._wrapped_call_impl`` reads
  ``_compiled_call_impl`` eagerly; entries answer with a wrapper that opens the scope first.
* Anything dynamo inlines from a bigger compiled region sees no scope and computes values through
  the descriptor in-graph: correct, at stock-like compile cost.
* While torch.fx traces (``symbolic_trace``, ``make_fx``; its patch of ``nn.Module.__call__`` is
  process-wide, its flag too until torch 2.14 and the tracing thread's own from 2.15) no scope
  opens: every read computes its value like stock, so the trace records stock's graph, not the
  values.

Calls nested in a scope: a forward may swap or change originals before it calls a submodule
(``torch.func.functional_call(self.inner, params, x)``, MoCo's momentum update). Every eager call
of an entry reads its ``_compiled_call_impl`` (:func:`_get_compiled_call_impl`), which checks in
one C-level pass what :mod:`paramfold.scope_nested` recorded, and runs the call with changed
values computed afresh. Nested calls inside compiled code are traced, not called: hoisted and
frozen values are not re-checked there (a documented limit; inline reads originals where it
reads them).
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from operator import getitem, is_
from typing import Any

import torch
import torch.fx._symbolic_trace as _fx
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle as _Handle

from paramfold import compiled_entry_regions as entry_regions
from paramfold import hooknorm_regions as hook_regions
from paramfold import scope as _scope
from paramfold import scope_nested as nested
from paramfold.compute import any_autocast as _any_autocast
from paramfold.compute import GLOBAL_HOOKS, compiling, compiling_here
from paramfold.compute import dispatch_modes as _dispatch_modes
from paramfold.compute import function_modes as _function_modes
from paramfold.errors import FoldError
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.scope import _STOP_RECOMPUTATION, _concurrent, _hooks_since, _local, _saved_tensors_hooks
from paramfold.state import STATE_ATTR
from paramfold.state import innermost_transform as _transform
from paramfold.state import tensor_data_ptr as _data_ptr
from paramfold.watch import tag

_Module = nn.Module
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
# Whether dynamo is about to compile the frames this one calls (torch.compile(model)); a torch
# without it counts as "maybe": nested calls then see swaps only.
_eval_frame_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", lambda: True)


def _fx_tracing_reader(fx: types.ModuleType) -> Callable[[], bool]:
    """A reader of torch.fx's "tracing now" flag that runs no Python frame (calls count them):
    the module global ``_is_fx_tracing_flag`` until torch 2.14, the attribute ``flag`` of the
    thread-local ``_is_fx_tracing_tls`` from torch 2.15, which removed the global."""
    tls = getattr(fx, "_is_fx_tracing_tls", None)
    if tls is None:
        return functools.partial(getattr, fx, "_is_fx_tracing_flag")
    return functools.partial(getattr, tls, "flag", False)


_fx_tracing = _fx_tracing_reader(_fx)


def _nested(module: nn.Module, call: Callable) -> Callable:
    """``call`` for a call of ``module`` inside an open scope: itself unless inputs below it
    changed since the scope opened (:mod:`paramfold.scope_nested`; the entry that opened the
    scope skips the check once)."""
    if _local.opened is module:
        _local.opened = None
        if parametrize._cache_enabled:
            nested.commit(module)
        return call
    if nested.unchanged(nested.check_of(module)):
        # (inside parametrize.cached(), unless the block holds a value the module does not)
        if not (parametrize._cache_enabled and nested.commit(module)):
            return call
    with _scope._LOCK:
        nested.undetach(module)
    found = nested.changed(module)
    if not found and nested.same_context(nested.local.context):
        return call
    # Also where only the grad mode or autocast state changed and no value needs computing
    # again: the calls nested in this one then compare with the state they run under.
    return functools.partial(nested.call_changed, module, found, _scope._LOCK, _concurrent, call)


_set_eval_frame = getattr(torch._C._dynamo.eval_frame, "set_eval_frame", None)
_EVAL_FRAME_FILE = torch._dynamo.eval_frame.__file__


def _outside_dynamo(fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` with dynamo's callback off, as ``torch.compiler.disable`` runs it (the
    scope's work, chains' forwards among it, must never be compiled), through two C calls
    instead of its wrapper's dozen Python ones (about 1.5 us a call). Needed only where the
    callback is set: ``torch.compile(model)``, whose first frame is the root's call."""
    if _set_eval_frame is None:  # a torch without it
        return torch.compiler.disable(fn)(*args)
    prior = _set_eval_frame(None)
    try:
        return fn(*args)
    finally:
        _set_eval_frame(prior)


def _in_scope(module: nn.Module) -> bool:
    return id(module) in _local.covered


def _enclosing(module: nn.Module) -> tuple | None:
    """The innermost scope this thread has open around the current one that covers ``module``, or None."""
    scope = _local.enclosing
    while scope is not None and id(module) not in scope[0]:
        scope = scope[3]
    return scope


def _reentered(scope: tuple, call: Callable, *args: Any, **kwargs: Any) -> Any:
    """``call`` of an entry of ``scope``, an enclosing scope of this thread (:func:`_enclosing`):
    model A's forward calls model B, whose forward calls A again. A's values are installed, its
    holders claimed by A's call: the call runs nested in A's scope, as a re-entrant call of A
    inside its own forward does (its nested check compares with what A's values were computed
    from and under), with B's scope enclosing it in turn."""
    current = (_local.covered, nested.local.context, nested.local.snapshot, _local.enclosing, _local.hooks_from)
    _local.covered, nested.local.context, nested.local.snapshot = scope[:3]
    _local.hooks_from = scope[4]
    _local.enclosing = current
    try:
        return call(*args, **kwargs)
    finally:
        _local.covered, nested.local.context, nested.local.snapshot, _local.enclosing, _local.hooks_from = current


def root_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``__call__`` of a prepared root: opens a scope, then the model class's ``__call__`` (the
    ``nn.Module.__call__`` of now, a profiler's or torch.fx's patch included, as stock calls
    it; or the model's own). Bound before its class was switched since (``torch.compile(model)``
    holds ``model.__call__``): the call of its class now, as stock's wrapper calls it (a restored
    root, one whose last parametrization torch removed, unwrapping paramfold's class)."""
    state = self.__dict__.get(STATE_ATTR)
    if state is None or not isinstance(self, state.prepared_class):  # (a subclass's __call__ may call this one)
        return _as_restored(self, *args, **kwargs)
    module_call = getattr(type(self), "_paramfold_call", None) or _Module.__call__
    # (compiling() and _in_scope() written out: no Python frame of paramfold's per call.)
    if (_is_compiling() and compiling_here()) or id(self) in _local.covered or _fx_tracing():
        # torch.fx traces (symbolic_trace, make_fx; until torch 2.14 in any thread: its flag was
        # process-wide): no scope, so every read computes its value like stock's and the trace
        # records stock's graph (a leaf call_module where stock has one), not the values.
        return module_call(self, *args, **kwargs)
    if (type(self).__call__ is not root_call and "_paramfold_forward" in vars(state.prepared_class)
            and sys._getframe(1).f_code.co_filename == _EVAL_FRAME_FILE):
        # Bound before the root was given a subclass with a __call__ of its own, by a
        # torch.compile(model) wrapper (dynamo's frame calls it): stock's wrapper of a root whose
        # forward is torch's calls the module (torch's wrap_inline), so its class's __call__ now.
        return _as_restored(self, *args, **kwargs)
    if _local.enclosing is not None and (scope := _enclosing(self)) is not None:
        return _reentered(scope, module_call, self, *args, **kwargs)
    # Dynamo's callback set (torch.compile(model): this frame is its first, run eagerly): the
    # scope's work must not be compiled, so it runs with the callback off (_outside_dynamo).
    dynamo = _eval_frame_callback() is not None
    opened = _outside_dynamo(_scope._open, self) if dynamo else _scope._open(self)
    if opened is None:
        return _as_restored(self, *args, **kwargs)
    if not opened:
        try:
            return module_call(self, *args, **kwargs)
        finally:
            opened.end()
    previous, claimed = opened
    snapshot = nested.local.snapshot
    # Run eagerly (no dynamo callback, no compiled call): its nested calls will check what
    # changed in place against the tensors as they are now.
    eager = not dynamo and self.__dict__.get("_compiled_call_impl") is None
    nested.local.snapshot = nested.snapshot(self) if eager else None
    call = (_call_eagerly if not eager and ((parametrize._cache_enabled and _through_cache(self)) or _transform() is not None)
            else module_call)  # _opens_eagerly, written out
    if (dynamo and call is module_call and (self._forward_pre_hooks or self._forward_hooks or any(GLOBAL_HOOKS))
            and "_paramfold_forward" in vars(state.prepared_class) and not _breaks_whole_call(self)):
        # torch.compile(model) of the stock model of a root whose forward is torch's compiles its
        # whole call, hooks included, as one frame (torch's wrap_inline); any other root's hooks
        # run outside dynamo, each compiled as a frame of its own, in stock as here.
        call = functools.partial(_hooked_root_call, module_call)
    stopped = False
    try:
        return call(self, *args, **kwargs)
    except _STOP_RECOMPUTATION:
        stopped = True
        raise
    finally:
        nested.local.snapshot = snapshot
        if dynamo:
            _outside_dynamo(_scope._close, previous, claimed, stopped)
        else:
            _scope._close(previous, claimed, stopped)


def _as_restored(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The call of a root restored (or its class unwrapped) since its call reached
    :func:`root_call` (in another thread, or since something bound this method:
    ``torch.compile(model)`` made while it was prepared holds ``model.__call__``): its class's
    own, as stock's. Its class is read under the lock, after a restore under way in another
    thread has put it back."""
    with _scope._LOCK:
        call = type(self).__call__
    if call is root_call:
        raise FoldError(
            f"{type(self).__name__} is a class paramfold made for a prepared model, on a module that is not "
            "prepared with it (its class set back after paramfold.restore, or given to another module): "
            "set the module's class to the one it had before paramfold.prepare, or prepare it"
        )
    handing = _local.handing
    outer = handing.get(id(self))
    if outer is not None and not _called_since(self, outer):
        # Back here from that call before any call of the module's forward: its class's
        # __call__ calls paramfold's, captured before the class was replaced
        # (``orig = type(m).__call__``), where stock's was nn.Module's.
        return _Module.__call__(self, *args, **kwargs)
    _local.handing = {**handing, id(self): sys._getframe()}
    try:
        if _eval_frame_callback() is not None:
            return _restored_call(call, self, *args, **kwargs)
        return call(self, *args, **kwargs)
    finally:
        _local.handing = handing


_CALL_FRAMES = frozenset({_Module._call_impl.__code__, _Module._wrapped_call_impl.__code__})


def _called_since(module: nn.Module, outer: types.FrameType) -> bool:
    """Whether, between :func:`_as_restored`'s frame ``outer`` and this call, ``module`` was
    called (``nn.Module``'s call) or its forward runs: a forward that calls the root again
    through a method bound while it was prepared, a recursion stock runs through the class's
    ``__call__`` at every level."""
    forward = getattr(getattr(type(module), "forward", None), "__code__", None)
    frame = sys._getframe(2)
    while frame is not None and frame is not outer:
        if (frame.f_code in _CALL_FRAMES or frame.f_code is forward) and frame.f_locals.get("self") is module:
            return True
        frame = frame.f_back
    return False


def _breaks_whole_call(module: nn.Module) -> bool:
    """Whether a compiled frame of the root's whole call would break, in stock too: on backward
    hooks, FSDP2's hooks (``fully_shard``: its all-gather and reshard), or in the forward of an
    ``nn.RNN``/``LSTM``/``GRU`` (which dynamo does not trace unless ``allow_rnn``). The forward is
    then compiled alone, as before: after a break in that frame dynamo would try the forward's
    frame of paramfold's again (a second break, where stock's forward, a file of torch, is skipped)."""
    if module._backward_hooks or module._backward_pre_hooks or GLOBAL_HOOKS[2] or GLOBAL_HOOKS[3]:
        return True
    if isinstance(module, nn.RNNBase) and not torch._dynamo.config.allow_rnn:
        return True
    fsdp = _fsdp_module_class()
    return fsdp is not None and isinstance(module, fsdp)


@functools.cache
def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # a torch built without distributed
        return None
    return FSDPModule


def _hooked_root_call(call: Callable, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # A frame dynamo compiles (kept out of run_module_eagerly_as_frames), as torch's wrap_inline
    # frame of the stock model's torch.compile(model): the root's hooks and forward are traced into
    # one graph, with the scope the eager root call opened around it.
    return call(module, *args, **kwargs)


def _restored_call(call: Callable, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # A frame dynamo compiles (kept out of run_module_eagerly_as_frames): a torch.compile(model)
    # made while prepared bound the root's call, not torch's wrapper of a module whose forward is
    # torch's (wrap_inline), every frame of whose call dynamo skips; its restored calls compile
    # here, as stock's wrapper compiles them.
    return call(module, *args, **kwargs)


def _scoped_compiled_call(module: nn.Module, compiled: Callable, *args: Any, **kwargs: Any) -> Any:
    if compiling():
        return compiled(*args, **kwargs)
    if _in_scope(module):
        state = module.__dict__[STATE_ATTR]
        if _local.opened is not module and (_Handle.next_id != state.hooks_checked
                                            or _local.hooks_from != state.hooks_checked_from):
            _hooks_since(module, state)
        if _through_cache(module):
            compiled = functools.partial(_call_eagerly, module)
        if _saved_tensors_hooks(True) is not None and not parametrize._cache_enabled:  # a checkpoint region?
            compiled = entry_regions.noting(module, state, compiled)
        return _nested(module, compiled)(*args, **kwargs)
    if _local.enclosing is not None and (scope := _enclosing(module)) is not None:
        return _reentered(scope, _scoped_compiled_call, module, compiled, *args, **kwargs)
    dynamo = _eval_frame_callback() is not None
    # A checkpointed region's recomputation of a call its forward served from the scope around it?
    replay = _local.replay = entry_regions.replay(module) if _saved_tensors_hooks(True) is not None else None
    # (A replay sets which sites are computed where read for itself only.)
    flags = entry_regions.at_read_flags(module.__dict__[STATE_ATTR]) if replay is not None else None
    try:
        opened = _outside_dynamo(_scope._open, module) if dynamo else _scope._open(module)
    finally:
        _local.replay = None
    if opened is None:  # restored meanwhile: the call stock's _wrapped_call_impl makes
        return compiled(*args, **kwargs)
    if not opened:  # no scope now (compile_reads.Bare)
        try:
            return compiled(*args, **kwargs)
        finally:
            opened.end()
    previous, claimed = opened
    stopped = False
    try:
        if _opens_eagerly(module):
            return _call_eagerly(module, *args, **kwargs)
        return compiled(*args, **kwargs)
    except _STOP_RECOMPUTATION:
        stopped = True
        raise
    finally:
        if dynamo:
            _outside_dynamo(_scope._close, previous, claimed, stopped)
        else:
            _scope._close(previous, claimed, stopped)
        if flags is not None:
            with _scope._LOCK:
                entry_regions.put_flags_back(flags)


def _opens_eagerly(entry: nn.Module) -> bool:
    """Whether a compiled call of ``entry`` that opens a scope must run eagerly instead: inside
    ``parametrize.cached()`` (:func:`_through_cache`), or inside a torch.func transform, where the
    hoisted values are the transform's wrappers with a history, which dynamo's fake-tensor
    conversion cannot take (torch's bug; dynamo skips stock's frame there, "Unsupported functorch
    tracing attempt")."""
    return _through_cache(entry) or _transform() is not None


def _through_cache(entry: nn.Module) -> bool:
    """Whether ``entry``'s call, inside ``parametrize.cached()``, must run eagerly (see
    :data:`_call_eagerly`): some site below it has no value in its module's ``__dict__`` in the
    open scope (inline, or computed in-graph for another reason), so compiled code would compute it."""
    if not parametrize._cache_enabled:
        return False
    for holder in entry.__dict__[STATE_ATTR].holders:
        values = holder.__dict__
        if any(name not in values for name in values[STATE_ATTR].sites):
            return True
    return False


#: A call with no compiled code at all, its callees included: inside ``parametrize.cached()``,
#: stock's compiled code reads the value cached by an earlier call of the block, as stock's eager
#: property does, where a value computed in paramfold's graph would be computed afresh; so a
#: prepared model with such values runs the block's calls eagerly, reading through the cache.
_call_eagerly = torch.compiler.disable(nn.Module._call_impl)


def _answered(module: nn.Module, answer: Callable) -> Callable:
    """``answer``, kept for the second read of ``_compiled_call_impl`` that
    ``nn.Module._wrapped_call_impl`` makes (``if self._compiled_call_impl is not None: return
    self._compiled_call_impl(...)``): computed again there, it could be None where another
    thread changed what it depends on in between (a claim count, a write that changes the
    nested check), and the call would fail on calling None."""
    try:
        caller = sys._getframe(2)  # (1: the property's getter)
    except ValueError:  # read by no Python frame (a thread whose target is a C function)
        return answer
    if caller.f_code is _WRAPPED_CALL:
        _local.answered = (caller, module, answer)
    return answer


_WRAPPED_CALL = nn.Module._wrapped_call_impl.__code__


def _get_compiled_call_impl(self: nn.Module) -> Callable | None:
    # nn.Module._wrapped_call_impl reads this at every eager call of an entry: where the call is
    # nested in a scope and tensors below were swapped or changed since it opened, it answers
    # with a call that computes their values afresh (paramfold.scope_nested).
    local = _local
    answered = local.answered
    if answered is not None:  # the second read of a _wrapped_call_impl: the first one's answer
        local.answered = None
        if answered[1] is self and sys._getframe(0).f_back is answered[0]:  # (f_back: None for a frame-less read)
            return answered[2]
    compiled = self.__dict__.get("_compiled_call_impl")
    if compiled is not None:
        if compiling() or _fx_tracing():  # (torch.fx: as in root_call)
            return compiled
        return _answered(self, functools.partial(_scoped_compiled_call, self, compiled))
    traced_hooked = (self._forward_pre_hooks or self._forward_hooks or self._backward_hooks
                     or self._backward_pre_hooks or any(GLOBAL_HOOKS)) and torch.compiler.is_compiling()
    if traced_hooked:
        # Traced: dynamo inlines the call of a module with hooks through _wrapped_call_impl;
        # stock's attribute is None, and so is this one's, but for a hook-based norm's layer
        # while a checkpointed region that noted a call lives (below: its recomputation may
        # replay it). Asked before the open scope and the module's identity, which dynamo would
        # guard on: same-architecture blocks compiled on their own compile once, as stock's do,
        # and a region's recomputation (a scope of the block's own) reuses the forward's code.
        # (Below, a call claiming another thread's values, or nested in a scope, comes to the
        # same under tracing.)
        state = self.__dict__.get(STATE_ATTR)
        if state is None or not (state.hook_sites and hook_regions.live):
            return None
    covered = local.covered
    # (Empty first: traced inside a function compiled around the model, where no scope is open,
    # dynamo then guards on no module's identity, so copies of one model share its graphs.)
    if not covered or id(self) not in covered:
        state = self.__dict__.get(STATE_ATTR)
        if state is None:  # being restored in another thread: called as restored, once it is
            with _scope._LOCK:
                return None
        if state.users:
            # Values another thread's scope installed are in this module's __dict__: this call
            # claims them as its own entry would (shares them, or is refused), rather than
            # reading them as they are (without their autograd history, or another autocast's).
            return _answered(self, functools.partial(_scoped_compiled_call, self, self._call_impl))
        # A checkpoint's recomputation? (Traced, asked only while a region that noted a call lives.)
        if (state.hook_sites and (hook_regions.live or not torch.compiler.is_dynamo_compiling())
                and _saved_tensors_hooks(True) is not None):
            replayed = hook_regions.replay(self, state)
            if replayed is not None:
                return _answered(self, replayed)
        return None
    if local.opened is self:
        local.opened = None
        return None
    if traced_hooked:
        # Traced (a hook-based norm's layer while a region lives, above): reading on would put
        # guards on this scope's bookkeeping (its nested check, a process-wide count of changed
        # inputs), each change a recompile.
        return None
    state = self.__dict__[STATE_ATTR]
    # A hook registered somewhere since this module's last check, or a check made for another call.
    if _Handle.next_id != state.hooks_checked or local.hooks_from != state.hooks_checked_from:
        _hooks_since(self, state)
    # scope_nested.unchanged, written out: no Python frame per nested call while nothing changed.
    context = nested.local.context
    check = state.nested_check
    unchanged = False
    if (check is not None and check[0] == nested.Installs.count and not check[6] and not parametrize._cache_enabled
            and context[0] is _grad_enabled() and context[1] is None and not _any_autocast()
            and context[2] is None and not _function_modes() and not _dispatch_modes()):
        try:
            if all(map(is_, map(getitem, check[1], check[2]), check[3])) and list(map(len, check[4])) == check[5]:
                snap, plain, ids = nested.local.snapshot, check[7], check[8]
                unchanged = snap is None or (
                    list(map(snap[0].__getitem__, check[11])) == list(map(getattr, check[9], check[10]))
                    and list(map(snap[1].__getitem__, ids)) == list(map(_data_ptr, plain))
                    and (not check[12] or list(map(snap[2].__getitem__, check[13])) == list(map(tag, check[12]))))
        except (LookupError, RuntimeError):
            pass
    answer = None
    if not unchanged:
        call = self._call_impl
        wrapped = _nested(self, call)
        answer = None if wrapped is call else _answered(self, wrapped)
    if state.hooks_out and _saved_tensors_hooks(True) is not None:  # inside a checkpoint region?
        hook_regions.note(self, state, served=answer is None)
    return answer


def _set_compiled_call_impl(self: nn.Module, value: Callable | None) -> None:
    self.__dict__["_compiled_call_impl"] = value


#: Installed on every entry class: ``layer.compile()`` stores the compiled callable through the
#: setter (same ``__dict__`` slot as stock), and ``nn.Module.__call__`` reads it through the getter.
compiled_call_impl = property(_get_compiled_call_impl, _set_compiled_call_impl)

# When one of these runs as a frame of its own under an active torch.compile (the root's
# __call__ as the first frame of torch.compile(model), the others called from it), dynamo runs it
# eagerly instead of trying to compile it, and still compiles the frames it calls (the model's
# forward).
run_module_eagerly_as_frames(globals(), keep=(_restored_call, _hooked_root_call))
