"""paramfold.recompiles: each category caused for real, on torch's own output (backend="eager")."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
import typer
from rich.console import Console
from torch import nn
from typer.testing import CliRunner

from paramfold.cli import app
from paramfold.recompiles import (
    CATEGORIES,
    FIXES,
    GRAPH_BREAKS_REPORTED,
    RecompileLimitError,
    RecompileLimitWarning,
    limit_config,
    recompiles,
)
from paramfold.recompiles.report import short_path


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile(fn):
    return torch.compile(fn, backend="eager")


def _torch_reasons(fn) -> list[str]:
    """The guard-failure strings torch itself stored for ``fn`` (dynamo.utils.guard_failures)."""
    code = getattr(fn, "__code__", None) or fn.forward.__code__
    return list(torch._dynamo.utils.guard_failures[code])


def _text(report) -> str:
    console = Console(width=200, record=True, file=open("/dev/null", "w"))
    console.print(report)
    return console.export_text()


class Block(nn.Module):
    def __init__(self, width: int = 16, dropout: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(0.0) if dropout else nn.Identity()  # Dropout reads self.training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.proj(x)))


def test_shape_size_change_and_automatic_dynamic():
    def f(x):
        return x.sin() + 1

    cf = _compile(f)
    with recompiles() as report:
        # 8 -> 1 (size 1 is specialised), 1 -> 9 (the dim becomes dynamic), 10 reuses that graph
        for n in (8, 1, 9, 10):
            cf(torch.randn(2, n))
    kinds = [r.kind for r in report.records]
    assert kinds == ["first compile", "recompile", "recompile"]
    assert report.graphs_per_function() == {report.records[0].location: 3}
    assert report.graphs_total == 3

    to_one, to_nine = report.records[1], report.records[2]
    assert to_one.cause == "shape" and to_nine.cause == "shape"
    g = to_one.failed_guards[0]
    assert "size mismatch at index 1" in g.guard and (g.tensor, g.dim) == ("x", 1)
    assert "mark_unbacked(x, 1)" in g.fix  # size 1: specialised unless marked unbacked
    assert all(g.category == "shape" and g.dim == 1 for g in to_nine.failed_guards)
    by_graph = {g.cached_compile_id: g.fix for g in to_nine.failed_guards}
    assert "torch._dynamo.mark_dynamic(x, 1)" in by_graph["0/0"]  # the graph made for 8
    assert "mark_unbacked(x, 1)" in by_graph["0/1"]  # the graph made for 1 serves size 1 only
    # torch's automatic dynamic kicked in (torch < 2.6 logs no create_symbol event)
    assert to_nine.dynamic == (["x.size()[1]"] if GRAPH_BREAKS_REPORTED else [])
    ours = sorted(g.reason for r in report.records for g in r.failed_guards)
    assert ours == sorted(_torch_reasons(f))

    # Once dynamic, a size-1 input fails the symbolic guard "2 <= x.size()[1]" (0/1 specialisation).
    torch._dynamo.reset()
    with recompiles() as report:
        for n in (8, 9, 1):
            cf(torch.randn(2, n))
    symbolic = [g for g in report.records[-1].failed_guards if ".size()[1]" in g.guard]
    assert symbolic and all(g.category == "shape" and g.dim == 1 for g in symbolic)
    assert "mark_unbacked(x, 1)" in symbolic[0].fix


def test_graph_made_for_size_1_gets_the_fix_that_removes_its_recompile():
    # Regression: "expected 1, actual 2" got the mark_dynamic fix, which changes nothing (dynamo
    # specialises sizes 0 and 1 even on a dim marked dynamic); mark_unbacked is what works.
    graphs = {}
    for mark in (None, torch._dynamo.mark_dynamic, torch._dynamo.decorators.mark_unbacked):
        torch._dynamo.reset()
        cf = _compile(lambda x: x * 2)
        with recompiles() as report:
            for n in (1, 2):
                x = torch.ones(n, 3)
                if mark is not None and n == 1:
                    mark(x, 0)
                cf(x)
        graphs[mark] = report.graphs_total
        if mark is None:
            (g,) = report.records[1].failed_guards
            assert "expected 1, actual 2" in g.guard and (g.category, g.tensor, g.dim) == ("shape", "x", 0)
            assert "mark_unbacked(x, 0)" in g.fix and "mark_dynamic" not in g.fix
    assert graphs == {None: 2, torch._dynamo.mark_dynamic: 2, torch._dynamo.decorators.mark_unbacked: 1}


def test_dim_marking_added_after_the_first_call():
    # Regression: classed "other" with "keep it constant, or pass it as a tensor".
    for mark_first in (False, True):
        torch._dynamo.reset()
        cf = _compile(lambda x: x * 2)
        with recompiles() as report:
            # same shape (else the size guard fails first), the second input marked dynamic
            for call, n in enumerate((3, 5) if mark_first else (3, 3)):
                x = torch.randn(n, 4)
                if mark_first or call == 1:
                    torch._dynamo.mark_dynamic(x, 0)
                cf(x)
        if mark_first:  # the fix followed: one graph serves both sizes
            assert report.graphs_total == 1 and report.recompiles == []
            continue
        (g,) = report.records[1].failed_guards
        assert g.category == "shape" and report.records[1].cause == "shape"
        assert "torch._dynamo.mark_dynamic" in g.fix and "before the first call" in g.fix
        assert "keep it constant" not in g.fix


def test_requires_grad_frozen_vs_trainable_under_no_grad():
    torch.manual_seed(0)
    trainable, frozen = Block(), Block()
    frozen.requires_grad_(False)
    trainable.compile(backend="eager")
    frozen.compile(backend="eager")
    with recompiles() as report, torch.no_grad():
        trainable(torch.randn(4, 16))
        frozen(torch.randn(4, 16))
    assert [r.cause for r in report.records] == [None, "requires_grad"]
    g = report.records[1].failed_guards[0]
    assert "requires_grad mismatch" in g.guard and "._parameters[" in g.tensor
    assert g.fix == FIXES["requires_grad"] and "paramfold.prepare(" in g.fix
    assert [g.reason for g in report.records[1].failed_guards] == _torch_reasons(Block)

    # An input that requires grad in one call and not in the next: same category, input fix.
    cf = _compile(lambda x: x * 2)
    with recompiles() as report:
        cf(torch.ones(3))
        cf(torch.ones(3, requires_grad=True))
    g = report.records[1].failed_guards[0]
    assert (g.category, g.tensor) == ("requires_grad", "x") and "input x requires grad" in g.fix


def test_training_vs_eval():
    block = Block()
    block.compile(backend="eager")
    x = torch.randn(4, 16)
    with recompiles() as report:
        block(x)
        block.eval()
        block(x)
    rec = report.records[1]
    assert rec.cause == "training"
    g = rec.failed_guards[0]
    assert ".training" in g.guard and g.tensor == "self._modules['drop']"
    assert "same train/eval mode" in g.fix and "self._modules['drop'].training" in g.fix


def test_grad_mode_is_reported_as_unavoidable():
    def f(x):
        return x * 2

    cf = _compile(f)
    x = torch.randn(3, requires_grad=True)
    with recompiles() as report:
        with torch.no_grad():
            cf(x)
        cf(x)
    rec = report.records[1]
    assert rec.cause == "grad_mode"
    assert "GLOBAL_STATE changed: grad_mode" in rec.failed_guards[0].guard
    assert rec.failed_guards[0].fix.startswith("unavoidable")
    assert [g.reason for g in rec.failed_guards] == _torch_reasons(f)


def test_dtype():
    def f(x):
        return x + 1

    cf = _compile(f)
    with recompiles() as report:
        cf(torch.ones(3))
        cf(torch.ones(3, dtype=torch.float64))
    g = report.records[1].failed_guards[0]
    assert report.records[1].cause == "dtype/device" and "dtype mismatch" in g.guard
    assert g.tensor == "x" and "Double" in g.fix and "Float" in g.fix


def test_a_hoisted_values_requires_grad_guard_is_a_parameters_not_an_inputs():
    import paramfold
    from torch.nn.utils.parametrizations import weight_norm

    from paramfold.recompiles.classify import classify

    # Regression (helper-223): hoist/auto's value of a parametrized weight sits in its module's
    # __dict__, so the guard names self._modules['b'].weight, which was taken for an input of the
    # call ("call .requires_grad_() on the input ... .detach()"), where stock's guard on the
    # original got the parameter's fix. The module is looked up in the frame's namespaces.
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = nn.Module()
            self.b.weight = nn.Parameter(torch.ones(2))
            self.b.c = weight_norm(nn.Linear(2, 2))
            weight_norm(self.b, "weight", dim=None)

    model = paramfold.prepare(Outer(), "hoist")
    namespaces = ({}, {"self": model})
    for source in ("self._modules['b'].weight", "L['self']._modules['b']._modules['c'].weight"):
        g = classify(f"0/1: tensor '{source}' requires_grad mismatch. expected requires_grad=1", namespaces)
        assert g.fix.startswith("a parameter's requires_grad differs"), (source, g.fix)
    g = classify("0/1: tensor 'x' requires_grad mismatch. expected requires_grad=1", namespaces)
    assert g.fix.startswith("input x requires grad"), g.fix


_helper_model = None


class _Cached(nn.Module):
    """A user's model keeping a running cache as a plain tensor attribute (no parameter, no buffer)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cache = torch.zeros(rows, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache = torch.cat([self.cache, x])
        return self.lin(self.cache).sum(0)


