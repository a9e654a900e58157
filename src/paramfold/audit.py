"""Audit a checkpoint for parametrizations from its keys alone: which tensors, of which kind.

A model that uses ``torch.nn.utils.parametrize`` saves ``<module>.parametrizations.<tensor>.original``
(or ``original0..N``) plus the parametrization modules' own tensors
(``<module>.parametrizations.<tensor>.<i>.<name>``, e.g. FakeSparsity's ``0.mask``, spectral_norm's
``0._u``/``0._v``). ``audit_checkpoint`` groups those keys into sites and recognises each site's kind
from its tensors' names, shapes and dtypes, without building the model and without reading tensor
data. This module only inspects; :mod:`paramfold.fold` computes and writes the plain tensors
(``fold_checkpoint``), following the plan :func:`audit_plan` makes here, and :mod:`paramfold.audit_render`
prints the report.

Recognised from keys (and foldable from the checkpoint alone, ``FOLDABLE_KINDS``):

* ``weight_norm``: ``original0`` (g) and ``original1`` (v); the norm dim is inferred from g's shape
  (where several dims fit, size-1 dims of v, the site lists ``dim_candidates`` and the fold
  refuses unless they give the same value). The legacy hook API's
  ``<name>_g``/``<name>_v`` pairs are recognised too.
* ``spectral_norm``: ``original`` plus ``0._u``/``0._v``; also the legacy hook API's
  ``<name>_orig``/``_u``/``_v`` triples. Where the shape leaves the matrix dim open (the weight's
  first two dims are equal: ``Conv*(c, c, k)``, ``ConvTranspose*(c, c, k)``, a square ``Linear``),
  the site lists ``dim_candidates`` and the fold reads it from the stored vectors, or refuses
  where they cannot tell (``paramfold.fold._resolve_spectral_dim``).
* ``fake_sparsity``: ``original`` plus ``0.mask``.

Recognised but foldable only with the model (``model_factory``, ``--model``): ``orthogonal``
(``original`` plus ``0.base``: its value depends on the ``orthogonal_map``, which is not saved),
``torchao_subclass`` (``original0..N`` with quantized dtypes, from
``torchao.utils.unwrap_tensor_subclass``: the subclass type and its metadata live in the model, not
the file), and everything else, reported as ``custom``. A parametrization without tensors of its own
(a dtype cast, a 1-D spectral_norm, orthogonal without trivialization) leaves no trace in the keys: a
chain ``[weight_norm, cast]`` looks like plain weight_norm. Nor do keys say which class saved them:
a custom parametrization whose tensors are named and shaped like a known kind's is taken for it.
If your models stack such parametrizations or have such classes, fold with ``model_factory``.

``fold_checkpoint``, ``FoldResult``, ``load_factory`` and ``print_report`` lived here before the split
and are still importable from this module (resolved on first use, so that this module does not import
the ones that import it).

Example::

    >>> import torch, tempfile, os
    >>> from torch.nn.utils.parametrizations import weight_norm
    >>> from paramfold.audit import audit_checkpoint
    >>> d = tempfile.mkdtemp()
    >>> torch.save(weight_norm(torch.nn.Linear(4, 3)).state_dict(), os.path.join(d, "wn.pt"))
    >>> report = audit_checkpoint(os.path.join(d, "wn.pt"))
    >>> [(s.key, s.kind, s.params) for s in report.sites]
    [('weight', 'weight_norm', {'dim': 0})]
"""

from __future__ import annotations

import importlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from paramfold.checkpoint import Checkpoint, TensorInfo, open_checkpoint

__all__ = [
    "CheckpointSite",
    "AuditReport",
    "FOLDABLE_KINDS",
    "audit_checkpoint",
    "audit_plan",
    # moved, still importable from here: see _MOVED
    "FoldResult",  # noqa: F822 (resolved by __getattr__)
    "fold_checkpoint",  # noqa: F822
    "load_factory",  # noqa: F822
    "print_report",  # noqa: F822
]

FOLDABLE_KINDS = ("weight_norm", "spectral_norm", "fake_sparsity")
# ``params["api"]`` of a site found from the legacy hook API's keys rather than parametrize's.
LEGACY_WEIGHT_NORM_API = "weight_g/weight_v"
LEGACY_SPECTRAL_NORM_API = "weight_orig/weight_u/weight_v"
_ORIGINAL = re.compile(r"original\d*")

