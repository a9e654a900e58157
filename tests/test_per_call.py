"""Deterministic proxies of the steady per-call path (issue 9): what a call of a prepared model
costs in Python beyond the plain model's call, and what it changes that dynamo's guards look at.

Timings are left to ``examples/percall_bench.py``; these tests count instead.
"""

from __future__ import annotations

import copy
import gc
import importlib
import sys
from collections import Counter

import pytest
import torch
from helpers import Doubled, assert_same_tensors
from torch import nn
from torch.nn.utils import parametrize as P
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import paramfold
from paramfold.bench import BenchConfig, build_model, make_input, unparametrize

FREEZING = [("freeze", "content"), ("freeze", "version"), ("auto", "content"), ("auto", "version")]
#: Python frames a steady call may add to the plain model's, whatever the number of sites: the
#: scope's open and close, the plan's check, and since 2026-12-04 one for what the values must
#: have been computed under (``compute.computed_under``: settings and modes; 25 before). 18 since
#: 2026-12-06: torch.compiler.disable's wrapper replaced where dynamo's callback is set (two C
#: calls) and left out where it is not, and the root's call checks tracing and the open scope
#: and the plan computes hoisted values without a frame each where there is nothing to do.
STEADY_FRAMES = 18


def _seed_pair(layers: int) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    config = BenchConfig(layers=layers, width=16)
    stock, plain = (_seeded(config) for _ in range(2))  # not deepcopy: stock's copies share a class
    return stock, unparametrize(plain), make_input(config)


def _seeded(config: BenchConfig) -> nn.Module:
    torch.manual_seed(0)
    return build_model(config).eval().requires_grad_(False)


def _python_frames(fn, x: torch.Tensor) -> Counter:
    """Python frames entered by one call of ``fn`` (after two warm-up calls), with the cyclic GC
    paused: a collection would run the finalizers of earlier tests' objects inside the call."""
    fn(x), fn(x)
    frames: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call":
            frames[frame.f_code.co_name] += 1

    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        fn(x)
    finally:
        sys.setprofile(None)
        gc.enable()
    return frames


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode,check", FREEZING)
def test_steady_call_python_work_does_not_grow_with_the_number_of_sites(mode, check, compiled):
    extra, seen = {}, {}
    for layers in (2, 8):  # 4 and 16 sites
        stock, plain, x = _seed_pair(layers)
        ours = paramfold.prepare(stock, mode, freeze_check=check)
        if compiled:
            torch._dynamo.reset()
            plain, ours = torch.compile(plain, backend="eager"), torch.compile(ours, backend="eager")
        with torch.no_grad():
            assert torch.equal(ours(x), plain(x))
            seen[layers] = _python_frames(ours, x)
            extra[layers] = sum(seen[layers].values()) - sum(_python_frames(plain, x).values())
    assert extra[2] == extra[8], (extra, seen[8] - seen[2], seen[2] - seen[8])  # a constant, not a walk over sites
    assert extra[8] <= STEADY_FRAMES, extra


@pytest.mark.parametrize("entry", ["uncompiled", "method", "model"])
def test_a_steady_call_opens_its_scope_without_compiler_disables_wrapper(entry):
    # Regression: the scope's open and close always ran through torch.compiler.disable's wrapper
    # (a dozen Python calls and four eval-frame switches each, about 1.5 us). Where dynamo's
    # callback is set (torch.compile(model), whose first frame is the root's call) they run with
    # it switched off by two C calls; an uncompiled call, or model.compile()'s, needs neither.
    stock, plain, x = _seed_pair(2)
    ours = paramfold.prepare(stock, "auto")
    torch._dynamo.reset()
    if entry == "method":
        ours.compile(backend="eager")
        plain.compile(backend="eager")
    elif entry == "model":
        ours, plain = torch.compile(ours, backend="eager"), torch.compile(plain, backend="eager")
    with torch.no_grad():
        assert torch.equal(ours(x), plain(x))
        frames, plain_frames = _python_frames(ours, x), _python_frames(plain, x)
    assert frames["_fn"] == plain_frames["_fn"], (frames, plain_frames)
    assert frames["_outside_dynamo"] == (2 if entry == "model" else 0)


