"""The CLI under hostile files, signals and a hostile environment: one line, an exit code, no mess.

Every failure class gets a real file (or a real signal sent to a real subprocess, or a writer
that fails like a full disk) and is checked for: exactly one line on stderr starting with
``paramfold <command>: error:``, the documented exit code, no traceback, no file written, and a
pre-existing output byte-identical.
"""

from __future__ import annotations

import ast
import io
import json
import os
import pickle
import signal
import stat
import subprocess
import sys
import textwrap
import time
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn.utils.parametrizations import spectral_norm, weight_norm
from typer.testing import CliRunner

from paramfold import bench, cli
from paramfold.cli import app

SRC = Path(__file__).resolve().parent.parent / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC)}


def _run(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def _one_line_error(res, command: str, code: int, *words: str) -> None:
    assert res.exit_code == code, (res.exit_code, res.output)
    err = res.stderr
    prefix = f"paramfold {command}: error: " if command else "paramfold: error: "
    assert err.startswith(prefix) and err.count("\n") == 1, err
    assert "Traceback" not in res.output
    for w in words:
        assert w in err, (w, err)


def _listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _wn_checkpoint(folder: Path, name: str = "wn.pt", width: int = 64) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(weight_norm(torch.nn.Linear(width, width)), weight_norm(torch.nn.Linear(width, 4)))
    path = folder / name
    if name.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    else:
        torch.save(model.state_dict(), path)
    return path


# -- fast start, help text -------------------------------------------------------------------------

_NO_TORCH = textwrap.dedent(
    """
    import io, sys, contextlib
    from paramfold.cli import main
    for argv in (["--help"], ["-h"], ["--version"], ["bench", "-h"], ["audit", "--help"], ["fold", "-h"]):
        sys.argv = ["paramfold", *argv]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                main()
            except SystemExit as e:
                assert e.code in (0, None), (argv, e.code)
        assert out.getvalue().strip(), argv
        print(argv, "torch" in sys.modules, out.getvalue().splitlines()[0] if argv == ["--version"] else "")
    # import paramfold works without hypothesis; paramfold.testing's strategies say what to install
    sys.modules["hypothesis"] = None
    import paramfold
    assert callable(paramfold.fold_checkpoint)
    try:
        paramfold.testing.cases
    except ImportError as e:
        print("testing:", e)
    """
)


def test_help_and_version_do_not_import_torch_and_testing_needs_its_extra():
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert all(" False" in line for line in lines[:6]), lines  # torch not in sys.modules
    assert "paramfold 0.1.0" in lines[2]
    assert lines[6] == (
        "testing: paramfold.testing's strategies (chains, models, cases) need hypothesis: "
        'pip install "paramfold[testing]"'
    )


def test_import_paramfold_imports_only_what_python_has_at_hand_not_typing():
    # Regression: paramfold/__init__.py imported typing (~10 ms of `import paramfold`, before the
    # console script's Ctrl-C handling starts in paramfold.__main__.main): a Ctrl-C then printed a
    # KeyboardInterrupt traceback through paramfold/__init__.py. What it imports now is small and
    # listed; typing (and anything else) comes with the CLI, under that handling.
    code = "import sys; before = set(sys.modules); import paramfold; print(sorted(set(sys.modules) - before))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    added = set(ast.literal_eval(proc.stdout))
    assert "typing" not in added
    assert added <= {"paramfold", "__future__", "importlib", "importlib._bootstrap", "importlib._bootstrap_external",
                     "importlib.machinery", "types", "warnings"}, added


def test_no_command_prints_the_help_once_and_exits_2():
    # Regression: the help was printed twice (rich printed it while click built its error, then
    # the CLI printed the error's help again).
    res = _run(env={"COLUMNS": "200"})
    assert res.exit_code == 2
    assert res.stdout.count("Usage: paramfold") == 1 and "Commands" in res.stdout


def test_help_text_lists_choices_and_real_defaults():
    text = " ".join(_run("bench", "--help", env={"COLUMNS": "200"}).stdout.split())
    assert "<bool>" not in text and "Number of layers, 1 to 10000 [default: 32 for seed, else 16]" in text
    assert "Layer width, 2 to 16384 [default: 128 for seed and weight_norm, else 64]" in text
    assert "variant, 1 to 1000 (min and median reported). [default: 3]" in text and "each 1 to 10000" in text
    assert all(name in text for name in cli.MODEL_NAMES) and "eager, aot_eager or inductor" in text
    assert "hoist, inline, freeze or auto" in text and "--wide" in text and "-h" in text
    # the defaults the help states are the zoo's, the choices are paramfold.bench's
    assert {n: (m.default_layers, m.default_width) for n, m in bench.MODELS.items()} == {
        "seed": (32, 128), "weight_norm": (16, 128), "spectral_norm": (16, 64), "weight_norm_hooks": (16, 128),
        "spectral_norm_hooks": (16, 64), "orthogonal": (16, 64)}
    assert cli.MODEL_NAMES == tuple(bench.MODELS) and cli.BACKEND_NAMES == bench.BACKENDS
    assert cli.ENTRY_NAMES == bench.ENTRIES and cli.VARIANT_NAMES == bench.VARIANT_NAMES
    assert cli.BENCH_LIMITS == {k: bench.config.LIMITS[k] for k in cli.BENCH_LIMITS}  # the ranges --help states
    from typing import get_args, get_type_hints

    from paramfold.fold import DTYPES

    assert cli.DTYPE_NAMES == tuple(DTYPES)  # fold's --dtype choices, and the Literal each command declares
    for fn in (cli.fold, cli.audit):
        assert get_args(get_args(get_type_hints(fn.__wrapped__)["dtype"])[0]) == cli.DTYPE_NAMES
    root = " ".join(_run("--help", env={"COLUMNS": "200"}).stdout.split())
    assert "<bool>" not in root and "--version" in root and "--debug" in root


def test_help_names_every_suffix_and_index_the_code_reads_and_writes():
    # Regression (helper-215): fold's OUT help named .safetensors and .pt only, audit's PATH help
    # no *.bin.index.json; the top-level help broke bench's line after "baseline, stock and".
    from paramfold.checkpoint.common import PT_SUFFIXES, SAFETENSORS_SUFFIX

    assert cli.FOLD_SUFFIXES == (SAFETENSORS_SUFFIX, *PT_SUFFIXES)  # what the help texts are made from
    fold = " ".join(_run("fold", "--help", env={"COLUMNS": "200"}).stdout.split())
    assert "its format by the suffix: .safetensors, .pt, .pth, .bin or .ckpt; not the input" in fold
    audit = " ".join(_run("audit", "--help", env={"COLUMNS": "200"}).stdout.split())
    assert "A .pt/.pth/.bin/.ckpt or .safetensors file, a *.safetensors.index.json or *.bin.index.json" in audit
    lines = _run("--help", env={"COLUMNS": "200"}).stdout.splitlines()
    bench_line = next(line for line in lines if "│ bench" in line)
    assert "as ratios to the plain model" in bench_line  # its summary on one line
    assert lines[lines.index(bench_line) + 1].split("│")[1].split()[0] == "audit"


@pytest.mark.parametrize(
    "args, command, words",
    [
        (["bench", "--model", "resnet"], "bench", ["Invalid value for '--model': 'resnet' is not one of", "orthogonal"]),
        # Regression: "Invalid value for '--variant': Value error, 'fast' is not one of ..."
        (["bench", "--variant", "fast"], "bench", ["Invalid value for '--variant': 'fast' is not one of", "freeze"]),
        (["bench", "--layers", "many"], "bench", ["Invalid value for '--layers'", "integer"]),
        # Regressions: read as 10 and 5 (int() and typer's parsing take them)
        (["bench", "--layers", "1_0"], "bench", ["Invalid value for '--layers': '1_0' is not an integer"]),
        (["bench", "--width", "5.0"], "bench", ["Invalid value for '--width': '5.0' is not an integer"]),
        (["bench", "--nope"], "bench", ["No such option: --nope"]),
        (["audit"], "audit", ["Missing argument 'PATH'"]),
        (["frobnicate"], "", ["No such command 'frobnicate'"]),
        # Regressions: "paramfold: error: ... (see paramfold --help)", though a command was named
        (["audit", "--json=1", "x.pt"], "audit", ["Option '--json' does not take a value", "see paramfold audit --help"]),
        (["--debug", "recompiles", "--strict=yes", "--", "python", "s.py"], "recompiles",
         ["does not take a value", "see paramfold recompiles --help"]),
        # Regression: "unsupported output format of '.'"
        (["fold", "x.pt", ""], "fold", ["no output path given (an empty string)"]),
        # Regression: blamed on python ("python's option --jsno is not supported here")
        (["recompiles", "--jsno", "--", "python", "s.py"], "recompiles",
         ["unknown option --jsno: paramfold recompiles takes --json and --strict before --"]),
    ],
)
def test_usage_errors_are_one_line(args, command, words):
    res = _run(*args)
    assert res.exit_code == 2 and res.stdout == ""
    prefix = f"paramfold {command}: error: " if command else "paramfold: error: "
    assert res.stderr.startswith(prefix) and res.stderr.count("\n") == 1, res.stderr
    assert all(w in res.stderr for w in words), res.stderr


def _corrupt(folder: Path) -> Path:
    path = folder / "corrupt.pt"
    path.write_bytes(b"PK\x03\x04 not really a zip")
    return path


@pytest.mark.parametrize(
    "args, command, code, words",
    [
        (["frobnicate"], "", 2, ["No such command 'frobnicate'", "(see paramfold --help)"]),
        (["bench", "--device", "gpu0"], "bench", 2, ["unknown device 'gpu0'"]),
        (["audit", "{tmp}/missing.pt"], "audit", 2, ["missing.pt: no such file or folder"]),
        (["audit", "{corrupt}"], "audit", 1, ["truncated or corrupt PyTorch checkpoint"]),
        (["fold", "{corrupt}"], "fold", 2, ["Missing argument 'OUT'", "(see paramfold fold --help)"]),
        (["fold", "{corrupt}", "{tmp}/o.pt"], "fold", 1, ["truncated or corrupt PyTorch checkpoint"]),
        (["fold", "{tmp}/missing.pt", "{tmp}/o.onnx"], "fold", 2, ["unsupported output format '.onnx'"]),
        (["recompiles"], "recompiles", 2, ["Missing argument", "(see paramfold recompiles --help)"]),
        (["recompiles", "--", "python", "{tmp}/missing.py"], "recompiles", 2, ["script not found"]),
    ],
)
def test_every_command_fails_with_one_line_in_one_format(tmp_path, args, command, code, words):
    corrupt = _corrupt(tmp_path)
    res = _run(*(a.format(tmp=tmp_path, corrupt=corrupt) for a in args))
    _one_line_error(res, command, code, *words)
    assert res.stdout == ""


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupt_outside_any_command_is_one_line_with_its_own_code(monkeypatch, signum, code):
    def interrupted(*a, **k):
        signal.getsignal(signum)(signum, None)  # the CLI's handler, as the signal runs it

    monkeypatch.setattr(cli.typer, "echo", interrupted)  # --version is answered while parsing
    res = _run("--version")
    _one_line_error(res, "", code, f"interrupted by {signal.Signals(signum).name}")


# -- hostile files -----------------------------------------------------------------------------------


def _flip_bytes_in_largest_record(path: Path) -> None:
    with zipfile.ZipFile(path) as z:
        rec = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    with open(path, "rb") as f:
        f.seek(rec.header_offset + 26)
        n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    middle = rec.header_offset + 30 + n + m + rec.file_size // 2
    for i in range(middle, middle + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_tensor_bytes_are_an_error_not_a_silent_fold(tmp_path):
    src = _wn_checkpoint(tmp_path)
    _flip_bytes_in_largest_record(src)
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"previous output")
    before = _listing(tmp_path)
    for target in (out, tmp_path / "new.pt"):
        res = _run("audit", str(src), "--fold-out", str(target))
        assert res.exit_code == 1 and "CRC-32" in res.stderr and res.stderr.count("\n") == 1, res.stderr
        assert res.stderr.startswith("paramfold audit: error: ") and "re-download or re-save" in res.stderr
    assert _listing(tmp_path) == before  # the old output untouched, nothing new


def _pt_declaring(path: Path, numel: int, record_bytes: int) -> None:
    """A torch.save-layout file whose pickle declares ``numel`` floats in a ``record_bytes`` record."""

    class Storage:
        pass

    class Ref:
        def __reduce__(self):
            return torch._utils._rebuild_tensor_v2, (storage, 0, (numel,), (1,), False, OrderedDict())

    storage = Storage()

    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", numel) if obj is storage else None

    buf = io.BytesIO()
    P(buf, protocol=2).dump({"big.weight": Ref()})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", sys.byteorder)
        z.writestr("archive/data/0", b"\0" * record_bytes)
        z.writestr("archive/version", "3\n")


def test_tensor_declaring_more_bytes_than_its_record_is_refused_before_allocating(tmp_path):
    huge = tmp_path / "huge.pt"
    _pt_declaring(huge, 2**38, 16)  # 1 TiB declared, 16 bytes stored
    st = tmp_path / "huge.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**38], "data_offsets": [0, 2**40]}}).encode()
    st.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    before = _listing(tmp_path)
    for src, words in ((huge, ["needs 1099511627776 bytes", "holds 16"]), (st, ["not a valid safetensors file"])):
        res = _run("audit", str(src), "--fold-out", str(tmp_path / "o.pt"))
        _one_line_error(res, "audit", 1, *words)
    assert _listing(tmp_path) == before


def test_a_view_expanding_a_few_stored_bytes_into_a_huge_tensor_is_refused_small_ones_fold(tmp_path):
    # Regression: a 1 KiB file with a stride-0 [8192, 8192] view made a 256 MiB output (and a
    # [10**6, 10**6] one an "out of memory"): it passed the record-size check, then was materialised.
    torch.save({"mask": torch.ones(1).expand(8192, 8192)}, tmp_path / "zip.pt")
    torch.save({"w": torch.ones(1).expand(10**6, 10**6)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    before = _listing(tmp_path)
    for name, words in (("zip.pt", ["'mask' [8192, 8192] float32", "expands 4 stored bytes to 268435456"]),
                        ("legacy.pt", ["'w' [1000000, 1000000] float32", "expands 4 stored bytes to 4000000000000"])):
        res = _run("fold", str(tmp_path / name), str(tmp_path / "o.safetensors"))
        _one_line_error(res, "fold", 1, *words, "more than 64 MiB")
    assert _listing(tmp_path) == before
    small = {"mask": torch.ones(1).expand(64, 64), "win": torch.arange(10.0).as_strided((9, 2), (1, 1))}
    torch.save(small, tmp_path / "small.pt")
    assert _run("fold", str(tmp_path / "small.pt"), str(tmp_path / "o.safetensors")).exit_code == 0
    got = load_file(tmp_path / "o.safetensors")
    assert all(torch.equal(got[k], v) for k, v in small.items())


def test_hand_edited_dtypes_that_torch_cannot_combine_are_one_line(tmp_path):
    torch.manual_seed(0)
    wn = weight_norm(torch.nn.Linear(8, 4)).state_dict()
    wn["parametrizations.weight.original0"] = wn["parametrizations.weight.original0"].half()
    torch.save(wn, tmp_path / "wn.pt")
    sn = spectral_norm(torch.nn.Linear(8, 4)).state_dict()
    sn["parametrizations.weight.0._u"] = sn["parametrizations.weight.0._u"].double()
    torch.save(sn, tmp_path / "sn.pt")
    before = _listing(tmp_path)
    for name, kind in (("wn.pt", "weight_norm"), ("sn.pt", "spectral_norm")):
        res = _run("audit", str(tmp_path / name), "--fold-out", str(tmp_path / "o.safetensors"))
        # Regression: it said "the stock model could not compute it either", but a model casts them
        # to its own dtype on load.
        _one_line_error(res, "audit", 1, f"cannot fold 'weight' ({kind})", "torch refuses its stored tensors",
                        "a model loads them cast to its own dtype", "--dtype", "--model")
        assert "could not compute" not in res.stderr
    assert _listing(tmp_path) == before
    for name, stock in (("wn.pt", weight_norm(torch.nn.Linear(8, 4))), ("sn.pt", spectral_norm(torch.nn.Linear(8, 4)))):
        res = _run("fold", str(tmp_path / name), str(tmp_path / "o.safetensors"), "--dtype", "float32")
        assert res.exit_code == 0, res.stderr
        stock.load_state_dict(torch.load(tmp_path / name, weights_only=True))
        assert torch.equal(load_file(tmp_path / "o.safetensors")["weight"], stock.eval().weight)


# -- hostile paths -----------------------------------------------------------------------------------


def test_output_over_the_input_is_refused_and_the_input_kept(tmp_path):
    src = _wn_checkpoint(tmp_path)
    (tmp_path / "link.pt").symlink_to(src)
    os.link(src, tmp_path / "hard.pt")
    shard_dir = tmp_path / "hf"
    shard_dir.mkdir()
    save_file({"a": torch.ones(2)}, shard_dir / "m-1.safetensors")
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "m-1.safetensors"}}))
    before, shards = _listing(tmp_path), _listing(shard_dir)
    for inp, out in ((src, src), (src, tmp_path / "link.pt"), (src, tmp_path / "hard.pt"),
                     (shard_dir, shard_dir / "m-1.safetensors")):
        res = _run("audit", str(inp), "--fold-out", str(out))
        _one_line_error(res, "audit", 2, "refusing to overwrite it")
        assert res.stdout == ""  # refused before the report is printed
    assert _listing(tmp_path) == before and _listing(shard_dir) == shards


