"""Hooks registered *during* a call: a forward pre-hook (from a forward hook of an earlier layer)
that edits a later layer's originals in place before its forward reads them, a global forward
hook, a hook on a chain's own modules; and a pre-hook there for some calls only.

Stock's read of the layer's tensor (a parametrization's, or a hook-based norm's hook) computes
from the edited originals; a value the call scope computed when the call began was computed
before the edit. Every call is compared bitwise with stock's: outputs, gradients of every
parameter after a backward and an SGD step, buffers (spectral_norm's ``u``/``v``), and a hook-based
norm's ``weight`` attribute, over several calls (the plan's steady calls too).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.modules.module import (_global_forward_hooks, _global_forward_pre_hooks, register_module_forward_hook,
                                     register_module_forward_pre_hook)
from torch.nn.utils import parametrizations, parametrize

import paramfold

KINDS = ["weight_norm", "spectral_norm", "hook weight_norm", "hook spectral_norm"]


def _normed(kind: str, layer: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the hook-based API
        return {
            "weight_norm": parametrizations.weight_norm,
            "spectral_norm": parametrizations.spectral_norm,
            "hook weight_norm": nn.utils.weight_norm,
            "hook spectral_norm": nn.utils.spectral_norm,
        }[kind](layer)


def _originals(layer: nn.Module) -> list[torch.Tensor]:
    if hasattr(layer, "parametrizations"):
        return list(layer.parametrizations.weight.parameters())
    return [p for n, p in layer.named_parameters() if n.startswith("weight_")]


def _edit(layer: nn.Module, args: tuple) -> None:
    """Changes every original of ``layer.weight`` in place (spectral_norm's value is scale-free:
    a pattern is added, not a factor applied), at the first call of ``layer`` after it was
    registered (a second edit would change tensors stock's first call saved for backward)."""
    if layer is not _edit.target:  # a global hook runs at every module's call
        return
    _edit.target = None
    with torch.no_grad():
        for t in _originals(layer):
            t.add_(torch.linspace(-0.3, 0.5, t.numel()).reshape(t.shape))


class _Net(nn.Module):
    """``a``'s forward hook registers :func:`_edit` on ``b`` (``where``: appended, prepended, or
    as a global hook), which edits at ``b``'s first call; ``b`` is called twice (a discriminator
    scoring two batches); the forward removes the hook at its end."""

    def __init__(self, kind: str, where: str):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = _normed(kind, nn.Linear(6, 8))
        self.where = where
        self.handles: list = []
        self.a.register_forward_hook(self._arm)

    def _arm(self, module, args, out):
        _edit.target = self.b
        if self.where == "global":
            self.handles.append(register_module_forward_pre_hook(_edit))
        else:
            self.handles.append(self.b.register_forward_pre_hook(_edit, prepend=self.where == "prepend"))

    def forward(self, x):
        try:
            h = self.a(x)
            return self.b(h) + self.b(h.flip(0))
        finally:
            while self.handles:
                self.handles.pop().remove()


def _same(stock: nn.Module, ours: nn.Module) -> None:
    for (n, s), (_, o) in zip(stock.state_dict(keep_vars=True).items(), ours.state_dict(keep_vars=True).items(),
                              strict=True):
        assert torch.equal(s, o), n
    if hasattr(stock.b, "weight_orig") or hasattr(stock.b, "weight_g"):
        assert torch.equal(stock.b.weight, ours.b.weight)


def _stepped_like_stock(stock: nn.Module, ours: nn.Module, out_s: torch.Tensor, out_o: torch.Tensor, what: str) -> bool:
    """A backward of each output and an SGD step of each model, gradients bitwise equal; False
    where stock's backward raised, as ours then must: an edit after the tensors were computed
    (a hook appended after a hook-based norm's own) changed what stock's autograd saved."""
    try:
        out_s.square().sum().backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out_o.square().sum().backward()
        return False
    out_o.square().sum().backward()
    with torch.no_grad():
        for (n, ps), (_, po) in zip(stock.named_parameters(), ours.named_parameters(), strict=True):
            assert torch.equal(ps.grad, po.grad), f"{what}: grad of {n}"
            ps.sub_(0.1 * ps.grad)
            po.sub_(0.1 * po.grad)
            ps.grad = po.grad = None
    return True


def _calls_like_stock(build, mode: str, train: bool, calls: int = 4,
                      before=lambda step, models: None) -> tuple[nn.Module, nn.Module]:
    """``calls`` calls of a stock model and one prepared in ``mode``, both made by ``build`` from
    one seed (in training, each followed by a backward and an SGD step), ``before(step, models)``
    before each: everything bitwise equal."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        net = build().train(train)
        models.append(net if train else net.requires_grad_(False))
    stock, ours = models
    paramfold.prepare(ours, mode)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    for step in range(calls):
        before(step, models)
        with torch.set_grad_enabled(train):
            out_s = stock(x)
            out_o = ours(x)
        assert torch.equal(out_s, out_o), f"call {step}: off by {(out_s - out_o).abs().max()}"
        if train and not _stepped_like_stock(stock, ours, out_s, out_o, f"call {step}"):
            break
        _same(stock, ours)
    return stock, ours


@pytest.mark.parametrize("where", ["append", "prepend", "global"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("mode", "train"), [("hoist", False), ("freeze", False), ("auto", False), ("inline", False),
                                              ("hoist", True), ("auto", True), ("inline", True)])
def test_a_pre_hook_registered_during_a_call_that_edits_a_layers_originals_is_followed_like_stock(
        kind, where, mode, train):
    # Regression: hoist, freeze and auto served the call the value computed when it began, before
    # the edit: under no_grad silently off (0.51 on a weight_norm layer); with grad the backward
    # raised autograd's "modified by an inplace operation" where stock's trains.
    stock, ours = _calls_like_stock(lambda: _Net(kind, where), mode, train)
    assert not ours.handles and not _forward_pre_hooks_left(ours)
    paramfold.restore(ours)
    _same(stock, ours)


def _forward_pre_hooks_left(model: nn.Module) -> list:
    return [h for m in model.modules() for h in m._forward_pre_hooks.values() if h is _edit] + [
        h for h in _global_forward_pre_hooks.values() if h is _edit]


def _noted_u(layer: nn.Module, args: tuple) -> None:
    """Notes what a training spectral_norm's power iteration has made of ``u`` so far."""
    u = layer.weight_u if hasattr(layer, "weight_u") else layer.parametrizations.weight[0]._u
    _noted_u.seen.append(u.clone())


class _Notes(_Net):
    """``a``'s forward hook registers :func:`_noted_u` on ``b`` for the rest of the call."""

    def _arm(self, module, args, out):
        self.handles.append(self.b.register_forward_pre_hook(_noted_u, prepend=self.where == "prepend"))


@pytest.mark.parametrize("where", ["append", "prepend"])
@pytest.mark.parametrize("kind", ["spectral_norm", "hook spectral_norm"])
@pytest.mark.parametrize("mode", ["hoist", "auto", "inline"])
def test_a_pre_hook_registered_during_a_training_call_runs_in_stocks_order_at_each_later_call(kind, where, mode):
    # Regression: a training hook-based spectral_norm's later calls in the call ran the norm's
    # power iteration after every pre-hook, where one appended after the norm's own runs after it
    # in stock: the hook saw u one iteration behind.
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(_Notes(kind, where).train())
    stock, ours = models
    paramfold.prepare(ours, mode)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        seen = []
        for model in (stock, ours):
            _noted_u.seen = []
            out = model(x)
            out.square().sum().backward()
            seen.append((out, _noted_u.seen))
        (out_s, us_s), (out_o, us_o) = seen
        assert torch.equal(out_s, out_o), f"call {step}"
        assert len(us_s) == len(us_o) == 2 and all(map(torch.equal, us_s, us_o)), f"call {step}"
        _same(stock, ours)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("mode", "train"), [("auto", False), ("hoist", True)])