# Names that moved out of this module in the audit/fold split -> the module that defines them now.
_MOVED = {
    "FoldResult": "paramfold.fold",
    "fold_checkpoint": "paramfold.fold",
    "load_factory": "paramfold.factory",
    "print_report": "paramfold.audit_render",
}


def __getattr__(name: str) -> Any:
    # Resolved on first use: paramfold.fold imports this module, so this one cannot import it back.
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


@dataclass
class CheckpointSite:
    """One parametrized tensor found in a checkpoint.

    ``originals`` and ``state`` map local names (``original0``, ``0._u``) to shape and dtype; ``keys``
    maps the same local names to the checkpoint's keys. ``folded`` is the folded tensor's shape and
    dtype where the kind tells it, ``None`` otherwise.
    """

    module: str
    tensor: str
    kind: str = "custom"
    originals: dict[str, TensorInfo] = field(default_factory=dict)
    state: dict[str, TensorInfo] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    folded: TensorInfo | None = None
    foldable: bool = False
    note: str | None = None
    keys: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """The key this tensor has in the unparametrized model's state dict."""
        return f"{self.module}.{self.tensor}" if self.module else self.tensor

    @property
    def decided_by_data(self) -> bool:
        """Foldable from the keys only if the tensors' values settle what the shapes leave open
        (``dim_candidates``): the fold reads them and refuses, saying to pass ``--model``, where they
        cannot tell."""
        return self.foldable and "dim_candidates" in self.params

    @property
    def originals_bytes(self) -> int:
        return sum(i.nbytes for i in self.originals.values())

    @property
    def state_bytes(self) -> int:
        return sum(i.nbytes for i in self.state.values())

    @property
    def folded_bytes(self) -> int | None:
        return None if self.folded is None else self.folded.nbytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "tensor": self.tensor,
            "kind": self.kind,
            "originals": {k: v.to_dict() for k, v in self.originals.items()},
            "state": {k: v.to_dict() for k, v in self.state.items()},
            "params": dict(self.params),
            "folded": None if self.folded is None else self.folded.to_dict(),
            "bytes": {"originals": self.originals_bytes, "state": self.state_bytes, "folded": self.folded_bytes},
            "foldable": self.foldable,
            "decided_by_data": self.decided_by_data,
            "note": self.note,
        }


@dataclass
class AuditReport:
    """What ``audit_checkpoint`` found. ``to_json()`` gives the stable document the CLI prints."""

    path: str
    format: str
    root: str | None
    sites: list[CheckpointSite]
    plain_tensors: int
    plain_bytes: int
    #: Entries beside ``root`` that are dicts of scalar tensors only, taken as metadata (metrics).
    beside: tuple[str, ...] = ()

    @property
    def kinds(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.sites:
            counts[s.kind] = counts.get(s.kind, 0) + 1
        return counts

    @property
    def refused(self) -> list[CheckpointSite]:
        """Sites that cannot be folded from the checkpoint alone."""
        return [s for s in self.sites if not s.foldable]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "root": self.root,
            "beside": list(self.beside),
            "sites": [s.to_dict() for s in self.sites],
            "plain_tensors": self.plain_tensors,
            "plain_bytes": self.plain_bytes,
            "summary": {
                "sites": len(self.sites),
                "kinds": self.kinds,
                "originals_bytes": sum(s.originals_bytes for s in self.sites),
                "state_bytes": sum(s.state_bytes for s in self.sites),
                "folded_bytes": sum(s.folded_bytes or 0 for s in self.sites),
                "foldable_without_model": not self.refused,
                "decided_by_data": sum(s.decided_by_data for s in self.sites),
            },
        }

    def to_json(self, indent: int | None = 2) -> str:
        return _json_with_flat_shapes(self.to_dict(), indent)


