"""Fold a checkpoint: compute the plain tensors from the parametrization originals and write them.

``fold_checkpoint`` writes the checkpoint the *unparametrized* model would have
(``<module>.<tensor>`` keys), following the plan that :func:`paramfold.audit.audit_plan` makes from
the keys. Each recognised stateless kind is computed with the op torch itself uses, one tensor at a
time, so the result is bitwise equal to what the stock model computes:

* ``weight_norm``: ``torch._weight_norm(v, g, dim)``, the op of ``parametrizations.weight_norm`` and
  of the legacy hook's ``compute_weight``. Where the shapes fit several dims (size-1 dims of v),
  which torch computes with kernels that round differently, it is refused unless they all give
  the same value (see :func:`_resolve_weight_norm_dim`).
* ``spectral_norm``: its eval-mode value ``W / vdot(u, W_mat @ v)`` from the stored vectors, exactly
  as ``_SpectralNorm.forward`` computes it in eval mode (the legacy hook's
  ``compute_weight(do_power_iteration=False)`` for legacy keys). A matrix dim the shape leaves
  open (a weight whose first two dims are equal: ``Conv*(c, c, k)``, ``ConvTranspose*(c, c, k)``,
  a square ``Linear``) is read from the stored vectors, where they are the last power step's for
  this weight (``v`` is the normalised ``W_mat^H u``; for the legacy hook, ``u`` the normalised
  ``W_mat v``), else refused unless every dim gives the same value (see
  :func:`_resolve_spectral_dim`).
* ``fake_sparsity``: ``mask * original``.

The stored tensors are computed in their own dtype, as a model of that dtype computes them; with
``dtype`` every floating-point tensor is cast to it first, exactly as ``load_state_dict`` casts
them into ``model.to(dtype)``, which then computes in ``dtype`` (a float32 checkpoint served by a
bfloat16 model rounds differently from the float32 value cast afterwards).

Every other kind needs the model: with ``model_factory`` (a callable, or ``"MODULE:FACTORY"``
resolved by :func:`paramfold.factory.load_factory`) the model is built, loaded and materialised
instead. Output goes through :mod:`paramfold.checkpoint`'s atomic writers (see
:func:`fold_checkpoint` for an example).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from paramfold.audit import LEGACY_SPECTRAL_NORM_API, LEGACY_WEIGHT_NORM_API, CheckpointSite, audit_plan
from paramfold.checkpoint import (
    Checkpoint,
    CheckpointError,
    TensorInfo,
    open_checkpoint,
    write_checkpoint,
    write_state_dict,
)
from paramfold.errors import counted, first_few, one_line, with_article
from paramfold.factory import load_factory
from paramfold.output import OutputError, check_output
from paramfold.signals import from_signal
from paramfold.audit_render import human_bytes

__all__ = ["FoldResult", "fold_checkpoint"]


@dataclass
class FoldResult:
    """What ``fold_checkpoint`` wrote: ``tensors`` keys and ``nbytes`` of data to ``out``."""

    out: Path
    tensors: int
    nbytes: int
    sites: int
    via: str  # "keys" (folded from the checkpoint alone) or "model" (materialised by the model)
    dtype: torch.dtype | None = None  # what ``dtype`` fold_checkpoint was given
    root: str | None = None  # the checkpoint's entry the weights were under
    beside: tuple[str, ...] = ()  # entries beside it of scalar tensors only, taken as metadata: not written

    def summary(self) -> str:
        how = "materialised by the model" if self.via == "model" else "folded from the checkpoint"
        cast = "" if self.dtype is None else f" in {_dtype_name(self.dtype)}"
        read = "" if self.root is None else f"; read from its entry '{self.root}'"
        if self.beside:  # as audit's title says it (a model whose weights are all scalars would be one)
            names = ", ".join(f"'{k}'" for k in self.beside[:4]) + (", ..." if len(self.beside) > 4 else "")
            read += f" ({names}: scalar tensors only, taken as metadata, not written)"
        return (
            f"wrote {self.out}: {counted(self.tensors, 'tensor')}, {human_bytes(self.nbytes)}; "
            f"{counted(self.sites, 'parametrized site')} {how}{cast}{read}"
        )


#: What ``dtype`` may be: the floating-point dtypes a model is cast to (``model.to(dtype)``).
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or dtype in DTYPES.values():
        return dtype  # type: ignore[return-value]
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise CheckpointError(f"dtype {dtype}: use one of {', '.join(DTYPES)} (the dtype of the model the "
                          "checkpoint is loaded into)", exit_code=2)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` as ``load_state_dict`` leaves it in ``model.to(dtype)``: floating point cast, else kept."""
    return t if dtype is None or not t.is_floating_point() else t.to(dtype)


