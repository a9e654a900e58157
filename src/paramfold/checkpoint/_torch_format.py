"""torch's private ``torch.save`` format: everything paramfold knows about it, in one place.

paramfold reads ``.pt`` files without ``torch.load`` (no pickled code runs, no tensor data is read
until asked for, every record's CRC-32 is checked) and writes them without ``torch.save`` (one
tensor at a time). Both rely on details torch does not document or promise. Each is listed here
with what paramfold does if torch changes it; in every case the failure is a refusal with a
one-line ``CheckpointError`` (or, for the last, a failing import), never a silently different tensor.

* **The archive** (``torch.save`` since 1.6): a zip holding one folder ``<name>/`` (the file's stem
  when saved to a path, ``archive`` when saved to a buffer) with ``data.pkl``, one uncompressed
  record ``data/<key>`` per storage, ``byteorder`` (absent in old files: little-endian) and
  ``version``; torch 2.x adds ``.format_version``, ``.storage_alignment`` and
  ``.data/serialization_id``, which are ignored. Read by :func:`pt_entries`,
  :func:`record_data_offset` (the local header's extra field, which torch pads) and
  :func:`check_record_crc`. If it changes: no single ``*/data.pkl`` is refused as "not a PyTorch
  checkpoint", a compressed record as "re-save it", a record whose size disagrees with the pickle
  as corrupt.
* **data.pkl's globals**: ``torch._utils._rebuild_tensor_v2`` (dtypes with a legacy storage class,
  ``torch.FloatStorage`` ...), ``_rebuild_tensor_v3`` with ``torch.storage.UntypedStorage`` (the
  others: uint16/32/64, float8), ``_rebuild_parameter`` / ``_rebuild_parameter_with_state``,
  ``torch._tensor._rebuild_from_type_v2``, persistent ids ``("storage", type, key, location,
  numel)``, plus ``torch.Size``, ``torch.device``, ``collections.OrderedDict`` and
  ``_codecs.encode``. The rebuild functions' last argument, torch's tensor metadata, holds the
  lazy math bits ``{"conj": True}`` / ``{"neg": True}`` of a saved conjugate or negative view; they
  are kept (the value is the bytes conjugated or negated) and any other key is refused. :class:`_StubUnpickler` answers exactly these (``_SAFE_GLOBALS``) with
  functions that build stubs. If torch renames one or adds another: the file is refused before
  anything is imported, and :func:`_explain_refusal` asks torch's own weights-only loader (on the
  meta device) what the file holds.
* ``torch.storage._dtype_to_storage_type_map()`` (private): the legacy storage class name of each
  dtype, read when this module is imported and again for every tensor written. If it goes away,
  ``import paramfold.checkpoint`` fails (AttributeError/ImportError): the loudest break; a fixed
  table would replace it.
* ``torch.load(weights_only=True)``'s ``UnpicklingError`` wording (:func:`_torch_load`, used for
  legacy non-zip files and to explain a refusal): searched for ``GLOBAL <name>`` ("Unsupported
  global: GLOBAL x was not an allowed global by default" in 2.13), ``Unsupported operand`` and
  ``WeightsUnpickler error:``. If it changes: still refused, with the generic "it is not a plain
  weights-only pickle".
* **Writing** (:func:`write_pt`): records ``archive/data/<i>`` as each tensor arrives, then
  ``archive/data.pkl`` (``_rebuild_tensor_v2``/``_v3`` references), ``byteorder`` and ``version``
  ``3`` (what 2.13 writes), each record's data aligned to 64 bytes by an ``FB`` extra field as
  torch's ``PyTorchStreamWriter`` does, so that ``torch.load(mmap=True)`` maps it;
  ``.storage_alignment`` is not written, and ``torch.load`` assumes 64 without it (2.13's
  ``serialization.py``). If torch changes its default alignment or requires a new record, loading
  paramfold's output fails: ``tests/test_checkpoint.py`` loads every ``.pt`` it writes with
  ``torch.load(weights_only=True)``, also with ``mmap=True``.

Checked against: torch 2.13.0's ``serialization.py``, ``_utils.py``, ``_tensor.py``, ``storage.py``
and ``_weights_only_unpickler.py`` (read for these notes); the tests that exercise this module
(``test_checkpoint.py``, ``test_audit.py``, ``test_cli.py``) passed on every torch of the nox
matrix, 2.5.1 to 2.15.0, when README's version table was last measured.
"""

