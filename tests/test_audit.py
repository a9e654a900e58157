"""paramfold audit: real checkpoints from real parametrized models, in every supported format.

Each case builds a stock parametrized model, saves its state dict, audits it (JSON checked against the
model itself), folds it and loads the folded file with strict=True into the unparametrized model,
whose outputs must be bitwise equal to the stock parametrized model's (eval mode, CPU).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.utils import parametrize
from typer.testing import CliRunner

from paramfold.audit import audit_checkpoint
from paramfold.checkpoint import CheckpointError
from paramfold.cli import app
from paramfold.factory import load_factory
from paramfold.fold import fold_checkpoint

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:  # audit_models must be importable as a dotted --model MODULE too
    sys.path.insert(0, str(TESTS))
import audit_models  # noqa: E402
SRC = TESTS.parent / "src"
IN_FORMATS = ("pt", "nested", "safetensors", "sharded")
FOLDABLE = ("weight_norm", "legacy_weight_norm", "spectral_norm", "fake_sparsity")
NEEDS_MODEL = ("orthogonal", "torchao_subclass", "custom")


# -- helpers ----------------------------------------------------------------------------------------


def _stock(kind: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """The parametrized model with non-trivial state, in eval mode, and an input for it."""
    factory, _, shape = audit_models.CASES[kind]
    if kind in ("fake_sparsity", "torchao_subclass"):  # their models are built with torchao
        pytest.importorskip("torchao", reason=f"the {kind} case builds its model with torchao")
    torch.manual_seed(0)
    model = getattr(audit_models, factory)()
    x = torch.randn(shape)
    step = 0.1
    if kind == "spectral_norm":  # advance the power iteration, then step the weights past it
        model.train()
        for _ in range(2):
            model(x)
        step = 1e-3  # an optimizer step's size: the stored vectors still tell the square layer's dim
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype.is_floating_point:
                p.add_(step * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("scale"):
                b.fill_(0.75)
    return model.eval(), x


def _plain(kind: str) -> torch.nn.Module:
    torch.manual_seed(1)
    return audit_models.CASES[kind][1]().eval()


def _save(sd: dict[str, torch.Tensor], fmt: str, folder: Path) -> Path:
    sd = {k: v.detach().contiguous() for k, v in sd.items()}
    if fmt == "pt":
        torch.save(sd, folder / "model.pt")
        return folder / "model.pt"
    if fmt == "nested":
        ckpt = {"epoch": 3, "model": sd, "optimizer": {"param_groups": [{"lr": 0.1}]}}
        torch.save(ckpt, folder / "train.pth")
        return folder / "train.pth"
    if fmt == "safetensors":
        save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
        return folder / "model.safetensors"
    shard = folder / "sharded"
    shard.mkdir()
    keys = list(sd)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in halves.items():
        save_file({k: sd[k] for k in ks}, shard / name)
    weight_map = {k: name for name, ks in halves.items() for k in ks}
    (shard / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shard


def _load(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)


def _expected_sites(model: torch.nn.Module) -> dict[tuple[str, str], dict]:
    """What the audit must report, read off the live model."""
    exp = {}
    for path, mod in model.named_modules():
        if parametrize.is_parametrized(mod):
            for tensor, plist in mod.parametrizations.items():
                sd = plist.state_dict()
                info = {k: {"shape": list(v.shape), "dtype": str(v.dtype)[6:]} for k, v in sd.items()}
                exp[(path, tensor)] = {
                    "originals": {k: v for k, v in info.items() if k.startswith("original")},
                    "state": {k: v for k, v in info.items() if not k.startswith("original")},
                    "dim": getattr(plist[0], "dim", None),
                    "value": getattr(mod, tensor),
                }
        if hasattr(mod, "weight_g") and hasattr(mod, "weight_v"):  # legacy weight_norm hook
            g, v = mod.weight_g, mod.weight_v
            exp[(path, "weight")] = {
                "originals": {n: {"shape": list(t.shape), "dtype": str(t.dtype)[6:]} for n, t in (("weight_g", g), ("weight_v", v))},
                "state": {},
                "dim": next(h.dim for h in mod._forward_pre_hooks.values() if hasattr(h, "dim")),
                "value": mod.weight,
            }
    return exp


def _check_report(doc: dict, model: torch.nn.Module, kind: str) -> None:
    exp = _expected_sites(model)
    assert exp, "the stock model has no parametrization"
    got = {(s["module"], s["tensor"]): s for s in doc["sites"]}
    assert set(got) == set(exp)
    want_kind = "weight_norm" if kind == "legacy_weight_norm" else kind
    for key, e in exp.items():
        s = got[key]
        assert s["kind"] == want_kind
        assert s["originals"] == e["originals"] and s["state"] == e["state"]
        assert s["foldable"] == (kind in FOLDABLE)
        assert s["bytes"]["originals"] == sum(
            torch.Size(o["shape"]).numel() * torch.empty((), dtype=getattr(torch, o["dtype"])).element_size()
            for o in e["originals"].values()
        )
        if want_kind in ("weight_norm", "spectral_norm"):
            dim = s["params"]["dim"]
            assert dim == e["dim"] or (dim is None and e["dim"] in s["params"]["dim_candidates"])
    plain = [k for k in model.state_dict() if ".parametrizations." not in f".{k}" and not k.endswith(("_g", "_v"))]
    assert doc["plain_tensors"] == len(plain)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, also for tensor subclasses (compared through their flattened pieces)."""
    if type(a) is not type(b):
        return False
    if hasattr(a, "__tensor_flatten__"):
        (names_a, meta_a), (names_b, meta_b) = a.__tensor_flatten__(), b.__tensor_flatten__()
        return names_a == names_b and meta_a == meta_b and all(_same_tensor(getattr(a, n), getattr(b, n)) for n in names_a)
    return a.dtype == b.dtype and torch.equal(a, b)