def _json_with_flat_shapes(value: Any, indent: int | None, level: int = 0) -> str:
    """``json.dumps(value, indent=indent)``, but with every list of integers (a shape, dims) on one
    line: ``[256, 80, 7]`` rather than one number per line. Built from the structure, so that text
    inside strings (a path ``run[1,2].pt``) stays as it is."""
    if isinstance(value, list) and value and all(type(x) is int for x in value):
        return json.dumps(value)
    if indent is None or not isinstance(value, (dict, list)) or not value:
        return json.dumps(value, indent=indent)
    inner = "\n" + " " * (indent * (level + 1))
    if isinstance(value, dict):
        items = [f"{json.dumps(str(k))}: {_json_with_flat_shapes(v, indent, level + 1)}" for k, v in value.items()]
        brackets = "{}"
    else:
        items = [_json_with_flat_shapes(v, indent, level + 1) for v in value]
        brackets = "[]"
    return brackets[0] + inner + ("," + inner).join(items) + "\n" + " " * (indent * level) + brackets[1]



def audit_checkpoint(path: str | os.PathLike[str] | Checkpoint) -> AuditReport:
    """Find every parametrized tensor in the checkpoint at ``path`` and recognise its kind.

    Reads only metadata (see ``paramfold.checkpoint`` for formats and safety). ``path`` may also
    be a checkpoint already opened with ``paramfold.checkpoint.open_checkpoint`` (left open).
    Raises ``CheckpointError`` with a one-line message for unreadable input.

    Example::

        >>> import torch, tempfile, os
        >>> from torch.nn.utils.parametrizations import spectral_norm
        >>> p = os.path.join(tempfile.mkdtemp(), "sn.pt")
        >>> torch.save(spectral_norm(torch.nn.Linear(5, 4)).state_dict(), p)
        >>> r = audit_checkpoint(p)
        >>> r.sites[0].kind, r.sites[0].params, r.plain_tensors
        ('spectral_norm', {'dim': 0}, 1)
        >>> r.to_dict()["sites"][0]["originals"]
        {'original': {'shape': [4, 5], 'dtype': 'float32'}}
    """
    if isinstance(path, Checkpoint):
        return audit_plan(path)[0]
    with open_checkpoint(path) as ckpt:
        report, _ = audit_plan(ckpt)
    return report


def audit_plan(ckpt: Checkpoint) -> tuple[AuditReport, list[tuple[str, CheckpointSite | None]]]:
    """The report, plus the fold plan: every output key in checkpoint order, with its site or None.

    A plain tensor keeps its key (``None``); a site's keys collapse into one output key, placed where
    the site's first key was. :func:`paramfold.fold.fold_checkpoint` writes the plan in this order.
    """
    sites: dict[tuple[str, str], CheckpointSite] = {}
    plain: list[str] = []
    order: list[tuple[str, tuple[str, str] | None]] = []
    for key in ckpt.keys():
        parsed = _parse_key(key)
        if parsed is None:
            plain.append(key)
            order.append((key, None))
            continue
        module, tensor, local = parsed
        site = sites.get((module, tensor))
        if site is None:
            site = sites[(module, tensor)] = CheckpointSite(module, tensor)
            order.append((key, (module, tensor)))
        (site.originals if _ORIGINAL.fullmatch(local) else site.state)[local] = ckpt.info(key)
        site.keys[local] = key

    for site in sites.values():
        _classify(site)
    legacy = _legacy_weight_norm_sites(ckpt, plain) + _legacy_spectral_norm_sites(ckpt, plain)
    legacy_keys = {k for s in legacy for k in s.keys.values()}
    legacy_first = {next(k for k in plain if k in s.keys.values()): s for s in legacy}
    plain = [k for k in plain if k not in legacy_keys]

    plan: list[tuple[str, CheckpointSite | None]] = []
    for key, ref in order:
        if ref is not None:
            plan.append((sites[ref].key, sites[ref]))
        elif key in legacy_first:
            plan.append((legacy_first[key].key, legacy_first[key]))
        elif key not in legacy_keys:
            plan.append((key, None))

    ordered_sites = [s for _, s in plan if s is not None]
    report = AuditReport(
        path=str(ckpt.path),
        format=ckpt.format,
        root=ckpt.root,
        beside=ckpt.beside,
        sites=ordered_sites,
        plain_tensors=len(plain),
        plain_bytes=sum(ckpt.info(k).nbytes for k in plain),
    )
    return report, plan


