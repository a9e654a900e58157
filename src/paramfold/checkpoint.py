"""Safe, lazy reading and atomic, streaming writing of checkpoints.

Reading never runs pickled code and never loads tensor data until a tensor is asked for:

* ``.pt`` / ``.pth`` / ``.bin`` / ``.ckpt``: ``torch.load(weights_only=True, map_location="meta")``
  gives every tensor's shape, dtype and layout, plus the byte offset of its storage in the zip archive
  (read from the archive's own directory, no data touched). A tensor's bytes are then read with one
  positioned read. Where torch cannot give offsets (torch < 2.7), ``torch.load(weights_only=True,
  mmap=True)`` is used instead; legacy (non-zip) files are read with ``weights_only=True`` in memory.
* ``.safetensors``: ``safetensors.safe_open`` validates the header and gives keys, shapes, dtypes and
  metadata; data is read by positioned reads at the header's offsets (not through a memory map, so a
  streamed pass over a large file does not pile up resident pages).
* A Hugging Face style folder (``*.safetensors.index.json`` or ``*.bin.index.json``), or the index
  file itself: every key is read from the shard that the index names.
* A training checkpoint (a dict with a nested ``state_dict``, ``model`` or ``model_state_dict``) is
  read from that entry.

Writing (``write_checkpoint``) goes to a temporary file in the target folder that is renamed over the
target only when complete, and streams: tensors are written one at a time, as they are produced.

Example::

    >>> import torch, tempfile, os
    >>> from paramfold.checkpoint import open_checkpoint, write_state_dict
    >>> d = tempfile.mkdtemp()
    >>> write_state_dict(os.path.join(d, "m.safetensors"), {"w": torch.ones(2, 3)})
    24
    >>> with open_checkpoint(os.path.join(d, "m.safetensors")) as ckpt:
    ...     print(ckpt.format, ckpt.keys(), ckpt.info("w").shape, ckpt.read("w").sum().item())
    safetensors ['w'] (2, 3) 6.0
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import pickle
import re
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from paramfold.errors import FoldError

__all__ = [
    "CheckpointError",
    "TensorInfo",
    "Checkpoint",
    "open_checkpoint",
    "write_checkpoint",
    "write_state_dict",
    "PT_SUFFIXES",
    "SAFETENSORS_SUFFIX",
]

PT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SAFETENSORS_SUFFIX = ".safetensors"
# Where a training checkpoint keeps the model's state dict, in the order they are tried.
NESTED_STATE_DICT_KEYS = ("state_dict", "model", "model_state_dict")


class CheckpointError(FoldError):
    """A checkpoint cannot be read or written as asked. The message is one line saying what to do.

    ``exit_code`` is what the CLI exits with: 2 for a wrong invocation (missing path, unsupported
    format, missing output folder), 1 for a problem in the file's contents.
    """

    def __init__(self, message: str, *, exit_code: int = 1) -> None:
        super().__init__(" ".join(message.split()))
        self.exit_code = exit_code


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of a stored tensor, known without reading its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _element_size(self.dtype)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype_name}

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorInfo:
        return cls(tuple(t.shape), t.dtype)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    """Where one tensor's bytes are: ``file`` at byte ``offset`` (the start of its storage)."""

    info: TensorInfo
    file: Path | None = None
    offset: int = 0
    stride: tuple[int, ...] | None = None  # None: contiguous
    storage_offset: int = 0  # in elements
    tensor: torch.Tensor | None = None  # already loaded (legacy files, torch < 2.7, mmap)


