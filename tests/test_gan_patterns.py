"""GAN and adversarial training loops over prepared models, the way real GAN code runs them.

SNGAN, BigGAN, StyleGAN2, HiFi-GAN and WGAN-GP put a *stateful* parametrization (spectral_norm,
whose ``_u``/``_v`` power-iteration buffers move at every training read) or the deprecated
hook-based norms on a discriminator, and weight_norm on a generator, then run loops that make
freeze/auto/hoist decide differently from one call to the next: the discriminator called twice
per step (real, then ``G(z).detach()``), ``D.requires_grad_(False)`` for the generator step and
back, ``torch.no_grad()`` calls in training mode (fakes for the D step, a "D(real) accuracy"
metric: stock still advances ``_u``), ``eval()`` sampling between steps, gradient penalties
(double backward: WGAN-GP, R1, path length, ``autograd.grad`` w.r.t. the originals),
re-initialisation of the originals after ``prepare``, an EMA generator (``deepcopy`` of the
prepared one, hook-based norms too) updated over its parameters *and* buffers, and the whole
D/G step functions under ``torch.compile``.

Each test builds a stock model and a prepared one from the same seed, runs the same loop on
both from the same global random state and compares, bitwise: outputs, losses, gradients of the
originals, every buffer, the global RNG state and the final ``state_dict``. Compiled calls use
``backend="eager"`` (bitwise against eager stock). Models are tiny (8x8 images, batch 2).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

from helpers import assert_same_nested

import paramfold

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

TRAIN_MODES = ["hoist", "inline", "auto"]
#: The modes that compute values once per call rather than at each read, as stock does.
HOISTING_MODES = ["hoist", "auto"]
EAGER = {"backend": "eager"}


class Generator(nn.Module):
    """weight_norm Linear and Conv2d, spectral_norm with ``dim=1`` on a ConvTranspose2d."""

    def __init__(self, hook: bool = False):
        super().__init__()
        wn = nn.utils.weight_norm if hook else weight_norm
        self.fc = wn(nn.Linear(4, 8 * 2 * 2))
        self.up = spectral_norm(nn.ConvTranspose2d(8, 4, 4, 2, 1), dim=1)
        self.out = wn(nn.Conv2d(4, 3, 3, padding=1))

    def forward(self, z):
        h = self.fc(z).view(-1, 8, 2, 2)
        h = F.interpolate(F.leaky_relu(self.up(h), 0.2), scale_factor=2)
        return torch.tanh(self.out(h))


class Discriminator(nn.Module):
    """spectral_norm convs and Linear (optionally the projection discriminator's Embedding)."""

    def __init__(self, hook: bool = False, n_classes: int = 0, n_power_iterations: int = 1):
        super().__init__()

        def sn(m):
            if hook:
                return nn.utils.spectral_norm(m, n_power_iterations=n_power_iterations)
            return spectral_norm(m, n_power_iterations=n_power_iterations)

        self.c1 = sn(nn.Conv2d(3, 4, 3, 2, 1))
        self.c2 = sn(nn.Conv2d(4, 8, 3, 2, 1))
        self.fc = sn(nn.Linear(8 * 2 * 2, 1))
        self.embed = sn(nn.Embedding(n_classes, 8 * 2 * 2)) if n_classes else None

    def forward(self, x, y=None):
        h = F.leaky_relu(self.c1(x), 0.2)
        h = F.leaky_relu(self.c2(h), 0.2).flatten(1)
        out = self.fc(h)
        if self.embed is not None:
            out = out + (self.embed(y) * h).sum(1, keepdim=True)
        return out


def grads(model: nn.Module) -> dict:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def buffers(model: nn.Module) -> dict:
    return {n: b.clone() for n, b in model.named_buffers()}


def run_twins(loop, mode: str | None, compile: dict | None = None, *, hook: bool = False, **d_options) -> None:
    """Run ``loop(G, D, G_call, D_call)`` on a stock pair and on a pair prepared with ``mode``
    (compiled with ``compile``), from the same seeds, and compare what it recorded, the global
    RNG state and both state_dicts bitwise."""
    results = []
    for prepare in (False, True):
        torch.manual_seed(0)
        g, d = Generator(hook), Discriminator(hook, **d_options)
        g_call, d_call = g, d
        if prepare:
            paramfold.prepare(g, mode)
            paramfold.prepare(d, mode)
            if compile is not None:
                g_call, d_call = torch.compile(g, **compile), torch.compile(d, **compile)
        torch.manual_seed(1)
        record = loop(g, d, g_call, d_call)
        results.append([record, torch.get_rng_state(), g.state_dict(), d.state_dict()])
    assert_same_nested(*results)


def alternating_steps(g, d, g_call, d_call, *, concat=False, set_to_none=True, steps=2):
    """Hinge-loss SNGAN loop: D on the real and the detached fake batch (or both concatenated),
    then the G step through D with D's parameters switched off and back on; two Adams."""
    opt_g = torch.optim.Adam(g.parameters(), 1e-2, betas=(0.0, 0.9))
    opt_d = torch.optim.Adam(d.parameters(), 1e-2, betas=(0.0, 0.9))
    record = []
    for _ in range(steps):
        real, z = torch.randn(2, 3, 8, 8), torch.randn(2, 4)
        opt_d.zero_grad(set_to_none=set_to_none)
        fake = g_call(z).detach()
        if concat:
            out = d_call(torch.cat([real, fake]))
            d_real, d_fake = out[:2], out[2:]
        else:
            d_real, d_fake = d_call(real), d_call(fake)
        loss_d = F.relu(1 - d_real).mean() + F.relu(1 + d_fake).mean()
        loss_d.backward()
        record += [loss_d.detach(), grads(d), buffers(d)]
        opt_d.step()
        d.requires_grad_(False)
        opt_g.zero_grad(set_to_none=set_to_none)
        loss_g = -d_call(g_call(z)).mean()
        loss_g.backward()
        opt_g.step()
        d.requires_grad_(True)
        record += [loss_g.detach(), grads(g), grads(d), buffers(d), buffers(g)]
    return record


@pytest.mark.parametrize("hook", [False, True], ids=["parametrizations", "hook_norms"])
@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_alternating_d_and_g_steps_with_requires_grad_toggled(mode, hook):
    run_twins(alternating_steps, mode, hook=hook)


@pytest.mark.parametrize("mode", HOISTING_MODES)
def test_alternating_steps_compiled_concatenated_batch_and_zeroed_grads(mode):
    def loop(*models):
        return alternating_steps(*models, concat=True, set_to_none=False)

    run_twins(loop, mode, EAGER)


def wgan_gp(g, d, g_call, d_call):
    opt_d = torch.optim.Adam(d.parameters(), 1e-2, betas=(0.0, 0.9))
    record = []
    for _ in range(2):
        real, z = torch.randn(2, 3, 8, 8), torch.randn(2, 4)
        opt_d.zero_grad()
        fake = g_call(z).detach()
        a = torch.rand(2, 1, 1, 1)
        interp = (a * real + (1 - a) * fake).requires_grad_(True)
        (gx,) = torch.autograd.grad(d_call(interp).sum(), interp, create_graph=True)
        penalty = ((gx.flatten(1).norm(2, dim=1) - 1) ** 2).mean()
        loss = d_call(fake).mean() - d_call(real).mean() + 10 * penalty
        loss.backward()
        record += [loss.detach(), penalty.detach(), grads(d), buffers(d)]
        opt_d.step()
    return record


def r1_penalty(g, d, g_call, d_call):
    record = []
    for _ in range(2):
        real = torch.randn(2, 3, 8, 8).requires_grad_(True)
        out = d_call(real)
        (gx,) = torch.autograd.grad(out.sum(), real, create_graph=True)
        r1 = gx.pow(2).flatten(1).sum(1).mean()
        (F.softplus(-out).mean() + 5 * r1).backward()
        record += [out.detach(), r1.detach(), grads(d), buffers(d)]
    return record


def path_length(g, d, g_call, d_call):
    record = []
    for _ in range(2):
        z = torch.randn(2, 4).requires_grad_(True)
        img = g_call(z)
        (gz,) = torch.autograd.grad((img * torch.randn_like(img)).sum(), z, create_graph=True)
        penalty = gz.pow(2).sum(1).mean()
        penalty.backward()
        record += [img.detach(), penalty.detach(), grads(g), buffers(g)]
    return record


def grad_wrt_originals(g, d, g_call, d_call):
    # autograd.grad w.r.t. spectral_norm's originals directly, then a penalty on it; and a
    # second backward through a retained graph.
    record = []
    for _ in range(2):
        out = d_call(torch.randn(2, 3, 8, 8))
        originals = [d.c1.parametrizations.weight.original, d.fc.parametrizations.weight.original, d.fc.bias]
        gs = torch.autograd.grad(out.sum(), originals, create_graph=True, retain_graph=True)
        sum(t.pow(2).sum() for t in gs).backward(retain_graph=True)
        record += [out.detach(), [t.detach() for t in gs], grads(d)]
        out.square().mean().backward()
        record += [grads(d), buffers(d)]
    return record


PENALTIES = {"wgan_gp": wgan_gp, "r1": r1_penalty, "path_length": path_length, "grad_wrt_originals": grad_wrt_originals}


@pytest.mark.parametrize("penalty", list(PENALTIES))
@pytest.mark.parametrize("mode", HOISTING_MODES)
def test_gradient_penalties_double_backward(mode, penalty):
    run_twins(PENALTIES[penalty], mode)


@pytest.mark.parametrize("mode", HOISTING_MODES)
def test_wgan_gp_compiled_and_with_hook_based_spectral_norm(mode):
    run_twins(wgan_gp, mode, EAGER)
    run_twins(r1_penalty, mode, hook=True)


def test_double_backward_under_aot_eager_raises_as_for_stock():
    # aot_autograd refuses double backward; the prepared model must raise the same error, not
    # run a penalty that skips part of the graph.
    errors = []
    for prepare in (False, True):
        torch.manual_seed(0)
        d = Discriminator()
        if prepare:
            paramfold.prepare(d, "hoist")
        torch._dynamo.reset()
        call = torch.compile(d, backend="aot_eager")
        real = torch.randn(2, 3, 8, 8).requires_grad_(True)
        (gx,) = torch.autograd.grad(call(real).sum(), real, create_graph=True)
        with pytest.raises(RuntimeError, match="double backward") as info:
            gx.pow(2).sum().backward()
        errors.append(str(info.value))
    assert errors[0] == errors[1]


def no_grad_calls_in_training(g, d, g_call, d_call):
    """Fakes made under no_grad with G training (its spectral_norm advances), a D accuracy metric
    under no_grad in training mode (D's advances too), then eval()-mode sampling and scoring."""
    opt_g = torch.optim.Adam(g.parameters(), 1e-2)
    opt_d = torch.optim.Adam(d.parameters(), 1e-2)
    record = []
    for _ in range(2):
        real, z = torch.randn(2, 3, 8, 8), torch.randn(2, 4)
        with torch.no_grad():
            fake = g_call(z)
        opt_d.zero_grad()
        loss_d = F.softplus(-d_call(real)).mean() + F.softplus(d_call(fake)).mean()
        loss_d.backward()
        opt_d.step()
        record += [fake, loss_d.detach(), grads(d), buffers(d), buffers(g)]
        with torch.no_grad():
            record += [(d_call(real) > 0).float().mean(), d_call(real), buffers(d)]
        opt_g.zero_grad()
        loss_g = F.softplus(-d_call(g_call(z))).mean()
        loss_g.backward()
        opt_g.step()
        record += [loss_g.detach(), grads(g), buffers(g)]
        g.eval()
        d.eval()
        with torch.no_grad():
            record += [g_call(z), g_call(z), d_call(real), d_call(g_call(z)), buffers(d), buffers(g)]
        g.train()
        d.train()
    return record


@pytest.mark.parametrize(
    ("mode", "compile"),
    [("hoist", None), ("inline", None), ("auto", None), ("hoist", EAGER), ("auto", EAGER)],
    ids=["hoist", "inline", "auto", "hoist-compiled", "auto-compiled"],
)
def test_no_grad_calls_in_training_mode_and_eval_sampling(mode, compile):
    run_twins(no_grad_calls_in_training, mode, compile)


@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_no_grad_calls_in_training_mode_with_hook_based_norms(mode):
    run_twins(no_grad_calls_in_training, mode, hook=True)


def conditional_steps(g, d, g_call, d_call):
    opt_d = torch.optim.Adam(d.parameters(), 1e-2)
    record = []
    for _ in range(3):
        real, y = torch.randn(2, 3, 8, 8), torch.randint(0, 5, (2,))
        opt_d.zero_grad()
        out = d_call(real, y)
        F.softplus(-out).mean().backward()
        opt_d.step()
        record += [out.detach(), grads(d), buffers(d)]
    d.eval()
    with torch.no_grad():
        record += [d_call(real, y), d_call(real, y)]
    return record


@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_projection_discriminator_embedding_under_spectral_norm_with_three_power_iterations(mode):
    run_twins(conditional_steps, mode, n_classes=5, n_power_iterations=3)


def reinitialised_after_prepare(g, d, g_call, d_call):
    """``D.apply(init)`` on the originals and ``m.weight.data.normal_()`` on G's computed weights
    (a no-op in stock: a fresh tensor at every read) between eval calls, then a training step."""

    def init(m):
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            if hasattr(m, "parametrizations"):
                nn.init.orthogonal_(m.parametrizations.weight.original)
            else:
                nn.init.orthogonal_(m.weight_orig)
            nn.init.zeros_(m.bias)

    x, z = torch.randn(2, 3, 8, 8), torch.randn(2, 4)
    g.eval()
    d.eval()
    with torch.no_grad():
        record = [d_call(x), g_call(z)]
        d.apply(init)
        for m in g.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear, nn.ConvTranspose2d)):
                m.weight.data.normal_(0, 0.02)
        record += [d_call(x), g_call(z), d_call(x), g_call(z), buffers(d)]
    g.train()
    d.train()
    out = d_call(g_call(z))
    out.sum().backward()
    return record + [out, grads(d), grads(g), buffers(d), buffers(g)]