def _check_folded(out: Path, stock: torch.nn.Module, x: torch.Tensor, kind: str) -> None:
    folded = _load(out)
    plain = _plain(kind)
    plain.load_state_dict(folded, strict=True)
    with torch.no_grad():
        want = stock(x)  # first: the legacy weight_norm hook refreshes module.weight in forward
        contiguous = True
        for (path, tensor), e in _expected_sites(stock).items():
            key = f"{path}.{tensor}" if path else tensor
            assert _same_tensor(folded[key], e["value"]), key
            contiguous &= e["value"].is_contiguous()
        if contiguous:
            assert torch.equal(plain(x), want)
        else:
            # orthogonal returns a transposed (non-contiguous) weight for wide matrices; a state dict
            # stores values, not strides, and F.linear rounds differently on the other layout. The
            # values are bitwise equal (above); outputs agree to float32 rounding.
            torch.testing.assert_close(plain(x), want, rtol=1e-6, atol=1e-6)


def _cli(*args: str):
    return CliRunner().invoke(app, ["audit", *args])


# -- every kind, every input format ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", IN_FORMATS)
@pytest.mark.parametrize("kind", FOLDABLE)
def test_audit_and_fold_from_keys_is_bitwise_equal(tmp_path, kind, fmt):
    stock, x = _stock(kind)
    src = _save(stock.state_dict(), fmt, tmp_path)

    res = _cli(str(src), "--json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["path"] == str(src if fmt != "sharded" else src / "model.safetensors.index.json")
    assert doc["format"] == {"nested": "pt", "sharded": "sharded-safetensors"}.get(fmt, fmt)
    _check_report(doc, stock, kind)
    assert doc == audit_checkpoint(src).to_dict()

    if kind == "fake_sparsity":  # the masks really zero something
        assert any(not bool(v.all()) for k, v in stock.state_dict().items() if k.endswith("mask"))
    for suffix in (".safetensors", ".pt"):
        out = tmp_path / f"folded{suffix}"
        result = fold_checkpoint(src, out)
        assert (result.via, result.sites) == ("keys", len(doc["sites"]))
        _check_folded(out, stock, x, kind)


@pytest.mark.parametrize("file_dtype, model_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                      (torch.float16, torch.float32)], ids=["fp32-bf16", "fp32-fp16", "fp16-fp32"])
@pytest.mark.parametrize("kind", FOLDABLE)
def test_fold_with_dtype_is_bitwise_the_stock_model_loaded_in_that_dtype(tmp_path, kind, file_dtype, model_dtype):
    # Regression: a checkpoint run by a model of another dtype (model.half(), bfloat16 inference, an
    # fp16 save loaded into fp32) is cast by load_state_dict, then computed in the model's dtype;
    # the keys-only fold computed in the file's dtype, up to 0.0078 away for fp32 -> bf16.
    stock, x = _stock(kind)
    src = _save({k: v.to(file_dtype) if v.is_floating_point() else v for k, v in stock.state_dict().items()},
                "pt", tmp_path)
    torch.manual_seed(1)
    model = getattr(audit_models, audit_models.CASES[kind][0])().to(model_dtype)
    model.load_state_dict(torch.load(src, weights_only=True), strict=True)
    model.eval()
    out = tmp_path / "folded.safetensors"
    name = str(model_dtype).removeprefix("torch.")
    res = _cli(str(src), "--fold-out", str(out), "--dtype", name) if kind == "weight_norm" else None
    if res is None:
        fold_checkpoint(src, out, dtype=model_dtype)
    else:
        assert res.exit_code == 0 and f"folded from the checkpoint in {name}" in res.stdout, res.stderr
    folded = _load(out)
    assert all(t.dtype == model_dtype for t in folded.values() if t.is_floating_point())
    with torch.no_grad():
        want = model(x.to(model_dtype))  # first: the legacy weight_norm hook computes module.weight in forward
        for (path, tensor), e in _expected_sites(model).items():
            key = f"{path}.{tensor}" if path else tensor
            assert _same_tensor(folded[key], e["value"]), key
        plain = _plain(kind).to(model_dtype)
        plain.load_state_dict(folded, strict=True)
        assert torch.equal(plain(x.to(model_dtype)), want)
    # --model with the same dtype writes the same checkpoint.
    fold_checkpoint(src, tmp_path / "with_model.safetensors", dtype=name,
                    model_factory=getattr(audit_models, audit_models.CASES[kind][0]))
    with_model = _load(tmp_path / "with_model.safetensors")
    assert with_model.keys() == folded.keys() and all(_same_tensor(with_model[k], folded[k]) for k in folded)


@pytest.mark.parametrize("fmt", ("pt", "safetensors"))
def test_fold_with_a_real_dtype_refuses_complex_tensors_which_model_to_would_make_real(tmp_path, fmt):
    # Regression: --dtype float16 kept a complex64 buffer complex64, where the model it claims to
    # write, model.to(float16) with the checkpoint loaded, holds its real part alone (torch warns).
    stock, _ = _stock("weight_norm")
    state = {**stock.state_dict(), "phase": torch.randn(3, dtype=torch.complex64)}
    src = _save(state, fmt, tmp_path)
    out = tmp_path / "folded.safetensors"
    with pytest.raises(CheckpointError, match=r"dtype float16: 'phase' is complex64, which model.to\(float16\) makes "
                                              r"real, dropping its imaginary part: fold without a dtype"):
        fold_checkpoint(src, out, dtype="float16")
    res = _cli(str(src), "--fold-out", str(out), "--dtype", "bfloat16")
    assert res.exit_code == 1 and res.stderr.count("\n") == 1 and "'phase' is complex64" in res.stderr
    assert not out.exists()
    fold_checkpoint(src, out)  # without a dtype: kept as it is
    assert torch.equal(_load(out)["phase"], state["phase"])


@pytest.mark.parametrize("fmt", ("pt", "safetensors"))
@pytest.mark.parametrize("kind", NEEDS_MODEL)
def test_kinds_that_need_the_model_are_refused_then_folded_with_it(tmp_path, kind, fmt):
    stock, x = _stock(kind)
    src = _save(stock.state_dict(), fmt, tmp_path)
    report = audit_checkpoint(src)
    _check_report(report.to_dict(), stock, kind)

    out = tmp_path / "folded.pt"
    res = _cli(str(src), "--fold-out", str(out))
    assert res.exit_code == 1
    assert res.stderr.count("\n") == 1 and "--model MODULE:FACTORY" in res.stderr and kind in res.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == sorted([src.name])

    factory = audit_models.CASES[kind][0]
    spec = f"audit_models:{factory}" if fmt == "pt" else f"{TESTS / 'audit_models.py'}:{factory}"
    res = _cli(str(src), "--fold-out", str(out), "--model", spec)
    assert res.exit_code == 0, res.stderr
    assert "materialised by the model" in res.stdout
    _check_folded(out, stock, x, kind)

    st_out = tmp_path / "folded.safetensors"
    if kind == "torchao_subclass":
        # Int8Tensor is a tensor subclass: only .pt can hold it.
        with pytest.raises(CheckpointError, match="tensor subclass.*write the folded checkpoint to a .pt") as refused:
            fold_checkpoint(src, st_out, model_factory=spec)
        assert not st_out.exists()
        # Exit 1, as a dtype .safetensors cannot hold: found in the folded values, after the report
        # audit --fold-out prints (exit 2 is a usage error, checked before; it was 2, helper-232).
        assert refused.value.exit_code == 1
        res = _cli(str(src), "--fold-out", str(st_out), "--model", spec)
        assert res.exit_code == 1 and res.stderr.count("\n") == 1 and "tensor subclass" in res.stderr, res.stderr
    else:
        fold_checkpoint(src, st_out, model_factory=getattr(audit_models, factory))
        _check_folded(st_out, stock, x, kind)


def test_json_keeps_brackets_inside_strings_and_puts_shapes_on_one_line(tmp_path):
    # Regression: the shape-compacting regex ran over the whole text and rewrote "run[1,2].pt" and
    # the module "blocks[0,1]" into "run[1, 2].pt" and "blocks[0, 1]", names that do not exist.
    from torch.nn.utils.parametrizations import weight_norm

    src = tmp_path / "run[1,2].pt"
    torch.save({"blocks[0,1]." + k: v for k, v in weight_norm(nn.Linear(3, 2)).state_dict().items()}, src)
    report = audit_checkpoint(src)
    text = report.to_json()
    assert json.loads(text) == report.to_dict()
    assert json.loads(text)["path"] == str(src) and json.loads(text)["sites"][0]["module"] == "blocks[0,1]"
    assert '[2, 3]' in text and json.loads(report.to_json(indent=None)) == report.to_dict()
    res = _cli(str(src), "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["path"] == str(src), res.stderr


def test_a_site_whose_fold_depends_on_the_tensors_values_is_said_so_not_promised(tmp_path):
    # Regression: "foldable from keys alone" for a square spectral_norm whose stale _u/_v then made
    # the fold refuse. foldable/foldable_without_model keep their meaning; decided_by_data is added.
    torch.manual_seed(0)
    from torch.nn.utils.parametrizations import spectral_norm

    model = nn.Sequential(spectral_norm(nn.Linear(4, 4)), spectral_norm(nn.Linear(4, 3)))
    model(torch.randn(2, 4))
    with torch.no_grad():  # weights loaded after the last training-mode forward: stale vectors
        model[0].parametrizations.weight.original.copy_(torch.randn(4, 4))
    src = tmp_path / "stale.pt"
    torch.save(model.state_dict(), src)
    doc = json.loads(_cli(str(src), "--json").stdout)
    assert [(s["module"], s["foldable"], s["decided_by_data"]) for s in doc["sites"]] == [("0", True, True), ("1", True, False)]
    assert doc["summary"]["foldable_without_model"] is True and doc["summary"]["decided_by_data"] == 1
    footer = " ".join(_cli(str(src)).stdout.split())
    assert footer.endswith("foldable from keys alone if the stored tensors settle the dim of 1 site "
                           "(fold reads them and otherwise refuses: then pass --model)"), footer
    with pytest.raises(CheckpointError, match="its stored _u/_v do not tell which"):
        fold_checkpoint(src, tmp_path / "plain.pt")


def test_table_output_names_every_site_and_summarises(tmp_path):
    stock, _ = _stock("spectral_norm")
    src = _save(stock.state_dict(), "nested", tmp_path)
    res = _cli(str(src))
    assert res.exit_code == 0
    for path in ("0", "1", "3"):
        assert f"│ {path} " in res.stdout
    assert "(under 'model')" in res.stdout and "[pt]" in res.stdout
    assert "3 parametrized sites (spectral_norm 3)" in " ".join(res.stdout.split())
    assert "foldable from keys alone" in " ".join(res.stdout.split())


def test_a_dict_of_scalar_tensors_set_aside_beside_the_model_is_named_in_the_title_and_the_json(tmp_path):
    # Regression (helper-233): {'generator': <a model whose weights are all scalars>, 'discriminator':
    # sd} was read as 'discriminator' with nothing said of 'generator', taken for metadata (metrics)
    # as dicts of scalar tensors beside a state dict are: the title and --json now name it.
    stock, _ = _stock("weight_norm")
    src = tmp_path / "two.pt"
    torch.save({"generator": {"temperature": torch.tensor(1.5)}, "discriminator": stock.state_dict()}, src)
    res = _cli(str(src))
    assert res.exit_code == 0, res.stderr
    assert " ".join(res.stdout.split()).startswith(
        f"{src} [pt] (under 'discriminator'; 'generator': scalar tensors only, taken as metadata)")
    doc = json.loads(_cli(str(src), "--json").stdout)
    assert (doc["root"], doc["beside"]) == ("discriminator", ["generator"])
    torch.save({"discriminator": stock.state_dict(), "step": torch.tensor(3)}, src)
    doc = json.loads(_cli(str(src), "--json").stdout)
    assert (doc["root"], doc["beside"]) == ("discriminator", [])


def test_fold_says_which_entry_it_read_and_what_it_set_aside_as_metadata(tmp_path):
    # helper-241: audit's title named a dict of scalar tensors set aside beside the state dict read,
    # fold said nothing of it (nor of the entry it read).
    stock, _ = _stock("weight_norm")
    src = tmp_path / "two.pt"
    torch.save({"net": stock.state_dict(), "scales": {"alpha": torch.tensor(2.0)}}, src)
    out = tmp_path / "plain.safetensors"
    summary = fold_checkpoint(src, out).summary()
    assert summary.endswith("folded from the checkpoint; read from its entry 'net' ('scales': scalar tensors only, "
                            "taken as metadata, not written)"), summary
    assert "alpha" not in load_file(out)
    # Nothing set aside: the entry read is still named (helper-243: only said with something beside it).
    torch.save({"state_dict": stock.state_dict(), "epoch": 3}, src)
    summary = fold_checkpoint(src, out).summary()
    assert summary.endswith("folded from the checkpoint; read from its entry 'state_dict'"), summary
    torch.save(stock.state_dict(), src)
    assert fold_checkpoint(src, out).summary().endswith("folded from the checkpoint"), summary


def test_table_output_without_sites_still_names_the_file_its_format_and_the_entry_read(tmp_path):
    # Regression: the header (the file of a folder that was read, its format, the entry the weights
    # were under) was the table's title, printed only with the table: a checkpoint with no
    # parametrized sites got the summary line alone, not which of its two models was read.
    src = tmp_path / "two.pt"
    torch.save({"model": {"a.weight": torch.ones(2)}, "state_dict": {"b.weight": torch.ones(3)}}, src)
    res = _cli(str(src))
    assert res.exit_code == 0, res.stderr
    assert " ".join(res.stdout.split()).startswith(f"{src} [pt] (under 'state_dict') 0 parametrized sites (none)")
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"w": torch.ones(2)}, folder / "model.safetensors")
    res = _cli(str(folder))
    assert res.exit_code == 0 and " ".join(res.stdout.split()).startswith(
        f"{folder / 'model.safetensors'} [safetensors] 0 parametrized sites"), res.stdout


# -- bad input ---------------------------------------------------------------------------------------


def _evil_pickle(path: Path, payload) -> None:
    class Evil:
        def __reduce__(self):
            return payload

    torch.save({"weight": torch.zeros(2), "evil": Evil()}, path)


def test_pickle_that_runs_code_is_refused_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    # The payloads really run code when unpickled the unsafe way.
    probe = tmp_path / "probe.pt"
    _evil_pickle(probe, (open, (str(tmp_path / "probe-ran"), "w")))
    torch.load(probe, weights_only=False)
    assert (tmp_path / "probe-ran").exists()

    system_pt, open_pt = tmp_path / "system.pt", tmp_path / "open.pt"
    _evil_pickle(system_pt, (os.system, (f"touch {marker}",)))
    _evil_pickle(open_pt, (open, (str(marker), "w")))

    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run(
        [sys.executable, "-m", "paramfold.cli", "audit", str(system_pt), "--fold-out", str(tmp_path / "o.pt")],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "refused to unpickle" in proc.stderr and "system" in proc.stderr

    res = _cli(str(open_pt))
    assert res.exit_code == 1 and "refused to unpickle" in res.stderr and "open" in res.stderr
    assert not marker.exists() and not (tmp_path / "o.pt").exists()


def _truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _bad_case(case: str, d: Path, src: dict[str, Path]) -> tuple[Path, Path | str | None, list[str]]:
    """(input, output or None, other options) of a command line that must fail."""
    out = d / "o.pt"
    if case == "missing":
        return d / "missing.pt", None, []
    if case == "unsupported":
        (d / "w.onnx").write_bytes(b"\0")
        return d / "w.onnx", None, []
    if case == "truncated_pt":
        _truncate(src["pt"], 0.6)
        return src["pt"], None, []
    if case == "truncated_st":
        _truncate(src["st"], 0.9)
        return src["st"], None, []
    if case == "out_folder_missing":
        return src["pt"], d / "no" / "o.pt", []
    if case == "out_format":  # checked before the input is even looked at
        return d / "missing.pt", d / "o.gguf", []
    if case == "out_is_input":
        return src["pt"], src["pt"], []
    if case == "out_trailing_slash":  # was written as a file named o.pt
        return src["pt"], f"{d / 'o.pt'}/", []
    if case == "model_without_out":
        return src["pt"], None, ["--model", "audit_models:custom_net"]
    if case == "model_spec":
        return src["pt"], out, ["--model", "nocolon"]
    if case == "model_import":
        return src["pt"], out, ["--model", "no_such_mod_xyz:f"]
    if case == "model_mismatch":
        return src["pt"], out, ["--model", "audit_models:custom_net"]
    if case == "needs_model":
        return src["orthogonal"], out, []
    raise AssertionError(case)


BAD_CASES = [
    ("missing", 2, "no such file"),
    ("unsupported", 2, "unsupported checkpoint format"),
    ("truncated_pt", 1, "truncated or corrupt"),
    ("truncated_st", 1, "not a valid safetensors file"),
    ("out_folder_missing", 2, "does not exist"),
    ("out_format", 2, "unsupported output format"),
    ("out_is_input", 2, "refusing to overwrite it"),
    ("out_trailing_slash", 2, "names a folder (it ends with a slash); give a file name ending in"),
    ("model_without_out", 2, "only applies together with --fold-out"),
    ("model_spec", 2, "expected MODULE:FACTORY"),
    ("model_import", 2, "cannot import"),
    ("model_mismatch", 1, "does not fit the model"),
    ("needs_model", 1, "(orthogonal) from the checkpoint alone: its value depends on the orthogonal_map"),
]


def _bad_sources(tmp_path: Path) -> dict[str, Path]:
    stock, _ = _stock("weight_norm")
    ortho = tmp_path / "ortho"
    ortho.mkdir()
    return {"pt": _save(stock.state_dict(), "pt", tmp_path), "st": _save(stock.state_dict(), "safetensors", tmp_path),
            "orthogonal": _save(_stock("orthogonal")[0].state_dict(), "pt", ortho)}


def _listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "command, case, code, message",
    [(command, *case) for command in ("audit", "fold") for case in BAD_CASES
     if not (command == "fold" and case[0] == "model_without_out")],  # fold's OUT is not optional
)
def test_bad_input_gets_one_line_and_no_output(tmp_path, command, case, code, message):
    src = _bad_sources(tmp_path)
    inp, out, extra = _bad_case(case, tmp_path, src)
    if command == "audit":
        args = ["audit", str(inp), *(["--fold-out", str(out)] if out else []), *extra]
    else:
        args = ["fold", str(inp), str(out or tmp_path / "o.pt"), *extra]
    before = _listing(tmp_path)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == code, res.output
    assert res.stderr.startswith(f"paramfold {command}: error: ") and res.stderr.count("\n") == 1, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr
    if command == "fold" or case.startswith("out_") or case == "model_without_out":
        assert res.stdout == ""  # fold prints only its summary; a bad OUT is refused before the report
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("kind", ["spectral_norm", "orthogonal"])
def test_fold_command_writes_exactly_what_audit_fold_out_writes(tmp_path, kind, suffix):
    stock, x = _stock(kind)
    src = _save(stock.state_dict(), "nested", tmp_path)
    model = [] if kind == "spectral_norm" else ["--model", f"audit_models:{audit_models.CASES[kind][0]}"]
    new, old = tmp_path / f"new{suffix}", tmp_path / f"old{suffix}"
    res = CliRunner().invoke(app, ["fold", str(src), str(new), *model])
    assert res.exit_code == 0 and res.stderr == "", res.output
    how = "folded from the checkpoint" if not model else "materialised by the model"
    assert res.stdout.startswith(f"wrote {new}: ") and res.stdout.endswith(f"{how}; read from its entry 'model'\n")
    assert res.stdout.count("\n") == 1
    assert _cli(str(src), "--fold-out", str(old), *model).exit_code == 0
    _check_folded(new, stock, x, kind)
    if model and suffix == ".pt":
        # torch.save writes the .pt of a model fold: its records carry a random serialization id and
        # the temporary file's name, so only the tensors can be compared.
        assert all(_same_tensor(a, b) for a, b in zip(_load(new).values(), _load(old).values()))
    else:
        assert new.read_bytes() == old.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([src.name, new.name, old.name])


def test_failure_mid_fold_keeps_the_previous_output(tmp_path, monkeypatch):
    stock, _ = _stock("weight_norm")
    src = _save(stock.state_dict(), "safetensors", tmp_path)
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"previous")
    import paramfold.fold as fold_mod

    real = fold_mod._fold_site
    calls = []

    def flaky(ckpt, site, *args):
        calls.append(site.key)
        if len(calls) == 2:
            raise RuntimeError("disk on fire")
        return real(ckpt, site, *args)

    monkeypatch.setattr(fold_mod, "_fold_site", flaky)
    with pytest.raises(RuntimeError, match="disk on fire"):
        fold_checkpoint(src, out)
    assert out.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "out.safetensors"]