def _refuse_complex(ckpt: Checkpoint, dtype: torch.dtype) -> None:
    """A complex tensor cannot be given a real ``dtype`` as ``model.to(dtype)`` gives it: torch
    keeps the real part (with a warning), which would write a different model, so it is refused."""
    for key in ckpt.keys():
        found = ckpt.info(key).dtype
        if found.is_complex:
            raise CheckpointError(
                f"dtype {_dtype_name(dtype)}: '{key}' is {_dtype_name(found)}, which model.to({_dtype_name(dtype)}) "
                "makes real, dropping its imaginary part: fold without a dtype"
            )


def _cast_info(info: TensorInfo, dtype: torch.dtype | None) -> TensorInfo:
    return info if dtype is None or not info.dtype.is_floating_point else TensorInfo(info.shape, dtype)


def fold_checkpoint(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    model_factory: Callable[[], torch.nn.Module] | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> FoldResult:
    """Write the unparametrized model's checkpoint (``<module>.<tensor>`` keys) to ``out``.

    ``out`` ends in ``.safetensors`` or ``.pt``. Without ``model_factory``, every site must be of a
    kind in ``paramfold.audit.FOLDABLE_KINDS``; they are computed tensor by tensor as torch computes
    them, and every other tensor is copied through, so memory stays around one tensor. With ``model_factory`` (a
    callable returning the parametrized model, or a ``"MODULE:FACTORY"`` string for ``load_factory``)
    the model is built, the checkpoint is loaded into it with ``strict=True``, the model is put in
    eval mode and every parametrized tensor is materialised once. ``dtype`` (``torch.bfloat16`` or
    ``"bfloat16"``; float16, float32, float64) writes the checkpoint of the model in that dtype:
    every floating-point tensor is cast to it before anything is computed, as ``load_state_dict``
    into ``model.to(dtype)`` casts it (with ``model_factory``, the model built is cast so). Without
    it the tensors are computed in their stored dtype, as a model of that dtype computes them. The output is written to a
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
    dtype = _as_dtype(dtype)
    with open_checkpoint(path) as ckpt:
        try:
            check_output(out, inputs=ckpt.files)
        except OutputError as e:
            raise CheckpointError(str(e), exit_code=e.exit_code) from None
        if dtype is not None:
            _refuse_complex(ckpt, dtype)
        if model_factory is not None:
            return _fold_with_model(ckpt, Path(out), model_factory, dtype)
        report, plan = audit_plan(ckpt)
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
            specs[key] = _cast_info(ckpt.info(key) if site is None else site.folded, dtype)  # type: ignore[arg-type]
        nbytes = write_checkpoint(out, specs, _stream(ckpt, plan, dtype), metadata=_metadata(ckpt))
    return FoldResult(Path(out), len(specs), nbytes, len(report.sites), "keys", dtype, ckpt.root, ckpt.beside)


def _stream(ckpt: Checkpoint, plan: list[tuple[str, CheckpointSite | None]],
            dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    # Plain tensors are read into one reused buffer; the writer is done with each before the next.
    largest = max((ckpt.info(k).nbytes for k, site in plan if site is None), default=0)
    scratch = torch.empty(largest, dtype=torch.uint8)
    for key, site in plan:
        yield key, (_cast(ckpt.read(key, out=scratch), dtype) if site is None else _fold_site(ckpt, site, dtype))


def _fold_site(ckpt: Checkpoint, site: CheckpointSite, dtype: torch.dtype | None) -> torch.Tensor:
    stored = {name: ckpt.read(key) for name, key in site.keys.items()}
    try:
        with torch.no_grad():
            return _fold_tensors(site, {name: _cast(x, dtype) for name, x in stored.items()}, stored)
    except CheckpointError:
        raise
    except RuntimeError as e:  # e.g. a hand-edited file: fp16 g with fp32 v, fp64 _u with fp32 W
        if "memory" in str(e).lower():
            raise  # the allocator's "can't allocate memory": not the file's fault
        pieces = ", ".join(f"{n} {_dtype_name(x.dtype)}{list(x.shape)}" for n, x in stored.items())
        floating = {x.dtype for x in stored.values() if x.is_floating_point()}
        if dtype is None and len(floating) > 1:  # a model casts them all to its dtype on load
            what_to_do = ("a model loads them cast to its own dtype and computes in it: pass --dtype "
                          f"{'|'.join(DTYPES)} (the model's dtype), or --model MODULE:FACTORY")
        else:
            what_to_do = "re-save the checkpoint from a working model"
        raise CheckpointError(
            f"cannot fold '{site.key}' ({site.kind}): torch refuses its stored tensors ({pieces}): "
            f"{str(e).strip().splitlines()[0][:200]}; {what_to_do}"
        ) from None


def _fold_tensors(site: CheckpointSite, t: dict[str, torch.Tensor], stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """The folded value from ``t``, the site's tensors in the dtype they are computed in; ``stored``
    holds them as the file does, the best evidence for a spectral_norm dim the shape leaves open."""
    if site.kind == "weight_norm":
        if site.params.get("api") == LEGACY_WEIGHT_NORM_API:
            g, v = t[f"{site.tensor}_g"], t[f"{site.tensor}_v"]
        else:
            g, v = t["original0"], t["original1"]
        if g.numel() == 0:
            # torch._weight_norm's fused kernels divide by zero there (SIGFPE: the process dies);
            # stock's weight_norm cannot be put on such a layer (its right_inverse raises).
            raise CheckpointError(
                f"cannot fold '{site.key}' (weight_norm): its g {list(g.shape)} is empty (v {list(v.shape)}), a "
                "norm over no rows that torch cannot compute; re-save the checkpoint from a working model"
            )
        # parametrizations._WeightNorm.forward (and the legacy hook's compute_weight) call exactly this.
        dim = site.params["dim"]
        if dim is None:
            dim = _resolve_weight_norm_dim(site.key, v, g, site.params["dim_candidates"])
        return torch._weight_norm(v, g, dim)
    if site.kind == "fake_sparsity":
        # torchao.prototype.sparsity.sparsifier.utils.FakeSparsity.forward
        return t["0.mask"] * t["original"]
    if site.kind == "spectral_norm":
        legacy = site.params.get("api") == LEGACY_SPECTRAL_NORM_API
        names = (f"{site.tensor}_orig", f"{site.tensor}_u", f"{site.tensor}_v") if legacy else ("original", "0._u", "0._v")
        w, u, v = (t[n] for n in names)

        def value(dim: int) -> torch.Tensor:
            if legacy:
                # torch.nn.utils.spectral_norm's SpectralNorm.compute_weight(do_power_iteration=False)
                sigma = torch.dot(u, torch.mv(_spectral_weight_mat(w, dim), v))
                return w / sigma
            return _spectral_norm_eval(w, u, v, dim)

        dim = site.params["dim"]
        if dim is None:
            dim = _resolve_spectral_dim(site.key, *(stored[n] for n in names), site.params["dim_candidates"], value, legacy)
        return value(dim)
    raise AssertionError(f"unfoldable kind {site.kind}")


def _resolve_weight_norm_dim(key: str, v: torch.Tensor, g: torch.Tensor, candidates: list[int]) -> int:
    """The norm dim of a weight_norm site whose shapes fit several dims.

    They are the size-1 dims of ``v`` (``g`` then has only size-1 dims): mathematically the same
    value, but ``torch._weight_norm`` computes dim 0 and the last dim with fused kernels and the
    others with the generic one, which round differently, and the checkpoint does not record the
    model's dim.
    Where every candidate gives the same bits it does not matter; otherwise refused.
    """
    if _one_value(candidates, lambda d: torch._weight_norm(v, g, d)):
        return candidates[0]
    raise CheckpointError(
        f"cannot fold '{key}' (weight_norm) from the checkpoint alone: its shapes fit norm dim "
        f"{' or '.join(map(str, candidates))} (size-1 dims), which torch computes with different kernels "
        "that round differently here, and the checkpoint does not record which the model used; "
        "pass --model MODULE:FACTORY that builds the parametrized model"
    )


def _one_value(candidates: list[int], value: Callable[[int], torch.Tensor]) -> bool:
    """Whether ``value(d)`` is bitwise the same for every candidate dim (then which one the model
    used does not matter)."""
    values = [value(d) for d in candidates]
    return all(torch.equal(values[0], other) for other in values[1:])


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


#: An ambiguous spectral_norm dim is taken from the stored vectors only on strong evidence. The
#: power method ends with ``v = normalize(W_mat^H u)`` (torch.nn.utils.parametrizations) or
#: ``u = normalize(W_mat v)`` (the legacy hook, which updates ``v`` first); a vector unrelated to
#: the product has a cosine of at least ``a`` with it with a chance below ``(1 - a^2)^((n - 1) / 2)``
#: in ``n`` dimensions. The dim taken must agree with a chance under ``_SURE``; every other, over
#: ``_UNRELATED``. Rounding to the stored dtype (unit roundoff ``r``) leaves even the last step's
#: vector off by up to about ``1 - a^2 = n (_ROUNDING r)^2``: where the closest dim is that close
#: and still not sure, the precision is what cannot tell (bfloat16 in few dimensions).
#: The other dims' products are not unrelated vectors, though: they permute the same weight, and
#: from the same ``u`` they often agree with ``v`` far beyond chance too (a ConvTranspose2d(64, 3, 3)'s
#: weight fits dims 1, 2 and 3). So a dim is also taken where it is sure and every other is at
#: least ``_APART`` times further off (``1 - a^2``, against the larger of its own and rounding's):
#: a vector the last step wrote for another dim would fit that one to its rounding instead.
_SURE, _UNRELATED, _ROUNDING, _APART = 1e-9, 1e-3, 4, 1e3


def _resolve_spectral_dim(key: str, w: torch.Tensor, u: torch.Tensor, v: torch.Tensor, candidates: list[int],
                          value: Callable[[int], torch.Tensor], legacy: bool = False) -> int:
    """The matrix dim of a spectral_norm weight whose shape fits several (``candidates``).

    The stored vectors decide where they are the last power step's for this weight (saved after a
    training-mode forward, or an optimizer step or so later), and where every candidate gives the
    same value it does not matter; otherwise (weights re-initialised or loaded after the last
    power step, or vectors too short for their dtype's rounding to leave strong evidence) they
    cannot tell, and a guess could fold a wrong weight: refused, saying which.
    """
    last, given = (u, v) if legacy else (v, u)  # the vector the last step wrote, from the other
    n = last.numel()

    def off(d: int) -> float:
        """``1 - a^2`` for the cosine ``a`` of ``last`` with the product for dim ``d`` (1 where
        ``a`` is not a number). Its sign does not count: a weight negated since the last power
        step (a large optimizer step) still has its own dim's product along the stored vector."""
        mat = _spectral_weight_mat(w.double(), d)
        x = torch.mv(mat if legacy else mat.H, given.double())
        norms = float(x.norm() * last.double().norm())
        a = float(torch.dot(x, last.double())) / norms if norms > 0 else 0.0
        return 1.0 if a != a else max(0.0, 1.0 - a * a)

    offs = {d: off(d) for d in candidates}
    chances = {d: o ** ((n - 1) / 2) for d, o in offs.items()}
    sure = [d for d, c in chances.items() if c <= _SURE]
    closest = min(offs, key=offs.__getitem__)
    if sure == [closest] and all(c >= _UNRELATED for d, c in chances.items() if d != closest):
        return closest
    coarsest = max((w, u, v), key=lambda t: torch.finfo(t.dtype).eps).dtype
    rounding = n * (_ROUNDING * torch.finfo(coarsest).eps / 2) ** 2
    floor = max(offs[closest], rounding)
    if closest in sure and all(o >= _APART * floor for d, o in offs.items() if d != closest):
        return closest
    if _one_value(candidates, value):
        return candidates[0]
    if sure:
        why = f"they fit dim {' and '.join(str(d) for d, c in chances.items() if c < _UNRELATED)} alike"
    elif offs[closest] <= rounding:
        why = (f"at this precision: they agree with dim {closest} up to {_dtype_name(coarsest)} rounding, "
               f"which in {n} dimensions is too weak to rule out chance")
    else:
        why = ("they are not the last power step's for this weight: it changed after the last training-mode "
               "forward, or none ran since the model was built (they are then torch's random start)")
    raise CheckpointError(
        f"cannot fold '{key}' (spectral_norm) from the checkpoint alone: its weight of shape {tuple(w.shape)} "
        f"fits matrix dim {' or '.join(map(str, candidates))}, and its stored _u/_v do not tell which ({why}); "
        "pass --model MODULE:FACTORY that builds the parametrized model"
    )


@contextlib.contextmanager
def _keeping_cwd() -> Iterator[None]:
    cwd = os.getcwd()
    try:
        yield
    finally:
        if os.getcwd() != cwd:
            os.chdir(cwd)


def _fold_with_model(ckpt: Checkpoint, out: Path, model_factory: Callable[[], torch.nn.Module] | str,
                     dtype: torch.dtype | None) -> FoldResult:
    name = model_factory if isinstance(model_factory, str) else getattr(model_factory, "__qualname__", "model_factory")
    # Model code that changes the working directory (to read its configs) leaves paramfold's own
    # relative paths (OUT, checked before any work) meaning what the caller meant.
    with _keeping_cwd():
        factory = load_factory(model_factory) if isinstance(model_factory, str) else model_factory
        try:
            model = factory()
        except (Exception, KeyboardInterrupt) as e:
            if isinstance(e, KeyboardInterrupt) and from_signal(e):
                raise  # a Ctrl-C or another signal while it ran, not the factory's failure
            raise CheckpointError(f"--model {name}: the factory raised {type(e).__name__}"
                                  + (f": {one_line(str(e))}" if str(e).strip() else "")) from None
        except SystemExit as e:
            raise CheckpointError(f"--model {name}: the factory called sys.exit({e.code!r}) instead of returning a model") from None
    if not isinstance(model, torch.nn.Module):
        raise CheckpointError(f"--model {name}: the factory returned {with_article(type(model).__name__)}, not a torch.nn.Module")
    if dtype is not None:
        model.to(dtype)
    state = {k: ckpt.read(k) for k in ckpt.keys()}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        msg = one_line(str(e))
        raise CheckpointError(
            f"the checkpoint does not fit the model from --model {name} (strict load): {msg[:400]}"
        ) from None
    del state
    model.eval()
    plain, computed = _plain_state_dict(model)
    nbytes = write_state_dict(out, plain, metadata=_metadata(ckpt))
    # The tensors computed, as the keys-only fold counts its sites: torch's hook-based norms too.
    return FoldResult(out, len(plain), nbytes, len(computed), "model", dtype, ckpt.root, ckpt.beside)


def _metadata(ckpt: Checkpoint) -> dict[str, str]:
    """The output's safetensors metadata: a single safetensors input's own (its header's
    ``__metadata__``: transformers' ``format``, a training run's notes), with ``format`` ``pt``
    where it has none. A sharded checkpoint's index metadata (``total_size``) describes the
    shards, not the folded file, and is not carried over."""
    single = ckpt.format == "safetensors"  # one file (an index's shards are "sharded-safetensors")
    return {"format": "pt", **(ckpt.metadata if single else {})}


def _plain_state_dict(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The state dict the unparametrized model would have (paramfold's freeze materialisation),
    and its keys that were computed (the sites).

    Call it in eval mode: in training a stateful parametrization (spectral_norm) gives its value
    after one more power iteration (its state is put back either way).
    """
    from paramfold.state_dict import materialised

    return materialised(model)
