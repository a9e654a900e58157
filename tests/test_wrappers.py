"""Modules that wrap a parametrized module and forward unknown attributes to it.

PEFT's ``ModulesToSaveWrapper`` and ``torch.compile(layer)``'s ``OptimizedModule`` answer
``wrapper.parametrizations`` with the wrapped module's, so torch's ``parametrize.is_parametrized``
says True of the wrapper too. The wrapped module is the parametrized one: paramfold must find,
prepare and fold exactly it, as stock computes exactly it, bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import paramfold
import paramfold.testing as pt

MODES = ["hoist", "inline", "auto"]


class Forwarding(nn.Module):
    """Unknown attributes go to the wrapped module (inherited, so the subclass's dict is empty)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def forward(self, x):
        return self.inner(x)


class Wrapper(Forwarding):
    pass


def _net(wrap) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(wrap(spectral_norm(nn.Linear(6, 6))), nn.Tanh(), wrap(weight_norm(nn.Linear(6, 3))))


def _train_like_stock(stock: nn.Module, ours: nn.Module, x: torch.Tensor, steps: int = 3) -> None:
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (stock, ours)]
    for step in range(steps):
        outs = []
        for model, opt in zip((stock, ours), opts):
            opt.zero_grad()
            out = model(x)
            out.square().sum().backward()
            opt.step()
            outs.append(out)
        assert torch.equal(*outs), step
    for (name, a), b in zip(stock.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("wrap", ["forwarding", "compiled"])
def test_a_wrapper_forwarding_to_a_parametrized_module_is_not_a_site(mode, wrap):
    # Regression: find() listed the wrapper as a second site of the wrapped module's tensor;
    # prepare refused it (its class is not parametrize's), and with the filter_fn the refusal
    # advised, or a wrapper class whose forwarding __getattr__ is inherited, raised
    # KeyError: 'parametrizations'.
    make = Wrapper if wrap == "forwarding" else (lambda m: torch.compile(m, backend="eager"))
    inner = "inner" if wrap == "forwarding" else "_orig_mod"
    stock, ours = _net(make), _net(make)
    assert [(s.module_path, s.tensor_name) for s in paramfold.find(ours)] == [
        (f"0.{inner}", "weight"), (f"2.{inner}", "weight")]
    before = pt.structure(ours)
    excluded_class = type(getattr(ours[0], inner))
    paramfold.prepare(ours, mode)
    _train_like_stock(stock, ours, torch.randn(4, 6))
    paramfold.restore(ours)
    pt.assert_same_structure(before, pt.structure(ours, values=False))
    # only the wrapped module is excluded or chosen by filter_fn, as stock's class says
    paramfold.prepare(ours, mode, filter_fn=lambda module, fqn: fqn != f"0.{inner}")
    assert type(getattr(ours[0], inner)) is excluded_class  # stock's own class: not prepared
    assert type(getattr(ours[2], inner)) is not type(getattr(stock[2], inner))
    _train_like_stock(stock, ours, torch.randn(4, 6), steps=1)
    paramfold.restore(ours)


def test_plain_state_dict_and_export_fold_the_wrapped_module_only():
    stock = _net(Wrapper).eval()
    plain = paramfold.plain_state_dict(stock)
    assert sorted(plain) == ["0.inner.bias", "0.inner.weight", "2.inner.bias", "2.inner.weight"]
    x = torch.randn(4, 6)
    ep = paramfold.export(stock, (x,))
    assert torch.equal(ep.module()(x), stock(x))
    assert sorted(ep.state_dict) == sorted(plain)


def _peft_net(peft):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = weight_norm(nn.Linear(8, 4))

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(0)
    config = peft.LoraConfig(r=2, target_modules=["a"], modules_to_save=["b"], init_lora_weights=False)
    return peft.get_peft_model(Net(), config)


@pytest.mark.parametrize("mode", MODES)
def test_peft_modules_to_save_on_a_weight_normed_layer_trains_like_stock(mode):
    # Regression: refused ("its class ModulesToSaveWrapper is not the one torch.nn.utils.parametrize
    # made"), and with filter_fn excluding the wrapper as advised, KeyError: 'parametrizations'.
    peft = pytest.importorskip("peft")
    stock, ours = _peft_net(peft), _peft_net(peft)
    assert [s.module_path for s in paramfold.find(ours)] == [
        "base_model.model.b.original_module", "base_model.model.b.modules_to_save.default"]
    paramfold.prepare(ours, mode)
    x = torch.randn(3, 8)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (stock, ours)]
    for _ in range(2):
        outs = []
        for model, opt in zip((stock, ours), opts):
            opt.zero_grad()
            out = model(x)
            out.sum().backward()
            opt.step()
            outs.append(out)
        assert torch.equal(*outs)
    a, b = peft.get_peft_model_state_dict(stock), peft.get_peft_model_state_dict(ours)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    paramfold.restore(ours)