@pytest.mark.parametrize("hook", [False, True], ids=["parametrizations", "hook_norms"])
@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_originals_reinitialised_after_prepare(mode, hook):
    run_twins(reinitialised_after_prepare, mode, hook=hook)


def _steps_with_ema(g, g_ema, forward, ema_call, loss, lerp) -> list:
    """Three Adam steps of ``g`` through ``forward(z)``, each followed by an EMA update of
    ``g_ema`` (``lerp()`` over the parameters, G's buffers copied) and two eval calls of it: what
    each step and call gave, for a bitwise comparison with stock's run."""
    opt = torch.optim.Adam(g.parameters(), 1e-2)
    torch.manual_seed(1)
    z_fixed, record = torch.randn(2, 4), []
    for _ in range(3):
        opt.zero_grad()
        out = forward(torch.randn(2, 4))
        loss(out).backward()
        opt.step()
        record += [out.detach(), grads(g), buffers(g)]
        with torch.no_grad():
            lerp()
            for b_ema, b in zip(g_ema.buffers(), g.buffers()):
                b_ema.copy_(b)
            record += [ema_call(z_fixed), ema_call(z_fixed), buffers(g_ema)]
    return record


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(("mode", "ema_mode"), [("auto", "freeze"), ("hoist", "auto")])
def test_ema_generator_lerped_over_parameters_and_buffers(mode, ema_mode, compiled):
    # G_ema = deepcopy(G) of the prepared G (the copy is prepared like G), restored and prepared
    # again for inference with ema_mode.
    # Each step lerps its parameters and copies G's buffers (spectral_norm's _u/_v) into it:
    # its eval calls must never serve values from before an update.
    results = []
    for prepare in (False, True):
        torch.manual_seed(0)
        g, d = Generator(), Discriminator()
        if prepare:
            paramfold.prepare(g, mode)
        g_ema = copy.deepcopy(g).eval().requires_grad_(False)
        if prepare:
            paramfold.restore(g_ema)
            paramfold.prepare(g_ema, ema_mode)
        g_call, ema_call = g, g_ema
        if prepare and compiled:
            g_call, ema_call = torch.compile(g, **EAGER), torch.compile(g_ema, **EAGER)
        record = _steps_with_ema(
            g, g_ema, lambda z: d(g_call(z)), ema_call, loss=lambda out: -out.mean(),
            lerp=lambda: torch._foreach_lerp_(list(g_ema.parameters()), list(g.parameters()), 0.01))
        results.append([record, torch.get_rng_state(), g_ema.state_dict(), g.state_dict()])
    assert_same_nested(*results)


