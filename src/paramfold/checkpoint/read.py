"""Reading checkpoints: ``open_checkpoint`` and the lazy, verified ``Checkpoint`` it returns.

This module finds the files (a single file, a Hugging Face folder, an index and its shards), reads
safetensors headers and does all the reading of tensor bytes, with positioned reads into buffers
the caller may reuse. What a ``torch.save`` file holds is told by :mod:`._torch_format`, the one
module that knows torch's private serialization format.
"""

from __future__ import annotations

import errno
import io
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from paramfold.checkpoint._torch_format import check_record_crc, pt_entries, record_data_offset
from paramfold.checkpoint.common import (
    PT_SUFFIXES,
    SAFETENSORS_SUFFIX,
    ST_DTYPES,
    CheckpointError,
    Entry,
    TensorInfo,
    contiguous_stride,
    element_size,
    file_format,
    first_line,
    negative_part,
)
from paramfold.errors import one_line, with_article

__all__ = ["Checkpoint", "open_checkpoint"]


class Checkpoint:
    """A lazily read checkpoint: keys, shapes and dtypes up front, tensor data on ``read(key)``.

    Use ``open_checkpoint(path)`` to get one; close it (or use it as a context manager) to release
    its file handles.
    """

    def __init__(
        self,
        path: Path,
        format: str,
        entries: dict[str, Entry],
        *,
        root: str | None = None,
        beside: tuple[str, ...] = (),
        metadata: Mapping[str, str] | None = None,
        files: Iterable[Path] = (),
    ) -> None:
        self.path = path
        self.format = format
        self.root = root
        self.beside = beside  # dicts of scalar tensors beside the state dict, taken as metadata
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

        With ``out`` (a 1-D contiguous ``uint8`` CPU tensor, starting at a multiple of the dtype's
        element size in its storage, as ``torch.empty(n, dtype=torch.uint8)`` does), the bytes are
        read into ``out`` and the result is a view of it, valid until ``out`` is reused: a streamed
        pass then allocates nothing per tensor (repeatedly allocating and freeing large tensors
        grows the heap with glibc's malloc). An ``out`` too small for the tensor is not used. Any
        other ``out`` raises ``ValueError``.
        """
        e = self._entries[key]
        shape, dtype = e.info.shape, e.info.dtype
        if out is not None:
            _check_buffer(out, dtype)
        if e.tensor is not None:
            if out is None or out.numel() < e.info.nbytes:  # resolved: a conjugate/negative view's value
                return e.tensor.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
            view = out[: e.info.nbytes].view(dtype).view(shape)
            return view.copy_(e.tensor)
        stride = e.stride if e.stride is not None else contiguous_stride(shape)
        numel = e.info.numel
        span = 0 if numel == 0 else 1 + sum((s - 1) * st for s, st in zip(shape, stride))
        elem = element_size(dtype)
        nbytes = span * elem
        start = e.storage_offset * elem
        if e.record is not None:  # read the whole storage record, so that its CRC-32 can be checked
            start, nbytes = 0, e.record.file_size
        if out is not None and out.numel() >= nbytes and nbytes:
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
        if e.conj or e.neg:  # a saved conjugate/negative view: its value, as torch.load's resolves
            if e.conj:
                result = result.conj_physical()
            if e.neg:
                result = result.neg()
            return result.contiguous()
        if not result.is_contiguous():
            return result.contiguous()
        if out is None and raw.untyped_storage().nbytes() != result.nbytes:
            return result.clone()  # a view into a larger storage record: keep only its own bytes
        return result

    def _read_record(self, e: Entry, buf: memoryview, key: str) -> None:
        rec = e.record
        assert rec is not None and e.file is not None
        start = record_data_offset(self._open(e.file), rec, e.file, key)
        self._read_into(e.file, start, buf, rec.file_size, key)
        check_record_crc(buf[: rec.file_size], rec, e.file, key)

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


def _check_buffer(out: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse an ``out`` that ``Checkpoint.read`` cannot read into and view as ``dtype``."""
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1 or out.device.type != "cpu":
        what = f"a {out.dim()}-D {out.dtype} tensor on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a 1-D uint8 CPU tensor, not {what}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous (its stride is {out.stride()[0]})")
    elem = element_size(dtype)
    if out.storage_offset() % elem:
        raise ValueError(
            f"out starts at byte {out.storage_offset()} of its storage, not a multiple of {elem} (the size of "
            f"{with_article(str(dtype).removeprefix('torch.'))} element), so its bytes cannot be viewed as that dtype: "
            "pass a buffer that starts where its storage does, e.g. torch.empty(n, dtype=torch.uint8)"
        )


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
    if not str(path).strip():  # Path("") is the current folder, which would be read instead
        raise CheckpointError("no input path given (an empty string)", exit_code=2)
    p = Path(path)
    _check_named(p)
    if p.is_dir():
        return _open_folder(p)
    if not p.is_file():  # a FIFO or a device would block or never end
        raise CheckpointError(f"{p}: not a regular file", exit_code=2)
    _check_readable(p)
    if p.name.lower().endswith(".index.json"):
        return _open_index(p)
    fmt = file_format(p)
    if fmt is not None:
        _check_content(p, fmt)
    if fmt == "safetensors":
        entries, metadata = _safetensors_entries(p)
        return Checkpoint(p, "safetensors", entries, metadata=metadata)
    if fmt == "pt":
        entries, root, beside = pt_entries(p)
        return Checkpoint(p, "pt", entries, root=root, beside=beside)
    what = _sniffed(p)
    raise CheckpointError(
        f"{p}: unsupported checkpoint format '{p.suffix or p.name}': expected "
        f"{', '.join(PT_SUFFIXES)}, {SAFETENSORS_SUFFIX}, a *.safetensors.index.json "
        "or a folder holding one" + (f" (it is {what[0]}: rename it to end in {what[1]})" if what else ""),
        exit_code=2,
    )


