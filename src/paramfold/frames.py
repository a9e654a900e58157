"""Which of paramfold's functions dynamo runs eagerly when it meets them as frames of their own.

Dynamo compiles every Python frame it meets under an active ``torch.compile``, except torch's own
code. When it runs a frame eagerly (the prepared root's ``__call__``, registered here, or a
user's frame it falls back on), the frames that frame calls are compiled one by one: each of
paramfold's helpers would be traced on the first call (compile time the plain model does not
pay) and a getter or descriptor would become a graph of its own, per weight shape, where stock's
parametrize code (a file of torch) is skipped. Functions registered here are skipped the same
way; inlined into traced code they are traced as usual.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch


def run_eagerly_as_frame(fn: Callable) -> Callable:
    """Have dynamo run ``fn`` eagerly (compiling what it calls) when it meets it as a frame."""
    for code in _nested_codes(fn.__code__):
        torch._dynamo.eval_frame.skip_code(code)
    return fn


def run_module_eagerly_as_frames(namespace: Mapping[str, object], keep: Iterable[Callable] = ()) -> None:
    """:func:`run_eagerly_as_frame` for everything a module defines (pass ``globals()``): its
    functions, its classes' methods and properties, and the comprehensions, lambdas and closures
    inside them, each a frame of its own; except the functions in ``keep``, which dynamo is to
    compile as frames (a forward standing in for the user's)."""
    kept = {fn.__code__ for fn in keep}
    for fn in _defined_functions(namespace):
        if fn.__code__ not in kept:
            run_eagerly_as_frame(fn)


def _defined_functions(namespace: Mapping[str, object]) -> Iterator[types.FunctionType]:
    module = namespace["__name__"]
    for obj in list(namespace.values()):
        if isinstance(obj, types.FunctionType) and obj.__module__ == module:
            yield obj
        elif isinstance(obj, type) and obj.__module__ == module:
            for attr in vars(obj).values():
                if isinstance(attr, (staticmethod, classmethod)):
                    attr = attr.__func__
                parts = (attr.fget, attr.fset, attr.fdel) if isinstance(attr, property) else (attr,)
                yield from (f for f in parts if isinstance(f, types.FunctionType))


def _nested_codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested_codes(const)
