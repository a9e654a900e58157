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
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from paramfold.errors import counted, with_article

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

#: Who the two sides of a comparison are, as messages name them: ``(actual, expected)``.
SIDES = ("prepared", "stock")


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


def compare_outputs(actual: Any, expected: Any, at: str, tol: Tolerance, sides: tuple[str, str] = SIDES) -> None:
    compare_tree("output", actual, expected, at, tol, sides=sides)


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "a tensor"
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    return with_article(f"{type(value).__module__}.{type(value).__qualname__}")


def compare_tree(
    what: str, actual: Any, expected: Any, at: str, tol: Tolerance, seen: set[tuple[int, int]] | None = None,
    strict: bool = True, sides: tuple[str, str] = SIDES,
) -> None:
    """``actual`` against ``expected``, structure included: tensors as :func:`compare`, within
    lists, tuples (named ones by field), mappings (keys in order), dataclasses (by field) and
    other objects by their attributes (``vars()`` and ``__slots__``); Python numbers as float64
    tensors (bitwise unless a tolerance applies; then an int may stand for a float), NumPy arrays
    and scalars as tensors of their dtype, ``None``, strings, enums and other plain values by
    equality, always of the same type; functions, classes and modules by their type only. An
    object with no attributes to walk is compared by its type's ``==`` where that gives a truth
    value, and otherwise, where ``strict`` (outputs), refused with a TypeError (it could hide
    tensors); by its type only where not (inputs, which the caller made). ``sides`` names the
    two sides in messages."""
    mine, theirs = sides
    if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
        compare(f"{what}{at}", actual, expected, tol, sides)
        return
    if isinstance(expected, nn.Module):
        # Compared as the model's own parameters, buffers and state dict; prepare gives a module
        # a subclass of its class.
        if not isinstance(actual, type(expected)):
            raise AssertionError(f"{what}{at}: {mine} gives {_kind(actual)}, {theirs} {_kind(expected)}")
        return
    # A pair already compared, or being compared (a cycle). Keyed on both sides: stock's None,
    # small int or shared list seen again says nothing about what the prepared side holds there.
    seen = set() if seen is None else seen
    if (id(expected), id(actual)) in seen:
        return
    seen.add((id(expected), id(actual)))
    numbers = (int, float)
    if type(actual) is not type(expected) and (
        _exact(tol) or not (
            isinstance(actual, numbers) and isinstance(expected, numbers)
            and not isinstance(actual, bool) and not isinstance(expected, bool)
        )
    ):
        raise AssertionError(f"{what}{at}: {mine} gives {_kind(actual)}, {theirs} {_kind(expected)}")
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(expected, (numpy.ndarray, numpy.generic)):
        _compare_numpy(numpy, f"{what}{at}", actual, expected, tol, sides)
    elif isinstance(expected, Mapping):
        if list(actual) != list(expected):
            raise AssertionError(f"{what}{at}: {mine} has keys {list(actual)!r}, {theirs} {list(expected)!r}")
        for key in expected:
            compare_tree(f"{what}[{key!r}]", actual[key], expected[key], at, tol, seen, strict, sides)
    elif isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            raise AssertionError(f"{what}{at}: {mine} has {len(actual)} entries, {theirs} {len(expected)}")
        fields = getattr(type(expected), "_fields", None)
        for i, (a, e) in enumerate(zip(actual, expected)):
            compare_tree(f"{what}.{fields[i]}" if fields else f"{what}[{i}]", a, e, at, tol, seen, strict, sides)
    elif dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        for field in dataclasses.fields(expected):
            compare_tree(f"{what}.{field.name}", getattr(actual, field.name), getattr(expected, field.name), at, tol,
                          seen, strict, sides)
    elif isinstance(expected, (float, complex)) or (isinstance(expected, int) and not isinstance(expected, bool)
                                                     and isinstance(actual, float)):
        dtype = torch.complex128 if isinstance(expected, complex) else torch.float64
        compare(f"{what}{at}", torch.tensor(actual, dtype=dtype), torch.tensor(expected, dtype=dtype), tol, sides)
    elif isinstance(expected, _PLAIN):
        if actual != expected:
            raise AssertionError(f"{what}{at}: {mine} gives {actual!r}, {theirs} {expected!r}")
    elif isinstance(expected, _BY_TYPE):
        pass
    elif (attributes := _attributes(expected)) is not None:
        ours = _attributes(actual) or {}
        if list(ours) != list(attributes):
            raise AssertionError(f"{what}{at}: {mine} has attributes {list(ours)!r}, {theirs} {list(attributes)!r}")
        for name, e in attributes.items():
            compare_tree(f"{what}.{name}", ours[name], e, at, tol, seen, strict, sides)
    elif actual is not expected:
        same = None
        if type(expected).__eq__ is not object.__eq__:
            try:
                same = bool(actual == expected)
            except Exception:  # noqa: BLE001 - no truth value (an array): refused below
                pass
        if same is False:
            raise AssertionError(f"{what}{at}: {mine} gives {actual!r}, {theirs} {expected!r}")
        if same is None and strict:
            raise TypeError(
                f"assert_equivalent cannot compare {what}{at}: {_kind(expected)} is no tensor, container, dataclass "
                "or object with attributes (vars() or __slots__), and its == gives no truth value, so a difference "
                "in it could not be seen; return its tensors (or a comparable value) instead"
            )