#: Why a path names nothing, said as a usage error (exit 2) as for an output path; others (a folder
#: on the way without permission) are the environment's, raised as they are.
_UNNAMED = {errno.ENOENT: "no such file or folder", errno.ENOTDIR: "no such file or folder",
            errno.ELOOP: "a symlink loop (too many levels of symbolic links)",
            errno.ENAMETOOLONG: "cannot be used as an input path: File name too long"}


def _check_named(p: Path) -> None:
    """Refuse an input path that names nothing: missing, a loop of links, a name too long."""
    try:
        os.stat(p)
    except OSError as e:
        if e.errno not in _UNNAMED:
            raise
        raise CheckpointError(f"{p}: {_UNNAMED[e.errno]}", exit_code=2) from None


def _symlink_loop(p: Path) -> bool:
    """Whether ``p`` does not exist because its links lead round in a loop (``exists()`` says False)."""
    try:
        os.stat(p)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def _check_readable(p: Path) -> None:
    """Say why a file that exists cannot be read (the readers' own messages would call an
    unreadable safetensors file missing or invalid)."""
    try:
        with open(p, "rb"):
            pass
    except OSError as e:
        raise CheckpointError(f"{p}: {e.strerror or e}") from None


#: The files transformers' ``from_pretrained`` loads from a folder, in its order
#: (``modeling_utils._get_resolved_checkpoint_files``, no variant): the first present is read,
#: whatever else the folder holds. ``save_pretrained`` leaves such pairs: the index of a sharded
#: save beside a later unsharded one (its shards deleted), ``model.safetensors`` beside a later
#: sharded save.
_HF_WEIGHTS_NAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _open_folder(folder: Path) -> Checkpoint:
    try:  # listed, and its files reachable ("folder/." needs the search permission the files do)
        os.listdir(folder)
        os.stat(os.path.join(folder, "."))
    except OSError as e:  # else the first file looked for would be named, as if it were there
        raise CheckpointError(f"{folder}: cannot list this folder: {e.strerror or e}") from None
    named = _config_weights(folder)
    if named is not None:
        return open_checkpoint(named)
    for name in _HF_WEIGHTS_NAMES:
        if (folder / name).is_file():
            return open_checkpoint(folder / name)
    # No name transformers looks for: the one index, else the one checkpoint file, the folder holds.
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
            f"{folder}: no checkpoint in this folder (looked for *.safetensors.index.json, *.safetensors, "
            f"{', '.join('*' + s for s in PT_SUFFIXES)})",
            exit_code=2,
        )
    names = ", ".join(q.name for q in singles[:4])
    raise CheckpointError(
        f"{folder}: several checkpoint files and no index ({names}, ...): pass one file", exit_code=2
    )


