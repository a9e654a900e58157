"""Tests of ``paramfold.bench`` and ``paramfold bench``: structure, proxies and outputs, never timings."""

from __future__ import annotations

import json
import math
import os
import stat

import pytest
import torch
from typer.testing import CliRunner

import paramfold
from paramfold import bench
from paramfold.bench import BenchConfig, Variant, run_bench
from paramfold.cli import app
from paramfold.recompiles import limit_config

SMALL = dict(layers=4, repeats=1, backend="eager", steady_calls=2, warmup_calls=1)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _n_parametrized(model: torch.nn.Module) -> int:
    """Parametrized tensors, torch's hook-based norms included."""
    return len(paramfold.find(model))


@pytest.mark.parametrize("model", list(bench.MODELS))
@pytest.mark.parametrize("train", [False, True])
def test_baseline_is_the_stock_model_without_parametrizations(model, train):
    config = BenchConfig(model=model, layers=3, train=train)
    stock = bench.build_model(config)
    assert _n_parametrized(stock) == (6 if model == "seed" else 3)
    plain = bench.unparametrize(bench.build_model(config))
    assert _n_parametrized(plain) == 0
    assert type(plain.seq[0].linear) is torch.nn.Linear
    assert set(plain.state_dict()) == {
        f"seq.{i}.linear.{n}" for i in range(3) for n in ("weight", "bias")
    }
    for p in plain.parameters():
        assert p.requires_grad == train
        assert p.dtype == config.spec.dtype
    x = bench.make_input(config)
    # Same values, same dtype: the first forward of a fresh stock model is bitwise the baseline's.
    with torch.no_grad():
        assert torch.equal(plain(x), stock(x))


def test_seed_model_matches_seed_003():
    model = bench.build_model(BenchConfig())
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 32
    assert all(m.in_features == m.out_features == 128 for m in linears)
    for m in linears:
        for name in ("weight", "bias"):
            (p,) = m.parametrizations[name]
            assert isinstance(p, bench.CastToBFloat16)
            assert m.parametrizations[name].original.dtype == torch.float32
            assert getattr(m, name).dtype == torch.bfloat16
    assert bench.make_input(BenchConfig()).dtype == torch.bfloat16


def test_config_validation_names_the_choices():
    for kwargs, words in [
        (dict(model="resnet"), ["'resnet'", "seed", "orthogonal"]),
        (dict(backend="tvm"), ["'tvm'", "inductor"]),
        (dict(entry="x"), ["'x'", "layers"]),
        (dict(layers=0), ["layers", "at least 1"]),
        (dict(repeats=0), ["repeats"]),
        (dict(variants=("hoist", "fast")), ["'fast'", "freeze"]),
    ]:
        with pytest.raises(ValueError) as info:
            BenchConfig(**kwargs)
        assert all(w in str(info.value) for w in words), str(info.value)


def test_run_bench_eval_structure_proxies_and_outputs():
    config = BenchConfig(**SMALL)
    result = run_bench(config)
    assert [v.name for v in result.variants] == list(bench.VARIANT_NAMES)
    base, stock = result.variant("baseline"), result.variant("stock")
    for v in (base, stock):
        assert v.status == "ok" and len(v.samples) == config.repeats
        assert v.first_call_min > 0 and v.steady_call_median > 0
        assert len(v.samples[0].steady_calls_s) == config.steady_calls
        assert v.proxies_stable
        assert v.max_abs_diff == 0.0
        assert (v.proxies.graphs, v.proxies.graph_breaks, v.proxies.recompiles) == (1, 0, 0)
    # The baseline graph holds one linear per layer; stock also traces both casts of every layer.
    assert base.proxies.captured_calls == config.n_layers
    assert stock.proxies.captured_calls == 3 * config.n_layers
    assert result.ratio("baseline") == 1.0
    assert result.ratio("stock", "median") == pytest.approx(
        stock.first_call_median / base.first_call_median
    )
    for mode in ("hoist", "inline", "freeze", "auto"):
        v = result.variant(mode)
        assert v.status == "ok" and len(v.samples) == config.repeats, v.note
        assert v.max_abs_diff == 0.0  # backend=eager runs the same kernels as stock
        # Issue 2, requirement 6: as many graphs and breaks as the unparametrized model.
        assert v.proxies.graphs == base.proxies.graphs
        assert v.proxies.graph_breaks == base.proxies.graph_breaks
        if mode != "inline":  # compiled code reads plain tensors: the baseline's ops
            assert v.proxies.captured_calls == base.proxies.captured_calls
    doc = json.loads(json.dumps(result.to_dict()))
    assert [v["name"] for v in doc["variants"]] == list(bench.VARIANT_NAMES)
    assert doc["config"]["layers"] == 4 and doc["config"]["width"] == 128
    again = bench.BenchResult.from_dict(doc)
    assert again.to_dict() == doc
    with pytest.raises(ValueError, match="paramfold bench --json"):
        bench.BenchResult.from_dict({"schema": "something else"})


