"""paramfold.testing.assert_equivalent used the way users call it on their own models.

Why this file exists: ``assert_equivalent`` is the check users put in their own suites, on models
this project never built: forwards that return dataclasses, tuples with ``None``, strings and
numbers beside tensors, complex tensors; forwards that take keyword arguments, flags, token ids,
or write into their inputs; models on the meta device. Its promise is to pass exactly when the
prepared model behaves like stock, to say what differs when it does not, and to leave the
caller's model, inputs and global state (random stream, grad mode, default dtype) as they were.
The models whose forward behaves differently once prepared (``_Marked``: it looks for
paramfold's state on itself) stand for a real difference the checker must not let pass.
"""

from __future__ import annotations

import collections
import dataclasses
import sys

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import paramfold
import paramfold.testing as pt
import paramfold.testing.compare as pt_compare
from paramfold.testing.compare import BITWISE, compare_outputs

MODES = ("hoist", "inline", "auto")


@dataclasses.dataclass
class _Out:
    y: torch.Tensor
    extra: torch.Tensor | None = None


_Pair = collections.namedtuple("_Pair", "y total")


class _Marked(nn.Module):
    """A weight-normed Linear whose forward returns ``kind`` of output; where ``differ`` names it,
    the prepared copy's output differs from stock's in that one respect."""

    def __init__(self, kind: str, differ: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.lin = weight_norm(nn.Linear(4, 4))
        self.kind, self.differ = kind, differ

    def forward(self, x):
        changed = self.differ and paramfold.state.STATE_ATTR in self.__dict__
        y = self.lin(x)
        kind = self.kind
        if kind == "dataclass":
            return _Out(y + (1e-3 if changed else 0.0))
        if kind == "none_position":
            return (y, None) if changed else (None, y)
        if kind == "int":
            return y, (1 if changed else 0)
        if kind == "float":
            return y, float(y.sum()) + (1e-3 if changed else 0.0)
        if kind == "str":
            return y, ("prepared" if changed else "stock")
        if kind == "dict_keys":
            return {("a" if changed else "b"): y}
        if kind == "container":
            return (y,) if changed else [y]
        if kind == "namedtuple":
            return _Pair(y, y.sum() + (1e-3 if changed else 0.0))
        if kind == "complex_grad":
            # equal values, different gradient: only a backward through the complex output shows it
            return torch.complex(y, y.detach() if changed else y)
        raise ValueError(kind)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "kind", ["dataclass", "none_position", "int", "float", "str", "dict_keys", "container", "namedtuple", "complex_grad"]
)
def test_a_difference_in_a_structured_output_fails_naming_it(kind, mode):
    pt.assert_equivalent(_Marked(kind), torch.randn(2, 4), mode, steps=2)  # the same model, unchanged: passes
    with pytest.raises(AssertionError, match=r"output|grad of 'lin\."):
        pt.assert_equivalent(_Marked(kind, differ=True), torch.randn(2, 4), mode, steps=2)


class _WritesItsInput(nn.Module):
    """Scales its input in place before using it, as some preprocessing does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = weight_norm(nn.Linear(4, 4))

    def forward(self, x, scale: float = 2.0):
        x.mul_(scale)
        return self.lin(x)


@pytest.mark.parametrize("mode", MODES)
def test_a_forward_that_writes_its_input_in_place_is_checked_on_the_callers_inputs_and_leaves_them(mode):
    x = torch.randn(2, 4)
    before = x.clone()
    pt.assert_equivalent(_WritesItsInput(), (x, 3.0), mode, steps=2)
    assert torch.equal(x, before)  # each copy ran on a copy of the caller's inputs


def test_a_forward_that_writes_its_input_differently_when_prepared_fails_naming_the_input():
    class Differs(_WritesItsInput):
        def forward(self, x, scale: float = 2.0):
            x.mul_(scale + (1.0 if paramfold.state.STATE_ATTR in self.__dict__ else 0.0))
            return self.lin(x.detach() / x.detach())

    with pytest.raises(AssertionError, match=r"input 0 after the call at step 1 differs from stock"):
        pt.assert_equivalent(Differs(), torch.randn(2, 4), "hoist", steps=2)


class _KeywordOnly(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = weight_norm(nn.Embedding(10, 4))
        self.lin = spectral_norm(nn.Linear(4, 3))

    def forward(self, *, input_ids, attention_mask=None, return_dict: bool = True):
        h = self.lin(self.emb(input_ids))
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        return {"logits": h} if return_dict else (h,)


@pytest.mark.parametrize("mode", MODES)
def test_keyword_arguments_reach_the_forward_as_keywords(mode):
    ids, mask = torch.tensor([[1, 2, 3], [4, 5, 9]]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    pt.assert_equivalent(_KeywordOnly(), {"input_ids": ids, "attention_mask": mask}, mode, steps=2)
    pt.assert_equivalent(_KeywordOnly(), (), mode, steps=2, kwargs={"input_ids": ids, "return_dict": False})


def test_a_meta_device_model_is_refused_with_what_to_do():
    model = _Marked("dataclass", differ=True).to("meta")
    with pytest.raises(ValueError, match=r"meta device.*to_empty"):
        pt.assert_equivalent(model, torch.randn(2, 4, device="meta"), "hoist")


class _Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = spectral_norm(nn.Linear(4, 4))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x)) + 0.1 * torch.randn_like(x)


@pytest.mark.parametrize("mode", MODES)
def test_the_callers_random_stream_and_global_modes_are_left_as_they_were_pass_or_fail(mode):
    noisy, differs, x = _Noisy(), _Marked("dataclass", differ=True), torch.randn(2, 4)
    torch.manual_seed(1)
    state = torch.get_rng_state()
    dtype, deterministic = torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled()
    pt.assert_equivalent(noisy, x, mode, steps=2)
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(AssertionError, match="output"):
        pt.assert_equivalent(differs, x, mode)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.is_grad_enabled() and torch.get_default_dtype() is dtype
    assert torch.are_deterministic_algorithms_enabled() is deterministic


def _gru() -> nn.Module:
    torch.manual_seed(0)
    gru = nn.GRU(3, 4)
    spectral_norm(gru, "weight_hh_l0")
    return gru


def _frozen_batchnorm() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.BatchNorm1d(4))
    model[1].eval().requires_grad_(False)
    return model


class _Counting(nn.Module):
    """Integer and bool buffers beside a parametrized weight; returns numbers and strings too."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = spectral_norm(nn.Linear(4, 4))
        self.register_buffer("calls", torch.tensor(0))
        self.register_buffer("mask", torch.tensor([True, False, True, True]))

    def forward(self, x, flag: bool, tag: str):
        self.calls += 1
        y = self.lin(x) * self.mask
        return {"y": y if flag else -y, "n": int(self.calls), "tag": tag, "none": None, "all": [y.sum(), y.mean()]}


