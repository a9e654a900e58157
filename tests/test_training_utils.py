"""torch's training-loop utilities around a prepared model, the way training scripts use them.

Each test builds a stock model and a prepared one identically (same seed), runs the same loop on
both (an optimizer, an EMA or SWA average, autocast with a GradScaler, gradient clipping,
backward hooks, activation checkpointing, dtype and memory-format conversions, writes to the
originals between calls) and compares outputs, gradients and state_dict bitwise, eagerly and with
``torch.compile(backend="eager")``. The models are tiny ``nn.Sequential`` stacks with
``weight_norm``, ``spectral_norm`` (stateful: its ``_u``/``_v`` must evolve like stock's), a
custom two-member chain and the deprecated hook-based norms. Evaluation calls between training
steps (``eval()`` under ``no_grad``) are where freeze and auto serve cached values: a stale one
would show there.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, update_bn

from helpers import small_net, twin_nets

import paramfold

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

TRAIN_MODES = ["hoist", "inline", "auto"]


def _input(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 2, 6, 6, generator=g) if kind == "conv2d" else torch.randn(3, 4, generator=g)


def _flat(value, out: list) -> list:
    if isinstance(value, torch.Tensor) or value is None:
        out.append(value)
    elif isinstance(value, dict):
        for key in value:
            out.append(key)
            _flat(value[key], out)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _flat(item, out)
    else:
        out.append(value)
    return out


def assert_same(expected, actual) -> None:
    """Nested records (tensors, dicts, lists, numbers) equal, tensors bitwise."""
    expected, actual = _flat(expected, []), _flat(actual, [])
    assert len(expected) == len(actual)
    for i, (a, b) in enumerate(zip(expected, actual)):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, i
            assert a.stride() == b.stride(), i
            assert torch.equal(a, b), f"record {i} differs by {(a.double() - b.double()).abs().max().item()}"
        else:
            assert a == b, i


def _grads(model: nn.Module) -> list:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _train_step(model: nn.Module, call, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    """One optimizer step of ``model`` in training mode, its forward through ``call`` (the
    model, or a compiled wrapper of it); the output."""
    model.train()
    opt.zero_grad()
    y = call(x)
    y.square().sum().backward()
    opt.step()
    return y


# --------------------------------------------------------------------------------------------
# A deep copy of a model after model.compile()
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["root", "nested_container", "hook_based_root"])
@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_deepcopy_after_module_compile_gives_a_copy_that_runs_its_own_weights(mode, where):
    # Regression: nn.Module.__getstate__ drops `_compiled_call_impl`, so stock's deep copy of a
    # model after `model.compile()` is an eager model of its own. paramfold's shared classes
    # copied the instance __dict__ as it was, `_compiled_call_impl` included: the compiled
    # bound `_call_impl` of the *original*, so the copy's calls ran the original model (and an
    # AveragedModel/EMA built after `model.compile()` evaluated the training weights). Any
    # module stock does not parametrize: a container (compiled itself, inside the model), the
    # layer of a hook-based norm. (A module stock parametrizes keeps it in stock too: torch's
    # parametrize copies its __dict__ as it is; so does paramfold.)
    x = _input("weight_norm")
    results = []
    for prepare in (False, True):
        if where == "hook_based_root":
            torch.manual_seed(0)
            model = nn.utils.weight_norm(nn.Linear(4, 3))
        else:
            model = small_net("weight_norm")
            if where == "nested_container":
                model = nn.Sequential(model)
        if prepare:
            paramfold.prepare(model, mode)
        (model[0] if where == "nested_container" else model).compile(backend="eager")
        with torch.no_grad():
            model(x)
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(0.5)
            compiled = twin[0] if where == "nested_container" else twin
            results.append([twin(x), model(x), "_compiled_call_impl" in compiled.__dict__])
    assert_same(*results)
    assert not torch.equal(results[1][0], results[1][1])


@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_ema_averaged_model_built_after_module_compile(mode):
    # The user flow of the test above: model.compile(), then AveragedModel(model) (a deep copy).
    x = _input("spectral_norm")
    results = []
    for prepare in (False, True):
        model = small_net("spectral_norm")
        if prepare:
            paramfold.prepare(model, mode)
        model.compile(backend="eager")
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=True)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        record = []
        for _ in range(3):
            y = _train_step(model, model, opt, x)
            ema.update_parameters(model)
            ema.eval()
            with torch.no_grad():
                record += [y.detach(), ema(x), ema(x)]
        record += [ema.state_dict(), model.state_dict()]
        results.append(record)
    assert_same(*results)


# --------------------------------------------------------------------------------------------
# EMA / SWA
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("use_buffers", "compiled"), [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_averaged_model_ema_of_a_prepared_model(mode, use_buffers, compiled):
    # AveragedModel deep-copies the prepared model (the copy is prepared too) and writes the
    # averaged originals in place (foreach lerp under no_grad): each eval call of the average
    # (auto freezes there) must see every update; spectral_norm's buffers are averaged too.
    x = _input("spectral_norm")
    results = []
    for model in twin_nets("spectral_norm", mode):
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=use_buffers)
        call = torch.compile(model, backend="eager") if compiled else model
        ecall = torch.compile(ema, backend="eager") if compiled else ema
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        record = []
        for _ in range(3):
            y = _train_step(model, call, opt, x)
            ema.update_parameters(model)
            ema.eval()
            with torch.no_grad():
                record += [y.detach(), ecall(x), ecall(x)]
            record.append(ecall(x).detach())
            ema.train()
        record += [ema.state_dict(), model.state_dict()]
        results.append(record)
    assert_same(*results)


@pytest.mark.parametrize("update", ["data_mul_add", "foreach_lerp", "load_state_dict", "swap_data"])
@pytest.mark.parametrize(("mode", "freeze_check"), [("freeze", "content"), ("freeze", "version"), ("auto", "version")])
def test_hand_written_ema_of_a_prepared_eval_copy(mode, freeze_check, update):
    # The EMA copy alone is prepared (inference: frozen values), compiled, and updated between
    # its eval calls the ways training scripts do: `pe.data.mul_(d).add_(p.data, alpha=1 - d)`
    # (bumps no version counter), torch._foreach_lerp_, load_state_dict, and swapping `.data`
    # with the training model's for a validation pass and back (Lightning/timm's EMA swap).
    x = _input("weight_norm")
    results = []
    for prepare in (False, True):
        model = small_net("weight_norm")
        ema = copy.deepcopy(model).eval().requires_grad_(False)
        if prepare:
            paramfold.prepare(ema, mode, freeze_check=freeze_check)
        ecall = torch.compile(ema, backend="eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        record = []
        for _ in range(3):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
            if update == "data_mul_add":
                for pe, p in zip(ema.parameters(), model.parameters()):
                    pe.data.mul_(0.9).add_(p.data, alpha=0.1)
            elif update == "foreach_lerp":
                with torch.no_grad():
                    torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 0.1)
            elif update == "load_state_dict":
                ema.load_state_dict(model.state_dict())
            else:
                for pe, p in zip(ema.parameters(), model.parameters()):
                    pe.data, p.data = p.data, pe.data
                with torch.no_grad():
                    record += [ecall(x), ecall(x)]
                for pe, p in zip(ema.parameters(), model.parameters()):
                    pe.data, p.data = p.data, pe.data
            with torch.no_grad():
                record += [ecall(x), ecall(x)]
        record.append(ema.state_dict())
        results.append(record)
    assert_same(*results)


@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_swa_update_bn_on_a_prepared_model(mode):
    # update_bn runs the model in training mode over a loader (spectral_norm's power iteration
    # runs at each batch) to recompute BatchNorm statistics; then eval calls.
    x = _input("spectral_norm")
    results = []
    for model in twin_nets("spectral_norm", mode):
        model.insert(1, nn.BatchNorm1d(6))
        record = []
        for scale in (1.0, 2.0):
            update_bn([x * scale, x - scale], model)
            with torch.no_grad():
                record += [model(x), model(x)]
        record.append(model.state_dict())
        results.append(record)
    assert_same(*results)


# --------------------------------------------------------------------------------------------
# Optimizers, AMP, clipping
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adam_fused", "sgd_fused", "adamw_foreach", "adam_compiled_step"])
@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_fused_foreach_and_compiled_optimizer_steps_then_eval_calls(mode, optimizer):
    # The optimizer writes the originals in place (fused and foreach kernels, or a compiled
    # step, with the model compiled too); eval calls under no_grad between steps (auto freezes there) must not be stale.
    x = _input("spectral_norm")
    results = []
    for model in twin_nets("spectral_norm", mode):
        call = torch.compile(model, backend="eager") if optimizer == "adam_compiled_step" else model
        params = list(model.parameters())
        if optimizer == "adam_fused":
            opt = torch.optim.Adam(params, lr=0.05, fused=True)
        elif optimizer == "sgd_fused":
            opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)
        else:
            opt = torch.optim.AdamW(params, lr=0.05, foreach=True, weight_decay=0.1)
        step = torch.compile(opt.step, backend="eager") if optimizer == "adam_compiled_step" else opt.step
        record = []
        for i in range(3):
            model.train()
            opt.zero_grad(set_to_none=i % 2 == 0)
            y = call(x)
            y.square().sum().backward()
            record += [y.detach(), _grads(model)]
            step()
            model.eval()
            with torch.no_grad():
                record += [call(x), call(x)]
        record.append(model.state_dict())
        results.append(record)
    assert_same(*results)


@pytest.mark.parametrize(
    ("kind", "compiled"), [("weight_norm", False), ("spectral_norm", False), ("spectral_norm", True)]
)
@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_autocast_grad_scaler_and_gradient_clipping(mode, kind, compiled):
    # bf16 autocast around the call, GradScaler("cpu") (scale, unscale_, step, update),
    # clip_grad_norm_ and clip_grad_value_ over model.parameters(), zero_grad(set_to_none=False);
    # eval calls under no_grad, with and without autocast, between steps.
    x = _input(kind)
    results = []
    for model in twin_nets(kind, mode):
        call = torch.compile(model, backend="eager") if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
        record = []
        for _ in range(3):
            model.train()
            opt.zero_grad(set_to_none=False)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = call(x)
            scaler.scale(y.float().square().sum()).backward()
            scaler.unscale_(opt)
            record.append(nn.utils.clip_grad_norm_(model.parameters(), 0.1))
            nn.utils.clip_grad_value_(model.parameters(), 0.02)
            record += [y.detach(), _grads(model)]
            scaler.step(opt)
            scaler.update()
            model.eval()
            with torch.no_grad():
                record.append(call(x))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    record.append(call(x))
        record += [scaler.get_scale(), model.state_dict()]
        results.append(record)
    assert_same(*results)


@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_optimizer_in_backward_via_post_accumulate_grad_hooks(mode):
    # Each original steps its own optimizer from a post-accumulate-grad hook, during backward.
    # The order the hooks fire in may differ under hoist and auto (README, Notes and limits: "When
    # the originals' gradients arrive"), so gradients are recorded per parameter.
    x = _input("spectral_norm")
    results = []
    for model in twin_nets("spectral_norm", mode):
        params = list(model.parameters())
        opts = {p: torch.optim.SGD([p], lr=0.1) for p in params}
        seen: dict[int, list] = {i: [] for i in range(len(params))}
        index = {p: i for i, p in enumerate(params)}

        def hook(p):
            seen[index[p]].append(p.grad.clone())
            opts[p].step()
            opts[p].zero_grad()

        for p in params:
            p.register_post_accumulate_grad_hook(hook)
        record = []
        for _ in range(3):
            model.train()
            y = model(x)
            y.square().sum().backward()
            model.eval()
            with torch.no_grad():
                record += [y.detach(), model(x)]
        record += [seen, model.state_dict()]
        results.append(record)
    assert_same(*results)


# --------------------------------------------------------------------------------------------
# Hooks and activation checkpointing
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_backward_hooks_and_kwargs_pre_hook_removed_midway(mode, compiled):
    # Full backward hooks (recording, and one that rescales grad_input) and a full backward
    # pre-hook on the parametrized layer and on the root; a forward
    # pre-hook with kwargs that rescales the input; all removed through their handles after two
    # steps (the third runs without them).
    x0 = _input("weight_norm")
    results = []
    for model in twin_nets("weight_norm", mode):
        log = []

        def record_hook(m, grad_input, grad_output):
            log.append([g.clone() for g in grad_input + grad_output if g is not None])

        layer = model[0]
        handles = [
            layer.register_full_backward_hook(record_hook),
            model[2].register_full_backward_hook(lambda m, gi, go: tuple(g * 2 for g in gi)),
            layer.register_full_backward_pre_hook(lambda m, go: tuple(g * 0.5 for g in go)),
            model.register_full_backward_hook(record_hook),
            layer.register_forward_pre_hook(lambda m, args, kwargs: ((args[0] * 2,), kwargs), with_kwargs=True),
        ]
        call = torch.compile(model, backend="eager") if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        record = []
        for i in range(3):
            x = x0.clone().requires_grad_(True)
            opt.zero_grad()
            y = call(x)
            y.square().sum().backward()
            record += [y.detach(), x.grad, _grads(model)]
            opt.step()
            if i == 1:
                for handle in handles:
                    handle.remove()
        record += [log, model.state_dict()]
        results.append(record)
    assert_same(*results)


@pytest.mark.parametrize("how", ["checkpoint", "checkpoint_sequential", "checkpoint_sequential_reentrant"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "hook_weight_norm"])
@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_activation_checkpointing_of_a_prepared_model(mode, kind, how):
    from torch.utils.checkpoint import checkpoint, checkpoint_sequential

    x0 = _input(kind)
    results = []
    for model in twin_nets(kind, mode):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        record = []
        for _ in range(2):
            x = x0.clone().requires_grad_(True)
            opt.zero_grad()
            if how == "checkpoint":
                y = checkpoint(model, x, use_reentrant=False)
            else:
                y = checkpoint_sequential(model, 2, x, use_reentrant=how.endswith("reentrant"))
            y.square().sum().backward()
            record += [y.detach(), x.grad, _grads(model)]
            opt.step()
        record.append(model.state_dict())
        results.append(record)
    assert_same(*results)


# --------------------------------------------------------------------------------------------
# Conversions and writes to the originals between calls
# --------------------------------------------------------------------------------------------


def _init(module: nn.Module) -> None:
    # Re-initialises the originals, as a model.apply(init_fn) of a training script does.
    if parametrize.is_parametrized(module):
        for plist in module.parametrizations.values():
            for original in plist.parameters(recurse=False):
                nn.init.normal_(original, 0.0, 0.3)
    elif isinstance(module, (nn.Linear, nn.Conv2d)):
        nn.init.uniform_(module.weight, -0.2, 0.2)
    if hasattr(module, "weight_g"):
        nn.init.uniform_(module.weight_g, 0.5, 1.5)


def _convert(model: nn.Module, change: str, step: int) -> None:
    if change == "channels_last":
        model.to(memory_format=torch.channels_last)
    elif change == "float64_and_back":
        model.to(torch.float64 if step % 2 == 0 else torch.float32)
    elif change == "half_then_float":
        model.half()
        model.float()
    elif change == "requires_grad_toggle":
        model.requires_grad_(step % 2 == 1)
    elif change == "apply_init":
        torch.manual_seed(10 + step)
        model.apply(_init)
    elif change == "vector_to_parameters":
        vector = nn.utils.parameters_to_vector(model.parameters())
        nn.utils.vector_to_parameters(vector * 0.9 + 0.01, model.parameters())


CHANGES = ["channels_last", "float64_and_back", "half_then_float", "requires_grad_toggle", "apply_init",
           "vector_to_parameters"]


#: The conv model (weight_norm and spectral_norm Conv2d) for every change; the hook-based
#: weight_norm (its `weight` is a plain attribute the hook recomputes) for dtype changes and init.
CASES = [("conv2d", change) for change in CHANGES] + [
    ("hook_weight_norm", change) for change in ("half_then_float", "apply_init", "vector_to_parameters")
]


@pytest.mark.parametrize(("kind", "change"), CASES)
@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_conversions_between_training_steps(mode, kind, change):
    results = []
    for model in twin_nets(kind, mode):
        # Compiled for the memory format change (dynamo recompiles for it); eager otherwise.
        call = torch.compile(model, backend="eager") if change == "channels_last" else model
        record = []
        for i in range(2):
            _convert(model, change, i)
            p = next(model.parameters())
            x = _input(kind).to(p.dtype)
            if x.dim() == 4:
                x = x.to(memory_format=torch.channels_last)
            model.train()
            model.zero_grad()
            y = call(x)
            if y.requires_grad:
                y.square().sum().backward()
            record += [y.detach(), _grads(model)]
            model.eval()
            with torch.no_grad():
                record += [call(x), call(x)]
        record += [model.state_dict(), list(model.parameters())]
        results.append(record)
    assert_same(*results)


@pytest.mark.parametrize(("kind", "change"), [case for case in CASES if case[1] != "requires_grad_toggle"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_conversions_between_inference_calls(mode, kind, change):
    results = []
    for model in twin_nets(kind, mode, eval_only=True):
        call = torch.compile(model, backend="eager") if change in ("channels_last", "float64_and_back") else model
        record = []
        for i in range(3):
            _convert(model, change, i)
            p = next(model.parameters())
            x = _input(kind).to(p.dtype)
            if x.dim() == 4:
                x = x.to(memory_format=torch.channels_last)
            with torch.no_grad():
                record += [call(x), call(x), model(x)]
        record += [model.state_dict(), list(model.parameters())]
        results.append(record)
    assert_same(*results)


def test_freeze_refuses_originals_made_trainable_again():
    # model.requires_grad_(True) after prepare(mode="freeze"): a FoldError that says what to do.
    model = paramfold.prepare(small_net("weight_norm").eval().requires_grad_(False), "freeze")
    with torch.no_grad():
        model(_input("weight_norm"))
    model.requires_grad_(True)
    with pytest.raises(paramfold.FoldError, match="restore"), torch.no_grad():
        model(_input("weight_norm"))


@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_inference_mode_validation_between_training_steps(mode):
    # Lightning validates under torch.inference_mode(): eval calls (frozen under auto), and one
    # in training mode (spectral_norm's power iteration writes _u/_v there), then training goes on.
    x = _input("spectral_norm")
    results = []
    for model in twin_nets("spectral_norm", mode):
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        record = []
        for _ in range(3):
            y = _train_step(model, model, opt, x)
            record.append(y.detach())
            model.eval()
            with torch.inference_mode():
                record += [model(x).clone(), model(x).clone()]
            model.train()
            with torch.inference_mode():
                record.append(model(x).clone())
        record.append(model.state_dict())
        results.append(record)
    assert_same(*results)