from __future__ import annotations

import collections
import io
import pickle
import re
import reprlib
import struct
import sys
import warnings
import zipfile
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch.storage import _dtype_to_storage_type_map

from paramfold.errors import with_article
from paramfold.checkpoint.common import (
    CheckpointError,
    Entry,
    TensorInfo,
    contiguous_stride,
    element_size,
    first_line,
    negative_part,
    raw_bytes,
)

__all__ = ["NESTED_STATE_DICT_KEYS", "check_record_crc", "pt_entries", "record_data_offset", "write_pt"]

# Where a training checkpoint keeps the model's state dict, in the order they are tried.
NESTED_STATE_DICT_KEYS = ("state_dict", "model", "model_state_dict")


# --------------------------------------------------------------------------------------------------
# Reading


def pt_entries(p: Path) -> tuple[dict[str, Entry], str | None, tuple[str, ...]]:
    """Every tensor of the ``.pt`` file ``p`` (where its bytes are), the entry it was under, and
    the entries beside it taken as metadata though they are dicts of (scalar) tensors.

    A zip archive is read without ``torch.load``: its directory, then ``data.pkl`` through
    :class:`_StubUnpickler`; each tensor is checked to fit in its storage record. A legacy (non-zip)
    file is loaded whole with ``torch.load(weights_only=True)``, to the CPU.
    """
    with open(p, "rb") as f:
        head = f.read(4)
    if not head:
        raise CheckpointError(f"{p}: the file is empty, not a PyTorch checkpoint; re-download or re-save it")
    if head != b"PK\x03\x04":
        # Legacy format: no offsets, no checksums; weights_only still applies. Tensors saved from a
        # GPU are read to the CPU, as every tensor paramfold reads is (else: "corrupt" without CUDA).
        obj = _torch_load(p, legacy=True, map_location="cpu")
        sd, root, beside = _find_state_dict(obj, p)
        _plain_only(sd, p)
        for k, t in sd.items():
            _check_expansion(p, k, TensorInfo.of(t), t.untyped_storage().nbytes())
        return {k: Entry(TensorInfo.of(t), tensor=t) for k, t in sd.items()}, root, beside
    try:  # the zip's central directory sits at its end: a truncated file has none
        with zipfile.ZipFile(p) as z:
            infos = z.infolist()
            pickles = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
            if len(pickles) != 1:
                raise CheckpointError(f"{p}: not a PyTorch checkpoint (a zip archive without one data.pkl)")
            prefix = pickles[0].filename[: -len("data.pkl")]
            order = z.NameToInfo.get(prefix + "byteorder")
            for rec in (pickles[0], order):
                # Stored, so no more bytes come out than the file holds: a deflated or bzip2 record
                # of a few KiB can unpack to gigabytes before a single byte of it is checked.
                if rec is not None and rec.compress_type != zipfile.ZIP_STORED:
                    raise CheckpointError(f"{p}: record {rec.filename} is compressed; torch.save never compresses: re-save it")
            data = z.read(pickles[0])  # zipfile checks its CRC-32
            byteorder = z.read(order) if order is not None else b"little"
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, RuntimeError, zlib.error) as e:
        # RuntimeError: an encrypted record; zlib.error: a record whose deflate data is broken
        detail = "the zip archive is incomplete" if "CRC" not in str(e) else first_line(e)
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
        raise CheckpointError(f"{p}: corrupt PyTorch checkpoint: its data.pkl does not unpickle ({first_line(e)})") from None
    sd, root, beside = _find_state_dict(obj, p, tensor_type=_TensorStub)
    records = {i.filename[len(prefix) + len("data/"):]: i for i in infos if i.filename.startswith(prefix + "data/")}
    entries: dict[str, Entry] = {}
    for k, t in sd.items():
        rec = records.get(t.storage.key)
        if rec is None:
            raise CheckpointError(f"{p}: corrupt PyTorch checkpoint: the storage of '{k}' (record data/{t.storage.key}) is missing")
        if rec.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{p}: record {rec.filename} is compressed; torch.save never compresses: re-save it")
        negative = negative_part({"shape": t.shape, "stride": t.stride, "storage offset": (t.offset,)})
        if negative:
            raise CheckpointError(f"{p}: corrupt PyTorch checkpoint: tensor '{k}' has {negative}")
        elem = element_size(t.dtype)
        storage_bytes = t.storage.numel * (elem if t.storage.typed else 1)
        if _numel_overflows(t.shape):  # torch.load refuses such a size, empty or not
            raise CheckpointError(f"{p}: corrupt PyTorch checkpoint: tensor '{k}' has an impossible shape {reprlib.repr(list(t.shape))}")
        span = 0 if 0 in t.shape else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride))
        needed = (t.offset + span) * elem if span else 0
        if storage_bytes != rec.file_size or needed > rec.file_size:
            raise CheckpointError(
                f"{p}: corrupt PyTorch checkpoint: tensor '{k}' {list(t.shape)} {str(t.dtype)[6:]} needs "
                f"{max(needed, storage_bytes)} bytes, its record {rec.filename} holds {rec.file_size}"
            )
        info = TensorInfo(t.shape, t.dtype)
        _check_expansion(p, k, info, rec.file_size)
        entries[k] = Entry(info, p, 0, t.stride, t.offset, record=rec, conj=t.conj, neg=t.neg)
    return entries, root, beside