def test_a_pre_hook_registered_inside_compiled_code_is_followed_like_stocks_compiled_model(kind, mode, train):
    # Compiled, the hook is registered while dynamo traces the forward; stock's compiled model
    # then differs from its eager one (torch's behaviour), and the prepared one's is the same.
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        net = _Net(kind, "prepend").train(train)
        models.append(net if train else net.requires_grad_(False))
    stock, ours = models
    paramfold.prepare(ours, mode)
    torch._dynamo.reset()
    runs = [torch.compile(m, backend="aot_eager") for m in models]
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        with torch.set_grad_enabled(train):
            out_s, out_o = (run(x) for run in runs)
        assert torch.equal(out_s, out_o), f"call {step}: off by {(out_s - out_o).abs().max()}"
        if train and not _stepped_like_stock(stock, ours, out_s, out_o, f"call {step}"):
            break
        _same(stock, ours)


def _scale_members(module, args, out):
    """A global forward hook that changes what a parametrization's modules return."""
    if isinstance(module, parametrize.ParametrizationList):
        return out * 1.5


class _ArmsAGlobalForwardHook(_Net):
    def _arm(self, module, args, out):
        self.handles.append(register_module_forward_hook(_scale_members))


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize(("mode", "train"), [("hoist", False), ("freeze", False), ("auto", False), ("inline", False),
                                              ("hoist", True), ("auto", True)])
def test_a_global_forward_hook_registered_during_a_call_runs_at_each_later_read_like_stock(kind, mode, train):
    # Regression: stock's reads after the registration call the chain's modules, so the hook;
    # hoist, freeze and auto served the value computed when the call began (1.38 off).
    stock, ours = _calls_like_stock(lambda: _ArmsAGlobalForwardHook(kind, "global"), mode, train)
    assert not ours.handles and _scale_members not in _global_forward_hooks.values()


def _list_edit(plist, args):
    """Edits the list's originals in place, at its first call after it was registered."""
    if _list_edit.armed:
        _list_edit.armed = False
        with torch.no_grad():
            for t in plist.parameters(recurse=False):
                t.add_(torch.linspace(-0.3, 0.5, t.numel()).reshape(t.shape))


