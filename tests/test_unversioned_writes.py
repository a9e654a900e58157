"""Writes that no version counter sees, against freeze's two checks.

``p.data.mul_()`` edits ``p``'s storage through another tensor, so ``p._version`` stays put;
so do writes through ``untyped_storage()`` and through a numpy array. ``freeze_check="content"``
(the default) reads the bytes; ``"version"`` watches each host input's storage instead
(``write_marks.arm``), and both watch the frozen value's own storage. Each test runs the same writes
on stock and compares every call with stock's, bitwise (eager, CPU, and compiled with the eager
backend). Every test failed on the code before the storages were watched, except where it says.
"""

from __future__ import annotations

import copy
import functools
import gc

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize as P
from torch.nn.utils.parametrizations import weight_norm

import paramfold
from paramfold import freeze, write_marks
from paramfold.state import STATE_ATTR
from paramfold.testing.compare import BITWISE, compare_outputs


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # see conftest.py


class Cast(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.to(torch.bfloat16).to(torch.float32)


@pytest.fixture
def computed(monkeypatch) -> list:
    """The calls of ``freeze.compute`` (a frozen value computed again) during the test."""
    calls = []
    real = freeze.compute
    monkeypatch.setattr(freeze, "compute", lambda *a: calls.append(a) or real(*a))
    return calls


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 4))
    P.register_parametrization(model[2], "weight", Cast())
    return model.eval().requires_grad_(False)


def _originals(model: nn.Module) -> list[torch.Tensor]:
    return [t for name, t in model.named_parameters() if ".original" in name]


def _through_data(t: torch.Tensor, step: int) -> None:
    t.data.mul_(1.0 + step)


def _through_storage(t: torch.Tensor, step: int) -> None:
    alias = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    alias.add_(0.25 * step)


def _through_numpy(t: torch.Tensor, step: int) -> None:
    t.detach().numpy()[...] *= -1.0


def _through_init(t: torch.Tensor, step: int) -> None:
    nn.init.uniform_(t.data, -step, step)


