"""What a prepared model must leave as stock leaves it, besides the values the checker compares:
the process-wide settings (:func:`settings_now`, :func:`set_settings`, :func:`compare_settings`),
torch's global module hooks (:func:`global_hook_keys`, :func:`compare_global_hooks`), the memory
and order of its parameters and buffers (:func:`memory_of`, :func:`compare_memory`, bar what stock's own calls
change, :class:`StockChanges`),
copy-on-write storage after ``restore`` (:func:`compare_copy_on_write`) and the parametrized modules
``filter_fn`` leaves out of ``prepare`` (:func:`excluded_modules`, :func:`compare_excluded`).

Why a module of its own: the checker (:mod:`~paramfold.testing.check`) holds each step's results
to stock's, tensor by tensor; these checks look elsewhere, at what a caller relies on that no
output shows (a setting that changes every later computation in the process, a hook that runs
for every model, memory an optimizer or FSDP's flat buffer aliases, a module left stock by
``filter_fn``). Each is a snapshot taken before ``prepare``, a run or ``restore`` and a comparison
after it, bar what stock's own run changed too; the checker only calls them. (What stock's own
calls change in a structure snapshot is :func:`paramfold.testing.structure.with_changes_by_stock`,
beside the snapshot's layout.) Its names are the checker's internals (imported by
:mod:`~paramfold.testing.check`), not part of :mod:`paramfold.testing`'s API.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from paramfold import hooknorms
from paramfold.sites import parametrization_paths
from paramfold.state import STATE_ATTR
from paramfold.testing.structure import IGNORED_KEYS, Structure, changed_by_stock, storage_key, structure, with_changes_by_stock
from paramfold.testing.walks import hook_norms, parametrized

__all__ = [
    "compare_copy_on_write",
    "compare_excluded",
    "compare_global_hooks",
    "compare_memory",
    "compare_settings",
    "excluded_modules",
    "global_hook_keys",
    "memory_of",
    "set_settings",
    "settings_now",
    "StockChanges",
]


# --------------------------------------------------------------------------------------------
# Process-wide settings
# --------------------------------------------------------------------------------------------


def _autocast(device: str) -> Callable[[], bool]:
    return lambda: torch.is_autocast_enabled(device)


def _stance() -> tuple[Any, ...]:
    """``torch.compiler.set_stance``'s current ``(stance, skip_guard_eval_unsafe, force_backend)``
    (torch's default where dynamo is not imported: nothing can have set one)."""
    current = getattr(sys.modules.get("torch._dynamo.eval_frame"), "_stance", None)
    if current is None:
        return ("default", False, None)
    return (current.stance, current.skip_guard_eval_unsafe, current.backend)


def _set_stance(value: tuple[Any, ...]) -> None:
    stance, skip_guard_eval_unsafe, force_backend = value
    torch.compiler.set_stance(stance, skip_guard_eval_unsafe=skip_guard_eval_unsafe, force_backend=force_backend)


def _default_device() -> torch.device | None:
    """The device ``torch.set_default_device`` set (None where none is: ``"cpu"`` set is a mode
    on the stack, which ``torch.get_default_device()`` does not tell from none)."""
    context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    return None if context is None else context.device


class _Modes(tuple):
    """A mode stack, bottom first, compared by its mode objects and shown by their classes."""

    def __repr__(self) -> str:
        return "[" + ", ".join(f"{type(m).__module__}.{type(m).__qualname__}" for m in self) + "]"


def _function_modes() -> _Modes:
    return _Modes(torch.overrides._get_current_function_mode_stack())


def _set_function_modes(modes: _Modes) -> None:
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    for mode in modes:
        torch._C._push_on_torch_function_stack(mode)


def _dispatch_modes() -> _Modes:
    return _Modes(torch.utils._python_dispatch._get_current_dispatch_mode_stack())


def _set_dispatch_modes(modes: _Modes) -> None:
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    while torch._C._len_torch_dispatch_stack():
        _pop_mode()
    for mode in modes:
        _push_mode(mode)


#: Process-wide settings a forward (or prepare/restore) could leave changed, each with its getter
#: and, where torch has one, its setter (the check sets each run's start back before each run of
#: a step, and everything back when it ends, pass or fail).
_SETTINGS: tuple[tuple[str, Callable[[], Any], Callable[[Any], Any] | None], ...] = (
    ("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
    ("torch.is_grad_enabled()", torch.is_grad_enabled, torch.set_grad_enabled),
    ("torch.is_inference_mode_enabled()", torch.is_inference_mode_enabled, None),
    ("torch.are_deterministic_algorithms_enabled()", torch.are_deterministic_algorithms_enabled, None),
    ("torch.is_deterministic_algorithms_warn_only_enabled()",
     torch.is_deterministic_algorithms_warn_only_enabled, None),
    ("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision,
     torch.set_float32_matmul_precision),
    ("torch.is_anomaly_enabled()", torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    ("torch.is_autocast_enabled('cpu')", _autocast("cpu"), None),
    ("torch.is_autocast_enabled('cuda')", _autocast("cuda"), None),
    ("the device torch.set_default_device() set (None: none)", _default_device, torch.set_default_device),
    ("torch.compiler.set_stance()'s (stance, skip_guard_eval_unsafe, force_backend)", _stance, _set_stance),
    ("the TorchFunctionMode stack (torch.overrides._get_current_function_mode_stack())", _function_modes,
     _set_function_modes),
    ("the TorchDispatchMode stack (torch.utils._python_dispatch._get_current_dispatch_mode_stack())",
     _dispatch_modes, _set_dispatch_modes),
    ("sys.getprofile()", sys.getprofile, sys.setprofile),
    ("sys.gettrace()", sys.gettrace, sys.settrace),
)

#: Set back first: the mode stacks, exactly as they were (torch.set_default_device then exits the
#: mode a forward's call left and enters the one it sets, keeping those on the stack).
_SET_FIRST = ("the TorchFunctionMode stack", "the TorchDispatchMode stack")


def settings_now() -> dict[str, Any]:
    """The process-wide settings of :data:`_SETTINGS` now (one a getter cannot read is left out)."""
    values = {}
    for name, get, _ in _SETTINGS:
        try:
            values[name] = get()
        except Exception:  # noqa: BLE001 - a getter this torch lacks or refuses: not compared
            pass
    return values


def set_settings(values: Mapping[str, Any]) -> None:
    """Set back what :func:`settings_now` read, where it changed (the mode stacks first,
    deterministic algorithms by their own setter, both flags at once)."""
    order = sorted(_SETTINGS, key=lambda setting: not setting[0].startswith(_SET_FIRST))
    for name, get, set_ in order:
        if set_ is not None and name in values:
            try:
                now = get()
            except Exception:  # noqa: BLE001 - as settings_now: not read, not set
                continue
            if now != values[name]:
                set_(values[name])
    now = settings_now()
    flags = ("torch.are_deterministic_algorithms_enabled()", "torch.is_deterministic_algorithms_warn_only_enabled()")
    if all(f in values for f in flags) and any(now.get(f) != values[f] for f in flags):
        torch.use_deterministic_algorithms(values[flags[0]], warn_only=values[flags[1]])


def compare_settings(stock_before: Mapping[str, Any], stock_after: Mapping[str, Any],
                     before: Mapping[str, Any], after: Mapping[str, Any], by: str) -> None:
    """A setting the prepared run changed (``before`` -> ``after``) must be one stock's run
    changed to the same value; one stock left as it was must be left as it was. Every setting
    that differs is named, the first one first."""
    differences = []
    for name, value in after.items():
        if name not in before:
            continue
        changed_by_stock = name in stock_before and name in stock_after and stock_before[name] != stock_after[name]
        expected = stock_after[name] if changed_by_stock else before[name]
        if value != expected:
            differences.append(
                f"{name} changed{by}: {before[name]!r} -> {value!r}"
                + (f" (stock's run left it {expected!r})" if changed_by_stock else ", stock's run left it as it was")
            )
    if differences:
        raise AssertionError(
            f"process-wide setting {differences[0]}: it changes every later computation in the process"
            + (f" (also: {'; '.join(differences[1:])})" if differences[1:] else "")
        )


# --------------------------------------------------------------------------------------------
# torch's global module hooks
# --------------------------------------------------------------------------------------------


#: torch's process-wide module hook dicts: a prepare or restore that leaves one behind changes
#: every model's calls.
_GLOBAL_HOOK_DICTS = tuple(
    name for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                      "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
                      "_global_forward_hooks_with_kwargs", "_global_module_registration_hooks",
                      "_global_parameter_registration_hooks", "_global_buffer_registration_hooks")
    if hasattr(torch.nn.modules.module, name)
)


def global_hook_keys() -> dict[str, tuple]:
    """The keys of each of torch's process-wide module hook dicts now."""
    return {name: tuple(getattr(torch.nn.modules.module, name)) for name in _GLOBAL_HOOK_DICTS}


def compare_global_hooks(before: dict[str, tuple], by: str) -> None:
    """No global module hook added or removed since :func:`global_hook_keys` gave ``before``."""
    for name, keys in global_hook_keys().items():
        added = [k for k in keys if k not in before[name]]
        removed = [k for k in before[name] if k not in keys]
        if added or removed:
            raise AssertionError(
                f"torch.nn.modules.module.{name} changed{by}: {len(added)} added, {len(removed)} removed "
                "(a global module hook runs for every model in the process)"
            )


# --------------------------------------------------------------------------------------------
# The memory and order of parameters and buffers
# --------------------------------------------------------------------------------------------


def memory_of(model: nn.Module) -> list[tuple[str, str, Any]]:
    """``(kind, name, storage key)`` of every parameter and buffer, in ``named_parameters()`` /
    ``named_buffers()`` order (duplicates too): an optimizer built on the prepared model maps its
    state by that order, and memory a caller holds (a view, FSDP's flat parameter) aliases them."""
    return [("parameter", n, storage_key(t)) for n, t in model.named_parameters(remove_duplicate=False)] + [
        ("buffer", n, storage_key(t)) for n, t in model.named_buffers(remove_duplicate=False)]


def compare_memory(at: str, expected: list[tuple[str, str, Any]], now: list[tuple[str, str, Any]]) -> None:
    """The prepared model's parameters and buffers against ``expected`` (:func:`memory_of` before
    ``prepare``, with what stock's own calls changed: :meth:`StockChanges.memory`): the same names
    in the same order, each in the memory it had (where a storage can be read: a tensor subclass
    by its inner tensors, not on the meta device; not where stock's calls moved, replaced or
    added it)."""
    for kind in ("parameter", "buffer"):
        old = [name for k, name, _ in expected if k == kind]
        new = [name for k, name, _ in now if k == kind]
        if old != new:
            change = (f"missing {sorted(set(old) - set(new))}, unexpected {sorted(set(new) - set(old))}"
                      if set(old) != set(new) else f"the same names in another order: {new} where stock has {old}")
            raise AssertionError(
                f"named_{kind}s() differs from stock's{at}: {change} (an optimizer or checkpoint maps state by them)"
            )
    keys = {(kind, name): key for kind, name, key in expected}
    for kind, name, key in now:
        was = keys[(kind, name)]
        if was is None or key is None or was == key:
            continue
        raise AssertionError(
            f"{kind} {name!r} moved to other memory{at}: (address, storage offset, strides) {was!r} -> {key!r} "
            "(memory a caller holds, a view of it, an optimizer's or FSDP's flat buffer, no longer aliases it)"
        )


class StockChanges:
    """What stock's own calls change in the model's structure and memory, read from stock itself:
    a snapshot (:func:`~paramfold.testing.structure.structure`, :func:`memory_of`) where a stretch
    of stock's calls begins and one where it ends, applied to the prepared copy's snapshots by
    (kind, name) (:func:`~paramfold.testing.structure.with_changes_by_stock`,
    :func:`~paramfold.testing.structure.changed_by_stock`). A stretch is one stock object: the check
    may go on from another copy of stock (a compiled step held to stock compiled from the same
    state, :meth:`fork` and :meth:`switch`). Every object a stretch starts with is held alive
    until the end: a tensor stock's calls replace cannot hand its id or address to the next, which
    would look unmoved."""

    def __init__(self, stock: nn.Module) -> None:
        self._done: list[tuple[Any, Any, list[Any]]] = []
        self._stock, self._first, self._held = stock, _snapshot(stock), _objects(stock)

    def fork(self, stock: nn.Module, copy: nn.Module) -> tuple[Any, ...]:
        """Taken when ``copy`` is made of ``stock``: what :meth:`switch` needs to go on from ``copy``."""
        return _snapshot(stock), copy, _snapshot(copy), _objects(copy)

    def switch(self, fork: tuple[Any, ...]) -> None:
        """Stock is now the copy :meth:`fork` was taken for, and goes on from where it was copied."""
        end, copy, start, held = fork
        self._done.append((self._first, end, self._held))
        self._stock, self._first, self._held = copy, start, held

    def _stretches(self) -> list[tuple[Any, Any]]:
        return [(first, end) for first, end, _ in self._done] + [(self._first, _snapshot(self._stock))]

    def structure(self, before: Structure) -> Structure:
        """The prepared copy's ``before`` with what stock's calls changed since."""
        for first, end in self._stretches():
            before = with_changes_by_stock(before, first[0], end[0])
        return before

    def memory(self, before: list[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
        """The prepared copy's :func:`memory_of` ``before`` with what stock's calls changed since:
        stock's names now, the memory stock's calls moved, replaced or added not compared (None)."""
        for first, end in self._stretches():
            before = changed_by_stock(before, first[1], end[1], 1, None)
        return before


def _snapshot(model: nn.Module) -> tuple[Structure, list[tuple[str, str, Any]]]:
    return structure(model, values=False), memory_of(model)


def _objects(model: nn.Module) -> list[Any]:
    return [*model.modules(), *model.parameters(), *model.buffers()]


def compare_copy_on_write(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], what: str) -> None:
    """A restored tensor is copy-on-write (``torch._lazy_clone``'s) only where stock's is: a
    storage paramfold's freeze shared with a frozen value and did not take back makes a later
    ``resize_`` and in-place write fail inside torch."""
    is_cow = getattr(torch._C, "_is_cow_tensor", None)
    if is_cow is None:
        return
    for key, tensor in actual.items():
        other = expected.get(key)
        if (isinstance(tensor, torch.Tensor) and isinstance(other, torch.Tensor)
                and not is_traceable_wrapper_subclass(tensor) and is_cow(tensor) != is_cow(other)):
            raise AssertionError(
                f"{what} {key!r}: {'copy-on-write' if is_cow(tensor) else 'not copy-on-write'} after restore, "
                f"stock's {'is' if is_cow(other) else 'is not'}"
            )


# --------------------------------------------------------------------------------------------
# Modules filter_fn leaves out of prepare
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Excluded:
    """A module with a parametrization or a hook-based norm that ``filter_fn`` left out, as it
    was before ``prepare``."""

    path: str
    module: nn.Module
    cls: type
    keys: frozenset[str]
    chains: Any
    properties: dict[str, Any]
    above_selected: bool


def _chains_of(module: nn.Module) -> Any:
    """Its parametrizations (the objects, classes and members of each chain) and its hook-based
    norms (each forward pre-hook's key, object and class)."""
    plists = module._modules.get("parametrizations")
    chains = None if plists is None else (id(plists), type(plists), tuple(
        (name, id(plist), type(plist), tuple((id(m), type(m)) for m in plist), plist.unsafe)
        for name, plist in plists.items()))
    return chains, tuple((key, id(hook), type(hook)) for key, hook, _ in hooknorms.hook_norms(module))


def _computed_names(module: nn.Module) -> list[str]:
    """The tensors stock computes on ``module``: parametrized ones and hook-based norms' ``weight``."""
    plists = module._modules.get("parametrizations")
    return [*(plists or {}), *(hook.name for _, hook, _ in hooknorms.hook_norms(module))]


def excluded_modules(model: nn.Module, filter_fn: Callable[[nn.Module, str], bool] | None) -> list[_Excluded]:
    """The modules ``filter_fn`` leaves out of ``prepare``, parametrized ones and those with a
    hook-based ``weight_norm``/``spectral_norm`` (``filter_fn`` selects those too): each must keep
    stock's class (or, above a module that is prepared, a class made from stock's, as prepare
    makes for the modules whose calls serve those below), its parametrizations, its hook-based
    norms and its properties, and gain no site of paramfold's. Called before ``prepare``, on the
    same modules with the same paths as ``prepare`` calls ``filter_fn`` with."""
    if filter_fn is None:
        return []
    found = dict(parametrized(model))
    found.update((path, module) for path, module, _, _ in hook_norms(model))
    found = {path: module for path, module in model.named_modules() if path in found}  # model order
    chosen = {path: bool(filter_fn(module, path)) for path, module in found.items()}
    inside = parametrization_paths(model)
    # (Above any module of its own, prepare may make it an entry of those below: a selected
    # site, a hook-based norm, a module whose parameters it detaches under no_grad.)
    below = [path for path, _ in model.named_modules() if path not in inside]
    result = []
    for path, module in found.items():
        if chosen[path]:
            continue
        result.append(_Excluded(
            path, module, type(module), frozenset(module.__dict__), _chains_of(module),
            {name: inspect.getattr_static(type(module), name, None) for name in _computed_names(module)},
            any(p != path and (not path or p.startswith(path + ".")) for p in below),
        ))
    return result


def compare_excluded(at: str, excluded: list[_Excluded], expected: Structure | None = None) -> None:
    """Each module :func:`excluded_modules` found still as it was before ``prepare``; its
    ``__dict__`` keys bar those stock's own calls added or deleted (``expected``: the prepared
    copy's structure before ``prepare`` with stock's changes, :meth:`StockChanges.structure`)."""
    keys_now = {} if expected is None else {row[0]: frozenset(row[3]) for row in expected.modules}
    for ex in excluded:
        where = f"module {ex.path or '<root>'!r}, which filter_fn left out of prepare,"
        cls = type(ex.module)
        if cls is not ex.cls and not (ex.above_selected and issubclass(cls, ex.cls)):
            raise AssertionError(
                f"{where} has another class{at}: {cls.__module__}.{cls.__qualname__} (id {id(cls)}), stock's "
                f"{ex.cls.__module__}.{ex.cls.__qualname__} (id {id(ex.cls)})"
            )
        if _chains_of(ex.module) != ex.chains:
            raise AssertionError(f"{where} has other parametrizations or hook-based norms{at} (their objects, "
                                 "classes or members)")
        for name, prop in ex.properties.items():
            if inspect.getattr_static(cls, name, None) is not prop:
                raise AssertionError(f"{where} reads {name!r} through another attribute of its class{at} than stock's")
        state = ex.module.__dict__.get(STATE_ATTR)
        if getattr(state, "sites", None):
            raise AssertionError(f"{where} has tensors prepared by paramfold{at}: {sorted(state.sites)}")
        if not ex.above_selected:
            keys = ex.keys - IGNORED_KEYS
            if ex.path in keys_now:  # as stock's calls left stock's
                keys = keys_now[ex.path]
            now = frozenset(ex.module.__dict__) - IGNORED_KEYS
            added, removed = now - keys, keys - now
            if added or removed:
                raise AssertionError(
                    f"{where} has other __dict__ keys{at}: added {sorted(added)}, removed {sorted(removed)}"
                    + (" (stock's own calls changed its keys too)" if keys != ex.keys - IGNORED_KEYS else ""))
