"""paramfold.export: the plain model's program, stock outputs bitwise, the model left unchanged."""

from __future__ import annotations

import copy
import os
import re
import tempfile

import pytest
import torch
import torch.nn.functional as F
from helpers import build, seed_model
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import paramfold
import paramfold.testing as pt
from paramfold.export import folded_copy

KINDS = ["weight_norm", "spectral_norm", "orthogonal", "split", "chain", "buffer", "lora"]


def ops(program: torch.export.ExportedProgram) -> list[str]:
    return [str(node.target) for node in program.graph.nodes if node.op == "call_function"]


def plain_twin(model: nn.Module, plain: nn.Module) -> nn.Module:
    """``plain`` (same architecture, no parametrizations) holding ``model``'s materialised tensors."""
    plain.load_state_dict(paramfold.plain_state_dict(model), strict=True)
    return plain.train(model.training)


class Vocoder(nn.Module):
    """HiFi-GAN-like: weight_norm Conv1d / ConvTranspose1d with leaky ReLU residual blocks."""

    def __init__(self, parametrized: bool = True, channels: int = 16):
        super().__init__()
        wn = weight_norm if parametrized else (lambda m: m)
        self.pre = wn(nn.Conv1d(8, channels, 7, padding=3))
        self.up = nn.ModuleList(
            wn(nn.ConvTranspose1d(channels // 2**i, channels // 2 ** (i + 1), 4, stride=2, padding=1)) for i in range(2)
        )
        self.res = nn.ModuleList(
            wn(nn.Conv1d(channels // 2 ** (i + 1), channels // 2 ** (i + 1), 3, padding=d, dilation=d))
            for i, d in enumerate((1, 3))
        )
        self.post = wn(nn.Conv1d(channels // 4, 1, 7, padding=3))

    def forward(self, x):
        x = self.pre(x)
        for up, res in zip(self.up, self.res):
            x = up(nn.functional.leaky_relu(x, 0.1))
            x = x + res(nn.functional.leaky_relu(x, 0.1))
        return torch.tanh(self.post(nn.functional.leaky_relu(x)))


class Discriminator(nn.Module):
    """A spectral_norm conv discriminator (GAN style)."""

    def __init__(self, parametrized: bool = True):
        super().__init__()
        sn = spectral_norm if parametrized else (lambda m: m)
        self.convs = nn.ModuleList(
            [sn(nn.Conv2d(3, 8, 3, stride=2, padding=1)), sn(nn.Conv2d(8, 16, 3, stride=2, padding=1))]
        )
        self.head = sn(nn.Linear(16 * 4 * 4, 1))

    def forward(self, x):
        for conv in self.convs:
            x = nn.functional.leaky_relu(conv(x), 0.2)
        return self.head(x.flatten(1))


def _cases():
    torch.manual_seed(0)
    return {
        "vocoder": (Vocoder().eval(), lambda: Vocoder(False), (torch.randn(2, 8, 32),)),
        "discriminator": (Discriminator().eval(), lambda: Discriminator(False), (torch.randn(2, 3, 16, 16),)),
        "seed": (seed_model(), lambda: seed_model(parametrized=False), (torch.randn(3, 64, dtype=torch.bfloat16),)),
        **{kind: (build(kind).eval(), lambda kind=kind: _plain_net(kind), (torch.randn(4, 32),)) for kind in KINDS},
    }


def _plain_net(kind: str) -> nn.Module:
    net = build("plain")
    if kind == "buffer":  # build("buffer") parametrizes a buffer "shift" that forward does not read
        for layer in net.layers:
            layer.register_buffer("shift", torch.zeros(32))
    return net


@pytest.mark.parametrize("case", ["vocoder", "discriminator", "seed", *KINDS])
def test_export_is_the_plain_program_with_stock_outputs(case):
    model, make_plain, args = _cases()[case]
    before = pt.structure(model)
    expected = model(*args)

    ep = paramfold.export(model, args)
    plain = plain_twin(model, make_plain())
    plain_ep = torch.export.export(plain, args)

    assert ops(ep) == ops(plain_ep)
    assert torch.equal(ep.module()(*args), expected)  # bitwise, eager CPU
    # The folded tensors are parameters (or buffers) under the unparametrized names.
    assert ep.state_dict.keys() | ep.constants.keys() == plain_ep.state_dict.keys() | plain_ep.constants.keys()
    folded = paramfold.plain_state_dict(model)
    assert all(torch.equal(v, folded[k]) for k, v in ep.state_dict.items())
    pt.assert_same_structure(before, pt.structure(model))
    assert torch.equal(model(*args), expected)


@pytest.mark.parametrize("case", ["vocoder", "discriminator", "seed"])
def test_stock_export_carries_the_parametrization_math(case):
    # The problem export solves (pytorch #167645): stock's program has more ops than the plain one.
    model, make_plain, args = _cases()[case]
    stock = ops(torch.export.export(model, args))
    plain = ops(torch.export.export(plain_twin(model, make_plain()), args))
    assert len(stock) > len(plain)
    if case == "vocoder":
        assert stock.count("aten._weight_norm.default") == 6  # one per conv


def test_the_copy_keeps_the_originals_classes_and_shares_plain_tensors():
    model = build("weight_norm").eval()
    cls = type(model.layers[0])
    plain = folded_copy(model)
    # The original's per-instance class still has its property (remove_parametrizations on a
    # deepcopy would delete it from the class both share).
    assert isinstance(vars(cls)["weight"], property)
    assert type(model.layers[0]) is cls and parametrize.is_parametrized(model.layers[0], "weight")
    assert type(plain.layers[0]) is nn.Linear and not parametrize.is_parametrized(plain.layers[0])
    assert plain.layers[0].bias is model.layers[0].bias
    assert isinstance(plain.layers[0].weight, nn.Parameter)
    assert plain.layers[0].weight.requires_grad


def test_a_prepared_model_exports_plain_and_stays_prepared():
    model, make_plain, args = _cases()["vocoder"]
    paramfold.prepare(model, "auto")
    prepared_classes = [type(m) for m in model.modules()]
    expected = model(*args)
    ep = paramfold.export(model, args)
    assert ops(ep) == ops(torch.export.export(plain_twin(model, make_plain()), args))
    assert torch.equal(ep.module()(*args), expected)
    assert [type(m) for m in model.modules()] == prepared_classes
    assert torch.equal(model(*args), expected)
    paramfold.restore(model)
    assert type(model.pre).__name__ == "ParametrizedConv1d"


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("mode", ["inline", "hoist", "auto"])
def test_torch_export_of_a_prepared_model_leaves_it_real(mode):
    # Regression (found by the 2026-12-02 entry-point hunt): torch.export put back copies of
    # the inline getters' dicts that held its fake tensors; until the next eager call, a
    # compiled closure calling the model returned a FakeTensor, and deepcopy and
    # paramfold.export raised "Cannot access data pointer".
    torch.manual_seed(0)
    stock = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.ReLU(), spectral_norm(nn.Linear(4, 4))).eval()
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.export.export(ours, (x,))
        fakes = [k for m in ours.modules() for k, v in vars(m).items()
                 if any(type(t).__name__ == "FakeTensor" for t in (v.values() if hasattr(v, "values") else [v]))]
        assert fakes == []
        closure = torch.compile(lambda x: ours(x) * 2, backend="eager")
        out = closure(x)
        assert type(out) is torch.Tensor and torch.equal(out, stock(x) * 2)
        twin = copy.deepcopy(ours)
        assert torch.equal(twin(x), stock(x))
        assert torch.equal(paramfold.export(ours, (x,)).module()(x), stock(x))
        assert torch.equal(ours(x), stock(x))


def test_shared_module_is_folded_once_like_a_tied_plain_model():
    model = build("weight_norm").eval()
    model.layers[2] = model.layers[1]
    plain = build("plain")
    plain.layers[2] = plain.layers[1]
    x = torch.randn(2, 32)
    ep = paramfold.export(model, (x,))
    plain_ep = torch.export.export(plain_twin(model, plain), (x,))
    assert ops(ep) == ops(plain_ep)
    assert sorted(ep.state_dict) == sorted(plain_ep.state_dict)
    assert torch.equal(ep.module()(x), model(x))


def test_tied_originals_under_different_chains_fold_to_their_own_values():
    model = build("chain").eval()
    model.layers[2].parametrizations.weight.original0 = model.layers[1].parametrizations.weight.original0
    x = torch.randn(2, 32)
    ep = paramfold.export(model, (x,))
    assert torch.equal(ep.module()(x), model(x))


def test_filter_fn_leaves_excluded_modules_stock():
    model = build("weight_norm").eval()
    x = torch.randn(2, 32)
    ep = paramfold.export(model, (x,), filter_fn=lambda module, fqn: fqn != "layers.0")
    assert sum("weight_norm" in op for op in ops(ep)) == 1
    assert "layers.0.parametrizations.weight.original0" in ep.state_dict
    assert torch.equal(ep.module()(x), model(x))


def _legacy_model(parametrized: bool = True) -> nn.Module:
    """HiFi-GAN style: torch's deprecated hook-based weight_norm / spectral_norm (not parametrize)."""
    import warnings

    torch.manual_seed(0)
    wn = nn.utils.weight_norm if parametrized else (lambda m: m)
    sn = nn.utils.spectral_norm if parametrized else (lambda m: m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return nn.Sequential(wn(nn.Conv1d(4, 8, 3, padding=1)), nn.Tanh(), sn(nn.Conv1d(8, 4, 3, padding=1))).eval()


def test_hook_based_norms_are_folded_too_and_the_model_keeps_its_hooks():
    model = _legacy_model()
    x = torch.randn(2, 4, 16)
    expected = model(x)  # the hooks have run: module.weight is a non-leaf, which deepcopy refuses
    before = pt.structure(model)
    ep = paramfold.export(model, (x,))
    stock = ops(torch.export.export(model, (x,)))
    assert "aten._weight_norm.default" in stock and "aten.mv.default" in stock
    plain = _legacy_model(parametrized=False)
    plain.load_state_dict({k: v for k, v in ep.state_dict.items()})
    assert ops(ep) == ops(torch.export.export(plain, (x,)))
    assert sorted(ep.state_dict) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert torch.equal(ep.module()(x), expected)
    pt.assert_same_structure(before, pt.structure(model))
    assert [len(m._forward_pre_hooks) for m in (model[0], model[2])] == [1, 1]
    assert torch.equal(model(x), expected)


def test_a_folded_copy_of_hook_based_norms_loads_its_own_state_dict_as_a_plain_model_does():
    # Regression (helper-239): torch's remove_spectral_norm missed its load hook, which torch 2.13
    # keeps wrapped: the folded copy asked every load_state_dict for weight_orig and weight_u.
    model = _legacy_model()
    x = torch.randn(2, 4, 16)
    expected = model(x)
    plain = folded_copy(model)
    assert [len(m._load_state_dict_pre_hooks) for m in plain.modules()] == [0] * len(list(plain.modules()))
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    with torch.no_grad():
        for t in plain.state_dict().values():
            t.zero_()
    plain.load_state_dict(state)  # strict
    assert torch.equal(plain(x), expected)
    fresh = _legacy_model(parametrized=False)
    fresh.load_state_dict(state)
    assert torch.equal(fresh(x), expected)


def test_hook_based_spectral_norm_in_training_mode_is_refused():
    model = _legacy_model().train()
    with pytest.raises(paramfold.FoldError, match="spectral_norm in training mode.*model.eval"):
        paramfold.export(model, (torch.randn(2, 4, 16),))


def test_hook_based_spectral_norm_refusal_names_the_tensor_and_filter_fn():
    model = _legacy_model().train()
    with pytest.raises(paramfold.FoldError, match=r"2\.weight \(hook-based spectral_norm\).*filter_fn"):
        paramfold.export(model, (torch.randn(2, 4, 16),))


@pytest.mark.parametrize("train", [False, True])
def test_filter_fn_leaves_excluded_hook_based_norms_stock(train):
    # filter_fn used to be asked about parametrizations only: an excluded hook-based norm was
    # folded anyway, and an excluded training spectral_norm refused.
    model = _legacy_model().train(train)
    x = torch.randn(2, 4, 16)
    asked = []

    def keep_stock(module, fqn):
        asked.append(fqn)
        return fqn != "2"

    plain = folded_copy(model, filter_fn=keep_stock)
    assert sorted(asked) == ["0", "2"]
    assert sorted(n for n, _ in plain.named_parameters()) == ["0.bias", "0.weight", "2.bias", "2.weight_orig"]
    assert len(plain[0]._forward_pre_hooks) == 0 and len(plain[2]._forward_pre_hooks) == 1
    stock = _legacy_model().train(train)
    assert torch.equal(plain(x), stock(x))
    if train:  # the excluded layer's power iteration runs in the copy as in stock
        assert torch.equal(plain[2].weight_u, stock[2].weight_u)
    else:
        ep = paramfold.export(model, (x,), filter_fn=keep_stock)
        assert "2.weight_orig" in ep.state_dict and "0.weight" in ep.state_dict
        assert torch.equal(ep.module()(x), model(x))


@pytest.mark.parametrize("mode", [None, "hoist", "auto", "freeze", "inline"])
@pytest.mark.parametrize("norm", ["hook_spectral_norm", "weight_norm"])
def test_a_folded_copy_saves_whole_and_deep_copies(mode, norm):
    # A prepared model's copy kept paramfold's read-once hooks on a hook-based spectral_norm layer
    # (torch.save failed, deepcopy after a grad call too); the weight_norm parametrization's
    # load-time hook, a local function of torch's, made torch.save fail on any folded copy.
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    if norm == "weight_norm":
        weight_norm(model[2])
    else:
        nn.utils.spectral_norm(model[2])
    model.eval()
    x = torch.randn(2, 4)
    if mode == "freeze":
        model.requires_grad_(False)
    if mode is not None:
        paramfold.prepare(model, mode)
    model(x)
    plain = folded_copy(model)
    assert [k for m in plain.modules() for k in vars(m) if "paramfold" in k] == []
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(x), model(x))
    assert torch.equal(copy.deepcopy(plain)(x), model(x))


def test_spectral_norm_in_training_mode_is_refused_and_nothing_moves():
    model = build("spectral_norm").train()
    before = pt.structure(model)
    with pytest.raises(paramfold.FoldError, match="training mode.*model.eval"):
        paramfold.export(model, (torch.randn(2, 32),))
    pt.assert_same_structure(before, pt.structure(model))  # the power iteration did not run (u, v unchanged)


@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
def test_a_part_of_a_prepared_model_exports_as_the_same_part_unprepared_and_leaves_the_model_alone(mode):
    # Regression: paramfold.export(prepared.layers[0]) raised KeyError '_paramfold': the copy, part
    # of no copied prepared model, was restored as an orphan through the original's own state
    # (shared by export's memo), which also removed the original's load_state_dict hook (inline)
    # and released its frozen values.
    stock = build("weight_norm").eval()
    model = paramfold.prepare(copy.deepcopy(stock).requires_grad_(mode != "freeze"), mode)
    x = torch.randn(2, 32)
    with torch.no_grad():
        model(x)
    before = pt.structure(model)
    hooks = {path: dict(m._load_state_dict_post_hooks) for path, m in model.named_modules()}
    ep = paramfold.export(model.layers[0], (x,))
    assert ops(ep) == ops(paramfold.export(stock.layers[0], (x,)))
    assert torch.equal(ep.module()(x), stock.layers[0](x))
    pt.assert_same_structure(before, pt.structure(model))
    assert hooks == {path: dict(m._load_state_dict_post_hooks) for path, m in model.named_modules()}
    with torch.no_grad():
        assert torch.equal(model(x), stock(x))


class _SharedTwice(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.lin = norm(nn.Linear(4, 4))
        self.again = self.lin  # one layer at two paths: non-strict export calls it through a proxy per path

    def forward(self, x):
        return self.again(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
@pytest.mark.parametrize("norm", [weight_norm, spectral_norm], ids=["weight_norm", "spectral_norm"])
def test_non_strict_export_under_cached_computes_a_shared_layers_tensor_once_as_stock(norm, mode):
    # Regression: inside parametrize.cached(), the prepared model's program computed a layer's
    # tensor at each of its paths (two _weight_norm ops): its descriptors keyed the cache by the
    # object they were read through, torch.fx's per-path proxy, where stock's keys the module.
    torch.manual_seed(0)
    stock = _SharedTwice(norm).eval()
    model = paramfold.prepare(copy.deepcopy(stock).requires_grad_(mode != "freeze"), mode)
    x = torch.randn(2, 4)
    with parametrize.cached():
        want = torch.export.export(stock, (x,), strict=False)
        got = torch.export.export(model, (x,), strict=False)
    assert ops(got) == ops(want)
    assert sum(op in ("aten._weight_norm.default", "aten.vdot.default") for op in ops(got)) == 1
    assert torch.equal(got.module()(x), want.module()(x))


class _EmaInEval(nn.Module):
    """Updates its buffer at every computation, in eval mode too."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(32, 32))

    def forward(self, w):
        self.ema.mul_(0.5).add_(w.detach())
        return w + self.ema


class _WeightNoise(nn.Module):
    def forward(self, w):
        return w + 0.01 * torch.randn_like(w)


class _GradBranch(nn.Module):
    def forward(self, w):
        return w * 2 if torch.is_grad_enabled() else w


class _Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, w):
        self.calls += 1
        return w * self.calls


@pytest.mark.parametrize("mode", [None, "hoist", "inline", "auto"])
@pytest.mark.parametrize("member, why", [
    (_EmaInEval, "it changes its buffers, in eval mode too"),
    (_WeightNoise, "it draws random numbers"),
    (_GradBranch, "it computes another value with grad enabled than under no_grad"),
    (_Counter, "it changes its own attributes, buffers or originals"),
], ids=["ema_in_eval", "noise", "grad_branch", "counter"])
def test_a_chain_computed_at_every_call_is_refused_and_nothing_moves(member, why, mode):
    # Regression: export folded these to the value computed at export time, where stock's program
    # computes them at every call (an EMA moving, fresh noise, the branch of the call's grad mode),
    # and computing the EMA's value moved the user's buffer.
    model = build("plain").eval()
    parametrize.register_parametrization(model.layers[1], "weight", member())
    if mode is not None:
        if mode == "hoist" and member is not _EmaInEval:
            with pytest.raises(paramfold.FoldError):
                paramfold.prepare(model, mode)  # documented: served by auto and inline only
            return
        paramfold.prepare(model, mode)
    before = pt.structure(model)
    with pytest.raises(paramfold.FoldError, match=rf"cannot export layers\.1\.weight \(custom: {why}\) folded.*filter_fn"):
        paramfold.export(model, (torch.randn(2, 32),))
    pt.assert_same_structure(before, pt.structure(model))
    ep = paramfold.export(model, (torch.randn(2, 32),), filter_fn=lambda m, fqn: fqn != "layers.1")
    assert "layers.1.parametrizations.weight.original" in ep.state_dict


class _EmaThroughData(nn.Module):
    """An eval-mode EMA written through ``.data``: no version counter moves, so find() does not see it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(32, 32))

    def forward(self, w):
        self.ema.data.mul_(0.5).add_(w.detach())
        return w + self.ema


def test_a_chain_writing_its_buffer_through_data_is_stopped_before_the_write_and_refused():
    # Regression (helper-220): export computed the value on the model itself and the EMA moved.
    model = build("plain").eval()
    parametrize.register_parametrization(model.layers[1], "weight", _EmaThroughData(), unsafe=True)
    before = pt.structure(model)
    ema = model.layers[1].parametrizations.weight[0].ema.clone()
    with pytest.raises(paramfold.FoldError, match=r"cannot export layers\.1\.weight \(custom\) folded: computing it "
                                                  r"would write one of the model's tensors.*model is unchanged.*filter_fn"):
        paramfold.export(model, (torch.randn(2, 32),))
    assert torch.equal(model.layers[1].parametrizations.weight[0].ema, ema)
    pt.assert_same_structure(before, pt.structure(model))


class _EmaRebindingData(nn.Module):
    """An old-style EMA: ``.data`` rebound to a new tensor, which no op shows."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(32, 32))

    def forward(self, w):
        self.ema.data = 0.5 * self.ema.data + w.detach()
        return w + self.ema


class _EmaThroughNumpy(_EmaRebindingData):
    def forward(self, w):
        a = self.ema.numpy()
        a *= 0.5
        a += w.detach().numpy()
        return w + self.ema


class _EmaOfAnotherModule(nn.Module):
    """Updates a buffer of another module of the model, held in a list (no tensor of its chain)."""

    def __init__(self, holder):
        super().__init__()
        self.held = [holder]

    def forward(self, w):
        self.held[0].ema.mul_(0.5).add_(w.detach())
        return w + self.held[0].ema


@pytest.mark.parametrize("member", ["rebinding", "numpy", "another_module"])
def test_a_chain_changing_a_tensor_in_a_way_no_op_shows_is_refused_and_put_back(member):
    # Regression (helper-221): export folded these eval-mode EMAs to one value (0.26 off stock's
    # second call) and left the model's buffer moved: a .data rebind and a NumPy view's write are
    # no ops, and the guard watched only the chain's own tensors, not another module's it holds.
    model = build("plain").eval()
    model.holder = nn.Module()
    model.holder.register_buffer("ema", torch.zeros(32, 32))
    chain = {"rebinding": _EmaRebindingData, "numpy": _EmaThroughNumpy}.get(member)
    parametrize.register_parametrization(model.layers[1], "weight",
                                         chain() if chain else _EmaOfAnotherModule(model.holder), unsafe=True)
    before = pt.structure(model)
    tensors = {n: (t, t.untyped_storage().data_ptr(), t.clone()) for n, t in (*model.named_parameters(),
                                                                               *model.named_buffers())}
    how = {"rebinding": "its .data rebound", "numpy": "written in place"}.get(member, "would write one of the model's")
    with pytest.raises(paramfold.FoldError, match=r"cannot export layers\.1\.weight \(custom\) folded.*"
                                                  + re.escape(how) + r".*model is unchanged"):
        paramfold.export(model, (torch.randn(2, 32),))
    for name, (t, address, then) in tensors.items():
        assert t.untyped_storage().data_ptr() == address and torch.equal(t, then), name
    pt.assert_same_structure(before, pt.structure(model))


class _DropConnect(nn.Module):
    def forward(self, w):
        return F.dropout(w, 0.5, self.training)


class _TrainingCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def forward(self, w):
        if self.training:
            self.steps += 1
        return w


class _TrainingOnlyGradBranch(nn.Module):
    def forward(self, w):
        return w.round() + (w - w.detach()) if self.training and torch.is_grad_enabled() else w


@pytest.mark.parametrize("member", [_DropConnect, _TrainingCounter, _TrainingOnlyGradBranch],
                         ids=["dropconnect", "counter", "grad_branch"])
def test_a_chain_that_draws_writes_or_branches_in_training_only_exports_in_eval_as_stock(member):
    # Regression (2026-12-07, the same day's refusal above): find()'s verdicts hold for training
    # or eval mode, and export refused these in eval, where stock's program is a constant of the
    # weights: their chains are probed again in their modules' current modes.
    model = build("plain").eval()
    parametrize.register_parametrization(model.layers[1], "weight", member())
    assert any((s.random, s.writes_itself, s.grad_dependent) != (False,) * 3 for s in paramfold.find(model))
    x = torch.randn(2, 32)
    ep = paramfold.export(model, (x,))
    want = torch.export.export(model, (x,))
    assert torch.equal(ep.module()(x), want.module()(x))
    assert "layers.1.weight" in ep.state_dict


class _Marked(torch.Tensor):
    pass


class _ToSubclass(nn.Module):
    def forward(self, x):
        return x.as_subclass(_Marked)


def test_a_tensor_subclass_value_is_refused():
    model = build("plain")
    parametrize.register_parametrization(model.layers[1], "weight", _ToSubclass(), unsafe=True)
    before = pt.structure(model)
    with pytest.raises(paramfold.FoldError, match=r"layers\.1\.weight.*_Marked.*filter_fn"):
        paramfold.export(model, (torch.randn(2, 32),))
    pt.assert_same_structure(before, pt.structure(model))


def test_torchao_unwrapped_subclasses_stay_stock_and_exact():
    pytest.importorskip("torchao")
    import warnings

    warnings.filterwarnings("ignore", module="torchao")
    from test_torchao import _int8_model

    model = _int8_model().eval()
    x = torch.randn(2, 64)
    ep = paramfold.export(model, (x,))
    assert ops(ep) == ops(torch.export.export(model, (x,)))
    assert torch.equal(ep.module()(x), model(x))


def test_export_kwargs_pass_through():
    model = build("weight_norm").eval()
    batch = torch.export.Dim("batch", min=2, max=64)
    ep = paramfold.export(model, (torch.randn(4, 32),), dynamic_shapes=({0: batch},))
    x = torch.randn(9, 32)
    assert torch.equal(ep.module()(x), model(x))


def test_aoti_package_of_the_folded_program_runs_on_cpu():
    # One AOTInductor compile of a small vocoder: about 40 s on a shared 2-core machine.
    torch.manual_seed(0)
    model = Vocoder(channels=8).eval()
    x = torch.randn(1, 8, 16)
    ep = paramfold.export(model, (x,))
    with tempfile.TemporaryDirectory() as tmp:
        path = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(tmp, "vocoder.pt2"))
        loaded = torch._inductor.aoti_load_package(path)
        with torch.no_grad():
            expected = model(x)
            got = loaded(x)
            again = loaded(copy.deepcopy(x) * 0.5)
            expected_again = model(x * 0.5)
    # Inductor may reorder float arithmetic (fused conv epilogues): a stated tolerance.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(again, expected_again, rtol=1e-5, atol=1e-6)


def test_export_bench_example_runs_and_checks_equal_outputs():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "export_bench.py"
    spec = importlib.util.spec_from_file_location("export_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        rows = bench.main(["--repeats", "2", "--models", "seed"])
    finally:
        torch.set_num_threads(threads)
    assert [name for name, _ in rows] == ["seed (unsafe bf16 cast)"]
    assert all(v > 0 for v in rows[0][1].values())


@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
def test_torch_jit_script_of_a_prepared_model_is_refused_with_the_ways_to_script(mode):
    # Regression: torch.jit.script raised TorchScript's "try blocks aren't supported" (from
    # paramfold's runtime). Stock scripts a parametrized model but its call raises; the folded
    # copy the message gives scripts and runs.
    stock = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh()).eval().requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    with pytest.raises(paramfold.FoldError, match=r"torch\.jit\.script") as refused:
        torch.jit.script(ours)
    x = torch.randn(2, 4)
    # The advice runs as spelled (helper-245: it said paramfold.export.folded_copy(model), and
    # paramfold.export is the export function: AttributeError).
    advice = re.search(r"from paramfold\.export import folded_copy; torch\.jit\.script\(folded_copy\(model\)\)",
                       str(refused.value))
    assert advice is not None, str(refused.value)
    space = {"torch": torch, "model": ours}
    exec(advice.group(0).replace("; ", "\nscripted = "), space)
    assert torch.equal(space["scripted"](x), stock(x))
    with pytest.raises(Exception, match="Parametrization is not working with scripting"):
        torch.jit.script(paramfold.restore(ours))(x)  # as stock


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
@pytest.mark.parametrize("mode", [None, "hoist", "auto", "inline"])
@pytest.mark.parametrize("legacy", [False, True], ids=["parametrize", "hook_based"])
def test_an_export_under_inference_mode_runs_in_grad_mode_and_keeps_requires_grad(legacy, mode, frozen):
    # Regression (2026-12-05 hunt): values folded inside the caller's inference_mode were inference
    # tensors, so the program failed in grad mode ("Inference tensors cannot be saved for
    # backward"); and torch's remove_weight_norm / remove_spectral_norm, which fold the hook-based
    # norms, registered a weight that requires grad for a frozen model too.
    def build_one():
        if legacy:
            return _legacy_model()
        torch.manual_seed(0)
        return nn.Sequential(weight_norm(nn.Conv1d(4, 8, 3, padding=1)), nn.Tanh(),
                             spectral_norm(nn.Conv1d(8, 4, 3, padding=1))).eval()

    stock, ours = build_one().requires_grad_(not frozen), build_one().requires_grad_(not frozen)
    if mode is not None:
        paramfold.prepare(ours, mode)
    x = torch.randn(2, 4, 16)
    with torch.inference_mode():
        want = stock(x).clone()
        ep = paramfold.export(ours, (x,))
        plain = folded_copy(ours)
    for module in (ep.module(), plain):
        params = dict(module.named_parameters())
        assert not any(p.is_inference() for p in params.values())
        assert {k: p.requires_grad for k, p in params.items()} == {k: not frozen for k in params}
        out = module(x)  # grad mode
        assert torch.equal(out, want) and out.requires_grad is not frozen