def test_names_that_moved_out_of_audit_are_still_importable_from_it():
    import paramfold
    import paramfold.audit as audit
    import paramfold.factory
    import paramfold.fold
    import paramfold.audit_render

    for name, module in (("fold_checkpoint", paramfold.fold), ("FoldResult", paramfold.fold),
                         ("load_factory", paramfold.factory), ("print_report", paramfold.audit_render)):
        assert getattr(audit, name) is getattr(module, name), name
        assert name in audit.__all__
    assert paramfold.fold_checkpoint is paramfold.fold.fold_checkpoint
    assert paramfold.AuditReport is audit.AuditReport and paramfold.CheckpointError is paramfold.fold.CheckpointError
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        audit.nope  # noqa: B018


def test_load_factory_reports_a_factory_error_in_one_line(tmp_path):
    (tmp_path / "broken.py").write_text("def build():\n    raise ValueError('no GPU here')\n")
    stock, _ = _stock("weight_norm")
    src = _save(stock.state_dict(), "pt", tmp_path)
    with pytest.raises(CheckpointError, match="the factory raised ValueError: no GPU here"):
        fold_checkpoint(src, tmp_path / "o.pt", model_factory=f"{tmp_path / 'broken.py'}:build")
    assert load_factory("torch.nn:Identity")().__class__ is torch.nn.Identity