def _numel_overflows(shape: tuple[int, ...]) -> bool:
    """Whether torch's element count of ``shape`` overflows: a product taken left to right, so
    (2**40, 2**40, 0) does and (2**62, 0, 2) does not (c10's ``safe_multiplies``)."""
    numel = 1
    for n in shape:
        numel *= n
        if numel >= 1 << 63:
            return True
    return False


#: How many bytes more than its storage holds a tensor's value may have (an expanded view: a
#: stride-0 dim, overlapping strides). Read, it is materialised, and written, it takes that much;
#: beyond this a tiny file could make any amount of memory and output.
EXPANSION_ALLOWANCE = 64 << 20


def _check_expansion(p: Path, key: str, info: TensorInfo, stored: int) -> None:
    if info.nbytes > stored + EXPANSION_ALLOWANCE:
        raise CheckpointError(
            f"{p}: tensor '{key}' {list(info.shape)} {info.dtype_name} is a view that expands {stored} stored "
            f"bytes to {info.nbytes} (a stride-0 or overlapping view); paramfold materialises every tensor and "
            f"refuses more than {EXPANSION_ALLOWANCE >> 20} MiB of such growth: save it with .contiguous() "
            "if that size is meant, or save its unexpanded base"
        )


def _plain_only(sd: dict[str, torch.Tensor], p: Path) -> dict[str, torch.Tensor]:
    for k, t in sd.items():
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise CheckpointError(
                f"{p}: '{k}' is {with_article(type(t).__name__)} (a tensor subclass); paramfold reads plain tensors: "
                "save the model after torchao.utils.unwrap_tensor_subclass(model), or its plain state dict"
            )
    return sd