def test_a_plain_tensor_attributes_guard_gets_a_plain_tensors_fix_not_a_parameters():
    # Regression (helper-225): every tensor attribute reached through self was taken for a
    # parameter/buffer: a plain model's running cache got "force_parameter_static_shapes = False",
    # which does nothing for it, instead of the size-0/1 fix (1 -> 2) and mark_dynamic (2 -> 3).
    for rows, wanted in ((1, "mark_unbacked(self.cache, 0)"), (2, "torch._dynamo.mark_dynamic(self.cache, 0)")):
        torch._dynamo.reset()
        cm = _compile(_Cached(rows))
        with recompiles() as report:
            cm(torch.randn(1, 4))
            cm(torch.randn(1, 4))
        (g,) = report.records[1].failed_guards
        assert (g.category, g.tensor, g.dim) == ("shape", "self.cache", 0), g.guard
        assert wanted in g.fix, g.fix
        assert "parameter/buffer" not in g.fix and "force_parameter_static_shapes" not in g.fix

    # requires_grad: a cache that took an input with grad in one call, then was reset without it
    torch._dynamo.reset()
    model = _Cached(2)
    cm = _compile(model)
    with recompiles() as report:
        cm(torch.randn(1, 4, requires_grad=True))
        cm(torch.randn(1, 4, requires_grad=True))
        model.cache = model.cache.detach()[:2]
        cm(torch.randn(1, 4, requires_grad=True))
    (g,) = report.records[-1].failed_guards
    assert (g.category, g.tensor) == ("requires_grad", "self.cache"), g.guard
    assert g.fix == FIXES["requires_grad:attribute"].format(tensor="self.cache"), g.fix

    # hoist's value of a parametrized weight, also a tensor in its module's __dict__, stays a parameter
    import paramfold
    from torch.nn.utils.parametrizations import weight_norm

    torch._dynamo.reset()
    model = paramfold.prepare(nn.Sequential(weight_norm(nn.Linear(8, 4, bias=False))), "hoist")
    cm = _compile(model)
    with recompiles() as report:
        cm(torch.randn(2, 8))
        model[0].weight = torch.randn(6, 8)
        cm(torch.randn(2, 8))
    (g,) = report.records[1].failed_guards
    assert (g.category, g.tensor) == ("shape", "self._modules['0'].weight"), g.guard
    assert g.fix.startswith("parameter/buffer self._modules['0'].weight changed shape"), g.fix


def test_a_hoisted_value_reached_through_a_global_or_an_argument_gets_the_parameters_fix():
    # Regression (helper-225): the parameter's fix was given only where the module was reached as
    # self; a compiled function reading a prepared model as a global (G['model']) or an argument
    # got the input's ".requires_grad_() ... .detach()". A plain tensor attribute read the same
    # way is not taken for a parameter.
    import paramfold
    from torch.nn.utils.parametrizations import weight_norm

    global _helper_model  # a module global, as dynamo names it: G['_helper_model']

    @torch.compile(backend="eager")
    def from_global(x):
        return x @ _helper_model.lin.weight.T + _helper_model.extra

    @torch.compile(backend="eager")
    def from_argument(m, x):
        return x @ m.lin.weight.T + m.extra

    class Net(nn.Module):
        def __init__(self, as_argument: bool) -> None:
            super().__init__()
            self.lin = weight_norm(nn.Linear(4, 4))
            self.extra = torch.zeros(4)  # a plain tensor attribute
            self.as_argument = as_argument

        def forward(self, x):
            return from_argument(self, x) if self.as_argument else from_global(x)

    for as_argument, holder in ((False, "G['_helper_model']"), (True, "m")):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _helper_model = paramfold.prepare(Net(as_argument), "hoist")
        x = torch.randn(3, 4)
        with recompiles() as report:
            model(x)
            model.requires_grad_(False)
            model(x)
            model.extra = torch.zeros(4, requires_grad=True)
            model(x)
        weight, extra = (r.failed_guards[0] for r in report.recompiles)
        assert (weight.category, weight.tensor) == ("requires_grad", f"{holder}._modules['lin'].weight"), weight.guard
        assert weight.fix == FIXES["requires_grad"], weight.fix
        assert (extra.category, extra.tensor) == ("requires_grad", f"{holder}.extra"), extra.guard
        assert extra.fix.startswith(f"{holder}.extra, a tensor attribute of a module"), extra.fix
    _helper_model = None


def test_a_parameters_dtype_guard_names_the_dtype_without_torchs_full_stop():
    from paramfold.recompiles.classify import classify

    # Regression (helper-223): on a parameter torch's line goes on after the dtype ("actual
    # Double. Guard failed on a parameter, ..."), and the fix read "arrived as Double., the graph".
    g = classify("0/2: tensor 'self._modules['sn']._parameters['bias']' dtype mismatch. expected Float, "
                 "actual Double. Guard failed on a parameter, consider using "
                 "torch._dynamo.config.force_parameter_static_shapes = False to allow dynamism on parameters.")
    assert "arrived as Double, the graph was made for Float" in g.fix, g.fix


_ACT = torch.sin


def _uses_global(x):
    return _ACT(x)


def _calls_module(m, x):
    return m(x)


def test_object_identity_id_match_and_type_match():
    global _ACT
    cf, cm = _compile(_uses_global), _compile(_calls_module)
    try:
        with recompiles() as report:
            cf(torch.randn(3))
            _ACT = torch.cos  # ID_MATCH on the global fails
            cf(torch.randn(3))
            cm(nn.ReLU(), torch.randn(3))
            cm(nn.GELU(), torch.randn(3))  # TYPE_MATCH on the module argument fails
    finally:
        _ACT = torch.sin
    recs = report.recompiles
    assert [r.cause for r in recs] == ["id/object identity", "id/object identity"]
    assert "___check_obj_id(G['_ACT']" in recs[0].failed_guards[0].guard
    assert recs[0].failed_guards[0].tensor == "G['_ACT']"
    assert "___check_type_id(m," in recs[1].failed_guards[0].guard
    assert recs[1].failed_guards[0].tensor == "m"
    assert "m is a different object" in recs[1].failed_guards[0].fix


class _NormedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


def test_stock_parametrize_classes_get_the_prepare_fix():
    # Regression: every stock parametrized module has a class of its own, so same-architecture
    # blocks compiled one by one recompile on ___check_type_id; the fix said "reuse one object".
    import paramfold

    for prepare in (False, True):
        torch._dynamo.reset()
        blocks = nn.ModuleList(_NormedBlock() for _ in range(3))
        if prepare:
            paramfold.prepare(blocks)
        for b in blocks:
            b.compile(backend="eager")
        with recompiles() as report, torch.no_grad():
            for b in blocks:
                b(torch.randn(2, 4))
        if prepare:  # the fix followed: one class, one graph
            assert report.graphs_total == 1 and report.recompiles == []
            continue
        assert [r.cause for r in report.recompiles] == ["id/object identity"] * 2
        g = report.recompiles[0].failed_guards[0]
        assert g.guard.startswith("___check_type_id(self._modules['proj'],")
        assert "paramfold.prepare" in g.fix and "ParametrizedLinear" in g.fix
        # and that it removes this guard, not a difference of another kind (helper-234: a codec's
        # conv wrappers of different strides kept their 8 graphs prepared)
        assert "modules that differ otherwise (a conv's stride or padding" in g.fix, g.fix


def test_a_class_named_parametrized_elsewhere_keeps_the_identity_fix():
    from paramfold.recompiles.classify import classify

    g = classify("0/0: ___check_type_id(m, 123), type=<class 'mylib.ParametrizedThing'>")
    assert g.category == "id/object identity" and "paramfold.prepare" not in g.fix


def test_other_python_constant():
    def f(x, n):
        return x * n

    cf = _compile(f)
    with recompiles() as report:
        cf(torch.ones(3), 2)
        cf(torch.ones(3), 3)
    g = report.records[1].failed_guards[0]
    assert report.records[1].cause == "other" and g.guard.startswith("n == 2")
    assert "(n == 2)" in g.fix


SRC = Path(__file__).resolve().parent.parent / "src"
LIMIT = limit_config()  # recompile_limit (torch >= 2.7) or cache_size_limit