_LEGIT = {
    "embedding": (lambda: nn.Sequential(weight_norm(nn.Embedding(10, 4)), nn.Linear(4, 2)),
                  lambda: (torch.tensor([[1, 2, 3]]),)),
    "conv2d": (lambda: nn.Sequential(spectral_norm(nn.Conv2d(2, 3, 3)), nn.ReLU()), lambda: (torch.randn(1, 2, 5, 5),)),
    "conv_transpose1d": (lambda: weight_norm(nn.ConvTranspose1d(2, 3, 3)), lambda: (torch.randn(1, 2, 5),)),
    "dropout": (lambda: nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Dropout(0.5)), lambda: (torch.randn(3, 4),)),
    "float64": (lambda: weight_norm(nn.Linear(4, 4)).double(), lambda: (torch.randn(3, 4, dtype=torch.float64),)),
    "bfloat16": (lambda: weight_norm(nn.Linear(4, 4)).bfloat16(), lambda: (torch.randn(3, 4, dtype=torch.bfloat16),)),
    "frozen_batchnorm": (_frozen_batchnorm, lambda: (torch.randn(3, 4),)),
    "buffers_numbers_strings": (_Counting, lambda: (torch.randn(3, 4), False, "tag")),
    "input_requires_grad": (lambda: weight_norm(nn.Linear(4, 4)), lambda: [torch.randn(3, 4, requires_grad=True)]),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(_LEGIT))
def test_unusual_but_legitimate_models_pass_and_are_left_untouched(name, mode):
    build, inputs = _LEGIT[name]
    torch.manual_seed(0)
    model, args = build(), inputs()
    model.train()
    before = pt.structure(model)
    flags = [(m.training, [p.requires_grad for p in m.parameters(recurse=False)]) for m in model.modules()]
    for _ in range(2):  # twice in a row on the same model and inputs
        pt.assert_equivalent(model, args, mode, steps=2)
    pt.assert_same_structure(before, pt.structure(model))
    assert flags == [(m.training, [p.requires_grad for p in m.parameters(recurse=False)]) for m in model.modules()]


@pytest.mark.parametrize("mode", ["inline", "auto", "hoist"])
def test_spectral_norm_on_a_gru_hidden_weight(mode):
    # The GRU is the prepared root and the holder; it reads the weight several times per forward
    # (hoist refused it until 2026-12-03; the read-once class serves it now).
    pt.assert_equivalent(_gru(), torch.randn(5, 1, 3), mode, steps=2)


def test_a_model_without_trainable_parameters_passes_in_every_mode_freeze_included():
    torch.manual_seed(0)
    model = nn.Sequential(spectral_norm(nn.Linear(4, 4)), nn.Tanh()).requires_grad_(False).eval()
    for mode in (*MODES, "freeze"):
        pt.assert_equivalent(model, torch.randn(3, 4), mode, steps=2)


def _with_hooks_and_state() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(4, 4)), spectral_norm(nn.Linear(4, 4)), nn.BatchNorm1d(4))
    model[0].register_forward_hook(lambda module, args, out: None)  # the user's hook
    model.register_buffer("scratch", torch.ones(2), persistent=False)
    return model


_SLOPPY_RESTORES = {
    "extra hook left": (lambda m: m[0].register_forward_hook(lambda module, args, out: None),
                        r"module '0': hooks changed: _forward_hooks: added \[\d+: "),
    "user's hook dropped": (lambda m: m[0]._forward_hooks.clear(),
                            r"module '0': hooks changed: _forward_hooks: added \[\], removed \[\d+: "),
    "running_mean moved": (lambda m: m[2].running_mean.add_(1), r"buffer '2\.running_mean' differs from stock"),
    "non-persistent buffer": (lambda m: m.scratch.mul_(2), r"buffer 'scratch' differs from stock"),
    "chain member's setting": (
        lambda m: setattr(m[1].parametrizations.weight[0], "n_power_iterations", 5),
        r"module '1\.parametrizations\.weight\.0': attribute 'n_power_iterations' changed: 1 -> 5",
    ),
    "training flag": (lambda m: m[2].eval(), r"module '2': attribute 'training' changed: True -> False"),
    "gradient dropped": (lambda m: setattr(m[2].weight, "grad", None), r"grad of '2\.weight': prepared has None"),
    "gradient changed": (lambda m: m[2].weight.grad.mul_(2),
                         r"grad of '2\.weight' \(against the prepared model's before restore\) differs"),
    "copy-on-write left": (lambda m: _LAZY_CLONES.append(torch._lazy_clone(m[2].weight)),
                           r"parameter '2\.weight': copy-on-write after restore, stock's is not"),
}
#: Keeps the lazy clones a sloppy restore makes alive (the original stays copy-on-write while one is).
_LAZY_CLONES: list[torch.Tensor] = []


@pytest.mark.parametrize("sloppy", list(_SLOPPY_RESTORES))
def test_a_restore_that_leaves_hooks_values_or_attributes_otherwise_fails_naming_them(monkeypatch, sloppy):
    # The after-restore check compared objects and __dict__ keys only: each of these passed.
    change, message = _SLOPPY_RESTORES[sloppy]
    restore = paramfold.restore

    def sloppy_restore(model, *args, **kwargs):
        out = restore(model, *args, **kwargs)
        change(model)
        return out

    pt.assert_equivalent(_with_hooks_and_state(), torch.randn(5, 4), "hoist", steps=2)
    monkeypatch.setattr(paramfold, "restore", sloppy_restore)
    try:
        with pytest.raises(AssertionError, match="after paramfold.restore: " + message):
            pt.assert_equivalent(_with_hooks_and_state(), torch.randn(5, 4), "hoist", steps=2)
    finally:
        _LAZY_CLONES.clear()