# -- large files ---------------------------------------------------------------------------------------

_PEAK = textwrap.dedent(
    """
    import sys
    from paramfold.audit import audit_checkpoint
    from paramfold.fold import fold_checkpoint
    action, paths = sys.argv[1], sys.argv[2:]
    for p in paths:
        if action == "audit":
            r = audit_checkpoint(p)
            assert len(r.sites) == 1 and r.plain_tensors > 0, r
        else:
            fold_checkpoint(p, p + ".folded" + (".pt" if p.endswith(".pt") else ".safetensors"))
    # VmHWM: peak RSS of this process image. (ru_maxrss would also count the parent's RSS at fork.)
    status = open("/proc/self/status").read()
    print(int(next(l.split()[1] for l in status.splitlines() if l.startswith("VmHWM:"))) * 1024)
    """
)


def _peak_rss(action: str, *paths: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK, action, *map(str, paths)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="peak RSS is read from /proc (Linux)")
def test_large_checkpoints_are_audited_and_folded_without_loading_them(tmp_path):
    # ~300 MB: 18 tensors of 16 MiB plus one weight_norm site on a 16 MiB v.
    n, rows = 18, 1024
    sd = {f"blocks.{i}.weight": torch.full((rows, 4096), float(i)) for i in range(n)}
    sd["head.parametrizations.weight.original0"] = torch.ones(rows, 1)
    sd["head.parametrizations.weight.original1"] = torch.full((rows, 4096), 2.0)
    big_st, big_pt = tmp_path / "big.safetensors", tmp_path / "big.pt"
    save_file(sd, big_st)
    torch.save(sd, big_pt)
    del sd
    tiny = tmp_path / "tiny.safetensors"
    save_file({"a.weight": torch.ones(2, 2), "h.parametrizations.weight.original0": torch.ones(2, 1),
               "h.parametrizations.weight.original1": torch.ones(2, 2)}, tiny)
    size = big_st.stat().st_size
    assert size > 290 * 2**20 and big_pt.stat().st_size > 290 * 2**20

    baseline = max(_peak_rss("audit", tiny), _peak_rss("fold", tiny))
    audit_peak = _peak_rss("audit", big_st, big_pt)
    fold_st, fold_pt = _peak_rss("fold", big_st), _peak_rss("fold", big_pt)
    print(f"file {size / 2**20:.0f} MiB; peak RSS over baseline {baseline / 2**20:.0f} MiB: audit "
          f"{(audit_peak - baseline) / 2**20:.0f} MiB, fold safetensors {(fold_st - baseline) / 2**20:.0f} MiB, "
          f"fold pt {(fold_pt - baseline) / 2**20:.0f} MiB")
    assert audit_peak - baseline < 0.05 * size
    assert fold_st - baseline < 0.4 * size and fold_pt - baseline < 0.4 * size

    folded = load_file(str(big_st) + ".folded.safetensors")
    assert torch.equal(folded["head.weight"], torch._weight_norm(torch.full((rows, 4096), 2.0), torch.ones(rows, 1), 0))
    assert torch.equal(folded["blocks.7.weight"], torch.full((rows, 4096), 7.0))
    del folded
    folded_pt = torch.load(str(big_pt) + ".folded.pt", weights_only=True, mmap=True)
    assert list(folded_pt) == [f"blocks.{i}.weight" for i in range(n)] + ["head.weight"]