def test_fold_out_is_validated_before_any_work(tmp_path):
    src = _wn_checkpoint(tmp_path)
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder.pt").mkdir()
    before = _listing(tmp_path)
    for out, words in ((tmp_path / "no" / "o.pt", "does not exist"), (tmp_path / "file" / "o.pt", "is a file, not a folder"),
                       (tmp_path / "o.gguf", "unsupported output format"), (tmp_path / "folder.pt", "is a folder")):
        res = _run("audit", str(src), "--fold-out", str(out))
        _one_line_error(res, "audit", 2, words)
        assert res.stdout == ""
    assert _listing(tmp_path) == before


def test_unwritable_output_folder_is_one_line(tmp_path, monkeypatch):
    src = _wn_checkpoint(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() == 0:  # root writes anywhere: make the permission check see what a user would
        import paramfold.output

        real = os.access
        monkeypatch.setattr(paramfold.output.os, "access", lambda p, m: False if Path(p) == locked else real(p, m))
    else:
        locked.chmod(0o500)
    res = _run("audit", str(src), "--fold-out", str(locked / "o.pt"))
    _one_line_error(res, "audit", 2, "permission denied")
    assert list(locked.iterdir()) == []


class _FullDisk(io.FileIO):
    """A file on a disk that fills up after ``room`` bytes (what a small tmpfs does)."""

    room = 4096

    def write(self, b):  # type: ignore[override]
        n = memoryview(b).nbytes
        if self.tell() + n > self.room:
            import errno

            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write(2) reports it: no name
        return super().write(b)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_full_disk_is_one_line_and_keeps_the_old_output(tmp_path, monkeypatch, suffix):
    import paramfold.output

    src = _wn_checkpoint(tmp_path, width=128)  # ~70 KiB of tensors
    out = tmp_path / f"o{suffix}"
    out.write_bytes(b"previous output")
    before = _listing(tmp_path)
    monkeypatch.setattr(paramfold.output, "open", lambda p, mode: io.BufferedWriter(_FullDisk(p, "w")), raising=False)
    res = _run("audit", str(src), "--fold-out", str(out))
    _one_line_error(res, "audit", 1, f"{out}: cannot write: No space left on device", "nothing was written")
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("command", ["fold", "audit"])
@pytest.mark.parametrize("target_exists", [True, False])
def test_an_output_that_is_a_symlink_is_written_through_to_its_target(tmp_path, command, target_exists):
    # As open(), torch.save and safetensors' save_file write a path that is a link: the link stays
    # and its target gets the bytes (a relative link is resolved from the link's folder).
    src = _wn_checkpoint(tmp_path)
    store = tmp_path / "store"
    store.mkdir()
    target = store / "real.safetensors"
    if target_exists:
        target.write_bytes(b"previous output")
    link = tmp_path / "o.safetensors"
    link.symlink_to(os.path.join("store", "real.safetensors"))
    args = ("fold", str(src), str(link)) if command == "fold" else ("audit", str(src), "--fold-out", str(link))
    assert _run(*args).exit_code == 0
    plain = tmp_path / "plain.safetensors"
    assert _run("fold", str(src), str(plain)).exit_code == 0
    assert link.is_symlink() and os.readlink(link) == os.path.join("store", "real.safetensors")
    assert target.read_bytes() == plain.read_bytes()
    assert [p.name for p in store.iterdir()] == ["real.safetensors"]  # no temporary file left


@pytest.mark.parametrize("kind", ["fifo", "link to a fifo", "device", "link to a device"])
def test_an_output_that_is_not_a_regular_file_is_refused_not_replaced(tmp_path, kind):
    # Regression: the temporary file was renamed over the FIFO or device node (through a link too),
    # so `ln -s /dev/null out.pt` run as root would have replaced /dev/null.
    node = tmp_path / "node"
    if kind.endswith("fifo"):
        os.mkfifo(node)
    elif os.geteuid() == 0:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a private twin of /dev/null
    else:
        pytest.skip("making a device node needs root")
    out = node.rename(tmp_path / "o.pt") if not kind.startswith("link") else tmp_path / "o.pt"
    if kind.startswith("link"):
        out.symlink_to("node")
    src = _wn_checkpoint(tmp_path)
    for args, command in [(("fold", str(src), str(out)), "fold"), (("audit", str(src), "--fold-out", str(out)), "audit")]:
        res = _run(*args)
        _one_line_error(res, command, 2, "not a regular file", "refusing to replace it")
        assert res.stdout == ""  # refused before the report
    target = tmp_path / ("node" if kind.startswith("link") else "o.pt")
    assert not stat.S_ISREG(target.stat().st_mode)
    assert {p.name for p in tmp_path.iterdir()} == {"o.pt", "wn.pt", target.name}  # no temporary file left


@pytest.mark.parametrize("kind", ["folder", "/dev/full"])
def test_an_output_without_a_suffix_says_what_it_is_before_its_format(tmp_path, kind):
    # Regression: "runs: unsupported output format 'runs'" for a folder, "'full'" for /dev/full.
    if kind == "folder":
        out, words = tmp_path / "runs", ["runs: is a folder; give a file name ending in .safetensors"]
        out.mkdir()
    elif Path(kind).exists():
        out, words = Path(kind), ["/dev/full: is not a regular file (a FIFO, a device or a socket)"]
    else:
        pytest.skip("needs /dev/full")
    res = _run("fold", str(_wn_checkpoint(tmp_path)), str(out))
    _one_line_error(res, "fold", 2, *words)
    assert "unsupported output format" not in res.stderr


def test_an_output_path_that_cannot_be_used_is_said_as_it_is(tmp_path, monkeypatch):
    # Regressions (helper-215): "the output folder notadir does not exist" where notadir is a file;
    # "unsupported output format 'noext'" for a name without a suffix; and OUT = ".safetensors"
    # exited 0, writing a hidden file of that name.
    monkeypatch.chdir(tmp_path)
    src = _wn_checkpoint(tmp_path)
    Path("notadir").write_text("x")
    before = _listing(tmp_path)
    for out, message in (
        ("notadir/out.pt", "notadir/out.pt: the output folder notadir is a file, not a folder"),
        ("notadir/sub/out.pt", "notadir/sub/out.pt: the output folder notadir/sub cannot exist: notadir is a file, not a folder"),
        ("missing/out.pt", "missing/out.pt: the output folder missing does not exist"),
        ("noext", "noext: the name has no suffix to say the format: give a name ending in "
                  ".safetensors, .pt, .pth, .bin or .ckpt"),
        (".safetensors", ".safetensors: the name is only a suffix: give a file name before it (model.safetensors)"),
        (".PT", ".PT: the name is only a suffix: give a file name before it (model.PT)"),
    ):
        res = _run("fold", str(src), out)
        assert (res.exit_code, res.stdout, res.stderr) == (2, "", f"paramfold fold: error: {message}\n"), out
    assert _listing(tmp_path) == before


def test_an_error_line_shows_a_paths_control_characters_escaped_as_success_lines_do(tmp_path, monkeypatch):
    # Regression: an error line made a newline in a path a space ("bad name.pt") and two spaces
    # one, naming a file that is not the user's; success lines show it escaped ("o\\nut.pt").
    monkeypatch.chdir(tmp_path)
    for name in ("bad\nname.pt", "two  spaces.pt", "tab\there.pt"):
        res = _run("audit", name)
        shown = name.replace("\n", "\\n").replace("\t", "\\t")
        assert (res.exit_code, res.stderr) == (2, f"paramfold audit: error: {shown}: no such file or folder\n"), name
    src = _wn_checkpoint(tmp_path)
    res = _run("fold", str(src), "o\nut.pt")
    assert res.exit_code == 0 and res.stdout.startswith("wrote o\\nut.pt: ")
    res = _run("fold", str(src), "o\nut.pt2")
    assert res.stderr == "paramfold fold: error: o\\nut.pt2: unsupported output format '.pt2': use .safetensors, .pt, .pth, .bin or .ckpt\n"
    # Another library's multi-line message quoted in one is still one line of words, not escapes.
    (tmp_path / "factory.py").write_text("def build():\n    raise ValueError('first line\\n    second line')\n")
    res = _run("fold", str(src), "out.pt", "--model", "factory.py:build")
    assert res.stderr == ("paramfold fold: error: --model factory.py:build: the factory raised ValueError: "
                          "first line second line\n"), res.stderr


def test_a_failed_rename_names_the_output_in_one_line_and_keeps_the_old_one(tmp_path, monkeypatch):
    import errno

    import paramfold.output

    src = _wn_checkpoint(tmp_path)
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"previous output")
    before = _listing(tmp_path)

    def failing_replace(a, b):  # what rename(2) says on a failing disk: both names, EIO
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(a), None, str(b))

    monkeypatch.setattr(paramfold.output.os, "replace", failing_replace)
    res = _run("fold", str(src), str(out))
    _one_line_error(res, "fold", 1, f"{out}: cannot write: Input/output error", "nothing was written")
    assert ".partial" not in res.stderr  # the temporary file is gone: naming it would mislead
    assert _listing(tmp_path) == before