class _HooksItselfOnFirstCall(nn.Module):
    """Registers a forward hook on a submodule at its first call and counts its calls, as
    transformers' output-capturing models register theirs (``_output_capturing_hooks_installed``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = spectral_norm(nn.Linear(4, 4))
        self.calls = 0
        self.seen = []

    def forward(self, x):
        if not self.calls:
            self.lin.register_forward_hook(lambda module, args, out: self.seen.append(out.shape))
        self.calls += 1
        return self.lin(x)


@pytest.mark.parametrize("mode", [*MODES, "freeze"])
def test_hooks_and_attribute_values_stock_sets_in_its_forward_are_expected_on_the_restored_copy(mode):
    model = _HooksItselfOnFirstCall()
    if mode == "freeze":
        model.eval().requires_grad_(False)
    pt.assert_equivalent(model, torch.randn(2, 4), mode, steps=2)
    assert model.calls == 0 and not model.lin._forward_hooks  # the caller's model was not run


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_check_does_not_hide_a_real_difference_in_a_structured_output_nor_change_dynamo_config():
    config = torch._dynamo.config.get_config_copy()
    with pytest.raises(AssertionError, match=r"output\.y"):
        pt.assert_equivalent(_Marked("dataclass", differ=True), torch.randn(2, 4), "hoist",
                             compile={"backend": "aot_eager"})
    assert torch._dynamo.config.get_config_copy() == config


def test_hypothesis_cases_run_through_the_checker_in_a_users_suite():
    hypothesis = pytest.importorskip("hypothesis")

    @hypothesis.settings(max_examples=4, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(pt.cases())
    def check(case):
        factory, inputs, flags = case
        with pt.grad_mode(flags):
            try:
                pt.assert_equivalent(factory(), inputs, "hoist", steps=2)
            except paramfold.FoldError:
                pass  # a documented refusal, raised before anything changed

    check()


class _PlainBox:
    def __init__(self, y):
        self.y = y


class _Slotted:
    __slots__ = ("y",)

    def __init__(self, y):
        self.y = y


_WRAPS = {"namespace": lambda y: __import__("types").SimpleNamespace(y=y), "plain": _PlainBox, "slots": _Slotted}


class _WrapsIn(_Marked):
    """Returns its output inside a plain object (not a container nor a dataclass)."""

    def __init__(self, wrap: str, differ: bool = False):
        super().__init__("dataclass", differ)
        self.wrap = wrap

    def forward(self, x):
        return _WRAPS[self.wrap](super().forward(x).y)


@pytest.mark.parametrize("wrap", list(_WRAPS))
def test_tensors_inside_a_plain_object_output_are_compared_by_its_attributes(wrap):
    pt.assert_equivalent(_WrapsIn(wrap), torch.randn(2, 4), "hoist", steps=2)
    with pytest.raises(AssertionError, match=r"output\.y at step 1 differs"):
        pt.assert_equivalent(_WrapsIn(wrap, differ=True), torch.randn(2, 4), "hoist", steps=2)


def test_a_plain_object_output_enters_the_backward():
    class GradOnly(_Marked):
        def forward(self, x):
            y = self.lin(x)
            changed = paramfold.state.STATE_ATTR in self.__dict__
            # equal values, another gradient: only the backward through the object's tensor shows it
            return _PlainBox(y * 2 - y.detach() if changed else y)

    with pytest.raises(AssertionError, match=r"grad of 'lin\."):
        pt.assert_equivalent(GradOnly("dataclass"), torch.randn(2, 4), "hoist")


def test_an_output_object_whose_contents_cannot_be_walked_is_refused():
    class Opaque(_Marked):
        def forward(self, x):
            return self.lin(x), torch.Generator()

    with pytest.raises(TypeError, match=r"cannot compare output\[1\]: a torch\._C\.Generator"):
        pt.assert_equivalent(Opaque("dataclass"), torch.randn(2, 4), "hoist")


def test_fewer_than_one_step_is_refused():
    for steps in (0, -1):
        with pytest.raises(ValueError, match=r"steps=.*pass steps=1 or more"):
            pt.assert_equivalent(_Marked("dataclass", differ=True), torch.randn(2, 4), "hoist", steps=steps)


def _hooked(*layers: nn.Module) -> list[nn.Module]:
    return [torch.nn.utils.weight_norm(layer) for layer in layers]


class _Branch(nn.Module):
    """Calls one of two hook-based weight_norm layers per call, in turn: the layer a call skips
    keeps, in stock, its last call's ``weight``; hoist computes it at each call (README)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = _hooked(nn.Linear(4, 4), nn.Linear(4, 4))
        self.register_buffer("n", torch.tensor(0))

    def forward(self, x):
        self.n += 1
        return self.a(x) if int(self.n) % 2 else self.b(x)


@pytest.mark.parametrize("trainable", [False, True])
@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_a_hook_based_norms_weight_attribute_is_compared_outside_forward(mode, trainable):
    model, x = _Branch().requires_grad_(trainable), torch.randn(3, 4)
    with torch.no_grad():
        model.a(x), model.b(x)
    if trainable:
        # Step 1 calls a only: stock's b.weight stays the no_grad value from before, the
        # prepared copy's is step 1's, which requires grad.
        reported = r"b\.weight \(hook-based weight_norm\) read outside forward before step 2: prepared requires grad, stock does not"
    else:
        # Step 2 calls b only: stock's a.weight stays step 1's, the prepared copy's is step 2's.
        reported = r"a\.weight \(hook-based weight_norm\) read outside forward after step 2 differs"
    with pytest.raises(AssertionError, match=reported):
        pt.assert_equivalent(model, x, mode, steps=2)
    pt.assert_equivalent(model, x, "inline", steps=3)


@pytest.mark.parametrize("mode", [*MODES, "freeze"])
def test_a_freshly_built_hook_based_norm_model_is_checked(mode):
    # The pre-hook leaves module.weight with a history, which torch's deepcopy refuses.
    torch.manual_seed(0)
    model = nn.Sequential(_hooked(nn.Linear(4, 4))[0], nn.Tanh(), torch.nn.utils.spectral_norm(nn.Linear(4, 2)))
    x = torch.randn(3, 4)
    if mode == "freeze":
        model.eval().requires_grad_(False)
    model(x)
    assert model[0].weight.grad_fn is not None or mode == "freeze"
    pt.assert_equivalent(model, x, mode, steps=2)
    pt.assert_equivalent(model, x, mode, steps=2, compile={"backend": "aot_eager"})


_SCHEDULE = [0]