def _bytecode(fn) -> int:
    """Bytecode instructions the interpreter runs in one call of ``fn``."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "opcode":
            count += 1
        return local

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        return local

    gc.collect()
    gc.disable()  # as in _python_frames
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
        gc.enable()
    return count


@pytest.mark.parametrize("mode,check", FREEZING)
def test_steady_call_scope_runs_the_same_python_bytecode_for_4_and_64_sites(mode, check):
    # The steady plan's checks and bookkeeping run as map() over C callables: the interpreter's
    # work to open and close a call's scope is a constant, whatever the number of sites (the C
    # work per site stays, about 1 us on this machine).
    scope = importlib.import_module("paramfold.scope")
    counts = {}
    for layers in (2, 32):
        stock, plain, x = _seed_pair(layers)
        ours = paramfold.prepare(stock, mode, freeze_check=check)
        with torch.no_grad():
            assert torch.equal(ours(x), plain(x))
            assert torch.equal(ours(x), plain(x))
            counts[layers] = _bytecode(lambda: scope._close(*scope._open(ours)))
            assert torch.equal(ours(x), plain(x))
    assert counts[2] == counts[32], counts


def test_steady_compiled_inline_call_has_a_plan_and_constant_python_work():
    # Regression: a model with any inline site (so every inline model) had no steady plan, and
    # each call walked every holder and site in Python.
    extra = {}
    for layers in (2, 8):
        stock, plain, x = _seed_pair(layers)
        torch._dynamo.reset()
        prepared = paramfold.prepare(stock, "inline")
        ours, plain = torch.compile(prepared, backend="eager"), torch.compile(plain, backend="eager")
        with torch.no_grad():
            assert torch.equal(ours(x), plain(x))
            extra[layers] = sum(_python_frames(ours, x).values()) - sum(_python_frames(plain, x).values())
        assert prepared.__dict__["_paramfold"].plan is not None
    assert extra[2] == extra[8], extra
    assert extra[8] <= STEADY_FRAMES, extra


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_steady_hoisted_call_costs_per_site_only_the_parametrization_call(grad):
    # Hoist computes every value at every call; beyond a constant, each site costs exactly its
    # parametrization's forward (called directly: with no hooks nn.Module.__call__ and _call_impl
    # would add two frames and do nothing else): no bookkeeping per site.
    extra = {}
    for layers in (2, 8):
        stock, plain, x = _seed_pair(layers)
        stock.requires_grad_(grad), plain.requires_grad_(grad)
        torch._dynamo.reset()
        ours = torch.compile(paramfold.prepare(stock, "hoist"), backend="eager")
        plain = torch.compile(plain, backend="eager")
        with torch.set_grad_enabled(grad):
            extra[layers] = sum(_python_frames(ours, x).values()) - sum(_python_frames(plain, x).values())
    per_site = (extra[8] - extra[2]) / (2 * (8 - 2))
    assert per_site == 1, extra
    assert extra[2] - 1 * 4 <= STEADY_FRAMES, extra


def _call_path_changes():
    """Ways to make a parametrization module's call more than its class's forward, after the plan exists."""
    def forward_hook(m):
        return m.register_forward_hook(lambda mod, args, out: out + 1).remove

    def pre_hook(m):
        return m.register_forward_pre_hook(lambda mod, args: (args[0] * 3,)).remove

    def global_hook(m):
        return nn.modules.module.register_module_forward_hook(
            lambda mod, args, out: out - 1 if isinstance(mod, type(m)) else None).remove

    def instance_forward(m):
        m.forward = lambda x: x * 5
        return lambda: delattr(m, "forward")

    def class_forward(m):
        saved = type(m).forward
        type(m).forward = lambda self, x: x * 7
        return lambda: setattr(type(m), "forward", saved)

    def class_set(m):
        cls = type(m)
        m.__class__ = type("Tripled", (cls,), {"forward": lambda self, x: cls.forward(self, x) * 3})
        return lambda: setattr(m, "__class__", cls)

    def compiled_member(m):
        def off_by_one(gm, example_inputs):  # a backend whose results differ, so its use shows
            return lambda *args: [out + 1 for out in gm(*args)]

        m.compile(backend=off_by_one)
        return lambda: setattr(m, "_compiled_call_impl", None)

    return [forward_hook, pre_hook, global_hook, instance_forward, class_forward, class_set, compiled_member]


def _spectral_norm_in_eval(layer: nn.Module) -> None:
    torch.nn.utils.parametrizations.spectral_norm(layer)
    layer.eval()


@pytest.mark.parametrize("change", _call_path_changes(), ids=lambda f: f.__name__)
@pytest.mark.parametrize("mode", ["hoist", "auto"])
@pytest.mark.parametrize("chain", ["custom", "spectral_norm"])
def test_a_hook_or_override_added_to_a_hoisted_chain_after_the_plan_is_honoured_like_stock(chain, mode, change):
    # The steady path calls a chain member's forward directly only while a module call would do
    # just that; a hook, an instance or class override, or member.compile() added later is run.
    # torch's own parametrizations (spectral_norm) have no settings watched for random draws:
    # the plan watches what their call depends on by itself.
    if chain == "spectral_norm" and change.__name__ == "compiled_member":
        pytest.skip("dynamo does not compile a frame of torch's own files: stock runs member.compile()'s eagerly")

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        for layer in model:
            if chain == "custom":
                P.register_parametrization(layer, "weight", Doubled())
            else:
                _spectral_norm_in_eval(layer)
        return model

    stock, ours = build(), paramfold.prepare(build(), mode)
    x = torch.randn(2, 4)
    for _ in range(3):  # into the steady plan
        assert torch.equal(ours(x), stock(x))
    plan = ours.__dict__["_paramfold"].plan
    assert plan is not None and plan.direct and plan.plain_calls()  # the forwards called directly
    before = stock(x)
    undo = [change(m[0].parametrizations.weight[0]) for m in (stock, ours)]
    try:
        want = stock(x)
        assert not torch.equal(want, before), "the change should change stock's result"
        assert torch.equal(ours(x), want)
        assert torch.equal(ours(x), stock(x))
    finally:
        for u in reversed(undo):
            u()
        torch._dynamo.reset()
    assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("mode,check", FREEZING)
def test_steady_calls_change_no_module_dict_and_compile_once(mode, check):
    guards = pytest.importorskip("torch._C._dynamo.guards")
    dict_version = getattr(guards, "dict_version", None)
    if dict_version is None:
        pytest.skip("this torch has no torch._C._dynamo.guards.dict_version")
    stock, plain, x = _seed_pair(4)
    ours = paramfold.prepare(stock, mode, freeze_check=check)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(ours, backend="eager")
    with torch.no_grad():
        compiled(x)
        versions = [dict_version(m.__dict__) for m in ours.modules()]
        for _ in range(3):
            assert torch.equal(compiled(x), plain(x))
        # Unchanged dicts: dynamo skips the guards of their tensors, as for the plain model.
        assert [dict_version(m.__dict__) for m in ours.modules()] == versions
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_a_change_leaves_the_fast_path_and_the_next_call_takes_it_again():
    stock, plain, x = _seed_pair(2)
    ours = paramfold.prepare(copy.deepcopy(stock), "freeze")
    scope_plan = sys.modules["paramfold.scope_plan"]
    with torch.no_grad():
        ours(x)
        plan = ours.__dict__["_paramfold"].plan
        assert plan is not None
        ours(x)
        assert ours.__dict__["_paramfold"].plan is plan  # reused
        for model in (stock, ours):
            model.seq[0].linear.parametrizations.weight.original.data.mul_(2)  # no version bump
        assert not scope_plan.holds(plan)
        assert torch.equal(ours(x), stock(x))
        assert ours.__dict__["_paramfold"].plan is not plan
        assert scope_plan.holds(ours.__dict__["_paramfold"].plan)


def test_content_check_reads_the_bytes_only_of_inputs_something_outside_torch_may_hold(monkeypatch):
    # freeze_check="content": an input that is the only tensor on its storage is armed (any later
    # write through torch, or hand-out of a pointer to its bytes, disarms it), so its bytes are not
    # read at each call; one that a numpy array (or a view, or a DLPack capsule) already shares is
    # hashed in place on the host, and compared with a copy where it is not contiguous.
    import ctypes

    write_marks = importlib.import_module("paramfold.write_marks")
    scope_plan = importlib.import_module("paramfold.scope_plan")
    torch.manual_seed(0)
    stock = nn.Linear(4, 4).eval().requires_grad_(False)
    stock.weight = nn.Parameter(torch.randn(4, 4).t(), requires_grad=False)  # not contiguous
    P.register_parametrization(stock, "weight", Doubled())
    weight_norm(stock, "bias", dim=None)
    ours = paramfold.prepare(copy.deepcopy(stock), "freeze")
    g, v = ours.parametrizations.bias.original0, ours.parametrizations.bias.original1
    w = ours.parametrizations.weight.original
    held_v, held_w = v.detach().numpy(), w.detach()  # made before the values are frozen, kept alive to the end
    assert held_w.data_ptr() == w.data_ptr()
    hashed = []
    real = write_marks.digest
    for module in (write_marks, scope_plan):
        monkeypatch.setattr(module, "digest", lambda memory: hashed.append(1) or real(memory))
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(ours(x), stock(x))
        frozen = {n: s.frozen for n, s in ours.__dict__["_paramfold"].sites.items()}
        assert len(frozen["weight"].views) == 1 and not frozen["weight"].raw  # shared, transposed
        assert [ctypes.addressof(memory) for memory, _ in frozen["bias"].raw] == [v.data_ptr()]  # in place
        assert not frozen["bias"].views and any(t is g for t in frozen["bias"].armed)
        ours(x), ours(x)  # the second one through the steady plan
        hashed.clear()
        ours(x), ours(x)
        assert len(hashed) == 2  # v's bytes, once per call; g's never
        held_v[0] += 1  # through the array made before freezing
        stock.parametrizations.bias.original1.detach().numpy()[0] += 1
        assert torch.equal(ours(x), stock(x))
        for model in (stock, ours):
            model.parametrizations.weight.original.data.add_(1)
        assert torch.equal(ours(x), stock(x))
        for model in (stock, ours):  # an array of g made now disarms it
            model.parametrizations.bias.original0.detach().numpy()[...] *= 2
        assert torch.equal(ours(x), stock(x))


def test_content_check_of_a_model_whose_storages_nothing_else_holds_reads_no_bytes(monkeypatch):
    # The steady call's cost must not grow with the model's bytes: the seed model's 64 originals
    # are each the only tensor on their storage, so a steady call arms and checks, and hashes nothing.
    write_marks = importlib.import_module("paramfold.write_marks")
    scope_plan = importlib.import_module("paramfold.scope_plan")
    stock, plain, x = _seed_pair(4)
    ours = paramfold.prepare(copy.deepcopy(stock), "freeze")
    hashed = []
    real = write_marks.digest
    for module in (write_marks, scope_plan):
        monkeypatch.setattr(module, "digest", lambda memory: hashed.append(1) or real(memory))
    with torch.no_grad():
        ours(x), ours(x)
        plan = ours.__dict__["_paramfold"].plan
        assert plan is not None and scope_plan.holds(plan)
        assert plan.raw_memory == () and plan.views == ()
        hashed.clear()
        for _ in range(3):
            assert torch.equal(ours(x), stock(x))
        assert hashed == []
        original = ours.seq[0].linear.parametrizations.weight.original
        original.detach().numpy()[0, 0] += 1  # a pointer handed out now disarms the storage
        stock.seq[0].linear.parametrizations.weight.original.detach().numpy()[0, 0] += 1
        assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("check", ["content", "version"])
def test_the_steady_check_reads_no_version_counter_of_a_write_marked_tensor(check):
    # Whatever bumps a version counter writes the storage, which clears its write mark: the plan
    # reads the marks, and version counters only of tensors without one (memory torch did not
    # allocate: here an original over a numpy array). Each kind of write is still seen.
    import numpy as np

    scope_plan = importlib.import_module("paramfold.scope_plan")
    stock, plain, x = _seed_pair(3)
    ours = copy.deepcopy(stock)
    for model in (stock, ours):
        foreign = model.seq[1].linear.parametrizations.weight
        foreign.original = nn.Parameter(torch.from_numpy(np.array(foreign.original.numpy())), requires_grad=False)
    paramfold.prepare(ours, "freeze", freeze_check=check)
    with torch.no_grad():
        ours(x), ours(x)
        plan = ours.__dict__["_paramfold"].plan
        assert plan is not None and scope_plan.holds(plan)
        theirs = ours.seq[1].linear.parametrizations.weight.original
        assert [t is theirs for t in plan.versioned] == [True] and plan.versioned_values == ()
        assert len(plan.inputs) == 6 and len(plan.values) == 6
        for write in (lambda m: m.seq[0].linear.parametrizations.weight.original.add_(1),
                      lambda m: m.seq[2].linear.parametrizations.bias.original.mul_(2),
                      lambda m: m.seq[1].linear.parametrizations.weight.original.sub_(1)):
            for model in (stock, ours):
                write(model)
            assert not scope_plan.holds(ours.__dict__["_paramfold"].plan)
            assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("mode", ["freeze", "auto", "hoist"])
def test_the_steady_check_reads_the_members_classes_and_dicts_in_the_guard_managers_pass(mode, managers, monkeypatch):
    # Four Python maps (members' classes, their __dict__s, the dict entries and keys the plan
    # pins) read one object each per call; the guard manager reads them with the tags (built at
    # the plan's first use, checked from Python once). Each replacement is still seen, and its
    # call is stock's.
    watch = importlib.import_module("paramfold.watch")
    scope_plan = importlib.import_module("paramfold.scope_plan")
    from_python = []
    real = watch.Identities.same
    monkeypatch.setattr(watch.Identities, "same", lambda self: from_python.append(self) or real(self))
    stock, _, x = _seed_pair(3)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(ours(x), stock(x))
        plan = ours.__dict__["_paramfold"].plan
        ids = plan.watch.ids
        members = [m for layer in ours.seq for plist in layer.linear.parametrizations.values() for m in (plist, *plist)]
        assert {id(m) for m in ids.typed} >= ({id(m) for m in members} if mode != "hoist" else set())
        assert len(ids.key_names) >= 2 * len(ours.seq) and plan.watch._root is not None
        assert len(from_python) == 1 and len(managers) == 1  # the plan's first use, the second call
        assert scope_plan.holds(plan) and ours(x) is not None and len(from_python) == 1
        base = type(ours.seq[1].linear.parametrizations.weight[0])
        doubled = type("Doubled", (base,), {"forward": lambda self, t: 2 * base.forward(self, t)})
        changes = [lambda m: setattr(m.seq[1].linear.parametrizations.weight[0], "__class__", doubled),
                   lambda m: setattr(m.seq[2].linear, "forward", m.seq[2].linear.forward)]
        if mode != "hoist":  # hoist reads a member's attributes at every call: its __dict__ is not pinned
            changes.append(lambda m: object.__setattr__(m.seq[0].linear.parametrizations.weight[0], "__dict__",
                                                        dict(vars(m.seq[0].linear.parametrizations.weight[0]))))
        for change in changes:
            for model in (stock, ours):
                change(model)
            assert not scope_plan.holds(ours.__dict__["_paramfold"].plan)
            assert torch.equal(ours(x), stock(x))


class _KeyEncoder(nn.Module):
    """MoCo-style: a grad call whose forward runs another encoder under no_grad."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.query = nn.Sequential(*[weight_norm(nn.Linear(4, 4)) for _ in range(depth)])
        self.key = nn.Sequential(*[weight_norm(nn.Linear(4, 4)) for _ in range(depth)])

    def forward(self, x):
        with torch.no_grad():
            k = self.key(x)
        return self.query(x) + k


