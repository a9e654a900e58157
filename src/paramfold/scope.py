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

import dataclasses
import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paramfold.errors import FoldError
from paramfold.freeze import FrozenValue, can_freeze, frozen_value
from paramfold.hoist import hoisted_value
from paramfold.inline import REFS_PREFIX

STATE_ATTR = "_paramfold"
_MODULE_CALL = nn.Module.__call__
_tokens = itertools.count(1)


@dataclasses.dataclass(eq=False)
class ModuleState:
    """What paramfold keeps on a prepared module (in its instance ``__dict__``)."""

    original_class: type
    #: tensor name -> "hoist" | "inline" | "freeze" | "auto", for this module's own sites.
    modes: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Stateful-chain flags for this module's own sites (used to decide auto/freeze).
    stateful: dict[str, bool] = dataclasses.field(default_factory=dict)
    #: Chain length of each own site at prepare time (generated inline getters rely on it).
    chain_lengths: dict[str, int] = dataclasses.field(default_factory=dict)
    frozen: dict[str, FrozenValue] = dataclasses.field(default_factory=dict)
    #: Whether plain parameters of this module are detached under no_grad.
    detach_params: bool = False
    #: For entries: the modules with sites or detached parameters at or below this one.
    holders: list[nn.Module] = dataclasses.field(default_factory=list)
    #: For entries: every entry at or below this one (stamped when a scope opens here).
    entries: list[nn.Module] = dataclasses.field(default_factory=list)
    stamp: int = 0


class _Scope(threading.local):
    token: int = 0


_scope = _Scope()


def state_of(module: nn.Module) -> ModuleState | None:
    return module.__dict__.get(STATE_ATTR)


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
            if hs.modes:
                _check_unchanged(holder, hs)
            for name, mode in hs.modes.items():
                if mode == "inline":
                    continue
                values[name] = _value(holder, name, mode, hs)
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


def _check_unchanged(holder: nn.Module, hs: ModuleState) -> None:
    plists = holder._modules["parametrizations"]._modules
    if plists.keys() != hs.modes.keys() or any(
        len(plists[name]._modules) != length
        or (hs.modes[name] == "inline" and holder.__dict__[REFS_PREFIX + name][0] is not plists[name]._modules)
        for name, length in hs.chain_lengths.items()
    ):
        raise FoldError(
            f"parametrizations of a {type(holder).__name__} changed after paramfold.prepare "
            "(registered or removed): call paramfold.restore(model), change them, then prepare again."
        )


def _value(holder: nn.Module, name: str, mode: str, hs: ModuleState) -> torch.Tensor:
    if mode == "hoist":
        return hoisted_value(holder, name)
    frozen_ok = can_freeze(holder, name, hs.stateful[name])
    if mode == "freeze" and not frozen_ok:
        raise FoldError(
            f"{type(holder).__name__}.{name} was prepared with mode='freeze' but now an original "
            "requires grad or its stateful chain is in training mode; frozen values would not "
            "train. Call paramfold.restore(model) and prepare it with mode='auto' or 'hoist'."
        )
    if frozen_ok:
        return frozen_value(holder, name, hs.frozen)
    hs.frozen.pop(name, None)
    return hoisted_value(holder, name)


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


# Dynamo runs this frame eagerly when it is the first frame of torch.compile(model), and still
# compiles the frames it calls (nn.Module.__call__ and the model's forward).
torch._dynamo.eval_frame.skip_code(root_call.__code__)


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
