"""paramfold.testing itself: its registry's options and availability, and what chains() draws."""

from __future__ import annotations

import copy

import hypothesis
import pytest
import torch
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parametrize

import paramfold.testing as pt


def _tensors() -> list[tuple[pt.TensorSpec, nn.Module]]:
    """One module per kind of tensor the strategies parametrize, with the spec of that tensor."""
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        rows = [
            (nn.Linear(4, 3), "weight"),
            (nn.Linear(4, 3), "bias"),
            (nn.Conv2d(2, 3, (3, 1)), "weight"),
            (nn.Embedding(5, 4), "weight"),
            (pt.BufferMix(4), "mix"),
        ]
        for module, name in rows:
            module = module.to(dtype)
            tensor = getattr(module, name)
            spec = pt.TensorSpec(tuple(tensor.shape), dtype, type(module), name, name in module._buffers)
            out.append((spec, module))
    return out


@pytest.mark.parametrize("name", sorted(pt.PARAMETRIZATIONS))
def test_every_option_of_every_recipe_registers_on_the_tensors_it_supports(name):
    recipe = pt.PARAMETRIZATIONS[name]
    if not recipe.available:
        pytest.skip(
            f"recipe {name!r} needs {recipe.requires}, which is missing or does not import here: "
            "chains(), models() and cases() leave it out"
        )
    tried = 0
    for spec, module in _tensors():
        if not recipe.supports(spec):
            continue
        for options in recipe.options(spec):  # plain data: enumerable without Hypothesis
            layer = pt.apply_chain(copy.deepcopy(module), spec.name, [pt.Step(name, tuple(sorted(options.items())))])
            assert parametrize.is_parametrized(layer, spec.name), (spec, options)
            with torch.no_grad():
                assert tuple(getattr(layer, spec.name).shape) == spec.shape, (spec, options)
            tried += 1
    assert tried >= 2, f"{name} supports almost none of the tensors the strategies draw"


@pytest.mark.parametrize(
    "options",
    [lambda spec: [{"factor": 2}, {"factor": 3}], lambda spec: st.sampled_from([{"factor": 2}, {"factor": 3}])],
    ids=["data", "strategy"],
)
def test_chains_draws_a_recipes_options_from_data_or_from_its_own_strategy(monkeypatch, options):
    recipe = pt.Recipe("doubled", lambda module, name, factor: None, lambda spec: True, options)
    monkeypatch.setitem(pt.PARAMETRIZATIONS, "doubled", recipe)
    strategy = pt.chains(pt.TensorSpec((2, 2)), names=["doubled"], max_length=1)
    for factor in (2, 3):
        found = hypothesis.find(strategy, lambda chain, f=factor: chain == (pt.Step("doubled", (("factor", f),)),))
        assert found == (pt.Step("doubled", (("factor", factor),)),)
    with pytest.raises(hypothesis.errors.NoSuchExample):
        hypothesis.find(strategy, lambda chain: dict(chain[0].options)["factor"] not in (2, 3))
