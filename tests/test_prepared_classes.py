"""The classes of prepared modules, against stock's class of a module's own: a root given a subclass
or a call of its own while prepared, paramfold's class set on a module it did not prepare, a
module built from a prepared module's class, class attributes set or deleted through
``type(module)``, a root prepared after its class changed, and ``type_before_parametrizations``.

Stock gives each parametrized module a class of its own; paramfold's prepared classes are shared
by the prepared modules of an architecture and cached (``paramfold/classes.py``): a write to one
must reach no other module, and is refused or made where stock makes it. Compared with stock
bitwise (eager on CPU).
"""

from __future__ import annotations

import contextlib
import copy
import types
import warnings

import pytest
import torch
from helpers import ALL_MODES, assert_same_tensors, _inference, skew_pair
from torch import nn
from torch.nn.utils import parametrize as P
from torch.nn.utils.parametrizations import weight_norm

import paramfold
import paramfold.testing as pt


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_prepared_root_given_a_subclass_whose_call_calls_super_runs_like_stock(mode):
    # Regression (2026-12-06, hours old): the root's call took any class whose __call__ was not
    # paramfold's for an unwrapped one and called that class's __call__, which called super()'s,
    # paramfold's again: RecursionError at every call.
    def with_call_override(model: nn.Module) -> None:
        base = type(model)

        def __call__(self, *args, **kwargs):
            return super(cls, self).__call__(*args, **kwargs) * 2.0

        cls = type(f"Scaled{base.__name__}", (base,), {"__call__": __call__})
        model.__class__ = cls

    torch.manual_seed(0)
    stock = _inference(nn.Sequential(weight_norm(nn.Linear(4, 6)), nn.Tanh(), weight_norm(nn.Linear(6, 3))))
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(3, 4)
    assert torch.equal(ours(x), stock(x))
    for model in (stock, ours):
        with_call_override(model)
    for _ in range(2):
        assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_restore_of_a_root_given_a_subclass_using_zero_argument_super_keeps_it_working(mode):
    # Regression: restore rebuilds a subclass given to the root after prepare on the root's own
    # class; its methods' zero-argument super() still named the subclass made on paramfold's
    # class, so every call after restore raised TypeError ("obj must be an instance or subtype").
    def subclassed(model: nn.Module) -> nn.Module:
        class Shifted(type(model)):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return super().forward(x) + self.shift

            @property
            def shift(self) -> float:
                return 1.0

        model.__class__ = Shifted
        return model

    torch.manual_seed(0)
    stock = _inference(nn.Sequential(weight_norm(nn.Linear(4, 6)), nn.Tanh()))
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(3, 4)
    subclassed(stock)
    subclassed(ours)
    assert torch.equal(ours(x), stock(x))
    paramfold.restore(ours)
    assert type(ours).__name__ == "Shifted" and type(ours).__mro__[1] is nn.Sequential
    for _ in range(2):
        assert torch.equal(ours(x), stock(x))