_SQUARE_SPECTRAL = {
    # Layers whose weight's first two dims are equal: the shape fits matrix dim 0 and 1. Each:
    # the parametrized layer, the plain one, an input.
    "conv2d": (lambda: nn.utils.parametrizations.spectral_norm(nn.Conv2d(8, 8, 3, padding=1)),
               lambda: nn.Conv2d(8, 8, 3, padding=1), (1, 8, 5, 5)),
    "conv_transpose2d": (lambda: nn.utils.parametrizations.spectral_norm(nn.ConvTranspose2d(8, 8, 3, padding=1)),
                         lambda: nn.ConvTranspose2d(8, 8, 3, padding=1), (1, 8, 5, 5)),
    "linear_dim1": (lambda: nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8), dim=1),
                    lambda: nn.Linear(8, 8), (2, 8)),
    "hooks_conv2d": (lambda: nn.utils.spectral_norm(nn.Conv2d(8, 8, 3, padding=1)),
                     lambda: nn.Conv2d(8, 8, 3, padding=1), (1, 8, 5, 5)),
    # The legacy hook updates u last (the parametrization, v): read the other way round; and
    # few dimensions (5), where only the last step's own vectors are evidence enough (no step
    # after it: a 5x5 matrix's wrong dim agrees by chance too often to tell a stepped one).
    "hooks_conv1d_1x1": (lambda: nn.utils.spectral_norm(nn.Conv1d(5, 5, 1)), lambda: nn.Conv1d(5, 5, 1), (2, 5, 7)),
    # A GAN generator's RGB output layer: weight (64, 3, 3, 3) fits dims 1, 2 and 3, whose
    # products from the same u all agree with v far beyond chance (a permuted weight).
    "conv_transpose2d_rgb": (lambda: nn.utils.parametrizations.spectral_norm(nn.ConvTranspose2d(64, 3, 3)),
                             lambda: nn.ConvTranspose2d(64, 3, 3), (1, 64, 5, 5)),
    "conv_transpose2d_4x4": (lambda: nn.utils.parametrizations.spectral_norm(nn.ConvTranspose2d(32, 4, 4)),
                             lambda: nn.ConvTranspose2d(32, 4, 4), (1, 32, 5, 5)),
}
#: The dims each layer's weight shape fits, where not 0 and 1.
_CANDIDATES = {"conv_transpose2d_rgb": "1 or 2 or 3", "conv_transpose2d_4x4": "1 or 2 or 3"}
#: How far the weights are stepped past the last power step before saving.
_STEP = {"hooks_conv1d_1x1": 0.0}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("layer", sorted(_SQUARE_SPECTRAL))
def test_square_spectral_norm_dim_is_read_from_fresh_vectors_and_refused_from_stale(tmp_path, layer, seed):
    # Regression: the dim was the candidate whose W_mat^H u came closest to v, so vectors that are
    # not this weight's last power step (re-initialised after spectral_norm, as GAN code does)
    # folded a wrong weight with exit 0 for 6 Conv2d(8, 8, 3) of 10. And (2026-12-07) fresh vectors
    # of a ConvTranspose2d(64, 3, 3) were refused as fitting "dim 1 and 2 alike": the other dims'
    # products were taken for unrelated vectors, which from the same u and weight they are not.
    make, make_plain, shape = _SQUARE_SPECTRAL[layer]
    torch.manual_seed(seed)
    model = make()
    x = torch.randn(shape)
    model.train()
    for _ in range(3):
        model(x)  # training-mode forwards: the vectors are this weight's last power step
    with torch.no_grad():
        for p in model.parameters():
            p.add_(_STEP.get(layer, 1e-3) * torch.randn_like(p))  # about an optimizer step's size
    model.eval()
    src = tmp_path / "fresh.pt"
    torch.save(model.state_dict(), src)
    out = tmp_path / "fresh.safetensors"
    fold_checkpoint(src, out)
    plain = make_plain().eval()
    plain.load_state_dict(load_file(out), strict=True)
    with torch.no_grad():
        want = model(x)  # the hook-based norm computes its weight in this call
        assert torch.equal(plain(x), want)

    # Weights replaced after the last power step: the vectors cannot tell dim 0 from dim 1.
    weight = "weight_orig" if layer.startswith("hooks") else "parametrizations.weight.original"
    nn.init.orthogonal_(model.get_parameter(weight))
    stale = tmp_path / "stale.pt"
    torch.save(model.state_dict(), stale)
    with pytest.raises(CheckpointError, match=rf"cannot fold 'weight' \(spectral_norm\).*dim {_CANDIDATES.get(layer, '0 or 1')}.*"
                                              r"not the last power step's for this weight.*--model"):
        fold_checkpoint(stale, tmp_path / "stale.safetensors")
    res = _cli(str(stale), "--fold-out", str(tmp_path / "stale.safetensors"))
    assert res.exit_code == 1 and res.stderr.count("\n") == 1 and "--model MODULE:FACTORY" in res.stderr
    assert not (tmp_path / "stale.safetensors").exists()
    by_model = tmp_path / "by_model.safetensors"
    assert fold_checkpoint(stale, by_model, model_factory=make).via == "model"
    plain.load_state_dict(load_file(by_model), strict=True)
    with torch.no_grad():
        assert torch.equal(plain(x), model(x))


