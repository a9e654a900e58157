"""Tests of ``paramfold.bench`` and ``paramfold bench``: structure, proxies and outputs, never timings."""

from __future__ import annotations

import gc
import io
import json
import math
import os
import stat
import statistics

import pytest
import torch
from typer.testing import CliRunner

import paramfold
from paramfold import bench
from paramfold.bench import BenchConfig, Variant, run_bench
from paramfold.cli import app
from paramfold.recompiles import limit_config

SMALL = dict(layers=4, repeats=1, backend="eager", steady_calls=2, warmup_calls=1, steady_rounds=2)


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
        (dict(layers=10**23), ["layers", "at most 10000"]),
        (dict(width=10**23), ["width", "at most 16384"]),
        (dict(batch=65_537), ["batch", "at most 65536"]),
        (dict(steady_calls=10**6), ["steady_calls", "at most 10000"]),
        (dict(warmup_calls=-1), ["warmup_calls", "at least 0"]),
        (dict(variants=("hoist", "fast")), ["'fast'", "freeze"]),
    ]:
        with pytest.raises(ValueError) as info:
            BenchConfig(**kwargs)
        assert all(w in str(info.value) for w in words), str(info.value)


def test_every_integer_setting_has_a_range_that_allows_the_documented_runs():
    # Regression: only lower bounds were checked; --layers 10**23 failed in every variant (exit 1).
    from paramfold.bench.config import LIMITS, parse_layer_counts

    for name, (low, high) in LIMITS.items():
        assert getattr(BenchConfig(**{name: high}), name) == high
        with pytest.raises(ValueError, match=f"{name} must be at most {high}, got {high + 1}$"):
            BenchConfig(**{name: high + 1})
        with pytest.raises(ValueError, match=f"{name} must be at least {low}"):
            BenchConfig(**{name: low - 1})
    assert BenchConfig(layers=512).n_layers == 512  # README: --layers 512, --sweep-layers 32,128,512
    assert parse_layer_counts("32,128,512") == (32, 128, 512) and parse_layer_counts("010") == (10,)
    for text in ("2,10001", "2," + "9" * 5000, "0"):
        with pytest.raises(ValueError, match="--sweep-layers: each layer count must be at"):
            parse_layer_counts(text)
    with pytest.raises(ValueError, match="separated by commas"):
        parse_layer_counts("2,\u00b2")  # a digit to isdigit(), not to int()


def test_a_bench_keeps_the_heap_it_started_with_out_of_its_collections_and_thaws_it_after():
    from paramfold.bench.measure import heap_frozen

    assert gc.get_freeze_count() == 0
    seen = []
    variant = Variant("probe", lambda m: (seen.append(gc.get_freeze_count()), m)[1])
    stock = [v for v in bench.default_variants() if v.name in ("baseline", "stock")]
    run_bench(BenchConfig(layers=1, repeats=1, steady_calls=1, steady_rounds=1, warmup_round=False),
              variants=[*stock, variant])
    # frozen while the probe variant was prepared (a first call and the steady phase's), thawed after
    assert len(seen) == 2 and all(n > 1000 for n in seen)
    assert gc.get_freeze_count() == 0

    def frozen(obj) -> bool:  # tracked by the GC, and in none of its collected generations
        return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())

    before = []
    with heap_frozen() as settle:
        assert frozen(before)
        made = []
        assert not frozen(made)
        settle()
        assert frozen(made)
    assert gc.get_freeze_count() == 0 and not frozen(before) and not frozen(made)

    # a caller's own frozen objects are neither thawed nor added to
    mine = []
    gc.freeze()
    try:
        with heap_frozen() as settle:
            made = []
            settle()
            assert not frozen(made)
        assert frozen(mine)
    finally:
        gc.unfreeze()