def test_recompile_limit_hit_is_loud():
    def f(x):
        return x + 1

    cf = _compile(f)
    dtypes = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    with torch._dynamo.config.patch(**{LIMIT: 2}):
        with pytest.warns(RecompileLimitWarning, match=LIMIT):
            with recompiles() as report:
                for dtype in dtypes:
                    cf(torch.ones(3, dtype=dtype))
                cf(torch.ones(3, dtype=torch.float16))  # runs eager from now on: no new record
    assert [r.kind for r in report.records] == ["first compile", "recompile", "limit hit"]
    hit = report.limit_hits[0]
    assert (hit.function, hit.limit_type, hit.limit, hit.graphs) == ("f", LIMIT, 2, 0)
    assert hit.cause == "limit hit" and hit.categories == ["dtype/device", "limit hit"]
    assert f"torch._dynamo.config.{LIMIT}" in hit.fix
    data = json.loads(report.to_json())
    assert data["limit_hit"] is True and data["functions"][0]["limit_hit"] is True
    assert "RECOMPILE LIMIT HIT" in _text(report)

    # strict=True raises; and the hit is found from the compile metrics alone when dynamo's own
    # warning is silenced (torch >= 2.8: 2.5/2.6 record no metrics for a refused compile, so the
    # warning is the only sign there, and it stays on; 2.7 is not measured).
    torch._dynamo.reset()
    torch._logging.set_logs(dynamo=logging.ERROR if torch.__version__ >= (2, 8) else logging.WARNING)
    try:
        with torch._dynamo.config.patch(**{LIMIT: 1}):
            with pytest.raises(RecompileLimitError, match=rf"compiling f \(.*{LIMIT}=1 "):
                with recompiles(strict=True) as report:
                    cf(torch.ones(3))
                    cf(torch.ones(3, dtype=torch.float64))
    finally:
        torch._logging.set_logs()
    assert [r.kind for r in report.records] == ["first compile", "limit hit"]


def _two_breaks(x):
    x = x + 1
    torch._dynamo.graph_break()  # an explicit graph break
    y = x * 2
    if y.sum() > 0:  # a data-dependent branch (not in counters["graph_break"])
        return y
    return y - 1


@pytest.mark.skipif(not GRAPH_BREAKS_REPORTED, reason="torch < 2.6 logs no graph-break event")
def test_graph_breaks_counted_and_json_round_trip():
    import inspect

    first = inspect.getsourcelines(_two_breaks)[1]
    cf = _compile(_two_breaks)
    with recompiles() as report:
        cf(torch.ones(3))
    assert report.graph_breaks == 2
    where = [b.split(": ", 1)[0] for r in report.records for b in r.graph_breaks]
    assert [w.rsplit(":", 1)[1] for w in where] == [str(first + 2), str(first + 4)]
    assert all(w.startswith("at ") and "test_recompiles.py" in w for w in where)
    assert report.graphs_total == sum(report.graphs_per_function().values()) >= 2
    data = json.loads(report.to_json())
    assert data["graphs"] == report.graphs_total
    assert data["graph_breaks"] == 2 and data["recompiles"] == 0
    assert {r["compile_id"] for r in data["records"]} == {r.compile_id for r in report.records}
    assert set(data["causes"]) <= set(CATEGORIES)


@pytest.mark.skipif(GRAPH_BREAKS_REPORTED, reason="torch >= 2.6 reports graph breaks")
def test_graph_breaks_said_unavailable_before_2_6():
    cf = _compile(_two_breaks)
    with recompiles() as report:
        cf(torch.ones(3))
    assert report.graph_breaks is None and json.loads(report.to_json())["graph_breaks"] is None
    assert "graph breaks and dynamic dims not reported by torch < 2.6" in " ".join(_text(report).split())


def test_only_the_block_is_recorded_and_logging_is_restored():
    from torch._logging._internal import trace_log

    cf = _compile(lambda x: x - 1)
    cf(torch.ones(3))  # compiled before the block
    handlers, level = list(trace_log.handlers), trace_log.level
    cf_logger = logging.getLogger("torch._dynamo.convert_frame")
    cf_handlers = list(cf_logger.handlers)
    with recompiles() as report:
        cf(torch.ones(3))
        cf(torch.ones(3, dtype=torch.float64))
    assert [r.kind for r in report.records] == ["recompile"]
    assert report.records[0].compile_id == "0/1"
    assert trace_log.handlers == handlers and trace_log.level == level
    assert cf_logger.handlers == cf_handlers


def test_seed000_layerwise_rlhf_counts():
    """Seed 000 in miniature: four same-architecture models, each layer compiled on its own."""
    torch.manual_seed(0)
    models = [
        nn.Sequential(nn.Embedding(128, 64), Block(64, dropout=False), Block(64, dropout=False))
        for _ in range(4)
    ]
    policy, value, reference, reward = models
    for frozen in (reference, reward):
        frozen.eval().requires_grad_(False)
    for m in models:
        for layer in m:
            layer.compile(backend="eager")
    tokens = {n: torch.ones(1, n, dtype=torch.long) for n in (64, 1, 68, 66)}
    with recompiles() as report:
        with torch.no_grad():
            policy(tokens[64])
            for _ in range(4):
                policy(tokens[1])
            reference(tokens[68])
            value(tokens[68])
            reward(tokens[66])
        (policy(tokens[64]).mean() + value(tokens[68]).mean()).backward()
    graphs = report.graphs_per_function()
    (loc,) = [f for f in graphs if f.startswith("forward (")]  # Block.forward, shared by 8 blocks
    assert graphs[loc] == 5 and report.recompiles_per_function()[loc] == 4
    block = [r for r in report.recompiles if r.location == loc]
    assert [r.cause for r in block] == ["shape", "shape", "requires_grad", "grad_mode"]
    assert all(r.shared_code is None for r in report.records if r.location == loc)
    others = set(graphs) - {loc}
    if WRAPS_TORCH_MODULES:
        # torch >= 2.14 compiles the nn.Embedding layers too, through its wrap_inline wrapper; the
        # report names Embedding.forward, not the wrapper's `inner`.
        (emb,) = others
        assert emb.startswith("Embedding.forward (") and "torch/nn/modules/sparse.py:" in emb
        assert all(r.shared_code for r in report.records if r.location == emb)
    else:  # before 2.14 dynamo skips a torch.nn module's forward as a top-level frame
        assert not others


WRAPS_TORCH_MODULES = hasattr(torch._dynamo.eval_frame.OptimizedModule, "_should_wrap_module_call_impl")


def test_torch_modules_compiled_one_by_one_share_one_limit():
    """Ten nn.Linear(4 + i, 4).compile(): from torch 2.14 all run through one shared code object."""
    layers = [nn.Linear(4 + i, 4) for i in range(10)]
    for layer in layers:
        layer.compile(backend="eager")
    with recompiles(warn=False) as report:
        for i, layer in enumerate(layers):
            x = torch.ones(2, 4 + i)
            assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    if not WRAPS_TORCH_MODULES:
        assert report.records == []  # torch < 2.14: a torch.nn forward is not compiled at all
        return
    limit = getattr(torch._dynamo.config, LIMIT)
    (loc,) = report.graphs_per_function()
    assert loc.startswith("Linear.forward (") and "torch/nn/modules/linear.py:" in loc
    assert "inner" not in loc and "external_utils" not in loc
    assert [r.kind for r in report.records] == ["first compile"] + ["recompile"] * (limit - 1) + ["limit hit"]
    assert {r.cause for r in report.recompiles} == {"shape"}
    hit = report.limit_hits[0]
    assert hit.shared_code == "torch._dynamo.external_utils.wrap_inline"
    assert "share ONE recompile limit" in hit.fix and "compile the parent model once" in hit.fix
    text = " ".join(_text(report).split())
    assert "all of them count against one recompile limit" in text and "RECOMPILE LIMIT HIT" in text


def test_torch_compile_of_torch_nn_modules_names_their_forward_and_says_they_share_one_limit():
    # Regression: torch.compile(nn.Sequential(...)) was labelled with the module's multi-line repr
    # (and no line); and the limit fix spoke of layer.compile() on torch >= 2.14 only.
    models = [nn.Sequential(nn.Linear(4 + i, 4), nn.ReLU()) for i in range(3)]
    compiled = [torch.compile(m, backend="eager") for m in models]
    with torch._dynamo.config.patch(**{LIMIT: 2}), recompiles(warn=False) as report:
        for i, cm in enumerate(compiled):
            cm(torch.ones(2, 4 + i))
    forward = nn.Sequential.forward.__code__
    (loc,) = report.graphs_per_function()
    assert loc == f"Sequential.forward ({short_path(forward.co_filename)}:{forward.co_firstlineno})"
    # Regression: torch's files were shown by their absolute site-packages path
    assert short_path(forward.co_filename) == os.path.join("torch", "nn", "modules", "container.py")
    assert [r.kind for r in report.records] == ["first compile", "recompile", "limit hit"]
    assert all(r.shared_code == "torch._dynamo.external_utils.wrap_inline" for r in report.records)
    (fn,) = json.loads(report.to_json())["functions"]
    assert (fn["function"], fn["filename"], fn["lineno"]) == ("Sequential.forward", forward.co_filename, forward.co_firstlineno)
    fix = report.limit_hits[0].fix
    assert "torch.compile(module)" in fix and "ONE recompile limit" in fix
    assert "layer.compile()" not in fix and "2.14" not in fix
    assert "Sequential(" not in _text(report)