class _Recursive(nn.Module):
    """A root with a ``__call__`` of its own whose forward calls the root again through a method
    bound once (``self.__dict__["again"]``), as a tree-recursive model holding its call does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = weight_norm(nn.Linear(4, 4))

    def __call__(self, x: torch.Tensor, depth: int = 0) -> torch.Tensor:
        return super().__call__(x, depth) * 2.0

    def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        return self.__dict__["again"](y, depth + 1) if depth < 2 else y


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_root_recursing_through_its_call_bound_while_prepared_runs_each_level_s_call_after_restore(mode):
    # Regression (33a2786): after restore, the call bound while prepared handed the first level
    # to the class's __call__ and took every later level for a class calling paramfold's captured
    # call, running nn.Module's: each level's * 2 but the first was lost.
    torch.manual_seed(0)
    stock = _inference(_Recursive())
    ours = copy.deepcopy(stock)
    stock.__dict__["again"] = stock.__call__
    x = torch.randn(3, 4)
    paramfold.prepare(ours, mode)
    ours.__dict__["again"] = ours.__call__
    assert torch.equal(ours(x), stock(x))
    paramfold.restore(ours)
    assert torch.equal(ours.__dict__["again"](x), stock(x))
    assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
def test_a_compiled_wrapper_made_before_the_root_got_a_call_override_runs_it_like_stocks(mode):
    # Regression: torch.compile(model) of a root whose forward is torch's binds paramfold's call;
    # stock's wrapper calls the module (torch's wrap_inline), so a __call__ of a subclass the
    # root is given later runs through it. Ours skipped it: the output without the override's +1.
    torch.manual_seed(0)
    stock = nn.Sequential(weight_norm(nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 4)).eval()
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(3, 8)
    torch._dynamo.reset()
    wrappers = [torch.compile(model, backend="eager") for model in (stock, ours)]
    assert torch.equal(wrappers[1](x), wrappers[0](x))
    for model in (stock, ours):
        base = type(model)
        model.__class__ = type("PlusOne", (base,), {"__call__": lambda self, *a, base=base: base.__call__(self, *a) + 1})
    for _ in range(2):
        assert torch.equal(wrappers[1](x), wrappers[0](x))
        assert torch.equal(ours(x), stock(x))
    assert torch.equal(wrappers[1](x), stock[2](stock[1](stock[0](x))) + 1)


def test_paramfolds_class_on_a_module_it_did_not_prepare_is_refused_and_a_captured_call_runs_like_stocks():
    # Regression: a prepared root's class set back after restore (or given to another module)
    # recursed without end at the next call; so did a class whose __call__ calls the prepared
    # class's, captured before the swap (orig = type(m).__call__), which stands for nn.Module's.
    torch.manual_seed(0)
    stock = _inference(nn.Sequential(weight_norm(nn.Linear(4, 6)), nn.Tanh()))
    ours = paramfold.prepare(copy.deepcopy(stock), "auto")
    x = torch.randn(2, 4)
    prepared_class = type(ours)
    orig = prepared_class.__call__
    ours.__class__ = type("Instrumented", (nn.Sequential,), {"__call__": lambda self, *a: orig(self, *a)})
    assert torch.equal(ours(x), stock(x))
    ours.__class__ = prepared_class
    paramfold.restore(ours)
    ours.__class__ = prepared_class
    with pytest.raises(paramfold.FoldError, match="set the module's class to the one it had before"):
        ours(x)
    ours.__class__ = nn.Sequential
    assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_type_before_parametrizations_reports_the_users_classes(mode):
    model = nn.Sequential(nn.Sequential(weight_norm(nn.Linear(4, 4))), nn.Linear(4, 4))
    if mode == "freeze":
        _inference(model)
    before = {p: P.type_before_parametrizations(m) for p, m in model.named_modules()}
    assert before[""] is nn.Sequential and before["0.0"] is nn.Linear
    shape = pt.structure(model)
    paramfold.prepare(model, mode, filter_fn=None)
    assert {p: P.type_before_parametrizations(m) for p, m in model.named_modules()} == before
    from torch.ao.nn.intrinsic.modules import fused  # imported by name there

    assert fused.type_before_parametrizations(model) is nn.Sequential
    paramfold.restore(model)
    pt.assert_same_structure(shape, pt.structure(model))


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.inner = weight_norm(nn.Linear(4, 4))

    def forward(self, x):
        return self.inner(x) * self.scale


def test_type_before_parametrizations_of_an_unselected_parametrized_entry():
    model = Outer()
    P.register_parametrization(model, "scale", nn.Identity())
    stock = copy.deepcopy(model)
    paramfold.prepare(model, "hoist", filter_fn=lambda m, fqn: fqn == "inner")
    assert P.type_before_parametrizations(model) is Outer
    assert P.type_before_parametrizations(model.inner) is nn.Linear
    x = torch.randn(2, 4)
    assert torch.equal(model(x), stock(x))


@pytest.mark.parametrize("root", [False, True])
@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
def test_a_module_built_from_a_prepared_modules_class_works_like_stocks(mode, root):
    # Regression (PEFT's LoRA for a conv builds its adapters with type(base_layer)(...)): stock
    # builds a module of the layer's own class, with no parametrizations, which works as the
    # plain class; paramfold's shared class made one without paramfold's state: KeyError at its
    # call. Also after a call, where freeze and auto leave the between-calls class.
    def build():
        torch.manual_seed(0)
        conv = weight_norm(nn.Conv1d(3, 4, 3))
        model = conv if root else nn.Sequential(conv, nn.Tanh())
        return (_inference(model) if mode == "freeze" else model), conv

    (stock, stock_conv), (ours, ours_conv) = build(), build()
    paramfold.prepare(ours, mode)
    x = torch.randn(2, 3, 5)
    with torch.no_grad() if mode == "freeze" else contextlib.nullcontext():
        for model in (stock, ours):
            model(x)
        made = []
        for model, conv in ((stock, stock_conv), (ours, ours_conv)):
            torch.manual_seed(1)
            made.append((type(conv)(3, 2, 1, bias=False), type(model)(nn.Linear(5, 5)) if not root else None))
        (stock_new, stock_seq), (ours_new, ours_seq) = made
        assert not paramfold.find(ours_new) and isinstance(ours_new, nn.Conv1d)
        assert torch.equal(ours_new(x), stock_new(x))
        assert_same_tensors(dict(stock_new.state_dict()), dict(ours_new.state_dict()))
        if not root:
            assert torch.equal(ours_seq(torch.ones(1, 5)), stock_seq(torch.ones(1, 5)))
        assert torch.equal(ours(x), stock(x))
    paramfold.restore(ours)
    assert type(ours_conv).__bases__ == type(stock_conv).__bases__
    assert torch.equal(ours_new(x), stock_new(x))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_class_attribute_set_on_a_prepared_layer_is_refused_and_reaches_no_other_module(mode):
    # Regression: stock gives each parametrized layer a class of its own, so
    # ``type(layer).forward = f`` changes that layer only; paramfold's class is shared by every
    # prepared layer of the architecture and cached, so the write silently changed the model's
    # other layer, another model and models prepared later (also after restore); a property set
    # there became a _ForeignSite (AttributeError at its read). Such a write is refused, and the
    # same change made on the module is served like stock's.
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), weight_norm(nn.Linear(4, 4)))
        return _inference(model) if mode == "freeze" else model

    def patch(forward):
        return lambda self, x: forward(self, x) * 2.0

    stock_a, stock_b, ours_a, ours_b = build(0), build(1), build(0), build(1)
    for model in (ours_a, ours_b):
        paramfold.prepare(model, mode)
    x = torch.randn(2, 4)
    cls = type(ours_a[0])
    before = dict(vars(cls))
    writes = [(lambda: setattr(cls, "forward", patch(cls.forward)), r"module\.forward = types\.MethodType"),
              (lambda: setattr(cls, "bias_norm", property(lambda self: self.bias.norm())), "Call paramfold.restore"),
              (lambda: delattr(cls, "forward"), "Call paramfold.restore")]
    for write, what_to_do in writes:
        with pytest.raises(paramfold.FoldError, match=rf"(?s)shared by every prepared Linear.*{what_to_do}"):
            write()
    assert dict(vars(cls)) == before
    # The change made on the module, where stock made it on the layer's own class.
    type(stock_a[0]).forward = patch(type(stock_a[0]).forward)
    ours_a[0].forward = types.MethodType(patch(nn.Linear.forward), ours_a[0])
    later, stock_later = build(1), build(1)
    paramfold.prepare(later, mode)
    with torch.no_grad() if mode == "freeze" else contextlib.nullcontext():
        for ours, stock in ((ours_a, stock_a), (ours_b, stock_b), (later, stock_later)):
            assert torch.equal(ours(x), stock(x))
        for model in (ours_a, ours_b, later):
            paramfold.restore(model)
        fresh = paramfold.prepare(build(1), mode)
        assert torch.equal(fresh(x), stock_b(x))
        paramfold.restore(fresh)
        # Restored, each layer has stock's class of its own again: the same writes are stock's.
        for stock, ours in ((stock_a[2], ours_a[2]), (stock_b[0], ours_b[0])):
            for layer in (stock, ours):
                type(layer).forward = patch(type(layer).forward)
                type(layer).bias_norm = property(lambda self: self.bias.norm())
            assert torch.equal(ours.bias_norm, stock.bias_norm)
        for ours, stock in ((ours_a, stock_a), (ours_b, stock_b)):
            assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("leave", [True, False])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_class_attribute_del_of_a_parametrized_name_is_refused_not_ignored(mode, leave):
    # Regression: ``del type(layer).weight`` (a parametrized name) was ignored without a word, so
    # the layer kept its weight where stock's lost it (stock deletes the property of the layer's
    # own class: ``layer.weight`` then raises AttributeError): the class's __delattr__ took every
    # such del for torch's remove_parametrizations, which deletes its property that way. The
    # user's is refused like any class write, between calls and inside a call, also for a name
    # registered after prepare; torch's removal of either still works as before.
    stock, ours = _inference(skew_pair()), paramfold.prepare(_inference(skew_pair()), mode)
    x = torch.randn(2, 4)
    classes = {type(layer) for layer in ours}

    def refused(i, name, in_a_call):
        layer = ours[i]
        before = [dict(vars(cls)) for cls in classes]
        match = rf"(?s)del type\(module\)\.{name} .*shared by every prepared Linear.*Call paramfold\.restore"
        if in_a_call:
            handle = ours[1].register_forward_pre_hook(lambda module, args: delattr(type(layer), name))
            with pytest.raises(paramfold.FoldError, match=match):
                ours(x)
            handle.remove()
        else:
            with pytest.raises(paramfold.FoldError, match=match):
                delattr(type(layer), name)
        assert [dict(vars(cls)) for cls in classes] == before
        assert torch.equal(getattr(layer, name), getattr(stock[i], name))

    for in_a_call in (False, True):
        for i in (0, 2):
            refused(i, "weight", in_a_call)
            assert torch.equal(ours(x), stock(x))
    for model in (ours, stock):
        P.register_parametrization(model[2], "bias", nn.Tanh())
    classes = {type(layer) for layer in ours}
    refused(2, "bias", in_a_call=False)
    for layer in (ours, stock):
        P.remove_parametrizations(layer[2], "bias", leave_parametrized=leave)
        P.remove_parametrizations(layer[0], "weight", leave_parametrized=leave)
    assert_same_tensors(dict(stock.state_dict()), dict(ours.state_dict()))
    assert torch.equal(ours[2].weight, stock[2].weight)  # still parametrized, its class still serving it
    with pytest.raises(paramfold.FoldError, match="changed after paramfold.prepare"):
        ours(x)
    paramfold.restore(ours)
    assert torch.equal(ours(x), stock(x))
    assert [type(layer).__mro__[1:] for layer in ours] == [type(layer).__mro__[1:] for layer in stock]


class _Holds(nn.Module):
    """A container of the user's: its class is stock's for every instance, prepared or not."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = weight_norm(nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _SpectralLinear(nn.Linear):
    """A layer of the user's class with torch's hook-based spectral_norm."""


