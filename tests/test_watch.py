"""paramfold.watch: every write to a watched dict and every re-description of a watched tensor is
seen, the same way through dynamo's guard manager and through the Python comparison."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paramfold import watch as watch_module
from paramfold.watch import Identities, Watch


@pytest.fixture(params=["guard-manager", "python"])
def path(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(watch_module, "_USE_GUARD_MANAGER", False)
    return request.param


def test_this_torch_checks_through_the_guard_manager():
    # The steady call's cost depends on it (README, "Freeze is never stale"); a torch whose guard
    # manager changed falls back to the Python comparison, which this test makes visible.
    assert watch_module._USE_GUARD_MANAGER
    assert Watch([{}], [torch.zeros(2)])._root is not None


DICT_WRITES = {
    "add": lambda m: setattr(m, "beta", 1),
    "replace": lambda m: setattr(m, "alpha", 2.0),
    "remove": lambda m: delattr(m, "alpha"),
    "parameter": lambda m: m.register_parameter("alpha2", nn.Parameter(torch.zeros(1))),
}


@pytest.mark.parametrize("write", list(DICT_WRITES.values()), ids=list(DICT_WRITES))
def test_a_write_to_any_watched_dict_is_seen(path, write):
    modules = [nn.Module() for _ in range(3)]
    for m in modules:
        m.alpha = 1.0
    watched = Watch([m.__dict__ for m in modules] + [modules[1]._parameters])
    assert watched.same() and watched.same()
    write(modules[1])
    assert not watched.same()


def _data(make):
    def change(t):
        t.data = make(t.data)
    return change


TENSOR_CHANGES = {
    "t": _data(lambda d: d.t()),
    "rows": _data(lambda d: d[:2]),
    "dtype": _data(lambda d: d.view(torch.int32)),
    "strides": _data(lambda d: d.as_strided((4, 4), (1, 4))),
    "requires_grad": lambda t: t.requires_grad_(True),
    "double": _data(lambda d: d.double()),
}


@pytest.mark.parametrize("change", [_data(torch.Tensor.conj), _data(torch._neg_view)], ids=["conj", "neg"])
def test_a_conjugate_or_negative_view_of_the_same_bytes_is_seen(path, change):
    # Regression: only the lazy bit differs (same storage, dtype, shape and strides).
    tensors = [nn.Parameter(torch.randn(4, 4, dtype=torch.cfloat), requires_grad=False)]
    watched = Watch([{}], tensors)
    assert watched.same()
    change(tensors[0])
    assert not watched.same()


@pytest.mark.parametrize("change", list(TENSOR_CHANGES.values()), ids=list(TENSOR_CHANGES))
def test_a_re_described_tensor_is_seen(path, change):
    tensors = [nn.Parameter(torch.randn(4, 4), requires_grad=False), torch.randn(4, 4), torch.randn(3)]
    watched = Watch([{}], tensors)
    assert watched.same()
    change(tensors[0])
    assert not watched.same()


def test_writes_of_values_and_reads_are_not_changes(path):
    tensors = [torch.randn(4, 4), nn.Parameter(torch.randn(4))]
    d = {"k": 1}
    watched = Watch([d], tensors)
    with torch.no_grad():
        tensors[0].mul_(2)  # bytes and versions are other checks' business
        tensors[1].add_(1)
    _ = d["k"], tensors[0].sum(), list(d.items())
    assert watched.same()


class Tagged(torch.Tensor):
    pass


def test_tensor_subclasses_are_described_from_python(path):
    sub = torch.randn(4, 4).as_subclass(Tagged)
    watched = Watch([], [sub, torch.randn(2)])
    assert watched.others == (sub,) and len(watched.tensors) == 1
    assert watched.same()
    sub.data = sub.data.t()
    assert not watched.same()


@pytest.mark.parametrize("where", [0, 63, 64, 130, 199])
def test_a_write_anywhere_in_a_large_watch_is_seen(path, where):
    # A model of 1,024 sites watches some 7,700 dicts and tensors, checked in chunks: a write in
    # any chunk, at its edges too, is seen.
    modules = [nn.Module() for _ in range(150)]
    tensors = [torch.zeros(2, 2) for _ in range(50)]
    watched = Watch([m.__dict__ for m in modules], tensors)
    assert watched.same()
    if where < len(modules):
        modules[where].alpha = 1.0
    else:
        tensors[where - len(modules)].data = torch.zeros(4)
    assert not watched.same()


def _most_children(manager) -> int:
    children = manager.get_child_managers()
    return max([len(children), *map(_most_children, children)])


def test_a_large_watch_is_built_in_linear_time():
    # Dynamo's guard manager scans a node's children as it adds one: a flat node of n objects took
    # O(n²) to build, 0.29 s for the 1,024-site seed model's first call (0.07 s in chunks).
    n = 640
    watched = Watch([{"k": i} for i in range(n)], [torch.zeros(1) for _ in range(n)])
    assert watched._root is not None
    assert _most_children(watched._root) <= 64


class Other(nn.Module):
    pass


def _three_modules() -> list[nn.Module]:
    modules = [nn.Module() for _ in range(3)]
    for m in modules:
        m.alpha = 1.0
    return modules


IDENTITY_CHANGES = {
    "class set": ("types", lambda m: setattr(m, "__class__", Other)),
    "__dict__ replaced": ("dicts", lambda m: object.__setattr__(m, "__dict__", dict(vars(m)))),
    "entry replaced by an equal object": ("entries", lambda m: vars(m).__setitem__("_modules", dict(m._modules))),
    "entry removed": ("entries", lambda m: vars(m).pop("_modules")),
    "key added": ("keys", lambda m: setattr(m, "forward", print)),
    "key removed": ("keys", lambda m: delattr(m, "alpha")),
}


def _identities(kind: str, modules: list[nn.Module]) -> Identities:
    columns = {
        "types": [(m, type(m)) for m in modules],
        "dicts": [(m, vars(m)) for m in modules],
        "entries": [(vars(m), "_modules", m._modules) for m in modules],
        "keys": [(vars(m), key, key in vars(m)) for m in modules for key in ("alpha", "forward")],
    }
    return Identities(**{kind: columns[kind]})


@pytest.mark.parametrize("kind, change", list(IDENTITY_CHANGES.values()), ids=list(IDENTITY_CHANGES))
def test_a_replaced_identity_is_seen(path, kind, change):
    modules = _three_modules()
    watched = Watch([], [], ids=_identities(kind, modules))
    assert watched.same() and watched.same()
    change(modules[1])
    assert not watched.same()


@pytest.mark.parametrize("kind", ["entries", "keys"])
def test_other_writes_to_a_dict_whose_entries_are_watched_are_not_changes(path, kind):
    # A holder's __dict__ is written at every call (the values a scope puts in): only the
    # watched entry or key counts.
    modules = _three_modules()
    watched = Watch([], [], ids=_identities(kind, modules))
    modules[1].beta = torch.zeros(1)
    modules[1].alpha = 2.0 if kind == "entries" else modules[1].alpha
    del modules[1].beta
    assert watched.same()


def test_a_watch_of_other_identities_does_not_reuse_the_guards(path):
    # The guards of a watch whose identities are checked by other keys hold for nothing they
    # would have to check: a present key "alpha" passes a guard built for "alpha" only.
    modules = _three_modules()
    first = Watch([], [], ids=Identities(keys=[(vars(m), "alpha", True) for m in modules]))
    other = Watch([], [], first, Identities(keys=[(vars(m), "gamma", False) for m in modules]))
    again = Watch([], [], first, Identities(keys=[(vars(m), "alpha", True) for m in modules]))
    assert other.same() and again.same()
    if path == "guard-manager":
        assert other._root is not first._root and again._root is first._root
    modules[0].gamma = 1.0
    assert not other.same() and again.same()


def test_a_watch_rooted_after_checks_builds_its_guards_after_that_many_unchanged_checks():
    # A plan's watch is built in the call that opens the general way (a model's first, compiling
    # one among them) and may never be checked: its guard manager is built at its first check.
    modules = _three_modules()
    watched = Watch([vars(m) for m in modules], [torch.zeros(2)], ids=_identities("types", modules), rooted_after=2)
    assert watched._root is None and watched.same() and watched._root is None
    modules[0].beta = 1.0  # a changed check builds nothing
    assert not watched.same() and watched._root is None
    del modules[0].beta
    watched = Watch([vars(m) for m in modules], [torch.zeros(2)], ids=_identities("types", modules), rooted_after=1)
    assert watched.same() and watched._root is not None
    modules[2].__class__ = Other
    assert not watched.same()


def test_a_dict_written_back_or_a_training_flag_switched_is_told_apart_from_a_change():
    # Watch.same_but_training: what a steady plan takes after model.train() / model.eval().
    from paramfold.watch import Watch

    structure, member = nn.Linear(2, 2), nn.Linear(2, 2)
    weight = structure.weight
    watch = Watch([vars(structure), vars(member), structure._parameters], [weight, structure.bias], flags_free=1)
    assert watch.same()
    structure.train(False)
    assert not watch.same() and watch.same_but_training()  # a structure module's flag switched
    assert watch.same()  # taken as it is now
    member.train(False)
    member.train(True)
    assert not watch.same() and watch.same_but_training()  # written back: the same objects
    member.train(False)
    assert not watch.same() and not watch.same_but_training()  # a member's flag: held whole
    member.train(True)
    assert watch.same_but_training()
    structure.weight = nn.Parameter(weight.detach().clone())
    assert not watch.same_but_training()  # another tensor, where the same was
    structure.weight = weight
    assert watch.same_but_training()  # the tensor the watch holds, put back
    structure.extra = 1.0
    assert not watch.same_but_training()  # a key added