def test_train_skips_freeze_and_keeps_outputs_equal():
    config = BenchConfig(model="spectral_norm", train=True, variants=("freeze", "hoist"), **SMALL)
    result = run_bench(config)
    assert [v.name for v in result.variants] == ["baseline", "stock", "hoist", "freeze"]
    freeze = result.variant("freeze")
    assert freeze.status == "skipped" and not freeze.samples
    assert freeze.note == "inference only: skipped for --train"
    base, stock = result.variant("baseline"), result.variant("stock")
    # The baseline holds the weights after one power iteration, i.e. what stock's first step uses.
    assert base.max_abs_diff == 0.0 and stock.max_abs_diff == 0.0
    assert base.proxies.graph_breaks == stock.proxies.graph_breaks == 0
    assert stock.proxies.captured_calls > base.proxies.captured_calls
    hoist = result.variant("hoist")
    # The power iteration runs outside the graph, exactly as stock runs it.
    assert hoist.status == "ok" and len(hoist.samples) == config.repeats
    assert hoist.max_abs_diff == 0.0
    assert hoist.proxies.captured_calls == base.proxies.captured_calls


def test_layers_entry_compiles_every_layer():
    threads = torch.get_num_threads()
    config = BenchConfig(entry="layers", variants=(), threads=1, **SMALL)
    result = run_bench(config)
    assert result.environment["torch_threads"] == 1 and torch.get_num_threads() == threads
    base, stock = result.variant("baseline"), result.variant("stock")
    # All layers share Layer.forward and, with parameters as graph inputs, one graph.
    assert base.proxies.frames >= 1 and base.proxies.graphs == 1
    assert base.proxies.captured_calls == 1
    # Each parametrized Linear has its own class, so stock recompiles per layer.
    assert stock.proxies.recompiles == config.n_layers - 1
    assert base.proxies.recompile_limit_hits == stock.proxies.recompile_limit_hits == 0
    assert base.max_abs_diff == stock.max_abs_diff == 0.0


def test_recompile_limit_is_reported():
    limit = getattr(torch._dynamo.config, limit_config())  # cache_size_limit before torch 2.7
    config = BenchConfig(entry="layers", variants=(), **{**SMALL, "layers": limit + 2})
    result = run_bench(config)
    stock = result.variant("stock")
    assert stock.proxies.recompile_limit_hits == 1
    assert stock.proxies.graphs == limit
    assert result.variant("baseline").proxies.recompile_limit_hits == 0
    table = bench.to_rich_table(result)
    notes = list(table.columns[-1].cells)
    assert "recompile_limit" in notes[1] and "recompile_limit" not in notes[0]