class _Schedule(nn.Module):
    """Reads and advances a module-level counter: stock itself gives another output at each run."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = weight_norm(nn.Linear(4, 4))

    def forward(self, x):
        _SCHEDULE[0] += 1
        return self.lin(x) * _SCHEDULE[0]


@pytest.mark.parametrize("mode", MODES)
def test_a_model_that_stock_does_not_reproduce_is_reported_as_such(mode):
    with pytest.raises(AssertionError, match=r"not reproducible.*stock run twice"):
        pt.assert_equivalent(_Schedule(), torch.randn(2, 4), mode)


def test_inputs_holding_objects_it_cannot_walk_are_still_accepted():
    class TakesAGenerator(_Marked):
        def forward(self, x, generator=None, opts=None):
            return self.lin(x) + torch.rand(x.shape, generator=generator) * opts.scale

    options = __import__("types").SimpleNamespace(scale=0.5, token=object())
    pt.assert_equivalent(TakesAGenerator("dataclass"), (torch.randn(2, 4),), "hoist", steps=2,
                         kwargs={"generator": torch.Generator().manual_seed(1), "opts": options})


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("mode", ["hoist", "auto", "inline"])
def test_a_checkpointed_layer_is_checked_where_paramfold_is_exact(mode, reentrant):
    # The call counter counted the region's recomputation during backward as a second call, took
    # the originals for summed twice and ran a stock copy under parametrize.cached(), which a
    # non-reentrant checkpoint cannot run: a CheckpointError instead of a verdict.
    from torch.nn.utils.parametrizations import weight_norm
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = weight_norm(nn.Linear(4, 4))

        def forward(self, x):
            return checkpoint(self.layer, x, use_reentrant=reentrant)

    torch.manual_seed(0)
    pt.assert_equivalent(Checkpointed(), torch.randn(2, 4, requires_grad=reentrant), mode, steps=2)


class _DrawsFromPythonAndNumpy(nn.Module):
    """Masks drawn from Python's ``random`` and NumPy's global generator, as transformers'
    SpecAugment (``_compute_mask_indices``) draws its time masks from ``np.random``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = weight_norm(nn.Linear(8, 8))

    def forward(self, x):
        import random

        import numpy as np

        keep = torch.from_numpy((np.random.rand(8) > 0.3).astype("float32"))
        return self.lin(x) * keep * random.random()


@pytest.mark.parametrize("mode", MODES)
def test_a_model_drawing_from_python_and_numpy_random_is_checked_and_their_streams_left_alone(mode):
    # Only torch's generators were replayed: such a model was reported as not reproducible, and
    # the check moved the caller's Python and NumPy streams on.
    import random

    import numpy as np

    random.seed(3)
    np.random.seed(3)
    python_state, numpy_state = random.getstate(), np.random.get_state()
    pt.assert_equivalent(_DrawsFromPythonAndNumpy(), torch.randn(2, 8), mode, steps=2)
    assert random.getstate() == python_state
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), numpy_state))


def _prepared(module: nn.Module) -> bool:
    return paramfold.state.STATE_ATTR in module.__dict__


class _Returns(nn.Module):
    """A weight-normed Linear whose forward returns ``build(y, prepared)``: where the two differ,
    the prepared copy's output differs from stock's (a difference the checker must see)."""

    def __init__(self, build):
        super().__init__()
        torch.manual_seed(0)
        self.lin = weight_norm(nn.Linear(4, 4))
        self.build = build

    def forward(self, x):
        return self.build(self.lin(x), _prepared(self))


@pytest.mark.parametrize(
    "build",
    [
        lambda y, p: (y, None, y.detach() * 100 if p else None),
        lambda y, p: (y, 4, 5 if p else 4),
        lambda y, p: (y, True, not p),
        lambda y, p: (y, (), (1,) if p else ()),
        lambda y, p: (y, "a", "b" if p else "a"),
        lambda y, p: (y, nn.Tanh(), nn.ReLU() if p else nn.Tanh()),
    ],
    ids=["None", "small_int", "bool", "empty_tuple", "interned_str", "module"],
)
def test_a_difference_behind_a_value_stock_returns_twice_is_seen(build):
    # compare_tree skipped any object it had met before in stock's output (keyed on stock's id
    # alone): None, small ints, bools, () and interned strings at their second occurrence, and
    # it accepted anything where stock returned a module.
    pt.assert_equivalent(_Returns(lambda y, p: build(y, False)), torch.randn(2, 4), "hoist")
    with pytest.raises(AssertionError, match=r"output\[2\]: prepared"):
        pt.assert_equivalent(_Returns(build), torch.randn(2, 4), "hoist")
    t = torch.ones(1)
    compare_outputs((t, [t], [t]), (t, [t], [t]), "", BITWISE)  # a shared list is still fine
    with pytest.raises(AssertionError, match=r"output\[2\]"):
        compare_outputs((t, None, t), (t, None, None), "", BITWISE)


def test_a_prepared_forward_writing_into_an_input_slot_stock_leaves_none_is_seen():
    class WritesCache(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = weight_norm(nn.Linear(4, 4))

        def forward(self, x, cache):
            if _prepared(self):
                cache[2] = torch.ones(1)
            return self.lin(x)

    with pytest.raises(AssertionError, match=r"input 1 after the call\[2\]: prepared gives a tensor, stock None"):
        pt.assert_equivalent(WritesCache(), (torch.randn(2, 4), [torch.zeros(1), None, None]), "hoist")


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda y, p: (y, torch.zeros(3).neg() if p else torch.zeros(3)), r"output\[1\].*bitwise.*-0\.0, stock 0\.0"),
        (lambda y, p: (y, y.t().contiguous().t() if p else y), r"output\[1\].*strides \(1, 2\), stock \(4, 1\)"),
        (lambda y, p: (y, 1.0 if p else 1), r"output\[1\]: prepared gives 1\.0, stock 1"),
        (lambda y, p: (y, -0.0 if p else 0.0), r"output\[1\].*-0\.0, stock 0\.0"),
    ],
    ids=["signed_zero", "strides", "float_for_int", "python_signed_zero"],
)
def test_bitwise_in_eager_means_bit_patterns_layouts_and_value_types(build, message):
    # assert_close at zero tolerance takes -0.0 for 0.0 (1/x: -inf against inf) and ignores
    # strides, and an int passed for a float: none of them is what stock returns.
    pt.assert_equivalent(_Returns(lambda y, p: build(y, False)), torch.randn(2, 4), "hoist")
    with pytest.raises(AssertionError, match=message):
        pt.assert_equivalent(_Returns(build), torch.randn(2, 4), "hoist")
    # under a tolerance the values count, as stated
    compare_outputs((torch.zeros(2).neg(), 1.0), (torch.zeros(2), 1), "", pt_compare.Tolerance(atol=1e-6))


def test_a_nan_is_equal_to_the_same_nan_bit_for_bit():
    nan = torch.tensor([float("nan"), 1.0])
    compare_outputs(nan, nan.clone(), "", BITWISE)
    other = nan.view(torch.int32).clone()
    other[0] ^= 1  # another NaN payload
    with pytest.raises(AssertionError, match="bitwise"):
        compare_outputs(other.view(torch.float32), nan, "", BITWISE)
    pt.assert_equivalent(_Returns(lambda y, p: (y, y.detach() * float("nan"))), torch.randn(2, 4), "hoist", steps=2)