@pytest.mark.parametrize("kind", ["container", "hook_norm", "unselected"])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_class_attribute_set_through_a_class_stock_shares_is_refused_and_made_there_is_stocks(mode, kind):
    # Regression: where stock's class is not the module's own (a container's, a hook-based norm's
    # layer's: the user's class; an unselected parametrized module's: its own, shared by its
    # copies), ``type(module).attr = value`` went to paramfold's class: it missed the user's
    # class's other instances, was lost at restore, and a property became a _ForeignSite
    # (AttributeError). Refused, naming the class stock's write changes, which paramfold's class
    # derives from: made there, it is stock's, in training calls too (a hook-based norm's
    # read-once class ran the forward its class had when it was made).
    class Holds(_Holds):  # a class of this test's own: stock's writes reach every instance of it
        tag = "the class's own"

    class Spectral(_SpectralLinear):
        tag = "the class's own"

    def build(seed):
        torch.manual_seed(seed)
        if kind == "hook_norm":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                model = nn.Sequential(torch.nn.utils.spectral_norm(Spectral(4, 4)), nn.Tanh())
        else:
            model = Holds()
            if kind == "unselected":  # the root: parametrized, left out by filter_fn
                model.scale = nn.Parameter(torch.ones(4))
                P.register_parametrization(model, "scale", nn.Identity())
        return _inference(model) if mode == "freeze" else model

    def module_of(model):  # the module whose class is written
        return model[0] if kind == "hook_norm" else model

    stock_a, stock_b, ours_a, ours_b = build(0), build(1), build(0), build(1)
    filter_fn = (lambda m, fqn: fqn == "lin") if kind == "unselected" else None
    for model in (ours_a, ours_b):
        paramfold.prepare(model, mode, filter_fn=filter_fn)
    x = torch.randn(2, 4)
    cls = type(module_of(ours_a))
    if kind == "hook_norm" and mode == "inline":
        assert cls is Spectral  # inline leaves a hook-based norm's layer its class
        stock_classes = [Spectral]
    else:
        before = dict(vars(cls))
        writes = [(lambda: setattr(cls, "forward", lambda self, inp: inp), r"\.forward = \.\.\.\), which reaches"),
                  (lambda: setattr(cls, "doubled", property(lambda self: 1)), r"\.doubled = \.\.\.\), which reaches")]
        deletable = "tag" in vars(type(module_of(stock_a)))  # (not the per-module class torch made)
        if deletable:
            writes.append((lambda: delattr(cls, "tag"), r"\(del type\(module\)\.__mro__\[1\]\.tag\)"))
        for write, what_to_do in writes:
            with pytest.raises(paramfold.FoldError, match=r"(?s)stock makes it on the module's class .*" + what_to_do):
                write()
        # Names stock's class has none of its own (inherited, or a hook-based norm's weight, the
        # instance's): stock's del raises AttributeError (the message pointed at a del raising it too).
        for name in ("forward", "weight", *(() if deletable else ("tag",))):
            with pytest.raises(AttributeError) as ours_raised:
                delattr(cls, name)
            with pytest.raises(AttributeError) as stock_raised:
                delattr(type(module_of(stock_a)), name)
            assert str(ours_raised.value) == str(stock_raised.value)
        assert dict(vars(cls)) == before
        # Where the message says: the user's class (stock's modules' too), or each module's own.
        stock_classes = [type(module_of(m)).__mro__[1] for m in (ours_a, ours_b)]
        if kind == "unselected":
            stock_classes += [type(module_of(m)) for m in (stock_a, stock_b)]
        else:
            assert stock_classes == [type(module_of(stock_a))] * 2
    for stock_class in set(stock_classes):
        forward = stock_class.forward
        stock_class.forward = lambda self, inp, forward=forward: forward(self, inp) * 2.0
        stock_class.doubled = property(lambda self: 2.0 * next(iter(self.parameters())))
    grad = contextlib.nullcontext() if mode != "freeze" else torch.no_grad()
    with grad:
        for step in range(2):
            for ours, stock in ((ours_a, stock_a), (ours_b, stock_b)):
                assert torch.equal(ours(x), stock(x)), step
                assert torch.equal(module_of(ours).doubled, module_of(stock).doubled)
        assert_same_tensors(dict(stock_a.state_dict()), dict(ours_a.state_dict()))
        for model in (ours_a, ours_b):
            paramfold.restore(model)
        for ours, stock in ((ours_a, stock_a), (ours_b, stock_b)):
            assert torch.equal(ours(x), stock(x))  # the patch is kept, as on stock's class


