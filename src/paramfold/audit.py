"""Audit a checkpoint for parametrizations from its keys alone, and fold it into a plain checkpoint.

A model that uses ``torch.nn.utils.parametrize`` saves ``<module>.parametrizations.<tensor>.original``
(or ``original0..N``) plus the parametrization modules' own tensors
(``<module>.parametrizations.<tensor>.<i>.<name>``, e.g. FakeSparsity's ``0.mask``, spectral_norm's
``0._u``/``0._v``). ``audit_checkpoint`` groups those keys into sites and recognises each site's kind
from its tensors' names, shapes and dtypes, without building the model and without reading tensor
data. ``fold_checkpoint`` writes the checkpoint the *unparametrized* model would have
(``<module>.<tensor>`` keys), computing each recognised stateless kind with the op torch itself uses,
one tensor at a time.

Recognised from keys (and folded from the checkpoint alone):

* ``weight_norm``: ``original0`` (g) and ``original1`` (v); the norm dim is inferred from g's shape.
  Folded with ``torch._weight_norm(v, g, dim)``, the op of ``parametrizations.weight_norm``, so the
  result is bitwise equal. The legacy hook API's ``<name>_g``/``<name>_v`` pairs and
  ``<name>_orig``/``_u``/``_v`` triples are recognised (and folded) too.
* ``spectral_norm``: ``original`` plus ``0._u``/``0._v``. Folded to its eval-mode value
  ``W / vdot(u, W_mat @ v)`` from the stored vectors, exactly as ``_SpectralNorm.forward`` computes it
  in eval mode. Where the matrix dim is ambiguous from shapes (square ConvTranspose weights), it is
  resolved from the stored vectors (``v`` is the normalised ``W_mat^H u`` of the last power step).
* ``fake_sparsity``: ``original`` plus ``0.mask``: folded to ``mask * original``.

Recognised but folded only with ``model_factory`` (``--model``): ``orthogonal`` (``original`` plus
``0.base``: its value depends on the ``orthogonal_map``, which is not saved), ``torchao_subclass``
(``original0..N`` with quantized dtypes, from ``torchao.utils.unwrap_tensor_subclass``: the subclass
type and its metadata live in the model, not the file), and everything else, reported as ``custom``.
A parametrization without tensors of its own (a dtype cast, a 1-D spectral_norm, orthogonal without
trivialization) leaves no trace in the keys: a chain ``[weight_norm, cast]`` looks like plain
weight_norm. If your models stack such parametrizations, fold with ``model_factory``.

Example::

    >>> import torch, tempfile, os
    >>> from torch.nn.utils.parametrizations import weight_norm
    >>> from paramfold.audit import audit_checkpoint, fold_checkpoint
    >>> d = tempfile.mkdtemp()
    >>> torch.save(weight_norm(torch.nn.Linear(4, 3)).state_dict(), os.path.join(d, "wn.pt"))
    >>> report = audit_checkpoint(os.path.join(d, "wn.pt"))
    >>> [(s.key, s.kind, s.params) for s in report.sites]
    [('weight', 'weight_norm', {'dim': 0})]
    >>> fold_checkpoint(os.path.join(d, "wn.pt"), os.path.join(d, "plain.safetensors")).tensors
    2
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from paramfold.checkpoint import (
    Checkpoint,
    CheckpointError,
    TensorInfo,
    open_checkpoint,
    write_checkpoint,
    write_state_dict,
)
from paramfold.errors import first_few
from paramfold.output import OutputError, check_output

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "CheckpointSite",
    "AuditReport",
    "FoldResult",
    "audit_checkpoint",
    "fold_checkpoint",
    "load_factory",
    "print_report",
]

FOLDABLE_KINDS = ("weight_norm", "spectral_norm", "fake_sparsity")
_ORIGINAL = re.compile(r"original\d*")
_LEGACY_API = "weight_g/weight_v"
_LEGACY_SPECTRAL_API = "weight_orig/weight_u/weight_v"


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
            },
        }

    def to_json(self, indent: int | None = 2) -> str:
        text = json.dumps(self.to_dict(), indent=indent)
        # Shapes on one line: [256, 80, 7] rather than one number per line.
        return re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]", lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]", text)


@dataclass
class FoldResult:
    """What ``fold_checkpoint`` wrote: ``tensors`` keys and ``nbytes`` of data to ``out``."""

    out: Path
    tensors: int
    nbytes: int
    sites: int
    via: str  # "keys" (folded from the checkpoint alone) or "model" (materialised by the model)

    def summary(self) -> str:
        how = "materialised by the model" if self.via == "model" else "folded from the checkpoint"
        return (
            f"wrote {self.out}: {self.tensors} tensors, {_human(self.nbytes)}; "
            f"{self.sites} parametrized site{'' if self.sites == 1 else 's'} {how}"
        )


# --------------------------------------------------------------------------------------------------
# Audit
# --------------------------------------------------------------------------------------------------


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
        return _audit(path)[0]
    with open_checkpoint(path) as ckpt:
        report, _ = _audit(ckpt)
    return report


def _audit(ckpt: Checkpoint) -> tuple[AuditReport, list[tuple[str, CheckpointSite | None]]]:
    """The report, plus the fold plan: every output key in checkpoint order, with its site or None."""
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
        dim = _weight_norm_dim(g.shape, v.shape)
        if dim is not None and g.dtype.is_floating_point and v.dtype.is_floating_point:
            site.kind, site.params = "weight_norm", {"dim": dim}
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
                    site.note += "; the matrix dim is resolved from _u/_v when folding"
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


def _weight_norm_dim(g: tuple[int, ...], v: tuple[int, ...]) -> int | None:
    """The ``dim`` of ``torch.norm_except_dim(v, 2, dim)`` that gives a ``g`` of this shape.

    ``dim=None`` is stored by torch as ``-1``, for which ``g`` is a 0-d tensor. Where several dims fit
    (size-1 dims), the lowest wins, matching torch's default ``dim=0``.
    """
    if len(g) == 0 and len(v) > 0:
        return -1
    if len(g) != len(v):
        return None
    for d in range(len(v)):
        if g[d] == v[d] and all(g[j] == 1 for j in range(len(v)) if j != d):
            return d
    return None


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
        dim = _weight_norm_dim(g.shape, v.shape)
        if dim is None or not (g.dtype.is_floating_point and v.dtype.is_floating_point):
            continue
        module, _, tensor = key[:-2].rpartition(".")
        site = CheckpointSite(
            module,
            tensor,
            kind="weight_norm",
            originals={f"{tensor}_g": g, f"{tensor}_v": v},
            params={"dim": dim, "api": _LEGACY_API},
            folded=TensorInfo(v.shape, torch.promote_types(g.dtype, v.dtype)),
            foldable=True,
            note="legacy torch.nn.utils.weight_norm keys",
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
        params["api"] = _LEGACY_SPECTRAL_API
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
                note="legacy torch.nn.utils.spectral_norm keys, folded to its eval-mode value",
                keys={f"{tensor}_orig": key, f"{tensor}_u": base + "_u", f"{tensor}_v": base + "_v"},
            )
        )
    return found


# --------------------------------------------------------------------------------------------------
# Fold
# --------------------------------------------------------------------------------------------------


def fold_checkpoint(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    model_factory: Callable[[], torch.nn.Module] | str | None = None,
) -> FoldResult:
    """Write the unparametrized model's checkpoint (``<module>.<tensor>`` keys) to ``out``.

    ``out`` ends in ``.safetensors`` or ``.pt``. Without ``model_factory``, every site must be of a
    kind in ``FOLDABLE_KINDS``; they are computed tensor by tensor as torch computes them, and every
    other tensor is copied through, so memory stays around one tensor. With ``model_factory`` (a
    callable returning the parametrized model, or a ``"MODULE:FACTORY"`` string for ``load_factory``)
    the model is built, the checkpoint is loaded into it with ``strict=True``, the model is put in
    eval mode and every parametrized tensor is materialised once. The output is written to a
    temporary file in ``out``'s folder and renamed when complete; ``out`` must not be one of the
    checkpoint's own files (refused with ``CheckpointError``, exit code 2).

    Example::

        >>> import torch, tempfile, os
        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> d = tempfile.mkdtemp()
        >>> m = weight_norm(torch.nn.Linear(4, 3))
        >>> torch.save(m.state_dict(), os.path.join(d, "wn.pt"))
        >>> res = fold_checkpoint(os.path.join(d, "wn.pt"), os.path.join(d, "plain.pt"))
        >>> plain = torch.nn.Linear(4, 3)
        >>> _ = plain.load_state_dict(torch.load(res.out, weights_only=True), strict=True)
        >>> x = torch.randn(2, 4)
        >>> torch.equal(plain(x), m(x))
        True
    """
    with open_checkpoint(path) as ckpt:
        try:
            check_output(out, inputs=ckpt.files)
        except OutputError as e:
            raise CheckpointError(str(e), exit_code=e.exit_code) from None
        if model_factory is not None:
            return _fold_with_model(ckpt, Path(out), model_factory)
        report, plan = _audit(ckpt)
        refused = report.refused
        if refused:
            listed = first_few([f"{s.key} ({s.kind})" for s in refused], 3)
            raise CheckpointError(
                f"cannot fold {listed} from the checkpoint alone: {refused[0].note}; "
                "pass --model MODULE:FACTORY that builds the parametrized model"
            )
        specs: dict[str, TensorInfo] = {}
        for key, site in plan:
            if key in specs:
                raise CheckpointError(f"the folded checkpoint would hold '{key}' twice (a parametrized and a plain tensor)")
            specs[key] = ckpt.info(key) if site is None else site.folded  # type: ignore[assignment]
        nbytes = write_checkpoint(out, specs, _stream(ckpt, plan), metadata={"format": "pt"})
    return FoldResult(Path(out), len(specs), nbytes, len(report.sites), "keys")


def _stream(ckpt: Checkpoint, plan: list[tuple[str, CheckpointSite | None]]) -> Iterator[tuple[str, torch.Tensor]]:
    # Plain tensors are read into one reused buffer; the writer is done with each before the next.
    largest = max((ckpt.info(k).nbytes for k, site in plan if site is None), default=0)
    scratch = torch.empty(largest, dtype=torch.uint8)
    for key, site in plan:
        yield key, (ckpt.read(key, out=scratch) if site is None else _fold_site(ckpt, site))


def _fold_site(ckpt: Checkpoint, site: CheckpointSite) -> torch.Tensor:
    t = {name: ckpt.read(key) for name, key in site.keys.items()}
    try:
        with torch.no_grad():
            return _fold_tensors(site, t)
    except CheckpointError:
        raise
    except RuntimeError as e:  # e.g. a hand-edited file: fp16 g with fp32 v, fp64 _u with fp32 W
        if "memory" in str(e).lower():
            raise  # the allocator's "can't allocate memory": not the file's fault
        pieces = ", ".join(f"{n} {str(x.dtype)[6:]}{list(x.shape)}" for n, x in t.items())
        raise CheckpointError(
            f"cannot fold '{site.key}' ({site.kind}): torch refuses its stored tensors ({pieces}): "
            f"{str(e).strip().splitlines()[0][:200]}; the stock model could not compute it either: "
            "re-save the checkpoint from a working model"
        ) from None


def _fold_tensors(site: CheckpointSite, t: dict[str, torch.Tensor]) -> torch.Tensor:
    if site.kind == "weight_norm":
        if site.params.get("api") == _LEGACY_API:
            g, v = t[f"{site.tensor}_g"], t[f"{site.tensor}_v"]
        else:
            g, v = t["original0"], t["original1"]
        # parametrizations._WeightNorm.forward (and the legacy hook's compute_weight) call exactly this.
        return torch._weight_norm(v, g, site.params["dim"])
    if site.kind == "fake_sparsity":
        # torchao.prototype.sparsity.sparsifier.utils.FakeSparsity.forward
        return t["0.mask"] * t["original"]
    if site.kind == "spectral_norm":
        legacy = site.params.get("api") == _LEGACY_SPECTRAL_API
        name = site.tensor
        w, u, v = (t[f"{name}_orig"], t[f"{name}_u"], t[f"{name}_v"]) if legacy else (t["original"], t["0._u"], t["0._v"])
        dim = site.params["dim"]
        if dim is None:
            dim = _resolve_spectral_dim(w, u, v, site.params["dim_candidates"])
        if legacy:
            # torch.nn.utils.spectral_norm's SpectralNorm.compute_weight(do_power_iteration=False)
            sigma = torch.dot(u, torch.mv(_spectral_weight_mat(w, dim), v))
            return w / sigma
        return _spectral_norm_eval(w, u, v, dim)
    raise AssertionError(f"unfoldable kind {site.kind}")


def _spectral_weight_mat(weight: torch.Tensor, dim: int) -> torch.Tensor:
    # parametrizations._SpectralNorm._reshape_weight_to_matrix
    if dim != 0:
        weight = weight.permute(dim, *(d for d in range(weight.dim()) if d != dim))
    return weight.flatten(1)


def _spectral_norm_eval(weight: torch.Tensor, u: torch.Tensor, v: torch.Tensor, dim: int) -> torch.Tensor:
    # parametrizations._SpectralNorm.forward with self.training == False, op for op.
    weight_mat = _spectral_weight_mat(weight, dim)
    u = u.clone(memory_format=torch.contiguous_format)
    v = v.clone(memory_format=torch.contiguous_format)
    sigma = torch.vdot(u, torch.mv(weight_mat, v))
    return weight / sigma


def _resolve_spectral_dim(w: torch.Tensor, u: torch.Tensor, v: torch.Tensor, candidates: list[int]) -> int:
    # The power method ends with v = normalize(W_mat^H u): the right dim reproduces the stored v.
    def agreement(d: int) -> float:
        mat = _spectral_weight_mat(w.double(), d)
        return float(torch.dot(torch.nn.functional.normalize(torch.mv(mat.H, u.double()), dim=0), v.double()))

    return max(candidates, key=agreement)


def _fold_with_model(ckpt: Checkpoint, out: Path, model_factory: Callable[[], torch.nn.Module] | str) -> FoldResult:
    factory = load_factory(model_factory) if isinstance(model_factory, str) else model_factory
    name = model_factory if isinstance(model_factory, str) else getattr(model_factory, "__qualname__", "model_factory")
    try:
        model = factory()
    except Exception as e:
        raise CheckpointError(f"--model {name}: the factory raised {type(e).__name__}: {e}") from None
    except SystemExit as e:
        raise CheckpointError(f"--model {name}: the factory called sys.exit({e.code!r}) instead of returning a model") from None
    if not isinstance(model, torch.nn.Module):
        raise CheckpointError(f"--model {name}: the factory returned a {type(model).__name__}, not a torch.nn.Module")
    state = {k: ckpt.read(k) for k in ckpt.keys()}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        msg = " ".join(str(e).split())
        raise CheckpointError(
            f"the checkpoint does not fit the model from --model {name} (strict load): {msg[:400]}"
        ) from None
    del state
    model.eval()
    plain = _plain_state_dict(model)
    sites = sum(
        len(m.parametrizations) for m in model.modules() if torch.nn.utils.parametrize.is_parametrized(m)
    )
    nbytes = write_state_dict(out, plain)
    return FoldResult(out, len(plain), nbytes, sites, "model")


def _plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict the unparametrized model would have: paramfold's freeze materialisation.

    Call it in eval mode: a stateful parametrization (spectral_norm) would otherwise step its state.
    """
    from paramfold.state_dict import plain_state_dict

    return plain_state_dict(model)