@pytest.mark.parametrize("mode", HOISTING_MODES)
def test_ema_copy_of_a_generator_with_hook_based_norms(mode):
    # The deprecated hook-based weight_norm keeps its computed weight as a plain attribute, so
    # deepcopy works only after a no_grad call (as in stock); the copy (prepared too) is then
    # lerped over its parameters, its buffers copied, and called compiled between G's steps.
    results = []
    for prepare in (False, True):
        torch.manual_seed(0)
        g = Generator(hook=True)
        if prepare:
            paramfold.prepare(g, mode)
        with torch.no_grad():
            g(torch.randn(2, 4))
        g_ema = copy.deepcopy(g).eval().requires_grad_(False)
        g_call, ema_call = g, g_ema
        if prepare:
            g_call, ema_call = torch.compile(g, **EAGER), torch.compile(g_ema, **EAGER)
        def lerp():
            for p_ema, p in zip(g_ema.parameters(), g.parameters()):
                p_ema.lerp_(p, 0.1)

        record = _steps_with_ema(g, g_ema, g_call, ema_call, loss=lambda out: out.square().mean(), lerp=lerp)
        results.append([record, torch.get_rng_state(), g_ema.state_dict(), g.state_dict()])
    assert_same_nested(*results)


class GAN(nn.Module):
    """Both networks in one module, prepared as one model (Lightning-style): its forward scores
    generated images; the D step calls its submodules directly."""

    def __init__(self):
        super().__init__()
        self.generator, self.discriminator = Generator(), Discriminator()

    def forward(self, z):
        return self.discriminator(self.generator(z))