def _cli(args: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``paramfold ARGS``, run in this process.

    Not standalone (click's standalone mode ends the process): the script's exit steps, which
    ``recompiles`` runs for it only when the process ends (threads joined, ``atexit`` functions),
    are left to this one; the tests of those run the command in a process of its own."""
    # get_group: a command group even while ``recompiles`` is the only command registered.
    with CliRunner().isolation() as (out, err, _):
        try:
            code = typer.main.get_group(app).main(args=args, prog_name="paramfold", standalone_mode=False)
        except SystemExit as e:
            code = e.code
        sys.stdout.flush()
        sys.stderr.flush()
        return code, out.getvalue().decode(), err.getvalue().decode()


def test_cli_runs_script_prints_report_and_keeps_exit_code(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, torch
            print("argv", sys.argv[1:])
            f = torch.compile(lambda x: x * 2, backend="eager")
            f(torch.ones(3))
            f(torch.ones(3, dtype=torch.float64))
            sys.exit(int(sys.argv[1]))
            """
        )
    )
    code, out, err = _cli(["recompiles", "--", "python", str(script), "5", "--flag"])
    assert code == 5, out + err
    assert "argv ['5', '--flag']" in out
    assert "dtype mismatch" in out and "dtype/device" in out
    # the tables' titles on lines of their own, not padded to the table's width (helper-233)
    assert "per function" in out.splitlines(), out

    torch._dynamo.reset()
    code, out, err = _cli(["recompiles", "--json", "--", "python", str(script), "0"])
    assert code == 0, out + err
    data = json.loads(out)  # stdout is pure JSON; the script's print went to stderr
    assert data["recompiles"] == 1 and data["causes"] == {"dtype/device": 1}
    assert "argv ['0']" in err

    # A script that crashes: its traceback, exit code 1, and the report of what ran before.
    crash = tmp_path / "crash.py"
    crash.write_text(script.read_text().replace("sys.exit(int(sys.argv[1]))", "raise ValueError"))
    torch._dynamo.reset()
    code, out, err = _cli(["recompiles", "--", "python", str(crash)])
    assert code == 1 and "ValueError" in err and "dtype/device" in out

    code, out, err = _cli(["recompiles", "--", "python", str(tmp_path / "missing.py")])
    assert code == 2
    assert err.strip().splitlines() == [
        f"paramfold recompiles: error: script not found: {tmp_path / 'missing.py'}"
    ]


@pytest.mark.parametrize("body", [
    "def f():\n    raise ValueError('boom')\nf()\n",
    "def stop():\n    raise KeyboardInterrupt('raised by the script, no signal')\nstop()\n",
    "x = (\n",  # a SyntaxError: no frames at all, as python prints it
    "import sys\nsys.excepthook = lambda t, v, tb: print('hook:', t.__name__, file=sys.stderr)\nraise KeyError(1)\n",
], ids=["raises", "raises KeyboardInterrupt", "syntax error", "own excepthook"])
def test_a_failing_scripts_traceback_is_the_one_python_prints(tmp_path, body):
    # Regression: two frames of paramfold/recompiles/script.py (run_script, _run_path) came first,
    # and a hook the script set was not called. A KeyboardInterrupt the script raised itself was
    # taken for a SIGINT: no traceback, and "interrupted by SIGINT".
    script = tmp_path / "crash.py"
    script.write_text(body)
    python = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    ours = subprocess.run([sys.executable, "-m", "paramfold", "recompiles", "--", str(script)],
                          capture_output=True, text=True, timeout=300)
    assert ours.returncode == (130 if "KeyboardInterrupt" in body else 1)
    assert python.returncode in (ours.returncode, -2)  # python ends itself with SIGINT: -2 seen from here
    assert ours.stderr == python.stderr and "paramfold" not in ours.stderr, ours.stderr


def test_cli_json_stdout_holds_only_the_report_whatever_the_script_writes(tmp_path):
    # Regression: only sys.stdout went to stderr, so a child process's output, os.system's and
    # sys.__stdout__'s came before the JSON on stdout, which then did not parse.
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(
        """
        import os, subprocess, sys, torch
        subprocess.run([sys.executable, "-c", "print('from a child process')"], check=True)
        os.system("echo from os.system")
        print("from sys.__stdout__", file=sys.__stdout__)
        print("from print")
        torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
        """
    ))
    done = subprocess.run([sys.executable, "-m", "paramfold", "recompiles", "--json", "--", "python", str(script)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["compiles"] == 1
    for line in ("from a child process", "from os.system", "from sys.__stdout__", "from print"):
        assert line in done.stderr
    # Without --json the script's output stays on stdout, before the report.
    plain = subprocess.run([sys.executable, "-m", "paramfold", "recompiles", "--", "python", str(script)],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "120"})
    assert plain.returncode == 0 and "from a child process" in plain.stdout and "from print" in plain.stdout


def test_cli_gives_the_script_an_absolute_file_as_python_does(tmp_path):
    # Regression: __file__ was the path as typed, so a script that changes directory and then
    # finds its data next to itself failed under paramfold recompiles (python makes it absolute).
    (tmp_path / "data.txt").write_text("42")
    (tmp_path / "sub").mkdir()
    (tmp_path / "run.py").write_text(textwrap.dedent(
        """
        import os, sys
        print(__file__, sys.argv[0])
        os.chdir("sub")
        print(open(os.path.join(os.path.dirname(__file__), "data.txt")).read())
        """
    ))
    want = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, capture_output=True, text=True)
    assert want.returncode == 0 and want.stdout.split() == [str(tmp_path / "run.py"), "run.py", "42"]
    got = subprocess.run([sys.executable, "-m", "paramfold", "recompiles", "--json", "--", "python", "run.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    assert want.stdout in got.stderr


def test_cli_runs_a_folder_with_a_main_module_as_python_does(tmp_path):
    # Regression: `python pkgdir` runs pkgdir/__main__.py; the command said "script not found".
    folder = tmp_path / "pkgdir"
    folder.mkdir()
    (folder / "helper.py").write_text("VALUE = 7\n")
    (folder / "__main__.py").write_text(
        "import sys\nimport helper\nprint('ran', helper.VALUE, sys.argv[1:])\nsys.exit(4)\n"
    )
    code, out, err = _cli(["recompiles", "--", "python", str(folder), "x"])
    assert code == 4, out + err
    assert "ran 7 ['x']" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = _cli(["recompiles", "--", "python", str(empty)])
    assert (code, out, err) == (2, "", f"paramfold recompiles: error: can't find '__main__' module in {str(empty)!r}\n")


def test_cli_reports_a_failing_package_init_of_a_dash_m_module_as_python_does(tmp_path, monkeypatch):
    # Regression: `recompiles -- python -m pk.m` where pk/__init__.py raised (a missing
    # dependency) said "no module named 'pk.m'", exit 2: the package's own code ran and failed,
    # which python reports with that code's traceback, exit 1.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pk").mkdir()
    (tmp_path / "pk" / "m.py").write_text("print('never')\n")
    for init, last in (("import missing_dep_xyz\n", "ModuleNotFoundError: No module named 'missing_dep_xyz'"),
                       ("raise ImportError('boom')\n", "ImportError: boom"),
                       ("x = 1 / 0\n", "ZeroDivisionError: division by zero")):
        (tmp_path / "pk" / "__init__.py").write_text(init)
        for name in ("pk.m", "pk.not_there"):  # python imports the package first either way
            code, out, err = _cli(["recompiles", "--", "python", "-m", name])
            python = subprocess.run([sys.executable, "-m", name], capture_output=True, text=True)
            assert (python.returncode, python.stderr.splitlines()[-1]) == (1, last)
            assert code == 1 and "never" not in out, err
            assert err.splitlines()[-1] == last and 'pk/__init__.py", line 1, in <module>' in err, err
            assert "0 graphs" in out  # the report of what ran, as after a script that raises
    (tmp_path / "pk" / "__init__.py").write_text("")
    code, out, err = _cli(["recompiles", "--", "python", "-m", "pk.not_there"])
    assert (code, out, err) == (2, "", "paramfold recompiles: error: no module named 'pk.not_there'\n")
    monkeypatch.delitem(sys.modules, "pk", raising=False)  # imported by this process's runs


def test_cli_refuses_what_python_cannot_run_in_one_line_not_a_runpy_traceback(tmp_path, monkeypatch):
    # Regression: `recompiles -- python model.pt` (a torch checkpoint: a zip without __main__.py)
    # printed runpy's chained 8-line traceback and an empty report, exit 1, where python says one
    # line and a folder without __main__.py was refused in one line, exit 2; so did `-m PACKAGE`
    # for a package without a __main__ module.
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.ones(2)}, "model.pt")
    with zipfile.ZipFile("pkg_main.zip", "w") as z:  # a __main__ package: not runnable either
        z.writestr("__main__/__init__.py", "print('never')\n")
    for name in ("model.pt", "pkg_main.zip"):
        code, out, err = _cli(["recompiles", "--", "python", name])
        assert (code, out, err) == (2, "", f"paramfold recompiles: error: can't find '__main__' module in {name!r}\n")
    (tmp_path / "package").mkdir()
    (tmp_path / "package" / "__init__.py").write_text("")
    code, out, err = _cli(["recompiles", "--", "python", "-m", "package"])
    assert (code, out) == (2, "") and err == (
        "paramfold recompiles: error: No module named package.__main__; 'package' is a package and cannot be "
        "directly executed\n")
    with zipfile.ZipFile("app.zip", "w") as z:  # a zip with its __main__.py still runs
        z.writestr("__main__.py", "import sys\nprint('zip ran')\nsys.exit(6)\n")
    code, out, err = _cli(["recompiles", "--", "python", "app.zip"])
    assert code == 6 and out.startswith("zip ran\n"), out + err