def test_new_outputs_get_normal_permissions_and_replaced_ones_keep_theirs(tmp_path):
    src = _wn_checkpoint(tmp_path)
    old = os.umask(0o027)
    try:
        assert _run("audit", str(src), "--fold-out", str(tmp_path / "new.safetensors")).exit_code == 0
        kept = tmp_path / "kept.pt"
        kept.write_bytes(b"x")
        kept.chmod(0o604)
        assert _run("audit", str(src), "--fold-out", str(kept)).exit_code == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.safetensors").stat().st_mode) == 0o640
    assert stat.S_IMODE(kept.stat().st_mode) == 0o604
    assert set(load_file(tmp_path / "new.safetensors")) == set(torch.load(kept, weights_only=True))


# -- hostile environment -----------------------------------------------------------------------------


def test_a_factory_that_changes_directory_leaves_a_relative_out_where_it_was_checked(tmp_path, monkeypatch):
    # Regression (helper-200): model code that chdirs (to read its configs) moved a relative OUT
    # under the new working directory, not the path checked before any work; exit 0.
    src = _wn_checkpoint(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "moving.py").write_text(
        "import os, torch\nfrom torch.nn.utils.parametrizations import weight_norm\n"
        f"def build():\n    os.chdir({str(elsewhere)!r})\n"
        "    return torch.nn.Sequential(weight_norm(torch.nn.Linear(64, 64)), weight_norm(torch.nn.Linear(64, 4)))\n"
    )
    monkeypatch.chdir(tmp_path)
    res = _run("fold", str(src), "o.safetensors", "--model", f"{tmp_path / 'moving.py'}:build")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "o.safetensors").is_file() and list(elsewhere.iterdir()) == []
    assert Path.cwd() == tmp_path


