"""Snapshots of a model's object structure, to check that ``prepare`` + ``restore`` (or a refused
``prepare``) leaves a model exactly as it was: :func:`structure` and :func:`assert_same_structure`.

Why a module of its own: a test suite uses the snapshots on their own, around any transform, and
the checker (:mod:`~paramfold.testing.check`) uses them after each restore, holding the restored
copy to its snapshot from before ``prepare`` with what stock's own calls changed meanwhile
(:func:`with_changes_by_stock`, which reads the snapshot's layout, so it sits beside it);
:mod:`~paramfold.testing.left_as_stock` reads tensors' memory by :func:`storage_key`.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from paramfold.testing.compare import BITWISE, compare_dicts

__all__ = ["Structure", "assert_same_structure", "structure"]


@dataclasses.dataclass(frozen=True, eq=False)
class Structure:
    """A snapshot of a model's object structure (and, optionally, its state dict values).

    ``modules`` lists, for every module reached by ``named_modules(remove_duplicate=False)``
    (parametrization modules included): its path, object id, class object, ``__dict__`` keys,
    the ids and ``requires_grad`` of its own parameters and buffers, its hooks (every hook dict's
    keys and hook objects), its plain attributes' values (``training``, ``Dropout.p``,
    spectral_norm's ``n_power_iterations``: numbers, strings, None, dtypes, devices, and tuples
    and sets of them) and the memory its parameters and buffers use (:func:`storage_key`: a
    ``p.data = p.data.clone()`` keeps the object and its values, but memory a caller holds, a
    NumPy view, FSDP's flat parameter, no longer aliases it).
    """

    modules: tuple[tuple[Any, ...], ...]
    state: dict[str, torch.Tensor] | None


#: ``__dict__`` entries that are not paramfold's business: ``torch.compile(module)`` marks the
#: module it wraps.
IGNORED_KEYS = frozenset({"_is_torch_compile"})

_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _is_plain(value: Any) -> bool:
    if isinstance(value, (tuple, frozenset, set)):
        return all(_is_plain(v) for v in value)
    return isinstance(value, _SCALARS)


def _same_plain(a: Any, b: Any) -> bool:
    """``a == b`` for plain values, of the same type, with NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same_plain(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def _hooks(module: nn.Module) -> tuple[tuple[str, tuple[tuple[Any, Any], ...]], ...]:
    """Every hook dict of ``module`` (``_forward_hooks``, ``_state_dict_pre_hooks``, ...): its
    name and its ``(handle id, hook)`` items, in order. The hook objects themselves are kept,
    compared by ``==`` (identity for functions)."""
    return tuple(
        (key, tuple(value.items()))
        for key, value in sorted(module.__dict__.items())
        if "_hooks" in key and isinstance(value, dict)
    )


def storage_key(tensor: Any) -> Any:
    """Where ``tensor``'s values live: its data's address, its storage offset and its strides; for a
    tensor subclass made of others (torchao's, DTensor), the keys of its inner tensors. ``None``
    where nothing can be read (no tensor, the meta device, a subclass that does not flatten),
    which is then not compared: those carry no memory a caller could hold."""
    if not isinstance(tensor, torch.Tensor):
        return None
    try:
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            return tuple((name, storage_key(getattr(tensor, name))) for name in names)
        if tensor.is_meta:
            return None
        # (const_data_ptr: a copy-on-write tensor's data_ptr() would materialize it, a change)
        return (tensor.const_data_ptr(), tensor.storage_offset(), tuple(tensor.stride()))
    except Exception:  # noqa: BLE001 - a tensor without readable storage: consciously not compared
        return None


def structure(model: nn.Module, *, values: bool = True) -> Structure:
    """Snapshot ``model`` for :func:`assert_same_structure`; ``values`` also copies its state dict.

    Example::

        >>> import torch, paramfold
        >>> from paramfold.testing import structure, assert_same_structure
        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> model = weight_norm(torch.nn.Linear(2, 2))
        >>> before = structure(model)
        >>> _ = paramfold.restore(paramfold.prepare(model, "hoist"))
        >>> assert_same_structure(before, structure(model))
    """
    rows = []
    for path, module in model.named_modules(remove_duplicate=False):
        params = tuple((n, id(p), p is not None and p.requires_grad) for n, p in module._parameters.items())
        buffers = tuple((n, id(b)) for n, b in module._buffers.items())
        keys = tuple(sorted(k for k in module.__dict__ if k not in IGNORED_KEYS))
        plain = tuple(
            (k, frozenset(v) if isinstance(v, set) else v)
            for k, v in sorted(module.__dict__.items())
            if k not in IGNORED_KEYS and _is_plain(v)
        )
        storage = tuple(
            (kind, n, storage_key(t))
            for kind, tensors in (("parameter", module._parameters), ("buffer", module._buffers))
            for n, t in tensors.items()
        )
        rows.append((path, id(module), type(module), keys, params, buffers, _hooks(module), plain, storage))
    state = None
    if values:
        state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    return Structure(tuple(rows), state)


def assert_same_structure(before: Structure, after: Structure) -> None:
    """Fail with a readable message unless two :func:`structure` snapshots agree.

    State values are compared (bitwise) only when both snapshots carry them.
    """
    if len(before.modules) != len(after.modules):
        raise AssertionError(f"module count changed: {len(before.modules)} -> {len(after.modules)}")
    fields = ("path", "module object", "class", "__dict__ keys", "parameters", "buffers", "hooks", "attributes",
              "memory")
    for old, new in zip(before.modules, after.modules):
        for field, a, b in zip(fields, old, new):
            where = old[0] or "<root>"
            if field == "attributes":
                _compare_attributes(where, dict(a), dict(b))
                continue
            if field == "memory":
                _compare_memory(where, a, b)
                continue
            if a == b:
                continue
            if field == "class":
                change = f"{a.__module__}.{a.__qualname__} (id {id(a)}) -> {b.__module__}.{b.__qualname__} (id {id(b)})"
            elif field == "__dict__ keys":
                change = f"added {sorted(set(b) - set(a))}, removed {sorted(set(a) - set(b))}"
            elif field == "hooks":
                change = _hook_change(dict(a), dict(b))
            else:
                change = f"{a!r} -> {b!r}"
            raise AssertionError(f"module {where!r}: {field} changed: {change}")
    if before.state is not None and after.state is not None:
        compare_dicts("", "state_dict", before.state, after.state, BITWISE)


def _compare_attributes(where: str, a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in sorted(set(a) | set(b)):
        old, new = a.get(key, _MISSING), b.get(key, _MISSING)
        if old is _MISSING or new is _MISSING or not _same_plain(old, new):
            raise AssertionError(f"module {where!r}: attribute {key!r} changed: {old!r} -> {new!r}")


def _compare_memory(where: str, a: tuple, b: tuple) -> None:
    """Each parameter's and buffer's :func:`storage_key`, where both snapshots could read one."""
    old = {(kind, name): key for kind, name, key in a}
    for kind, name, key in b:
        was = old.get((kind, name))
        if was is None or key is None or was == key:
            continue
        raise AssertionError(
            f"module {where!r}: {kind} {name!r} moved to other memory: (address, storage offset, strides) "
            f"{was!r} -> {key!r} (the same object and values, but memory a caller holds, a view or "
            "NumPy array of it, an optimizer's or FSDP's flat buffer, no longer aliases it)"
        )


class _Missing:
    def __repr__(self) -> str:
        return "(none, or not a plain value)"


_MISSING = _Missing()


def _hook_change(a: dict[str, tuple], b: dict[str, tuple]) -> str:
    """Which hooks were added or removed, dict by dict (a hook replaced under its handle id counts
    as both)."""
    changes = []
    for name in sorted(set(a) | set(b)):
        old, new = a.get(name, ()), b.get(name, ())
        added = [item for item in new if item not in old]
        removed = [item for item in old if item not in new]
        if added or removed or old != new:
            changes.append(f"{name}: added {_hook_items(added)}, removed {_hook_items(removed)}"
                           + ("" if added or removed else " (order changed)"))
    return "; ".join(changes)


def _hook_items(items: list[tuple[Any, Any]]) -> str:
    names = (f"{key!r}: {getattr(hook, '__qualname__', type(hook).__qualname__)}" for key, hook in items)
    return "[" + ", ".join(names) + "]"


def with_changes_by_stock(before: Structure, stock_before: Structure, stock_after: Structure) -> Structure:
    """``before`` with what stock's own calls changed, module by module (matched by path), as the
    prepared copy's calls change it too, which is no difference from stock: ``__dict__`` keys
    added or deleted (transformers marks a model ``_output_capturing_hooks_installed`` when it
    first runs with ``output_hidden_states``, and registers hooks then), hooks registered or
    removed, plain attributes' values (those are stock's, as stock has them now), parameters and
    buffers registered, deleted or replaced (a forward that keeps an EMA as ``self.ema = 0.9 *
    self.ema + ...``, a step counter, a cache registered at the first call: the prepared copy's
    calls make objects of their own, which match any object there), the memory stock's calls
    moved (:func:`changed_by_stock`), a module's class stock's calls changed (its own forward
    assigning ``__class__``) and submodules stock's calls registered, replaced or deleted (``if not
    hasattr(self, "head"): self.head = nn.Linear(...)``, a cache module built at the first call:
    the module tree is stock's now, in its order, and such a module is one like stock's,
    :func:`_like_stocks_row`). What stock changed is read from stock's two snapshots alone and
    applied to ``before`` by (kind, name) and by path: the two copies' objects and addresses always
    differ. A module of ``before`` at a path stock did not have is kept, never excused. ``before``
    may itself be such a result (the check may go on from another copy of stock)."""
    old = {row[0]: row for row in stock_before.modules}
    new = {row[0]: row for row in stock_after.modules}
    mine = {row[0]: row for row in before.modules}
    if [row[:2] for row in stock_before.modules] == [row[:2] for row in stock_after.modules]:
        # (the same module objects at the same paths: the tree is before's, in its order)
        tree = [row[0] for row in before.modules]
    else:
        # Stock's tree now: a path whose module stock's calls kept is before's; one they
        # registered or replaced is like stock's; one they deleted is gone.
        tree = [path for path in new] + [path for path in mine if path not in old]
    # (a module stock's calls put at a path that stock held at another: the copy's from there)
    was_at = {row[1]: row[0] for row in reversed(stock_before.modules)}
    rows = []
    for path in tree:
        if path in old and path in new and old[path][1] != new[path][1] or path not in mine:
            row = _like_stocks_row(new[path])
            moved = was_at.get(new[path][1])
            if moved in mine:
                row = (row[0], mine[moved][1], *row[2:])
            rows.append(row)
            continue
        row = mine[path]
        cls, keys, params, buffers, hooks, plain, memory = row[2], set(row[3]), *row[4:9]
        if path in old and path in new:
            if old[path][2] is not new[path][2]:
                cls = _LikeStocksClass(new[path][2])
            keys = (keys | (set(new[path][3]) - set(old[path][3]))) - (set(old[path][3]) - set(new[path][3]))
            params = changed_by_stock(params, old[path][4], new[path][4], 0, _ANY_OBJECT)
            buffers = changed_by_stock(buffers, old[path][5], new[path][5], 0, _ANY_OBJECT)
            hooks = _hooks_changed_by_stock(hooks, dict(old[path][6]), dict(new[path][6]))
            plain = new[path][7]
            memory = changed_by_stock(memory, old[path][8], new[path][8], 1, None)
        rows.append((*row[:2], cls, tuple(sorted(keys)), params, buffers, hooks, plain, memory))
    return Structure(tuple(rows), before.state)


def _like_stocks_row(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """A module stock's calls registered or replaced at ``row``'s path (stock's :func:`structure`
    row of it), as the prepared copy's calls register theirs: any object, of stock's class
    (:class:`_LikeStocksClass`), with stock's ``__dict__`` keys, parameter and buffer names (any
    objects, stock's ``requires_grad``), hooks (any handle ids, like stock's) and plain
    attributes; its memory is not compared (the copy's own)."""
    path, _, cls, keys, params, buffers, hooks, plain, memory = row
    return (
        path, _ANY_OBJECT, _LikeStocksClass(cls), keys,
        tuple((n, _ANY_OBJECT, grad) for n, _, grad in params),
        tuple((n, _ANY_OBJECT) for n, _ in buffers),
        tuple((name, tuple((_ANY_HANDLE, _LikeStocks(hook)) for _, hook in items)) for name, items in hooks),
        plain,
        tuple((kind, n, None) for kind, n, _ in memory),
    )


def changed_by_stock(entries: Any, stock_before: Any, stock_after: Any, name_at: int, unknown: Any) -> Any:
    """``entries`` (rows ``(..., name, what, *rest)`` of the prepared copy: a parameter's
    ``(name, id, requires_grad)``, a memory row's ``(kind, name, storage key)``), with what stock's
    calls changed between its rows ``stock_before`` and ``stock_after``: stock's names now, in its
    order, each with the prepared copy's ``what`` where stock's stayed the same, else ``unknown``
    (an object or memory stock's calls replaced, moved or added: the prepared copy's calls make
    their own), and stock's ``rest`` now. Unchanged by stock, ``entries`` as they are. The same
    for objects, names and memory (:func:`paramfold.testing.left_as_stock.compare_memory` too)."""
    if list(stock_before) == list(stock_after):
        return entries
    key = slice(0, name_at + 1)
    was = {tuple(e[key]): e[name_at + 1] for e in stock_before}
    mine = {tuple(e[key]): e[name_at + 1] for e in entries}
    result = []
    for e in stock_after:
        name = tuple(e[key])
        same = name in was and was[name] == e[name_at + 1] and name in mine
        result.append((*name, mine[name] if same else unknown, *e[name_at + 2:]))
    return type(entries)(result)


def _hooks_changed_by_stock(hooks: tuple, old: dict[str, tuple], new: dict[str, tuple]) -> tuple:
    """``hooks`` (a module's, :func:`structure`'s field) less those that stock's
    calls removed, plus those they registered: the prepared copy's own calls registered theirs
    under other handle ids, so those are matched by kind (:class:`_LikeStocks`)."""
    result = []
    for name, items in hooks:
        was, now = dict(old.get(name, ())), dict(new.get(name, ()))
        if list(was.items()) != list(now.items()):
            # (an entry an earlier stretch of stock left as any handle id stays)
            items = tuple((key, hook) for key, hook in items
                          if not isinstance(key, int) or key in now or key not in was) + tuple(
                (_ANY_HANDLE, _LikeStocks(hook)) for key, hook in now.items() if key not in was
            )
        result.append((name, items))
    return tuple(result)


class _AnyInt:
    """Equal to any int: the handle id the prepared copy's call registered a hook under
    (:data:`_ANY_HANDLE`), the id of an object its call registered or replaced where stock's
    did (:data:`_ANY_OBJECT`)."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __eq__(self, other: object) -> bool:
        return isinstance(other, int)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return self.what


_ANY_HANDLE = _AnyInt("(a handle id)")
_ANY_OBJECT = _AnyInt("(any object, as stock's calls replaced or added theirs)")


class _LikeStocks:
    """Equal to a hook of the same class and name as ``hook``, which stock's call registered."""

    def __init__(self, hook: Any) -> None:
        self.hook = hook
        self.__qualname__ = f"{_hook_kind(hook)} (as stock's calls registered)"

    def __eq__(self, other: object) -> bool:
        return _hook_kind(other) == _hook_kind(self.hook)

    __hash__ = None  # type: ignore[assignment]


class _LikeStocksClass:
    """Equal to the class stock's call gave a module (``cls``); where ``cls`` was made at run time
    (not reachable by its module and name: torch's ``parametrize`` makes one per parametrized
    module), also to a class of the same module, name and bases, which the prepared copy's call
    made likewise."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.__module__ = cls.__module__
        self.__qualname__ = f"{cls.__qualname__} (as stock's calls made it)"

    def __eq__(self, other: object) -> bool:
        if other is self.cls:
            return True
        cls = self.cls
        return (isinstance(other, type) and not _importable(cls) and other.__module__ == cls.__module__
                and other.__qualname__ == cls.__qualname__ and other.__bases__ == cls.__bases__)

    __hash__ = None  # type: ignore[assignment]


def _importable(cls: type) -> bool:
    """Whether ``cls`` is what its module holds under its qualified name."""
    found: Any = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is cls


def _hook_kind(hook: Any) -> str:
    hook = hook.hook if isinstance(hook, _LikeStocks) else hook
    return f"{type(hook).__qualname__} {getattr(hook, '__module__', '')}.{getattr(hook, '__qualname__', '')}"
