"""paramfold.testing itself: only its strategies need Hypothesis, its modules are layered, its
registry's options and availability, and what chains() draws."""

from __future__ import annotations

import ast
import copy
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

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


def _available_or_skip(name: str) -> pt.Recipe:
    """The recipe, or a skip that says why the strategies leave it out (rather than silence)."""
    recipe = pt.PARAMETRIZATIONS[name]
    if not recipe.available:
        pytest.skip(
            f"recipe {name!r} needs {recipe.requires}, which is missing or does not import here: "
            "chains(), models() and cases() leave it out"
        )
    return recipe


@pytest.mark.parametrize("name", sorted(pt.PARAMETRIZATIONS))
def test_every_option_of_every_recipe_registers_on_the_tensors_it_supports(name):
    recipe = _available_or_skip(name)
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


@pytest.mark.parametrize("name", sorted(pt.PARAMETRIZATIONS))
def test_chains_draw_every_available_recipe(name):
    _available_or_skip(name)
    chain = hypothesis.find(pt.chains(pt.TensorSpec((4, 4))), lambda chain: name in [s.name for s in chain])
    assert name in [s.name for s in chain]


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


SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "paramfold" / "testing"

# Hypothesis hidden as if not installed: the checker, the registry and the models work; the
# strategies say what to install, whichever way they are reached.
_WITHOUT_HYPOTHESIS = textwrap.dedent(
    """
    import sys
    sys.modules["hypothesis"] = None
    import torch
    import paramfold
    import paramfold.testing as pt
    from torch.nn.utils.parametrizations import weight_norm

    model = torch.nn.Sequential(weight_norm(torch.nn.Linear(4, 4)), torch.nn.Tanh())
    pt.assert_equivalent(model, torch.randn(2, 4), "hoist", steps=2)
    before = pt.structure(model)
    paramfold.restore(paramfold.prepare(model, "auto"))
    pt.assert_same_structure(before, pt.structure(model))
    layer = pt.LayerSpec("linear", 4, 4, chains=(("weight", (pt.Step("spectral_norm"), pt.Step("scale"))),))
    spec = pt.NetSpec((layer, layer), dtype="cast")
    with pt.grad_mode({"grad_enabled": True}):
        pt.assert_equivalent(spec.build(), spec.inputs(), "hoist", steps=2)
    print("options", pt.PARAMETRIZATIONS["spectral_norm"].options(pt.TensorSpec((2, 2)))[0])
    for name in ("cases", "chains", "models", "Case"):
        try:
            getattr(pt, name)
        except ImportError as e:
            print(name, e)
    try:
        from paramfold.testing import cases
    except ImportError as e:
        print("from-import", e)
    print("loaded", sorted(m for m in sys.modules if m.startswith("hypothesis") and sys.modules[m]))
    """
)


def test_the_checker_and_registry_work_without_hypothesis_and_strategies_say_what_to_install():
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    run = [sys.executable, "-c", _WITHOUT_HYPOTHESIS]
    proc = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    message = (
        "paramfold.testing's strategies (chains, models, cases) need hypothesis: "
        'pip install "paramfold[testing]"'
    )
    assert proc.stdout.splitlines() == [
        "options {'dim': 0, 'n_power_iterations': 1}",
        *(f"{name} {message}" for name in ("cases", "chains", "models", "Case")),
        f"from-import {message}",
        "loaded []",
    ]


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (lazy imports count), relative ones resolved."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(["paramfold", "testing", *filter(None, [base])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_only_the_strategies_import_hypothesis_and_the_modules_are_layered():
    modules = {path.stem: _imports(path) for path in PACKAGE.glob("*.py")}
    assert set(modules) == {"__init__", "registry", "nets", "compare", "structure", "walks", "generators",
                            "between_steps", "resummed", "left_as_stock", "check", "strategies"}
    uses_hypothesis = {m for m, names in modules.items() if any(n.split(".")[0] == "hypothesis" for n in names)}
    assert uses_hypothesis == {"strategies"}
    siblings = {
        m: {n.split(".")[2] for n in names if n.startswith("paramfold.testing.") and n.split(".")[2] in modules}
        for m, names in modules.items()
        if m != "__init__"
    }
    assert not any("paramfold.testing" in names for m, names in modules.items() if m != "__init__"), (
        "a submodule that imports the package imports every other submodule"
    )
    # No cycles: each module imports only modules listed before it.
    order = ["registry", "compare", "structure", "walks", "generators", "between_steps", "resummed", "left_as_stock",
             "check", "nets", "strategies"]
    for module, deps in siblings.items():
        assert deps <= set(order[: order.index(module)]), (module, deps)
    init = PACKAGE / "__init__.py"
    eager = {node.module for node in ast.parse(init.read_text()).body if isinstance(node, ast.ImportFrom)}
    assert "paramfold.testing.strategies" not in eager, "the package imports the strategies on first use only"