def test_cli_errors_of_the_command_itself_are_one_line(tmp_path):
    fifo = tmp_path / "fifo.py"
    os.mkfifo(fifo)
    for args, message in (
        (["python"], "nothing to run; usage: paramfold recompiles -- python SCRIPT [ARGS]..."),
        (["python", "-m"], "nothing to run; usage: paramfold recompiles -- python SCRIPT [ARGS]..."),
        (["python", "-m", "no_such_module_xyz"], "no module named 'no_such_module_xyz'"),
        ([""], "no script given (an empty string)"),  # was "script not found: " (helper-221)
        (["python", ""], "no script given (an empty string)"),
        # Was "script not found: -c".
        (["python", "-c", "print(1)"], "python's option -c is not supported here: give a script file "
                                       "(code for -c put in one) or -m MODULE"),
        (["python", "-u", "train.py"], "python's option -u is not supported here: give a script file "
                                       "(code for -c put in one) or -m MODULE"),
        # Was "script not found: .../fifo.py".
        (["python", str(fifo)], f"script is not a regular file (a FIFO, a device or a socket): {fifo}"),
    ):
        code, out, err = _cli(["recompiles", "--", *args])
        assert (code, out, err) == (2, "", f"paramfold recompiles: error: {message}\n"), args


def test_cli_strict_exits_3_after_the_report_and_says_why(tmp_path):
    # A real process: torch's log handler writes to the stderr it found at import, which an
    # in-process runner does not capture (on torch < 2.15 it let dynamo's own multi-line
    # limit warning through unseen).
    script = tmp_path / "hits.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import torch
            torch._dynamo.config.{LIMIT} = 1
            f = torch.compile(lambda x: x + 1, backend="eager")
            f(torch.ones(3))
            f(torch.ones(3, dtype=torch.float64))
            """
        )
    )

    def cli(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "paramfold.cli", "recompiles", *args, "--", "python", str(script)]
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)

    plain = cli()
    assert plain.returncode == 0 and "RECOMPILE LIMIT HIT" in plain.stdout and plain.stderr == ""  # reported only
    strict = cli("--strict", "--json")
    assert strict.returncode == 3 and json.loads(strict.stdout)["limit_hit"] is True
    assert strict.stderr.startswith("paramfold recompiles: error: recompile limit hit: torch stopped compiling ")
    assert strict.stderr.count("\n") == 1 and f"torch._dynamo.config.{LIMIT}=1" in strict.stderr


def test_cli_strict_still_says_the_limit_hit_when_the_script_fails_and_keeps_its_status(tmp_path):
    # Regression: a script that hit the limit and then exited 5 got no --strict line at all.
    script = tmp_path / "hits_then_fails.py"
    script.write_text(textwrap.dedent(
        f"""
        import sys, torch
        torch._dynamo.config.{LIMIT} = 1
        f = torch.compile(lambda x: x + 1, backend="eager")
        f(torch.ones(3))
        f(torch.ones(3, dtype=torch.float64))
        sys.exit(5)
        """))
    command = [sys.executable, "-m", "paramfold.cli", "recompiles", "--strict", "--", "python", str(script)]
    res = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=300)
    assert res.returncode == 5 and "RECOMPILE LIMIT HIT" in res.stdout
    assert res.stderr.startswith("paramfold recompiles: error: recompile limit hit: torch stopped compiling ")
    assert res.stderr.count("\n") == 1 and res.stderr.endswith("(the script itself exited with 5: its status is kept)\n")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_cli_a_script_that_ends_with_os_exit_is_said_not_mistaken_for_strict(tmp_path):
    # Regression: os._exit(3) ended the process with no report and no word: exit 3, as --strict's.
    script = tmp_path / "quits.py"
    script.write_text(textwrap.dedent(
        """
        import os
        print("ran", flush=True)
        child = os.fork()
        if child == 0:
            os._exit(0)  # a forked child's own: not said
        os.waitpid(child, 0)
        os._exit(3)
        """))
    command = [sys.executable, "-m", "paramfold.cli", "recompiles", "--strict", "--", "python", str(script)]
    res = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=300)
    assert res.returncode == 3 and res.stdout == "ran\n"
    assert res.stderr.splitlines() == [
        "paramfold recompiles: error: the script called os._exit(3), which ends the process at once: no report "
        "was printed, and the exit status 3 is the script's own"
    ]


def test_recompiles_leaves_dynamos_limit_warning_to_torchs_handlers_unless_told_not_to(caplog):
    f = torch.compile(lambda x: x - 1, backend="eager")
    limit = getattr(torch._dynamo.config, LIMIT)
    seen = {}
    try:
        setattr(torch._dynamo.config, LIMIT, 1)
        for keep in (True, False):
            torch._dynamo.reset()
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="torch._dynamo"), recompiles(warn=False, torch_warning=keep) as report:
                f(torch.ones(3))
                f(torch.ones(3, dtype=torch.float64))
            assert report.limit_hit  # seen either way
            seen[keep] = [r for r in caplog.records if r.getMessage().startswith("torch._dynamo hit config.")]
    finally:
        setattr(torch._dynamo.config, LIMIT, limit)
    assert len(seen[True]) == 1 and seen[False] == []


def test_cli_interrupted_script_still_reports_then_says_so(tmp_path):
    script = tmp_path / "ctrl_c.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            f = torch.compile(lambda x: x * 2, backend="eager")
            f(torch.ones(3))
            f(torch.ones(3, dtype=torch.float64))
            import os, signal, time
            os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C (one the script raises itself is its own failure)
            time.sleep(30)
            """
        )
    )
    code, out, err = _cli(["recompiles", "--", "python", str(script)])
    assert code == 130 and "dtype/device" in out  # the report of what ran before the interrupt
    assert err == "paramfold recompiles: error: interrupted by SIGINT; the report covers what ran before it\n"