@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_a_no_grad_region_in_the_forward_is_checked_once_not_at_every_module_called_in_it(mode):
    # Only a switch to grad mode (or another autocast state) needs values computed again; the
    # region's state is what the calls nested in it then compare with, so one slow check per
    # region, not one walk over the sites below every module called inside it.
    counts = {}
    for depth in (2, 6):
        torch.manual_seed(0)
        stock = _KeyEncoder(depth)
        ours = paramfold.prepare(copy.deepcopy(stock), mode)
        x = torch.randn(2, 4)
        assert torch.equal(ours(x), stock(x))
        counts[depth] = _python_frames(ours, x)["changed"]
    # (nn.Module._wrapped_call_impl reads _compiled_call_impl twice: test, then call)
    assert counts[2] == counts[6] <= 2, counts


def _trainable_seed(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return build_model(BenchConfig(layers=layers, width=16)).eval().requires_grad_(True)  # as users leave it


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("check", ["content", "version"])
def test_auto_freezes_a_trainable_model_for_no_grad_calls(check, compiled, monkeypatch):
    # Regression: inference the usual way (model.eval() and torch.no_grad(), parameters left
    # trainable) computed every value at every call under auto, as hoist does.
    freeze = importlib.import_module("paramfold.freeze")
    computed = []
    real = freeze.compute
    monkeypatch.setattr(freeze, "compute", lambda *a: computed.append(a) or real(*a))
    stock = _trainable_seed()
    ours = paramfold.prepare(copy.deepcopy(stock), "auto", freeze_check=check)
    assert all(p.requires_grad for p in ours.parameters())
    torch._dynamo.reset()
    run = torch.compile(ours, backend="eager") if compiled else ours
    x = make_input(BenchConfig(layers=2, width=16))
    with torch.no_grad():
        run(x)
        first = len(computed)
        assert first == 4  # once per site
        for _ in range(3):
            assert torch.equal(run(x), stock(x))
    assert len(computed) == first
    plan = ours.__dict__["_paramfold"].plan  # the steady plan serves them, as it does freeze's
    assert plan is not None and not plan.grad and len(plan.values) == 4


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_auto_on_a_trainable_model_alternating_no_grad_and_training_steps_equals_stock(compiled):
    # A frozen value serves no_grad calls only: a grad call between them computes with autograd
    # (hoisted), and the optimizer step after it makes the next no_grad call compute afresh.
    stock = _trainable_seed()
    ours = paramfold.prepare(copy.deepcopy(stock), "auto")
    torch._dynamo.reset()
    run = torch.compile(ours, backend="eager") if compiled else ours
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (stock, ours)]
    x = make_input(BenchConfig(layers=2, width=16))
    for step in range(3):
        with torch.no_grad():
            assert torch.equal(run(x), stock(x)), step
            assert torch.equal(run(x), stock(x)), step
        outs = [stock(x), run(x)]
        assert torch.equal(outs[1], outs[0]), step
        for out, opt in zip(outs, opts):
            out.float().square().sum().backward()
            opt.step()
            opt.zero_grad()
        assert_same_tensors(stock.state_dict(), ours.state_dict(), step)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_weights_updated_before_every_call_are_computed_at_every_call_without_fingerprints(mode, compiled, monkeypatch):
    # Regression (speed): an EMA or target model, or a policy sampled after every optimizer step,
    # made freeze and auto recompute each value, fingerprint every input (bytes hashed), walk the
    # general path and build a steady plan (its guard manager too) at every call: 5x stock's call
    # on the seed. After consecutive calls with changed inputs such a site is computed at every
    # call as hoist does, through the steady plan; freezing is tried again later.
    freeze = importlib.import_module("paramfold.freeze")
    watch = importlib.import_module("paramfold.watch")
    fingerprints, managers = [], []
    real_freeze, real_manager = freeze._freeze, watch._guard_manager
    monkeypatch.setattr(freeze, "_freeze", lambda *a: fingerprints.append(a) or real_freeze(*a))
    monkeypatch.setattr(watch, "_guard_manager", lambda *a: managers.append(a) or real_manager(*a))
    stock, _, x = _seed_pair(2)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    torch._dynamo.reset()
    run = torch.compile(ours, backend="eager") if compiled else ours
    state = ours.__dict__["_paramfold"]
    sites = [s for m in ours.modules() if "_paramfold" in m.__dict__ for s in m.__dict__["_paramfold"].sites.values()]
    with torch.no_grad():
        for call in range(10):  # the period starts at call 2 and ends after call 9
            for model in (stock, ours):
                for p in model.parameters():
                    p.add_(1e-3)
            assert torch.equal(run(x), stock(x)), call
            if call == 2:  # frozen at call 0, changed at calls 1 and 2: computed at every call now
                assert all(s.frozen is None and s.hoist_until > 0 for s in sites)
                fingerprinted, built = len(fingerprints), len(managers)
            if call == 3:
                plan = state.plan
        assert len(fingerprints) == fingerprinted  # no input fingerprinted since
        assert state.plan is plan and plan is not None and len(plan.hoisted) == len(sites)  # the steady plan serves them
        assert len(managers) <= built + 1
        # Weights that stop changing are frozen again when the period ends (8 calls).
        for call in range(12):
            assert torch.equal(run(x), stock(x)), call
        assert all(s.frozen is not None for s in sites)
        assert len(state.plan.values) == len(sites)