def test_model_spec_is_a_deprecated_alias_of_net_spec():
    with pytest.warns(DeprecationWarning, match="ModelSpec is deprecated: use paramfold.testing.NetSpec") as record:
        assert pt.ModelSpec is pt.NetSpec
    assert record[0].filename == __file__  # the warning points at the caller
    with pytest.warns(DeprecationWarning, match="NetSpec"):
        from paramfold.testing import ModelSpec
    assert ModelSpec is pt.NetSpec
    assert "ModelSpec" not in pt.__all__ and not hasattr(importlib.import_module("paramfold.testing.nets"), "ModelSpec")


def _tied_pair() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.Linear(3, 3)
    parametrize.register_parametrization(layer, "weight", pt.HalfSum())
    return nn.Sequential(layer, nn.Tanh(), layer)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: m[0].bias.data.add_(1), r"state_dict '0\.bias'"),
        (lambda m: m[0].register_parameter("bias", nn.Parameter(m[0].bias.detach().clone())), "parameters changed"),
        (lambda m: m[0].bias.requires_grad_(False), "parameters changed"),
        (lambda m: m[0].register_buffer("extra", torch.zeros(1)), "'0': buffers changed"),
        (lambda m: m[0].__dict__.update(note=1), r"__dict__ keys changed: added \['note'\]"),
        (lambda m: m.__setattr__("__class__", type("Other", (nn.Sequential,), {})), "<root>'?: class changed"),
        (
            lambda m: m[0].parametrizations.weight.__setattr__("original1", nn.Parameter(torch.zeros(3, 3))),
            r"'0\.parametrizations\.weight': parameters changed",
        ),
        (lambda m: m[1].eval(), r"'1': attribute 'training' changed: True -> False"),
        (lambda m: m[0].register_forward_hook(lambda *a: None), r"'0': hooks changed: _forward_hooks: added \[\d+: "),
        (lambda m: m[0].register_state_dict_pre_hook(lambda *a: None), r"'0': hooks changed: _state_dict_pre_hooks"),
        (lambda m: setattr(m[0], "in_features", 4), r"'0': attribute 'in_features' changed: 3 -> 4"),
        (lambda m: setattr(m[0], "note", None), r"__dict__ keys changed: added \['note'\]"),
    ],
    ids=["value", "parameter object", "requires_grad", "buffer", "dict key", "class", "original of a chain",
         "training flag", "forward hook", "state_dict hook", "attribute value", "attribute added"],
)
def test_structure_snapshots_catch_what_restore_must_give_back(change, message):
    model = _tied_pair()
    before = pt.structure(model)
    pt.assert_same_structure(before, pt.structure(model))
    change(model)
    with pytest.raises(AssertionError, match=message):
        pt.assert_same_structure(before, pt.structure(model))


def test_structure_snapshots_see_a_training_flag_a_hook_and_a_dropout_probability():
    # structure() recorded objects and __dict__ keys only: none of these failed the comparison.
    from torch.nn.utils.parametrizations import weight_norm

    for change in (lambda m: m[1].eval(), lambda m: m[0].register_forward_hook(lambda *a: None),
                   lambda m: setattr(m[1], "p", 0.9), lambda m: m[0]._forward_hooks.clear()):
        model = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Dropout(0.5))
        model[0].register_forward_hook(lambda *a: None)
        for values in (True, False):
            before = pt.structure(model, values=values)
            pt.assert_same_structure(before, pt.structure(model, values=values))
        change(model)
        with pytest.raises(AssertionError, match="attribute 'training'|attribute 'p'|hooks changed"):
            pt.assert_same_structure(before, pt.structure(model, values=False))


def test_structure_without_values_ignores_values_and_the_mark_torch_compile_leaves():
    model = _tied_pair()
    before = pt.structure(model, values=False)
    with torch.no_grad():
        model[0].bias.add_(1)
    torch.compile(model)  # marks the module it wraps (_is_torch_compile), not paramfold's business
    pt.assert_same_structure(before, pt.structure(model, values=False))
    assert before.state is None