class _FlipsGradWhenPrepared(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = weight_norm(nn.Linear(4, 3))

    def forward(self, x):
        y = self.lin(x)
        if _prepared(self) and y.requires_grad:
            y.register_hook(lambda g: g.flip(-1))  # a backward that mixes up the output's elements
        return y


@pytest.mark.parametrize("mode", MODES)
def test_a_backward_that_permutes_the_output_gradient_is_seen(mode):
    # The loss was sum(outputs): an all-ones cotangent, under which permuting it changes nothing.
    with pytest.raises(AssertionError, match=r"grad of 'lin\."):
        pt.assert_equivalent(_FlipsGradWhenPrepared(), torch.randn(5, 4), mode, steps=2)


def test_the_loss_weights_come_from_the_checkers_own_generator():
    from paramfold.testing.check import _loss

    torch.manual_seed(5)
    state = torch.get_rng_state()
    y = torch.ones(2, 3, requires_grad=True)
    first = _loss((y, torch.tensor([1, 2]), y.detach()))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(first, _loss((y, torch.tensor([1, 2]), y.detach())))
    first.backward()
    assert len(set(y.grad.flatten().tolist())) == 6  # no two elements weighted alike


class _ExtraDrawWhenPrepared(nn.Module):
    def __init__(self, where: str):
        super().__init__()
        torch.manual_seed(0)
        self.lin = weight_norm(nn.Linear(4, 4))
        self.drop = nn.Dropout(0.5)
        self.where = where

    def forward(self, x):
        import random

        y = self.drop(self.lin(x))
        if _prepared(self):
            if self.where == "torch":
                torch.rand(1)
            elif self.where == "python":
                random.random()
            elif y.requires_grad:  # "backward": a draw in the backward
                y.register_hook(lambda g: g + 0 * torch.rand(()))
        return y


@pytest.mark.parametrize("where, generator", [("torch", "torch's CPU"), ("python", "Python's random"),
                                              ("backward", "torch's CPU")])
def test_a_prepared_run_that_draws_other_random_numbers_is_seen(where, generator):
    # Every run was set back to stock's generator state after each step, and the states the
    # runs left were never compared: the caller's next dropout mask would differ from stock's.
    with pytest.raises(AssertionError, match=f"{generator}.* another state by prepared than by stock"):
        pt.assert_equivalent(_ExtraDrawWhenPrepared(where), torch.randn(2, 4), "hoist", steps=2)


class _OwnNoise(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = torch.Generator().manual_seed(3)

    def forward(self, w):
        return w + 0.01 * torch.randn(w.shape, generator=self.g)


class _Anneal(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, w):
        self.n.add_(1)
        return w * (1 + 0.01 * self.n)


@pytest.mark.parametrize("mode", ["inline", "auto"])
@pytest.mark.parametrize("chain", [_OwnNoise, _Anneal])
def test_a_chain_with_state_of_its_own_is_not_taken_for_an_irreproducible_model(chain, mode):
    # The reads before step 1 moved stock's own generator (or read counter) after the twin that
    # checks reproducibility had been copied: a correct, deterministic model "not reproducible".
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    parametrize.register_parametrization(model, "weight", chain())
    pt.assert_equivalent(model, torch.randn(3, 4), mode, steps=2)


@pytest.mark.parametrize("mode", ["hoist", "inline"])
def test_nested_tensor_and_numpy_outputs_are_compared(mode):
    import numpy as np

    def nested(y, p):
        return y, torch.nested.as_nested_tensor([y[0], y[1, :2] + (1.0 if p else 0.0)])  # with a graph

    pt.assert_equivalent(_Returns(lambda y, p: nested(y, False)), torch.randn(2, 4), mode)  # enters the loss
    with pytest.raises(AssertionError, match=r"output\[1\]\[1\]"):
        pt.assert_equivalent(_Returns(nested), torch.randn(2, 4), mode)
    pt.assert_equivalent(_Returns(lambda y, p: (y, np.array([np.nan, 1.0]), np.float32("nan"))), torch.randn(2, 4),
                         mode)
    with pytest.raises(AssertionError, match=r"output\[1\]"):
        pt.assert_equivalent(_Returns(lambda y, p: (y, np.array([np.nan, 2.0 if p else 1.0]))), torch.randn(2, 4), mode)
    with pytest.raises(AssertionError, match=r"output\[1\]"):
        pt.assert_equivalent(_Returns(lambda y, p: (y, np.array([1, 2], dtype="int32" if p else "int64"))),
                             torch.randn(2, 4), mode)


def test_the_not_reproducible_message_names_stocks_two_runs():
    with pytest.raises(AssertionError, match=r"not reproducible.*\(output differs from its first "):
        pt.assert_equivalent(_Schedule(), torch.randn(2, 4), "hoist")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_a_chain_member_s_own_parameters_in_a_layer_called_twice_are_held_to_the_order_paramfold_sums_in(mode, compiled):
    # Regression: a LoRA member's A and B, read by a layer called twice per forward, get their
    # gradient summed once per forward, as the originals do (bitwise stock's under
    # parametrize.cached()); the checker allowed that order for the originals only, and failed
    # a correct model on "grad of 'b.parametrizations.weight.0.A' ... differs from stock".
    from helpers import LoRA
    from torch.nn.utils import parametrize

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.b = nn.Linear(8, 8)
            parametrize.register_parametrization(self.b, "weight", LoRA(8, 8, rank=3))

        def forward(self, x):
            return self.b(torch.tanh(self.b(x)))

    torch.manual_seed(1)
    pt.assert_equivalent(Twice(), torch.randn(5, 8), mode, steps=2,
                         compile={"backend": "aot_eager"} if compiled else None)


@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_a_chain_member_shared_by_layers_called_out_of_module_order_is_held_to_the_order_paramfold_sums_in(mode):
    # Regression: one LoRA member registered on every layer (Tied-LoRA), the layers called in
    # reverse: paramfold computes each weight at the forward's start, in module order, so the
    # shared A and B sum their gradient terms in that order (bitwise stock's under
    # parametrize.cached() in module order); the checker allowed that only for tied originals,
    # and failed the correct model on "grad of 'ls.0.parametrizations.weight.0.A' ... differs".
    from helpers import LoRA
    from torch.nn.utils import parametrize

    class Reversed(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
            shared = LoRA(8, 8, rank=2)
            for layer in self.layers:
                parametrize.register_parametrization(layer, "weight", shared)
                layer.parametrizations.weight.original.requires_grad_(False)

        def forward(self, x):
            for layer in reversed(self.layers):
                x = x + torch.tanh(layer(x))
            return x

    torch.manual_seed(1)
    pt.assert_equivalent(Reversed(), torch.randn(5, 8), mode, steps=2)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm_eval"])
@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_a_hook_based_norm_in_a_layer_called_twice_is_held_to_the_order_paramfold_sums_in(mode, norm, compiled):
    # Regression: paramfold computes a hook-based norm's weight once per forward (its hook out
    # meanwhile), and both calls of the layer read it: the originals' (weight_g, weight_v)
    # gradients are summed once, bitwise those of stock computing the weight once per forward.
    # The checker's reference copy computed it at each call, as stock's hook does, and failed
    # the correct model on "grad of 'b.weight_g' ... differs from stock (bitwise)".
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            norm_of = nn.utils.weight_norm if norm == "weight_norm" else nn.utils.spectral_norm
            self.b = norm_of(nn.Linear(8, 8))

        def forward(self, x):
            return self.b(torch.tanh(self.b(x)))

    model = Twice()
    if norm == "spectral_norm_eval":
        model.eval()
    torch.manual_seed(1)
    pt.assert_equivalent(model, torch.randn(5, 8), mode, steps=2,
                         compile={"backend": "aot_eager"} if compiled else None)


def _serving_its_first_value(monkeypatch) -> None:
    """paramfold.prepare made to serve each parametrized Linear's weight as it was at prepare: a
    stale value, which the checker must see once the originals change between steps."""
    prepare, restore = paramfold.prepare, paramfold.restore

    def stale_prepare(model, *args, **kwargs):
        out = prepare(model, *args, **kwargs)
        for module in model.modules():
            if isinstance(module, nn.Linear) and paramfold.find(module):
                with torch.no_grad():
                    first = module.weight.detach().clone()
                module.forward = lambda x, m=module, w=first: nn.functional.linear(x, w, m.bias)
        return out

    def stale_restore(model, *args, **kwargs):
        for module in model.modules():
            module.__dict__.pop("forward", None)
        return restore(model, *args, **kwargs)

    monkeypatch.setattr(paramfold, "prepare", stale_prepare)
    monkeypatch.setattr(paramfold, "restore", stale_restore)


def _spectral_frozen() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(spectral_norm(nn.Linear(6, 6)), nn.Tanh(), nn.Linear(6, 3)).eval().requires_grad_(False)


@pytest.mark.parametrize("mode", ["freeze", "auto", "hoist"])
def test_a_stale_value_of_a_scale_invariant_chain_is_seen_when_originals_change_without_gradients(monkeypatch, mode):
    # Originals without a gradient were all shrunk by 1% between steps, and spectral_norm's W/sigma(W)
    # does not change under a uniform scaling: within a tolerance, a stale value passed.
    pt.assert_equivalent(_spectral_frozen(), torch.randn(4, 6), mode, steps=2, atol=1e-6, rtol=1e-6)
    _serving_its_first_value(monkeypatch)
    with pytest.raises(AssertionError, match="output at step 2 differs from stock"):
        pt.assert_equivalent(_spectral_frozen(), torch.randn(4, 6), mode, steps=2, atol=1e-6, rtol=1e-6)


def test_the_between_step_change_of_originals_without_gradients_is_the_same_on_every_copy_and_not_uniform():
    from paramfold.testing.between_steps import update

    models = [_spectral_frozen() for _ in range(3)]
    original = models[0][0].parametrizations.weight.original.clone()
    update(models[0], models[1:], lr=1e-3, step=2)  # (before the second step the original itself is held out)
    changed = [m[0].parametrizations.weight.original for m in models]
    assert all(torch.equal(changed[0], other) for other in changed[1:])
    ratio = changed[0] / original
    # more than rounding apart (a uniform shrink leaves spectral_norm's W/sigma(W) as it was)
    assert ratio.max() - ratio.min() > 1e-3 and ratio.min() > 0.97 and ratio.max() <= 1.0


@pytest.mark.parametrize("mode", ["freeze", "hoist"])
def test_an_output_that_requires_grad_where_stocks_does_not_is_seen(monkeypatch, mode):
    # A prepared output carrying a graph where stock's carries none (stock's y.numpy() works, the
    # prepared one's raises) passed: requires_grad of outputs was not compared.
    prepare, restore = paramfold.prepare, paramfold.restore
    handles = []

    def leaky_prepare(model, *args, **kwargs):
        out = prepare(model, *args, **kwargs)
        extra = nn.Parameter(torch.zeros(()))
        handles.append(model.register_forward_hook(lambda module, inputs, output: output + 0 * extra))
        return out

    def leaky_restore(model, *args, **kwargs):
        while handles:
            handles.pop().remove()
        return restore(model, *args, **kwargs)

    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(6, 6)), nn.Tanh(), nn.Linear(6, 3)).eval().requires_grad_(False)
    pt.assert_equivalent(model, torch.randn(4, 6), mode, steps=2)
    monkeypatch.setattr(paramfold, "prepare", leaky_prepare)
    monkeypatch.setattr(paramfold, "restore", leaky_restore)
    with pytest.raises(AssertionError, match=r"output( at step \d)?: prepared requires grad, stock does not"):
        pt.assert_equivalent(model, torch.randn(4, 6), mode, steps=2)


# --- faults the checker must see: each passed it before (helper-207, 2026-12-07) ------------


def _weight_normed_frozen() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(weight_norm(nn.Linear(6, 6)), nn.Tanh(), nn.Linear(6, 3)).eval().requires_grad_(False)


class _Scaled(nn.Module):
    """A parametrization with a buffer of its own."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((), 1.5))

    def forward(self, x):
        return x * self.scale


def _scaled_frozen() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    torch.nn.utils.parametrize.register_parametrization(model[0], "weight", _Scaled())
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("fault", ["first original only", "originals only"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_a_frozen_value_blind_to_some_of_its_inputs_is_seen(monkeypatch, mode, fault):
    # Every original was updated between steps, so a value watching only weight_norm's g (or a
    # custom member's own buffer not at all) was computed again for the change it did see.
    import itertools

    import paramfold.freeze

    build = _weight_normed_frozen if fault == "first original only" else _scaled_frozen
    pt.assert_equivalent(build(), torch.randn(4, 6), mode, steps=3)
    watched = paramfold.freeze._watched
    if fault == "first original only":
        monkeypatch.setattr(paramfold.freeze, "_watched", lambda site: itertools.islice(watched(site), 1))
    else:
        monkeypatch.setattr(paramfold.freeze, "_watched",
                            lambda site: (w for w in watched(site) if w[1].startswith("original")))
    with pytest.raises(AssertionError, match=r"at step \d differs from stock"):
        pt.assert_equivalent(build(), torch.randn(4, 6), mode, steps=3)


@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_a_read_outside_forward_in_training_mode_that_skips_the_power_iteration_is_seen(monkeypatch, mode):
    # Reads outside forward were made with the parametrizations in eval mode only.
    import paramfold.site_reads

    def build():
        torch.manual_seed(0)
        return nn.Sequential(spectral_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 2))

    pt.assert_equivalent(build(), torch.randn(3, 4), mode, steps=2)
    read = paramfold.site_reads.read_outside_scope

    def read_in_eval(module, name):
        flags = [(m, m.training) for m in module.parametrizations[name].modules()]
        for m, _ in flags:
            m.training = False
        try:
            return read(module, name)
        finally:
            for m, training in flags:
                m.training = training

    monkeypatch.setattr(paramfold.site_reads, "read_outside_scope", read_in_eval)
    with pytest.raises(AssertionError, match=r"after reads outside forward in training mode|read outside forward in training mode"):
        pt.assert_equivalent(build(), torch.randn(3, 4), mode, steps=2)


def test_a_global_module_hook_left_by_restore_is_seen(monkeypatch):
    restore = paramfold.restore
    handles = []

    def leaking_restore(model, *args, **kwargs):
        out = restore(model, *args, **kwargs)
        handles.append(torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None))
        return out

    pt.assert_equivalent(_with_hooks_and_state(), torch.randn(5, 4), "hoist", steps=2)
    monkeypatch.setattr(paramfold, "restore", leaking_restore)
    try:
        with pytest.raises(AssertionError, match=r"_global_forward_pre_hooks changed by paramfold\.restore: 1 added"):
            pt.assert_equivalent(_with_hooks_and_state(), torch.randn(5, 4), "hoist", steps=2)
    finally:
        for handle in handles:
            handle.remove()


def _cloning_save(self, destination, prefix, keep_vars):
    before = set(destination)
    type(self)._save_to_state_dict(self, destination, prefix, keep_vars)
    for key in set(destination) - before:
        if not keep_vars:
            destination[key] = destination[key].clone()


@pytest.mark.parametrize("fault", ["metadata", "copies"])
@pytest.mark.parametrize("mode", ["hoist", "freeze"])
def test_a_state_dict_with_other_metadata_or_copied_tensors_is_seen(monkeypatch, mode, fault):
    # state_dict() was compared by keys and values: its _metadata (the versions
    # _load_from_state_dict reads) and whether its tensors share the model's memory
    # (model.state_dict()[k].zero_() writes the model) were not.
    import types

    prepare, restore = paramfold.prepare, paramfold.restore

    def odd_prepare(model, *args, **kwargs):
        out = prepare(model, *args, **kwargs)
        plist = model[0].parametrizations.weight
        if fault == "metadata":
            plist.__dict__["_version"] = 99
        else:
            plist.__dict__["_save_to_state_dict"] = types.MethodType(_cloning_save, plist)
        return out

    def odd_restore(model, *args, **kwargs):
        model[0].parametrizations.weight.__dict__.pop("_version" if fault == "metadata" else "_save_to_state_dict")
        return restore(model, *args, **kwargs)

    pt.assert_equivalent(_weight_normed_frozen(), torch.randn(4, 6), mode, steps=2)
    monkeypatch.setattr(paramfold, "prepare", odd_prepare)
    monkeypatch.setattr(paramfold, "restore", odd_restore)
    message = (r"state_dict metadata differs after prepare" if fault == "metadata"
               else r"state_dict '0\.parametrizations\.weight\.original0' after prepare: .*not sharing its memory")
    with pytest.raises(AssertionError, match=message):
        pt.assert_equivalent(_weight_normed_frozen(), torch.randn(4, 6), mode, steps=2)


def test_an_error_of_the_stock_model_itself_says_it_came_from_stock():
    # Stock's own exception (inputs of the wrong shape) came out bare, as if paramfold raised it.
    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(4, 4)))
    with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
        pt.assert_equivalent(model, torch.randn(2, 5), "hoist")
    if sys.version_info >= (3, 11):  # (exception notes)
        assert any("stock copy's step 1" in note and "without paramfold" in note
                   for note in getattr(info.value, "__notes__", []))


# --- faults the checker must see: each passed it before (helper-238, from helper-235's probe) ---


def _sn_model():
    torch.manual_seed(1)
    return nn.Sequential(spectral_norm(nn.Linear(6, 6)), nn.ReLU(), nn.Linear(6, 2))


@pytest.mark.parametrize("mode", [*MODES, "freeze"])
def test_paramfold_keeps_the_memory_of_every_parameter_and_buffer_in_each_mode(mode):
    # What the checker now holds every check to: real paramfold keeps each tensor's storage.
    model = _sn_model()
    if mode == "freeze":
        model.eval().requires_grad_(False)
    pt.assert_equivalent(model, torch.randn(3, 6), mode, steps=2)


@pytest.mark.parametrize("when", ["restore", "prepare"])
def test_a_parameter_moved_to_other_memory_by_prepare_or_restore_fails_the_check(monkeypatch, when):
    # p.data = p.data.clone(): the same object and values, but a view a caller holds (a NumPy
    # array, FSDP's flat parameter) no longer aliases it. The checker never compared storage.
    real = getattr(paramfold, when)

    def rebinding(model, *args, **kwargs):
        out = real(model, *args, **kwargs)
        original = model[0].parametrizations.weight.original
        original.data = original.data.clone()
        return out

    monkeypatch.setattr(paramfold, when, rebinding)
    with pytest.raises(AssertionError, match=r"original' moved to other memory"):
        pt.assert_equivalent(_sn_model(), torch.randn(3, 6), "hoist", steps=2)


def test_the_memory_of_tensors_is_compared_only_where_it_can_be_read():
    from paramfold.testing.structure import storage_key

    assert storage_key(torch.empty(2, device="meta")) is None
    assert storage_key(None) is None
    t = torch.arange(6.0).view(2, 3)
    assert storage_key(t[1]) == (t[1].const_data_ptr(), 3, (1,))


def test_a_parameter_order_changed_while_prepared_fails_naming_the_order(monkeypatch):
    # An optimizer built on the prepared model maps its state by named_parameters()' order.
    real = paramfold.prepare

    def reordering(model, *args, **kwargs):
        out = real(model, *args, **kwargs)
        last = model._modules.pop("2")
        model._modules = {"2": last, **model._modules}
        return out

    monkeypatch.setattr(paramfold, "prepare", reordering)
    with pytest.raises(AssertionError, match=r"named_parameters\(\) differs from stock's after prepare: the same names in another order"):
        pt.assert_equivalent(_sn_model(), torch.randn(3, 6), "hoist")


def _two_normed():
    torch.manual_seed(0)
    return nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), weight_norm(nn.Linear(4, 4)))


def _only_first(module, fqn):
    return fqn == "0"


@pytest.mark.parametrize("mode", MODES)
def test_modules_filter_fn_leaves_out_must_stay_stock_while_prepared(monkeypatch, mode):
    pt.assert_equivalent(_two_normed(), torch.randn(2, 4), mode, steps=2, filter_fn=_only_first)
    real = paramfold.prepare

    def ignoring_filter(model, mode, filter_fn=None, **kwargs):
        return real(model, mode, **kwargs)  # prepares the modules filter_fn left out too

    monkeypatch.setattr(paramfold, "prepare", ignoring_filter)
    with pytest.raises(AssertionError, match=r"module '2', which filter_fn left out of prepare, has another class after prepare"):
        pt.assert_equivalent(_two_normed(), torch.randn(2, 4), mode, steps=2, filter_fn=_only_first)


class _Outer(nn.Module):
    """A parametrized module holding a parametrized child: filter_fn may leave out the parent."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = weight_norm(nn.Linear(4, 4))
        self.scale = nn.Parameter(torch.rand(4) + 0.5)
        torch.nn.utils.parametrize.register_parametrization(self, "scale", nn.Identity())

    def forward(self, x):
        return self.inner(x) * self.scale


@pytest.mark.parametrize("mode", MODES)
def test_a_left_out_module_above_a_prepared_one_may_serve_its_calls_but_keeps_its_own_chains(mode):
    # prepare makes the modules above a prepared one entries of it (a class made from stock's):
    # not a difference; the left-out module's own tensor must stay stock's.
    pt.assert_equivalent(_Outer(), torch.randn(2, 4), mode, steps=2, filter_fn=lambda m, fqn: fqn == "inner")


@pytest.mark.parametrize("lr", [0.0, -1e-3, float("nan"), float("inf")])
def test_an_lr_that_turns_the_update_off_is_refused_when_steps_check_freshness(lr):
    # lr=0 left the originals with a gradient as they were: a stale model passed steps=3.
    with pytest.raises(ValueError, match=r"lr=.* with steps=3"):
        pt.assert_equivalent(_two_normed(), torch.randn(2, 4), "hoist", steps=3, lr=lr)
    pt.assert_equivalent(_two_normed(), torch.randn(2, 4), "hoist", steps=1, lr=lr)  # no update runs


class _LeavesSetting(nn.Module):
    """A weight-normed Linear whose forward, once prepared, changes a process-wide setting."""

    def __init__(self, change):
        super().__init__()
        torch.manual_seed(0)
        self.lin = weight_norm(nn.Linear(4, 4))
        self.change = change

    def forward(self, x):
        if paramfold.state.STATE_ATTR in self.__dict__:
            self.change()
        return self.lin(x)


_SETTING_CHANGES = {
    "default dtype": (lambda: torch.set_default_dtype(torch.float64), r"torch\.get_default_dtype\(\)"),
    "deterministic": (lambda: torch.use_deterministic_algorithms(True, warn_only=True),
                      r"torch\.are_deterministic_algorithms_enabled\(\)"),
    "matmul precision": (lambda: torch.set_float32_matmul_precision("medium"),
                         r"torch\.get_float32_matmul_precision\(\)"),
    "anomaly": (lambda: torch.set_anomaly_enabled(True), r"torch\.is_anomaly_enabled\(\)"),
}


@pytest.mark.parametrize("setting", list(_SETTING_CHANGES))
def test_a_process_wide_setting_a_prepared_forward_leaves_changed_fails_and_is_set_back(setting):
    change, name = _SETTING_CHANGES[setting]
    before = (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(), torch.get_float32_matmul_precision(),
              torch.is_anomaly_enabled())
    try:
        with pytest.raises(AssertionError, match=rf"process-wide setting {name} changed by the prepared run 1"):
            pt.assert_equivalent(_LeavesSetting(change), torch.randn(2, 4), "hoist")
        after = (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
                 torch.is_deterministic_algorithms_warn_only_enabled(), torch.get_float32_matmul_precision(),
                 torch.is_anomaly_enabled())
        assert after == before  # the check sets it back
    finally:
        torch.set_default_dtype(before[0])
        torch.use_deterministic_algorithms(before[1], warn_only=before[2])
        torch.set_float32_matmul_precision(before[3])
        torch.set_anomaly_enabled(before[4])


def test_a_setting_stock_changes_too_is_no_difference():
    model = _LeavesSetting(lambda: None)
    model.forward = lambda x: (torch.set_float32_matmul_precision("high"), model.lin(x))[1]
    before = torch.get_float32_matmul_precision()
    try:
        pt.assert_equivalent(model, torch.randn(2, 4), "hoist", steps=2)
    finally:
        torch.set_float32_matmul_precision(before)


class _CountingMember(nn.Module):
    """A parametrization reading a global counter: the model does not reproduce itself."""

    count = 0

    def forward(self, x):
        type(self).count += 1
        return x * (1 + type(self).count * 1e-3)


def test_a_parametrization_reading_a_global_counter_is_reported_as_not_reproducible():
    # The reads before step 1 compared prepared with stock first, and blamed paramfold.
    model = nn.Sequential(nn.Linear(4, 4))
    torch.nn.utils.parametrize.register_parametrization(model[0], "weight", _CountingMember())
    with pytest.raises(AssertionError, match=r"the model is not reproducible"):
        pt.assert_equivalent(model, torch.randn(2, 4), "auto", steps=2)


def test_a_hoist_refusal_of_a_chain_that_computes_other_values_names_a_global_counter_too():
    model = nn.Sequential(nn.Linear(4, 4))
    torch.nn.utils.parametrize.register_parametrization(model[0], "weight", _CountingMember())
    with pytest.raises(paramfold.FoldError, match=r"global counter"):
        pt.assert_equivalent(model, torch.randn(2, 4), "hoist", steps=2)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("compiled", [False, True])
def test_every_failure_names_the_mode_and_whether_compiled(compiled):
    compile = {"backend": "eager"} if compiled else None
    how = r"compiled, backend='eager'" if compiled else "eager"
    with pytest.raises(AssertionError, match=rf"^\[mode='auto', {how}\] output"):
        pt.assert_equivalent(_Marked("dataclass", differ=True), torch.randn(2, 4), "auto", compile=compile)