def _parse_key(key: str) -> tuple[str, str, str] | None:
    """``a.b.parametrizations.weight.original0`` -> ``("a.b", "weight", "original0")``."""
    parts = key.split(".")
    for i, part in enumerate(parts[:-2]):
        if part != "parametrizations":
            continue
        rest = parts[i + 2 :]
        if (len(rest) == 1 and _ORIGINAL.fullmatch(rest[0])) or (len(rest) >= 2 and rest[0].isdigit()):
            return ".".join(parts[:i]), parts[i + 1], ".".join(rest)
    return None


def _classify(site: CheckpointSite) -> None:
    orig, state = site.originals, site.state
    names, snames = set(orig), set(state)
    if not names:
        site.note = "parametrization tensors without any original"
        return
    if len(names) >= 2 and not state and _has_quantized(orig.values()):
        site.kind = "torchao_subclass"
        site.note = (
            "a tensor subclass unwrapped into plain pieces (torchao unwrap_tensor_subclass): its type "
            "and metadata live in the model, not in the checkpoint"
        )
        return
    if names == {"original0", "original1"} and not state:
        g, v = orig["original0"], orig["original1"]
        params = _weight_norm_params(g.shape, v.shape)
        if params is not None and g.dtype.is_floating_point and v.dtype.is_floating_point:
            site.kind, site.params = "weight_norm", params
            if params["dim"] is None:
                site.note = _WEIGHT_NORM_DIM_NOTE
            site.folded = TensorInfo(v.shape, torch.promote_types(g.dtype, v.dtype))
            site.foldable = True
            return
    if names == {"original"}:
        w = orig["original"]
        if snames == {"0._u", "0._v"}:
            dims = _spectral_dims(w.shape, state["0._u"].shape, state["0._v"].shape)
            if dims:
                site.kind = "spectral_norm"
                site.params = {"dim": dims[0]} if len(dims) == 1 else {"dim": None, "dim_candidates": dims}
                site.folded, site.foldable = w, True
                site.note = "folded to its eval-mode value from the stored _u/_v"
                if len(dims) > 1:
                    site.note += "; the matrix dim is read from _u/_v when folding (refused where they cannot tell)"
                return
        if snames == {"0.mask"} and state["0.mask"].shape == w.shape:
            site.kind = "fake_sparsity"
            site.folded = TensorInfo(w.shape, torch.promote_types(state["0.mask"].dtype, w.dtype))
            site.foldable = True
            return
        if snames == {"0.base"} and _is_orthogonal_base(w.shape, state["0.base"].shape):
            site.kind = "orthogonal"
            site.note = "its value depends on the orthogonal_map, which the checkpoint does not record"
            return
    site.note = "not recognised from its keys"


def _weight_norm_dims(g: tuple[int, ...], v: tuple[int, ...]) -> list[int]:
    """Every ``dim`` of ``torch.norm_except_dim(v, 2, dim)`` that gives a ``g`` of this shape.

    ``dim=None`` is stored by torch as ``-1``, for which ``g`` is a 0-d tensor. Several dims fit
    where ``v`` has several size-1 dims (``g`` is then all ones).
    """
    if len(g) == 0 and len(v) > 0:
        return [-1]
    if len(g) != len(v):
        return []
    return [d for d in range(len(v)) if g[d] == v[d] and all(g[j] == 1 for j in range(len(v)) if j != d)]


def _weight_norm_params(g: tuple[int, ...], v: tuple[int, ...]) -> dict[str, Any] | None:
    """``params`` of a weight_norm site: ``{"dim": d}``, or ``{"dim": None, "dim_candidates": [...]}``.

    Where several dims fit (size-1 dims of ``v``: ``Conv1d(1, 1, k)`` normed over dim 0 or 1, a 1x1
    conv over dim 2 or 3), torch computes them with different kernels (dim 0 and the last dim fused,
    the others generic), which may round differently: the fold computes each and refuses unless
    they agree bitwise (``paramfold.fold._resolve_weight_norm_dim``).
    """
    dims = _weight_norm_dims(g, v)
    if not dims:
        return None
    if len(dims) == 1:
        return {"dim": dims[0]}
    return {"dim": None, "dim_candidates": dims}