def record_data_offset(f: io.BufferedReader, rec: zipfile.ZipInfo, file: Path, key: str) -> int:
    """Where the bytes of record ``rec`` start in ``f``: after its local header and its extra field.

    The zip's central directory gives the local header's offset; the header's own name and extra
    lengths say where the data begins (torch pads the extra field to align the data).
    """
    f.seek(rec.header_offset)
    header = f.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise CheckpointError(f"{file}: corrupt PyTorch checkpoint: the zip record of tensor '{key}' is damaged")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return rec.header_offset + 30 + name_len + extra_len


def check_record_crc(data: memoryview, rec: zipfile.ZipInfo, file: Path, key: str) -> None:
    """Refuse the bytes read for record ``rec`` unless they match the CRC-32 the zip stores for it."""
    if zlib.crc32(data) != rec.CRC:
        raise CheckpointError(
            f"{file}: corrupt: the bytes of tensor '{key}' fail their CRC-32 check (record "
            f"{rec.filename}); the file was damaged after it was saved: re-download or re-save it"
        )


class _Refused(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _Unbuildable:
    """An object pickle's BUILD opcode may not change (its attributes, set past any check)."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise ValueError("it sets attributes of a function or tensor it names (pickle's BUILD), which torch.save never writes")


@dataclass(frozen=True)
class _StorageStub(_Unbuildable):
    """A storage named by ``data.pkl``: its record key, element dtype (or bytes) and size."""

    key: str
    dtype: torch.dtype | None  # None: an UntypedStorage, ``numel`` counts bytes
    numel: int

    @property
    def typed(self) -> bool:
        return self.dtype is not None

    @property
    def public_name(self) -> str:
        """The type ``torch.load`` would give (:func:`_type_name`)."""
        return "TypedStorage" if self.typed else "UntypedStorage"


@dataclass(frozen=True)
class _TensorStub(_Unbuildable):
    """A tensor described by ``data.pkl``, its data still in the archive."""

    storage: _StorageStub
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    # torch's lazy math bits (``torch._utils.get_tensor_metadata``): a conjugate or negative view
    # was saved as its base's bytes plus the bit; the tensor's value is the bytes conjugated/negated.
    conj: bool = False
    neg: bool = False

    #: The type ``torch.load`` would give (:func:`_type_name`); a Parameter's stub is a Tensor's.
    public_name = "Tensor"


def _math_bits(metadata: Any) -> dict[str, bool]:
    """The ``metadata`` argument of ``_rebuild_tensor_v2``/``_v3``: ``{"conj": True}``, ``{"neg": True}``.

    Anything else is refused: ignoring a bit torch sets would read a silently different value.
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not set(metadata) <= {"conj", "neg"} or not all(
        type(v) is bool for v in metadata.values()
    ):
        raise ValueError(f"unknown tensor metadata {reprlib.repr(metadata)}")
    return {k: v for k, v in metadata.items() if v}


def _ints(values: Any, what: str) -> tuple[int, ...]:
    out = tuple(values)
    if not all(type(v) is int for v in out):
        raise ValueError(f"{what} must be integers")
    return out


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                metadata: Any = None) -> _TensorStub:
    if not isinstance(storage, _StorageStub) or storage.dtype is None or type(offset) is not int:
        raise ValueError("_rebuild_tensor_v2 got no typed storage")
    return _TensorStub(storage, offset, _ints(size, "size"), _ints(stride, "stride"), storage.dtype, **_math_bits(metadata))


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                dtype: Any, metadata: Any = None) -> _TensorStub:
    if not isinstance(storage, _StorageStub) or not isinstance(dtype, torch.dtype) or type(offset) is not int:
        raise ValueError("_rebuild_tensor_v3 got no storage or dtype")
    return _TensorStub(storage, offset, _ints(size, "size"), _ints(stride, "stride"), dtype, **_math_bits(metadata))


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any, state: Any = None) -> Any:
    if not isinstance(data, _TensorStub):
        raise ValueError("a Parameter without tensor data")
    return data