@pytest.fixture
def managers(monkeypatch) -> list:
    """The arguments of every guard manager ``paramfold.watch`` builds from now on."""
    watch = importlib.import_module("paramfold.watch")
    if not watch._USE_GUARD_MANAGER:
        pytest.skip("this torch's guard manager is not used (paramfold.watch)")
    built = []
    real = watch._guard_manager
    monkeypatch.setattr(watch, "_guard_manager", lambda *a: built.append(a) or real(*a))
    return built


def test_a_rebuilt_plan_reuses_the_guard_manager_while_its_guards_hold(managers):
    # Building dynamo's guard manager costs more than a call of the seed (one accessor per
    # watched dict and tensor, through Python); a plan rebuilt with the same dicts, unwritten,
    # and tensors described alike (a frozen value recomputed) keeps the last one.
    stock, _, x = _seed_pair(2)
    ours = paramfold.prepare(copy.deepcopy(stock), "freeze")
    with torch.no_grad():
        ours(x)
        assert managers == []  # built at the plan's first use, the next call
        ours(x)
        assert len(managers) == 1
        first = ours.__dict__["_paramfold"].plan
        for model in (stock, ours):
            model.seq[0].linear.parametrizations.weight.original.add_(1)
        assert torch.equal(ours(x), stock(x))
        again = ours.__dict__["_paramfold"].plan
        assert again is not first and again.watch._root is first.watch._root and len(managers) == 1
        assert torch.equal(ours(x), stock(x))  # unchanged (two changed calls in a row would compute at every call)
        for model in (stock, ours):  # re-described: the guards do not hold, new ones are built
            linear = model.seq[0].linear.parametrizations.weight
            linear.original.data = linear.original.data.t().contiguous().t()
        assert torch.equal(ours(x), stock(x))
        assert len(managers) == 1 and ours.__dict__["_paramfold"].plan.watch.same()  # its first use
        assert len(managers) == 2