def _config_weights(folder: Path) -> Path | None:
    """The file ``config.json``'s ``transformers_weights`` names, which ``from_pretrained`` loads
    before any other; None where the folder's config names none (or is not one transformers reads)."""
    config = folder / "config.json"
    try:
        named = json.loads(config.read_text()).get("transformers_weights") if config.is_file() else None
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(named, str):
        return None
    if not named or Path(named).is_absolute() or ".." in Path(named).parts:
        raise CheckpointError(f"{config}: transformers_weights '{named}' is not a file name inside the folder")
    if not (folder / named).is_file():
        raise CheckpointError(
            f"{config}: transformers_weights names '{named}', which is missing: transformers would load "
            "that file; restore it, or remove the entry"
        )
    return folder / named


def _open_index(index: Path) -> Checkpoint:
    try:
        doc = json.loads(index.read_text())
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to shard file names")
        metadata = doc.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise TypeError(f"metadata must be an object, not {type(metadata).__name__}")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: JSON nested too deep
        raise CheckpointError(f"{index}: not a valid checkpoint index ({type(e).__name__}: {one_line(str(e))})") from None
    shards: dict[str, dict[str, Entry]] = {}
    kinds: set[str] = set()
    for shard in dict.fromkeys(weight_map.values()):
        # Named inside the index's folder, checked on the name: a shard may be a link out of it
        # (Hugging Face's cache links each snapshot's files to blobs named by hash).
        named = Path(shard)
        if "\0" in shard:  # no file can be named so (os.stat would raise ValueError)
            raise CheckpointError(f"{index}: not a valid checkpoint index (shard name {shard!r} holds a NUL byte)")
        if not shard or named.is_absolute() or ".." in named.parts:
            raise CheckpointError(f"{index}: shard '{shard}' lies outside the index's folder")
        sp = index.parent / named
        if not sp.exists():
            broken = " (a symlink loop)" if _symlink_loop(sp) else " (a broken link)" if sp.is_symlink() else ""
            raise CheckpointError(f"{index}: shard '{shard}' named by the index is missing{broken}")
        if not sp.is_file():  # a FIFO or a device would block or never end; a folder is no shard
            raise CheckpointError(
                f"{index}: shard '{shard}' named by the index is not a regular file (a folder, a FIFO or a device)",
                exit_code=2,
            )
        _check_readable(sp)
        fmt = file_format(named)
        if fmt is not None:
            _check_content(sp, fmt, index)
        if fmt == "safetensors":
            shards[shard], _ = _safetensors_entries(sp)
        elif fmt == "pt":
            shards[shard] = pt_entries(sp)[0]
        else:
            raise CheckpointError(f"{index}: shard '{shard}' has an unsupported format")
        kinds.add(fmt)
    entries: dict[str, Entry] = {}
    for key, shard in weight_map.items():
        if key not in shards[shard]:
            raise CheckpointError(f"{index}: the index puts '{key}' in '{shard}', but that shard lacks it")
        entries[key] = shards[shard][key]
    # Loaders read every tensor of every shard the index names (transformers' from_pretrained and
    # load_sharded_checkpoint), whether the index lists it or not: so is an unlisted one here.
    unlisted: dict[str, str] = {}
    for shard, held in shards.items():
        for key, entry in held.items():
            if key in weight_map:
                continue
            if key in unlisted:
                raise CheckpointError(
                    f"{index}: tensor '{key}', which the index does not list, is in two shards, "
                    f"'{unlisted[key]}' and '{shard}': loaders would take whichever they read last; "
                    "list it in the index's weight_map under the shard to use"
                )
            unlisted[key] = shard
            entries[key] = entry
    fmt = "sharded-" + ("safetensors" if kinds == {"safetensors"} else "pt" if kinds == {"pt"} else "mixed")
    metadata = {k: str(v) for k, v in metadata.items()}
    files = [(index.parent / shard).resolve() for shard in dict.fromkeys(weight_map.values())]
    return Checkpoint(index, fmt, entries, metadata=metadata, files=files)