class _Global(_Unbuildable):
    """What a global of :data:`_SAFE_GLOBALS` unpickles to: ``fn`` (None: a marker) behind an
    object that pickle's BUILD cannot change. BUILD sets attributes on whatever object the pickle
    names; on a module-level function it would change that function for every later file read
    in the process (``__defaults__``: every tensor read negated), so no function is handed out
    bare, and BUILD on one of these is refused."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        if self.fn is None:
            raise ValueError("a tensor type called")
        return self.fn(*args)


#: What ``torch.Tensor`` / ``nn.Parameter`` unpickle to here: a marker, never called.
_PlainTensorType = _Global(None)


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if new_type is not _PlainTensorType or not isinstance(func, _Global) or func.fn not in (
            _rebuild_v2, _rebuild_v3, _rebuild_parameter):
        raise ValueError("a tensor subclass")
    return func(*args)


def _encode(text: Any, encoding: Any = "utf-8") -> bytes:
    # How protocol 2 pickles bytes (torch's own write latin1). Any other name would import an
    # encodings module of the attacker's choosing.
    if encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise ValueError(f"_codecs.encode with encoding {reprlib.repr(encoding)}")
    return str(text).encode(encoding)


_STORAGE_DTYPES: dict[str, torch.dtype] = {}
for _dt, _storage_name in _dtype_to_storage_type_map().items():
    _STORAGE_DTYPES.setdefault(_storage_name, _dt)

#: The globals a checkpoint's pickle may name, and what each unpickles to. Types are torch's and
#: Python's own (immutable: BUILD on them fails), functions are wrapped (:class:`_Global`).
_SAFE_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _Global(_rebuild_v2),
    ("torch._utils", "_rebuild_tensor_v3"): _Global(_rebuild_v3),
    ("torch._utils", "_rebuild_parameter"): _Global(_rebuild_parameter),
    ("torch._utils", "_rebuild_parameter_with_state"): _Global(_rebuild_parameter),
    ("torch._tensor", "_rebuild_from_type_v2"): _Global(_rebuild_from_type_v2),
    ("torch._tensor", "Tensor"): _PlainTensorType,
    ("torch", "Tensor"): _PlainTensorType,
    ("torch.nn.parameter", "Parameter"): _PlainTensorType,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): tuple,
    ("torch", "device"): _Global(lambda *args: "device"),  # where a tensor was: irrelevant to its bytes
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("_codecs", "encode"): _Global(_encode),
}


class _StubUnpickler(pickle.Unpickler):
    """Unpickles ``data.pkl`` into containers and :class:`_TensorStub`: no other code can run.

    Every global a pickle names goes through ``find_class``; only the table above is answered,
    with functions of this module that build stubs. Anything else raises :class:`_Refused`
    before it is imported.
    """

    def find_class(self, module: str, name: str) -> Any:
        if module == "__builtin__":  # Python 2's name for builtins, which protocol 2 writes
            module = "builtins"
        found = _SAFE_GLOBALS.get((module, name))
        if found is not None:
            return found
        if name == "UntypedStorage" and module in ("torch", "torch.storage"):
            return ("storage-type", None)
        if module == "torch":
            if name in _STORAGE_DTYPES:
                return ("storage-type", _STORAGE_DTYPES[name])
            # (torch's namespace as it is: its getattr would import a lazily loaded submodule)
            dtype = vars(torch).get(name) if not name.startswith("_") else None
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
        if "refused to unpickle: it references" in str(e):
            raise
        # torch could not even build it on the meta device (torch 2.15: sparse tensors), or refused
        # it without naming what it references (an opcode it lacks, such as protocol 0's STRING):
        # say what paramfold refused, not torch's side error.
        raise refused from None
    sd, _, _ = _find_state_dict(obj, p)
    _plain_only(sd, p)
    raise refused


def _torch_load(p: Path, *, legacy: bool = False, **kwargs: Any) -> Any:
    """``torch.load(p, weights_only=True)``, its failures as one-line ``CheckpointError``.

    ``legacy``: ``p`` is a legacy (non-zip) file, whose damage torch reports as anything from an
    empty ``EOFError`` to an ``IndexError``; every such failure is called a truncated or corrupt file.
    """
    try:
        with warnings.catch_warnings():  # torch's notes on the pickle (its protocol): not our line
            warnings.simplefilter("ignore")
            return torch.load(p, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        msg = str(e)
        m = re.search(r"GLOBAL ([\w.]+)", msg)
        if m:
            why = f"it references '{m.group(1)}', which could run arbitrary code"
        else:
            detail = re.search(r"Unsupported operand[^\n]*", msg) or re.search(r"WeightsUnpickler error:[ \t]*\S[^\n]*", msg)
            why = (
                "it is not a plain weights-only pickle"
                + (f" ({detail.group(0).strip()})" if detail else "")
                + ": either corrupt or it needs code execution"
            )
        raise CheckpointError(
            f"{p}: refused to unpickle: {why}; paramfold reads only dense tensors and plain containers and never runs "
            "pickled code. If you trust the file, re-save its weights as plain tensors: just the state dict "
            "(torch.save(model.state_dict(), 'clean.pt')), and for tensor subclasses (quantized weights) a model "
            "whose weights are plain (torchao: torchao.utils.unwrap_tensor_subclass(model) before state_dict())"
        ) from None
    except Exception as e:
        if legacy:
            detail = first_line(e) if str(e).strip() else "it ends early"
            raise CheckpointError(
                f"{p}: truncated or corrupt PyTorch checkpoint (legacy non-zip format: {detail}), or an intact "
                "one holding what torch's legacy reader cannot read (uint16, uint32, uint64 and float8 tensors: re-save "
                "such a file with torch.save's default zip format); re-download or re-save it"
            ) from None
        if "central directory" in str(e) or isinstance(e, (EOFError, zipfile.BadZipFile)):
            raise CheckpointError(f"{p}: truncated or corrupt PyTorch checkpoint (the zip archive is incomplete)") from None
        raise CheckpointError(f"{p}: cannot read this PyTorch checkpoint ({first_line(e)})") from None


def _type_name(obj: Any) -> str:
    """The name of ``obj``'s type in a message: a stub of this module is named by the public type it
    stands for (``Tensor``, not ``_TensorStub``), as ``torch.load`` on a legacy file would show it."""
    if isinstance(obj, (_TensorStub, _StorageStub)):
        return obj.public_name
    return type(obj).__name__


def _find_state_dict(obj: Any, p: Path, tensor_type: type = torch.Tensor) -> tuple[dict[str, Any], str | None, tuple[str, ...]]:
    """The state dict in ``obj``, the key it is under (None: the top level), and the keys of the
    dicts of scalar tensors beside it under keys of the project's own, taken as metadata (a model
    whose weights are all scalars would be one of them: the caller shows which were set aside)."""
    if _is_state_dict(obj, tensor_type):
        return dict(obj), None, ()
    if isinstance(obj, Mapping):
        for key in NESTED_STATE_DICT_KEYS:
            sub = obj.get(key)
            if _is_state_dict(sub, tensor_type):
                return dict(sub), key, ()
        for key in NESTED_STATE_DICT_KEYS:
            _refuse_mixed_state_dict(obj.get(key), key, p, tensor_type)
        if _has_model_marks(obj, tensor_type):
            _refuse_mixed_state_dict(obj, None, p, tensor_type)
        # Under another key of the project's own (HiFi-GAN's {'generator': ...}): the one state dict there.
        others = [(k, sub) for k, sub in obj.items()
                  if isinstance(k, str) and k not in NESTED_STATE_DICT_KEYS and isinstance(sub, Mapping) and sub]
        found = [k for k, sub in others if _is_state_dict(sub, tensor_type)]
        # beside it, a dict of scalar tensors is metadata (metrics, as a step at the top level)
        modelled = [k for k in found if _has_model_marks(obj[k], tensor_type)]
        # A model's state dict with non-tensor entries (a module's extra state) is a candidate too: not
        # passed over for the one plain dict of tensors beside it (its discriminator, a dict of metrics).
        mixed = [k for k, sub in others if k not in found and _has_model_marks(sub, tensor_type)
                 and any(isinstance(v, tensor_type) for v in sub.values())]
        if mixed:
            if len(modelled) + len(mixed) == 1:
                _refuse_mixed_state_dict(obj[mixed[0]], mixed[0], p, tensor_type)
            found = modelled = [k for k, _ in others if k in modelled or k in mixed]
        beside: tuple[str, ...] = ()
        if len(found) > 1 and len(modelled) == 1:
            beside, found = tuple(k for k in found if k not in modelled), modelled
        if len(found) == 1:
            return dict(obj[found[0]]), found[0], beside
        if found:
            raise CheckpointError(
                f"{p}: several state dicts (under {', '.join(map(repr, found[:8]))}"
                f"{', ...' if len(found) > 8 else ''}): paramfold reads one model per checkpoint; save the one "
                f"to read on its own (torch.save(ckpt[{found[0]!r}], PATH)); which is the model is not guessed "
                "from sizes or names: a generator and its discriminator, a model and its EMA copy or its "
                "normalisation stats look alike"
            )
        for name, sub in others:
            _refuse_mixed_state_dict(sub, name, p, tensor_type)
        for name, sub in [(None, obj), *((k, obj.get(k)) for k in NESTED_STATE_DICT_KEYS)]:
            if isinstance(sub, Mapping) and not sub:  # a model without parameters: no tensors, as in safetensors
                return {}, name, ()
        where = f"top-level keys: {', '.join(map(_key_name, list(obj)[:8]))}"
        scalars = [k for k, v in obj.items() if isinstance(v, tensor_type) and len(v.shape) == 0]
        if scalars:  # {'a': tensor(2.), 'epoch': 3}: a model whose weights are all scalars, beside a step
            where += (f"; its tensors ('{_key_name(scalars[0])}'{', ...' if len(scalars) > 1 else ''}) are all "
                      "scalars, taken as metadata (a step or a loss saved as a tensor): if they are the model's "
                      "weights, save its state dict alone, torch.save(model.state_dict(), PATH)")
    else:
        where = f"it holds {with_article(_type_name(obj))}"
    raise CheckpointError(
        f"{p}: no state dict found ({where}); expected a dict of tensors, one under "
        + " / ".join(f"'{k}'" for k in NESTED_STATE_DICT_KEYS)
        + ", or the only one under a key of its own (HiFi-GAN's 'generator', beside metadata such as a step)"
    )


def _has_model_marks(obj: Mapping[Any, Any], tensor_type: type) -> bool:
    """Whether ``obj``, a top level that is not a plain state dict, is a state dict with stray entries
    rather than a training checkpoint around one (HiFi-GAN's ``{'generator': sd, 'steps': ...}``):
    every key a string, as in any state dict, and the marks of a model, a tensor that is not a scalar
    or a module's ``_extra_state``. Scalar tensors (a step counter or a best loss saved as a tensor)
    are a checkpoint's metadata, as ints and floats are: no model's weights are all scalars."""
    return all(isinstance(k, str) for k in obj) and any(
        (isinstance(v, tensor_type) and len(v.shape) > 0) or _is_extra_state_key(k) for k, v in obj.items()
    )


def _is_extra_state_key(key: str) -> bool:
    """Where ``Module.state_dict()`` puts a module's ``get_extra_state()``: ``<module>._extra_state``."""
    return key == "_extra_state" or key.endswith("._extra_state")


def _refuse_mixed_state_dict(sub: Any, name: str | None, p: Path, tensor_type: type) -> None:
    """Say so where ``sub`` is a state dict but for some non-tensor entries (a module's
    ``get_extra_state``, a step counter), rather than that no state dict was found."""
    if not (isinstance(sub, Mapping) and all(isinstance(k, str) for k in sub)):
        return
    others = [k for k, v in sub.items() if not isinstance(v, tensor_type)]
    if not others or len(others) == len(sub):
        return
    where = f"its entry '{name}'" if name else "its state dict"
    first = others[0]
    # A dict of tensors beside tensors that are not scalars: two sets of weights, either of which may be the model.
    # (A dict of scalar tensors is metadata, as beside a state dict under a key of the project's own.)
    nested = [k for k in others if not _is_extra_state_key(k) and isinstance(sub[k], Mapping)
              and any(isinstance(v, tensor_type) and len(v.shape) > 0 for v in sub[k].values())]
    if nested:
        ckpt = "ckpt" if name is None else f"ckpt[{name!r}]"
        tensors = [k for k, v in sub.items() if isinstance(v, tensor_type)]
        raise CheckpointError(
            f"{p}: {where if name else 'its top level'} holds a dict of tensors under '{nested[0]}' beside tensors "
            f"that are not all scalars ('{tensors[0]}'{', ...' if len(tensors) > 1 else ''}): either may be the "
            "model, and paramfold reads one per checkpoint without guessing which; save the one to read on its own: "
            f"torch.save({ckpt}[{nested[0]!r}], PATH), or the tensors beside it, "
            f"{{k: v for k, v in {ckpt}.items() if isinstance(v, torch.Tensor)}}"
        )
    raise CheckpointError(
        f"{p}: {where} holds {len(others)} non-tensor entr{'y' if len(others) == 1 else 'ies'} "
        f"('{_key_name(first)}': {_type_name(sub[first])}{', ...' if len(others) > 1 else ''}; "
        "a module's get_extra_state() saves one as '<module>._extra_state'); paramfold reads only "
        "tensors: re-save without them, e.g. {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}"
    )


#: Names a key in an error without recursing into it: a pickle can nest a tuple key 100,000 deep.
_KEY_REPR = reprlib.Repr()  # keyword arguments need Python 3.12
_KEY_REPR.maxlevel, _KEY_REPR.maxstring, _KEY_REPR.maxother = 4, 60, 60


def _key_name(key: Any) -> str:
    return key if isinstance(key, str) else _KEY_REPR.repr(key)


def _is_state_dict(obj: Any, tensor_type: type = torch.Tensor) -> bool:
    return (
        isinstance(obj, Mapping)
        and len(obj) > 0
        and all(isinstance(k, str) and isinstance(v, tensor_type) for k, v in obj.items())
    )


# --------------------------------------------------------------------------------------------------
# Writing


class _StorageRef:
    def __init__(self, key: str, storage_type: Any, numel: int) -> None:
        self.pid = ("storage", storage_type, key, "cpu", numel)


class _TensorRef:
    """Pickles like a CPU tensor saved by ``torch.save``, whose storage is record ``data/<key>``."""

    def __init__(self, key: str, info: TensorInfo) -> None:
        self.key, self.info = key, info

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        info = self.info
        stride = contiguous_stride(info.shape)
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


def write_pt(
    f: IO[bytes], specs: Mapping[str, TensorInfo], tensors: Iterable[tuple[str, torch.Tensor]]
) -> int:
    """Write ``tensors`` to ``f`` in the layout ``torch.save`` writes; returns the bytes of tensor data.

    ``tensors`` yields the keys of ``specs`` in order, as contiguous CPU tensors (the writer in
    :mod:`paramfold.checkpoint.write` checks them before they get here).
    """
    # The zip layout torch.save writes, except that every storage record is written as soon as
    # its tensor exists and the pickle comes last.
    refs: dict[str, _TensorRef] = {}
    nbytes = 0
    zw = _ZipWriter(f)
    try:
        for key, t in tensors:
            i = len(refs)
            zw.record(f"data/{i}", raw_bytes(t) if t.numel() else b"")
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