@pytest.mark.parametrize("mode", ["freeze", "hoist", "auto"])
def test_a_plan_rebuilt_after_a_setting_changed_reuses_the_guard_manager(mode, managers):
    # A plan is built inside the scope of the call that opened the general way, where the holders
    # have the scope's class and the hoisted values are put in: a watch that checked either could
    # not be reused there, and every rebuild would build a guard manager (milliseconds) again.
    stock = _trainable_seed() if mode == "auto" else _seed_pair(2)[0]  # auto, trainable, grad: hoisted
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = make_input(BenchConfig(layers=2, width=16))
    with torch.set_grad_enabled(mode == "auto"):
        for call in range(3):
            assert torch.equal(ours(x), stock(x)), call
        state = ours.__dict__["_paramfold"]
        first = state.plan
        assert first is not None and len(managers) == 1
        assert (len(first.hoisted) > 0) is (mode != "freeze")
        deterministic = torch.are_deterministic_algorithms_enabled()
        try:
            torch.use_deterministic_algorithms(True)  # what values are computed under changed
            for call in range(3):
                assert torch.equal(ours(x), stock(x)), call
            again = state.plan
            assert again is not first and importlib.import_module("paramfold.scope_plan").holds(again)
        finally:
            torch.use_deterministic_algorithms(deterministic)
        assert again.watch._root is first.watch._root and len(managers) == 1


def test_calls_alternating_grad_modes_build_plans_only_now_and_then(monkeypatch):
    # A rollout under no_grad and a training step with grad, in turn: each call opens the general
    # way (the other mode's call changed what a plan relies on), so a plan built after it is never
    # used; building one at every call cost more than the call. Plans are built after 1, 2, 4,
    # ... such calls, and the plan path is back as soon as calls stop alternating.
    scope_plan = importlib.import_module("paramfold.scope_plan")
    builds = []
    real = scope_plan.Plan.build
    monkeypatch.setattr(scope_plan.Plan, "build", classmethod(lambda cls, *a, **k: builds.append(a) or real(*a, **k)))
    stock = _trainable_seed()
    ours = paramfold.prepare(copy.deepcopy(stock), "auto")
    x = make_input(BenchConfig(layers=2, width=16))
    for call in range(64):
        with torch.set_grad_enabled(bool(call % 2)):
            assert torch.equal(ours(x), stock(x)), call
    assert len(builds) <= 16  # one per call before; now one per mode and computed-at-every-call period
    state = ours.__dict__["_paramfold"]
    with torch.no_grad():
        for call in range(40):
            assert torch.equal(ours(x), stock(x)), call
        assert state.plan is not None and state.plan.used and scope_plan.holds(state.plan)
        built = len(builds)
        for _ in range(3):
            ours(x)
        assert len(builds) == built


def _noted_call(module: nn.Module, args: tuple) -> None:
    module.calls = getattr(module, "calls", 0) + 1