@pytest.mark.parametrize("mode", ["auto"])
def test_whole_d_and_g_step_functions_compiled(mode):
    # torch.compile of the step functions themselves (backward and optimizer step inside, graph
    # breaks included), on a wrapper prepared as one model whose submodules are called directly.
    # (SGD: a compiled Adam step rounds differently from an eager one, for stock too.)
    results = []
    for prepare in (False, True):
        torch.manual_seed(0)
        gan = GAN()
        if prepare:
            paramfold.prepare(gan, mode)
        g, d = gan.generator, gan.discriminator
        opt_g = torch.optim.SGD(g.parameters(), 1e-2)
        opt_d = torch.optim.SGD(d.parameters(), 1e-2)

        def d_step(real, z):
            opt_d.zero_grad(set_to_none=True)
            with torch.no_grad():
                fake = g(z)
            loss = F.relu(1 - d(real)).mean() + F.relu(1 + d(fake)).mean()
            loss.backward()
            opt_d.step()
            return loss.detach()

        def g_step(z):
            d.requires_grad_(False)
            opt_g.zero_grad(set_to_none=True)
            loss = -gan(z).mean()
            loss.backward()
            opt_g.step()
            d.requires_grad_(True)
            return loss.detach()

        if prepare:
            d_step, g_step = torch.compile(d_step, **EAGER), torch.compile(g_step, **EAGER)
        torch.manual_seed(1)
        record = []
        for _ in range(2):
            real, z = torch.randn(2, 3, 8, 8), torch.randn(2, 4)
            record += [d_step(real, z), buffers(gan), g_step(z), buffers(gan), dict(gan.named_parameters())]
        results.append([record, torch.get_rng_state(), gan.state_dict()])
        torch._dynamo.reset()
    assert_same_nested(*results)


