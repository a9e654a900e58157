"""What reading and writing checkpoints share: the public types, file suffixes and dtype names.

``CheckpointError`` and ``TensorInfo`` are public (importable from :mod:`paramfold.checkpoint`).
The other names here are shared by the modules of this package and are not part of its API.
"""

from __future__ import annotations

import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paramfold.errors import FoldError

__all__ = ["CheckpointError", "TensorInfo", "PT_SUFFIXES", "SAFETENSORS_SUFFIX"]

PT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SAFETENSORS_SUFFIX = ".safetensors"


def file_format(path: Path | str) -> str | None:
    """``"safetensors"`` or ``"pt"`` by the file's name, in any case (``B.SAFETENSORS``); ``None``
    for another name. The one place that decides a single file's format, reading or writing."""
    name = Path(path).name.lower()
    if name.endswith(SAFETENSORS_SUFFIX):
        return "safetensors"
    if name.endswith(PT_SUFFIXES):
        return "pt"
    return None


class CheckpointError(FoldError):
    """A checkpoint cannot be read or written as asked. The message is one line saying what to do,
    with the paths and keys it names as they are (a control character in one is data: the command
    line shows it escaped); another library's message quoted in it is made one line where it is
    quoted (:func:`~paramfold.errors.one_line`, :func:`first_line`).

    ``exit_code`` is what the CLI exits with: 2 for a wrong invocation (missing path, unsupported
    format, missing output folder), 1 for a problem in the file's contents.
    """

    def __init__(self, message: str, *, exit_code: int = 1) -> None:
        super().__init__(message)
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
        return self.numel * element_size(self.dtype)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype_name}

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorInfo:
        return cls(tuple(t.shape), t.dtype)


def element_size(dtype: torch.dtype) -> int:
    with warnings.catch_warnings():  # complex32's "ComplexHalf support is experimental": not our line
        warnings.simplefilter("ignore")
        return torch.empty((), dtype=dtype, device="meta").element_size()


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


#: How a negative number in each part of a stored tensor's description is said (:func:`negative_part`).
_NEGATIVE_PARTS = {"shape": "size", "stride": "stride", "storage offset": "storage offset", "data_offsets": "data offset"}


def negative_part(parts: dict[str, Any]) -> str | None:
    """``"a negative size (shape [-4])"`` for the first of a stored tensor's ``parts`` (``shape``,
    ``stride``, ``storage offset``, ``data_offsets``: lists of numbers) that holds a negative number,
    which no writer makes (a corrupt file); ``None`` where none does."""
    for name, said in _NEGATIVE_PARTS.items():
        values = parts.get(name)
        if isinstance(values, (list, tuple)) and any(isinstance(v, int) and v < 0 for v in values):
            return f"a negative {said} ({name} {list(values)})"
    return None


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line (300 characters at most), for one-line errors."""
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


@dataclass
class Entry:
    """Where one tensor's bytes are: ``file`` at byte ``offset`` (the start of its storage)."""

    info: TensorInfo
    file: Path | None = None
    offset: int = 0
    stride: tuple[int, ...] | None = None  # None: contiguous
    storage_offset: int = 0  # in elements
    tensor: torch.Tensor | None = None  # already loaded (legacy non-zip files)
    record: zipfile.ZipInfo | None = None  # .pt: the zip record holding the storage (CRC checked)
    conj: bool = False  # .pt: saved as a conjugate view (the value is the stored bytes conjugated)
    neg: bool = False  # .pt: saved as a negative view (the value is the stored bytes negated)


# safetensors' dtype names (its format spec), for the dtypes this torch has.
ST_DTYPES: dict[str, torch.dtype] = {
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
        ST_DTYPES[_name] = getattr(torch, _attr)
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