@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_a_model_no_plan_serves_builds_one_only_now_and_then(mode, plan_counts):
    # Regression: where Plan.build finds no plan (a hook-based norm's layer with a forward
    # pre-hook of the user's, whose value is computed where read; FSDP2's sharded originals),
    # the next call found none and built one again: a build at every call. Builds now back off
    # as for plans that never serve (1, 2, 4, ...).
    claims, builds = plan_counts
    torch.manual_seed(0)
    stock = nn.Sequential(*[torch.nn.utils.spectral_norm(nn.Linear(8, 8)) for _ in range(3)])
    stock[1].register_forward_pre_hook(_noted_call)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(3, 8)
    for call in range(40):
        assert torch.equal(ours(x), stock(x)), call
        assert_same_tensors(dict(ours.named_buffers()), dict(stock.named_buffers()), call)
    assert not claims and 1 <= len(builds) <= 8, len(builds)  # 40 before
    # The entry's plans dropped (its sites changed): the next call builds one at once.
    state = ours.__dict__["_paramfold"]
    state.drop_caches()
    built = len(builds)
    assert torch.equal(ours(x), stock(x))
    assert len(builds) == built + 1


@pytest.mark.parametrize("trainable", [True, False], ids=["trainable", "frozen-weights"])
def test_rollouts_between_training_steps_are_served_by_each_grad_mode_s_plan(trainable, monkeypatch):
    # RLHF's loop: a rollout under no_grad, then a step with grad (a backward and an optimizer
    # step when the model trains). Each call used to open the general way: a grad call dropped
    # the values a no_grad plan keeps (and auto recomputed and fingerprinted them at the next
    # rollout), a kept tuple made afresh at every call failed the other plan's identity check,
    # and only the plan of the last call's grad mode was tried. Now a trainable auto site whose
    # frozen values keep being dropped is computed at every call, and each grad mode's plan
    # serves its calls.
    scope_plan = importlib.import_module("paramfold.scope_plan")
    freeze = importlib.import_module("paramfold.freeze")
    claims, fingerprints = [], []
    real_claim, real_freeze = scope_plan.Plan.claim, freeze._freeze
    monkeypatch.setattr(scope_plan.Plan, "claim", lambda self: claims.append(self.grad) or real_claim(self))
    monkeypatch.setattr(freeze, "_freeze", lambda *a: fingerprints.append(a) or real_freeze(*a))
    stock = _trainable_seed().requires_grad_(trainable)
    ours = paramfold.prepare(copy.deepcopy(stock), "auto")
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (stock, ours)] if trainable else []
    x = make_input(BenchConfig(layers=2, width=16))
    for step in range(24):
        if step == 12:
            claims.clear()
            fingerprinted = len(fingerprints)
        with torch.no_grad():
            assert torch.equal(ours(x), stock(x)), step
        outs = [stock(x), ours(x)]
        assert torch.equal(outs[1], outs[0]), step
        if trainable:
            for out, opt in zip(outs, opts):
                out.float().square().sum().backward()
                opt.step()
                opt.zero_grad()
            assert_same_tensors(stock.state_dict(), ours.state_dict(), step)
    # The last 12 steps: both grad modes' calls through plans, but for the few that try freezing
    # again at the end of a computed-at-every-call period (trainable) and nothing fingerprinted
    # (frozen weights: the values frozen once serve both modes).
    assert claims.count(False) >= 10 and claims.count(True) >= 10, claims
    if not trainable:
        assert len(fingerprints) == fingerprinted and len(claims) == 24


@pytest.fixture
def plan_counts(monkeypatch):
    """``(claims, builds)``: the steady plans that served a call, and the arguments of each plan built."""
    scope_plan = importlib.import_module("paramfold.scope_plan")
    claims, builds = [], []
    real_claim, real_build = scope_plan.Plan.claim, scope_plan.Plan.build
    monkeypatch.setattr(scope_plan.Plan, "claim", lambda self: claims.append(self) or real_claim(self))
    monkeypatch.setattr(scope_plan.Plan, "build", classmethod(lambda cls, *a, **k: builds.append(a) or real_build(*a, **k)))
    return claims, builds


@pytest.mark.parametrize("mode", ["hoist", "inline"])
def test_calls_switching_autocast_are_served_by_each_state_s_plan(mode, plan_counts):
    # A no_grad call, then one under autocast, in turn (mixed-precision eval beside full-precision
    # checks). A plan serves only calls under the autocast state it was made under; with one plan
    # per grad mode, each call found the other state's plan, opened the general way and planned
    # again: about 20x stock's Python calls. Each state now keeps its own plan.
    claims, builds = plan_counts
    stock = _seed_pair(2)[0]
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = make_input(BenchConfig(layers=2, width=16))
    with torch.no_grad():
        for call in range(16):
            if call == 6:
                claims.clear()
                built = len(builds)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(call % 2)):
                assert torch.equal(ours(x), stock(x)), call
    assert len(builds) == built and len(claims) == 10
    assert len({id(plan) for plan in claims}) == 2


