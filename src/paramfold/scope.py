"""Call scopes: where hoisted and frozen values are computed, outside any compiled code.

A prepared model has *entry* modules: the root passed to :func:`paramfold.prepare` and every
module above a prepared site. Calling an entry eagerly opens a scope: each hoist or freeze site
below it gets its value written into its module's instance ``__dict__`` (where it shadows the
class-level :class:`~paramfold.inline.SiteDescriptor`), then the call runs, then the values are
removed again. Compiled code inside the scope therefore reads plain tensors, exactly like an
unparametrized model; outside a scope every read falls back to the descriptor, which computes
the value like stock PyTorch, so a value is never stale whatever way a module is called.

How each entry point reaches a scope:

* ``model(x)`` eagerly, or ``model.compile()``: the root's ``__call__`` opens it.
* ``torch.compile(model)``: dynamo's first frame is the root's ``__call__``, whose code is
  registered with ``skip_code``: dynamo runs that frame eagerly (opening the scope) and compiles
  the frames it calls.
* ``layer.compile()`` on any entry (torchtune style): ``nn.Module._wrapped_call_impl`` reads
  ``_compiled_call_impl`` eagerly; entries answer with a wrapper that opens the scope first.
* Anything dynamo inlines from a bigger compiled region sees no scope and computes values through
  the descriptor in-graph: correct, at stock-like compile cost.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paramfold.errors import FoldError
from paramfold.freeze import can_freeze, chain_needs_grad, frozen_value
from paramfold.hoist import hoisted_value
from paramfold.inline import sync_refs
from paramfold.runtime import STATE_ATTR, SiteState, distributed

_MODULE_CALL = nn.Module.__call__
_tokens = itertools.count(1)


class _Scope(threading.local):
    token: int = 0


_scope = _Scope()


def _open(entry: nn.Module) -> tuple[int, list[tuple[dict, str]]]:
    state = entry.__dict__[STATE_ATTR]
    previous, token = _scope.token, next(_tokens)
    for module in state.entries:
        module.__dict__[STATE_ATTR].stamp = token
    installed: list[tuple[dict, str]] = []
    try:
        grad = torch.is_grad_enabled()
        for holder in state.holders:
            hs = holder.__dict__[STATE_ATTR]
            values = holder.__dict__
            if hs.sites:
                _check_unchanged(holder, hs.sites)
            for name, site in hs.sites.items():
                if site.mode == "inline":
                    _refuse_distributed_inline(holder, name, site)
                    sync_refs(holder, site)
                    continue
                value = _value(holder, name, site)
                if value is not None:
                    values[name] = value
                    installed.append((values, name))
            if hs.detach_params and not grad:
                for name, param in holder._parameters.items():
                    if param is not None:
                        values[name] = param.detach()
                        installed.append((values, name))
    except BaseException:
        _close(previous, installed)
        raise
    _scope.token = token
    return previous, installed


def _check_unchanged(holder: nn.Module, sites: dict[str, SiteState]) -> None:
    plists = holder._modules["parametrizations"]._modules
    if plists.keys() != sites.keys() or any(
        plists[name] is not site.plist
        or len(site.plist._modules) != len(site.chain)
        or any(a is not b for a, b in zip(site.chain, site.plist._modules.values()))
        for name, site in sites.items()
    ):
        raise FoldError(
            f"parametrizations of a {type(holder).__name__} changed after paramfold.prepare "
            "(registered, removed or replaced): call paramfold.restore(model), change them, then "
            "prepare again."
        )


def _refuse_distributed_inline(holder: nn.Module, name: str, site: SiteState) -> None:
    if distributed(site):
        raise FoldError(
            f"{type(holder).__name__}.{name} was prepared with mode='inline' but its originals are now "
            "DTensors (sharded by fully_shard, or a communication parametrization): inline reads the "
            "originals stored at the call's start, before FSDP gathers them. Call "
            "paramfold.restore(model) and prepare it with mode='auto' or 'hoist'."
        )


def _value(holder: nn.Module, name: str, site: SiteState) -> torch.Tensor | None:
    if distributed(site):
        # Computed where it is read (the descriptor, in-graph), after FSDP2's pre-forward hook
        # has gathered the originals, exactly like stock: never gathered early, never frozen.
        site.frozen = None
        return None
    if site.mode == "hoist":
        return _hoisted(holder, name, site)
    frozen_ok = can_freeze(site)
    if site.mode == "freeze" and not frozen_ok:
        raise FoldError(
            f"{type(holder).__name__}.{name} was prepared with mode='freeze' but now a parameter "
            "of its chain requires grad or its stateful chain is in training mode; frozen values would not "
            "train. Call paramfold.restore(model) and prepare it with mode='auto' or 'hoist'."
        )
    if frozen_ok:
        return frozen_value(holder, name, site)
    site.frozen = None
    return _hoisted(holder, name, site)


def _hoisted(holder: nn.Module, name: str, site: SiteState) -> torch.Tensor | None:
    needs_grad = torch.is_grad_enabled() and chain_needs_grad(site)
    if site.subclass and needs_grad:
        return None
    value = hoisted_value(holder, name)
    if site.subclass is None:
        site.subclass = type(value) not in (torch.Tensor, nn.Parameter)
        if site.subclass and needs_grad:
            return None
    return value


def _close(previous: int, installed: list[tuple[dict, str]]) -> None:
    for values, name in installed:
        values.pop(name, None)
    _scope.token = previous


# Both run eagerly even when dynamo is active around them: the scope's work must never be traced.
_open_scope = torch.compiler.disable(_open)
_close_scope = torch.compiler.disable(_close)


def _in_scope(module: nn.Module) -> bool:
    return _scope.token != 0 and module.__dict__[STATE_ATTR].stamp == _scope.token


def root_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``__call__`` of a prepared root: opens a scope, then the ordinary ``nn.Module.__call__``."""
    if torch.compiler.is_compiling() or _in_scope(self):
        return _MODULE_CALL(self, *args, **kwargs)
    previous, installed = _open_scope(self)
    try:
        return _MODULE_CALL(self, *args, **kwargs)
    finally:
        _close_scope(previous, installed)




def _scoped_compiled_call(module: nn.Module, compiled: Callable, *args: Any, **kwargs: Any) -> Any:
    if torch.compiler.is_compiling() or _in_scope(module):
        return compiled(*args, **kwargs)
    previous, installed = _open_scope(module)
    try:
        return compiled(*args, **kwargs)
    finally:
        _close_scope(previous, installed)


def _get_compiled_call_impl(self: nn.Module) -> Callable | None:
    compiled = self.__dict__.get("_compiled_call_impl")
    if compiled is None:
        return None
    return functools.partial(_scoped_compiled_call, self, compiled)


def _set_compiled_call_impl(self: nn.Module, value: Callable | None) -> None:
    self.__dict__["_compiled_call_impl"] = value


#: Installed on every entry class: ``layer.compile()`` stores the compiled callable through the
#: setter (same ``__dict__`` slot as stock), and ``nn.Module.__call__`` reads it through the getter.
compiled_call_impl = property(_get_compiled_call_impl, _set_compiled_call_impl)

# When one of these runs as a frame of its own under an active torch.compile (the root's
# __call__ as the first frame of torch.compile(model), the others called from it), dynamo runs it
# eagerly instead of trying to compile it, and still compiles the frames it calls (the model's
# forward). Inlined into traced code they are traced as usual.
for _fn in (root_call, _in_scope, _scoped_compiled_call, _get_compiled_call_impl, _set_compiled_call_impl):
    torch._dynamo.eval_frame.skip_code(_fn.__code__)
del _fn
