"""paramfold.checkpoint: lazy safe reading and atomic streaming writing, checked against torch/safetensors."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from paramfold.checkpoint import CheckpointError, TensorInfo, open_checkpoint, write_checkpoint, write_state_dict


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(4, 2, generator=g).to(torch.bfloat16),
        "f16": torch.randn(7, generator=g).to(torch.float16),
        "i64": torch.arange(6).view(2, 3),
        "i8": torch.randint(-128, 127, (5, 4), dtype=torch.int8, generator=g),
        "bool": torch.rand(3, 3, generator=g) > 0.5,
        "f8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "transposed": torch.randn(4, 6, generator=g).t(),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_write_then_read_back_with_torch_safetensors_and_paramfold(tmp_path, suffix):
    sd = _tensors()
    out = tmp_path / f"all{suffix}"
    nbytes = write_state_dict(out, sd)
    assert nbytes == sum(t.numel() * t.element_size() for t in sd.values())
    if suffix == ".pt":
        for kwargs in ({}, {"mmap": True}):
            loaded = torch.load(out, weights_only=True, **kwargs)
            assert list(loaded) == list(sd) and all(_same(loaded[k], sd[k]) for k in sd)
    else:
        loaded = load_file(out)
        assert set(loaded) == set(sd) and all(_same(loaded[k], sd[k]) for k in sd)
    with open_checkpoint(out) as ckpt:
        assert ckpt.keys() == list(sd)
        for k, t in sd.items():
            assert ckpt.info(k) == TensorInfo.of(t)
            assert _same(ckpt.read(k), t)
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_reads_views_and_shared_storages_saved_by_torch(tmp_path):
    base = torch.randn(10, 10)
    sd = {"rows": base[2:5], "col": base[:, 3], "t": base.t(), "full": base, "elem": base[4, 4]}
    torch.save(sd, tmp_path / "views.pt")
    with open_checkpoint(tmp_path / "views.pt") as ckpt:
        for k, t in sd.items():
            got = ckpt.read(k)
            assert torch.equal(got, t) and got.is_contiguous()
            assert got.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_nested_training_checkpoint_and_sharded_folder(tmp_path):
    sd = {"a.weight": torch.randn(3, 4), "a.bias": torch.randn(3), "b.weight": torch.randn(2, 3)}
    torch.save({"epoch": 7, "model": sd, "optimizer": {"param_groups": [{"lr": 0.1}]}}, tmp_path / "train.pth")
    with open_checkpoint(tmp_path / "train.pth") as ckpt:
        assert (ckpt.format, ckpt.root) == ("pt", "model")
        assert all(torch.equal(ckpt.read(k), sd[k]) for k in sd)

    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"a.weight": sd["a.weight"]}, folder / "model-00001-of-00002.safetensors")
    save_file({"a.bias": sd["a.bias"], "b.weight": sd["b.weight"]}, folder / "model-00002-of-00002.safetensors")
    weight_map = {"a.weight": "model-00001-of-00002.safetensors"} | {
        k: "model-00002-of-00002.safetensors" for k in ("a.bias", "b.weight")
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for path in (folder, folder / "model.safetensors.index.json"):
        with open_checkpoint(path) as ckpt:
            assert ckpt.format == "sharded-safetensors" and ckpt.keys() == list(weight_map)
            assert all(torch.equal(ckpt.read(k), sd[k]) for k in sd)

    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard 'model-00002-of-00002.safetensors' named by the index is missing"):
        open_checkpoint(folder)
    # Regression: a symlink loop was called missing, "no such file or folder".
    (folder / "model-00002-of-00002.safetensors").symlink_to("model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=r"named by the index is missing \(a symlink loop\)"):
        open_checkpoint(folder)
    (tmp_path / "loop.pt").symlink_to("loop.pt")
    with pytest.raises(CheckpointError, match=r"loop\.pt: a symlink loop \(too many levels of symbolic links\)") as e:
        open_checkpoint(tmp_path / "loop.pt")
    assert e.value.exit_code == 2


def test_an_index_over_shards_of_both_kinds_is_sharded_mixed(tmp_path):
    # README lists the format values; this one was missing there.
    a, b = torch.randn(3), torch.randn(2)
    save_file({"a": a}, tmp_path / "one.safetensors")
    torch.save({"b": b}, tmp_path / "two.bin")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"a": "one.safetensors", "b": "two.bin"}}))
    with open_checkpoint(index) as ckpt:
        assert ckpt.format == "sharded-mixed"
        assert torch.equal(ckpt.read("a"), a) and torch.equal(ckpt.read("b"), b)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_read_into_a_buffer_it_cannot_use_is_a_clear_value_error(tmp_path, suffix):
    # Regression: a misaligned buffer raised torch's "storage_offset() must be divisible by 4",
    # a strided one a TypeError from readinto, and a 2-D one made .pt's CRC-32 check call the file corrupt.
    w = torch.randn(4, 4)
    path = tmp_path / f"w{suffix}"
    save_file({"w": w}, path) if suffix == ".safetensors" else torch.save({"w": w}, path)
    byte = torch.uint8
    bad = {
        "starts at byte 1 of its storage, not a multiple of 4": torch.empty(101, dtype=byte)[1:],
        "must be contiguous": torch.empty(200, dtype=byte)[::2],
        "not a 2-D torch.uint8 tensor": torch.empty(100, dtype=byte).view(10, 10),
        "not a 1-D torch.float32 tensor": torch.empty(100),
    }
    with open_checkpoint(path) as ckpt:
        for words, out in bad.items():
            with pytest.raises(ValueError, match=words):
                ckpt.read("w", out=out)
        for out in (torch.empty(100, dtype=byte), torch.empty(108, dtype=byte)[8:]):  # used
            got = ckpt.read("w", out=out)
            assert torch.equal(got, w) and got.data_ptr() == out.data_ptr()
        assert torch.equal(ckpt.read("w", out=torch.empty(10, dtype=byte)), w)  # too small: not used


def test_a_tensor_a_shard_holds_but_the_index_omits_is_read_as_loaders_read_it(tmp_path):
    # Regression: it was dropped from the audit and the fold without a word, where transformers'
    # from_pretrained (and load_sharded_checkpoint) load every tensor of every shard.
    sd = {"a.weight": torch.randn(3, 4), "a.bias": torch.randn(3), "b.weight": torch.randn(2, 3)}
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"a.weight": sd["a.weight"], "a.bias": sd["a.bias"]}, folder / "s1.safetensors")
    save_file({"b.weight": sd["b.weight"]}, folder / "s2.safetensors")
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a.weight": "s1.safetensors", "b.weight": "s2.safetensors"}}))
    with open_checkpoint(folder) as ckpt:
        assert ckpt.keys() == ["a.weight", "b.weight", "a.bias"]
        assert all(torch.equal(ckpt.read(k), sd[k]) for k in sd)

    save_file({"b.weight": sd["b.weight"], "a.bias": sd["a.bias"]}, folder / "s2.safetensors")
    with pytest.raises(CheckpointError, match="'a.bias', which the index does not list, is in two shards, "
                       "'s1.safetensors' and 's2.safetensors'") as info:
        open_checkpoint(folder)
    assert info.value.exit_code == 1


def _hf_file(folder, name: str, value: float) -> None:
    """``name`` in ``folder`` holding ``w`` filled with ``value``: a single file, or an index and its shard."""
    w = {"w": torch.full((2,), value)}
    if name.endswith(".index.json"):
        shard = name.replace(".index.json", "").replace(".", "-00001-of-00001.", 1)
        (save_file(w, folder / shard) if shard.endswith(".safetensors") else torch.save(w, folder / shard))
        (folder / name).write_text(json.dumps({"weight_map": {"w": shard}}))
    else:
        save_file(w, folder / name) if name.endswith(".safetensors") else torch.save(w, folder / name)


@pytest.mark.parametrize(
    "present, read",
    [
        # transformers' from_pretrained on a folder (modeling_utils._get_resolved_checkpoint_files):
        # model.safetensors, its index, pytorch_model.bin, its index: the first present, whatever else
        # the folder holds. save_pretrained leaves the index of a sharded save beside a later
        # unsharded one, and model.safetensors beside a later sharded save.
        (["model.safetensors", "model.safetensors.index.json"], "model.safetensors"),
        (["model.safetensors.index.json", "pytorch_model.bin"], "model.safetensors.index.json"),
        (["pytorch_model.bin", "pytorch_model.bin.index.json"], "pytorch_model.bin"),
        (["pytorch_model.bin.index.json", "other.safetensors"], "pytorch_model.bin.index.json"),
        (["pytorch_model.bin", "other.safetensors"], "pytorch_model.bin"),
        (["model.safetensors", "model.fp16.safetensors"], "model.safetensors"),
        (["model.safetensors.index.json", "model.fp16.safetensors.index.json"], "model.safetensors.index.json"),
    ],
)
def test_a_folder_is_read_in_transformers_order(tmp_path, present, read):
    # Regression: any *.safetensors.index.json came first, then any single file: a folder holding
    # model.safetensors and an index folded the shards, another checkpoint than transformers loads.
    for i, name in enumerate(present):
        _hf_file(tmp_path, name, float(i))
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.path.name == read
        assert torch.equal(ckpt.read("w"), torch.full((2,), float(present.index(read))))


def test_a_stale_index_beside_model_safetensors_is_not_read(tmp_path):
    # save_pretrained sharded, then unsharded: it deletes the shards, keeps the index.
    _hf_file(tmp_path, "model.safetensors.index.json", 0.0)
    (tmp_path / "model-00001-of-00001.safetensors").unlink()
    _hf_file(tmp_path, "model.safetensors", 1.0)
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.path.name == "model.safetensors" and torch.equal(ckpt.read("w"), torch.ones(2))


def test_a_folder_config_naming_its_weights_file_is_read_as_transformers_reads_it(tmp_path):
    # config.json's transformers_weights names the file from_pretrained loads, before any other.
    _hf_file(tmp_path, "model.safetensors", 0.0)
    _hf_file(tmp_path, "quant.safetensors", 1.0)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", "transformers_weights": "quant.safetensors"}))
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.path.name == "quant.safetensors" and torch.equal(ckpt.read("w"), torch.ones(2))
    for named, match in [("gone.safetensors", "names 'gone.safetensors', which is missing"),
                         ("../model.safetensors", "not a file name inside the folder")]:
        (tmp_path / "config.json").write_text(json.dumps({"transformers_weights": named}))
        with pytest.raises(CheckpointError, match=match):
            open_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))  # no such entry: the usual order
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.path.name == "model.safetensors"


@pytest.mark.parametrize(
    "make, match, code",
    [
        (lambda p: None, "no such file", 2),
        (lambda p: p.with_suffix(".onnx").write_bytes(b"x"), "unsupported checkpoint format", 2),
        (lambda p: p.with_suffix(".pt").write_bytes(b"PK\x03\x04" + b"\0" * 64), "truncated or corrupt", 1),
        (lambda p: p.with_suffix(".pt").write_bytes(b"not a zip, not a pickle"), "not a plain weights-only pickle", 1),
        (lambda p: p.with_suffix(".safetensors").write_bytes(b"\xff" * 16), "not a valid safetensors file", 1),
    ],
)
def test_bad_inputs_raise_one_line_errors(tmp_path, make, match, code):
    p = tmp_path / "bad"
    make(p)
    target = next(iter(tmp_path.iterdir()), p)
    with pytest.raises(CheckpointError, match=match) as info:
        open_checkpoint(target)
    assert info.value.exit_code == code and "\n" not in str(info.value)


def test_failed_write_leaves_nothing_and_keeps_the_old_file(tmp_path):
    out = tmp_path / "out.safetensors"
    write_state_dict(out, {"old": torch.ones(2)})
    before = out.read_bytes()

    def produce():
        yield "a", torch.zeros(3)
        raise RuntimeError("boom")

    specs = {"a": TensorInfo((3,), torch.float32), "b": TensorInfo((3,), torch.float32)}
    for target in (out, tmp_path / "new.pt"):
        with pytest.raises(RuntimeError, match="boom"):
            write_checkpoint(target, specs, produce())
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors"]


def test_output_in_missing_folder_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist") as info:
        write_state_dict(tmp_path / "nope" / "x.pt", {"a": torch.ones(1)})
    assert info.value.exit_code == 2


def test_legacy_non_zip_pt_and_sharded_bin_index(tmp_path):
    sd = {"a.weight": torch.randn(3, 4), "b.weight": torch.randn(2, 3)}
    torch.save(sd, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    with open_checkpoint(tmp_path / "legacy.pt") as ckpt:
        assert ckpt.keys() == list(sd) and all(torch.equal(ckpt.read(k), sd[k]) for k in sd)

    folder = tmp_path / "bin"
    folder.mkdir()
    torch.save({"a.weight": sd["a.weight"]}, folder / "pytorch_model-00001-of-00002.bin")
    torch.save({"b.weight": sd["b.weight"]}, folder / "pytorch_model-00002-of-00002.bin")
    weight_map = {"a.weight": "pytorch_model-00001-of-00002.bin", "b.weight": "pytorch_model-00002-of-00002.bin"}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with open_checkpoint(folder) as ckpt:
        assert ckpt.format == "sharded-pt"
        assert all(torch.equal(ckpt.read(k), sd[k]) for k in sd)


def test_a_legacy_pt_saved_from_a_gpu_is_read_to_the_cpu(tmp_path, monkeypatch):
    # Regression: without CUDA it was "truncated or corrupt ...; re-download or re-save it".
    import torch.serialization

    sd = {"a.weight": torch.randn(3, 4), "b.weight": torch.randn(2, 3)}
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")  # what a GPU tensor records
        torch.save(sd, tmp_path / "gpu.pt", _use_new_zipfile_serialization=False)
    with open_checkpoint(tmp_path / "gpu.pt") as ckpt:
        got = {k: ckpt.read(k) for k in ckpt.keys()}
    assert got.keys() == sd.keys() and all(t.device.type == "cpu" and torch.equal(t, sd[k]) for k, t in got.items())


@pytest.mark.parametrize("saved, root", [({}, None), ({"model": {}, "epoch": 3}, "model")])
def test_an_empty_pt_state_dict_has_no_tensors_like_an_empty_safetensors(tmp_path, saved, root):
    # Regression: "no state dict found (top-level keys: )" for a model without parameters.
    torch.save(saved, tmp_path / "empty.pt")
    with open_checkpoint(tmp_path / "empty.pt") as ckpt:
        assert (ckpt.keys(), ckpt.root) == ([], root)


@pytest.mark.parametrize("legacy", [False, True])
def test_a_state_dict_under_a_projects_own_key_is_read_and_several_are_refused(tmp_path, legacy):
    # Regression (helper-222): HiFi-GAN saves its generator as torch.save({'generator': sd}, ...):
    # "no state dict found (top-level keys: generator)", though it is the only one there.
    sd = {"conv.weight": torch.randn(3, 2), "conv.bias": torch.zeros(3)}
    save = dict(_use_new_zipfile_serialization=not legacy)
    torch.save({"generator": sd, "steps": 250}, tmp_path / "g.pt", **save)
    with open_checkpoint(tmp_path / "g.pt") as ckpt:
        assert ckpt.root == "generator" and sorted(ckpt.keys()) == sorted(sd)
        assert all(torch.equal(ckpt.read(k), t) for k, t in sd.items())
    # Its discriminators' checkpoint holds two models (and optimizer states): which is meant is not
    # for paramfold to guess.
    torch.save({"mpd": sd, "msd": sd, "optim_d": {"state": {}}}, tmp_path / "do.pt", **save)
    with pytest.raises(CheckpointError, match=r"several state dicts \(under 'mpd', 'msd'\): paramfold reads one "
                                              r"model per checkpoint; save the one to read on its own"):
        open_checkpoint(tmp_path / "do.pt")


@pytest.mark.parametrize("legacy", [False, True])
def test_a_projects_own_key_is_read_beside_an_empty_standard_one_and_odd_top_level_entries(tmp_path, legacy):
    # Regression (helper-224): {'state_dict': {}, 'generator': sd} was read as the empty state
    # dict (fold wrote an empty checkpoint, exit 0); a legacy file with a tensor under a non-string
    # top-level key failed inside (RuntimeError: Boolean value of Tensor ...); a state dict with
    # an extra-state entry under such a key was "no state dict found".
    sd = {"conv.weight": torch.randn(3, 2), "conv.bias": torch.zeros(3)}
    save = dict(_use_new_zipfile_serialization=not legacy)
    for name, saved in (("empty_beside", {"state_dict": {}, "generator": sd}),
                        ("odd_keys", {"generator": sd, "avg": torch.ones(3), 5: "x"})):
        torch.save(saved, tmp_path / f"{name}.pt", **save)
        with open_checkpoint(tmp_path / f"{name}.pt") as ckpt:
            assert ckpt.root == "generator" and sorted(ckpt.keys()) == sorted(sd), name
    torch.save({"generator": {**sd, "_extra_state": 3}}, tmp_path / "mixed.pt", **save)
    with pytest.raises(CheckpointError, match=r"its entry 'generator' holds 1 non-tensor entry \('_extra_state': int"):
        open_checkpoint(tmp_path / "mixed.pt")


@pytest.mark.parametrize("legacy", [False, True])
def test_a_projects_own_key_is_read_beside_scalar_tensors_as_beside_ints(tmp_path, legacy):
    # Regression (helper-225): {'generator': sd, 'step': torch.tensor(5)} was refused as "its state dict
    # holds 1 non-tensor entry ('generator': OrderedDict ...)", the top level taken for a state dict
    # because of the step counter, where {'model': sd, 'step': tensor} and {'generator': sd, 'step': 5}
    # were read. Scalar tensors are a checkpoint's metadata; no model's weights are all scalars.
    sd = {"conv.weight": torch.randn(3, 2), "conv.bias": torch.zeros(3)}
    save = dict(_use_new_zipfile_serialization=not legacy)
    for name, saved in (("step", {"generator": sd, "step": torch.tensor(5)}),
                        ("more", {"best_loss": torch.tensor(0.25), "generator": sd, "step": torch.tensor(5),
                                  "epoch": 3, "optimizer": {"state": {}, "param_groups": []}}),
                        ("empty_model", {"model": {}, "generator": sd, "step": torch.tensor(5)}),
                        # metrics saved as a dict of scalar tensors: metadata too (helper-230)
                        ("metrics", {"generator": sd, "metrics": {"loss": torch.tensor(0.3), "acc": torch.tensor(0.9)}})):
        torch.save(saved, tmp_path / f"{name}.pt", **save)
        with open_checkpoint(tmp_path / f"{name}.pt") as ckpt:
            assert ckpt.root == "generator" and sorted(ckpt.keys()) == sorted(sd), name
            assert ckpt.beside == (("metrics",) if name == "metrics" else ()), name
            assert all(torch.equal(ckpt.read(k), t) for k, t in sd.items())
    # Under that key, extra state is named there, not taken for the top level's.
    torch.save({"generator": {**sd, "_extra_state": 3}, "step": torch.tensor(5)}, tmp_path / "mixed.pt", **save)
    with pytest.raises(CheckpointError, match=r"its entry 'generator' holds 1 non-tensor entry \('_extra_state': int"):
        open_checkpoint(tmp_path / "mixed.pt")
    # Metadata alone (scalars, no model): no state dict, not a state dict with a stray entry.
    torch.save({"step": torch.tensor(5), "epoch": 3}, tmp_path / "meta.pt", **save)
    with pytest.raises(CheckpointError, match=r"no state dict found \(top-level keys: step, epoch; its tensors "
                                              r"\('step'\) are all scalars, taken as metadata .* if they are the "
                                              r"model's weights, save its state dict alone"):
        open_checkpoint(tmp_path / "meta.pt")
    # A dict of scalar tensors inside a flat state dict is a stray entry, as an int is there, not a
    # second candidate model (helper-233: the line said it "may be the model").
    torch.save({**sd, "metrics": {"loss": torch.tensor(0.5)}}, tmp_path / "flat.pt", **save)
    with pytest.raises(CheckpointError, match=r"its state dict holds 1 non-tensor entry \('metrics': dict"):
        open_checkpoint(tmp_path / "flat.pt")


@pytest.mark.parametrize("legacy", [False, True])
def test_a_dict_of_tensors_beside_weights_is_refused_naming_both(tmp_path, legacy):
    # Regression (helper-225): a dict of tensors beside tensors that are not scalars (a state dict
    # with its stats dict put inside, {'weights': t, 'generator': sd}) is two candidate models: it
    # was refused as a state dict with a stray entry and a module's get_extra_state() blamed, without
    # a word of the state dict under that key. Still refused (either may be the model), naming both.
    sd = {"conv.weight": torch.randn(3, 2), "conv.bias": torch.zeros(3)}
    stats = {"mean": torch.zeros(3), "std": torch.ones(3)}
    save = dict(_use_new_zipfile_serialization=not legacy)
    for saved, inner, beside in (({**sd, "norm_stats": stats}, "norm_stats", "'conv.weight', ..."),
                                 ({"weights": torch.zeros(3), "generator": sd}, "generator", "'weights'")):
        torch.save(saved, tmp_path / "two.pt", **save)
        with pytest.raises(CheckpointError) as refused:
            open_checkpoint(tmp_path / "two.pt")
        assert str(refused.value).endswith(
            f"two.pt: its top level holds a dict of tensors under '{inner}' beside tensors that are not all scalars "
            f"({beside}): either may be the model, and paramfold reads one per checkpoint without guessing which; "
            f"save the one to read on its own: torch.save(ckpt['{inner}'], PATH), or the tensors beside it, "
            "{k: v for k, v in ckpt.items() if isinstance(v, torch.Tensor)}"
        ), str(refused.value)
    # A stray entry that holds no tensor is what it was: a state dict with a non-tensor entry.
    torch.save({**sd, "meta": {"lr": 0.1}}, tmp_path / "meta.pt", **save)
    with pytest.raises(CheckpointError, match=r"its state dict holds 1 non-tensor entry \('meta': dict; a module's"):
        open_checkpoint(tmp_path / "meta.pt")


@pytest.mark.parametrize("legacy", [False, True])
def test_a_model_beside_its_stats_dict_is_refused_saying_why_not_picked(tmp_path, legacy):
    # helper-225: {'net': sd, 'norm_stats': {'mean': t, 'std': t}} is refused as several state dicts.
    # Kept (no rule tells a model from its stats that does not also pick between a generator and its
    # discriminator, or a model and its EMA copy, by guessing), the line now says so; with a scalar
    # step beside them it was refused as a top-level state dict with a stray entry ('net': dict).
    sd = {"conv.weight": torch.randn(3, 2), "conv.bias": torch.zeros(3)}
    stats = {"mean": torch.zeros(3), "std": torch.ones(3)}
    save = dict(_use_new_zipfile_serialization=not legacy)
    for saved in ({"net": sd, "norm_stats": stats}, {"net": sd, "norm_stats": stats, "step": torch.tensor(7)}):
        torch.save(saved, tmp_path / "stats.pt", **save)
        with pytest.raises(CheckpointError, match=re.escape(
                "several state dicts (under 'net', 'norm_stats'): paramfold reads one model per checkpoint; save "
                "the one to read on its own (torch.save(ckpt['net'], PATH)); which is the model is not guessed from "
                "sizes or names: a generator and its discriminator, a model and its EMA copy or its normalisation "
                "stats look alike")):
            open_checkpoint(tmp_path / "stats.pt")


@pytest.mark.parametrize("legacy", [False, True])
def test_a_model_with_extra_state_under_a_key_of_its_own_is_not_passed_over_for_another_entry(tmp_path, legacy):
    # Regression (helper-243): a state dict with a module's extra state under a key of its own was not a
    # candidate at all, so the only plain dict of tensors beside it was read as the model without a word:
    # the discriminator, or a dict of metrics (fold wrote a 4-byte file, exit 0).
    sd = {"conv.weight": torch.randn(3, 2), "conv.bias": torch.zeros(3)}
    gen = {**sd, "post._extra_state": {"scale": 1.0}}
    save = dict(_use_new_zipfile_serialization=not legacy)
    torch.save({"generator": gen, "discriminator": dict(sd), "epoch": 3}, tmp_path / "gan.pt", **save)
    with pytest.raises(CheckpointError, match=r"several state dicts \(under 'generator', 'discriminator'\)"):
        open_checkpoint(tmp_path / "gan.pt")
    torch.save({"generator": gen, "metrics": {"loss": torch.tensor(0.3)}, "epoch": 3}, tmp_path / "metrics.pt", **save)
    with pytest.raises(CheckpointError, match=r"its entry 'generator' holds 1 non-tensor entry "
                                              r"\('post\._extra_state': dict"):
        open_checkpoint(tmp_path / "metrics.pt")
    # A dict that holds no weights beside the model (an optimizer's state, settings) is still no candidate.
    torch.save({"generator": sd, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]},
                "config": {"n_mels": 80, "name": "g"}}, tmp_path / "plain.pt", **save)
    with open_checkpoint(tmp_path / "plain.pt") as ckpt:
        assert ckpt.root == "generator" and sorted(ckpt.keys()) == sorted(sd)


def test_no_state_dict_found_names_every_place_one_is_looked_for(tmp_path):
    # Regression (helper-225): the line named the top level and 'state_dict' / 'model' /
    # 'model_state_dict' only, not a state dict under a key of the project's own (read since helper-222).
    torch.save({"ckpt": {"model": {"w": torch.ones(2)}}}, tmp_path / "deep.pt")
    with pytest.raises(CheckpointError, match=re.escape(
            "no state dict found (top-level keys: ckpt); expected a dict of tensors, one under 'state_dict' / "
            "'model' / 'model_state_dict', or the only one under a key of its own (HiFi-GAN's 'generator', "
            "beside metadata such as a step)")):
        open_checkpoint(tmp_path / "deep.pt")


def test_a_checkpoint_without_a_suffix_is_told_what_it_is_and_how_to_name_it(tmp_path):
    # Regression (helper-222): HiFi-GAN's g_02500000 (a torch.save file, no suffix) was said to be of
    # an unsupported format 'g_02500000' and no more.
    torch.save({"w": torch.ones(2)}, tmp_path / "g_02500000")
    save_file({"w": torch.ones(2)}, tmp_path / "weights")
    for name, what in (("g_02500000", "a zip archive (as torch.save writes): rename it to end in .pt"),
                       ("weights", "a safetensors file: rename it to end in .safetensors")):
        with pytest.raises(CheckpointError, match=re.escape(f"(it is {what})")) as refused:
            open_checkpoint(tmp_path / name)
        assert refused.value.exit_code == 2
    (tmp_path / "notes").write_text("hello")
    with pytest.raises(CheckpointError, match=r"or a folder holding one$"):
        open_checkpoint(tmp_path / "notes")


def test_tensor_subclass_in_a_pt_file_is_refused(tmp_path):
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    quantize_(model, Int8WeightOnlyConfig())
    torch.save(model.state_dict(), tmp_path / "q.pt")
    with pytest.raises(CheckpointError, match="'0.weight' is an Int8Tensor .*unwrap_tensor_subclass"):
        open_checkpoint(tmp_path / "q.pt")


def test_pt_is_read_without_torch_load_and_written_aligned(tmp_path, monkeypatch):
    import zipfile

    model = torch.nn.Linear(4, 3)
    plain = torch.randn(5)
    plain.note = "a python attribute"  # pickled through torch._tensor._rebuild_from_type_v2
    sd = {**model.state_dict(keep_vars=True), "plain": plain, "f8": torch.ones(3).to(torch.float8_e5m2)}
    torch.save(sd, tmp_path / "in.pt")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    with open_checkpoint(tmp_path / "in.pt") as ckpt:  # the same code on every torch version
        assert ckpt.keys() == list(sd) and all(_same(ckpt.read(k), sd[k].detach()) for k in sd)
    monkeypatch.undo()
    out = tmp_path / "out.pt"
    write_state_dict(out, {k: v.detach() for k, v in sd.items()})
    with zipfile.ZipFile(out) as z:
        z.testzip()  # every record's CRC-32
        records = [i for i in z.infolist() if "/data/" in i.filename]
    with open(out, "rb") as f:
        for rec in records:
            f.seek(rec.header_offset + 26)
            n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
            assert (rec.header_offset + 30 + n + m) % 64 == 0  # as torch.save aligns, for mmap
    loaded = torch.load(out, weights_only=True, mmap=True)
    assert all(_same(loaded[k], sd[k].detach()) for k in sd)


def test_corrupt_bytes_and_unsupported_tensor_kinds_are_refused(tmp_path):
    torch.save({"w": torch.arange(100.0)}, tmp_path / "w.pt")
    data = bytearray((tmp_path / "w.pt").read_bytes())
    at = data.index(torch.arange(100.0).numpy().tobytes()) + 200
    data[at] ^= 1
    (tmp_path / "w.pt").write_bytes(bytes(data))
    with open_checkpoint(tmp_path / "w.pt") as ckpt:  # metadata is intact: the audit still works
        assert ckpt.info("w").shape == (100,)
        with pytest.raises(CheckpointError, match="'w' fail their CRC-32 check"):
            ckpt.read("w")

    torch.save({"s": torch.eye(3).to_sparse()}, tmp_path / "sparse.pt")
    with pytest.raises(CheckpointError, match="_rebuild_sparse_tensor") as info:
        open_checkpoint(tmp_path / "sparse.pt")
    assert "\n" not in str(info.value)


def test_public_names_stay_where_they_were():
    import paramfold.checkpoint.read
    import paramfold.checkpoint.write

    for name in paramfold.checkpoint.__all__:
        assert getattr(paramfold.checkpoint, name) is not None, name
    assert paramfold.CheckpointError is paramfold.checkpoint.CheckpointError
    assert paramfold.checkpoint.open_checkpoint is paramfold.checkpoint.read.open_checkpoint
    assert paramfold.checkpoint.write_state_dict is paramfold.checkpoint.write.write_state_dict
    assert paramfold.checkpoint.NESTED_STATE_DICT_KEYS == ("state_dict", "model", "model_state_dict")