def _compare_numpy(numpy: Any, what: str, actual: Any, expected: Any, tol: Tolerance, sides: tuple[str, str]) -> None:
    """NumPy arrays and scalars (of the same type): dtype and shape, then numbers as tensors (so
    NaN equals NaN, bit for bit where exact), objects one by one, anything else by its bytes."""
    a, e = numpy.asarray(actual), numpy.asarray(expected)
    if a.dtype != e.dtype or a.shape != e.shape:
        raise AssertionError(f"{what}: {sides[0]} gives a {a.dtype} array of shape {a.shape}, "
                             f"{sides[1]} a {e.dtype} array of shape {e.shape}")
    if e.dtype.kind == "O":
        for i, (x, y) in enumerate(zip(a.flat, e.flat)):
            compare_tree(f"{what}.flat[{i}]", x, y, "", tol, None, True, sides)
        return
    try:
        ours, stocks = torch.from_numpy(a.copy()), torch.from_numpy(e.copy())
    except TypeError:  # a dtype torch does not have (strings, dates): by its bytes
        if a.tobytes() != e.tobytes():
            raise AssertionError(f"{what}: {sides[0]} gives {actual!r}, {sides[1]} {expected!r}") from None
        return
    compare(what, ours, stocks, tol, sides)


def _exact(tol: Tolerance) -> bool:
    return not (tol.rtol or tol.atol or tol.of_max)


def compare(
    what: str, actual: torch.Tensor | None, expected: torch.Tensor | None, tol: Tolerance,
    sides: tuple[str, str] = SIDES,
) -> None:
    """Two tensors within ``tol`` (as ``torch.testing.assert_close``: shape, dtype and device
    too), and whether they require grad. Exact (:data:`BITWISE`) means bit for bit: ``-0.0`` is
    not ``0.0``, a NaN equals only the same NaN, and the strides of dimensions longer than one
    must match (stock and prepared run the same operations eagerly)."""
    mine, theirs = sides
    if actual is None or expected is None:
        if actual is not expected:
            state = ("None", "a tensor") if actual is None else ("a tensor", "None")
            raise AssertionError(f"{what}: {mine} has {state[0]}, {theirs} has {state[1]}")
        return
    if actual.requires_grad != expected.requires_grad:
        # (One that carries a graph where stock's carries none keeps that graph alive, and its
        # .numpy() raises; one that carries none breaks the caller's backward.)
        state = ("requires grad", "does not") if actual.requires_grad else ("does not require grad", "does")
        raise AssertionError(f"{what}: {mine} {state[0]}, {theirs} {state[1]}")
    if _is_subclass(actual) or _is_subclass(expected):
        # e.g. torchao's Int8Tensor: compare its plain inner tensors and metadata instead.
        if type(actual) is not type(expected):
            raise AssertionError(f"{what}: {mine} is {with_article(type(actual).__name__)}, {theirs} {with_article(type(expected).__name__)}")
        names, meta = expected.__tensor_flatten__()
        if actual.__tensor_flatten__() != (names, meta):
            raise AssertionError(f"{what}: tensor subclass metadata differs")
        for inner in names:
            ours, stocks = getattr(actual, inner), getattr(expected, inner)
            if isinstance(ours, torch.Tensor) or isinstance(stocks, torch.Tensor):
                compare(f"{what}.{inner}", ours, stocks, tol, sides)
            elif ours != stocks:  # an opaque inner object (a DTensor's device mesh): compared as a value
                raise AssertionError(f"{what}.{inner}: {mine} has {ours!r}, {theirs} has {stocks!r}")
        return
    if actual.is_nested or expected.is_nested:
        if not (actual.is_nested and expected.is_nested):
            raise AssertionError(f"{what}: {mine} is {'a' if actual.is_nested else 'no'} nested tensor, "
                                 f"{theirs} {'a' if expected.is_nested else 'no'} nested tensor")
        ours, stocks = actual.detach().unbind(), expected.detach().unbind()
        if len(ours) != len(stocks):
            raise AssertionError(f"{what}: {mine} nests {counted(len(ours), 'tensor')}, {theirs} {len(stocks)}")
        for i, (a, e) in enumerate(zip(ours, stocks)):
            compare(f"{what}[{i}]", a, e, tol, sides)
        return
    atol = tol.atol
    if tol.of_max and expected.is_floating_point():
        atol += tol.of_max * largest(expected)
    try:
        torch.testing.assert_close(actual.detach(), expected.detach(), rtol=tol.rtol, atol=atol, equal_nan=True)
    except AssertionError as exc:
        detail = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise AssertionError(f"{what} differs from {theirs} ({tol.describe()}): {detail}") from None
    if _exact(tol) and actual.layout == torch.strided and not actual.is_quantized:
        _compare_bits(what, actual.detach(), expected.detach(), sides)


def _compare_bits(what: str, actual: torch.Tensor, expected: torch.Tensor, sides: tuple[str, str]) -> None:
    """What ``assert_close`` at zero tolerance lets through: signed zeros, NaN payloads, strides."""
    ours, stocks = _bits(actual), _bits(expected)
    if not torch.equal(ours, stocks):
        where = tuple((ours != stocks).nonzero()[0].tolist())
        if actual.is_complex():
            where = where[:-1]
        raise AssertionError(
            f"{what} differs from {sides[1]} (bitwise): at index {where} {sides[0]} has {actual[where].item()!r}, "
            f"{sides[1]} {expected[where].item()!r} (equal as numbers, other bits: a signed zero or a NaN's payload)"
        )
    long = [d for d in range(actual.dim()) if actual.shape[d] > 1]
    if [actual.stride(d) for d in long] != [expected.stride(d) for d in long]:
        raise AssertionError(
            f"{what} differs from {sides[1]} (bitwise): equal values in another memory layout, {sides[0]} has strides "
            f"{actual.stride()}, {sides[1]} {expected.stride()} (a .view() of one of them would fail)"
        )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width (bools as they are)."""
    t = t.resolve_conj().resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        return t
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


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