def test_run_bench_eval_structure_proxies_and_outputs():
    config = BenchConfig(**SMALL)
    result = run_bench(config)
    assert [v.name for v in result.variants] == list(bench.VARIANT_NAMES)
    base, stock = result.variant("baseline"), result.variant("stock")
    for v in (base, stock):
        assert v.status == "ok" and len(v.samples) == config.repeats
        assert v.first_call_min > 0 and v.steady_call_min > 0
        assert v.proxies_stable
        assert v.max_abs_diff == 0.0
        assert (v.proxies.graphs, v.proxies.graph_breaks, v.proxies.recompiles) == (1, 0, 0)
    # The baseline graph holds one linear per layer; stock also traces both casts of every layer.
    assert base.proxies.captured_calls == config.n_layers
    assert stock.proxies.captured_calls == 3 * config.n_layers
    for name in ("min", "median", "cpu", "steady_min", "steady_median", "steady_paired"):
        assert result.ratio("baseline", name) == 1.0
    assert result.ratio("stock", "median") == pytest.approx(
        stock.first_call_median / base.first_call_median
    )
    for mode in bench.VARIANT_NAMES:
        v = result.variant(mode)
        assert v.status == "ok" and len(v.samples) == config.repeats, v.note
        # the steady phase: one time per interleaved round, nothing compiled while timing, and
        # its own model's first output equal to stock's
        assert len(v.steady_rounds_s) == config.steady_rounds and min(v.steady_rounds_s) > 0
        assert v.steady_call_min == min(v.steady_rounds_s) and v.steady_compiles == 0
        assert v.steady_max_abs_diff == 0.0
        assert result.ratio(mode, "steady_median") == pytest.approx(
            statistics.median(v.steady_rounds_s) / statistics.median(base.steady_rounds_s))
        assert result.ratio(mode, "steady_min") == pytest.approx(
            min(v.steady_rounds_s) / min(base.steady_rounds_s))
        assert result.ratio(mode, "steady_paired") == pytest.approx(
            statistics.median(t / b for t, b in zip(v.steady_rounds_s, base.steady_rounds_s)))
        assert all(s.steady_call_s is None and s.steady_calls_s == [] for s in v.samples)
    for mode in ("hoist", "inline", "freeze", "auto"):
        v = result.variant(mode)
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


def test_grad_phase_records_autograd_without_backward_and_skips_freeze():
    seen, models = [], []

    def hoist_probed(model):
        paramfold.prepare(model, "hoist")
        models.append(model)
        linear = model.seq[0].linear

        @torch.compiler.disable  # run at every call, on what the call runs with (not traced once)
        def probe(module, args, out):
            seen.append((torch.is_grad_enabled(), module.training, module.weight.grad_fn is not None, out.requires_grad))

        linear.register_forward_hook(probe)
        return model

    variants = [v for v in bench.default_variants() if v.name in ("baseline", "stock", "freeze")]
    variants.append(Variant("hoist", hoist_probed))
    config = BenchConfig(model="weight_norm", grad=True, **SMALL)
    assert config.phase.name == "grad" and config.trainable
    result = run_bench(config, variants=variants)
    freeze = result.variant("freeze")
    assert freeze.status == "skipped" and freeze.note == "inference only: skipped for --grad"
    assert result.steady_unit.startswith("seconds per call (forward in train mode recording autograd")
    # Every call of the hoisted model recorded autograd: grad on, train mode, a hoisted weight
    # with a history, an output that requires grad (the bench detaches it after the call).
    assert seen and set(seen) == {(True, True, True, True)}
    for v in (result.variant(n) for n in ("baseline", "stock", "hoist")):
        assert v.max_abs_diff == 0.0 and v.steady_max_abs_diff == 0.0
    assert models and all(p.requires_grad and p.grad is None for m in models for p in m.parameters())  # no backward
    with pytest.raises(ValueError, match="give one of them"):
        BenchConfig(train=True, grad=True)


