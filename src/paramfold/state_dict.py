"""``plain_state_dict``: the state dict the same model would have without parametrizations."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from paramfold import hooknorms
from paramfold.compute import compute, has_parametrizations
from paramfold.errors import FoldError
from paramfold.sites import parametrization_paths
from paramfold.state import STATE_ATTR, is_dtensor, version_of
from paramfold.unread import copy_back


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return ``model``'s state dict with every parametrized tensor materialised.

    Keys are those of the unparametrized model (``<module>.<tensor>`` instead of
    ``<module>.parametrizations.<tensor>.original``, parametrization buffers dropped; for torch's
    deprecated hook-based norms, instead of ``<tensor>_g``/``<tensor>_v`` or ``<tensor>_orig``
    and its ``_u``/``_v``), values are computed under ``no_grad`` exactly as stock PyTorch
    computes them (stateful chains are evaluated in their current mode: a training spectral_norm
    gives the value a read now would, after one power iteration, so put the model in ``eval()``
    first for the value without one). The model is left as it was, like ``model.state_dict()``:
    the buffers a chain updates while computing (spectral_norm's ``_u``/``_v``) are put back.
    The result loads with ``strict=True`` into the model class without parametrizations, except
    where a parametrized buffer was non-persistent there: torch's ``register_parametrization``
    makes its original persistent, and its key is listed (README, "Notes and limits").

    Example::

        >>> import torch, paramfold
        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> sd = paramfold.plain_state_dict(weight_norm(torch.nn.Linear(4, 3)))
        >>> sorted(sd)
        ['bias', 'weight']
    """
    return materialised(model)[0]


def materialised(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``plain_state_dict(model)`` and the keys of it that were computed: one per parametrized
    tensor and per hook-based norm (listed under every path a shared module has, as its keys are)."""
    # Every path, not find()'s deduplicated ones: state_dict() lists a module shared between two
    # places under both.
    by_prefix: dict[str, list[tuple[str, nn.Module, str]]] = {}
    # A hook-based norm's stored keys -> (the plain key, module, hook, kind).
    by_hook_key: dict[str, tuple[str, nn.Module, object, str]] = {}
    inside = parametrization_paths(model)
    for path, module in model.named_modules(remove_duplicate=False):
        if path in inside:
            continue
        at = f"{path}." if path else ""
        # A call open now (plain_state_dict from a hook) has taken the norms' hooks off for it.
        hs = module.__dict__.get(STATE_ATTR)
        for _, hook, kind in hooknorms.hook_norms(module, hs.hooks_out[0] if hs is not None and hs.hooks_out else ()):
            stored = hooknorms.originals(module, hook, kind) + hooknorms.state_tensors(module, hook, kind)
            by_hook_key.update((at + n, (at + hook.name, module, hook, kind)) for n, _, _ in stored)
        if not has_parametrizations(module):
            continue
        prefix = f"{path}.parametrizations." if path else "parametrizations."
        for name in module._modules["parametrizations"]:
            by_prefix.setdefault(prefix, []).append((f"{path}.{name}" if path else name, module, name))
    plain: dict[str, torch.Tensor] = {}
    computed: list[str] = []
    # First, as a state_dict() taken inside a call gives the chains the call has not read yet
    # their state from before it (scope_midcall.state_read): that is the state to leave them in.
    entries = model.state_dict()
    # What a chain may update while computing, and where it is held: its buffers, a hook-based
    # norm's _u/_v.
    held = [(m._buffers, k, t) for plist in _parametrization_lists(by_prefix) for m in plist.modules()
            for k, t in m._buffers.items() if t is not None]
    held += [(d, k, d[k]) for _, module, hook, kind in by_hook_key.values()
             for _, d, k in hooknorms.state_tensors(module, hook, kind)]
    state = {id(t): t for _, _, t in held}
    before = [(t, version_of(t), t.clone()) for t in state.values()]
    with torch.no_grad():
        try:
            _compute_into(entries, plain, computed, by_prefix, by_hook_key)
        finally:
            for t, version, then in before:
                if version_of(t) != version:
                    copy_back(t, then, version)
            # An assignment of the computation may have stored another tensor there (a buffer
            # registration hook's copy at spectral_norm's `self._u = ...`): the buffer itself again.
            for d, k, t in held:
                if d.get(k) is not t:
                    d[k] = t
    return plain, computed


def _parametrization_lists(by_prefix: dict[str, list[tuple[str, nn.Module, str]]]) -> Iterator[nn.Module]:
    for sites in by_prefix.values():
        for _, module, name in sites:
            yield module._modules["parametrizations"][name]


def _compute_into(entries: dict, plain: dict, computed: list, by_prefix: dict, by_hook_key: dict) -> None:
    """Fill ``plain`` with the model's state dict ``entries``, each parametrized tensor computed
    (see :func:`materialised`)."""
    for key, value in entries.items():
        if key in by_hook_key:
            fqn, module, hook, kind = by_hook_key[key]
            if fqn not in plain:
                tensors = [d[k] for _, d, k in hooknorms.originals(module, hook, kind)]
                plain[fqn] = _computed(fqn, tensors, lambda: hooknorms.compute(module, hook, kind)).detach()
                computed.append(fqn)
            continue
        prefix = _parametrizations_prefix(key)
        if prefix not in by_prefix:
            plain[key] = value
            continue
        for fqn, module, name in by_prefix[prefix]:
            if fqn not in plain:
                plist = module._modules["parametrizations"][name]
                tensors = [*plist.parameters(), *plist.buffers()]
                value = _computed(fqn, tensors, lambda: compute(module, name))
                # Under no_grad only an identity chain hands back the original itself.
                plain[fqn] = value.detach() if value.requires_grad else value
                computed.append(fqn)


def _computed(fqn: str, originals: list[torch.Tensor], compute_value) -> torch.Tensor:
    """``compute_value()``; where it fails on a sharded tensor, a FoldError that says what to do.

    A chain computes on DTensor originals where its ops take them (weight_norm's), and fails where
    it mixes them with plain tensors (spectral_norm's power iteration on its ``_u``), as stock's
    read of the tensor does."""
    try:
        return compute_value()
    except Exception as exc:
        if not any(map(is_dtensor, originals)):
            raise
        raise FoldError(
            f"cannot compute {fqn} for the plain state dict: its originals are DTensors (a sharded "
            f"model) and its parametrization mixes them with plain tensors ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:120]}). Call plain_state_dict before sharding the model, or on "
            "an unsharded copy loaded from torch.distributed.checkpoint.state_dict.get_model_state_dict("
            "model, options=StateDictOptions(full_state_dict=True))."
        ) from exc


def _parametrizations_prefix(key: str) -> str | None:
    """``"a.b.parametrizations."`` for ``"a.b.parametrizations.weight.original"``, else None."""
    marker = "parametrizations."
    at = 0 if key.startswith(marker) else key.find("." + marker) + 1
    return key[: at + len(marker)] if key.startswith(marker) or at > 0 else None
