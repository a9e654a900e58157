"""How :mod:`paramfold.testing` compares a prepared model's results with stock's: tensors within a
:class:`Tolerance` (bitwise by default), and whole output trees, structure included.

Why a module of its own: the checker (:mod:`~paramfold.testing.check`) and the structure snapshots
(:mod:`~paramfold.testing.structure`) both compare, and what counts as "the same" (which
containers and objects are walked, what is compared by equality or by type only, how tensor
subclasses are opened) is one decision, made here.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["BITWISE", "Tolerance", "compare", "compare_dicts", "compare_outputs", "compare_tree", "largest", "tensors_of"]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + of_max * max|expected| + rtol * |expected|``, elementwise."""

    rtol: float = 0.0
    atol: float = 0.0
    of_max: float = 0.0

    def describe(self) -> str:
        if not (self.rtol or self.atol or self.of_max):
            return "bitwise"
        return f"rtol={self.rtol:.3g}, atol={self.atol:.3g} + {self.of_max:.3g} * max|stock|"


BITWISE = Tolerance()


def tensors_of(value: Any, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """The tensors in ``value``, walked as :func:`compare_tree` walks it."""
    if isinstance(value, torch.Tensor):
        yield value
        return
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, Mapping):
        for v in value.values():
            yield from tensors_of(v, seen)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_of(v, seen)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_of(getattr(value, field.name), seen)
    elif (attributes := _attributes(value)) is not None:
        for v in attributes.values():
            yield from tensors_of(v, seen)


#: Objects compared by their type only: code, classes and modules, not values (a module's tensors
#: are compared as the model's parameters, buffers and state dict).
_BY_TYPE = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, nn.Module)

#: Plain values, compared by equality.
_PLAIN = (type(None), bool, int, str, bytes, enum.Enum, torch.dtype, torch.device, torch.Size)


def _attributes(value: Any) -> dict[str, Any] | None:
    """A plain object's attributes (``vars()`` and ``__slots__``, as a dataclass's fields), or
    None for a value that is not such an object or has neither (a C type's instance)."""
    if isinstance(value, (torch.Tensor, Mapping, list, tuple, float, complex, *_PLAIN, *_BY_TYPE)):
        return None
    slots = [
        name
        for cls in type(value).__mro__
        for name in ((cls.__dict__.get("__slots__") or ()) if not isinstance(cls.__dict__.get("__slots__"), str)
                     else (cls.__dict__["__slots__"],))
        if name not in ("__dict__", "__weakref__")
    ]
    if not slots and not hasattr(value, "__dict__"):
        return None
    found = dict(vars(value)) if hasattr(value, "__dict__") else {}
    for name in slots:
        if hasattr(value, name):
            found.setdefault(name, getattr(value, name))
    return found


