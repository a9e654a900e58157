"""A parametrization that reads what it holds: a config dict, a plain object, a list, a tensor in a
dict (paramfold.held). Stock reads them at every computation; a frozen value must follow every
change or not be frozen, and a chain that changes them itself is one that writes itself."""

from __future__ import annotations

import collections
import copy
import functools
import types

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import paramfold

MODES = ["auto", "freeze", "hoist", "inline"]


class _FromDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = {"scale": 1.0, "shift": torch.zeros(())}

    def forward(self, w):
        return w * self.cfg["scale"] + self.cfg["shift"]


class _FromObject(nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = types.SimpleNamespace(inner=types.SimpleNamespace(scale=1.0))

    def forward(self, w):
        scale = self.cfg.inner.scale
        return w * (scale[0] if isinstance(scale, list) else scale)


class _FromList(nn.Module):
    def __init__(self):
        super().__init__()
        self.scales = [1.0]

    def forward(self, w):
        return w * self.scales[0]


class _Counts(nn.Module):
    """Keeps a count of its computations in a list, and scales by it."""

    def __init__(self):
        super().__init__()
        self.count = [0]

    def forward(self, w):
        self.count[0] += 1
        return w * (1.0 + 0.1 * self.count[0])


class _Config(dict):
    """A dict subclass whose own attributes are settings too (``cfg.scale``)."""


class _FromDictSubclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = _Config(shift=0.0)
        self.cfg.scale = 1.0

    def forward(self, w):
        return w * self.cfg.scale + self.cfg["shift"]


def _scaled(w, cfg):
    return w * cfg["scale"]


class _FromPartial(nn.Module):
    def __init__(self):
        super().__init__()
        self.fn = functools.partial(_scaled, cfg={"scale": 1.0})

    def forward(self, w):
        return self.fn(w)


class _Schedule:
    def __init__(self, scale):
        self.scale = scale

    def factor(self):
        return self.scale


class _Doubled(_Schedule):
    def factor(self):
        return 2.0 * self.scale


class _FromPlainObject(nn.Module):
    def __init__(self):
        super().__init__()
        self.schedule = _Schedule(1.0)

    def forward(self, w):
        return w * self.schedule.factor()


def _edit_dict(p):
    p.cfg["scale"] += 0.5


def _edit_dict_tensor(p):
    with torch.no_grad():
        p.cfg["shift"].add_(0.25)


def _edit_object(p):
    p.cfg.inner.scale += 0.5


def _edit_list(p):
    p.scales[0] += 0.5


def _edit_dict_subclass_attribute(p):
    p.cfg.scale += 0.5


def _edit_partial_keyword(p):
    p.fn.keywords["cfg"]["scale"] += 0.5


def _replace_object_dict(p):
    p.schedule.__dict__ = {"scale": p.schedule.scale + 0.5}


def _swap_object_class(p):
    p.schedule.__class__ = _Doubled if type(p.schedule) is _Schedule else _Schedule


EDITS = {
    "dict entry": (_FromDict, _edit_dict),
    "tensor in a dict, in place": (_FromDict, _edit_dict_tensor),
    "attribute of a held object": (_FromObject, _edit_object),
    "list item": (_FromList, _edit_list),
    "attribute of a held dict subclass": (_FromDictSubclass, _edit_dict_subclass_attribute),
    "keyword dict of a held functools.partial": (_FromPartial, _edit_partial_keyword),
    "__dict__ of a held object replaced": (_FromPlainObject, _replace_object_dict),
    "__class__ of a held object set": (_FromPlainObject, _swap_object_class),
}


def _pair(member: type[nn.Module], eval_mode: bool = True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    parametrize.register_parametrization(model[0], "weight", member())
    if eval_mode:
        model.eval().requires_grad_(False)
    return model, copy.deepcopy(model)


def _member(model):
    return model[0].parametrizations.weight[0]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("mode", MODES)
def test_a_held_setting_changed_between_calls_is_followed_like_stock(mode, edit, compiled):
    member, change = EDITS[edit]
    stock, prepared = _pair(member)
    if mode == "freeze" and member is _FromList:
        with pytest.raises(paramfold.FoldError, match=r"_FromList\.scales"):
            paramfold.prepare(prepared, mode=mode)
        assert type(prepared[0]).__name__ == "ParametrizedLinear"  # left as it was
        return
    paramfold.prepare(prepared, mode=mode)
    run_stock, run_prepared = stock, prepared
    if compiled:
        torch._dynamo.reset()
        run_stock = torch.compile(stock, backend="eager")
        run_prepared = torch.compile(prepared, backend="eager")
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(run_prepared(x), run_stock(x))
            change(_member(stock))
            change(_member(prepared))


@pytest.mark.parametrize("mode", ["auto", "inline"])
def test_a_chain_that_counts_in_a_list_it_holds_equals_stock_at_every_read(mode):
    class ReadsTwiceSkipsOnce(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            parametrize.register_parametrization(self.a, "weight", _Counts())
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls % 3 == 0:  # a call that does not read it
                return self.b(x)
            return self.a(x) + self.a(x) @ self.a.weight

    def same_count(stock, prepared):
        return prepared.a.parametrizations.weight[0].count == stock.a.parametrizations.weight[0].count

    _calls_equal_stock(ReadsTwiceSkipsOnce, mode, calls=4, also=same_count)


def test_find_reports_a_chain_that_appends_to_what_it_holds_and_changes_nothing():
    stock, prepared = _pair(_Counts)
    sites = paramfold.find(prepared)
    assert [s.writes_itself for s in sites] == [True]
    assert _member(prepared).count == _member(stock).count  # probed on a copy


@pytest.mark.parametrize("mode", ["hoist", "freeze"])
def test_hoist_and_freeze_refuse_a_chain_that_changes_what_it_holds(mode):
    stock, prepared = _pair(_Counts)
    with pytest.raises(paramfold.FoldError):
        paramfold.prepare(prepared, mode=mode)
    assert _member(prepared).count == _member(stock).count


def test_a_list_given_to_a_frozen_chain_after_prepare_refuses_the_next_call_and_auto_follows_it():
    stock, frozen = _pair(_FromObject)
    auto = copy.deepcopy(frozen)
    paramfold.prepare(frozen, mode="freeze")
    paramfold.prepare(auto, mode="auto")
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(frozen(x), stock(x))
        assert torch.equal(auto(x), stock(x))
        for model in (stock, frozen, auto):
            _member(model).cfg.inner = types.SimpleNamespace(scale=[2.0])
        with pytest.raises(paramfold.FoldError, match=r"cfg\.inner\.scale"):
            frozen(x)
        for _ in range(2):
            assert torch.equal(auto(x), stock(x))
            for model in (stock, auto):
                _member(model).cfg.inner.scale[0] += 1.0


def test_known_parametrizations_hold_nothing_unwatched():
    from paramfold.held import held

    layer = nn.Linear(4, 4)
    for register in (torch.nn.utils.parametrizations.weight_norm, torch.nn.utils.parametrizations.spectral_norm,
                     torch.nn.utils.parametrizations.orthogonal):
        layer = nn.Linear(4, 4)
        register(layer)
        for m in layer.parametrizations.weight.modules():
            assert held(m).unwatched == [] and held(m).dicts == []


@pytest.mark.parametrize("mode", MODES)
def test_a_held_setting_changed_inside_the_forward_reaches_the_next_read_like_stock(mode):
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            parametrize.register_parametrization(self.lin, "weight", _FromDict())

        def forward(self, x):
            y = self.lin(x)
            self.lin.parametrizations.weight[0].cfg["scale"] += 1.0
            return y + self.lin(x)

    _calls_equal_stock(Outer, mode, calls=3)


def _calls_equal_stock(make, mode, calls, also=lambda stock, prepared: True):
    """``calls`` eval ``no_grad`` calls of a model from ``make`` and its prepared copy: equal outputs."""
    torch.manual_seed(0)
    stock = make().eval().requires_grad_(False)
    prepared = copy.deepcopy(stock)
    paramfold.prepare(prepared, mode=mode)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(calls):
            assert torch.equal(prepared(x), stock(x))
            assert also(stock, prepared)


def test_objects_keeping_state_outside_their_dict_are_unwatched_and_partials_are_followed():
    import threading

    from paramfold.held import held

    class Error(Exception):
        pass

    m = nn.Module()
    m.local, m.error = threading.local(), Error({"scale": 1.0})  # per-thread dicts, args: not in __dict__
    m.fn = functools.partial(_scaled, cfg={"scale": 1.0})
    m.ns = types.SimpleNamespace(scale=1.0)
    found = held(m)
    assert sorted(where for where, _ in found.unwatched) == ["error", "local"]
    assert m.fn.keywords["cfg"] in found.dicts and vars(m.ns) in found.dicts


class _Thing:
    __slots__ = ("v",)

    def __init__(self, v):
        self.v = v


class _Replaces(nn.Module):
    """Replaces the item of a list it holds: the old item is freed before the new one is made."""

    def __init__(self):
        super().__init__()
        self.items = [_Thing(1.0)]

    def forward(self, w):
        v = self.items[0].v
        self.items.clear()
        self.items.append(_Thing(v + 1.0))
        return w * v


def test_find_sees_an_item_replaced_where_the_new_one_may_get_the_freed_ones_address():
    # Regression: the probe compared the items' ids only, and the new item took the freed one's.
    stock, prepared = _pair(_Replaces)
    assert [s.writes_itself for s in paramfold.find(prepared)] == [True]
    assert _member(prepared).items[0].v == _member(stock).items[0].v


def test_a_frozen_slotted_dataclass_is_followed_through_its_fields():
    import dataclasses

    from paramfold.held import held

    @dataclasses.dataclass(frozen=True, slots=True)
    class Settings:
        scale: float
        extra: dict
        steps: tuple

    m = nn.Module()
    m.settings = Settings(2.0, {"shift": 1.0}, (1, [2]))
    found = held(m)
    assert found.dicts == [m.settings.extra]
    assert [where for where, _ in found.unwatched] == ["settings.steps[1]"]
    m.settings = Settings(2.0, {}, (1, 2))
    assert held(m).unwatched == []


class _Steps(nn.Module):
    """Applies the steps of an OrderedDict it holds, in their order."""

    def __init__(self):
        super().__init__()
        self.steps = collections.OrderedDict(scale=2.0, shift=1.0)

    def forward(self, w):
        for kind, v in self.steps.items():
            w = w * v if kind == "scale" else w + v
        return w


class _Mul(nn.Module):
    def __init__(self):
        super().__init__()
        self.k = 2.0

    def forward(self, w):
        return w * self.k


def _reorder_steps(p):
    p.steps.move_to_end(next(iter(p.steps)))  # no dict version tag changes


def _replace_member_dict(p):
    p.__dict__ = {**p.__dict__, "k": p.k + 0.5}  # the old __dict__ is left unwritten


@pytest.mark.parametrize("edit", [_reorder_steps, _replace_member_dict], ids=["move_to_end", "member __dict__"])
@pytest.mark.parametrize("mode", MODES)
def test_an_ordereddict_reordered_or_a_member_dict_replaced_is_followed_like_stock(mode, edit):
    # Regression: neither touches a version tag, and freeze and auto served the old value.
    stock, prepared = _pair(_Steps if edit is _reorder_steps else _Mul)
    paramfold.prepare(prepared, mode=mode)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(prepared(x), stock(x))
            edit(_member(stock))
            edit(_member(prepared))


def _deep():
    return {"model": {"layers": {"attn": {"proj": {"scale": {"value": 2.0}}}}}}


def _wide():
    return {**_deep(), **{f"tok{i}": {"id": i} for i in range(300)}}


class _FromConfig(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def forward(self, w):
        return w * self.cfg["model"]["layers"]["attn"]["proj"]["scale"]["value"]


@pytest.mark.parametrize("config", [_deep, _wide], ids=["5 levels deep", "300 small dicts"])
@pytest.mark.parametrize("mode", MODES)
def test_a_config_past_what_is_followed_is_served_like_stock_and_refused_by_freeze(mode, config):
    # Regression: find and prepare raised AttributeError ('tuple' object has no attribute 'keys').
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(4, 4))
    parametrize.register_parametrization(stock[0], "weight", _FromConfig(config()))
    stock.eval().requires_grad_(False)
    prepared = copy.deepcopy(stock)
    assert [s.kind for s in paramfold.find(prepared)] == ["custom"]
    if mode == "freeze":
        cfg = _member(prepared).cfg
        with pytest.raises(paramfold.FoldError, match=r"_FromConfig\.cfg\['model'\].*4 levels deep and 256 objects"):
            paramfold.prepare(prepared, mode=mode)
        assert type(prepared[0]).__name__ == "ParametrizedLinear" and _member(prepared).cfg is cfg
        return
    paramfold.prepare(prepared, mode=mode)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(prepared(x), stock(x))
            for model in (stock, prepared):
                _member(model).cfg["model"]["layers"]["attn"]["proj"]["scale"]["value"] += 0.5


def test_freeze_names_the_depth_followed_when_plain_objects_nest_deeper():
    # Regression: the refusal advised keeping such settings in a plain object, which they were.
    stock, prepared = _pair(_FromObject)
    node = _member(prepared).cfg.inner
    for _ in range(3):
        node.n = types.SimpleNamespace()
        node = node.n
    with pytest.raises(paramfold.FoldError, match=r"_FromObject\.cfg\.inner\.n\.n\.n \(a SimpleNamespace\).*"
                       r"followed up to 4 levels deep and 256 objects"):
        paramfold.prepare(prepared, mode="freeze")
    assert type(prepared[0]).__name__ == "ParametrizedLinear"


class _Slotted(nn.Module):
    __slots__ = ("k",)

    def __init__(self):
        super().__init__()
        self.k = 2.0

    def forward(self, w):
        return w * self.k


@pytest.mark.parametrize("mode", MODES)
def test_a_member_keeping_a_setting_in_its_slots_is_not_frozen(mode):
    # Regression: a slot is outside the member's __dict__, and freeze and auto served the old value.
    stock, prepared = _pair(_Slotted)[0], _pair(_Slotted)[0]  # built twice: a deepcopy drops slots
    if mode == "freeze":
        with pytest.raises(paramfold.FoldError, match=r"_Slotted\.k \(a slot\)"):
            paramfold.prepare(prepared, mode=mode)
        assert type(prepared[0]).__name__ == "ParametrizedLinear"
        return
    paramfold.prepare(prepared, mode=mode)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(prepared(x), stock(x))
            for model in (stock, prepared):
                _member(model).k += 0.5


class _Lazy(nn.Module):
    """Reads a buffer registered on it later, and a submodule's weight."""

    def __init__(self):
        super().__init__()
        self.sub = nn.Linear(1, 1)

    def forward(self, w):
        s = getattr(self, "scale", None)
        return w * self.sub.weight if s is None else w * s * self.sub.weight


@pytest.mark.parametrize("check", ["content", "version"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_tensors_given_to_a_member_after_prepare_are_inputs_of_the_frozen_value(mode, check):
    # Regression: only the parameter and buffer dicts non-empty at prepare were read as inputs, so a
    # buffer registered since, or a replaced submodule's weight, edited in place was not seen.
    stock, prepared = _pair(_Lazy)
    paramfold.prepare(prepared, mode=mode, freeze_check=check)
    x = torch.randn(2, 4)
    edits = [
        lambda p: p.register_buffer("scale", torch.tensor(3.0)),
        lambda p: p.scale.fill_(0.5),
        lambda p: p.load_state_dict({**p.state_dict(), "scale": torch.tensor(-1.0)}),
        lambda p: setattr(p, "sub", nn.Linear(1, 1).requires_grad_(False)),
        lambda p: p.sub.weight.fill_(2.0),
        lambda p: p.sub.weight.mul_(1.5),
    ]
    with torch.no_grad():
        assert torch.equal(prepared(x), stock(x))
        for edit in edits:
            torch.manual_seed(1)
            edit(_member(stock))
            torch.manual_seed(1)
            edit(_member(prepared))
            assert torch.equal(prepared(x), stock(x))
            assert torch.equal(prepared(x), stock(x))


class _Tie(nn.Module):
    def __init__(self, src):
        super().__init__()
        self.src = src

    def forward(self, w):
        return w + self.src.weight


@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_a_chain_holding_another_prepared_layer_is_frozen_like_any_other(mode):
    # Regression: held() walked paramfold's own state on that layer, and freeze refused the call.
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    torch.nn.utils.parametrizations.weight_norm(stock[0])
    parametrize.register_parametrization(stock[1], "weight", _Tie(stock[0]))
    stock.eval().requires_grad_(False)
    prepared = copy.deepcopy(stock)
    paramfold.prepare(prepared, mode=mode)
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(prepared(x), stock(x))
        frozen = prepared[1].__dict__["_paramfold"].sites["weight"].frozen
        assert frozen is not None
        assert torch.equal(prepared(x), stock(x))
        assert prepared[1].__dict__["_paramfold"].sites["weight"].frozen is frozen  # served, not recomputed
        for _ in range(3):
            for model in (stock, prepared):
                model[0].parametrizations.weight.original1.mul_(1.5)
            assert torch.equal(prepared(x), stock(x))


class _DictProperty:
    """Shows a ``__dict__`` its class computes: reading it runs the class's code."""

    def __init__(self):
        object.__setattr__(self, "calls", [])

    @property
    def __dict__(self):
        raise RuntimeError("the holder's __dict__ property ran")

    def __deepcopy__(self, memo):  # copied as its class says: the probe's copy gets past copying
        return type(self)()


class _ItemsRaise(dict):
    def items(self):
        raise RuntimeError("the holder's items() ran")

    values = keys = __iter__ = items

    def __deepcopy__(self, memo):
        return _ItemsRaise(scale=1.0)


class _KeptAsIs(tuple):
    """A tuple its copies share (``copy.deepcopy`` returns it): a dead weak proxy in it is copied."""

    def __deepcopy__(self, memo):
        return self


class _Holds(nn.Module):
    """Holds ``odd`` besides a config it reads; stock never looks at ``odd``."""

    def __init__(self, odd):
        super().__init__()
        self.cfg = {"scale": 2.0}
        self.__dict__["odd"] = odd

    def forward(self, w):
        return w * self.cfg["scale"]


class _Gone:
    pass


def _dead_proxy():
    import weakref

    return weakref.proxy(_Gone())


class _EqualsByName(type):
    def __eq__(cls, other):  # and so no __hash__: the class cannot be a set's item or a cache's key
        return getattr(other, "__name__", None) == cls.__name__


class _OfAnUnhashableClass(metaclass=_EqualsByName):
    pass


_ODD_HOLDINGS = {
    "instance_of_an_unhashable_class": _OfAnUnhashableClass,
    "dead_weak_proxy_in_a_tuple": lambda: _KeptAsIs((_dead_proxy(),)),
    "dead_weak_proxy": _dead_proxy,  # helper-248: auto's and inline's first call raised
    "dict_property": _DictProperty,
    "dict_property_in_a_tuple": lambda: (1.0, _DictProperty()),
    "dict_subclass_whose_items_raise": lambda: _ItemsRaise(scale=1.0),
}


@pytest.mark.parametrize("holding", list(_ODD_HOLDINGS))
@pytest.mark.parametrize("mode", MODES)
def test_a_holding_that_cannot_be_looked_into_without_its_own_code_is_served_like_stock_or_refused(mode, holding):
    # Regression (helper-243): held() read a held object through isinstance (a dead weak proxy's
    # __class__ raises), getattr(value, "__dict__") and d.items(), running the holder's own code, and
    # the search for a held global generator hashed each class: prepare raised.
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3)).eval().requires_grad_(False)
        parametrize.register_parametrization(model[0], "weight", _Holds(_ODD_HOLDINGS[holding]()))
        return model

    stock, prepared = make(), make()
    x = torch.randn(2, 4)
    try:
        paramfold.prepare(prepared, mode=mode)
    except paramfold.FoldError as e:  # what freeze cannot watch; what neither can copy to probe
        assert mode in ("freeze", "hoist") and "0.weight" in str(e)
        return
    with torch.no_grad():
        for _ in range(2):
            try:
                out = prepared(x)
            except paramfold.FoldError as e:  # freeze's refusal of what it cannot watch, at the first call
                assert mode == "freeze" and "'odd'" in str(e)
                return
            assert torch.equal(out, stock(x))
            _member(stock).cfg["scale"] += 1.0
            _member(prepared).cfg["scale"] += 1.0
    paramfold.restore(prepared)
    assert torch.equal(prepared(x), stock(x))


class _RotatesItsOrderedDict(nn.Module):
    """Moves its first setting to the end at each computation (``move_to_end``: no version tag moves)."""

    def __init__(self):
        super().__init__()
        self.steps = collections.OrderedDict(a=1.0, b=2.0, c=3.0)

    def forward(self, w):
        key = next(iter(self.steps))
        self.steps.move_to_end(key)
        return w * self.steps[key]


def test_a_chain_that_reorders_its_ordered_dict_is_found_writing_itself():
    # Regression (helper-248): the probe compared the underlying dict's order (dict.__iter__), which
    # move_to_end does not change: the chain was taken as not writing itself, and hoist and auto
    # served one value to two reads where stock computes each afresh.
    _, prepared = _pair(_RotatesItsOrderedDict)
    assert [s.writes_itself for s in paramfold.find(prepared)] == [True]


class _AddictLike(dict):
    """An addict-style config: its own ``__getattr__``, ``__missing__`` and ``copy``; reads are dict's."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __missing__(self, key):
        raise KeyError(key)

    def copy(self):
        return _AddictLike(dict.items(self))


class _FromAddict(nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = _AddictLike(scale=1.0)

    def forward(self, w):
        return w * self.cfg.scale


def test_an_addict_style_config_is_followed_by_its_version_tag_and_frozen():
    # Regression (helper-248): a dict subclass with Python methods of its own other than its reads
    # (copy, __missing__, __getattr__) was taken as unwatchable: freeze refused, auto stopped freezing.
    stock, prepared = _pair(_FromAddict)
    paramfold.prepare(prepared, mode="freeze")
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(prepared(x), stock(x))
            for model in (stock, prepared):
                _member(model).cfg["scale"] += 1.0