_CHAIN_HOOKS = {
    "member forward hook": lambda plist: plist[0].register_forward_hook(lambda m, a, o: o * 1.5),
    "member pre-hook": lambda plist: plist[0].register_forward_pre_hook(lambda m, a: tuple(t + 0.25 for t in a)),
    "list forward hook": lambda plist: plist.register_forward_hook(lambda m, a, o: o * 1.5),
    "list pre-hook editing originals": lambda plist: plist.register_forward_pre_hook(_list_edit),
}


class _ArmsAChainHook(_Net):
    def _arm(self, module, args, out):
        _list_edit.armed = True
        self.handles.append(_CHAIN_HOOKS[self.where](self.b.parametrizations.weight))


@pytest.mark.parametrize("where", list(_CHAIN_HOOKS))
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize(("mode", "train"), [("hoist", False), ("freeze", False), ("auto", False), ("inline", False),
                                              ("hoist", True), ("auto", True)])
def test_a_hook_registered_during_a_call_on_a_chains_own_modules_runs_at_each_later_read_like_stock(
        kind, where, mode, train):
    # Regression (helper finding F2): stock's reads after the registration run the hook; hoist,
    # freeze and auto served the value computed when the call began (0.55 off; a list's pre-hook
    # editing the originals never ran, the state_dict differed after restore).
    stock, ours = _calls_like_stock(lambda: _ArmsAChainHook(kind, where), mode, train)
    paramfold.restore(ours)
    _same(stock, ours)


class _HookOnceThenEditsInTheForward(_Net):
    """Call 0: ``a``'s forward hook registers a pre-hook on ``b`` (which does nothing); call 1:
    the forward edits ``b``'s originals in place before calling it (a momentum update)."""

    def __init__(self, kind: str):
        super().__init__(kind, "append")
        self.calls = 0

    def _arm(self, module, args, out):
        if self.calls == 0:
            self.handles.append(self.b.register_forward_pre_hook(lambda m, a: None))

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            with torch.no_grad():
                for t in _originals(self.b):
                    t.mul_(0.5).add_(0.25)
        return super().forward(x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto"])
def test_an_edit_in_the_forward_after_a_call_that_met_a_new_pre_hook_is_seen_like_stock(kind, mode):
    # The nested checks built after call 0 gave its values up for the rest of the call (a new
    # pre-hook) leave those sites out; the next call serves them again, and its checks must see
    # the edit its forward makes before the layer's call. (A stale check was met through the
    # chain-hook test above: 40 of its cases failed with the checks kept.)
    _calls_like_stock(lambda: _HookOnceThenEditsInTheForward(kind), mode, train=False)


@pytest.mark.parametrize("where", ["prepend", "global"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_pre_hook_registered_during_a_call_before_a_compiled_layers_call_is_followed_like_stock(kind, where):
    # The layer compiled on its own (layer.compile()) inside an eager forward: its call is checked
    # where the call of a compiled module nested in a scope is (scope_entry._scoped_compiled_call).
    def compile_the_layers(step, models):
        if step == 0:
            torch._dynamo.reset()
            for model in models:
                model.b.compile(backend="aot_eager")

    _calls_like_stock(lambda: _Net(kind, where), "auto", train=False, calls=3, before=compile_the_layers)


class _EditsBeforeEachCall(nn.Module):
    """A momentum-style update of ``b``'s originals in place in every forward, before ``b``'s call."""

    def __init__(self, kind: str):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = _normed(kind, nn.Linear(6, 8))

    def forward(self, x):
        with torch.no_grad():
            for t in _originals(self.b):
                t.mul_(0.97)
        return self.b(self.a(x))


@pytest.mark.parametrize("calls", [(1, 3), (2, 3), (4, 5)], ids=["calls 1-2", "call 2", "call 4"])
@pytest.mark.parametrize("on", ["layer", "root", "global"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("mode", "train"), [("hoist", False), ("freeze", False), ("auto", False),
                                              ("hoist", True), ("auto", True)])
def test_an_edit_in_the_forward_is_seen_after_a_pre_hook_that_was_there_for_some_calls_is_removed(
        kind, mode, train, on, calls):
    # Regression (helpers' findings, older than the mid-call checks): while the pre-hook was
    # there, the layer's values were computed where read; after its removal they were served
    # again, but the nested checks built meanwhile (calls 1-2), or the plan of the steady call
    # before (calls 2, 4: kept aside, taken up again with the sites' flags of the hooked call),
    # left them out, and the forward's edit was not seen: values one edit behind (0.03-0.09 off).
    handles = []

    def hook_for_some_calls(step, models):
        if step == calls[0]:
            if on == "global":
                handles.append(register_module_forward_pre_hook(lambda module, args: None))
            for m in models if on != "global" else ():
                handles.append((m.b if on == "layer" else m).register_forward_pre_hook(lambda module, args: None))
        if step == calls[1]:
            while handles:
                handles.pop().remove()

    _calls_like_stock(lambda: _EditsBeforeEachCall(kind), mode, train, calls=7, before=hook_for_some_calls)