def test_a_spectral_norm_saved_before_any_forward_is_refused_saying_that_may_be_why(tmp_path):
    # helper-239: a discriminator saved as built (encodec's, BigVGAN's: square convs) was refused
    # saying its weight "changed after the last training-mode forward", where none had run.
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = nn.Sequential(torch.nn.utils.spectral_norm(nn.Conv2d(8, 8, (3, 9))))
    src = tmp_path / "built.pt"
    torch.save(model.state_dict(), src)
    with pytest.raises(CheckpointError, match=r"or none ran since the model was built \(they are then torch's "
                                              r"random start\)\); pass --model"):
        fold_checkpoint(src, tmp_path / "plain.safetensors")


@pytest.mark.parametrize("seed", [3180548566, 2271702458, 0])
def test_a_spectral_norm_weight_negated_since_its_last_power_step_is_refused_not_folded_by_another_dim(tmp_path, seed):
    # Regression (helper-220): the stored v's cosine with its own dim's product was -0.99, which
    # counted as unrelated (a cosine at or below 0), while a permuted dim's product agreed with v
    # by +0.28 through the weight's structure alone (a nearly rank-one weight): "sure" in 576
    # dimensions, that dim was folded, a weight up to 1.39 off stock's, exit 0. The sign no
    # longer counts: the fold is refused, or exact.
    torch.manual_seed(seed)
    layer = nn.ConvTranspose2d(64, 3, 3)
    with torch.no_grad():
        w = layer.weight
        w.copy_(torch.randn(w.shape[0]).reshape(-1, 1, 1, 1) * torch.randn(w.shape[1:]) + 0.01 * torch.randn_like(w))
    model = nn.utils.parametrizations.spectral_norm(layer, n_power_iterations=3)
    model.train()
    _ = model.weight  # the last power step
    with torch.no_grad():
        original = model.parametrizations.weight.original
        original.neg_()
        original.add_(0.3 * torch.randn_like(original) * original.abs().mean())  # a large step past it
    torch.save(model.state_dict(), tmp_path / "flipped.pt")
    model.eval()
    out = tmp_path / "flipped.safetensors"
    try:
        fold_checkpoint(tmp_path / "flipped.pt", out)
    except CheckpointError as e:
        assert "do not tell which" in str(e) and not out.exists()
        return
    with torch.no_grad():
        assert torch.equal(load_file(out)["weight"], model.weight)