def test_freeze_refuses_a_training_discriminator_before_changing_anything():
    torch.manual_seed(0)
    d = Discriminator()
    before = copy.deepcopy(d.state_dict())
    classes = [type(m) for m in d.modules()]
    for trainable in (True, False):
        d.requires_grad_(trainable)
        with pytest.raises(paramfold.FoldError, match="Freeze is for inference"):
            paramfold.prepare(d, "freeze")
        assert [type(m) for m in d.modules()] == classes
        assert_same_nested(before, d.state_dict())


def test_lazy_modules_materialised_before_spectral_norm():
    for mode in TRAIN_MODES:
        results = []
        for prepare in (False, True):
            torch.manual_seed(0)
            d = nn.Sequential(nn.LazyConv2d(4, 3, 2, 1), nn.LeakyReLU(0.2), nn.Flatten(), nn.LazyLinear(1))
            d(torch.zeros(1, 3, 8, 8))
            spectral_norm(d[0])
            spectral_norm(d[3])
            if prepare:
                paramfold.prepare(d, mode)
            opt = torch.optim.Adam(d.parameters(), 1e-2)
            torch.manual_seed(1)
            record = []
            for _ in range(2):
                opt.zero_grad()
                out = d(torch.randn(2, 3, 8, 8))
                out.mean().backward()
                opt.step()
                record += [out, grads(d), buffers(d)]
            results.append([record, d.state_dict()])
        assert_same_nested(*results)


class RealAndFake(nn.Module):
    """A wrapper whose one forward scores the real and the fake batch: D's spectral_norm is read
    twice per call, so stock runs its power iteration twice."""

    def __init__(self):
        super().__init__()
        self.discriminator = Discriminator()

    def forward(self, real, fake):
        return self.discriminator(real), self.discriminator(fake)


def _real_and_fake(mode: str) -> None:
    results = []
    for prepare in (False, True):
        torch.manual_seed(0)
        model = RealAndFake()
        if prepare:
            paramfold.prepare(model, mode)
        torch.manual_seed(1)
        d_real, d_fake = model(torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8))
        (d_real.mean() - d_fake.mean()).backward()
        results.append([d_real, d_fake, buffers(model), grads(model)])
    assert_same_nested(*results)


def test_discriminator_called_twice_in_one_forward_inline():
    _real_and_fake("inline")


@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_discriminator_called_twice_in_one_forward_hoisted(mode):
    """The first read is served the value computed before the call, the second computes afresh
    (tests/test_stateful_reads.py has the compiled and hook-based variants)."""
    _real_and_fake(mode)