@pytest.mark.parametrize(
    "names, min_length, max_length",
    [(["cast"], 1, 3), (["weight_norm", "spectral_norm"], 2, 3), (None, 3, 3), (["int8_weight_only"], 0, 3),
     (["weight_norm", "spectral_norm", "cast"], 3, 3)],
)
def test_chains_draws_only_chains_of_the_lengths_asked(names, min_length, max_length):
    # chains() drew shorter chains when its pool ran dry or a recipe had to be alone (an empty
    # chain for names=["cast"], int8_weight_only alone whatever min_length).
    strategy = pt.chains(pt.TensorSpec((4, 4), module_type=nn.Linear, name="weight"), names=names,
                         min_length=min_length, max_length=max_length)
    with pytest.raises(hypothesis.errors.NoSuchExample):
        hypothesis.find(strategy, lambda chain: not min_length <= len(chain) <= max_length,
                        settings=hypothesis.settings(max_examples=300, database=None))


@hypothesis.settings(max_examples=150, deadline=None, database=None)
@hypothesis.given(st.data())
def test_chains_of_any_names_and_lengths_are_valid_chains_of_those_lengths_or_refused_when_built(data):
    names = data.draw(st.lists(st.sampled_from(sorted(pt.PARAMETRIZATIONS)), min_size=1, unique=True))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    low, high = data.draw(st.integers(0, 6)), data.draw(st.integers(0, 6))
    tensor = pt.TensorSpec((4, 4), dtype, nn.Linear, "weight")
    try:
        strategy = pt.chains(tensor, names=names, min_length=low, max_length=high)
    except hypothesis.errors.InvalidArgument as e:
        assert f"chains(min_length={low}, max_length={high})" in str(e)
        return
    chain = data.draw(strategy)
    assert low <= len(chain) <= high
    layer = pt.apply_chain(nn.Linear(4, 4).to(dtype), "weight", chain)
    assert len(chain) == 0 or len(layer.parametrizations.weight) == len(chain) or chain[0].name == "int8_weight_only"


def test_chains_refuses_lengths_its_recipes_cannot_reach_when_the_strategy_is_built():
    tensor = pt.TensorSpec((4, 4))
    refused = r"weight_norm, orthogonal.* chain at most 1, so pass min_length <= 1"
    with pytest.raises(hypothesis.errors.InvalidArgument, match=refused):
        pt.chains(tensor, names=["weight_norm", "orthogonal"], min_length=2)
    with pytest.raises(hypothesis.errors.InvalidArgument, match="need 0 <= min_length <= max_length"):
        pt.chains(tensor, min_length=3, max_length=2)


@hypothesis.settings(max_examples=100, deadline=None, database=None)
@hypothesis.given(pt.models())
def test_a_printed_net_spec_pastes_back_into_the_same_spec(spec):
    # Steps printed as weight_norm(dim=0), which is no expression that rebuilds them.
    from paramfold.testing import LayerSpec, NetSpec, Step  # what nets.py says a pasted spec needs

    pasted = eval(repr(spec), {"LayerSpec": LayerSpec, "NetSpec": NetSpec, "Step": Step})
    assert pasted == spec and repr(pasted) == repr(spec)


@pytest.mark.skipif(not pt.PARAMETRIZATIONS["int8_weight_only"].available, reason="torchao is not importable here")
@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(pt.cases(names=["int8_weight_only"], dtypes=["float32"]))
def test_cases_of_a_recipe_few_layers_support_are_drawn_without_failing_hypothesis_health_checks(case):
    # Regression: models drawn without any chain were filtered by assume(), and with
    # int8_weight_only (Linear weights only) most were: FailedHealthCheck (filter_too_much).
    factory, inputs, flags = case
    assert any(dict(layer.chains) for layer in flags["spec"].layers)


def test_cases_that_can_draw_no_parametrization_are_refused_saying_how_to_draw_the_cast():
    # Regression: names=["cast"] drew no chain (the cast comes through dtypes): every example was
    # filtered and Hypothesis failed its health check, naming nothing.
    @hypothesis.settings(max_examples=3, deadline=None)
    @hypothesis.given(pt.cases(names=["cast"], dtypes=["float32"]))
    def check(case):
        pass

    with pytest.raises(hypothesis.errors.InvalidArgument, match=r"dtypes=\['cast'\]"):
        check()


@pytest.mark.parametrize("names, dtypes", [(["orthogonal"], ["bfloat16"]), (["orthogonal", "cast"], ["bfloat16"])])
def test_cases_whose_names_support_none_of_the_dtypes_are_refused_up_front(names, dtypes):
    # Regression: every draw was rejected by assume(): Hypothesis' FailedHealthCheck or
    # Unsatisfiable, naming nothing.
    @hypothesis.settings(max_examples=3, deadline=None, database=None)
    @hypothesis.given(pt.cases(names=names, dtypes=dtypes))
    def check(case):
        pass

    with pytest.raises(hypothesis.errors.InvalidArgument, match=r"can draw no parametrized model: .* bfloat16"):
        check()