def test_a_method_paramfold_defines_on_a_roots_class_is_refused_there():
    # A prepared nn.Sequential root runs paramfold's forward (which calls nn.Sequential's as it
    # was at prepare): a forward written to nn.Sequential would not reach it. Refused.
    model = paramfold.prepare(nn.Sequential(weight_norm(nn.Linear(4, 4))), "hoist")
    forward = nn.Sequential.forward
    try:
        with pytest.raises(paramfold.FoldError, match="defines forward itself"):
            type(model).forward = lambda self, x: x
    finally:
        nn.Sequential.forward = forward
    assert nn.Sequential.forward is forward and "forward" in vars(type(model))
    paramfold.restore(model)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_root_prepared_after_its_class_changed_runs_the_class_as_it_is_now(mode):
    # Regression: the shared class of a root is kept for later prepares, with what it took from
    # the root's class (nn.Sequential's forward): a root prepared after ``nn.Sequential.forward``
    # was changed (as the refusal above says to: restore, change, prepare again) ran the old one.
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(weight_norm(nn.Linear(4, 4)))
        return _inference(model) if mode == "freeze" else model

    x = torch.randn(2, 4)
    paramfold.restore(paramfold.prepare(build(), mode))
    forward = nn.Sequential.forward
    try:
        nn.Sequential.forward = lambda self, inp: forward(self, inp) * 2.0
        ours = paramfold.prepare(build(), mode)
        with torch.no_grad() if mode == "freeze" else contextlib.nullcontext():
            assert torch.equal(ours(x), build()(x))
    finally:
        nn.Sequential.forward = forward
