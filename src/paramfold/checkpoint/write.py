"""Writing checkpoints: atomic and streaming, to ``.safetensors`` or ``torch.save``'s ``.pt`` layout.

Everything goes through :func:`paramfold.output.atomic_output` (a temporary file renamed over the
target only when complete, normal permissions, nothing left on an error or a signal), and streams:
tensors are written one at a time, as they are produced. The ``.pt`` record layout is written by
:mod:`._torch_format`; tensor subclasses, which only ``torch.save`` can write, go through it.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from paramfold.checkpoint._torch_format import write_pt
from paramfold.checkpoint.common import (
    PT_SUFFIXES,
    ST_NAMES,
    CheckpointError,
    TensorInfo,
    file_format,
    raw_bytes,
)
from paramfold.errors import with_article
from paramfold.output import OutputError, atomic_output, check_output

__all__ = ["write_checkpoint", "write_state_dict"]


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
    checked = _checked(specs, tensors)
    with _output(out) as f:
        if fmt == "safetensors":
            return _write_safetensors(f, specs, checked, metadata)
        return write_pt(f, specs, checked)


def _output(out: Path) -> Any:
    """``atomic_output`` with its path errors as ``CheckpointError`` (same message, same exit code)."""
    try:
        check_output(out)
    except OutputError as e:
        raise CheckpointError(str(e), exit_code=e.exit_code) from None
    return atomic_output(out)


def write_state_dict(path: str | os.PathLike[str], state_dict: Mapping[str, torch.Tensor], *,
                     metadata: Mapping[str, str] | None = None) -> int:
    """Atomically write an in-memory state dict (``.safetensors`` or ``.pt``). Returns data bytes.
    ``metadata``: the safetensors header's ``__metadata__`` (not stored in ``.pt``).

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
        return write_checkpoint(out, specs, state_dict.items(), metadata=metadata)
    if fmt == "safetensors":
        k = subclassed[0]
        raise CheckpointError(
            f"'{k}' is {with_article(type(state_dict[k]).__name__)} (a tensor subclass), which .safetensors cannot "
            "hold; write the folded checkpoint to a .pt file instead",
        )  # exit 1, as a dtype .safetensors cannot hold: found in the folded values, after the report
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
    fmt = file_format(out)
    if fmt is not None:
        return fmt
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
            raise CheckpointError(f"'{key}' is {with_article(type(t).__name__)}; only plain tensors can be streamed")
        if TensorInfo.of(t) != specs[key]:
            raise ValueError(f"write_checkpoint: '{key}' is {TensorInfo.of(t)}, announced {specs[key]}")
        # A conjugate/negative view (lazy math bits) is written as its value, as torch.save would load back.
        yield key, t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    missing = next(keys, None)
    if missing is not None:
        raise ValueError(f"write_checkpoint: announced tensor '{missing}' was never produced")


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
        if info.dtype not in ST_NAMES:
            raise CheckpointError(f"'{key}' has dtype {info.dtype_name}, which .safetensors cannot hold; write .pt")
        if not _utf8(key):  # a lone surrogate (torch.save keeps one) would make the header unreadable
            raise CheckpointError(f"key {key!r} is not valid UTF-8, which .safetensors cannot hold; write .pt")
        header[key] = {"dtype": ST_NAMES[info.dtype], "shape": list(info.shape), "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data section to 8 bytes
    f.write(len(blob).to_bytes(8, "little"))
    f.write(blob)
    for _, t in tensors:
        if t.numel():
            f.write(raw_bytes(t))
    return offset


def _utf8(key: str) -> bool:
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
