"""Safe, lazy, verified reading and atomic, streaming writing of checkpoints.

Reading never runs pickled code, never loads tensor data until a tensor is asked for, and checks
every byte it reads where the format allows:

* ``.pt`` / ``.pth`` / ``.bin`` / ``.ckpt`` (``torch.save``'s zip archive): the archive's directory
  is read with :mod:`zipfile`, and its ``data.pkl`` with a restricted unpickler that knows only
  plain containers, dtypes and torch's dense-tensor rebuild functions (anything else is refused,
  never called or imported), giving every tensor's shape, dtype, stride and storage record without
  touching tensor data. This is the same on every torch version. A tensor's bytes are read on
  ``read(key)`` from its ``data/<key>`` record, whose CRC-32 (stored in the zip) is checked: a
  flipped byte is an error, never a silently different weight. A tensor that needs more bytes than
  its record holds is refused when the file is opened. Legacy (non-zip) files have no checksum:
  they are read with ``torch.load(weights_only=True)`` in memory.
* ``.safetensors``: ``safetensors.safe_open`` validates the header (offsets within the file,
  contiguous, consistent with shapes and dtypes) and gives keys, shapes, dtypes and metadata; data
  is read by positioned reads at the header's offsets (not through a memory map, so a streamed
  pass over a large file does not pile up resident pages). The format has no checksum.
* A Hugging Face style folder (``*.safetensors.index.json`` or ``*.bin.index.json``), or the index
  file itself: every key is read from the shard that the index names.
* A training checkpoint (a dict with a nested ``state_dict``, ``model`` or ``model_state_dict``) is
  read from that entry.

Writing (``write_checkpoint``) goes through :func:`paramfold.output.atomic_output` (a temporary
file renamed over the target only when complete, normal permissions, nothing left on an error or
a signal), and streams: tensors are written one at a time, as they are produced. ``.pt`` output is
the zip layout ``torch.save`` writes (records aligned to 64 bytes, CRC-32 per record), written
with :mod:`zipfile`.

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
import io
import json
import os
import pickle
import re
import struct
import sys
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from paramfold.errors import FoldError
from paramfold.output import OutputError, atomic_output, check_output

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
    tensor: torch.Tensor | None = None  # already loaded (legacy non-zip files)
    record: zipfile.ZipInfo | None = None  # .pt: the zip record holding the storage (CRC checked)


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
        files: Iterable[Path] = (),
    ) -> None:
        self.path = path
        self.format = format
        self.root = root
        self.metadata = dict(metadata or {})
        self._entries = entries
        self._files: dict[Path, io.BufferedReader] = {}
        # Every file this checkpoint reads (the index and its shards for a sharded checkpoint).
        self.files: list[Path] = list(dict.fromkeys([path, *files, *(e.file for e in entries.values() if e.file)]))

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
        elem = _element_size(dtype)
        nbytes = span * elem
        start = e.storage_offset * elem
        if e.record is not None:  # read the whole storage record, so that its CRC-32 can be checked
            start, nbytes = 0, e.record.file_size
        if out is not None and out.dtype == torch.uint8 and out.numel() >= nbytes and nbytes:
            raw = out[:nbytes]
        else:
            raw = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            buf = memoryview(raw.numpy())
            if e.record is not None:
                self._read_record(e, buf, key)
            else:
                self._read_into(e.file, e.offset + start, buf, nbytes, key)  # type: ignore[arg-type]
        if e.record is not None:
            first = e.storage_offset * elem
            raw = raw[first : first + span * elem]
        flat = raw.view(dtype) if numel else torch.empty(0, dtype=dtype)
        result = flat.as_strided(shape, stride)
        if not result.is_contiguous():
            return result.contiguous()
        if out is None and raw.untyped_storage().nbytes() != result.nbytes:
            return result.clone()  # a view into a larger storage record: keep only its own bytes
        return result

    def _read_record(self, e: _Entry, buf: memoryview, key: str) -> None:
        rec = e.record
        assert rec is not None and e.file is not None
        f = self._open(e.file)
        f.seek(rec.header_offset)
        header = f.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise CheckpointError(f"{e.file}: corrupt PyTorch checkpoint: the zip record of tensor '{key}' is damaged")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        self._read_into(e.file, rec.header_offset + 30 + name_len + extra_len, buf, rec.file_size, key)
        if zlib.crc32(buf[: rec.file_size]) != rec.CRC:
            raise CheckpointError(
                f"{e.file}: corrupt: the bytes of tensor '{key}' fail their CRC-32 check (record "
                f"{rec.filename}); the file was damaged after it was saved: re-download or re-save it"
            )

    def _open(self, file: Path) -> io.BufferedReader:
        f = self._files.get(file)
        if f is None:
            f = self._files[file] = open(file, "rb", buffering=0)  # noqa: SIM115 (closed in close())
        return f

    def _read_into(self, file: Path, start: int, buf: memoryview, nbytes: int, key: str) -> None:
        f = self._open(file)
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
    files = [(index.parent / shard).resolve() for shard in dict.fromkeys(weight_map.values())]
    return Checkpoint(index, fmt, entries, metadata=metadata, files=files)


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
        obj = _torch_load(p)  # legacy format: no offsets, no checksums; weights_only still applies
        sd, root = _find_state_dict(obj, p)
        _plain_only(sd, p)
        return {k: _Entry(TensorInfo.of(t), tensor=t) for k, t in sd.items()}, root
    try:  # the zip's central directory sits at its end: a truncated file has none
        with zipfile.ZipFile(p) as z:
            infos = z.infolist()
            pickles = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
            if len(pickles) != 1:
                raise CheckpointError(f"{p}: not a PyTorch checkpoint (a zip archive without one data.pkl)")
            prefix = pickles[0].filename[: -len("data.pkl")]
            data = z.read(pickles[0])  # zipfile checks its CRC-32
            byteorder = z.read(prefix + "byteorder") if prefix + "byteorder" in z.NameToInfo else b"little"
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as e:
        detail = "the zip archive is incomplete" if "CRC" not in str(e) else _first_line(e)
        raise CheckpointError(f"{p}: truncated or corrupt PyTorch checkpoint ({detail})") from None
    if byteorder.decode(errors="replace") != sys.byteorder:
        raise CheckpointError(
            f"{p}: saved on a {byteorder.decode(errors='replace')}-endian machine; load and re-save it there"
        )
    try:
        obj = _StubUnpickler(io.BytesIO(data)).load()
    except _Refused as r:
        _explain_refusal(p, r.name)
        raise AssertionError("unreachable") from None
    except Exception as e:  # a malformed pickle: torch's own rebuild functions got the wrong arguments
        raise CheckpointError(f"{p}: corrupt PyTorch checkpoint: its data.pkl does not unpickle ({_first_line(e)})") from None
    sd, root = _find_state_dict(obj, p, tensor_type=_TensorStub)
    records = {i.filename[len(prefix) + len("data/"):]: i for i in infos if i.filename.startswith(prefix + "data/")}
    entries: dict[str, _Entry] = {}
    for k, t in sd.items():
        rec = records.get(t.storage.key)
        if rec is None:
            raise CheckpointError(f"{p}: corrupt PyTorch checkpoint: the storage of '{k}' (record data/{t.storage.key}) is missing")
        if rec.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{p}: record {rec.filename} is compressed; torch.save never compresses: re-save it")
        elem = _element_size(t.dtype)
        storage_bytes = t.storage.numel * (elem if t.storage.typed else 1)
        span = 0 if 0 in t.shape else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride))
        needed = (t.offset + span) * elem if span else 0
        if storage_bytes != rec.file_size or needed > rec.file_size or t.offset < 0 or min(t.stride, default=0) < 0:
            raise CheckpointError(
                f"{p}: corrupt PyTorch checkpoint: tensor '{k}' {list(t.shape)} {str(t.dtype)[6:]} needs "
                f"{max(needed, storage_bytes)} bytes, its record {rec.filename} holds {rec.file_size}"
            )
        entries[k] = _Entry(TensorInfo(t.shape, t.dtype), p, 0, t.stride, t.offset, record=rec)
    return entries, root


class _Refused(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


@dataclass(frozen=True)
class _StorageStub:
    """A storage named by ``data.pkl``: its record key, element dtype (or bytes) and size."""

    key: str
    dtype: torch.dtype | None  # None: an UntypedStorage, ``numel`` counts bytes
    numel: int

    @property
    def typed(self) -> bool:
        return self.dtype is not None


@dataclass(frozen=True)
class _TensorStub:
    """A tensor described by ``data.pkl``, its data still in the archive."""

    storage: _StorageStub
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _ints(values: Any, what: str) -> tuple[int, ...]:
    out = tuple(values)
    if not all(type(v) is int for v in out):
        raise ValueError(f"{what} must be integers")
    return out


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                metadata: Any = None) -> _TensorStub:
    if not isinstance(storage, _StorageStub) or storage.dtype is None or type(offset) is not int:
        raise ValueError("_rebuild_tensor_v2 got no typed storage")
    return _TensorStub(storage, offset, _ints(size, "size"), _ints(stride, "stride"), storage.dtype)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                dtype: Any, metadata: Any = None) -> _TensorStub:
    if not isinstance(storage, _StorageStub) or not isinstance(dtype, torch.dtype) or type(offset) is not int:
        raise ValueError("_rebuild_tensor_v3 got no storage or dtype")
    return _TensorStub(storage, offset, _ints(size, "size"), _ints(stride, "stride"), dtype)


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any, state: Any = None) -> Any:
    if not isinstance(data, _TensorStub):
        raise ValueError("a Parameter without tensor data")
    return data


class _PlainTensorType:
    """What ``torch.Tensor`` / ``nn.Parameter`` unpickle to here (a marker, never instantiated)."""


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if new_type is not _PlainTensorType or func not in (_rebuild_v2, _rebuild_v3, _rebuild_parameter):
        raise ValueError("a tensor subclass")
    return func(*args)


_STORAGE_DTYPES: dict[str, torch.dtype] = {}
for _dt, _storage_name in __import__("torch.storage", fromlist=["x"])._dtype_to_storage_type_map().items():
    _STORAGE_DTYPES.setdefault(_storage_name, _dt)

_SAFE_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._tensor", "Tensor"): _PlainTensorType,
    ("torch", "Tensor"): _PlainTensorType,
    ("torch.nn.parameter", "Parameter"): _PlainTensorType,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): tuple,
    ("torch", "device"): lambda *args: "device",  # where a tensor was: irrelevant to its bytes
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("_codecs", "encode"): lambda text, encoding="utf-8": str(text).encode(str(encoding)),
}


class _StubUnpickler(pickle.Unpickler):
    """Unpickles ``data.pkl`` into containers and :class:`_TensorStub`: no other code can run.

    Every global a pickle names goes through ``find_class``; only the table above is answered,
    with functions of this module that build stubs. Anything else raises :class:`_Refused`
    before it is imported.
    """

    def find_class(self, module: str, name: str) -> Any:
        found = _SAFE_GLOBALS.get((module, name))
        if found is not None:
            return found
        if name == "UntypedStorage" and module in ("torch", "torch.storage"):
            return ("storage-type", None)
        if module == "torch":
            if name in _STORAGE_DTYPES:
                return ("storage-type", _STORAGE_DTYPES[name])
            dtype = getattr(torch, name, None) if not name.startswith("_") else None
            if isinstance(dtype, torch.dtype):
                return dtype
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise ValueError(f"unexpected persistent id {str(pid)[:60]}")
        _, kind, key, _location, numel = pid
        if not (isinstance(kind, tuple) and kind[:1] == ("storage-type",)) or type(numel) is not int:
            raise ValueError("a storage of unknown type")
        return _StorageStub(str(key), kind[1], numel)


def _explain_refusal(p: Path, name: str) -> None:
    """Raise the most helpful ``CheckpointError`` for a pickle that names ``name``."""
    # torch's own weights-only loader (on the meta device: no data) says what the file holds, e.g.
    # a registered tensor subclass; it refuses code-running globals the same way.
    refused = CheckpointError(
        f"{p}: refused to unpickle: it references '{name}', which paramfold does not read (only plain "
        "tensors and containers). Re-save just its state dict, e.g. torch.save(model.state_dict(), 'clean.pt')"
    )
    try:
        obj = _torch_load(p, map_location="meta")
    except CheckpointError as e:
        if "refused to unpickle" in str(e):
            raise
        # torch could not even build it on the meta device (torch 2.15: sparse tensors): say what
        # paramfold refused, not torch's side error.
        raise refused from None
    sd, _ = _find_state_dict(obj, p)
    _plain_only(sd, p)
    raise refused


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
            f"{p}: refused to unpickle: {why}; paramfold reads only tensors and plain containers and never runs pickled code. "
            "If you trust the file, re-save just its state dict, e.g. torch.save(model.state_dict(), 'clean.pt')"
        ) from None
    except Exception as e:
        if "central directory" in str(e) or isinstance(e, (EOFError, zipfile.BadZipFile)):
            raise CheckpointError(f"{p}: truncated or corrupt PyTorch checkpoint (the zip archive is incomplete)") from None
        raise CheckpointError(f"{p}: cannot read this PyTorch checkpoint ({_first_line(e)})") from None


def _find_state_dict(obj: Any, p: Path, tensor_type: type = torch.Tensor) -> tuple[dict[str, Any], str | None]:
    if _is_state_dict(obj, tensor_type):
        return dict(obj), None
    if isinstance(obj, Mapping):
        for key in NESTED_STATE_DICT_KEYS:
            sub = obj.get(key)
            if _is_state_dict(sub, tensor_type):
                return dict(sub), key
        where = f"top-level keys: {', '.join(map(str, list(obj)[:8]))}"
    else:
        where = f"it holds a {type(obj).__name__}"
    raise CheckpointError(
        f"{p}: no state dict found ({where}); expected a dict of tensors or one under "
        + " / ".join(f"'{k}'" for k in NESTED_STATE_DICT_KEYS)
    )


def _is_state_dict(obj: Any, tensor_type: type = torch.Tensor) -> bool:
    return (
        isinstance(obj, Mapping)
        and len(obj) > 0
        and all(isinstance(k, str) and isinstance(v, tensor_type) for k, v in obj.items())
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
    with _output(out) as f:
        if fmt == "safetensors":
            return _write_safetensors(f, specs, tensors, metadata)
        return _write_pt(f, specs, tensors)


def _output(out: Path) -> Any:
    """``atomic_output`` with its path errors as ``CheckpointError`` (same message, same exit code)."""
    try:
        check_output(out)
    except OutputError as e:
        raise CheckpointError(str(e), exit_code=e.exit_code) from None
    return atomic_output(out)


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
    with _output(out) as f:
        f.close()  # torch.save writes the path itself (in C++: a signal cannot split its records)
        torch.save(dict(state_dict), f.name)
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
        f"{out}: unsupported output format '{out.suffix or out.name}': use .safetensors or .pt "
        f"({', '.join(PT_SUFFIXES)})",
        exit_code=2,
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


_PT_ALIGNMENT = 64  # torch.save aligns every record's data to 64 bytes (mmap-friendly)


class _ZipWriter:
    """The records of a ``torch.save`` archive, written with :mod:`zipfile` (CRC-32 per record).

    On an error nothing more is written: the caller discards the file.
    """

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self._zip = zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True)

    def record(self, name: str, data: bytes | memoryview) -> None:
        name = f"archive/{name}"
        size = len(data) if isinstance(data, bytes) else data.nbytes
        zip64 = size * 1.05 > zipfile.ZIP64_LIMIT  # zipfile's own rule: it then adds a 20-byte extra
        start = self._f.tell() + 30 + len(name.encode()) + 4 + (20 if zip64 else 0)
        pad = -start % _PT_ALIGNMENT
        info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = size
        info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad  # torch's padding field
        w = self._zip.open(info, mode="w", force_zip64=zip64)
        w.write(data)
        w.close()

    def finish(self) -> None:
        self._zip.close()

    def abandon(self) -> None:
        # ZipFile.__del__ would write a central directory to a file that is being discarded.
        self._zip._writing = False  # type: ignore[attr-defined]
        self._zip.fp = None


def _write_pt(
    f: IO[bytes], specs: Mapping[str, TensorInfo], tensors: Iterable[tuple[str, torch.Tensor]]
) -> int:
    # The zip layout torch.save writes, except that every storage record is written as soon as
    # its tensor exists and the pickle comes last.
    refs: dict[str, _TensorRef] = {}
    nbytes = 0
    zw = _ZipWriter(f)
    try:
        for key, t in _checked(specs, tensors):
            i = len(refs)
            zw.record(f"data/{i}", _raw_bytes(t) if t.numel() else b"")
            refs[key] = _TensorRef(str(i), specs[key])
            nbytes += t.nbytes
        buf = io.BytesIO()
        _RefPickler(buf, protocol=2).dump(refs)
        zw.record("data.pkl", buf.getvalue())
        zw.record("byteorder", sys.byteorder.encode())
        zw.record("version", b"3\n")
        zw.finish()
    except BaseException:
        zw.abandon()
        raise
    return nbytes