def compare_outputs(actual: Any, expected: Any, at: str, tol: Tolerance) -> None:
    compare_tree("output", actual, expected, at, tol)


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "a tensor"
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def compare_tree(
    what: str, actual: Any, expected: Any, at: str, tol: Tolerance, seen: set[int] | None = None,
    strict: bool = True,
) -> None:
    """``actual`` against ``expected``, structure included: tensors as :func:`compare`, within
    lists, tuples (named ones by field), mappings (keys in order), dataclasses (by field) and
    other objects by their attributes (``vars()`` and ``__slots__``); Python numbers as float64
    tensors (bitwise unless a tolerance applies), ``None``, strings, enums and other plain values
    by equality; functions, classes and modules by their type only. An object with no attributes
    to walk is compared by its type's ``==`` where that gives a truth value, and otherwise, where
    ``strict`` (outputs), refused with a TypeError (it could hide tensors); by its type only where
    not (inputs, which the caller made)."""
    if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
        compare(f"{what}{at}", actual, expected, tol)
        return
    if isinstance(expected, nn.Module):
        return  # compared as the model's own parameters, buffers and state dict
    seen = set() if seen is None else seen
    if id(expected) in seen:
        return
    seen.add(id(expected))
    if type(actual) is not type(expected) and not (
        isinstance(actual, (int, float)) and isinstance(expected, (int, float))
        and not isinstance(actual, bool) and not isinstance(expected, bool)
    ):
        raise AssertionError(f"{what}{at}: prepared gives {_kind(actual)}, stock {_kind(expected)}")
    if isinstance(expected, Mapping):
        if list(actual) != list(expected):
            raise AssertionError(f"{what}{at}: prepared has keys {list(actual)!r}, stock {list(expected)!r}")
        for key in expected:
            compare_tree(f"{what}[{key!r}]", actual[key], expected[key], at, tol, seen, strict)
    elif isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            raise AssertionError(f"{what}{at}: prepared has {len(actual)} entries, stock {len(expected)}")
        fields = getattr(type(expected), "_fields", None)
        for i, (a, e) in enumerate(zip(actual, expected)):
            compare_tree(f"{what}.{fields[i]}" if fields else f"{what}[{i}]", a, e, at, tol, seen, strict)
    elif dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        for field in dataclasses.fields(expected):
            compare_tree(f"{what}.{field.name}", getattr(actual, field.name), getattr(expected, field.name), at, tol,
                          seen, strict)
    elif isinstance(expected, (float, complex)) or (isinstance(expected, int) and not isinstance(expected, bool)
                                                     and isinstance(actual, float)):
        compare(f"{what}{at}", torch.tensor(actual, dtype=torch.complex128 if isinstance(expected, complex)
                                             else torch.float64),
                 torch.tensor(expected, dtype=torch.complex128 if isinstance(expected, complex) else torch.float64),
                 tol)
    elif isinstance(expected, _PLAIN):
        if actual != expected:
            raise AssertionError(f"{what}{at}: prepared gives {actual!r}, stock {expected!r}")
    elif isinstance(expected, _BY_TYPE):
        pass
    elif (attributes := _attributes(expected)) is not None:
        theirs = _attributes(actual) or {}
        if list(theirs) != list(attributes):
            raise AssertionError(f"{what}{at}: prepared has attributes {list(theirs)!r}, stock {list(attributes)!r}")
        for name, e in attributes.items():
            compare_tree(f"{what}.{name}", theirs[name], e, at, tol, seen, strict)
    elif actual is not expected:
        same = None
        if type(expected).__eq__ is not object.__eq__:
            try:
                same = bool(actual == expected)
            except Exception:  # noqa: BLE001 - no truth value (an array): refused below
                pass
        if same is False:
            raise AssertionError(f"{what}{at}: prepared gives {actual!r}, stock {expected!r}")
        if same is None and strict:
            raise TypeError(
                f"assert_equivalent cannot compare {what}{at}: {_kind(expected)} is no tensor, container, dataclass "
                "or object with attributes (vars() or __slots__), and its == gives no truth value, so a difference "
                "in it could not be seen; return its tensors (or a comparable value) instead"
            )


def compare(what: str, actual: torch.Tensor | None, expected: torch.Tensor | None, tol: Tolerance) -> None:
    if actual is None or expected is None:
        if actual is not expected:
            state = ("None", "a tensor") if actual is None else ("a tensor", "None")
            raise AssertionError(f"{what}: prepared has {state[0]}, stock has {state[1]}")
        return
    if _is_subclass(actual) or _is_subclass(expected):
        # e.g. torchao's Int8Tensor: compare its plain inner tensors and metadata instead.
        if type(actual) is not type(expected):
            raise AssertionError(f"{what}: prepared is a {type(actual).__name__}, stock a {type(expected).__name__}")
        names, meta = expected.__tensor_flatten__()
        if actual.__tensor_flatten__() != (names, meta):
            raise AssertionError(f"{what}: tensor subclass metadata differs")
        for inner in names:
            compare(f"{what}.{inner}", getattr(actual, inner), getattr(expected, inner), tol)
        return
    atol = tol.atol
    if tol.of_max and expected.is_floating_point():
        atol += tol.of_max * largest(expected)
    try:
        torch.testing.assert_close(actual.detach(), expected.detach(), rtol=tol.rtol, atol=atol, equal_nan=True)
    except AssertionError as exc:
        detail = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise AssertionError(f"{what} differs from stock ({tol.describe()}): {detail}") from None


def largest(t: torch.Tensor) -> float:
    """The largest finite magnitude in ``t`` (0 for an empty or all non-finite tensor)."""
    finite = t.detach().float().nan_to_num(0.0, 0.0, 0.0)
    return float(finite.abs().max()) if finite.numel() else 0.0


def _is_subclass(t: torch.Tensor) -> bool:
    return type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__")


def compare_dicts(
    at: str, what: str, actual: Mapping[str, Any], expected: Mapping[str, Any], tol: Tolerance
) -> None:
    if list(actual) != list(expected):
        missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
        raise AssertionError(f"{what} keys differ{at}: missing {missing}, unexpected {extra} (or order changed)")
    for key in expected:
        compare(f"{what} {key!r}{at}", actual[key], expected[key], tol)