class _ModeScale(nn.Module):
    """A parametrization whose value depends on its own training flag."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * (2.0 if self.training else 3.0)


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
def test_a_training_step_and_an_eval_call_in_turn_are_each_served_by_their_plan(mode, plan_counts):
    # A step in train mode, then an eval call under no_grad, in turn (a rollout or validation
    # after every step): model.train() and model.eval() write every module's __dict__, so each
    # plan's tags failed and every call opened the general way (2.5x stock's Python calls). A
    # plan now takes a dict written back to what it held, and a structure module's training
    # flag switched; the value of a chain that reads its own flag follows it, as stock's.
    claims, builds = plan_counts
    torch.manual_seed(0)
    stock = nn.Sequential(weight_norm(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 8), nn.Dropout(0.0))
    P.register_parametrization(stock[2], "weight", _ModeScale())
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(4, 8)
    for step in range(12):
        if step == 4:
            claims.clear()
            built = len(builds)
        for model in (stock, ours):
            model.train()
        outs = [model(x) for model in (stock, ours)]
        assert torch.equal(outs[1], outs[0]), step
        for out in outs:
            out.sum().backward()
        assert_same_tensors({n: p.grad for n, p in ours.named_parameters()},
                            {n: p.grad for n, p in stock.named_parameters()}, step)
        for model in (stock, ours):
            model.zero_grad()
            model.eval()
        with torch.no_grad():
            assert torch.equal(ours(x), stock(x)), step
    if mode != "auto":  # auto freezes the eval call's values: its own plan check, at each switch
        assert len(builds) == built and len(claims) == 16
    for model in (stock, ours):  # a no_grad call in train mode: the chain's value for training
        model.train()
    with torch.no_grad():
        assert torch.equal(ours(x), stock(x))


def test_a_discriminator_whose_requires_grad_is_switched_at_every_step_is_served_by_its_plans(plan_counts):
    # pix2pix's set_requires_grad(D, False) around the generator's step, True around D's: auto's
    # choice for a site depends on its originals' requires_grad, so each switch failed the plan,
    # and the general path planned again at every call (2.2x stock's Python calls per GAN step).
    # The plan that served the other setting is kept, and serves again when it holds.
    claims, builds = plan_counts
    torch.manual_seed(0)
    stock = nn.Sequential(spectral_norm(nn.Linear(8, 8)), nn.LeakyReLU(0.2), spectral_norm(nn.Linear(8, 1)))
    ours = paramfold.prepare(copy.deepcopy(stock), "auto")
    fake = torch.randn(4, 8, requires_grad=True)
    for step in range(12):
        if step == 4:
            claims.clear()
            built = len(builds)
        for trainable in (False, True):  # the generator's step, then the discriminator's
            outs = []
            for model in (stock, ours):
                model.requires_grad_(trainable)
                fake.grad = None
                out = model(fake)
                out.sum().backward()
                outs.append((out, fake.grad.clone(), {n: p.grad for n, p in model.named_parameters()}))
                model.zero_grad()
            assert torch.equal(outs[1][0], outs[0][0]) and torch.equal(outs[1][1], outs[0][1]), step
            assert_same_tensors(outs[1][2], outs[0][2], step)
            assert_same_tensors(dict(ours.named_buffers()), dict(stock.named_buffers()), step)
    assert len(builds) == built and len(claims) == 16


def _hook_normed(layers: int, trainable: bool, norm: str = "weight_norm") -> nn.Module:
    """``layers`` Linear(8, 8) with torch's hook-based weight_norm (vocoders', codecs') or
    spectral_norm (GANs'), in eval."""
    torch.manual_seed(0)
    model = nn.Sequential(*[getattr(torch.nn.utils, norm)(nn.Linear(8, 8)) for _ in range(layers)])
    return model.eval().requires_grad_(trainable)


_HOOK_MODES = [("hoist", True), ("auto", True), ("auto", False), ("freeze", False)]
_HOOK_NORMS = pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])


@_HOOK_NORMS
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode,trainable", _HOOK_MODES)
def test_steady_calls_of_hook_based_norms_are_served_by_a_plan(mode, trainable, compiled, norm, plan_counts):
    # Regression (issue 9): a module with a hook-based norm took the general path at every call
    # (its plan refused hook-based norms) and tried to build a plan again at each: about 50
    # Python calls per site, 1.9x stock's steady call on `paramfold bench --model weight_norm_hooks`
    # (a spectral_norm in eval, whose hook runs no power iteration: 2.7x-2.9x).
    claims, builds = plan_counts
    stock, ours = _hook_normed(8, trainable, norm), paramfold.prepare(_hook_normed(8, trainable, norm), mode)
    fn = torch.compile(ours, backend="eager") if compiled else ours
    x = torch.randn(3, 8)
    with torch.no_grad():
        for call in range(8):
            if call == 3:
                claims.clear()
                built = len(builds)
            assert torch.equal(fn(x), stock(x)), call
            for layer, stock_layer in zip(ours, stock):  # the value left as stock leaves it, the hook back in
                assert torch.equal(layer.weight, stock_layer.weight)
                assert [type(h) for h in layer._forward_pre_hooks.values()] == [type(h) for h in stock_layer._forward_pre_hooks.values()]
            assert_same_tensors(dict(ours.named_buffers()), dict(stock.named_buffers()), call)
    assert len(builds) == built and len(claims) == 5
    torch._dynamo.reset()