def test_cli_a_ctrl_c_before_the_script_runs_says_no_report_was_printed(tmp_path, monkeypatch):
    # Regression: a Ctrl-C while the command was still starting (here: as it sets up the trace the
    # report is made from) said "the report covers what ran before it", and no report was printed.
    import importlib

    script_module = importlib.import_module("paramfold.recompiles.script")  # (paramfold.recompiles is the function)

    @contextlib.contextmanager
    def ctrl_c_on_entry(**kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C, handled by the CLI as one from the terminal
        yield None

    monkeypatch.setattr(script_module, "recompiles", ctrl_c_on_entry)
    script = tmp_path / "never.py"
    script.write_text("print('ran')\n")
    code, out, err = _cli(["recompiles", "--", "python", str(script)])
    assert (code, out) == (130, "")
    assert err == "paramfold recompiles: error: interrupted by SIGINT; the script had not started: no report was printed\n"


def test_cli_a_ctrl_c_the_script_catches_is_its_own_as_under_python(tmp_path):
    # Regression: a Ctrl-C raised paramfold's own Interrupted (a KeyboardInterrupt) in the script,
    # where python raises KeyboardInterrupt itself; caught, the script ends normally, as under python.
    script = tmp_path / "catches.py"
    script.write_text(textwrap.dedent(
        """
        import os, signal, time
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
        except KeyboardInterrupt as e:
            print("caught", type(e).__name__)
        """))
    code, out, err = _cli(["recompiles", "--json", "--", "python", str(script)])
    assert (code, err) == (0, "caught KeyboardInterrupt\n") and json.loads(out)["compiles"] == 0


def test_the_package_keeps_every_name_and_the_function_keeps_its_name():
    import importlib

    import paramfold

    package = importlib.import_module("paramfold.recompiles")
    for name in package.__all__:
        assert getattr(package, name) is not None, name
    # paramfold.recompiles is the function, not the package of the same name (see its docstring)
    assert paramfold.recompiles is package.recompiles and callable(paramfold.recompiles)
    assert issubclass(RecompileLimitError, RuntimeError) and RecompileLimitError.exit_code == 3
    assert package.GRAPH_BREAKS_REPORTED is GRAPH_BREAKS_REPORTED


def test_short_path_names_package_files_as_imported_and_local_files_relative(tmp_path, monkeypatch):
    import torch.nn.modules.linear as linear

    assert short_path(linear.__file__) == os.path.join("torch", "nn", "modules", "linear.py")
    assert short_path(json.__file__) == "json" + os.sep + "__init__.py"  # the standard library
    script = tmp_path / "sub" / "train.py"
    monkeypatch.chdir(tmp_path)
    assert short_path(str(script)) == os.path.join("sub", "train.py")
    elsewhere = tmp_path.parent / "other.py"
    assert short_path(str(elsewhere)) == str(elsewhere)


def test_prepared_torch_defined_roots_name_their_forward_and_share_a_limit_only_per_forward():
    # Regression: a prepared nn.Sequential was reported as paramfold's wrapper "_root_forward
    # (.../paramfold/classes.py:395)", every prepared torch-defined root (of any class) compiled
    # that one code object, and the limit-hit fix no longer said the limit was shared.
    import paramfold
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    seqs = [nn.Sequential(weight_norm(nn.Linear(4 + i, 4)), nn.ReLU()) for i in range(3)]
    linear = weight_norm(nn.Linear(4, 4))  # a root whose forward is Linear.forward
    xs = [torch.randn(2, 4 + i) for i in range(3)]
    stock = [m(x) for m, x in zip(seqs, xs)] + [linear(xs[0])]
    for m in [*seqs, linear]:
        paramfold.prepare(m, "hoist")
    compiled = [torch.compile(m, backend="eager") for m in [*seqs, linear]]
    with torch._dynamo.config.patch(**{LIMIT: 2}), recompiles(warn=False) as report:
        outs = [c(x) for c, x in zip(compiled, [*xs, xs[0]])]
    assert all(torch.equal(a, b) for a, b in zip(outs, stock))
    seq_fwd, lin_fwd = nn.Sequential.forward.__code__, nn.Linear.forward.__code__
    seq_loc = f"Sequential.forward ({short_path(seq_fwd.co_filename)}:{seq_fwd.co_firstlineno})"
    lin_loc = f"Linear.forward ({short_path(lin_fwd.co_filename)}:{lin_fwd.co_firstlineno})"
    assert report.graphs_per_function() == {seq_loc: 2, lin_loc: 1}
    # the Linear root has a code object (and limit) of its own: its first compile is no recompile
    assert [(r.location, r.kind) for r in report.records] == [
        (seq_loc, "first compile"), (seq_loc, "recompile"), (seq_loc, "limit hit"), (lin_loc, "first compile"),
    ]
    assert {r.shared_code for r in report.records} == {"paramfold.classes._root_forward"}
    fix = report.limit_hits[0].fix
    assert fix.startswith(f"torch stopped compiling {seq_loc}") and "ONE recompile limit" in fix
    assert "paramfold.classes._root_forward" in fix and "classes.py" not in _text(report)


def test_train_eval_switch_of_a_prepared_stateful_chain_is_reported_as_training():
    # Regression: paramfold gives a module whose spectral_norm trains another class of its own
    # than in eval (named as torch's Linear); the recompile on model.eval() was reported as object
    # identity with "reuse one object", where stock's report says "training".
    import paramfold
    from torch.nn.utils.parametrizations import spectral_norm

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = spectral_norm(nn.Linear(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(x)

    for first_training in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Net()
        paramfold.prepare(model, "hoist")
        model.train(first_training)
        compiled = torch.compile(model, backend="eager")
        with torch.no_grad(), recompiles() as report:
            compiled(torch.randn(2, 4))
            model.train(not first_training)
            compiled(torch.randn(2, 4))
        (rec,) = report.recompiles
        g = rec.failed_guards[0]
        assert rec.cause == "training" and g.category == "training"
        assert g.guard.startswith("___check_type_id(self._modules['b'],")
        mode = "training" if first_training else "eval"
        assert f"type=<class 'torch.nn.modules.linear.Linear'> (paramfold's class of that Linear, for {mode})" in g.guard
        assert f"made with self._modules['b'] in {mode} mode" in g.fix and "same train/eval mode" in g.fix
        assert "reuse one object" not in g.fix


def _graphs(body) -> tuple[int, list]:
    torch._dynamo.reset()
    with recompiles() as report:
        body()
    return report.graphs_total, [g for r in report.recompiles for g in r.failed_guards[:1]]


def test_each_suggested_fix_removes_the_recompile_or_says_there_is_none():
    # Regression: stride and rank mismatches got "mark the dims with mark_dynamic", which changes
    # nothing; a parameter's shape change got force_parameter_static_shapes = False, after which
    # the first change still recompiles (and every change, on a module of torch's own).
    def stride(fixed: bool):
        f = _compile(lambda t: t * 2)
        a, b = torch.randn(4, 6), torch.randn(6, 4).t()
        f(a.contiguous() if fixed else a)
        f(b.contiguous() if fixed else b)

    graphs, (g,) = _graphs(lambda: stride(False))
    assert graphs == 2 and "stride mismatch" in g.guard and g.category == "shape"
    assert "t.contiguous()" in g.fix and "mark_dynamic(" not in g.fix
    assert _graphs(lambda: stride(True)) == (1, [])

    def rank():
        f = _compile(lambda t: t.sum())
        f(torch.randn(3))
        f(torch.randn(3, 4))

    graphs, (g,) = _graphs(rank)
    assert graphs == 2 and "rank mismatch" in g.guard and g.category == "shape"
    assert "no setting lets one graph serve" in g.fix and "mark_dynamic(" not in g.fix

    class Own(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.t()

    for make in (Own, lambda: nn.Linear(4, 4, bias=False)):
        def resized(fixed: bool):
            m = make()
            c, x = _compile(m), torch.randn(2, 4)
            for n in (4, 6, 8):
                m.weight = nn.Parameter(torch.randn(n, 4))
                if fixed:
                    torch._dynamo.mark_dynamic(m.weight, 0)
                c(x)

        graphs, fails = _graphs(lambda: resized(False))
        assert graphs == 3 and fails[0].category == "shape" and fails[0].dim == 0
        fix = fails[0].fix
        assert "force_parameter_static_shapes = False" in fix and "force_nn_module_property_static_shapes = False" in fix
        assert "mark_dynamic" in fix and "first change still recompiles" in fix
        with torch._dynamo.config.patch(force_parameter_static_shapes=False, force_nn_module_property_static_shapes=False):
            assert _graphs(lambda: resized(True)) == (1, [])
            assert _graphs(lambda: resized(False))[0] == 2  # the settings alone: the first change recompiles

        def pruned(marked: str):  # called with the parameter it was built with, then given smaller ones
            m = make()
            c, x = _compile(m), torch.randn(2, 4)
            if marked == "all":
                torch._dynamo.mark_dynamic(m.weight, 0)
            c(x)
            for n in (3, 2, 3):
                m.weight = nn.Parameter(torch.randn(n, 4))
                if marked:
                    torch._dynamo.mark_dynamic(m.weight, 0)
                c(x)

        # Regression: the fix said to mark "every new parameter put there", after which the first
        # change still recompiled: the one there at the first call is marked too.
        with torch._dynamo.config.patch(force_parameter_static_shapes=False, force_nn_module_property_static_shapes=False):
            assert _graphs(lambda: pruned("new"))[0] == 2
            assert _graphs(lambda: pruned("all")) == (1, [])
        assert "there before the first call" in fix

    # a parameter's requires_grad flipped with grad mode on: no fix exists, and the one for no_grad
    # (detach_params_under_no_grad) is named for no_grad only
    import paramfold

    def frozen_layer(no_grad: bool, detach: bool):
        torch.manual_seed(0)
        m = nn.Sequential(Block(), Block())
        if detach:
            paramfold.prepare(m, "hoist", detach_params_under_no_grad=True)
        c = _compile(m)
        with torch.set_grad_enabled(not no_grad):
            c(torch.randn(2, 16))
            m[1].proj.weight.requires_grad_(False)
            c(torch.randn(2, 16))

    graphs, (g,) = _graphs(lambda: frozen_layer(False, False))
    assert graphs == 2 and g.category == "requires_grad"
    assert "with grad mode on nothing removes it" in g.fix and "under torch.no_grad()" in g.fix
    assert _graphs(lambda: frozen_layer(False, True))[0] == 2  # indeed: nothing removes it
    assert _graphs(lambda: frozen_layer(True, False))[0] == 2
    assert _graphs(lambda: frozen_layer(True, True)) == (1, [])  # the no_grad fix works

    # Regression: inline's originals, read in the graph through its getter, were named an "input"
    # to make consistent with .detach(), which the user cannot reach; the fix names the modes whose
    # values detach_params_under_no_grad serves without grad.
    from torch.nn.utils.parametrizations import weight_norm

    def frozen_original(mode: str):
        torch.manual_seed(0)
        m = nn.Sequential(Block(), Block())
        weight_norm(m[1].proj)
        paramfold.prepare(m, mode, detach_params_under_no_grad=True)
        c = _compile(m)
        with torch.no_grad():
            c(torch.randn(2, 16))
            m[1].proj.parametrizations.weight.requires_grad_(False)
            c(torch.randn(2, 16))

    graphs, (g,) = _graphs(lambda: frozen_original("inline"))
    assert graphs == 2 and g.category == "requires_grad" and "_paramfold_weight_original" in g.tensor
    assert 'prepare the models with "auto" or "hoist"' in g.fix and ".detach()" not in g.fix
    assert _graphs(lambda: frozen_original("hoist")) == (1, [])
    assert _graphs(lambda: frozen_original("auto")) == (1, [])


@pytest.mark.skipif(not GRAPH_BREAKS_REPORTED, reason="torch < 2.6 logs no create_symbol event")
def test_dynamic_dims_are_listed_once_when_dynamo_restarts_the_analysis():
    # Regression: after a graph break dynamo logs create_symbol again and the record listed
    # "x.size()[0]" twice.
    def f(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    cf = _compile(f)
    with recompiles() as report:
        cf(torch.randn(4))
        cf(torch.randn(5))
    assert [r.dynamic for r in report.recompiles] == [["x.size()[0]"], ["y.size()[0]"]]


def _reset_hangup_and_term() -> None:
    # A suite started under nohup (or in the background) inherits SIGHUP ignored; plain python
    # and paramfold would both keep it so. These runs are about signals that arrive.
    for sig in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork and SIGHUP")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_cli_script_meets_sigterm_and_sighup_as_under_python_and_so_do_its_children(tmp_path, sig):
    # Regression: while the script ran, SIGTERM and SIGHUP were paramfold's, raising a
    # KeyboardInterrupt: a script that catches Ctrl-C went on and the command exited 0 where
    # python dies with 143 / 129, and forked children (a fork Pool's workers on terminate())
    # printed a traceback ending in "paramfold.signals.Interrupted: SIGTERM" instead of dying.
    script = tmp_path / "term.py"
    script.write_text(textwrap.dedent(
        f"""
        import os, signal, time
        print("handlers:", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
              signal.getsignal(signal.SIGHUP) is signal.SIG_DFL, flush=True)
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        os.kill(child, signal.SIGTERM)
        _, status = os.waitpid(child, 0)
        print("child killed by:", os.WIFSIGNALED(status) and os.WTERMSIG(status), flush=True)
        try:
            os.kill(os.getpid(), signal.{sig})
            time.sleep(60)
        except KeyboardInterrupt:
            print("caught it and went on", flush=True)
        """))
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=300,
                            preexec_fn=_reset_hangup_and_term)
    python = run([sys.executable, str(script)])
    assert python.stdout == "handlers: True True\nchild killed by: 15\n"
    assert python.returncode == -getattr(signal, sig)
    ours = run([sys.executable, "-m", "paramfold", "recompiles", "--", "python", str(script)])
    # Killed by the signal as python is (143 / 129 in a shell), the report not printed.
    assert (ours.returncode, ours.stdout, ours.stderr) == (python.returncode, python.stdout, ""), ours.stderr


def test_cli_counts_what_the_scripts_threads_and_exit_functions_compile_and_json_stays_alone(tmp_path):
    # Regression: the report was made when the script's main code returned: a non-daemon thread
    # that compiled after it (python waits for it) and an atexit function were missed, and with
    # --json what they printed came after the JSON document on stdout ("Extra data").
    script = tmp_path / "late.py"
    script.write_text(textwrap.dedent(
        """
        import atexit, threading, torch
        f = torch.compile(lambda x: x + 1, backend="eager")
        def late():
            threading.main_thread().join()  # until the main code has ended
            f(torch.ones(2, dtype=torch.float64))
            print("thread done")
        def bye():
            f(torch.ones(2, dtype=torch.float16))
            print("atexit says bye")
        atexit.register(bye)
        threading.Thread(target=late).start()
        f(torch.ones(2))
        print("main done")
        """))
    done = subprocess.run([sys.executable, "-m", "paramfold", "recompiles", "--json", "--", "python", str(script)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)  # the JSON document alone
    assert (data["compiles"], data["recompiles"], data["graphs"]) == (3, 2, 3)
    assert data["causes"] == {"dtype/device": 2}
    # as python orders them: the main code, its threads joined, then the exit functions
    assert [ln for ln in done.stderr.splitlines() if ln.endswith(("done", "bye"))] == [
        "main done", "thread done", "atexit says bye"]


def test_a_dynamo_reset_in_the_block_does_not_lend_one_functions_shared_wrapper_to_another():
    # Regression: frame ids start again from 0 after torch._dynamo.reset(), and the frame a
    # torch.compile(nn.Sequential) had compiled through torch's shared wrapper (wrap_inline) kept
    # that mark: a plain function compiled after the reset was reported as shared_code=wrap_inline,
    # with the shared wrapper's limit fix and footer.
    seq = _compile(nn.Sequential(nn.Linear(4, 4)))

    def plain(x):
        return x * 2

    cp = _compile(plain)
    limit = getattr(torch._dynamo.config, LIMIT)
    try:
        setattr(torch._dynamo.config, LIMIT, 2)
        with recompiles(warn=False) as report:
            seq(torch.randn(2, 4))
            torch._dynamo.reset()
            for dtype in (torch.float32, torch.float64, torch.float16):
                cp(torch.randn(2, dtype=dtype))
    finally:
        setattr(torch._dynamo.config, LIMIT, limit)
    mine = [r for r in report.records if r.function == "plain"]
    assert [r.kind for r in mine] == ["first compile", "recompile", "limit hit"]
    assert [r.shared_code for r in mine] == [None, None, None]
    assert "remove the causes above" in mine[-1].fix and "shared wrapper" not in mine[-1].fix
    assert "plain (" not in "".join(ln for ln in _text(report).splitlines() if "shared wrapper code object" in ln)


def test_a_failed_compile_is_no_graph_and_the_table_says_it_failed():
    # Regression: a backend that raised, called twice, showed "2 graphs" for the function while the
    # total and torch's counters["stats"]["unique_graphs"] said 0, and nothing in the table said
    # that the compiles failed.
    def bad_backend(gm, example_inputs):
        raise RuntimeError("backend boom")

    bad = torch.compile(lambda x: x.sin() + 1, backend=bad_backend)
    good = _compile(lambda x: x.cos())
    counted_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with recompiles() as report:
        for dtype in (torch.float32, torch.float64):
            with pytest.raises(Exception, match="backend boom"):
                bad(torch.randn(2, dtype=dtype))
        good(torch.ones(2))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - counted_before == report.graphs_total == 1
    assert sum(report.graphs_per_function().values()) == 1
    failed = [r for r in report.records if r.failed]
    assert len(failed) == 2 and [r.graphs for r in failed] == [0, 0]
    assert all(r.fail_type == "BackendCompilerFailed" for r in failed)
    text = _text(report)
    assert text.count("FAILED: BackendCompilerFailed") == 2 and "2 failed" in text
    assert json.loads(report.to_json())["failed_compiles"] == 2


_FLAG = True


def _reads_flag(x):
    return x * 2 if _FLAG else x * 3


def test_a_flags_fix_does_not_say_pass_it_as_a_tensor():
    # Regression: a bool flag got "keep it constant, or pass it as a tensor"; as a tensor it is
    # a data-dependent branch, which breaks the graph (3 graphs and a break instead of 2 graphs).
    global _FLAG

    def flipped():
        global _FLAG
        cf = _compile(_reads_flag)
        cf(torch.ones(2))
        _FLAG = False
        cf(torch.ones(2))

    try:
        graphs, (g,) = _graphs(flipped)
    finally:
        _FLAG = True
    assert graphs == 2 and g.category == "other" and g.tensor == "G['_FLAG']"
    assert "pass it as a tensor" not in g.fix and "Passing it as a tensor does not help" in g.fix

    def as_argument(flag_as_tensor: bool):
        cf = _compile(lambda x, flag: x * 2 if flag else x * 3)
        for flag in (True, False):
            cf(torch.ones(2), torch.tensor(flag) if flag_as_tensor else flag)

    graphs, (g,) = _graphs(lambda: as_argument(False))
    assert graphs == 2 and g.tensor == "flag" and "Passing it as a tensor does not help" in g.fix
    torch._dynamo.reset()
    with recompiles() as report:
        as_argument(True)
    assert report.graphs_total > 2 or report.graph_breaks  # why: the tensor's value is branched on


def test_a_hook_registered_after_the_first_call_gets_its_own_category_and_a_fix_that_works():
    # Regression: a hook registered after the first call, guarded with
    # skip_nnmodule_hook_guards=False, fell into "other" with "keep it constant, or pass it as a tensor".
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            return self.l(x)

    def hooked(before_first_call: bool):
        m = Outer()
        c = _compile(m)
        if before_first_call:
            m.l.register_forward_hook(lambda mod, i, o: o * 2)
        c(torch.ones(1, 4))
        if not before_first_call:
            m.l.register_forward_hook(lambda mod, i, o: o * 2)
        c(torch.ones(1, 4))

    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        graphs, (g,) = _graphs(lambda: hooked(False))
        assert graphs == 2 and g.category == "hooks" and "_forward_hooks" in g.tensor
        assert "register the hooks before the first call" in g.fix and "as a tensor" not in g.fix
        assert _graphs(lambda: hooked(True)) == (1, [])  # the fix applied


def test_an_inputs_requires_grad_fix_keeps_the_gradients():
    # Regression: layers compiled one by one in training: the first gets the model's input
    # without grad, the next an activation with it. The fix offered ".detach()", which between
    # layers silently cuts the first layer's gradient; .requires_grad_() on the input works.
    def per_layer(requires_grad: bool):
        torch.manual_seed(0)
        net = nn.Sequential(Block(4, dropout=False), Block(4, dropout=False))
        for layer in net:
            layer.compile(backend="eager")
        x = torch.ones(2, 4)
        if requires_grad:
            x.requires_grad_()
        net(x).sum().backward()
        assert net[0].proj.weight.grad is not None

    graphs, (g,) = _graphs(lambda: per_layer(False))
    assert graphs == 2 and g.category == "requires_grad" and g.tensor == "x"
    assert ".requires_grad_() on the input" in g.fix and "cuts the gradient" in g.fix
    assert _graphs(lambda: per_layer(True)) == (1, [])


def test_the_summary_counts_a_recompile_under_every_category_its_cached_graphs_failed_on():
    # Regression: the summary named only the newest cached graph's guard: a stride change after a
    # no_grad call was "grad_mode x1" ("unavoidable"), though the grad-mode graph failed on the stride.
    cf = _compile(lambda t: t * 2)
    with recompiles() as report:
        cf(torch.randn(4, 6))
        with torch.no_grad():
            cf(torch.randn(4, 6))
        cf(torch.randn(6, 4).t())
    last = report.records[-1]
    assert last.kind == "recompile" and last.categories == ["shape", "grad_mode"]
    summary = _text(report).split("per function", 1)[1]
    assert "shape or grad_mode x1" in summary and summary.count("grad_mode x1") == 2  # and the no_grad one


def _breaks(y):
    torch._dynamo.graph_break()
    return y


def _breaks_mid_expression(x):
    return torch.cat([x.sin(), _breaks(x).cos()], 0) * 2  # x.sin() is on dynamo's stack at the break


def test_a_resume_functions_shape_guard_gets_a_fix_the_user_can_apply_not_mark_dynamic_of_stack0():
    cf = _compile(_breaks_mid_expression)
    with recompiles() as report:
        for n in (8, 9):
            cf(torch.randn(3, n))
    resumed = [r for r in report.recompiles if r.function.startswith("torch_dynamo_resume_in__breaks_mid_expression")]
    assert len(resumed) == 1, [(r.function, r.kind) for r in report.records]
    (g,) = resumed[0].failed_guards
    assert g.tensor.startswith("___stack") and g.category == "shape"
    assert "mark_dynamic(___stack" not in g.fix and "dynamo's stack" in g.fix
    # the compiled function recompiled on its input x dim 1 in the same call: the fix names it
    assert "maybe_mark_dynamic(x, 1)" in g.fix and "dynamic=True" in g.fix
    # dynamic=True does not merge a dim a weight's shape fixes (helper-234: a codec's channels)
    assert "except where a weight's shape fixes that dim" in g.fix, g.fix
    # and what it says holds: maybe_mark_dynamic(x, 1) removes the compiled function's recompile, not
    # the resume function's; mark_dynamic(x, 1) raises there; dynamic=True removes both
    for mark, compile_kw in ((torch._dynamo.maybe_mark_dynamic, {}), (None, {"dynamic": True})):
        torch._dynamo.reset()
        cd = torch.compile(_breaks_mid_expression, backend="eager", **compile_kw)
        with recompiles() as fixed:
            for n in (8, 9):
                x = torch.randn(3, n)
                if mark:
                    mark(x, 1)
                cd(x)
        assert [r.function for r in fixed.recompiles] == ([resumed[0].function] if mark else [])
    torch._dynamo.reset()
    x = torch.randn(3, 8)
    torch._dynamo.mark_dynamic(x, 1)
    with pytest.raises(Exception, match="ConstraintViolation|Constraints violated"):
        _compile(_breaks_mid_expression)(x)


def _breaks_with_a_local(x):
    y = x.sin()
    torch._dynamo.graph_break()
    return x.cos() + y  # x and y are the resume function's inputs


def test_a_resume_functions_guard_on_a_passed_on_input_does_not_say_mark_dynamic_of_it():
    cf = _compile(_breaks_with_a_local)
    with recompiles() as report:
        for n in (8, 9):
            cf(torch.randn(3, n))
    (resumed,) = [r for r in report.recompiles if r.function.startswith("torch_dynamo_resume_in_")]
    (g,) = resumed.failed_guards
    assert g.tensor == "x" and "resume function" in g.fix and "torch._dynamo.mark_dynamic(x" not in g.fix
    assert "maybe_mark_dynamic(x, 1)" in g.fix


def _decorate(func):
    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):  # transformers' merge_with_config_defaults & co., in small
        return func(self, *args, **kwargs)

    return wrapper


def _decorated_models(n: int) -> list[nn.Module]:
    models = []
    for i in range(n):
        ns: dict = {}
        exec(f"def forward(self, x):\n    return self.lin(x) * {i + 1}\n", ns)
        forward = ns["forward"]
        forward.__qualname__ = f"Decorated{i}.forward"

        def init(self):
            nn.Module.__init__(self)
            self.lin = nn.Linear(4, 4)

        models.append(type(f"Decorated{i}", (nn.Module,), {"__init__": init, "forward": _decorate(forward)})())
    return models


def test_models_whose_forwards_share_a_decorators_code_are_named_and_said_to_share_one_limit():
    models = _decorated_models(3)
    with torch._dynamo.config.patch(**{limit_config(): 2}), recompiles(warn=False) as report:
        torch.compile(models[0], backend="eager")(torch.randn(2, 4))
        models[1].compile(backend="eager")  # compiling each model on its own does not separate them
        models[1](torch.randn(2, 4))
        torch.compile(models[2], backend="eager")(torch.randn(2, 4))
    assert [(r.compile_id, r.function, r.kind) for r in report.records] == [
        ("0/0", "Decorated0.forward", "first compile"),
        ("0/1", "Decorated1.forward", "recompile"),
        ("0/2", "Decorated2.forward", "limit hit"),
    ]
    wrapper_line = _decorate(len).__code__.co_firstlineno
    assert {r.shared_code for r in report.records} == {f"wrapper ({short_path(__file__)}:{wrapper_line})"}
    g = report.records[1].failed_guards[0]
    assert g.category == "id/object identity" and g.tensor.startswith("func")
    assert "ONE recompile limit" in g.fix and "reuse one object" not in g.fix
    assert "does not separate them" in report.limit_hits[0].fix
    assert "Decorated2.forward" in _text(report) and "wrapper (" in _text(report)


def test_a_decorated_plain_function_is_named_and_a_plain_closure_keeps_its_name():
    def decorate(func):
        @functools.wraps(func)
        def wrapper(*args):
            return func(*args)

        return wrapper

    @decorate
    def scaled(x):
        return x * 2

    helper = torch.sin

    def closure(x):
        return helper(x)

    with recompiles() as report:
        _compile(scaled)(torch.ones(3))
        _compile(closure)(torch.ones(3))
    assert [(r.function, r.shared_code is not None) for r in report.records] == [
        (scaled.__qualname__, True), ("closure", False)
    ]