def test_export_copies_a_forwarding_wrapper_as_its_class_would():
    # Regression: paramfold.export folds a deep copy, and copy.deepcopy finds __deepcopy__ through
    # a forwarding __getattr__: PEFT's ModulesToSaveWrapper came back as a copy of its active
    # module (export raised KeyError), a user's wrapper as the module it wraps (the program lost
    # the wrapper's keys: "0.weight" for "0.inner.weight").
    peft = pytest.importorskip("peft")
    model = _peft_net(peft).eval()
    with torch.no_grad():
        model.base_model.model.b.modules_to_save.default.parametrizations.weight.original0.mul_(2)  # g
    x = torch.randn(3, 8)
    stock = torch.export.export(model, (x,))
    ep = paramfold.export(model, (x,))
    assert torch.equal(ep.module()(x), model(x)) and torch.equal(ep.module()(x), stock.module()(x))
    plain = paramfold.plain_state_dict(model)
    assert sorted(ep.state_dict) == sorted(plain)
    for key, value in plain.items():
        assert torch.equal(ep.state_dict[key], value), key
    # disabling the adapter is a different program: the original layer's
    with model.disable_adapter():
        assert torch.equal(paramfold.export(model, (x,)).module()(x), model(x))


def test_export_refuses_a_copy_that_is_not_the_model():
    class OwnCopy(nn.Sequential):
        def __deepcopy__(self, memo):
            return nn.Sequential(*copy.deepcopy(list(self), memo)[:1])

    model = OwnCopy(weight_norm(nn.Linear(4, 4)), nn.Tanh())
    with pytest.raises(paramfold.FoldError, match=r"module '1' and what follows differ.*torch\.export\.export"):
        paramfold.export(model, (torch.randn(2, 4),))


@pytest.mark.parametrize("mode", MODES)
def test_deepcopy_of_a_wrapper_around_a_prepared_model_copies_what_stock_copies(mode):
    # Regression: copy.deepcopy(torch.compile(prepared)) returned a copy of the bare model, not an
    # OptimizedModule as stock's: copy.deepcopy found the prepared class's __deepcopy__ through
    # OptimizedModule's forwarding __getattr__ (stock's Sequential has none). AveragedModel(compiled)
    # then had other state_dict keys than stock's ("module.0.bias" for "module._orig_mod.0.bias")
    # and the two runs' EMA checkpoints did not load into each other.
    from torch.optim.swa_utils import AveragedModel

    def build(prepared):
        torch.manual_seed(0)
        model = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 2))
        return torch.compile(paramfold.prepare(model, mode) if prepared else model, backend="eager")

    stock, ours = build(False), build(True)
    twins = copy.deepcopy(stock), copy.deepcopy(ours)
    assert [type(t).__name__ for t in twins] == ["OptimizedModule", "OptimizedModule"]
    x = torch.randn(3, 4)
    assert torch.equal(twins[1](x), twins[0](x)) and torch.equal(twins[1](x), stock(x))
    emas = AveragedModel(stock), AveragedModel(ours)
    assert list(emas[0].state_dict()) == list(emas[1].state_dict())
    emas[1].load_state_dict(emas[0].state_dict())
    paramfold.restore(twins[1]._orig_mod)


# Accelerate's big-model offload (``cpu_offload``, ``disk_offload``) keeps every parameter and
# buffer on the meta device between calls and loads it in a hook that its wrapper of each
# module's ``forward`` (an instance attribute) runs; PEFT depends on it, so it is installed here.
accelerate = pytest.importorskip("accelerate")


@pytest.mark.parametrize("offload", ["cpu_offload", "disk_offload"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_accelerate_offload_then_prepare_computes_like_stock_offload(offload, mode, train, tmp_path):
    def offloaded(prepare_first: bool) -> nn.Module:
        model = _net(lambda m: m).train(train)
        if prepare_first:
            paramfold.prepare(model, mode)
        kwargs = {"offload_dir": str(tmp_path / str(prepare_first))} if offload == "disk_offload" else {}
        getattr(accelerate, offload)(model, execution_device="cpu", **kwargs)
        if not prepare_first:
            paramfold.prepare(model, mode)
        return model

    stock = _net(lambda m: m).train(train)
    getattr(accelerate, offload)(stock, execution_device="cpu",
                                 **({"offload_dir": str(tmp_path / "stock")} if offload == "disk_offload" else {}))
    ours = offloaded(prepare_first=False)
    assert ours[0].parametrizations.weight.original.device.type == "meta"  # offloaded between calls, as stock's
    x = torch.randn(4, 6)
    with torch.set_grad_enabled(train):
        for call in range(3):  # spectral_norm's power iteration runs at each training call
            assert torch.equal(ours(x), stock(x)), call
    # Prepared first, the hooks accelerate adds to the chain's members are served too, except by
    # inline, whose getter calls each member's forward itself: refused at the call, model intact.
    first = offloaded(prepare_first=True)
    if mode == "inline":
        with pytest.raises(paramfold.FoldError, match="with mode='inline', a hook added"):
            first(x)
    else:
        fresh = _net(lambda m: m).train(train)
        getattr(accelerate, offload)(fresh, execution_device="cpu",
                                     **({"offload_dir": str(tmp_path / "fresh")} if offload == "disk_offload" else {}))
        with torch.set_grad_enabled(train):
            for call in range(3):
                assert torch.equal(first(x), fresh(x)), call