class _Discriminator(nn.Module):
    """A GAN discriminator's pattern: hook-based spectral_norm layers, training, scoring a real and
    a fake batch in one forward (each layer called twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[torch.nn.utils.spectral_norm(nn.Linear(8, 8)) for _ in range(3)])

    def forward(self, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        return self.body(real).mean() - self.body(fake).mean()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_steady_training_steps_of_hook_based_spectral_norms_are_served_by_a_plan(mode, compiled, plan_counts):
    # Regression (issue 9): a training hook-based spectral_norm's layer took the general path at
    # every call, and tried to build a plan at each (2.2x-2.4x stock's call on 8 Linear(32,32)).
    # The plan now runs its power iteration through its hook's compute_weight, its state copied
    # first, its stand-ins reset: each step bitwise stock's, buffers and gradients too.
    claims, builds = plan_counts
    torch.manual_seed(0)
    stock = _Discriminator()
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    fn = torch.compile(ours, backend="eager") if compiled else ours
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (stock, ours)]
    for step in range(8):
        if step == 3:
            claims.clear()
            built = len(builds)
        real, fake = torch.randn(4, 8), torch.randn(4, 8)
        outs = [stock(real, fake), fn(real, fake)]
        for out, optimizer in zip(outs, optimizers):
            out.backward()
        assert torch.equal(outs[1], outs[0]), step
        assert_same_tensors({n: p.grad for n, p in ours.named_parameters()},
                            {n: p.grad for n, p in stock.named_parameters()}, step)
        assert_same_tensors(dict(ours.named_buffers()), dict(stock.named_buffers()), step)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for layer, stock_layer in zip(ours.body, stock.body):
            assert torch.equal(layer.weight, stock_layer.weight), step
    assert len(builds) == built and len(claims) == 5
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("where", ["layer", "root", "global"])
@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_a_pre_hook_on_for_some_training_steps_then_removed_is_followed_like_stock(mode, where, compiled):
    # Regression (helper hD, 2026-12-06): a forward pre-hook keeps a hook-based norm's hook in
    # (computed at the layer's call, after it), and those calls leave the layer no stand-in for
    # its read-once class. Once the pre-hook was removed, the plan built before served again:
    # its layer's class ran no stand-in, the value looked unread at every call, and the power
    # iteration was put back each time (weight_u frozen, outputs off by 4e-6 from the next step).
    torch.manual_seed(0)
    stock = _Discriminator()
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    calls = [torch.compile(m, backend="eager") if compiled else m for m in (stock, ours)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (stock, ours)]
    handles = []
    for step in range(10):
        if step == 4:
            if where == "global":
                handles.append(torch.nn.modules.module.register_module_forward_pre_hook(_noted_call))
            else:
                handles += [(m if where == "root" else m.body[0]).register_forward_pre_hook(_noted_call)
                            for m in (stock, ours)]
        if step == 6:
            for handle in handles:
                handle.remove()
        real, fake = torch.randn(4, 8), torch.randn(4, 8)
        outs = [call(real, fake) for call in calls]
        for out, optimizer in zip(outs, optimizers):
            out.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert torch.equal(outs[1], outs[0]), step
        assert_same_tensors(dict(ours.named_buffers()), dict(stock.named_buffers()), step)
        for layer, stock_layer in zip(ours.body, stock.body):
            assert torch.equal(layer.weight, stock_layer.weight), step
    torch._dynamo.reset()


def _scale_v(model: nn.Module) -> None:
    with torch.no_grad():
        model[0].weight_v.mul_(1.5)  # (spectral_norm's: the power iteration's vector, a buffer)


def _replace_g(model: nn.Module) -> None:
    name = "weight_g" if hasattr(model[0], "weight_g") else "weight_orig"
    old = getattr(model[0], name)
    setattr(model[0], name, nn.Parameter(old.detach() * 3, requires_grad=old.requires_grad))


def _one_training_call(model: nn.Module) -> None:
    model.train()
    model(torch.ones(2, 8))  # spectral_norm's power iteration runs
    model.eval()


def _scaling_pre_hook(model: nn.Module) -> None:
    def hook(module, args):
        with torch.no_grad():
            module.weight_v.mul_(0.5)  # after the norm's hook in stock: this call's weight is the last v's

    model[0].register_forward_pre_hook(hook)


def _hook_setting(model: nn.Module) -> None:
    hook = model[0]._forward_pre_hooks[next(iter(model[0]._forward_pre_hooks))]
    hook.dim = 1 if hasattr(model[0], "weight_orig") else -1  # spectral_norm's matrix transposed; the norm over the whole tensor


@_HOOK_NORMS
@pytest.mark.parametrize("change", [_scale_v, _replace_g, _scaling_pre_hook, _hook_setting, _one_training_call],
                         ids=["v-in-place", "g-replaced", "pre-hook-added", "hook-setting", "a-training-call"])
@pytest.mark.parametrize("mode,trainable", _HOOK_MODES)
def test_a_change_to_a_hook_based_norm_between_steady_calls_is_followed_like_stock(mode, trainable, change, norm):
    # What the plan serving hook-based norms holds on: the tensors (in place and replaced), the
    # hook dict (a user's pre-hook: computed where read, after it, as stock does), the hook's own
    # settings, a spectral_norm's module in eval. Each call bitwise stock's, before and after the change.
    if mode == "freeze" and change is _one_training_call:
        pytest.skip("freeze refuses a training call (test_core's refusals)")
    stock, ours = _hook_normed(2, trainable, norm), paramfold.prepare(_hook_normed(2, trainable, norm), mode)
    x = torch.randn(3, 8)
    with torch.no_grad():
        for call in range(8):
            if call == 4:
                change(stock)
                change(ours)
            assert torch.equal(ours(x), stock(x)), call
            assert torch.equal(ours[0].weight, stock[0].weight), call
            assert_same_tensors(dict(ours.named_buffers()), dict(stock.named_buffers()), call)


@_HOOK_NORMS
@pytest.mark.parametrize("mode", ["auto", "freeze"])
def test_steady_python_work_of_frozen_hook_based_norms_does_not_grow_with_the_number_of_layers(mode, norm):
    # Compiled (eager calls pay the nested check per module called, as for parametrizations):
    # the plan takes each layer's hook out and puts it back without a Python frame (before: the
    # general path's ~50 a layer; hooknorms.detach/attach's 6 a layer in a first version).
    frames = {}
    for layers in (2, 8):
        ours = paramfold.prepare(_hook_normed(layers, False, norm), mode)
        fn = torch.compile(ours, backend="eager")
        with torch.no_grad():
            frames[layers] = _python_frames(fn, torch.randn(3, 8))
        torch._dynamo.reset()
    assert frames[2] == frames[8], (frames[8] - frames[2], frames[2] - frames[8])


@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto"])
def test_another_models_frozen_values_leave_a_models_steady_plan_standing(monkeypatch, mode):
    # Regression (helper-210): the steady plan compared a process-wide count of storages armed
    # for frozen values, so another model's first frozen call (or a re-freeze after its weights
    # changed: an EMA model beside the one you train) sent every prepared model back to the
    # general path and rebuilt its plan at its next call (11 ms instead of 1.3 ms on the seed).
    scope_plan = importlib.import_module("paramfold.scope_plan")
    config = BenchConfig(layers=2, width=16)
    stock, other_stock, x = _seeded(config), _seeded(config), make_input(config)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    other = paramfold.prepare(copy.deepcopy(other_stock), "freeze")
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(ours(x), stock(x))
        builds = []
        real = scope_plan.Plan.build
        monkeypatch.setattr(scope_plan.Plan, "build", classmethod(lambda cls, *a, **k: builds.append(a) or real(*a, **k)))
        for step in range(3):
            with torch.no_grad():
                for p in (*other.parameters(), *other_stock.parameters()):
                    p.mul_(0.99)  # other's frozen values are computed and armed again
            assert torch.equal(other(x), other_stock(x))
            built = len(builds)
            assert torch.equal(ours(x), stock(x)), step
            assert len(builds) == built, step