WRITES = [_through_data, _through_storage, _through_numpy, _through_init]
WRITE_IDS = ["data", "untyped_storage", "numpy", "init-on-data"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("check", ["version", "content"])
@pytest.mark.parametrize("write", WRITES, ids=WRITE_IDS)
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_writes_that_bump_no_version_counter_are_seen(mode, write, check, compiled):
    # Regression (check="version"): the frozen values kept the weights from before the write.
    def change(model: nn.Module, step: int) -> None:
        for t in _originals(model):
            torch.manual_seed(step)  # init draws
            write(t, step)

    stock = _model()
    ours = paramfold.prepare(copy.deepcopy(stock), mode, freeze_check=check)
    _each_call_equals_stock(stock, ours, compiled, change, steps=range(1, 4))


def _each_call_equals_stock(stock: nn.Module, ours: nn.Module, compiled: bool, change, steps) -> None:
    """Call both models (``ours`` compiled with the eager backend if ``compiled``) on one input
    under ``no_grad``, a steady call of ours between, and ``change(model, step)`` both after each
    step: every output bitwise stock's."""
    run = torch.compile(ours, backend="eager") if compiled else ours
    x = torch.randn(3, 4)
    with torch.no_grad():
        for step in steps:
            assert torch.equal(run(x), stock(x)), step
            run(x)  # a steady call between the changes
            for model in (stock, ours):
                change(model, step)
        assert torch.equal(run(x), stock(x))


def test_a_storage_shared_by_two_originals_is_told_apart_by_address():
    # `a.data = b.data` hands a the storage b was armed with: still armed, same version, so only
    # the address (read without disarming) tells. Passed before too; it pins the address check.
    stock = _model()
    ours = paramfold.prepare(copy.deepcopy(stock), "freeze", freeze_check="version")
    x = torch.randn(3, 4)
    with torch.no_grad():
        ours(x), ours(x)
        for m in (stock, ours):
            plist = m[0].parametrizations.weight
            plist.original1.data = m[2].parametrizations.weight.original.data
        assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("check", ["version", "content"])
def test_steady_calls_keep_the_storages_armed_and_compute_nothing(backend, check, computed):
    # What arming must not cost: reading a frozen value (in compiled code, with any backend)
    # leaves its storage armed, so steady calls compute no value again.
    stock = _model()
    ours = paramfold.prepare(copy.deepcopy(stock), "freeze", freeze_check=check)
    run = torch.compile(ours, backend=backend)
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = stock(x)
        run(x), run(x)
        first = len(computed)
        assert first == 2  # one per site
        for _ in range(3):
            out = run(x)
        torch.testing.assert_close(out, expected)  # a compiler may reorder the model's own arithmetic
    assert len(computed) == first
    armed = [t for site in _frozen(ours) for t in site.armed]
    if write_marks.is_armed is not None:
        # The values, and the 3 originals: with "content" too, as no other tensor shares their storages.
        assert len(armed) == 2 + 3
        assert all(map(write_marks.is_armed, armed))


@pytest.mark.skipif(write_marks.is_armed is None, reason="this torch marks nothing")
@pytest.mark.parametrize("check", ["version", "content"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_a_pointer_handed_out_with_nothing_written_keeps_the_frozen_value(mode, check, computed):
    # Regression: a kernel that takes a writable pointer and writes nothing (inductor's freezing
    # packs a frozen weight for MKL so while it compiles) clears a mark; the next call computed
    # the value again, a new tensor, which compiled code guarded on recompiled for (at every
    # call with inductor's freezing, then ran eagerly past dynamo's recompile limit). Now a mark
    # found cleared with the version, address and bytes it was set on is set again, or, where
    # something else now holds the storage (inductor keeps a view of a frozen weight, a numpy
    # array made of it), the bytes are checked at every call: a write through it is still seen.
    stock = _model()
    ours = paramfold.prepare(copy.deepcopy(stock), mode, freeze_check=check)
    x = torch.randn(3, 4)
    with torch.no_grad():
        ours(x)
        first, value = len(computed), ours[0].__dict__["weight"]
        for t in (value, *_originals(ours)):
            t.data_ptr()
        assert torch.equal(ours(x), stock(x))
        alias = value.detach()  # held, as inductor's compiled code holds it
        value.data_ptr()
        for _ in range(2):
            assert torch.equal(ours(x), stock(x))
        assert len(computed) == first and ours[0].__dict__["weight"] is value
        if check == "version":  # which does not see writes through memory handed out before
            return
        held = _originals(ours)[0].detach().numpy()
        assert torch.equal(ours(x), stock(x))
        _originals(ours)[1].data_ptr()  # a mark cleared, nothing written
        held *= 2.0
        _originals(stock)[0].mul_(2.0)
        assert torch.equal(ours(x), stock(x))
        held = ours[0].__dict__["weight"].detach().numpy()
        ours(x)
        held += 1.0  # the value a forward was given: stock's next read is a fresh one
        assert torch.equal(ours(x), stock(x))
    del alias


class _ReturnsItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.d = weight_norm(nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.d(x), self.d.weight


@pytest.mark.skipif(write_marks.is_armed is None, reason="this torch marks nothing")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("check", ["version", "content"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_an_array_of_a_returned_value_written_after_a_call_is_seen_by_both_checks(mode, check, compiled):
    # Regression: with freeze_check="version", a numpy array taken of the frozen value a forward
    # returned, kept over one more call and then written, changed every later call's output
    # (by 5.36 here): the value's own mark, cleared by the array, was set again at that call
    # although the array still held the storage. Stock's next read is a fresh tensor.
    stock, run, x = _stock_and_prepared(_ReturnsItsWeight, mode, check, compiled)
    with torch.no_grad():
        for _ in range(3):
            run(x)
        ours_array, stock_array = run(x)[1].numpy(), stock(x)[1].numpy()
        assert torch.equal(run(x)[0], stock(x)[0])  # a call between the export and the write
        ours_array[0, 0] += 5.0
        stock_array[0, 0] += 5.0
        for _ in range(3):
            assert torch.equal(run(x)[0], stock(x)[0])


def _stock_and_prepared(cls: type[nn.Module], mode: str, check: str, compiled: bool):
    """``(stock, the prepared twin's callable, an input)``: ``cls()`` in eval needing no grad,
    and its copy prepared with ``mode`` and ``check``, compiled with the eager backend or not."""
    torch.manual_seed(0)
    stock = cls().eval().requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), mode, freeze_check=check)
    return stock, torch.compile(ours, backend="eager") if compiled else ours, torch.randn(3, 4)


class _TakesAPointer(_ReturnsItsWeight):
    """Takes a writable pointer to its frozen weight at every call and writes nothing, as an
    mkldnn convolution of inductor's compiled code does."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.d.weight.data_ptr()
        return super().forward(x)


@pytest.mark.skipif(write_marks.is_armed is None, reason="this torch marks nothing")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("check", ["version", "content"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_a_value_whose_mark_a_kernel_takes_at_every_call_keeps_the_steady_plan(monkeypatch, mode, check, compiled):
    # Regression: a spectral_norm GAN discriminator compiled with inductor ran 1.2x-1.4x stock's
    # call under freeze and auto: inductor's mkldnn convolutions take a writable pointer to each
    # conv weight at every call, which cleared the value's mark, and every call left the steady
    # plan for the general path (a walk of every site, about 2,500 Python calls there). The plan
    # now sets such a mark again itself, where the value's version, address and bytes are
    # unchanged and nothing else holds it; a write through .data is still seen.
    from paramfold import scope

    general = []
    open_general = scope._open_general
    monkeypatch.setattr(scope, "_open_general", lambda *args: general.append(1) or open_general(*args))
    stock, run, x = _stock_and_prepared(_TakesAPointer, mode, check, compiled)
    with torch.no_grad():
        for _ in range(3):
            run(x)
        general.clear()
        for _ in range(4):
            assert torch.equal(run(x)[0], stock(x)[0])
        assert general == []
        run(x)[1].data.mul_(2.0)  # the value handed out, written: stock's next read is fresh
        for _ in range(2):
            assert torch.equal(run(x)[0], stock(x)[0])
        assert general != []


@pytest.mark.skipif(write_marks.is_armed is None, reason="this torch marks nothing")
def test_marks_noted_by_another_compile_are_not_set_again():
    # The marks a compile noted as it began are set again only as that compile ends: where its
    # end was not seen on this thread (its end callback ran in another thread's compile), a
    # later compile's end drops them, since code ran since (here a numpy array taken of the
    # value a forward returned, which a mark set again would hide).
    from paramfold import compile_leaves

    torch.manual_seed(0)
    model = paramfold.prepare(_ReturnsItsWeight().eval().requires_grad_(False), "freeze", freeze_check="version")
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(2):
            value = model(x)[1]
    marks = write_marks.standing_marks([model.d])
    assert [t for t, _ in marks] == [value]
    array = value.numpy()
    assert not write_marks.is_armed(value)
    for noted_by, ending in (("0/1", "0/2"), ("0/1", "0/1")):
        compile_leaves.local.marks, compile_leaves.local.marks_for = list(marks), noted_by
        compile_leaves._rearm(ending)
        assert compile_leaves.local.marks == ()
        assert write_marks.is_armed(value) is (noted_by == ending)  # the same compile's: set again
    del array


@pytest.mark.parametrize("check", ["version", "content"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_inductor_freezing_compiles_once_for_unchanged_weights_like_stock(mode, check):
    # Regression: with torch._inductor.config.freezing, freeze and auto recompiled at every
    # call (stock: once), then ran eagerly past dynamo's recompile limit: see the test above.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    stock = nn.Sequential(weight_norm(nn.Linear(4, 6)), nn.Tanh()).eval().requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), mode, freeze_check=check)
    x = torch.randn(3, 4)
    counts = []
    with torch._inductor.config.patch(freezing=True), torch.no_grad():
        for model in (stock, ours):
            torch._dynamo.reset()
            counter = CompileCounterWithBackend("inductor")
            run = torch.compile(model, backend=counter)
            for _ in range(5):
                torch.testing.assert_close(run(x), stock(x))  # inductor may reorder the arithmetic
            counts.append(counter.frame_count)
        assert counts == [1, 1]
        # With the version check the value's mark, which the compile cleared packing it, was set
        # again as the compile ended: no call hashes its bytes (until 2026-12-05 the mark was set
        # again at the next call, whatever held the storage). The content check hashes what
        # something else holds: the compiled code's view of it.
        (value,) = [f.value for f in _frozen(ours)]
        if write_marks.is_armed is not None:
            assert write_marks.is_armed(value) is (check == "version")
            assert [len(f.raw) + len(f.views) for f in _frozen(ours)] == [int(check == "content")]
        for model in (stock, ours):
            model[0].parametrizations.weight.original1.mul_(1.5)
        for _ in range(3):
            torch.testing.assert_close(run(x), stock(x))  # stock's frozen graph would be stale
        assert counter.frame_count == 2  # one recompile for the one change


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_hoist_under_inductor_freezing_compiles_once_for_unchanged_weights_like_stock(backend):
    # Regression: under inductor's freezing dynamo keys the code it compiles under no_grad on the
    # identity of each module's tensor attributes; hoist's values, new at every call, recompiled
    # at every call (8 frames for 12 calls, stock 1), then ran eagerly past the recompile limit.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    stock = nn.Sequential(weight_norm(nn.Linear(4, 6)), nn.Tanh(), weight_norm(nn.Linear(6, 3))).eval()
    ours = paramfold.prepare(copy.deepcopy(stock), "hoist")
    x = torch.randn(3, 4)
    exact = torch.testing.assert_close if backend == "inductor" else _bitwise  # inductor may reorder
    counts = []
    with torch._inductor.config.patch(freezing=True), torch.no_grad():
        for model in (stock, ours):
            torch._dynamo.reset()
            counter = CompileCounterWithBackend(backend)
            run = torch.compile(model, backend=counter)
            for _ in range(6):
                exact(run(x), stock(x))
            counts.append(counter.frame_count)
        assert counts == [1, 1]
        assert len(list(_frozen(ours))) == 2
        plan = vars(ours)[STATE_ATTR].plan  # the steady calls were served by the steady plan
        assert plan.used and plan.freezing is True
        for model in (stock, ours):
            model[2].parametrizations.weight.original0.mul_(1.5)
        for _ in range(3):
            exact(run(x), stock(x))  # a new value for the changed weight (stock's graph keeps the old one)
        assert counter.frame_count == 2
    with torch.no_grad():  # freezing off: the steady plan keeps serving the frozen values, exact
        exact(run(x), stock(x))
        ours[2].parametrizations.weight.original0.mul_(2.0)  # the general path: computed at every call again
        stock[2].parametrizations.weight.original0.mul_(2.0)
        exact(run(x), stock(x))
        assert list(_frozen(ours)) == []
    with torch._inductor.config.patch(freezing=True):  # grad calls: hoisted, gradients to the originals
        ours(x).sum().backward()
        stock(x).sum().backward()
        assert list(_frozen(ours)) == []
    for a, b in zip(stock.parameters(), ours.parameters()):
        _bitwise(b.grad, a.grad)


def test_hoist_plan_built_before_inductor_freezing_gives_way_at_a_compile_under_it():
    # Calls made before freezing was turned on leave a steady plan that computes hoist's values at
    # every call; a compile under freezing ends it, so the next call freezes them: two frames
    # (the first compile keyed on a hoisted value), then none (before: one per call).
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    stock = nn.Sequential(weight_norm(nn.Linear(4, 6)), nn.Tanh()).eval()
    ours = paramfold.prepare(copy.deepcopy(stock), "hoist")
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(3):
            _bitwise(ours(x), stock(x))
        plan = vars(ours)[STATE_ATTR].plan
        assert plan.used and plan.freezing is False and list(_frozen(ours)) == []
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("eager")
        run = torch.compile(ours, backend=counter)
        with torch._inductor.config.patch(freezing=True):
            for _ in range(6):
                _bitwise(run(x), stock(x))
    assert counter.frame_count == 2
    assert len(list(_frozen(ours))) == 1


@pytest.mark.parametrize("mode", ["auto", "hoist"])
def test_calls_alternating_grad_modes_under_inductor_freezing_compile_like_stock(mode):
    # Regression: a grad call dropped a trainable chain's frozen value (and after two such the
    # site was computed at every call for a while), so each no_grad call brought a new value
    # and, under freezing, recompiled: 8 frames for 16 alternating calls (stock 2), then eager.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    stock = nn.Sequential(weight_norm(nn.Linear(8, 16)), nn.ReLU(), weight_norm(nn.Linear(16, 4))).eval()
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(3, 8)
    counts = []
    with torch._inductor.config.patch(freezing=True):
        for model in (stock, ours):
            torch._dynamo.reset()
            counter = CompileCounterWithBackend("eager")
            run = torch.compile(model, backend=counter)
            for grad in (False, True) * 8:
                with torch.set_grad_enabled(grad):
                    _bitwise(run(x), stock(x))
            counts.append(counter.frame_count)
        assert counts == [2, 2]
        # A training step between: the kept value's inputs changed, so the next no_grad call
        # computes it again (a recompile for the new value), never serving the old one.
        for model in (stock, ours):
            model(x).sum().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
        for grad in (False, True, False):
            with torch.set_grad_enabled(grad):
                _bitwise(run(x), stock(x))
        for a, b in zip(stock.parameters(), ours.parameters()):
            _bitwise(b.grad, a.grad)
    with torch.no_grad():  # freezing off: the kept values dropped at the next grad call, exact throughout
        _bitwise(run(x), stock(x))
    _bitwise(run(x), stock(x))
    assert list(_frozen(ours)) == []


#: Bit for bit, dtype, shape and strides included (the checker's own comparison).
_bitwise = functools.partial(compare_outputs, at="", tol=BITWISE)


def _frozen(model: nn.Module):
    for module in model.modules():
        state = module.__dict__.get(STATE_ATTR)
        for site in getattr(state, "sites", {}).values():
            if site.frozen is not None:
                yield site.frozen


def test_memory_torch_does_not_own_is_not_armed_and_the_content_check_still_reads_it():
    # An original over a numpy array's memory cannot be armed; a write through the array is seen
    # by the byte check (the default) only, as README says.
    array = np.ones((4, 4), dtype=np.float32)
    stock = nn.Linear(4, 4)
    with torch.no_grad():
        stock.weight = nn.Parameter(torch.from_numpy(array), requires_grad=False)
    P.register_parametrization(stock, "weight", Cast())
    stock.eval().requires_grad_(False)
    assert not write_marks.arm(stock.parametrizations.weight.original)
    ours = paramfold.prepare(stock, "freeze")
    x = torch.randn(2, 4)
    with torch.no_grad():
        before = ours(x)
        array *= 3.0
        after = ours(x)
    assert not torch.equal(after, before)
    assert torch.equal(after, nn.functional.linear(x, Cast()(torch.from_numpy(array)), stock.bias))


def test_only_host_memory_torch_allocated_itself_is_armed(tmp_path):
    assert not write_marks.arm(torch.empty(4, device="meta"))
    assert not write_marks.arm(torch.empty(4).share_memory_())
    torch.save({"w": torch.randn(4)}, tmp_path / "w.pt")
    assert not write_marks.arm(torch.load(tmp_path / "w.pt", mmap=True, weights_only=True)["w"])
    t = torch.randn(4)
    assert write_marks.arm(t) is (write_marks.is_armed is not None)
    t.add_(1)  # the first write takes the storage back
    assert write_marks.is_armed is None or not write_marks.is_armed(t)


@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_values_computed_under_vmap_over_stacked_parameters_match_stock(mode):
    # Regression: marking a frozen value asked vmap's batched tensor whether it was pinned, which
    # vmap cannot answer (a RuntimeError where stock ran).
    models = [_model() for _ in range(3)]
    for i, m in enumerate(models):
        with torch.no_grad():
            for t in m.parameters():
                t.add_(0.1 * i)
    ours = [paramfold.prepare(copy.deepcopy(m), mode) for m in models]
    x = torch.randn(3, 4)
    outs = []
    for group in (models, ours):
        params, buffers = torch.func.stack_module_state(group)
        call = torch.func.vmap(lambda p, b, x: torch.func.functional_call(group[0], (p, b), (x,)), in_dims=(0, 0, None))
        with torch.no_grad():
            outs.append(call(params, buffers, x))
    assert torch.equal(outs[1], outs[0])
    with torch.no_grad():
        assert torch.equal(ours[0](x), models[0](x))


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.tensor(2.0))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.s


def _shared_member() -> tuple[nn.Module, callable]:
    """One parametrization (with a buffer) registered on two layers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    scale = Scale()
    P.register_parametrization(model[0], "weight", scale)
    P.register_parametrization(model[1], "weight", scale)
    return model, lambda m: m[0].parametrizations.weight[0].s.data.mul_(1.5)


def _tied_original() -> tuple[nn.Module, callable]:
    """The same Parameter as the original of two layers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    P.register_parametrization(model[0], "weight", Cast())
    P.register_parametrization(model[1], "weight", Cast())
    return model, lambda m: m[1].parametrizations.weight.original.data.add_(0.5)


def _flat_views() -> tuple[nn.Module, callable]:
    """Originals that are views of one flat buffer (as FSDP1 and Megatron lay them out)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    flat = torch.randn(32)
    for i, layer in enumerate(model):
        layer.weight = nn.Parameter(flat[16 * i:16 * (i + 1)].view(4, 4))
        P.register_parametrization(layer, "weight", Cast())
    return model, lambda m: m[1].parametrizations.weight.original.data.add_(0.5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("build", [_shared_member, _tied_original, _flat_views], ids=["member", "tied", "views"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_a_write_to_a_storage_that_several_values_read_is_seen_by_each(mode, build, compiled):
    # Regression: the first value to see the storage written armed it again, and the others then
    # found it armed and kept their old values.
    stock, write = build()
    stock.eval().requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), mode, freeze_check="version")
    run = torch.compile(ours, backend="eager") if compiled else ours
    x = torch.randn(3, 4)
    with torch.no_grad():
        for step in range(3):
            assert torch.equal(run(x), stock(x)), step
            write(stock), write(ours)
        assert torch.equal(run(x), stock(x))


@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_a_write_to_a_parametrization_two_prepared_models_share_is_seen_by_both(mode):
    def pair(scale: nn.Module) -> list[nn.Module]:
        torch.manual_seed(0)
        models = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)]
        for m in models:
            P.register_parametrization(m[0], "weight", scale)
            m.eval().requires_grad_(False)
        return models

    stock, ours = pair(Scale()), pair(Scale())
    ours = [paramfold.prepare(m, mode, freeze_check="version") for m in ours]
    x = torch.randn(3, 4)
    with torch.no_grad():
        for step in range(3):
            for a, b in zip(ours, stock):
                assert torch.equal(a(x), b(x)), step
            for models in (stock, ours):
                models[0][0].parametrizations.weight[0].s.data.mul_(1.5)


def _transposed(t: torch.Tensor) -> None:
    t.data = t.data.t()


def _strided(t: torch.Tensor) -> None:
    t.data = t.data.as_strided(t.shape, (1, t.shape[0]))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("check", ["version", "content"])
@pytest.mark.parametrize("describe", [_transposed, _strided], ids=["t", "as_strided"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_an_original_re_described_on_the_same_bytes_is_seen(mode, describe, check, compiled):
    # Regression: `v.data = v.data.t()` keeps the tensor, its version, storage address and
    # bytes; only its strides change, and the frozen value kept the untransposed weight.
    stock = _model()
    ours = paramfold.prepare(copy.deepcopy(stock), mode, freeze_check=check)
    _each_call_equals_stock(stock, ours, compiled, lambda m, _: describe(m[0].parametrizations.weight.original1),
                            steps=range(2))


@pytest.mark.parametrize("check", ["version", "content"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_originals_shrunk_on_the_same_storage_are_seen(mode, check):
    # Regression: pruning rows through `.data = t.data[:n]` keeps each tensor's address (its
    # first rows) and those rows' bytes; the call served the 4-row weight, and failed.
    stock = _model()
    ours = paramfold.prepare(copy.deepcopy(stock), mode, freeze_check=check)
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(ours(x), stock(x))
        for model in (stock, ours):
            layer = model[0]
            for t in (layer.parametrizations.weight.original0, layer.parametrizations.weight.original1, layer.bias):
                t.data = t.data[:2]
            model[2].parametrizations.weight.original.data = model[2].parametrizations.weight.original.data[:, :2]
        assert stock(x).shape == (3, 4)
        assert torch.equal(ours(x), stock(x))


class ScaleByAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.tensor(2.0)  # a plain attribute, not a registered buffer

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.scale


def _fill(t: torch.Tensor) -> None:
    t.fill_(3.0)


def _through_data_of_attribute(t: torch.Tensor) -> None:
    t.data.add_(0.5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("check", ["version", "content"])
@pytest.mark.parametrize("write", [_fill, _through_data_of_attribute, _transposed], ids=["in-place", "data", "t"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_a_tensor_a_parametrization_holds_as_an_attribute_is_an_input(mode, write, check, compiled):
    # Regression: the member's __dict__ tag sees the attribute replaced, not the tensor written
    # in place; the frozen value kept the old scale.
    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        P.register_parametrization(model[0], "weight", ScaleByAttribute())
        model[0].parametrizations.weight[0].scale = torch.arange(16.0).reshape(4, 4) / 8 + 1  # not symmetric
        return model.eval().requires_grad_(False)

    stock = build()
    ours = paramfold.prepare(build(), mode, freeze_check=check)
    _each_call_equals_stock(stock, ours, compiled, lambda m, _: write(m[0].parametrizations.weight[0].scale),
                            steps=range(2))


class ReDescribesItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        P.register_parametrization(self.lin, "weight", Cast())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        w = self.lin.weight  # stock: a fresh tensor at every read; freeze: the kept value
        w.data = w.data.t()
        return out


@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_a_forward_that_re_describes_the_value_it_read_gets_a_fresh_one_next_call(mode):
    # Regression: the kept value's version and storage stayed as they were; the next call
    # served it transposed.
    torch.manual_seed(0)
    stock = ReDescribesItsWeight().eval().requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(3, 4)
    with torch.no_grad():
        for step in range(3):
            assert torch.equal(ours(x), stock(x)), step


class ReturnsItsWeights(nn.Module):
    """Returns its parametrized weights (tied-embedding style): stock's are fresh tensors at every
    read, freeze's the values it keeps for the next call."""

    def __init__(self) -> None:
        super().__init__()
        self.a = weight_norm(nn.Linear(4, 4))
        self.b = weight_norm(nn.Linear(4, 4))

    def forward(self, x):
        return self.b(self.a(x)), self.a.weight, self.b.weight


def _swap_data(wa: torch.Tensor, wb: torch.Tensor) -> None:
    wa.data, wb.data = wb.data, wa.data


#: What a caller may do to the weights the forward returned: give one another storage.
STORAGE_EDITS = {"set_": lambda wa, wb: wa.set_(wb), "data": lambda wa, wb: setattr(wa, "data", wb.data),
                 "swap": _swap_data}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("edit", sorted(STORAGE_EDITS))
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_a_returned_value_given_another_storage_by_the_caller_is_computed_again(mode, edit, compiled):
    # Regression: ``w.data = other`` bumps no version and leaves the value on a storage whose mark
    # is ``other``'s, which no check compared: both paths kept serving the edited value. After
    # ``w.set_(other)`` the general path saw the version move, the steady plan (which reads no
    # version of a marked value) did not.
    torch.manual_seed(0)
    stock = ReturnsItsWeights().eval().requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    run = torch.compile(ours, backend="eager") if compiled else ours
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(5):  # its steady state
            assert torch.equal(run(x)[0], stock(x)[0])
        for model in (stock, run):
            _, wa, wb = model(x)
            STORAGE_EDITS[edit](wa, wb)
        for step in range(3):
            assert torch.equal(run(x)[0], stock(x)[0]), step


def _marked(model: nn.Module) -> list[str]:
    """The model's parameters and buffers whose storage is still copy-on-write (write_marks.arm's mark)."""
    return [name for name, t in (*model.named_parameters(), *model.named_buffers()) if write_marks.is_armed(t)]


def _free_and_reallocate(t: torch.Tensor) -> None:
    """What FSDP and offloading code do to a tensor's memory between uses."""
    saved = t.detach().clone()
    storage = t.untyped_storage()
    size = storage.nbytes()
    storage.resize_(0)
    storage.resize_(size)
    with torch.no_grad():
        t.copy_(saved * 2)
        t.resize_(64)  # grown in place
        t.resize_(saved.shape)
        t.add_(1)


@pytest.mark.skipif(write_marks.is_armed is None, reason="this torch marks nothing")
@pytest.mark.parametrize("check", ["version", "content"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_restore_leaves_no_write_mark_behind(mode, check):
    # Regression: restore left the originals' storages copy-on-write, and a storage resized
    # after it failed at its next write with torch's "ctx != nullptr INTERNAL ASSERT".
    stock = _model()
    ours = paramfold.prepare(copy.deepcopy(stock), mode, freeze_check=check)
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(ours(x), stock(x))
    assert _marked(ours)
    paramfold.restore(ours)
    assert not _marked(ours)
    for model in (stock, ours):
        for t in _originals(model):
            _free_and_reallocate(t)
    with torch.no_grad():
        assert torch.equal(ours(x), stock(x))


@pytest.mark.skipif(write_marks.is_armed is None, reason="this torch marks nothing")
@pytest.mark.parametrize("check", ["version", "content"])
def test_a_frozen_value_dropped_for_a_call_leaves_no_write_mark_behind(check):
    # Regression: auto drops a trainable chain's frozen value for a call that records grad (and
    # demotes a site whose values keep going stale) but left its inputs marked.
    stock = _model().requires_grad_(True)
    ours = paramfold.prepare(copy.deepcopy(stock), "auto", freeze_check=check)
    x = torch.randn(3, 4)
    with torch.no_grad():
        ours(x)
    assert _marked(ours)
    assert torch.equal(ours(x), stock(x))  # records grad: every value dropped
    assert not _marked(ours)


class _Twice(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * 2


class _Product(nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = nn.Parameter(w, requires_grad=False)
        P.register_parametrization(self, "w", _Twice())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


@pytest.mark.parametrize("describe", [lambda t: t.t(), lambda t: t[:, ::2], lambda t: t.conj(), lambda t: t],
                         ids=["transposed", "strided", "conjugate", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=["complex64", "complex128"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_a_complex_original_on_memory_held_elsewhere_is_hashed_whatever_its_layout(mode, dtype, describe):
    # Regression: a non-contiguous complex128 input (a transposed or strided view, torch's
    # orthogonal's QR-made base) had no integer type of its element size to be read as, and got
    # no byte check at all: a write through the memory it shares left the old value served.
    def build():
        torch.manual_seed(0)
        flat = torch.randn(4, 4, dtype=dtype)  # the memory a user keeps
        return _Product(describe(flat)).eval(), flat

    (stock, stock_flat), (ours, our_flat) = build(), build()
    paramfold.prepare(ours, mode)
    x = torch.randn(3, 4, dtype=dtype)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(ours(x), stock(x))
            for flat in (stock_flat, our_flat):
                flat.numpy()[0, :] += 1.0


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("export", [np.from_dlpack, torch.from_dlpack], ids=["numpy", "torch"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_an_original_exported_through_dlpack_itself_is_hashed_and_its_writes_seen(mode, export, when):
    # Regression: a DLPack export of the tensor itself (not of a detached alias) holds the
    # tensor, not its storage, so the storage's use count stayed at one: the original was armed
    # and never hashed, and a write through the exported array left the old value served.
    stock = _model()
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(3, 4)
    arrays = []
    with torch.no_grad():
        if when == "before":
            arrays = [export(_originals(m)[0]) for m in (stock, ours)]
        for _ in range(3):
            assert torch.equal(ours(x), stock(x))
        if when == "after":
            arrays = [export(_originals(m)[0]) for m in (stock, ours)]
            assert torch.equal(ours(x), stock(x))
        for array in arrays:
            array[...] = 0.5
        for _ in range(2):
            assert torch.equal(ours(x), stock(x))


def _model_with_a_buffer(norm: str) -> nn.Module:
    """weight_norm (its parametrization or its hook-based form), then a custom chain: Cast, a scale buffer."""
    if norm == "parametrization":
        model = _model()
    else:
        torch.manual_seed(0)
        model = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 4))
        P.register_parametrization(model[2], "weight", Cast())
    P.register_parametrization(model[2], "weight", ScaleByBuffer(torch.arange(16.0).reshape(4, 4) / 8 + 1))
    return model.eval().requires_grad_(False)


EXPORTS = {
    "detach-numpy": lambda t: t.detach().numpy(),
    "numpy": lambda t: t.numpy(),  # of the tensor itself: the buffer
    "np-dlpack": np.from_dlpack,
    "torch-dlpack": torch.from_dlpack,
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("between", [0, 1, 3])
@pytest.mark.parametrize("export", list(EXPORTS))
@pytest.mark.parametrize("norm", ["parametrization", "hooks"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_an_input_exported_after_its_value_was_computed_is_followed_by_the_version_check(
        mode, norm, export, between, compiled, computed):
    # Regression: with freeze_check="version", an array (numpy, DLPack) taken of an original or
    # a member's buffer after its value was computed cleared the mark; the next call found the
    # bytes unchanged and armed the storage again, though the array still held it, so a write
    # through it after that call left the old value served (max |diff| 2.7-3.6). Written
    # without a call between, the first write was seen, but the value computed from it armed
    # the storage again, and the array's next write was missed.
    stock = _model_with_a_buffer(norm)
    ours = paramfold.prepare(_model_with_a_buffer(norm), mode, freeze_check="version")
    run = torch.compile(ours, backend="eager") if compiled else ours

    def exported(model: nn.Module) -> list:
        if export == "numpy":
            return [EXPORTS[export](model[2].parametrizations.weight[1].scale)]
        return [EXPORTS[export](t) for name, t in model.named_parameters()
                if ".original" in name or name.endswith(("weight_g", "weight_v"))]

    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(run(x), stock(x))
        arrays = [exported(m) for m in (stock, ours)]
        for _ in range(between):
            assert torch.equal(run(x), stock(x))
        for step in range(3):
            for array in (a for both in arrays for a in both):
                array[0] += 1.0 + step
            assert torch.equal(run(x), stock(x)), step
            after = len(computed)
            for _ in range(2):  # steady calls, the arrays still held: the values are not computed again
                assert torch.equal(run(x), stock(x)), step
            assert len(computed) == after


@pytest.mark.skipif(write_marks.is_armed is None, reason="this torch marks nothing")
@pytest.mark.parametrize("end", ["restored", "dropped"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_models_prepared_and_dropped_in_a_loop_leave_no_arming_record_behind(mode, end):
    # Regression: write_marks._armings kept an entry for every storage a frozen value was ever keyed
    # on, after restore and after the model was freed: a process that prepares and drops models
    # (a server loading versions, a sweep) grew without bound.
    def once():
        model = paramfold.prepare(_model(), mode)
        with torch.no_grad():
            model(torch.randn(3, 4))
        if end == "restored":
            paramfold.restore(model)

    once()
    gc.collect()
    before = len(write_marks._armings)
    for _ in range(20):
        once()
    gc.collect()
    assert len(write_marks._armings) <= before


@pytest.mark.skipif(write_marks.is_armed is None, reason="this torch marks nothing")
@pytest.mark.parametrize("check", ["version", "content"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_a_storage_resized_while_prepared_after_a_pointer_hand_out_matches_stock(mode, check):
    # README's workaround for resizing a marked storage (which torch cannot do): hand out a
    # pointer first, which clears the mark; the next call computes the value again.
    stock = _model()
    ours = paramfold.prepare(copy.deepcopy(stock), mode, freeze_check=check)
    x = torch.randn(3, 4)
    with torch.no_grad():
        for step in range(2):
            assert torch.equal(ours(x), stock(x)), step
            for model in (stock, ours):
                for t in _originals(model):
                    t.data_ptr()
                    _free_and_reallocate(t)
        assert torch.equal(ours(x), stock(x))


def _built_inside_inference_mode() -> nn.Module:
    with torch.inference_mode():
        model = _model()
    assert all(t.is_inference() for t in model.parameters())
    return model


def _write_inside_inference_mode(model: nn.Module) -> None:
    with torch.inference_mode():
        for t in _originals(model):
            t.mul_(1.5)  # an inference tensor: no version counter moves


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("check", ["version", "content"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_a_model_built_inside_inference_mode_is_frozen_and_its_writes_are_seen(mode, check, compiled):
    # Regression: inference tensors have no version counter; the first call raised
    # "RuntimeError: Inference tensors do not track version counter" where stock ran.
    stock = _built_inside_inference_mode()
    ours = paramfold.prepare(_built_inside_inference_mode(), mode, freeze_check=check)
    run = torch.compile(ours, backend="eager") if compiled else ours
    x = torch.randn(3, 4)
    for step in range(3):
        with torch.inference_mode():
            assert torch.equal(run(x), stock(x)), step
        with torch.no_grad():
            assert torch.equal(run(x), stock(x)), step
        for model in (stock, ours):
            _write_inside_inference_mode(model)
    with torch.no_grad():
        assert torch.equal(run(x), stock(x))


@pytest.mark.parametrize("check", ["version", "content"])
def test_inference_tensors_loaded_with_assign_into_a_frozen_model_match_stock(check):
    # Regression: the same RuntimeError, from load_state_dict(assign=True) inside inference_mode.
    stock = _model()
    ours = paramfold.prepare(copy.deepcopy(stock), "freeze", freeze_check=check)
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(ours(x), stock(x))
    with torch.inference_mode():
        state = {k: v * 2 for k, v in stock.state_dict().items()}
        for model in (stock, ours):
            model.load_state_dict(state, assign=True)
        assert torch.equal(ours(x), stock(x))
        _write_inside_inference_mode(stock), _write_inside_inference_mode(ours)
        assert torch.equal(ours(x), stock(x))


class Tagged(torch.Tensor):
    """A subclass that changes nothing below Python (a logging or tagging class)."""


class TaggedParameter(nn.Parameter):
    """A Parameter subclass, as libraries define them."""


def _subclass_originals(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    for layer in (model[0], model[2]):
        w = torch.randn(4, 4)
        layer.weight = nn.Parameter(w.as_subclass(Tagged)) if kind == "as_subclass" else TaggedParameter(w)
        P.register_parametrization(layer, "weight", Cast())
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("check", ["version", "content"])
@pytest.mark.parametrize("write", [_through_data, _through_numpy], ids=["data", "numpy"])
@pytest.mark.parametrize("kind", ["as_subclass", "Parameter-subclass"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_a_subclass_original_written_without_a_version_bump_is_seen(mode, kind, write, check):
    # Regression: a subclass original was neither marked nor hashed (plain types only): writes
    # through .data or numpy left the old frozen value served.
    stock = _subclass_originals(kind)
    ours = paramfold.prepare(_subclass_originals(kind), mode, freeze_check=check)
    assert type(_originals(ours)[0]) is not nn.Parameter

    def change(model: nn.Module, step: int) -> None:
        for t in _originals(model):
            with torch._C.DisableTorchFunctionSubclass():
                write(t, step)

    _each_call_equals_stock(stock, ours, False, change, steps=range(1, 4))


def test_a_wrapper_subclass_is_neither_marked_nor_hashed():
    from torch.testing._internal.two_tensor import TwoTensor

    t = TwoTensor(torch.randn(4), torch.randn(4))
    assert not write_marks.plain_underneath(t) and not write_marks.arm(t) and write_marks.bitwise(t) is None
    assert write_marks.plain_underneath(torch.randn(4).as_subclass(Tagged))


class Double(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * 2


@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_attributes_dynamo_sets_on_a_wrapper_subclass_original_change_nothing(mode, computed):
    # Regression: a wrapper subclass's __dict__ (inner tensors, metadata) is watched by its tag,
    # and dynamo marks a tensor it meets there (_dynamo_static_input_type; inductor's freezing:
    # _is_frozen_param): the value was computed again after the first compiled call, a new
    # tensor, which compiled code recompiled for. An entry of the user's is still a change.
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    stock = nn.Linear(4, 4)
    stock.weight = nn.Parameter(TwoTensor(stock.weight.detach().clone(), stock.weight.detach().clone()))
    P.register_parametrization(stock, "weight", Double())
    stock.eval().requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(ours(x), stock(x))
        first = len(computed)
        original = ours.parametrizations.weight.original
        original._dynamo_static_input_type = "unguarded"
        original._is_frozen_param = True
        for _ in range(2):
            assert torch.equal(ours(x), stock(x))
        assert len(computed) == first
        for model in (stock, ours):
            model.parametrizations.weight.original.a = model.parametrizations.weight.original.a * 2
        assert torch.equal(ours(x), stock(x)) and len(computed) == first + 1
        ours.parametrizations.weight.original.note = "mine"
        assert torch.equal(ours(x), stock(x)) and len(computed) == first + 2


def _complex_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(4, 4, dtype=torch.cfloat)
    P.register_parametrization(model, "weight", Double())
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("check", ["version", "content"])
@pytest.mark.parametrize("view", [torch.Tensor.conj, torch._neg_view], ids=["conj", "neg"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_an_original_given_its_conjugate_or_negative_bit_is_seen(mode, view, check, compiled):
    # Regression: `p.data = p.data.conj()` keeps the storage, bytes, dtype, shape and strides;
    # only the lazy conjugate bit differs, which the description left out.
    stock = _complex_model()
    ours = paramfold.prepare(_complex_model(), mode, freeze_check=check)
    run = torch.compile(ours, backend="eager") if compiled else ours
    x = torch.randn(3, 4, dtype=torch.cfloat)

    def change(model: nn.Module, step: int) -> None:
        t = model.parametrizations.weight.original
        t.data = view(t.data)

    with torch.no_grad():
        for step in range(2):
            assert torch.equal(run(x), stock(x)), step
            change(stock, step), change(ours, step)
        assert torch.equal(run(x), stock(x))


class ScaleByBuffer(nn.Module):
    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", scale)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.scale


class EditsBetweenCalls(nn.Module):
    """Calls its layer, edits in place what the layer's weight is computed from, calls it again."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(4, 4)
        if kind == "original":
            weight_norm(self.a)
        elif kind == "hook":
            nn.utils.weight_norm(self.a)
        else:  # a member's buffer, contiguous, or strided (not contiguous)
            scale = torch.full((4, 4), 1.5) if kind == "buffer" else torch.full((4, 8), 1.5)[:, ::2]
            P.register_parametrization(self.a, "weight", ScaleByBuffer(scale))

    def edited(self) -> torch.Tensor:
        if self.kind == "original":
            return self.a.parametrizations.weight.original0
        if self.kind == "hook":
            return self.a.weight_g
        return self.a.parametrizations.weight[0].scale

    def forward(self, x):
        y = self.a(x)
        self.edited().mul_(1.5)
        return self.a(y) + self.a(x)  # a third read: after a value computed again for the second


@pytest.mark.filterwarnings("ignore:.*torch.nn.utils.weight_norm.*is deprecated")
@pytest.mark.parametrize("kind", ["original", "hook", "buffer", "strided buffer"])
@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
def test_an_inference_tensor_edited_inside_the_forward_is_read_edited_by_a_later_call(mode, kind):
    # Regression: the nested calls saw in-place edits by version counter only, which an inference
    # tensor lacks: hoist, freeze and auto served the second call the value from the call's start.
    def build() -> nn.Module:
        torch.manual_seed(0)
        with torch.inference_mode():
            return EditsBetweenCalls(kind).eval().requires_grad_(False)

    stock, ours = build(), paramfold.prepare(build(), mode)
    assert ours.edited().is_inference()
    x = torch.randn(3, 4)
    with torch.inference_mode():
        for step in range(3):
            assert torch.equal(ours(x), stock(x)), step
            assert_same_state(stock, ours)


def assert_same_state(stock: nn.Module, ours: nn.Module) -> None:
    expected, actual = stock.state_dict(), ours.state_dict()
    assert list(expected) == list(actual)
    assert all(torch.equal(expected[k], actual[k]) for k in expected)