def test_factory_exits_and_interrupts_and_unexpected_errors_are_one_line(tmp_path, monkeypatch):
    src = _wn_checkpoint(tmp_path)
    (tmp_path / "factories.py").write_text(
        "import signal, sys\ndef exits():\n    sys.exit(7)\ndef raises_interrupt():\n    raise KeyboardInterrupt\n"
        "def interrupted():\n    signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # the CLI's handler, as a Ctrl-C runs it\n"
    )
    before = _listing(tmp_path)
    out = str(tmp_path / "o.pt")
    res = _run("audit", str(src), "--fold-out", out, "--model", f"{tmp_path / 'factories.py'}:exits")
    _one_line_error(res, "audit", 1, "the factory called sys.exit(7)")
    res = _run("audit", str(src), "--fold-out", out, "--model", f"{tmp_path / 'factories.py'}:interrupted")
    _one_line_error(res, "audit", 130, "interrupted by SIGINT")
    # Regression: a KeyboardInterrupt the factory raised itself, no signal, was said as a Ctrl-C (exit 130).
    res = _run("audit", str(src), "--fold-out", out, "--model", f"{tmp_path / 'factories.py'}:raises_interrupt")
    _one_line_error(res, "audit", 1, "the factory raised KeyboardInterrupt")
    assert "SIGINT" not in res.stderr

    import paramfold.fold

    def no_memory(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 1099511627776 bytes.\nmore")

    monkeypatch.setattr(paramfold.fold, "_fold_site", no_memory)
    res = _run("audit", str(src), "--fold-out", out)
    _one_line_error(res, "audit", 1, "out of memory", "DefaultCPUAllocator")

    monkeypatch.setattr(paramfold.fold, "_fold_site", lambda *a: (_ for _ in ()).throw(TypeError("a bug")))
    res = _run("audit", str(src), "--fold-out", out)
    _one_line_error(res, "audit", 1, "TypeError: a bug", "PARAMFOLD_DEBUG=1")
    for env, args in (({"PARAMFOLD_DEBUG": "1"}, []), ({}, ["--debug"])):
        res = _run(*args, "audit", str(src), "--fold-out", out, env=env)
        assert res.exit_code == 1 and "Traceback (most recent call last)" in res.stderr
        assert res.stderr.splitlines()[-1].startswith("paramfold audit: error: TypeError: a bug")
    assert "PARAMFOLD_DEBUG" not in os.environ  # --debug holds for its own command line only
    res = _run("audit", str(src), "--fold-out", out)
    _one_line_error(res, "audit", 1, "TypeError: a bug")
    assert _listing(tmp_path) == before


_SLOW_FOLD = textwrap.dedent(
    """
    import sys, time
    import paramfold.fold as fold
    real, calls = fold._fold_site, []
    def slow(ckpt, site, *args):  # the second site blocks: the output is half written when the signal comes
        calls.append(site)
        if len(calls) == 2:
            sys.stderr.write("READY\\n"); sys.stderr.flush()
            time.sleep(120)
        return real(ckpt, site, *args)
    fold._fold_site = slow
    from paramfold.cli import main
    sys.argv = ["paramfold", *sys.argv[1:]]
    main()
    """
)


def _hangup_default() -> None:
    # Under nohup (a CI runner may start the suite that way) SIGHUP is inherited as ignored, and a
    # suite started in the background of a script SIGINT; paramfold then keeps ignoring them on
    # purpose. These tests are about signals that arrive.
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_a_signal_ignored_by_whoever_started_paramfold_stays_ignored(tmp_path, sig):
    # `paramfold fold big.pt out.pt &` in a non-interactive script starts with SIGINT ignored,
    # nohup with SIGHUP: a Ctrl-C meant for the script's foreground job must not end the fold.
    src = _wn_checkpoint(tmp_path)
    out = tmp_path / "o.pt"

    def ignored() -> None:
        _hangup_default()
        signal.signal(sig, signal.SIG_IGN)

    proc = subprocess.Popen([sys.executable, "-c", _SLOW_FOLD, "audit", str(src), "--fold-out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, preexec_fn=ignored)
    try:
        for line in proc.stderr:
            if line == "READY\n":
                break
        else:
            pytest.fail(f"the fold never started: {proc.communicate()}")
        proc.send_signal(sig)
        time.sleep(0.5)
        assert proc.poll() is None, "the ignored signal ended the fold"
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 143, (proc.returncode, stderr)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_signals_mid_fold_leave_no_partial_file_and_the_old_output(tmp_path):
    src = _wn_checkpoint(tmp_path, width=256)
    cases = [(signal.SIGINT, ".pt", 130), (signal.SIGTERM, ".safetensors", 143), (signal.SIGHUP, ".pt", 129)]
    outs = {}
    for sig, suffix, _ in cases:
        folder = tmp_path / sig.name
        folder.mkdir()
        outs[sig] = folder / f"o{suffix}"
        outs[sig].write_bytes(b"previous output")
    procs = {
        sig: subprocess.Popen([sys.executable, "-c", _SLOW_FOLD, "audit", str(src), "--fold-out", str(outs[sig])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                              preexec_fn=_hangup_default)
        for sig, _, _ in cases
    }
    try:  # all three at once: each pays torch's import, in parallel
        for sig, _, code in cases:
            proc = procs[sig]
            for line in proc.stderr:  # (a warning printed by an import may come first)
                if line == "READY\n":
                    break
            else:
                pytest.fail(f"{sig.name}: the fold never started: {proc.communicate()}")
            partial = [p for p in outs[sig].parent.iterdir() if p.name.endswith(".partial")]
            assert len(partial) == 1 and partial[0].stat().st_size > 0  # half written, really
            proc.send_signal(sig)
            stdout, stderr = proc.communicate(timeout=60)
            assert proc.returncode == code, (sig, proc.returncode, stderr)
            assert stderr == f"paramfold audit: error: interrupted by {sig.name}; no output was written\n"
            assert "1 parametrized site" not in stdout and "2 parametrized sites" in " ".join(stdout.split())
            assert _listing(outs[sig].parent) == {outs[sig].name: b"previous output"}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# -- output that fits --------------------------------------------------------------------------------


def _result_with_big_numbers() -> bench.BenchResult:
    config = bench.BenchConfig(backend="inductor", entry="layers", repeats=5)
    variants = []
    for i, name in enumerate(bench.VARIANT_NAMES):
        first = 1.234567 * (i + 1) * (10 if name == "stock" else 1)
        proxies = bench.Proxies(graphs=8 + i, graph_breaks=i, recompiles=7 * i, captured_calls=1024 + i,
                                frames=1, recompile_limit_hits=int(name == "stock"))
        samples = [bench.Sample(r, 0.0123, first + r, first + r, 0.00123456, [0.00123456], proxies,
                                max_abs_diff=0.0 if i % 2 else 1.5e-5) for r in range(5)]
        variants.append(bench.VariantResult(name, name, samples=samples))
    env = {"torch": "2.13.0+cpu", "torch_threads": 1, "device": "x86_64"}
    return bench.BenchResult(config, env, variants)


def test_bench_table_fits_100_columns_with_every_number_uncut():
    from rich.console import Console

    result = _result_with_big_numbers()
    buf = io.StringIO()
    bench.print_table(result, console=Console(file=buf, width=100, color_system=None))
    text = buf.getvalue()
    assert max(map(len, text.splitlines())) <= 100 and "…" not in text
    for v in result.variants:
        row = next(line for line in text.splitlines() if line.strip().startswith(v.name + " "))
        cells = [f"{v.first_call_min * 1e3:,.0f} / {v.first_call_median * 1e3:,.0f}",
                 f"{result.ratio(v.name, 'min'):.2f}x / {result.ratio(v.name, 'median'):.2f}x",
                 f"{result.ratio(v.name, 'steady_min'):.2f}x / {result.ratio(v.name, 'steady_median'):.2f}x",
                 str(v.proxies.graphs), str(v.proxies.recompiles),
                 str(v.proxies.captured_calls), "0" if not v.max_abs_diff else f"{v.max_abs_diff:.2e}"]
        for cell in cells:
            assert cell in row, (cell, row)
    assert "stock: hit dynamo's recompile_limit" in text  # notes under the compact table
    wide = io.StringIO()
    bench.print_table(result, wide=True, console=Console(file=wide, width=200, color_system=None))
    assert "first cpu" in wide.getvalue() and "prepare" in wide.getvalue() and "note" in wide.getvalue()
    assert "steady ms" in wide.getvalue() and f"{v.steady_call_median * 1e3:.3f}" in wide.getvalue()


def test_bench_cli_at_100_columns_prints_progress_lines_when_not_a_terminal():
    res = _run("bench", "--layers", "1", "--repeats", "1", "--steady-rounds", "1", "--variant", "hoist",
               env={"COLUMNS": "100"})
    assert res.exit_code == 0, res.output
    assert max(map(len, res.stdout.splitlines())) <= 100 and "…" not in res.stdout
    assert "hoist" in res.stdout and "x baseline" in res.stdout
    progress = res.stderr.splitlines()
    # a warm-up round and one repeat of baseline, stock, hoist, the steady phase, then "done"
    assert [line.split("] ", 1)[1] for line in progress] == [
        "warm-up (discarded): baseline", "warm-up (discarded): stock", "warm-up (discarded): hoist",
        "repeat 1/1: baseline", "repeat 1/1: stock", "repeat 1/1: hoist",
        "steady: compile and warm up baseline", "steady: compile and warm up stock",
        "steady: compile and warm up hoist", "steady: round 1/1", "done"]
    assert all(line.startswith("paramfold bench: [") for line in progress)


def test_lazy_package_keeps_every_public_name_and_submodule():
    import importlib
    import types

    import paramfold

    for name in paramfold.__all__:
        assert not isinstance(getattr(paramfold, name), types.ModuleType), name
    for name in ("prepare", "restore", "recompiles"):  # functions named like their modules
        module = importlib.import_module(f"paramfold.{name}")
        assert getattr(paramfold, name) is getattr(module, name)
    assert paramfold.testing.__name__ == "paramfold.testing" and "testing" in dir(paramfold)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        paramfold.nope


# -- found by the 2026-12-02 CLI hunt ----------------------------------------------------------


def _cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """The CLI as a real process (warnings, pipes and file descriptors as a user gets them)."""
    return subprocess.run([sys.executable, "-c", "from paramfold.cli import main; main()", *args],
                          capture_output=True, text=True, env=ENV, timeout=120, **kwargs)


def _with_pickle(src: Path, dest: Path, data: bytes) -> Path:
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as out:
        for name in z.namelist():
            out.writestr(name, data if name.endswith("data.pkl") else z.read(name))
    return dest


def test_a_refused_protocol_4_pickle_is_one_line(tmp_path):
    # Regression: torch's UserWarning about the pickle protocol (and its source line) came first.
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w')".encode()
    data = (b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x8c\x04eval\x93\x8c"
            + bytes([len(code)]) + code + b"\x85R.")
    bad = _with_pickle(_wn_checkpoint(tmp_path), tmp_path / "evil.pt", data)
    res = _cli("audit", str(bad))
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("paramfold audit: error: ") and "refused to unpickle" in res.stderr
    assert not marker.exists()


def test_a_refused_protocol_0_pickle_names_what_it_references(tmp_path):
    # Regression: torch's "Unsupported operand 83" (protocol 0's STRING) was said instead.
    bad = _with_pickle(_wn_checkpoint(tmp_path), tmp_path / "inst.pt", b"(S'true'\nios\nsystem\n.")
    res = _cli("audit", str(bad))
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert "refused to unpickle: it references 'os.system'" in res.stderr and "operand" not in res.stderr


def test_a_state_dict_holding_a_tensor_subclass_is_refused_with_advice_that_works(tmp_path):
    # Regression: a plain state_dict() with a quantized weight (torchao's Int8Tensor; here torch's
    # own TwoTensor) was refused with "re-save just its state dict", which it already was.
    from torch.testing._internal.two_tensor import TwoTensor

    path = tmp_path / "subclass.pt"
    torch.save({"weight": TwoTensor(torch.ones(2), torch.ones(2))}, path)
    res = _cli("audit", str(path))
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert "refused to unpickle" in res.stderr and "TwoTensor" in res.stderr
    assert "tensor subclasses" in res.stderr and "unwrap_tensor_subclass" in res.stderr


def test_a_fifo_is_refused_instead_of_read_forever(tmp_path):
    fifo = tmp_path / "ckpt.pt"
    os.mkfifo(fifo)
    res = _cli("audit", str(fifo))  # regression: blocked on open() until a signal
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "not a regular file" in res.stderr, res.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["--version"], ["--help"], ["audit", "--help"]])
def test_help_and_version_to_a_full_disk_are_one_line(args):
    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-c", "from paramfold.cli import main; main()", *args],
                             stdout=full, stderr=subprocess.PIPE, text=True, env=ENV, timeout=120)
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr  # was a traceback
    assert "No space left on device" in res.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["recompiles", "--json"], ["recompiles"], ["audit", "--json"], ["audit"]])