def test_train_skips_freeze_and_keeps_outputs_equal():
    config = BenchConfig(model="spectral_norm", train=True, variants=("freeze", "hoist"), **SMALL)
    result = run_bench(config)
    assert [v.name for v in result.variants] == ["baseline", "stock", "hoist", "freeze"]
    freeze = result.variant("freeze")
    assert freeze.status == "skipped" and not freeze.samples and not freeze.steady_rounds_s
    assert freeze.note == "inference only: skipped for --train"
    assert result.ratio("freeze", "steady_median") is None and result.ratio("freeze", "steady_paired") is None
    assert result.steady_unit == "seconds per training step (zero_grad, forward, backward)"
    for v in (result.variant(n) for n in ("baseline", "stock", "hoist")):
        assert len(v.steady_rounds_s) == config.steady_rounds and v.steady_max_abs_diff == 0.0
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


def test_recomp_counts_recompiles_as_paramfold_recompiles_does():
    # Regression: read_proxies counted the compile refused at the recompile limit as a recompile
    # (8 against the report's 7 for ten layers at the default limit of 8).
    from paramfold.bench.measure import fresh_compile_state, read_proxies

    class Layer(torch.nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.linear = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(width, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.linear(x))

    layers = [Layer(4 + i) for i in range(4)]
    for layer in layers:
        layer.compile(backend="eager")
    with fresh_compile_state(cold_caches=False), torch._dynamo.config.patch(**{limit_config(): 2}):
        with paramfold.recompiles(warn=False) as report:
            for i, layer in enumerate(layers):
                layer(torch.ones(2, 4 + i))
        proxies = read_proxies()
    assert report.limit_hit and len(report.recompiles) == 1
    assert proxies.recompiles == len(report.recompiles) and proxies.graphs == report.graphs_total == 2
    assert proxies.recompile_limit_hits == len(report.limit_hits) == 1


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
    assert calls == ["Stack"] * 4  # warm-up, two repeats, the steady phase
    same = result.variant("same")
    assert same.status == "ok" and same.max_abs_diff == 0.0
    assert same.proxies == result.variant("stock").proxies
    # A warm-up round and 2 repeats of the 4 active variants, in rotated order, the steady
    # phase's compiles and its 2 rounds, then "done".
    labels = [label for _, _, label in progress]
    active = ("baseline", "stock", "broken", "same")
    assert [d for d, _, _ in progress] == list(range(19))
    assert all(t == 18 for _, t, _ in progress)
    assert labels[0:4] == [f"warm-up (discarded): {n}" for n in active]
    assert labels[4:8] == [f"repeat 1/2: {n}" for n in active]
    assert labels[8:12] == [f"repeat 2/2: {n}" for n in ("stock", "broken", "same", "baseline")]
    assert labels[12:16] == [f"steady: compile and warm up {n}" for n in active]
    assert labels[16:19] == ["steady: round 1/2", "steady: round 2/2", "done"]
    assert not result.variant("broken").steady_rounds_s
    assert bench.to_rich_table(result).row_count == len(variants)


def test_run_bench_requires_baseline_and_stock():
    with pytest.raises(ValueError, match="baseline"):
        run_bench(BenchConfig(**SMALL), variants=[Variant("stock", lambda m: m)])


VARIANT_KEYS = {
    "name", "description", "status", "note", "first_call_s", "first_call_cpu_s_min",
    "ratio_to_baseline", "steady_s", "steady_ratio_to_baseline", "steady_call_s_median",
    "steady_compiles", "steady_max_abs_diff_vs_stock", "prepare_s_median", "proxies",
    "proxies_stable", "max_abs_diff_vs_stock", "samples",
}


def _check_document(doc: dict, layers: int) -> None:
    """A ``paramfold.bench/2`` document: its keys, and ratios that are the times over the baseline's."""
    assert doc["schema"] == "paramfold.bench/2"
    assert set(doc) == {"schema", "config", "environment", "steady_unit", "variants"}
    assert doc["config"]["layers"] == layers and doc["config"]["steady_rounds"] == 1
    assert doc["steady_unit"] == "seconds per call (eval, no_grad)"
    base = doc["variants"][0]
    assert base["name"] == "baseline"
    for v in doc["variants"]:
        assert set(v) == VARIANT_KEYS and v["status"] == "ok", v  # eval: every variant applies
        assert len(v["samples"]) == 1 and math.isfinite(v["first_call_s"]["min"])
        assert set(v["proxies"]) == {"graphs", "graph_breaks", "recompiles", "captured_calls",
                                     "frames", "recompile_limit_hits"}
        assert set(v["steady_s"]) == {"min", "median", "rounds"} and len(v["steady_s"]["rounds"]) == 1
        assert v["steady_call_s_median"] == v["steady_s"]["median"]
        for key in ("min", "median"):
            assert v["ratio_to_baseline"][key] == pytest.approx(
                v["first_call_s"][key] / base["first_call_s"][key])
            assert v["steady_ratio_to_baseline"][key] == pytest.approx(
                v["steady_s"][key] / base["steady_s"][key])
        assert v["steady_ratio_to_baseline"]["paired"] == pytest.approx(  # one round here
            v["steady_s"]["rounds"][0] / base["steady_s"]["rounds"][0])
        assert v["ratio_to_baseline"]["cpu"] == pytest.approx(
            v["first_call_cpu_s_min"] / base["first_call_cpu_s_min"])


def test_cli_json_has_every_variant():
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "--layers", "2", "--repeats", "1", "--steady-rounds", "1", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["config"]["model"] == "seed" and doc["config"]["backend"] == "eager"
    assert [v["name"] for v in doc["variants"]] == list(bench.VARIANT_NAMES)
    _check_document(doc, layers=2)
    assert bench.BenchResult.from_dict(doc).to_dict() == doc


def test_schema_1_documents_are_still_read():
    """Before the interleaved rounds each sample had steady calls of its own (schema 1)."""
    proxies = bench.Proxies(1, 0, 0, 4, 1)
    samples = [bench.Sample(r, 0.0, 0.2, 0.2, 0.001 * (r + 1), [0.001 * (r + 1)], proxies, 0.0)
               for r in range(3)]
    old = bench.BenchResult(BenchConfig(layers=4, repeats=3),
                            {"torch": "2.5.1", "torch_threads": 1},
                            [bench.VariantResult(n, n, samples=samples) for n in ("baseline", "stock")])
    doc = json.loads(json.dumps(old.to_dict()))
    doc["schema"] = "paramfold.bench/1"
    for v in doc["variants"]:
        del v["steady_s"], v["steady_compiles"], v["steady_max_abs_diff_vs_stock"]
    again = bench.BenchResult.from_dict(doc)
    assert again.variant("stock").steady_call_median == 0.002
    assert again.variant("stock").steady_call_min == 0.001
    assert again.ratio("stock", "steady_median") == 1.0
    with pytest.raises(ValueError, match="paramfold bench --json"):
        bench.BenchResult.from_dict({**doc, "schema": "paramfold.bench/3"})


def test_steady_models_have_dynamo_caches_of_their_own():
    """Compiled side by side, each variant's code keeps only its own graphs, as in a process of its
    own: past dynamo's recompile limit stock runs uncompiled, and the variants after it do not."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from paramfold.bench import measure

    limit = getattr(torch._dynamo.config, limit_config())
    config = BenchConfig(entry="layers", **{**SMALL, "layers": limit + 2})
    x = bench.make_input(config)
    ready = {v.name: measure.compiled_for_steady(v, config, x)
             for v in bench.default_variants() if v.name in ("baseline", "stock", "hoist")}
    # one code object (equal to Layer.forward's, not the same) shared by the layers of one model
    code = {name: {id(type(layer).forward.__code__): type(layer).forward.__code__
                   for layer in c.model.seq} for name, c in ready.items()}
    assert all(len(codes) == 1 for codes in code.values())
    assert len({*code["baseline"], *code["stock"], *code["hoist"], id(bench.Layer.forward.__code__)}) == 4
    entries = {name: len(_debug_get_cache_entry_list(*c.values())) for name, c in code.items()}
    assert entries == {"baseline": 1, "stock": limit, "hoist": 1}
    seconds, compiles = measure.time_round(ready["hoist"], x, config)
    assert seconds > 0 and compiles == 0


def test_run_sweep_rows_progress_and_document():
    progress = []
    config = BenchConfig(variants=("hoist",), **{**SMALL, "steady_rounds": 1})
    sweep = bench.run_sweep(config, [2, 3], on_progress=lambda *a: progress.append(a))
    assert sweep.layers == [2, 3] and sweep.variant_names == ["baseline", "stock", "hoist"]
    assert [r.config.warmup_round for r in sweep.runs] == [True, False]
    for run, n in zip(sweep.runs, (2, 3)):
        assert run.config.n_layers == n and run.variant("baseline").proxies.captured_calls == n
        assert all(v.status == "ok" and v.steady_rounds_s for v in run.variants)
    # 3 warm-ups, 3 first calls, 3 steady compiles and 1 round at layers=2; no warm-up at 3
    assert [d for d, _, _ in progress] == list(range(18)) and {t for _, t, _ in progress} == {17}
    assert progress[0][2] == "layers=2: warm-up (discarded): baseline"
    assert progress[10][2] == "layers=3: repeat 1/1: baseline" and progress[-1][2] == "done"
    doc = json.loads(json.dumps(sweep.to_dict()))
    assert doc["schema"] == "paramfold.bench.sweep/1" and doc["layers"] == [2, 3]
    assert [r["config"]["layers"] for r in doc["runs"]] == [2, 3]
    assert bench.SweepResult.from_dict(doc).to_dict() == doc
    with pytest.raises(ValueError, match="--sweep-layers"):
        bench.SweepResult.from_dict(doc["runs"][0])
    with pytest.raises(ValueError, match="at least one layer count"):
        bench.run_sweep(config, [])
    tables = bench.to_sweep_tables(sweep)
    assert [t.row_count for t in tables] == [2, 2]
    for table in tables:
        assert [c.header.split("\n")[0] for c in table.columns] == ["layers", "baseline", "stock", "hoist"]
        assert list(table.columns[0].cells) == ["2", "3"]
    first, steady = ([list(c.cells) for c in t.columns] for t in tables)
    for i, run in enumerate(sweep.runs):
        assert first[2][i] == f"{run.ratio('stock', 'min'):.2f}x / {run.ratio('stock', 'median'):.2f}x"
        assert steady[3][i] == (f"{run.ratio('hoist', 'steady_min'):.2f}x / "
                                f"{run.ratio('hoist', 'steady_median'):.2f}x")


def test_cli_sweep_json_plot_and_table(tmp_path):
    args = ["bench", "--sweep-layers", "2,4", "--repeats", "1", "--steady-rounds", "1",
            "--model", "weight_norm", "--train", "--variant", "freeze", "--variant", "auto"]
    res = CliRunner().invoke(app, [*args, "--json", "--plot", str(tmp_path / "sweep.png")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(res.stdout)
    assert doc["schema"] == "paramfold.bench.sweep/1" and doc["layers"] == [2, 4]
    assert [[v["name"] for v in r["variants"]] for r in doc["runs"]] == [["baseline", "stock", "freeze", "auto"]] * 2
    assert all(r["variants"][2]["status"] == "skipped" for r in doc["runs"])
    # the table the command prints without --json (the same function), at 100 columns
    from rich.console import Console

    out = io.StringIO()
    bench.print_sweep(bench.SweepResult.from_dict(doc), console=Console(file=out, width=100))
    text = out.getvalue()
    assert max(map(len, text.splitlines())) <= 100 and "…" not in text
    assert "--sweep-layers 2,4: first compiled call (compile + run)" in text
    assert "--sweep-layers 2,4: steady per training step (forward + backward)" in text
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["2"], ["4"])]
    assert [r[0] for r in rows] == ["2", "4", "2", "4"]  # one row per size in each table
    assert all(len(r) == 1 + 3 * 3 for r in rows)  # baseline, stock, auto: "min / med" each
    assert "freeze: inference only: skipped for --train (layers 2, 4)" in text


def test_cli_table_and_plot(tmp_path):  # matplotlib is in the test extra
    out = tmp_path / "ratios.png"
    res = CliRunner().invoke(  # on a pipe with no COLUMNS (pytest-xdist's workers set 80): nothing wraps
        app, ["bench", "--layers", "1", "--repeats", "1", "--variant", "stock", "--plot", str(out)],
        env={"COLUMNS": None},
    )
    assert res.exit_code == 0, res.output
    assert "baseline" in res.stdout and "x baseline" in res.stdout
    assert "first compiled call (compile + run), steady per call (eval, no_grad)" in res.stdout
    assert "baseline steady: " in res.stdout and " ms per call" in res.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["ratios.png"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask  # as open(), not mkstemp's 0600


def test_plot_without_matplotlib_is_refused_before_any_work(tmp_path, monkeypatch):
    # Regression: the whole bench ran first (minutes with the defaults), then the figure failed
    # with "ImportError ... (unexpected)" and exit code 1.
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` meets where it is not installed
    ran = []
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: ran.append(a))
    res = CliRunner().invoke(app, ["bench", "--layers", "1", "--plot", str(tmp_path / "ratios.png")])
    assert res.exit_code == 2 and not ran
    assert res.stderr.strip().splitlines() == [
        "paramfold bench: error: --plot needs matplotlib: pip install 'paramfold[plot]'"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, words",
    [
        (["--model", "resnet"], "'resnet' is not one of 'seed', 'weight_norm', 'spectral_norm', 'weight_norm_hooks', 'spectral_norm_hooks', 'orthogonal'"),
        (["--variant", "fast"], "'fast' is not one of 'baseline', 'stock', 'hoist'"),
        (["--plot", "/no/such/folder/x.png"], "folder /no/such/folder does not exist"),
        (["--plot", "ratios.svg"], "unsupported output format '.svg': use .png"),
        (["--repeats", "0"], "repeats must be at least 1"),
        (["--device", "gpu0"], "unknown device 'gpu0'"),
        (["--steady-rounds", "0"], "steady_rounds must be at least 1"),
        (["--sweep-layers", "32,x"], "--sweep-layers takes layer counts separated by commas, e.g. 32,128,512; got '32,x'"),
        (["--sweep-layers", "0,4"], "--sweep-layers: each layer count must be at least 1, got 0"),
        (["--sweep-layers", "4,4"], "lists a layer count twice"),
        (["--sweep-layers", "2,4", "--layers", "8"], "--sweep-layers replaces --layers"),
        (["--grad", "--train"], "--grad is a forward without backward and --train a whole step"),
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


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_interrupted_or_failing_measurement_leaves_no_cache_folder_behind(monkeypatch, tmp_path, error):
    # Regression (helper-210): torch's fresh inductor cache keeps its temporary folder when an
    # exception passes through it, so every Ctrl-C or failing variant left one in /tmp.
    import tempfile

    from paramfold.bench.measure import fresh_compile_state

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(error):
        with fresh_compile_state(cold_caches=True):
            assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path))
            raise error()
    assert list(tmp_path.iterdir()) == []


def test_a_table_wider_than_the_terminal_is_printed_whole_not_cut():
    # Regression (helper-210): on an 80-column terminal rich cut the compact table's cells to
    # "1.0…", median ratios and op counts lost.
    from rich.console import Console

    from paramfold.bench.render import print_table

    result = run_bench(BenchConfig(layers=1, repeats=1, steady_calls=1, steady_rounds=1, variants=("baseline", "stock")))
    out = io.StringIO()
    print_table(result, console=Console(file=out, width=60, force_terminal=False, color_system=None))
    text = out.getvalue()
    assert "…" not in text
    stock = result.variant("stock")
    assert f"{stock.proxies.captured_calls}" in text and f"{result.ratio('stock', 'median'):.2f}x" in text