#: How a torch.save file begins: a zip archive's first record, or (the legacy format) the pickled
#: magic number torch writes first.
_PT_STARTS = {b"PK\x03\x04": "a zip archive (as torch.save writes)",
              b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19": "a legacy (non-zip) torch.save file"}


def _sniffed(p: Path) -> tuple[str, str] | None:
    """``(what p's first bytes say it is, the suffix that reads it)`` for a torch.save or
    safetensors file, whatever its name (HiFi-GAN's ``g_02500000``, a file renamed to the other
    format's suffix: :func:`_check_content`), else None (where it cannot be read too)."""
    try:
        with open(p, "rb") as f:
            head = f.read(16)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    for start, what in _PT_STARTS.items():
        if head.startswith(start):
            return what, PT_SUFFIXES[0]
    if len(head) >= 9 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") <= size - 8:
        return "a safetensors file", SAFETENSORS_SUFFIX
    return None


def _check_content(p: Path, fmt: str, index: Path | None = None) -> None:
    """Refuse a file whose first bytes say the other format than its suffix (a ``.safetensors`` file
    renamed ``.pt``, a ``torch.save`` file renamed ``.safetensors``), which the reader of its suffix
    would call corrupt or an unsafe pickle. It is not read as what it holds: the suffix is what
    ``torch.load``, transformers and safetensors' loaders go by, and they would fail on it. A shard
    named by ``index`` is not to be renamed alone: the index names it. (Where it cannot be read,
    the reader says why.)"""
    what, suffix = _sniffed(p) or (None, None)
    if fmt == "pt" and suffix == SAFETENSORS_SUFFIX:
        raise CheckpointError(f"{p}: is a safetensors file, but its suffix '{p.suffix}' says a torch.save "
                              f"checkpoint: {_renaming(SAFETENSORS_SUFFIX, index)}")
    if fmt == "safetensors" and suffix == PT_SUFFIXES[0]:
        raise CheckpointError(f"{p}: is {what}, but its suffix '{p.suffix}' says safetensors: "
                              f"{_renaming(PT_SUFFIXES[0], index)}")


def _renaming(suffix: str, index: Path | None) -> str:
    if index is None:
        return f"rename it to end in {suffix}"
    return f"rename it to end in {suffix} and its name in {index.name} with it"


def _safetensors_entries(p: Path) -> tuple[dict[str, Entry], dict[str, str]]:
    from safetensors import safe_open

    try:
        # safe_open validates the header: offsets in bounds, contiguous, matching shapes and dtypes.
        with safe_open(str(p), framework="pt") as f:
            metadata = f.metadata() or {}
            infos = {}
            for k in f.keys():
                sl = f.get_slice(k)
                infos[k] = TensorInfo(tuple(sl.get_shape()), _st_dtype(sl.get_dtype(), p))
        n, header = _raw_header(p)
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own SafetensorError, plus OSError / ValueError
        negative = _negative_in_header(p)  # safetensors: "invalid value: integer `-4`, expected usize"
        raise CheckpointError(f"{p}: not a valid safetensors file: " + (negative or f"({first_line(e)})")) from None
    base = 8 + n
    # In the order the data lies in the file (safe_open lists keys sorted by name).
    order = sorted(infos, key=lambda k: (header[k]["data_offsets"][0], k))
    entries = {k: Entry(infos[k], p, base + header[k]["data_offsets"][0]) for k in order}
    return entries, metadata


def _negative_in_header(p: Path) -> str | None:
    """``"tensor 'w' has a negative size (shape [-4])"`` where the safetensors header of ``p``, which
    safe_open refused, says so; ``None`` otherwise (it cannot be read, or holds no negative number)."""
    try:
        _, header = _raw_header(p)
        for key, entry in header.items():
            negative = negative_part(entry) if key != "__metadata__" and isinstance(entry, dict) else None
            if negative:
                return f"tensor '{key}' has {negative}"
    except (OSError, ValueError, AttributeError, RecursionError):
        pass
    return None


def _raw_header(p: Path) -> tuple[int, Any]:
    """A safetensors file's header length and its JSON, as stored (``ValueError`` where the length
    is past the file's end)."""
    with open(p, "rb") as f:
        (n,) = _unpack_u64(f.read(8))
        if n > os.fstat(f.fileno()).st_size:
            raise ValueError(f"a header of {n} bytes is longer than the file")
        return n, json.loads(f.read(n))


def _unpack_u64(b: bytes) -> tuple[int]:
    if len(b) != 8:
        raise ValueError("file too short for a safetensors header")
    return (int.from_bytes(b, "little"),)


def _st_dtype(name: str, p: Path) -> torch.dtype:
    try:
        return ST_DTYPES[name.upper()]
    except KeyError:
        raise CheckpointError(f"{p}: safetensors dtype {name} has no torch equivalent here") from None