def test_a_report_to_a_full_disk_is_one_line_and_exit_1(tmp_path, args):
    # Regression (2026-12-05 hunt): recompiles --json printed its report into the buffer, whose
    # flush at the end dropped the error: the report was lost with exit 0 and no word.
    script = tmp_path / "quiet.py"
    script.write_text("x = 1\n")
    tail = ["--", sys.executable, str(script)] if args[0] == "recompiles" else [str(_wn_checkpoint(tmp_path))]
    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-c", "from paramfold.cli import main; main()", *args, *tail],
                             stdout=full, stderr=subprocess.PIPE, text=True, env=ENV, timeout=120)
    assert res.returncode == 1 and res.stderr.count("\n") == 1, (res.returncode, res.stderr)
    assert "No space left on device" in res.stderr


def test_an_audit_table_into_a_pipe_closed_early_ends_quietly(tmp_path):
    # Regression: rich's own broken-pipe exit was reported as "exited early (sys.exit(1))".
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(weight_norm(torch.nn.Linear(8, 8)) for _ in range(200)))
    torch.save(model.state_dict(), tmp_path / "many.pt")
    proc = subprocess.Popen([sys.executable, "-c", "from paramfold.cli import main; main()", "audit",
                             str(tmp_path / "many.pt")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    proc.stdout.read(10)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert err == "" and proc.returncode == 0, (proc.returncode, err)


@pytest.mark.parametrize("args, writes", [
    (["--version"], False), (["audit", "{src}"], False), (["audit", "{src}", "--json"], False),
    (["fold", "{src}", "{out}"], True), (["audit", "{src}", "--fold-out", "{out}"], True),
    (["recompiles", "--", "python", "{script}"], False),
])
def test_a_stdout_closed_before_anything_is_printed_ends_quietly_with_the_commands_own_code(tmp_path, args, writes):
    # Regression: exit 1 without a word (or 0, as the reader's timing fell), and `audit --fold-out`
    # stopped at its report, so OUT was never written. A pipe whose reader is gone at the start
    # makes every write fail, deterministically.
    src, out, script = _wn_checkpoint(tmp_path), tmp_path / "plain.pt", tmp_path / "s.py"
    script.write_text("x = 1\n")  # what it prints would be its own: a BrokenPipeError, as under python
    argv = [a.format(src=src, out=out, script=script) for a in args]
    read, write = os.pipe()
    os.close(read)
    try:
        res = subprocess.run([sys.executable, "-m", "paramfold", *argv], stdout=write, stderr=subprocess.PIPE,
                             text=True, env=ENV, timeout=120)
    finally:
        os.close(write)
    assert (res.returncode, res.stderr) == (0, ""), (res.returncode, res.stderr)
    assert out.exists() == writes
    if writes:
        assert sorted(torch.load(out, weights_only=True)) == ["0.bias", "0.weight", "1.bias", "1.weight"]


@pytest.mark.parametrize("args, writes", [
    (["audit", "{src}", "--json", "--fold-out", "{out}"], True),
    (["audit", "{src}", "--json", "--fold-out", "{out}", "--model", "{script}:build"], True),
    (["fold", "{src}", "{out}", "--model", "{script}:build"], True),
    (["recompiles", "--json", "--", "{script}"], False),
    (["recompiles", "--", "{script}"], False),
])
def test_a_stdout_closed_from_the_start_is_no_failure_and_user_code_output_goes_to_stderr(tmp_path, args, writes):
    # Regression: with `>&-` (sys.stdout None) the --json commands failed with "unexpected
    # AttributeError: 'NoneType' object has no attribute 'flush'" and wrote nothing.
    src, out, script = _wn_checkpoint(tmp_path), tmp_path / "plain.pt", tmp_path / "s.py"
    script.write_text(textwrap.dedent("""
        import os, subprocess, sys, torch
        from torch.nn.utils.parametrizations import weight_norm
        def build():
            print("from print")
            try:
                os.write(1, b"from descriptor 1\\n")
            except OSError:  # closed, as under python
                print("descriptor 1 closed", file=sys.stderr)
            return torch.nn.Sequential(weight_norm(torch.nn.Linear(64, 64)), weight_norm(torch.nn.Linear(64, 4)))
        if __name__ == "__main__":
            build()
        """))
    argv = [a.format(src=src, out=out, script=script) for a in args]
    res = subprocess.run(["sh", "-c", 'exec "$0" -m paramfold "$@" >&-', sys.executable, *argv],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "error" not in res.stderr, res.stderr
    if "--json" in args and "{script}" in " ".join(args):  # user code's output goes to stderr
        assert "from print\nfrom descriptor 1\n" in res.stderr, res.stderr
    elif "{script}" in " ".join(args):
        assert res.stderr.startswith("descriptor 1 closed\n"), res.stderr
    assert out.exists() == writes
    if writes:
        assert sorted(torch.load(out, weights_only=True)) == ["0.bias", "0.weight", "1.bias", "1.weight"]


def test_audit_json_with_a_model_that_prints_keeps_stdout_one_json_document(tmp_path):
    # Regression: the factory's prints came after the JSON document on stdout.
    ckpt = _wn_checkpoint(tmp_path)
    (tmp_path / "build.py").write_text(textwrap.dedent("""
        import os, torch
        from torch.nn.utils.parametrizations import weight_norm
        def build():
            print("building model...")
            os.write(1, b"from descriptor 1\\n")
            return torch.nn.Sequential(weight_norm(torch.nn.Linear(64, 64)), weight_norm(torch.nn.Linear(64, 4)))
        """))
    out = tmp_path / "plain.pt"
    res = _cli("audit", str(ckpt), "--json", "--fold-out", str(out), "--model", f"{tmp_path / 'build.py'}:build")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["summary"]["sites"] == 2
    assert "building model...\nfrom descriptor 1\n" in res.stderr and f"wrote {out}" in res.stderr


def test_a_model_file_that_exits_at_import_is_a_usage_error(tmp_path):
    # Regression: its sys.exit(5) became the command's exit code.
    ckpt = _wn_checkpoint(tmp_path)
    (tmp_path / "modexit.py").write_text("import sys\nsys.exit(5)\n")
    res = _run("fold", str(ckpt), str(tmp_path / "out.pt"), "--model", f"{tmp_path / 'modexit.py'}:build")
    _one_line_error(res, "fold", 2, "cannot import")


def test_a_key_safetensors_cannot_hold_is_refused_before_writing(tmp_path):
    # Regression: a key with a lone surrogate (torch.save keeps it) made an unreadable output.
    torch.save({"w\ud800": torch.zeros(2)}, tmp_path / "odd.pt")
    res = _run("fold", str(tmp_path / "odd.pt"), str(tmp_path / "out.safetensors"))
    _one_line_error(res, "fold", 1, "not valid UTF-8", "write .pt")
    assert not (tmp_path / "out.safetensors").exists()


def test_a_negative_size_in_a_pt_checkpoint_is_corrupt(tmp_path):
    # Regression: audit accepted it (plain_bytes -4) and fold failed with an "unexpected" error.
    torch.save({"w": torch.zeros(4)}, tmp_path / "good.pt")
    with zipfile.ZipFile(tmp_path / "good.pt") as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert data.count(b"K\x04\x85") == 1  # the size (4,): BININT1 4, TUPLE1
    bad = _with_pickle(tmp_path / "good.pt", tmp_path / "neg.pt", data.replace(b"K\x04\x85", b"J\xfc\xff\xff\xff\x85"))
    res = _run("audit", str(bad))
    # Regression: "tensor 'w' [-4] float32 needs 16 bytes, its record ... holds 16": one plain sentence now.
    _one_line_error(res, "audit", 1, "corrupt PyTorch checkpoint: tensor 'w' has a negative size (shape [-4])")
    assert "needs" not in res.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_summary_that_cannot_be_printed_does_not_deny_the_written_output(tmp_path):
    # Regression: "No space left on device ...; nothing was written" with the output in place.
    ckpt, out = _wn_checkpoint(tmp_path), tmp_path / "plain.safetensors"
    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-c", "from paramfold.cli import main; main()", "fold", str(ckpt), str(out)],
                             stdout=full, stderr=subprocess.PIPE, text=True, env=ENV, timeout=120)
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert f"{out} was written whole" in res.stderr and "nothing was written" not in res.stderr
    assert sorted(load_file(out)) == ["0.bias", "0.weight", "1.bias", "1.weight"]


def test_what_the_commands_say_counts_one_thing_in_the_singular_and_says_an_int(tmp_path):
    # Regressions: "wrote o.pt: 1 tensors", "1 plain tensors", "the factory returned a int",
    # "it holds a int".
    torch.save({"w": torch.zeros(2)}, tmp_path / "one.pt")
    res = _run("fold", str(tmp_path / "one.pt"), str(tmp_path / "o.pt"))
    assert res.exit_code == 0 and res.stdout.startswith(f"wrote {tmp_path / 'o.pt'}: 1 tensor, 8 B; 0 parametrized sites")
    res = _run("audit", str(tmp_path / "one.pt"))
    assert res.exit_code == 0 and "; 1 plain tensor (8 B); " in " ".join(res.stdout.split())
    (tmp_path / "factories.py").write_text("def number():\n    return 5\n")
    res = _run("fold", str(_wn_checkpoint(tmp_path)), str(tmp_path / "o.pt"), "--model", f"{tmp_path / 'factories.py'}:number")
    _one_line_error(res, "fold", 1, "the factory returned an int, not a torch.nn.Module")
    torch.save(5, tmp_path / "int.pt")
    _one_line_error(_run("audit", str(tmp_path / "int.pt")), "audit", 1, "(it holds an int)")


def test_an_empty_input_path_is_a_usage_error_not_the_current_folder(tmp_path, monkeypatch):
    # Regression: Path("") is ".", so fold read whatever checkpoint the current folder held.
    _wn_checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)
    res = _run("fold", "", str(tmp_path / "out.safetensors"))
    _one_line_error(res, "fold", 2, "no input path")
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("device", ["meta", "xpu"])
def test_a_bench_device_other_than_cpu_or_cuda_is_a_usage_error(device):
    res = _run("bench", "--device", device, "--layers", "2", "--repeats", "1")
    _one_line_error(res, "bench", 2, "cpu or cuda")  # was exit 1, "(unexpected)", after running


@pytest.mark.parametrize("case", ["deflated", "broken_deflate", "bzip2_bomb", "byteorder"])
def test_a_compressed_data_pkl_or_byteorder_is_refused_before_it_is_inflated(tmp_path, case):
    # Regression (2026-12-05 hunt): data.pkl was inflated whole before any check: a 2 KB file
    # whose bzip2 record held a pickle and then 1 GiB of zeros took 2.3 GB and audited fine. Only
    # tensor records were required to be stored (torch.save never compresses).
    good = _wn_checkpoint(tmp_path)
    bad = tmp_path / f"{case}.pt"
    target = "byteorder" if case == "byteorder" else "data.pkl"
    kind = zipfile.ZIP_BZIP2 if case == "bzip2_bomb" else zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(good) as z, zipfile.ZipFile(bad, "w") as out:
        for info in z.infolist():
            data = z.read(info)
            if case == "bzip2_bomb" and info.filename.endswith(target):
                data += bytes(8 << 20)  # after the pickle's STOP: never read by an unpickler
            out.writestr(info.filename, data,
                         compress_type=kind if info.filename.endswith(target) else zipfile.ZIP_STORED)
    if case == "broken_deflate":
        data = bytearray(bad.read_bytes())
        name = next(i for i in zipfile.ZipFile(bad).infolist() if i.filename.endswith("data.pkl"))
        body = name.header_offset + 30 + len(name.filename.encode()) + len(name.extra)
        data[body:body + 8] = b"\xff" * 8  # the deflate stream's first bytes
        bad.write_bytes(bytes(data))
    assert bad.stat().st_size < 64 << 10
    res = _run("audit", str(bad))
    _one_line_error(res, "audit", 1, f"/{target} is compressed", "re-save it")


def test_a_terminal_escape_sequence_in_a_key_is_shown_not_sent(tmp_path):
    torch.manual_seed(0)
    layer = weight_norm(torch.nn.Linear(4, 4))
    state = {f"evil\x1b[2J.{k}": v for k, v in layer.state_dict().items()}
    torch.save(state, tmp_path / "ansi.pt")
    res = _cli("audit", str(tmp_path / "ansi.pt"))
    assert res.returncode == 0, res.stderr
    assert "\x1b" not in res.stdout and "\\x1b[2J" in res.stdout, res.stdout


def test_a_deeply_nested_key_is_described_not_a_recursion_error(tmp_path):
    # A dict whose only key is a tuple nested 100,000 deep: naming it in the error recursed.
    data = b"\x80\x02}" + b")" + b"\x85" * 100_000 + b"K\x01s."
    bad = _with_pickle(_wn_checkpoint(tmp_path), tmp_path / "deep.pt", data)
    res = _run("audit", str(bad))
    _one_line_error(res, "audit", 1, "no state dict found", "top-level keys: ((((")
    assert "unexpected" not in res.stderr and len(res.stderr) < 600


@pytest.mark.parametrize("metadata, word", [(["a", "b"], "metadata"), ("text", "metadata"), (3, "metadata"),
                                           ("DEEP", "RecursionError")])
def test_an_index_whose_metadata_is_not_a_mapping_is_not_a_valid_index(tmp_path, metadata, word):
    shard = _wn_checkpoint(tmp_path, "model.safetensors")
    from safetensors import safe_open
    with safe_open(str(shard), "pt") as f:
        weight_map = {k: shard.name for k in f.keys()}
    index = tmp_path / "model.safetensors.index.json"
    text = json.dumps({"metadata": metadata, "weight_map": weight_map})
    index.write_text(text.replace('"DEEP"', "[" * 100_000 + "]" * 100_000))  # deeper than json's recursion limit
    res = _run("audit", str(index))
    _one_line_error(res, "audit", 1, "not a valid checkpoint index", word)  # was "(unexpected)"
    assert "unexpected" not in res.stderr


@pytest.mark.parametrize("args, code", [(["audit", "--nope"], 2), (["audit", "missing.pt"], 2), (["audit", "--help"], 0)])
def test_with_stderr_closed_the_exit_code_still_says_what_happened(tmp_path, args, code):
    # Python starts with sys.stderr None when fd 2 is closed: writing the error line raised, exit 1.
    script = 'exec "$0" -c "from paramfold.cli import main; main()" "$@" 2>&-'
    res = subprocess.run(["sh", "-c", script, sys.executable, *args], capture_output=False, stdout=subprocess.DEVNULL,
                         env=ENV, cwd=tmp_path, timeout=120)
    assert res.returncode == code


def test_ctrl_c_while_the_cli_is_imported_is_one_line_and_exit_130(tmp_path):
    # Regression: an interrupt while typer was being imported printed the import's traceback.
    # The interrupt is made deterministic: importing typer raises it, as a Ctrl-C there would.
    code = textwrap.dedent("""
        import sys
        class Interrupt:
            def find_spec(self, name, path=None, target=None):
                if name == "typer":
                    raise KeyboardInterrupt
        sys.meta_path.insert(0, Interrupt())
        from paramfold.__main__ import main
        main()
    """)
    res = subprocess.run([sys.executable, "-c", code, "audit", "x.pt"], capture_output=True, text=True,
                         env=ENV, cwd=tmp_path, timeout=120)
    assert res.returncode == 130, res.stderr
    assert res.stderr == "paramfold: error: interrupted by SIGINT; no output was written\n"
    from importlib.metadata import entry_points
    (script,) = entry_points(group="console_scripts", name="paramfold")
    assert script.value == "paramfold.__main__:main"  # the installed `paramfold` goes through it


def test_ctrl_c_while_typer_builds_the_command_line_is_one_line_and_exit_130(tmp_path):
    # Regression (helper-200): an interrupt about 0.1 s in, while typer built the command from the
    # commands' signatures, before the command's own handling was set up, printed a traceback.
    code = textwrap.dedent("""
        import typer.main
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt
        typer.main.get_group = interrupted
        from paramfold.__main__ import main
        main()
    """)
    res = subprocess.run([sys.executable, "-c", code, "audit", "x.pt"], capture_output=True, text=True,
                         env=ENV, cwd=tmp_path, timeout=120)
    assert res.returncode == 130, res.stderr
    assert res.stderr == "paramfold: error: interrupted by SIGINT; no output was written\n"


def test_bench_with_stderr_closed_prints_its_result(tmp_path):
    # Regression (helper-200): with fd 2 closed Python starts with sys.stderr None, and the plain
    # progress lines raised AttributeError: exit 1, no table, no --json document.
    script = 'exec "$0" -c "from paramfold.cli import main; main()" "$@" 2>&-'
    args = ["bench", "--layers", "1", "--width", "2", "--repeats", "1", "--steady-rounds", "1", "--variant", "hoist", "--json"]
    res = subprocess.run(["sh", "-c", script, sys.executable, *args], stdout=subprocess.PIPE, text=True,
                         env=ENV, cwd=tmp_path, timeout=300)
    assert res.returncode == 0
    assert [v["name"] for v in json.loads(res.stdout)["variants"]] == ["baseline", "stock", "hoist"]


def test_columns_zero_prints_the_report_at_a_usable_width(tmp_path, monkeypatch):
    # Regression (helper-200): rich took COLUMNS=0 for a width of 0: audit printed nothing, exit 0.
    monkeypatch.setenv("COLUMNS", "0")
    res = _run("audit", str(_wn_checkpoint(tmp_path)))
    assert res.exit_code == 0, res.output
    assert "weight_norm dim=0" in res.stdout, res.stdout


def test_python_dash_m_paramfold_is_the_cli():
    res = subprocess.run([sys.executable, "-m", "paramfold", "--version"], capture_output=True, text=True,
                         env=ENV, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().startswith("paramfold "), res.stderr


@pytest.mark.parametrize("stem", ["x" * 250, "é" * 125])  # 253 bytes with ".pt": within the 255-byte limit
def test_an_output_named_near_the_name_length_limit_is_written(tmp_path, stem):
    # Regression: the temporary file's name (the output's plus ".<random>.partial") was too long.
    out = tmp_path / f"{stem}.pt"
    res = _run("fold", str(_wn_checkpoint(tmp_path)), str(out))
    assert res.exit_code == 0, res.output
    assert out.is_file() and not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    assert set(torch.load(out, weights_only=True)) == {"0.weight", "0.bias", "1.weight", "1.bias"}


def test_a_read_only_output_is_refused_like_open_would(tmp_path, monkeypatch):
    # Regression: a read-only OUT was replaced by the rename. CI runs as root, for whom open()
    # writes read-only files too, so the test asks as a user would be answered.
    from paramfold import output

    out = tmp_path / "out.pt"
    out.write_bytes(b"keep")
    out.chmod(0o444)
    real_access = os.access
    monkeypatch.setattr(output.os, "access", lambda p, mode: False if Path(p) == out else real_access(p, mode))
    res = _run("fold", str(_wn_checkpoint(tmp_path)), str(out))
    _one_line_error(res, "fold", 2, "read-only")
    assert out.read_bytes() == b"keep"


def test_an_output_written_by_an_earlier_command_is_not_claimed_by_the_next(tmp_path, monkeypatch):
    # Regression: after a fold in the same process, any later command stopped by Ctrl-C said
    # "<the fold's OUT> was written whole before it".
    out = tmp_path / "folded.safetensors"
    assert _run("fold", str(_wn_checkpoint(tmp_path)), str(out)).exit_code == 0

    def interrupted(*args, **kwargs):
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # the CLI's handler, as a Ctrl-C runs it

    monkeypatch.setattr("paramfold.audit.audit_checkpoint", interrupted)
    res = _run("audit", str(out))
    _one_line_error(res, "audit", 130, "interrupted by SIGINT; no output was written")


def test_a_keyboard_interrupt_raised_by_code_without_a_signal_is_a_failure_not_a_ctrl_c(monkeypatch):
    # Regression: any KeyboardInterrupt was said as "interrupted by SIGINT" with exit 130.
    def raises(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run_bench", raises)
    res = _run("bench", "--layers", "2")
    _one_line_error(res, "bench", 1, "KeyboardInterrupt: raised without a signal")
    assert "SIGINT" not in res.stderr


def test_an_output_name_over_the_length_limit_is_a_usage_error(tmp_path):
    # Regression: a name over the 255-byte limit exited 1 with the raw OSError; an output path
    # that cannot be used is exit 2.
    res = _run("fold", str(_wn_checkpoint(tmp_path)), str(tmp_path / ("x" * 300 + ".pt")))
    _one_line_error(res, "fold", 2, "cannot be used as an output path")


@pytest.mark.parametrize("command", ["audit", "fold"])
def test_an_input_name_over_the_length_limit_is_a_usage_error_as_an_output_name_is(tmp_path, command):
    # Regression: exit 1 with the raw OSError ("File name too long"), where OUT's is exit 2.
    res = _run(command, str(tmp_path / ("x" * 300 + ".pt")), *([str(tmp_path / "o.pt")] if command == "fold" else []))
    _one_line_error(res, command, 2, "cannot be used as an input path: File name too long")


# -- found by the 2026-12 CLI hunt, second round --------------------------------------------------


def _saved(path: Path, what: str, **kwargs) -> Path:
    import warnings

    t = torch.zeros(2)
    with warnings.catch_warnings():  # TypedStorage is deprecated
        warnings.simplefilter("ignore")
        obj = {"tensor": lambda: t, "parameter": lambda: torch.nn.Parameter(t),
               "untyped": lambda: t.untyped_storage(), "typed": lambda: t.storage(),
               "mixed": lambda: {"w": t, "s": torch.ones(3).untyped_storage()}}[what]()
        torch.save(obj, path, **kwargs)
    return path


@pytest.mark.parametrize("what, words", [
    ("tensor", ["(it holds a Tensor)"]), ("parameter", ["(it holds a Tensor)"]),
    ("untyped", ["(it holds an UntypedStorage)"]), ("typed", ["(it holds a TypedStorage)"]),
    ("mixed", ["'s': UntypedStorage"]),
])
def test_a_pt_file_without_a_state_dict_names_the_public_type_it_holds(tmp_path, what, words):
    # Regression: the zip-format reader named its own stub classes ("it holds a _TensorStub").
    res = _run("audit", str(_saved(tmp_path / "x.pt", what)))
    _one_line_error(res, "audit", 1, *words)
    assert "Stub" not in res.stderr
    if what == "tensor":  # as the legacy-format reader (torch.load) says it
        legacy = _run("audit", str(_saved(tmp_path / "legacy.pt", what, _use_new_zipfile_serialization=False)))
        assert legacy.stderr.replace("legacy.pt", "x.pt") == res.stderr


@pytest.mark.parametrize("args, words", [
    (["--layers", "9" * 23], ["layers must be at most 10000, got 99999999999999999999999"]),
    (["--width", "9" * 23], ["width must be at most 16384"]),
    (["--repeats", "1001"], ["repeats must be at most 1000"]),
    (["--steady-rounds", "9" * 400], ["steady_rounds must be at most 1000", "(400 digits)"]),
    (["--sweep-layers", "32,99999999999999999999999"], ["--sweep-layers: each layer count must be at most 10000"]),
    (["--sweep-layers", "32," + "9" * 5000], ["--sweep-layers: each layer count must be at most 10000", "(5000 digits)"]),
    (["--sweep-layers", "2,0"], ["--sweep-layers: each layer count must be at least 1, got 0"]),
    # Regression: --wide was ignored with --sweep-layers (the sweep's tables have no wide form)
    (["--sweep-layers", "2,3", "--wide"], ["--wide shows one run's columns; with --sweep-layers, --json"]),
])
def test_a_bench_option_out_of_range_is_a_usage_error_before_any_work(monkeypatch, args, words):
    # Regression: --layers 999... passed validation, every variant failed with an OverflowError and
    # the command exited 1; --width 999... was a TypeError "(unexpected)".
    def no_work(*a, **k):
        raise AssertionError("the bench ran")

    monkeypatch.setattr(bench, "run_bench", no_work)
    monkeypatch.setattr(bench, "run_sweep", no_work)
    res = _run("bench", *args)
    _one_line_error(res, "bench", 2, *words)
    assert res.stdout == "" and len(res.stderr) < 300


@pytest.mark.parametrize("threads", ["1025", "30000", "100000", "9" * 20])
def test_bench_threads_beyond_the_ceiling_are_a_usage_error_before_any_work(monkeypatch, threads):
    # Regression: the value went to torch.set_num_threads: 30000 ended the process in libgomp
    # (exit 1, no paramfold line), 100000 with a segmentation fault, 9...9 an "(unexpected)" error.
    def no_work(*a, **k):
        raise AssertionError("the bench ran")

    monkeypatch.setattr(bench, "run_bench", no_work)
    monkeypatch.setattr(torch, "set_num_threads", no_work)
    res = _run("bench", "--threads", threads)
    _one_line_error(res, "bench", 2, "threads must be at most 1024")
    assert "1 to 1024; 0 leaves torch's setting" in " ".join(_run("bench", "--help", env={"COLUMNS": "200"}).stdout.split())


def test_bench_negative_threads_say_the_lowest_accepted_value_is_0(monkeypatch):
    # Regression: "threads must be at least 1, got -1", where 0 (torch's setting) is accepted.
    def no_work(*a, **k):
        raise AssertionError("the bench ran")

    monkeypatch.setattr(bench, "run_bench", no_work)
    _one_line_error(_run("bench", "--threads", "-1"), "bench", 2, "threads must be at least 0 (0 leaves torch's setting), got -1")


def test_no_command_prints_the_help_and_one_error_line():
    # Regression: exit 2 with the help on stdout and nothing on stderr, where README says every
    # failure ends with one line there.
    res = _run()
    assert "audit" in res.stdout and "bench" in res.stdout
    _one_line_error(res, "", 2, "no command given", "audit", "recompiles")
    _one_line_error(_run("--debug"), "", 2, "Missing command")


_SIGNAL_AT_EXIT = textwrap.dedent(
    """
    import atexit, signal, sys
    # The last exit function to run (they run in reverse): a signal while the process exits, after
    # the command has ended, deterministically (it came during torch's teardown in the hunt).
    atexit.register(signal.raise_signal, getattr(signal, sys.argv.pop(1)))
    from paramfold.__main__ import main
    sys.argv = ["paramfold", *sys.argv[1:]]
    main()
    """
)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_signal_while_the_process_exits_after_fold_says_out_was_written_whole(tmp_path, sig, code):
    # Regression: the default handlers were back before Python's shutdown, so a SIGTERM then
    # killed the process (exit 143, nothing said) although OUT was in place, whole.
    src, out = _wn_checkpoint(tmp_path), tmp_path / "plain.safetensors"
    res = subprocess.run([sys.executable, "-c", _SIGNAL_AT_EXIT, sig.name, "fold", str(src), str(out)],
                         capture_output=True, text=True, env=ENV, timeout=120, preexec_fn=_hangup_default)
    assert res.returncode == code, (res.returncode, res.stderr)
    assert res.stderr == f"paramfold fold: error: interrupted by {sig.name}; {out} was written whole before it\n"
    assert res.stdout.startswith(f"wrote {out}: ") and sorted(load_file(out)) == ["0.bias", "0.weight", "1.bias", "1.weight"]


def test_a_signal_while_the_process_exits_after_a_failure_adds_no_second_line(tmp_path):
    res = subprocess.run([sys.executable, "-c", _SIGNAL_AT_EXIT, "SIGTERM", "audit", str(tmp_path / "missing.pt")],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, (res.returncode, res.stderr)
    assert "missing.pt: no such file or folder" in res.stderr


def test_a_signal_while_the_process_exits_after_a_command_that_wrote_stdout_says_it_had_completed(tmp_path):
    # Regression: a SIGTERM after audit's report was printed said "no output was written".
    res = subprocess.run([sys.executable, "-c", _SIGNAL_AT_EXIT, "SIGTERM", "audit", str(_wn_checkpoint(tmp_path))],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 143, (res.returncode, res.stderr)
    assert res.stderr == "paramfold audit: error: interrupted by SIGTERM; the command had completed before it, its output whole\n"
    assert "2 parametrized sites" in " ".join(res.stdout.split())


_IDLE_EXECUTOR_WORKER = textwrap.dedent(
    """
    import atexit, concurrent.futures, sys
    # What inductor's async compile leaves: a worker waiting on its queue, which stops only when
    # threading's exit hooks run (Python's exit runs them before it joins the threads).
    executor = concurrent.futures.ThreadPoolExecutor(1)  # kept alive: collected, it stops its worker
    executor.submit(int).result()
    atexit.register(print, "atexit ran")
    from paramfold.__main__ import main
    sys.argv = ["paramfold", *sys.argv[1:]]
    main()
    """
)


def test_the_command_exits_with_an_idle_executor_worker_alive(tmp_path):
    # Regression: `paramfold bench --backend inductor` printed its table, then hung for ever:
    # the process's end joined the threads before threading's exit hooks had told the worker to stop.
    try:
        res = subprocess.run([sys.executable, "-c", _IDLE_EXECUTOR_WORKER, "audit", str(_wn_checkpoint(tmp_path))],
                             capture_output=True, text=True, env=ENV, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the command did not exit: the idle executor worker was joined before it was told to stop")
    assert res.returncode == 0 and res.stderr == "", (res.returncode, res.stderr)
    assert res.stdout.rstrip().endswith("atexit ran")


_SIGNAL_SWALLOWED_IN_AN_IMPORT = textwrap.dedent(
    """
    import signal, sys
    class Swallow:  # as torch's C code does with the exception of a signal during its import of numpy
        def find_spec(self, name, path=None, target=None):
            if name == "numpy":
                sys.meta_path.remove(self)
                try:
                    signal.raise_signal(signal.SIGTERM)  # its handler runs before this returns
                except BaseException as e:
                    sys.stderr.write(f"swallowed {type(e).__name__}\\n")
    sys.meta_path.insert(0, Swallow())
    from paramfold.__main__ import main
    sys.argv = ["paramfold", *sys.argv[1:]]
    main()
    """
)


def test_a_signal_whose_exception_an_import_swallows_still_interrupts_the_fold(tmp_path):
    # Regression: a SIGTERM during start-up was raised inside numpy's import, started by torch's
    # C code, which dropped the exception: the fold ran on, wrote OUT and exited 0.
    src, out = _wn_checkpoint(tmp_path), tmp_path / "plain.pt"
    out.write_bytes(b"previous output")
    res = subprocess.run([sys.executable, "-c", _SIGNAL_SWALLOWED_IN_AN_IMPORT, "fold", str(src), str(out)],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 143, (res.returncode, res.stderr)
    # (Since 2026-12-05 a signal during the imports is recorded there and raised after them: nothing
    # is raised inside the import for it to swallow.)
    assert res.stderr.splitlines() == ["paramfold fold: error: interrupted by SIGTERM; no output was written"]
    assert res.stdout == "" and _listing(tmp_path) == {src.name: src.read_bytes(), out.name: b"previous output"}


def test_a_failure_after_a_swallowed_signal_is_said_as_the_interrupt(tmp_path, monkeypatch):
    # The dropped exception may leave a library half imported (torch: "Numpy is not available"):
    # what the command then fails with follows from the signal, which is what is said.
    import paramfold.fold

    def swallowed_then_failed(*args, **kwargs):
        try:
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # the CLI's handler, as a signal runs it
        except KeyboardInterrupt:
            pass
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(paramfold.fold, "fold_checkpoint", swallowed_then_failed)
    res = _run("fold", str(_wn_checkpoint(tmp_path)), str(tmp_path / "o.pt"))
    _one_line_error(res, "fold", 143, "interrupted by SIGTERM; no output was written")
    assert not (tmp_path / "o.pt").exists()


def test_an_output_is_not_put_in_place_after_a_swallowed_signal(tmp_path):
    from paramfold.output import atomic_output
    from paramfold.signals import Interrupted, signals_raise

    target = tmp_path / "o.bin"
    with signals_raise(), pytest.raises(Interrupted):
        with atomic_output(target) as f:
            f.write(b"data")
            try:
                signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
            except KeyboardInterrupt:
                pass  # dropped: the output is still not committed
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["entering", "leaving"])
def test_a_second_signal_during_the_cleanup_leaves_no_temporary_file(tmp_path, monkeypatch, where):
    # Regression (helper-200): Ctrl-C twice, or SIGINT then SIGTERM, while an output was written:
    # the second signal's handler raised on the way into the cleanup's blocked section (a mask
    # cannot stop a signal already received), before the temporary file was removed, and the
    # command said "no output was written" beside a hidden .partial of the full size.
    import contextlib

    import paramfold.output
    from paramfold.signals import Interrupted, signals_blocked, signals_raise

    second = []

    @contextlib.contextmanager
    def second_signal_arrives():
        if where == "entering" and not second:
            second.append(signal.SIGTERM)
            raise Interrupted(signal.SIGTERM)
        with signals_blocked():
            yield
        if where == "leaving" and not second:
            second.append(signal.SIGTERM)
            raise Interrupted(signal.SIGTERM)

    target = tmp_path / "o.bin"
    target.write_bytes(b"before")
    monkeypatch.setattr(paramfold.output, "signals_blocked", second_signal_arrives)
    with signals_raise(), pytest.raises(Interrupted) as raised:
        with paramfold.output.atomic_output(target) as f:
            f.write(b"data")
            raise Interrupted(signal.SIGINT)
    assert raised.value.signum == signal.SIGINT and second  # the first says what happened
    assert [p.name for p in tmp_path.iterdir()] == ["o.bin"] and target.read_bytes() == b"before"


def test_a_signal_whose_exception_was_dropped_stops_bench_at_its_next_step(monkeypatch):
    # Regression (2026-12-05 hunt): Ctrl-C raised inside a GC callback (gc.collect between
    # measurements) was dropped by Python; the bench ran every measurement to the end, printed
    # its table, and only then said "interrupted ...; no output was written".
    import paramfold.bench

    steps = []

    def dropped_then_ran_on(config, on_progress=None):
        on_progress(0, 3, "one")
        steps.append(1)
        try:
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
        except KeyboardInterrupt:
            pass  # dropped, as Python drops one raised in a weakref callback
        on_progress(1, 3, "two")
        steps.append(2)
        raise AssertionError("ran on past the signal")

    monkeypatch.setattr(paramfold.bench, "run_bench", dropped_then_ran_on)
    res = _run("bench", "--layers", "2", "--repeats", "1")
    assert res.exit_code == 130, res.output
    assert res.stderr.splitlines()[-1] == "paramfold bench: error: interrupted by SIGINT; no output was written"
    assert steps == [1] and res.stdout == "" and "Traceback" not in res.stderr


def test_a_signal_in_a_callback_python_cannot_raise_from_is_silent_and_raised_at_the_next_safe_point(capfd):
    # Python prints "Exception ignored in ..." and a traceback for an exception raised in a
    # __del__ or weakref callback; the signal is recorded, so it is raised again where it can be.
    from paramfold.signals import Interrupted, raise_if_interrupted, signals_raise

    class Interrupts:
        def __del__(self):
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)

    with signals_raise(), pytest.raises(Interrupted):
        Interrupts()  # dropped at once: its __del__ raises where nothing can catch it
        raise_if_interrupted()
    assert "Exception ignored" not in capfd.readouterr().err


def test_a_signal_during_the_heavy_imports_is_raised_after_them():
    # A signal raised inside torch's C++ initialisation (torch._C._c10d_init runs Python) ended
    # the process with std::terminate (exit 134, a C++ trace): recorded there, raised after.
    from paramfold.signals import Interrupted, signals_deferred, signals_raise

    done = False
    with signals_raise(), pytest.raises(Interrupted) as raised:
        with signals_deferred():
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
            done = True  # not raised inside the block: when it ends
    assert done
    assert raised.value.signum == signal.SIGTERM


def test_the_fold_summary_shows_a_control_character_in_outs_name_escaped(tmp_path):
    # Regression (2026-12-05 hunt): error lines escaped it, the summary printed it raw (a newline
    # split the one-line summary, an escape sequence reached the terminal).
    out = tmp_path / "o\nut\x1b[2J.safetensors"
    res = _run("fold", str(_wn_checkpoint(tmp_path)), str(out))
    assert res.exit_code == 0 and out.exists(), res.output
    assert res.stdout.count("\n") == 1 and "\x1b" not in res.stdout and "o\\nut\\x1b[2J" in res.stdout, res.stdout


def test_an_empty_folder_names_every_suffix_looked_for(tmp_path):
    from paramfold.checkpoint.common import PT_SUFFIXES

    res = _run("audit", str(tmp_path))
    _one_line_error(res, "audit", 2, "no checkpoint in this folder", *(f"*{s}" for s in PT_SUFFIXES))


@pytest.mark.parametrize("columns", [None, " 90", "abc"])
def test_audit_piped_to_a_file_keeps_module_paths_and_lines_whole(tmp_path, columns):
    # Regression (helper-227): on a pipe or file rich took 80 columns: module paths were split
    # across lines (a grep of a CI log for them found nothing), and the header and summary lines
    # were wrapped and padded with spaces to the table's width. Also (helper-233) where COLUMNS
    # was set to what rich ignores (not a positive number).
    inner = torch.nn.Module()
    inner.positional_convolution_embedding = weight_norm(torch.nn.Conv1d(4, 4, 3))
    model = torch.nn.Module()
    model.feature_encoder_with_a_long_name = inner
    path = tmp_path / "a_checkpoint_with_a_rather_long_file_name_as_real_ones_have.pt"
    torch.save(model.state_dict(), path)
    env = {k: v for k, v in ENV.items() if k != "COLUMNS"} | ({} if columns is None else {"COLUMNS": columns})
    proc = subprocess.run([sys.executable, "-m", "paramfold", "audit", str(path)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "feature_encoder_with_a_long_name.positional_convolution_embedding" in proc.stdout, proc.stdout
    assert lines[0] == f"{path} [pt]", lines[0]
    assert lines[-1].startswith("1 parametrized site (weight_norm 1); stored") and not lines[-1].endswith(" "), lines