def test_square_spectral_norm_in_bfloat16_refused_for_its_precision_says_so(tmp_path):
    # Regression: fresh bfloat16 vectors of 4 elements, the last power step's for this weight, were
    # refused (rightly: bfloat16 rounding leaves too weak evidence) saying they were not, "it changed
    # after the last training-mode forward".
    from torch.nn.utils.parametrizations import spectral_norm

    torch.manual_seed(1)
    model = spectral_norm(nn.Conv2d(4, 4, 1).bfloat16())
    x = torch.randn(2, 4, 6, 6).bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        (model(x).float() - 1).pow(2).mean().backward()
        opt.step()
    model(x)  # a training forward after the last step: _u/_v are this weight's last power step
    torch.save(model.state_dict(), tmp_path / "bf16.pt")
    with pytest.raises(CheckpointError) as e:
        fold_checkpoint(tmp_path / "bf16.pt", tmp_path / "out.pt")
    assert "do not tell which (at this precision: they agree with dim 0 up to bfloat16 rounding" in str(e.value)
    assert "changed after" not in str(e.value) and str(e.value).endswith("pass --model MODULE:FACTORY that builds "
                                                                          "the parametrized model")
    assert not (tmp_path / "out.pt").exists()


def test_sharded_checkpoint_in_the_hugging_face_cache_layout_folds(tmp_path):
    # Regression: every shard was resolved through its link before the "inside the index's
    # folder" check, so a cache snapshot (each file a link to ../../blobs/<hash>) was refused.
    stock, x = _stock("weight_norm")
    sd = {k: v.detach().contiguous() for k, v in stock.state_dict().items()}
    keys = list(sd)
    blobs, snapshot = tmp_path / "models--me--tiny" / "blobs", tmp_path / "models--me--tiny" / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    weight_map = {}
    for i, part in enumerate((keys[::2], keys[1::2])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, blobs / f"hash{i}")
        (snapshot / name).symlink_to(f"../../blobs/hash{i}")
        weight_map.update(dict.fromkeys(part, name))
    (blobs / "hashindex").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (snapshot / "model.safetensors.index.json").symlink_to("../../blobs/hashindex")

    assert audit_checkpoint(snapshot).format == "sharded-safetensors"
    out = tmp_path / "folded.safetensors"
    fold_checkpoint(snapshot, out)
    _check_folded(out, stock, x, "weight_norm")

    # A shard named outside the folder is still refused, by its name.
    for outside in ("../model-00001-of-00002.safetensors", str(snapshot / "model-00001-of-00002.safetensors")):
        (snapshot / "model.safetensors.index.json").unlink()
        (snapshot / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {k: outside if v.startswith("model-00001") else v for k, v in weight_map.items()}}))
        with pytest.raises(CheckpointError, match="lies outside the index's folder"):
            audit_checkpoint(snapshot)