def load_factory(spec: str) -> Callable[[], torch.nn.Module]:
    """Resolve ``"MODULE:FACTORY"`` to a callable that builds the parametrized model.

    ``MODULE`` is a dotted module importable from ``sys.path`` (``mypkg.models``) or a path to a
    ``.py`` file (``./models/vocoder.py``, whose folder is put first on ``sys.path`` while it is
    imported); ``FACTORY`` names a callable in it taking no arguments (a function or a class).

    Example::

        >>> load_factory("torch.nn:Identity")()
        Identity()
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise CheckpointError(
            f"--model {spec!r}: expected MODULE:FACTORY, e.g. mypkg.models:build or ./make_model.py:build",
            exit_code=2,
        )
    try:
        if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
            module = _import_file(Path(module_name))
        else:
            module = importlib.import_module(module_name)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"--model {spec}: cannot import {module_name}: {type(e).__name__}: {e}", exit_code=2) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CheckpointError(f"--model {spec}: {module_name} has no callable named {attr!r}", exit_code=2)
    return factory


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"--model: no such file {path}", exit_code=2)
    name = f"_paramfold_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CheckpointError(f"--model: cannot import {path} as a Python module", exit_code=2)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


# --------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------


def print_report(report: AuditReport, console: Console | None = None) -> None:
    """Print ``report`` as a rich table and a summary line."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    root = f" (under '{report.root}')" if report.root else ""
    table = Table(title=escape(f"{report.path} [{report.format}]{root}"), title_justify="left")
    table.add_column("module", overflow="fold")
    table.add_column("tensor")
    table.add_column("kind")
    table.add_column("originals", overflow="fold")
    table.add_column("stored", justify="right")
    table.add_column("folded", justify="right")
    styles = {"custom": "red", "orthogonal": "yellow", "torchao_subclass": "yellow"}
    for s in report.sites:
        pieces = [f"{n} {_shape(i)} {i.dtype_name}" for n, i in {**s.originals, **s.state}.items()]
        kind = s.kind + (f" dim={s.params['dim']}" if s.params.get("dim") is not None else "")
        table.add_row(
            escape(s.module or "(root)"),
            escape(s.tensor),
            f"[{styles.get(s.kind, 'green')}]{kind}[/]",
            escape("\n".join(pieces)),
            _human(s.originals_bytes + s.state_bytes),
            "?" if s.folded_bytes is None else _human(s.folded_bytes),
        )
    if report.sites:
        console.print(table)
    kinds = ", ".join(f"{k} {n}" for k, n in report.kinds.items()) or "none"
    stored = sum(s.originals_bytes + s.state_bytes for s in report.sites)
    folded = sum(s.folded_bytes or 0 for s in report.sites)
    unknown = sum(s.folded_bytes is None for s in report.sites)
    refused = len(report.refused)
    n = len(report.sites)
    if unknown == n and n:
        folded_text = "?"
    else:
        folded_text = _human(folded) + (f" + {unknown} unknown" if unknown else "")
    console.print(
        f"{n} parametrized site{'' if n == 1 else 's'} ({kinds}); stored {_human(stored)} -> folded "
        f"{folded_text}; {report.plain_tensors} plain tensors ({_human(report.plain_bytes)}); "
        + ("foldable from keys alone" if not refused else f"{refused} need --model to fold"),
        highlight=False,
    )


def _shape(i: TensorInfo) -> str:
    return "[" + ",".join(map(str, i.shape)) + "]"


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"
