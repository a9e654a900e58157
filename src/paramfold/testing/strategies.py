"""Hypothesis strategies for parametrized models: :func:`chains`, :func:`models`, :func:`cases`.

Why a module of its own: it is the only part of :mod:`paramfold.testing` that needs Hypothesis
(the ``paramfold[testing]`` extra); the registry it draws from and the checker it feeds work
without it.

* :func:`chains`: 1-3 compatible parametrizations (:data:`~paramfold.testing.PARAMETRIZATIONS`)
  for one tensor;
* :func:`models`: small random models as a printable :class:`~paramfold.testing.NetSpec`;
* :func:`cases`: a model factory, its inputs and the case's flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

try:
    from hypothesis import assume
    from hypothesis.errors import InvalidArgument
    from hypothesis import strategies as st
except ImportError as _e:  # hypothesis is an optional dependency: the paramfold[testing] extra
    raise ImportError(
        "paramfold.testing's strategies (chains, models, cases) need hypothesis: "
        'pip install "paramfold[testing]"',
        name="hypothesis",
    ) from _e
from torch import nn

from paramfold.testing.nets import LayerSpec, NetSpec
from paramfold.testing.registry import PARAMETRIZATIONS, Chain, Recipe, Step, TensorSpec

__all__ = ["Case", "cases", "chains", "models"]


def _available(names: Sequence[str] | None) -> list[Recipe]:
    chosen = PARAMETRIZATIONS.values() if names is None else [PARAMETRIZATIONS[n] for n in names]
    return [r for r in chosen if r.available]


def _step(recipe: Recipe, tensor: TensorSpec) -> st.SearchStrategy[Step]:
    """``recipe`` as a :class:`Step` on ``tensor``, with one of its option dicts (or drawn from its
    own strategy, for a recipe that gives one)."""
    options = recipe.options(tensor)
    if not isinstance(options, st.SearchStrategy):
        options = st.sampled_from([dict(o) for o in options])
    return options.map(lambda o: Step(recipe.name, tuple(sorted(o.items()))))


def chains(
    tensor: TensorSpec,
    *,
    names: Sequence[str] | None = None,
    min_length: int = 1,
    max_length: int = 3,
) -> st.SearchStrategy[Chain]:
    """Hypothesis strategy: a chain of compatible parametrizations for one tensor, of
    ``min_length`` to ``max_length`` steps.

    Respects each :class:`Recipe`'s ``supports`` and ``position``; no name appears twice.
    ``names`` restricts the registry (default: every available entry). The default includes
    ``"cast"``, which may end a float32 tensor's chain and makes it bfloat16: a layer with such a
    chain fails on float32 inputs (:func:`models` and :func:`cases` build inputs to match). Pass
    ``names=[n for n in PARAMETRIZATIONS if n != "cast"]`` to keep your dtype. Chains longer than
    the recipes allow are never drawn: ``max_length`` is capped at the longest possible chain,
    and a ``min_length`` above it (or below 0, or above ``max_length``) raises Hypothesis'
    ``InvalidArgument`` when the strategy is built, saying what the recipes allow.

    Example::

        >>> import torch
        >>> from hypothesis import given, settings
        >>> from paramfold.testing import TensorSpec, apply_chain, chains
        >>> @settings(max_examples=5, deadline=None)
        ... @given(chains(TensorSpec((4, 4)), names=["weight_norm", "spectral_norm", "scale"]))
        ... def check(chain):
        ...     layer = apply_chain(torch.nn.Linear(4, 4), "weight", chain)
        ...     assert len(layer.parametrizations.weight) == len(chain)
        >>> check()
    """
    recipes = [r for r in _available(names) if r.supports(tensor)]
    positions = {r.position for r in recipes}
    # A chain is one "alone" recipe, or a "first" one or not, then distinct "any" ones, then a
    # "last" one or not.
    longest = sum(r.position == "any" for r in recipes) + ("first" in positions) + ("last" in positions)
    allows = max(longest, int("alone" in positions))
    if not 0 <= min_length <= max_length or min_length > allows:
        raise InvalidArgument(
            f"chains(min_length={min_length}, max_length={max_length}) for a {tensor.shape} {tensor.dtype} tensor: "
            + ("need 0 <= min_length <= max_length"
               if not 0 <= min_length <= max_length
               else f"the recipes that support it ({', '.join(r.name for r in recipes) or 'none'}; names={names!r}) "
               f"chain at most {allows}, so pass min_length <= {allows} or more names")
        )
    return _chains(tensor, recipes, min_length, min(max_length, longest or allows))


@st.composite
def _chains(draw: st.DrawFn, tensor: TensorSpec, recipes: list[Recipe], min_length: int, max_length: int) -> Chain:
    length = draw(st.integers(min_length, max_length))
    if length == 0:
        return ()
    alone = [r for r in recipes if r.position == "alone"]
    if alone and min_length <= 1 and (len(alone) == len(recipes) or draw(st.integers(0, 3)) == 0):
        recipe = draw(st.sampled_from(alone))
        return (draw(_step(recipe, tensor)),)
    last = [r for r in recipes if r.position == "last"]
    steps: list[Step] = []

    def usable(pool: list[Recipe], i: int) -> list[Recipe]:
        """The recipes of ``pool`` not in the chain yet that leave the steps after ``i`` fillable:
        with distinct "any" recipes, and a "last" one at the end."""
        after, used = length - 1 - i, {s.name for s in steps}
        spare = [o.name for o in recipes if o.position == "any" and o.name not in used]
        return [r for r in pool if r.name not in used and (after == 0 or len(set(spare) - {r.name}) + bool(last) >= after)]

    for i in range(length):
        here = [r for r in recipes if r.position == "any" or (i == 0 and r.position == "first")]
        pool = here
        if i == 0 and any(r.position == "first" for r in recipes) and draw(st.booleans()):
            # Half the chains start with one: they are fewer, and rarer.
            pool = [r for r in recipes if r.position == "first"]
        if i == length - 1 and last and draw(st.booleans()):
            pool = last
        # Where the coins above chose what cannot complete the chain, any recipe that can.
        pool = usable(pool, i) or usable(here + (last if i == length - 1 else []), i)
        recipe = draw(st.sampled_from(pool))
        steps.append(draw(_step(recipe, tensor)))
    return tuple(steps)


_LAYER_KINDS = ("linear", "conv1d", "conv2d", "layernorm", "buffer")


@st.composite
def _layer(draw: st.DrawFn, index: int, width: int, max_width: int, residual: bool) -> LayerSpec:
    kinds = _LAYER_KINDS + (("embedding",) if index == 0 else ())
    kind = draw(st.sampled_from(kinds))
    keeps_width = kind in ("layernorm", "buffer") or (residual and index > 0)
    out = width if keeps_width or draw(st.booleans()) else draw(st.integers(2, max_width))
    kernel: tuple[int, ...] = ()
    if kind == "conv1d":
        kernel = (draw(st.sampled_from([1, 3])),)
    elif kind == "conv2d":
        kernel = (draw(st.sampled_from([1, 3])), draw(st.sampled_from([1, 3])))
    if kind == "embedding":
        return LayerSpec(kind, draw(st.integers(2, max_width)), out)
    return LayerSpec(kind, width, out, kernel, bias=draw(st.booleans()))


#: The model dtypes :func:`models` draws from by default ("cast": float32 with the seed's cast last).
_DTYPES = ("float32", "bfloat16", "cast")


@st.composite
def models(
    draw: st.DrawFn,
    *,
    max_layers: int = 3,
    max_width: int = 12,
    dtypes: Sequence[str] = _DTYPES,
    names: Sequence[str] | None = None,
    tying: bool = True,
    repeats: bool = True,
    unused: bool = True,
    training: bool | None = None,
    requires_grad: Sequence[str] = ("all", "all", "none", "some"),
) -> NetSpec:
    """Hypothesis strategy: a :class:`NetSpec` for a small random parametrized model.

    Layers are Linear, Conv1d and Conv2d (in blocks), LayerNorm, a module with a parametrizable
    *buffer*, and an Embedding stem; the root is an ``nn.Sequential`` or a custom module with a
    residual. Each tensor gets a random chain (:func:`chains`) or none; with ``dtype="cast"``
    every floating tensor also gets the seed's ``unsafe`` cast to bfloat16, last. Optionally one
    tensor's originals are shared by two same-shaped layers (``tie``), or one layer instance is
    called twice (``repeat``; a stateful chain in training then runs its power iteration at
    each call, in stock and prepared alike), or one layer is held but never called (``unused``;
    its state, a training spectral_norm's, must not move).

    Example::

        >>> import torch
        >>> from hypothesis import given, settings
        >>> from paramfold.testing import models
        >>> @settings(max_examples=5, deadline=None)
        ... @given(models(max_layers=2, dtypes=["float32"]))
        ... def check(spec):
        ...     same = spec.build()(*spec.inputs()), spec.build()(*spec.inputs())
        ...     torch.testing.assert_close(*same, rtol=0, atol=0, equal_nan=True)  # deterministic
        >>> check()
    """
    dtype = draw(st.sampled_from(list(dtypes)))
    residual = draw(st.booleans())
    is_training = draw(st.booleans()) if training is None else training
    allowed = [n for n in (names if names is not None else PARAMETRIZATIONS) if n != "cast"]
    if dtype == "cast":
        allowed = [n for n in allowed if n != "int8_weight_only"]
    storage = torch.bfloat16 if dtype == "bfloat16" else torch.float32

    count = draw(st.integers(1, max_layers))
    width = draw(st.integers(2, max_width))
    layers: list[LayerSpec] = []
    for index in range(count):
        previous = layers[-1] if layers else None
        if (
            previous is not None
            and previous.kind != "embedding"
            and previous.width_in == previous.width_out
            and draw(st.booleans())
        ):
            spec = dataclasses.replace(previous, chains=())  # same kind and sizes: tying candidates
        else:
            spec = draw(_layer(index, width, max_width, residual))
        tensor_chains = []
        for tensor in spec.tensors(storage):
            if tensor_chains and tensor_chains[0][1][:1] == (Step("int8_weight_only"),):
                break  # torchao's unwrap needs the module otherwise unparametrized
            chain = draw(chains(tensor, names=allowed, min_length=0))
            if chain:
                tensor_chains.append((tensor.name, chain))
        layers.append(dataclasses.replace(spec, chains=tuple(tensor_chains)))
        width = spec.width_out

    tie = None
    if tying:
        int8 = Step("int8_weight_only")
        plain = [i for i, layer in enumerate(layers) if all(int8 not in c for _, c in layer.chains)]
        pairs = [
            (i, j, name)
            for i in plain
            for j in plain
            if i < j and layers[i].kind == layers[j].kind and layers[i].tensors(storage) == layers[j].tensors(storage)
            for name, _ in layers[i].chains
        ]
        if pairs and draw(st.sampled_from([True, True, True, False])):
            i, j, name = draw(st.sampled_from(pairs))
            shared = dict(layers[j].chains) | {name: dict(layers[i].chains)[name]}
            layers[j] = dataclasses.replace(layers[j], chains=tuple(shared.items()))
            tie = (i, j, name)

    repeat = None
    if repeats:
        candidates = [
            i
            for i, layer in enumerate(layers)
            if layer.width_in == layer.width_out
            and layer.kind != "embedding"
        ]
        if candidates and draw(st.integers(0, 3)) == 0:
            repeat = draw(st.sampled_from(candidates))

    skipped = None
    if unused and count > 1:
        candidates = [
            i
            for i, layer in enumerate(layers)
            if layer.width_in == layer.width_out and layer.kind != "embedding" and i != repeat
            and (tie is None or i not in tie[:2])
        ]
        if candidates and draw(st.integers(0, 3)) == 0:
            skipped = draw(st.sampled_from(candidates))

    return NetSpec(
        layers=tuple(layers),
        dtype=dtype,
        residual=residual and count > 1,
        repeat=repeat,
        tie=tie,
        requires_grad=draw(st.sampled_from(list(requires_grad))),
        training=is_training,
        seed=draw(st.integers(0, 2**16)),
        unused=skipped,
    )


def _parametrizes(spec: NetSpec) -> bool:
    """Whether a model drawn holds a parametrization (a chain, or the seed's cast on every tensor)."""
    return spec.dtype == "cast" or any(dict(layer.chains) for layer in spec.layers)


def _can_parametrize(names: Sequence[str] | None, dtype: str) -> bool:
    """Whether :func:`models` can put a chain on some tensor of some layer kind in ``dtype``
    (``"cast"`` always parametrizes: the seed's cast goes on every floating tensor)."""
    if dtype == "cast":
        return True
    storage = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    recipes = _available([n for n in (names if names is not None else PARAMETRIZATIONS) if n != "cast"])
    layers = [LayerSpec(kind, 3, 4, {"conv1d": (3,), "conv2d": (3, 3)}.get(kind, ()))
              for kind in (*_LAYER_KINDS, "embedding")]
    return any(r.supports(t) for r in recipes for layer in layers for t in layer.tensors(storage))


class Case(NamedTuple):
    """What :func:`cases` draws: ``factory()`` builds a fresh identical model every call."""

    factory: Callable[[], nn.Module]
    inputs: tuple[torch.Tensor, ...]
    flags: dict[str, Any]


@st.composite
def cases(draw: st.DrawFn, **model_options: Any) -> Case:
    """Hypothesis strategy: ``(model_factory, inputs, flags)`` for a random parametrized model.

    ``flags`` holds ``spec`` (the :class:`NetSpec`), ``training``, ``requires_grad``,
    ``dtype``, ``tied``, ``repeated``, ``unused``, ``grad_enabled`` (whether to run the case with grad
    mode on; see :func:`grad_mode`) and ``input_requires_grad`` (float inputs then require
    grad, so even frozen models run backward). Keyword options go to :func:`models`.

    Example::

        >>> from hypothesis import given, settings
        >>> from paramfold.testing import assert_equivalent, cases, grad_mode
        >>> @settings(max_examples=5, deadline=None)
        ... @given(cases(max_layers=2))
        ... def check(case):
        ...     factory, inputs, flags = case
        ...     with grad_mode(flags):
        ...         assert_equivalent(factory(), inputs, "hoist")
        >>> check()
    """
    names = model_options.get("names")
    dtypes = model_options.get("dtypes", _DTYPES)
    if names is not None and not [n for n in names if n != "cast"] and "cast" not in dtypes:
        raise InvalidArgument(
            f"cases(names={list(names)!r}, dtypes={list(dtypes)!r}) can draw no parametrization: the seed's "
            "bfloat16 cast is drawn through dtypes=['cast'], not names; add 'cast' to dtypes or other names"
        )
    if not any(_can_parametrize(names, dtype) for dtype in dtypes):
        raise InvalidArgument(
            f"cases(names={None if names is None else list(names)!r}, dtypes={list(dtypes)!r}) can draw no "
            "parametrized model: no parametrization named supports any tensor of the models' layers stored in "
            f"{' or '.join(map(str, dtypes)) or 'no dtype'} (see each entry's supports in PARAMETRIZATIONS, and "
            "whether it is available here); add dtypes (float32, or 'cast') or names"
        )
    # A model without any parametrization would check nothing paramfold does. Where the names
    # allow few layers (int8_weight_only: Linear weights only), most models drawn have none:
    # drawn again a few times here, rather than filtered by Hypothesis (its filter_too_much check).
    for _ in range(10):
        spec = draw(models(**model_options))
        if _parametrizes(spec):
            break
    assume(_parametrizes(spec))
    flags = {
        "spec": spec,
        "training": spec.training,
        "requires_grad": spec.requires_grad,
        "dtype": spec.dtype,
        "tied": spec.tie is not None,
        "repeated": spec.repeat is not None,
        "unused": spec.unused is not None,
        "grad_enabled": draw(st.sampled_from([True, True, True, False])),
        "input_requires_grad": draw(st.sampled_from([False, False, False, True])),
    }
    inputs = spec.inputs()
    if flags["input_requires_grad"]:
        inputs = tuple(x.requires_grad_() if x.is_floating_point() else x for x in inputs)
    return Case(spec.build, inputs, flags)