def _unreadable_runner() -> list[str] | None:
    """A command prefix under which a mode-000 file cannot be read: none needed as a user; as root,
    setpriv without the capabilities that bypass file permissions. None where neither is possible."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    prefix = [setpriv, "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", "--"]
    return prefix if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0 else None


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_an_unreadable_checkpoint_says_permission_denied_as_a_checkpoint_error(tmp_path, suffix):
    # Regression: an unreadable .safetensors was "not a valid safetensors file (No such file or
    # directory)", and the API raised a bare PermissionError for an unreadable .pt.
    prefix = _unreadable_runner()
    if prefix is None:
        pytest.skip("cannot make a file unreadable here (root without setpriv)")
    stock, _ = _stock("weight_norm")
    src = _save(stock.state_dict(), suffix.lstrip("."), tmp_path)
    src.chmod(0)
    tmp_path.chmod(0o755)
    api = ("import sys, paramfold\n"
           "try:\n    paramfold.audit_checkpoint(sys.argv[1])\n"
           "except paramfold.CheckpointError as e:\n    print('CheckpointError:', e)\n")
    done = subprocess.run([*prefix, sys.executable, "-c", api, str(src)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"CheckpointError: {src}: Permission denied", done.stderr
    cli = subprocess.run([*prefix, sys.executable, "-m", "paramfold", "audit", str(src)], capture_output=True, text=True)
    assert cli.returncode == 1 and cli.stderr.count("\n") == 1 and f"{src}: Permission denied" in cli.stderr, cli.stderr


def test_a_folder_that_cannot_be_listed_is_said_so_not_a_file_in_it(tmp_path):
    # Regression: `audit locked/` said "locked/model.safetensors: Permission denied", a file that
    # does not exist (the first name looked for in the folder).
    prefix = _unreadable_runner()
    if prefix is None:
        pytest.skip("cannot make a folder unreadable here (root without setpriv)")
    locked = tmp_path / "locked"
    locked.mkdir()
    torch.save({"w": torch.ones(2)}, locked / "in.pt")
    locked.chmod(0)
    try:
        cli = subprocess.run([*prefix, sys.executable, "-m", "paramfold", "audit", str(locked)],
                             capture_output=True, text=True)
    finally:
        locked.chmod(0o755)
    assert (cli.returncode, cli.stdout) == (1, "")
    assert cli.stderr == f"paramfold audit: error: {locked}: cannot list this folder: Permission denied\n"


@pytest.mark.parametrize("name", ["in.safetensors", "IN.SAFETENSORS"])
@pytest.mark.parametrize("with_model", [False, True], ids=["from keys", "with the model"])
def test_fold_keeps_a_safetensors_inputs_metadata(tmp_path, with_model, name):
    # Regression: the folded file's header had {"format": "pt"} only, whatever the input said;
    # then, for an input read as safetensors whose name is upper case (fold checked the suffix
    # case-sensitively, open_checkpoint does not).
    from safetensors import safe_open

    stock, _ = _stock("weight_norm")
    src = tmp_path / name
    note = {"format": "pt", "run": "ema-42", "step": "1000"}
    save_file({k: v.contiguous() for k, v in stock.state_dict().items()}, str(src), metadata=note)
    out = tmp_path / "folded.safetensors"
    factory = getattr(audit_models, audit_models.CASES["weight_norm"][0]) if with_model else None
    fold_checkpoint(src, out, model_factory=factory)
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == note
    bare = tmp_path / "bare.safetensors"  # no metadata in: transformers' {"format": "pt"} out
    save_file({k: v.contiguous() for k, v in stock.state_dict().items()}, str(bare))
    fold_checkpoint(bare, out, model_factory=factory)
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def _hook_and_parametrized_norms() -> nn.Module:
    torch.manual_seed(0)
    with pytest.warns(FutureWarning):  # torch deprecates the hook-based weight_norm
        hooked = torch.nn.utils.weight_norm(nn.Conv1d(4, 6, 3))
    return nn.Sequential(hooked, torch.nn.utils.spectral_norm(nn.Conv1d(6, 4, 3)),
                         torch.nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 2, 1)))


def test_fold_with_the_model_counts_hook_based_norms_as_sites(tmp_path):
    # Regression: --model counted only parametrizations: "0 parametrized sites materialised by the
    # model" for torch's hook-based weight_norm/spectral_norm, which the keys-only fold counts.
    model = _hook_and_parametrized_norms()
    model(torch.randn(2, 4, 9))
    torch.save(model.state_dict(), tmp_path / "hooks.pt")
    by_keys = fold_checkpoint(tmp_path / "hooks.pt", tmp_path / "keys.safetensors")
    by_model = fold_checkpoint(tmp_path / "hooks.pt", tmp_path / "model.safetensors", _hook_and_parametrized_norms)
    assert (by_keys.sites, by_model.sites) == (3, 3)
    assert by_model.summary().endswith("3 parametrized sites materialised by the model")
    keys, model_out = load_file(tmp_path / "keys.safetensors"), load_file(tmp_path / "model.safetensors")
    assert keys.keys() == model_out.keys() and all(torch.equal(keys[k], model_out[k]) for k in keys)