def test_method_entry_and_custom_variants():
    calls = []

    def broken(model):
        raise RuntimeError("this preparer is broken\nsecond line")

    def stock_again(model):
        calls.append(type(model).__name__)
        return model

    variants = [
        Variant("baseline", bench.unparametrize),
        Variant("stock", lambda m: m),
        Variant("broken", broken),
        Variant("same", stock_again),
        Variant("eval-only", stock_again, eval_only=True),
        Variant("missing", stock_again, unavailable="not installed"),
    ]
    progress = []
    config = BenchConfig(model="weight_norm", entry="method", train=True, **{**SMALL, "repeats": 2})
    result = run_bench(config, variants=variants, on_progress=lambda *a: progress.append(a))
    status = {v.name: (v.status, v.note) for v in result.variants}
    assert status["broken"] == ("error", "RuntimeError: this preparer is broken\nsecond line")
    assert status["eval-only"][0] == status["missing"][0] == "skipped"
    assert status["missing"][1] == "not installed"
    assert calls == ["Stack"] * 3  # warm-up and two repeats
    same = result.variant("same")
    assert same.status == "ok" and same.max_abs_diff == 0.0
    assert same.proxies == result.variant("stock").proxies
    # A warm-up round and 2 repeats of the 4 active variants, in rotated order, then "done".
    labels = [label for _, _, label in progress]
    active = ("baseline", "stock", "broken", "same")
    assert [d for d, _, _ in progress] == list(range(13))
    assert all(t == 12 for _, t, _ in progress)
    assert labels[0:4] == [f"warm-up (discarded): {n}" for n in active]
    assert labels[4:8] == [f"repeat 1/2: {n}" for n in active]
    assert labels[8:12] == [f"repeat 2/2: {n}" for n in ("stock", "broken", "same", "baseline")]
    assert labels[12] == "done"
    assert bench.to_rich_table(result).row_count == len(variants)


def test_run_bench_requires_baseline_and_stock():
    with pytest.raises(ValueError, match="baseline"):
        run_bench(BenchConfig(**SMALL), variants=[Variant("stock", lambda m: m)])


def test_cli_json_has_every_variant():
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "--layers", "2", "--repeats", "1", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["schema"] == "paramfold.bench/1"
    assert doc["config"]["model"] == "seed" and doc["config"]["backend"] == "eager"
    names = [v["name"] for v in doc["variants"]]
    assert names == list(bench.VARIANT_NAMES)
    for v in doc["variants"]:  # eval: every variant applies
        assert v["status"] == "ok", v
        assert len(v["samples"]) == 1
        assert math.isfinite(v["first_call_s"]["min"])
        assert set(v["proxies"]) == {"graphs", "graph_breaks", "recompiles", "captured_calls",
                                     "frames", "recompile_limit_hits"}


def test_cli_table_and_plot(tmp_path):  # matplotlib is in the test extra
    out = tmp_path / "ratios.png"
    res = CliRunner().invoke(
        app, ["bench", "--layers", "1", "--repeats", "1", "--variant", "stock", "--plot", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "baseline" in res.stdout and "x baseline" in res.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["ratios.png"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask  # as open(), not mkstemp's 0600


@pytest.mark.parametrize(
    "args, words",
    [
        (["--model", "resnet"], "'resnet' is not one of 'seed', 'weight_norm', 'spectral_norm', 'weight_norm_hooks', 'spectral_norm_hooks', 'orthogonal'"),
        (["--variant", "fast"], "'fast' is not one of 'baseline', 'stock', 'hoist'"),
        (["--plot", "/no/such/folder/x.png"], "folder /no/such/folder does not exist"),
        (["--plot", "ratios.svg"], "unsupported output format '.svg': use .png"),
        (["--repeats", "0"], "repeats must be at least 1"),
        (["--device", "gpu0"], "unknown device 'gpu0'"),
        pytest.param(["--device", "cuda"], "device 'cuda' is not available here",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
    ],
)
def test_cli_bad_input_is_one_line(args, words):
    res = CliRunner().invoke(app, ["bench", *args])
    assert res.exit_code == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paramfold bench: error: ") and words in lines[0]


def test_deprecated_names_still_answer(monkeypatch):
    import importlib
    import sys

    from paramfold.bench.plot import plot_ratios

    with pytest.warns(DeprecationWarning, match="use paramfold.bench.ZooModel"):
        assert bench.ModelSpec is bench.ZooModel
    monkeypatch.delitem(sys.modules, "paramfold.plot", raising=False)
    with pytest.warns(DeprecationWarning, match="from paramfold.bench.plot"):
        assert importlib.import_module("paramfold.plot").plot_ratios is plot_ratios
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        bench.nope