class Checkpoint:
    """A lazily read checkpoint: keys, shapes and dtypes up front, tensor data on ``read(key)``.

    Use ``open_checkpoint(path)`` to get one; close it (or use it as a context manager) to release
    its file handles.
    """

    def __init__(
        self,
        path: Path,
        format: str,
        entries: dict[str, _Entry],
        *,
        root: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.path = path
        self.format = format
        self.root = root
        self.metadata = dict(metadata or {})
        self._entries = entries
        self._files: dict[Path, io.BufferedReader] = {}

    def keys(self) -> list[str]:
        return list(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def info(self, key: str) -> TensorInfo:
        return self._entries[key].info

    def read(self, key: str, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor stored under ``key``, read now into CPU memory that nothing else shares.

        With ``out`` (a 1-D ``uint8`` CPU tensor), the bytes are read into ``out`` and the result is a
        view of it, valid until ``out`` is reused: a streamed pass then allocates nothing per tensor
        (repeatedly allocating and freeing large tensors grows the heap with glibc's malloc).
        """
        e = self._entries[key]
        shape, dtype = e.info.shape, e.info.dtype
        if e.tensor is not None:
            if out is None or out.numel() < e.info.nbytes:
                return e.tensor.clone(memory_format=torch.contiguous_format)
            view = out[: e.info.nbytes].view(dtype).view(shape)
            return view.copy_(e.tensor)
        stride = e.stride if e.stride is not None else _contiguous_stride(shape)
        numel = e.info.numel
        span = 0 if numel == 0 else 1 + sum((s - 1) * st for s, st in zip(shape, stride))
        nbytes = span * _element_size(dtype)
        if out is not None and out.dtype == torch.uint8 and out.numel() >= nbytes and nbytes:
            raw = out[:nbytes]
        else:
            raw = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            start = e.offset + e.storage_offset * _element_size(dtype)
            self._read_into(e.file, start, memoryview(raw.numpy()), nbytes, key)  # type: ignore[arg-type]
        flat = raw.view(dtype) if nbytes else torch.empty(0, dtype=dtype)
        result = flat.as_strided(shape, stride)
        return result if result.is_contiguous() else result.contiguous()

    def _read_into(self, file: Path, start: int, buf: memoryview, nbytes: int, key: str) -> None:
        f = self._files.get(file)
        if f is None:
            f = self._files[file] = open(file, "rb", buffering=0)  # noqa: SIM115 (closed in close())
        f.seek(start)
        got = 0
        while got < nbytes:
            n = f.readinto(buf[got:nbytes])
            if not n:
                raise CheckpointError(
                    f"{file}: truncated: tensor '{key}' needs {nbytes} bytes at offset {start}, "
                    f"the file ends after {got}; re-download or re-save the checkpoint"
                )
            got += n

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, format={self.format!r}, tensors={len(self)})"


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open a checkpoint for lazy, safe reading (see the module docstring for the formats).

    Raises ``CheckpointError`` with a one-line message for a missing path, an unsupported format, a
    truncated or corrupt file, or a pickle that would need to run code.

    Example::

        >>> import torch, tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> torch.save({"epoch": 3, "state_dict": {"lin.weight": torch.zeros(4, 2)}}, p)
        >>> ckpt = open_checkpoint(p)
        >>> ckpt.format, ckpt.root, ckpt.keys(), ckpt.info("lin.weight").dtype_name
        ('pt', 'state_dict', ['lin.weight'], 'float32')
        >>> ckpt.close()
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder", exit_code=2)
    if p.is_dir():
        return _open_folder(p)
    name = p.name.lower()
    if name.endswith(".index.json"):
        return _open_index(p)
    if name.endswith(SAFETENSORS_SUFFIX):
        entries, metadata = _safetensors_entries(p)
        return Checkpoint(p, "safetensors", entries, metadata=metadata)
    if name.endswith(PT_SUFFIXES):
        entries, root = _pt_entries(p)
        return Checkpoint(p, "pt", entries, root=root)
    raise CheckpointError(
        f"{p}: unsupported checkpoint format '{p.suffix or p.name}': expected "
        f"{', '.join(PT_SUFFIXES)}, {SAFETENSORS_SUFFIX}, a *.safetensors.index.json "
        "or a folder holding one",
        exit_code=2,
    )


def _open_folder(folder: Path) -> Checkpoint:
    indexes = sorted(folder.glob("*.safetensors.index.json")) or sorted(
        q for q in folder.glob("*.index.json") if q.name.lower().endswith(tuple(f"{s}.index.json" for s in PT_SUFFIXES))
    )
    if len(indexes) == 1:
        return _open_index(indexes[0])
    if len(indexes) > 1:
        names = ", ".join(q.name for q in indexes)
        raise CheckpointError(f"{folder}: several index files ({names}): pass the one to audit", exit_code=2)
    singles = sorted(folder.glob(f"*{SAFETENSORS_SUFFIX}")) or sorted(
        q for q in folder.iterdir() if q.is_file() and q.name.lower().endswith(PT_SUFFIXES)
    )
    if len(singles) == 1:
        return open_checkpoint(singles[0])
    if not singles:
        raise CheckpointError(
            f"{folder}: no checkpoint in this folder (looked for *.safetensors.index.json, "
            "*.safetensors, *.pt, *.pth, *.bin)",
            exit_code=2,
        )
    names = ", ".join(q.name for q in singles[:4])
    raise CheckpointError(
        f"{folder}: several checkpoint files and no index ({names}, ...): pass one file", exit_code=2
    )


def _open_index(index: Path) -> Checkpoint:
    try:
        doc = json.loads(index.read_text())
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to shard file names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a valid checkpoint index ({type(e).__name__}: {e})") from None
    shards: dict[str, dict[str, _Entry]] = {}
    kinds: set[str] = set()
    for shard in dict.fromkeys(weight_map.values()):
        sp = (index.parent / shard).resolve()
        if index.parent.resolve() not in sp.parents:
            raise CheckpointError(f"{index}: shard '{shard}' lies outside the index's folder")
        if not sp.is_file():
            raise CheckpointError(f"{index}: shard '{shard}' named by the index is missing")
        if sp.name.lower().endswith(SAFETENSORS_SUFFIX):
            shards[shard], _ = _safetensors_entries(sp)
            kinds.add("safetensors")
        elif sp.name.lower().endswith(PT_SUFFIXES):
            shards[shard], _ = _pt_entries(sp)
            kinds.add("pt")
        else:
            raise CheckpointError(f"{index}: shard '{shard}' has an unsupported format")
    entries: dict[str, _Entry] = {}
    for key, shard in weight_map.items():
        if key not in shards[shard]:
            raise CheckpointError(f"{index}: the index puts '{key}' in '{shard}', but that shard lacks it")
        entries[key] = shards[shard][key]
    fmt = "sharded-" + ("safetensors" if kinds == {"safetensors"} else "pt" if kinds == {"pt"} else "mixed")
    metadata = {k: str(v) for k, v in (doc.get("metadata") or {}).items()}
    return Checkpoint(index, fmt, entries, metadata=metadata)


def _safetensors_entries(p: Path) -> tuple[dict[str, _Entry], dict[str, str]]:
    from safetensors import safe_open

    try:
        # safe_open validates the header: offsets in bounds, contiguous, matching shapes and dtypes.
        with safe_open(str(p), framework="pt") as f:
            metadata = f.metadata() or {}
            infos = {}
            for k in f.keys():
                sl = f.get_slice(k)
                infos[k] = TensorInfo(tuple(sl.get_shape()), _st_dtype(sl.get_dtype(), p))
        with open(p, "rb") as f:
            (n,) = _unpack_u64(f.read(8))
            header = json.loads(f.read(n))
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own SafetensorError, plus OSError / ValueError
        raise CheckpointError(f"{p}: not a valid safetensors file ({_first_line(e)})") from None
    base = 8 + n
    # In the order the data lies in the file (safe_open lists keys sorted by name).
    order = sorted(infos, key=lambda k: (header[k]["data_offsets"][0], k))
    entries = {k: _Entry(infos[k], p, base + header[k]["data_offsets"][0]) for k in order}
    return entries, metadata


def _unpack_u64(b: bytes) -> tuple[int]:
    if len(b) != 8:
        raise ValueError("file too short for a safetensors header")
    return (int.from_bytes(b, "little"),)


_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
}
for _name, _attr in [
    ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
]:
    if hasattr(torch, _attr):
        _ST_DTYPES[_name] = getattr(torch, _attr)
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def _st_dtype(name: str, p: Path) -> torch.dtype:
    try:
        return _ST_DTYPES[name.upper()]
    except KeyError:
        raise CheckpointError(f"{p}: safetensors dtype {name} has no torch equivalent here") from None


def _plain_only(sd: dict[str, torch.Tensor], p: Path) -> dict[str, torch.Tensor]:
    for k, t in sd.items():
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise CheckpointError(
                f"{p}: '{k}' is a {type(t).__name__} (a tensor subclass); paramfold reads plain tensors: "
                "save the model after torchao.utils.unwrap_tensor_subclass(model), or its plain state dict"
            )
    return sd


def _pt_entries(p: Path) -> tuple[dict[str, _Entry], str | None]:
    with open(p, "rb") as f:
        is_zip = f.read(4) == b"PK\x03\x04"
    if not is_zip:
        obj = _torch_load(p)  # legacy format: no mmap, no offsets; weights_only still applies
        sd, root = _find_state_dict(obj, p)
        _plain_only(sd, p)
        return {k: _Entry(TensorInfo.of(t), tensor=t) for k, t in sd.items()}, root
    try:  # the zip's central directory sits at its end: a truncated file has none
        with zipfile.ZipFile(p) as z:
            z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        raise CheckpointError(f"{p}: truncated or corrupt PyTorch checkpoint (the zip archive is incomplete)") from None
    obj = _torch_load(p, map_location="meta")
    sd, root = _find_state_dict(obj, p)
    _plain_only(sd, p)
    entries: dict[str, _Entry] = {}
    for k, t in sd.items():
        offset = getattr(t.untyped_storage(), "_checkpoint_offset", None) if t.device.type == "meta" else None
        if offset is None:
            break
        entries[k] = _Entry(TensorInfo.of(t), p, offset, tuple(t.stride()), t.storage_offset())
    else:
        return entries, root
    # torch < 2.7 gives no storage offsets: map the file instead (data is paged in only when read).
    obj = _torch_load(p, mmap=True)
    sd, root = _find_state_dict(obj, p)
    return {k: _Entry(TensorInfo.of(t), tensor=t) for k, t in sd.items()}, root


def _torch_load(p: Path, **kwargs: Any) -> Any:
    try:
        return torch.load(p, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        msg = str(e)
        m = re.search(r"GLOBAL ([\w.]+)", msg)
        if m:
            why = f"it references '{m.group(1)}', which could run arbitrary code"
        else:
            detail = re.search(r"(Unsupported operand[^\n]*|WeightsUnpickler error:[^\n]+)", msg)
            why = (
                "it is not a plain weights-only pickle"
                + (f" ({detail.group(1).strip()})" if detail else "")
                + ": either corrupt or it needs code execution"
            )
        raise CheckpointError(
            f"{p}: refused to unpickle: {why}; paramfold only reads tensors (torch.load weights_only=True). "
            "If you trust the file, re-save just its state dict, e.g. torch.save(model.state_dict(), 'clean.pt')"
        ) from None
    except Exception as e:
        if "central directory" in str(e) or isinstance(e, (EOFError, zipfile.BadZipFile)):
            raise CheckpointError(f"{p}: truncated or corrupt PyTorch checkpoint (the zip archive is incomplete)") from None
        raise CheckpointError(f"{p}: cannot read this PyTorch checkpoint ({_first_line(e)})") from None


def _find_state_dict(obj: Any, p: Path) -> tuple[dict[str, torch.Tensor], str | None]:
    if _is_state_dict(obj):
        return dict(obj), None
    if isinstance(obj, Mapping):
        for key in NESTED_STATE_DICT_KEYS:
            sub = obj.get(key)
            if _is_state_dict(sub):
                return dict(sub), key
        where = f"top-level keys: {', '.join(map(str, list(obj)[:8]))}"
    else:
        where = f"it holds a {type(obj).__name__}"
    raise CheckpointError(
        f"{p}: no state dict found ({where}); expected a dict of tensors or one under "
        + " / ".join(f"'{k}'" for k in NESTED_STATE_DICT_KEYS)
    )


def _is_state_dict(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping)
        and len(obj) > 0
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


def write_checkpoint(
    path: str | os.PathLike[str],
    specs: Mapping[str, TensorInfo],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write ``tensors`` to ``path`` (``.safetensors`` or a ``.pt``-style file), one at a time.

    ``specs`` announces every key with its shape and dtype, in order; ``tensors`` yields the same
    keys in the same order (it may compute each tensor just before it is yielded, so no more than one
    is alive at a time). The file is written to a temporary file in the target folder and renamed
    over ``path`` only when complete; on any error nothing is left behind. Returns the bytes of
    tensor data written. ``.pt`` output loads with ``torch.load(weights_only=True, mmap=True)``.

    Example::

        >>> import torch, tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "out.pt")
        >>> t = torch.arange(6.0).view(2, 3)
        >>> write_checkpoint(p, {"t": TensorInfo.of(t)}, iter([("t", t)]))
        24
        >>> torch.equal(torch.load(p, weights_only=True)["t"], t)
        True
    """
    out = Path(path)
    fmt = _output_format(out)
    with _atomic_output(out) as f:
        if fmt == "safetensors":
            return _write_safetensors(f, specs, tensors, metadata)
        return _write_pt(f, specs, tensors)


@contextlib.contextmanager
def _atomic_output(out: Path) -> Iterator[IO[bytes]]:
    """A binary file that replaces ``out`` only if the block completes; nothing is left otherwise."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise CheckpointError(f"{out}: the output folder {parent} does not exist", exit_code=2)
    if out.is_dir():
        raise CheckpointError(f"{out}: is a folder; give a file name ending in .safetensors or .pt", exit_code=2)
    fd, tmp_name = tempfile.mkstemp(dir=parent, prefix=f".{out.name}.", suffix=".partial")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_state_dict(path: str | os.PathLike[str], state_dict: Mapping[str, torch.Tensor]) -> int:
    """Atomically write an in-memory state dict (``.safetensors`` or ``.pt``). Returns data bytes.

    Plain tensors go through ``write_checkpoint``. Tensor subclasses (e.g. torchao's ``Int8Tensor``)
    can only be written to ``.pt``, through ``torch.save``.

    Example::

        >>> import torch, tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "sd.safetensors")
        >>> write_state_dict(p, {"a": torch.zeros(3), "b": torch.ones(2, dtype=torch.bfloat16)})
        16
    """
    out = Path(path)
    fmt = _output_format(out)
    subclassed = [k for k, t in state_dict.items() if type(t) not in (torch.Tensor, torch.nn.Parameter)]
    if not subclassed:
        specs = {k: TensorInfo.of(t) for k, t in state_dict.items()}
        return write_checkpoint(out, specs, state_dict.items())
    if fmt == "safetensors":
        k = subclassed[0]
        raise CheckpointError(
            f"'{k}' is a {type(state_dict[k]).__name__} (a tensor subclass), which .safetensors cannot "
            "hold; write the folded checkpoint to a .pt file instead",
            exit_code=2,
        )
    with _atomic_output(out) as f:
        torch.save(dict(state_dict), f)
    return sum(_flat_nbytes(t) for t in state_dict.values())


def _flat_nbytes(t: torch.Tensor) -> int:
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_flat_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _output_format(out: Path) -> str:
    name = out.name.lower()
    if name.endswith(SAFETENSORS_SUFFIX):
        return "safetensors"
    if name.endswith(PT_SUFFIXES):
        return "pt"
    raise CheckpointError(
        f"{out}: unsupported output format '{out.suffix or out.name}': use .safetensors or .pt", exit_code=2
    )


def _checked(
    specs: Mapping[str, TensorInfo], tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    keys = iter(specs)
    for key, t in tensors:
        want = next(keys, None)
        if key != want:
            raise ValueError(f"write_checkpoint: got tensor '{key}' where '{want}' was announced")
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise CheckpointError(f"'{key}' is a {type(t).__name__}; only plain tensors can be streamed")
        if TensorInfo.of(t) != specs[key]:
            raise ValueError(f"write_checkpoint: '{key}' is {TensorInfo.of(t)}, announced {specs[key]}")
        yield key, t.detach().to("cpu").contiguous()
    missing = next(keys, None)
    if missing is not None:
        raise ValueError(f"write_checkpoint: announced tensor '{missing}' was never produced")


def _raw_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_safetensors(
    f: io.BufferedWriter,
    specs: Mapping[str, TensorInfo],
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: Mapping[str, str] | None,
) -> int:
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for key, info in specs.items():
        if info.dtype not in _ST_NAMES:
            raise CheckpointError(f"'{key}' has dtype {info.dtype_name}, which .safetensors cannot hold; write .pt")
        header[key] = {"dtype": _ST_NAMES[info.dtype], "shape": list(info.shape), "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data section to 8 bytes
    f.write(len(blob).to_bytes(8, "little"))
    f.write(blob)
    for _, t in _checked(specs, tensors):
        if t.numel():
            f.write(_raw_bytes(t))
    return offset


class _StorageRef:
    def __init__(self, key: str, storage_type: Any, numel: int) -> None:
        self.pid = ("storage", storage_type, key, "cpu", numel)


class _TensorRef:
    """Pickles like a CPU tensor saved by ``torch.save``, whose storage is record ``data/<key>``."""

    def __init__(self, key: str, info: TensorInfo) -> None:
        self.key, self.info = key, info

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from torch.storage import _dtype_to_storage_type_map

        info = self.info
        stride = _contiguous_stride(info.shape)
        legacy = _dtype_to_storage_type_map().get(info.dtype)
        if legacy is not None:
            storage = _StorageRef(self.key, getattr(torch, legacy), info.numel)
            return torch._utils._rebuild_tensor_v2, (
                storage, 0, info.shape, stride, False, collections.OrderedDict(),
            )
        storage = _StorageRef(self.key, torch.UntypedStorage, info.nbytes)
        return torch._utils._rebuild_tensor_v3, (
            storage, 0, info.shape, stride, False, collections.OrderedDict(), info.dtype,
        )


class _RefPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _StorageRef) else None


def _write_pt(
    f: io.BufferedWriter, specs: Mapping[str, TensorInfo], tensors: Iterable[tuple[str, torch.Tensor]]
) -> int:
    # The same zip layout torch.save writes (PyTorchFileWriter: aligned records, CRCs), except that
    # every storage record is written as soon as its tensor exists and the pickle comes last.
    refs: dict[str, _TensorRef] = {}
    nbytes = 0
    with torch.serialization._open_zipfile_writer(f) as zf:
        for i, (key, t) in enumerate(_checked(specs, tensors)):
            storage = t.untyped_storage()
            if storage.nbytes() != t.nbytes or t.storage_offset():
                start = t.storage_offset() * t.element_size()
                storage = storage[start : start + t.nbytes]  # a view of the same memory, no copy
            zf.write_record(f"data/{i}", storage, t.nbytes)
            refs[key] = _TensorRef(str(i), specs[key])
            nbytes += t.nbytes
        buf = io.BytesIO()
        _RefPickler(buf, protocol=2).dump(refs)
        data = buf.getvalue()
        zf.write_record("data.pkl", data, len(data))
        zf.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    return nbytes
