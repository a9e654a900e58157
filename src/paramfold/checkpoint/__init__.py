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
  its record holds is refused when the file is opened, and so is a view whose value is more than
  ``EXPANSION_ALLOWANCE`` (64 MiB) larger than its storage (a stride-0 expansion of a few bytes). Legacy (non-zip) files have no checksum:
  they are read with ``torch.load(weights_only=True, map_location="cpu")`` in memory.
* ``.safetensors``: ``safetensors.safe_open`` validates the header (offsets within the file,
  contiguous, consistent with shapes and dtypes) and gives keys, shapes, dtypes and metadata; data
  is read by positioned reads at the header's offsets (not through a memory map, so a streamed
  pass over a large file does not pile up resident pages). The format has no checksum.
* A Hugging Face style folder (the file transformers' ``from_pretrained`` would load: see
  ``read._HF_WEIGHTS_NAMES``; else the folder's one index or one checkpoint file), or an index
  (``*.safetensors.index.json`` or ``*.bin.index.json``) itself: every key is read from the shard that the index names, and every tensor of those
  shards that the index does not list too, as loaders read every tensor of every shard.
* A training checkpoint (a dict with a nested ``state_dict``, ``model`` or ``model_state_dict``) is
  read from that entry.

Writing (``write_checkpoint``) goes through :func:`paramfold.output.atomic_output` (a temporary
file renamed over the target only when complete, normal permissions, nothing left on an error or
a signal), and streams: tensors are written one at a time, as they are produced. ``.pt`` output is
the zip layout ``torch.save`` writes (records aligned to 64 bytes, CRC-32 per record), written
with :mod:`zipfile`.

The package: :mod:`.read` (``open_checkpoint``, ``Checkpoint``), :mod:`.write` (``write_checkpoint``,
``write_state_dict``), :mod:`.common` (``CheckpointError``, ``TensorInfo``) and
:mod:`._torch_format`, the one module that knows torch's private serialization format (the ``.pt``
archive, its pickle, its records), with notes on which torch versions it was checked against and
what breaks if torch changes it. Every public name is importable from ``paramfold.checkpoint``.

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

from paramfold.checkpoint._torch_format import NESTED_STATE_DICT_KEYS  # noqa: F401 (public, not in __all__)
from paramfold.checkpoint.common import PT_SUFFIXES, SAFETENSORS_SUFFIX, CheckpointError, TensorInfo
from paramfold.checkpoint.read import Checkpoint, open_checkpoint
from paramfold.checkpoint.write import write_checkpoint, write_state_dict

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