_WEIGHT_NORM_DIM_NOTE = (
    "the shapes fit several norm dims (size-1 dims), which torch computes with different kernels; "
    "folded only where they give the same value"
)


def _spectral_dims(w: tuple[int, ...], u: tuple[int, ...], v: tuple[int, ...]) -> list[int]:
    if len(w) < 2 or len(u) != 1 or len(v) != 1:
        return []
    numel = 1
    for s in w:
        numel *= s
    if u[0] * v[0] != numel:
        return []
    return [d for d in range(len(w)) if w[d] == u[0]]


def _is_orthogonal_base(w: tuple[int, ...], base: tuple[int, ...]) -> bool:
    if len(w) < 2 or len(base) != len(w) or base[:-2] != w[:-2]:
        return False
    n = max(w[-2], w[-1])
    return base[-2:] == (n, n)


def _has_quantized(infos: Any) -> bool:
    def quantized(dt: torch.dtype) -> bool:
        return (not dt.is_floating_point and not dt.is_complex and dt != torch.bool) or "float8" in str(dt)

    infos = list(infos)
    return any(quantized(i.dtype) for i in infos) and any(i.dtype.is_floating_point for i in infos)


def _legacy_weight_norm_sites(ckpt: Checkpoint, plain: list[str]) -> list[CheckpointSite]:
    """``<m>.<name>_g`` / ``<m>.<name>_v`` pairs of the legacy ``torch.nn.utils.weight_norm`` hook."""
    present = set(plain)
    found = []
    for key in plain:
        if not key.endswith("_g") or key[:-2] + "_v" not in present or key[:-2] in present:
            continue
        g, v = ckpt.info(key), ckpt.info(key[:-2] + "_v")
        params = _weight_norm_params(g.shape, v.shape)
        if params is None or not (g.dtype.is_floating_point and v.dtype.is_floating_point):
            continue
        module, _, tensor = key[:-2].rpartition(".")
        site = CheckpointSite(
            module,
            tensor,
            kind="weight_norm",
            originals={f"{tensor}_g": g, f"{tensor}_v": v},
            params={**params, "api": LEGACY_WEIGHT_NORM_API},
            folded=TensorInfo(v.shape, torch.promote_types(g.dtype, v.dtype)),
            foldable=True,
            note="legacy torch.nn.utils.weight_norm keys" + ("; " + _WEIGHT_NORM_DIM_NOTE if params["dim"] is None else ""),
            keys={f"{tensor}_g": key, f"{tensor}_v": key[:-2] + "_v"},
        )
        found.append(site)
    return found


def _legacy_spectral_norm_sites(ckpt: Checkpoint, plain: list[str]) -> list[CheckpointSite]:
    """``<m>.<name>_orig`` / ``_u`` / ``_v`` of the legacy ``torch.nn.utils.spectral_norm`` hook."""
    present = set(plain)
    found = []
    for key in plain:
        if not key.endswith("_orig"):
            continue
        base = key[: -len("_orig")]
        if base + "_u" not in present or base + "_v" not in present or base in present:
            continue
        w, u, v = ckpt.info(key), ckpt.info(base + "_u"), ckpt.info(base + "_v")
        dims = _spectral_dims(w.shape, u.shape, v.shape)
        if not dims or not w.dtype.is_floating_point:
            continue
        module, _, tensor = base.rpartition(".")
        params: dict[str, Any] = {"dim": dims[0]} if len(dims) == 1 else {"dim": None, "dim_candidates": dims}
        params["api"] = LEGACY_SPECTRAL_NORM_API
        found.append(
            CheckpointSite(
                module,
                tensor,
                kind="spectral_norm",
                originals={f"{tensor}_orig": w},
                state={f"{tensor}_u": u, f"{tensor}_v": v},
                params=params,
                folded=w,
                foldable=True,
                note="legacy torch.nn.utils.spectral_norm keys, folded to its eval-mode value" + (
                    "; the matrix dim is read from _u/_v when folding (refused where they cannot tell)" if len(dims) > 1 else ""),
                keys={f"{tensor}_orig": key, f"{tensor}_u": base + "_u", f"{tensor}_v": base + "_v"},
            )
        )
    return found
