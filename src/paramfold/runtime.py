"""What paramfold keeps on a prepared module, in its instance ``__dict__`` under ``STATE_ATTR``."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

STATE_ATTR = "_paramfold"


@dataclasses.dataclass(eq=False)
class FrozenValue:
    fingerprint: tuple[tuple[int, int, int], ...]
    value: torch.Tensor


@dataclasses.dataclass(eq=False)
class SiteState:
    """One prepared tensor: how it is served, and where its inputs live (looked up once)."""

    mode: str
    stateful: bool
    plist: nn.Module
    chain: tuple[nn.Module, ...]
    #: (dict, key) of each original, so reads see assign=True replacements.
    originals: tuple[tuple[dict, str], ...]
    #: Every ``_parameters``/``_buffers`` dict of the ParametrizationList and its members.
    tensor_dicts: tuple[dict, ...]
    #: The ``_parameters`` dicts among them: originals *and* parameters the parametrizations own
    #: (LoRA's A and B), all of which must be frozen before the value may be.
    param_dicts: tuple[dict, ...]
    frozen: FrozenValue | None = None
    #: Inline sites: (instance attribute, dict, key) of each original a generated getter reads.
    original_refs: tuple[tuple[str, dict, str], ...] = ()
    #: Whether values are tensor subclasses (known after the first computation). AOTAutograd does
    #: not carry gradients from a subclass graph input back to the originals it was built from,
    #: so such values are computed in-graph (the descriptor's stock path) whenever they need grad.
    subclass: bool | None = None


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (without importing it)."""
    return _is_dtensor_type(type(tensor))


@functools.cache
def _is_dtensor_type(cls: type) -> bool:
    return any(c.__name__ == "DTensor" and c.__module__.startswith("torch.distributed") for c in cls.__mro__)


def distributed(site: SiteState) -> bool:
    """Whether an original of ``site`` is a DTensor *now*: sharded by FSDP2 between calls (its
    pre-forward hook swaps in the gathered tensor only for the layer's own forward), or by a
    communication parametrization. Such values are computed where they are read, never earlier."""
    for d, key in site.originals:  # called for every site at every call scope: a plain loop
        cls = type(d[key])
        if cls not in _PLAIN and _is_dtensor_type(cls):
            return True
    return False


_PLAIN = frozenset({torch.Tensor, nn.Parameter})


def original_names(plist: nn.Module) -> list[str]:
    """``["original"]``, or ``["original0", ...]`` when ``right_inverse`` returned several tensors."""
    return ["original"] if plist.is_tensor else [f"original{i}" for i in range(plist.ntensors)]


def site_state(module: nn.Module, name: str, mode: str, stateful: bool) -> SiteState:
    plist = module._modules["parametrizations"]._modules[name]
    names = original_names(plist)
    originals = tuple((plist._parameters if n in plist._parameters else plist._buffers, n) for n in names)
    dicts = tuple(d for m in plist.modules() for d in (m._parameters, m._buffers) if d)
    params = tuple(m._parameters for m in plist.modules() if m._parameters)
    return SiteState(mode, stateful, plist, tuple(plist._modules.values()), originals, dicts, params)


@dataclasses.dataclass(eq=False)
class ModuleState:
    original_class: type
    #: This module's own prepared tensors, by name.
    sites: dict[str, SiteState] = dataclasses.field(default_factory=dict)
    #: Whether plain parameters of this module are detached under no_grad.
    detach_params: bool = False
    #: Instance ``__dict__`` keys holding inline getters' inputs (see ``inline.install_refs``).
    ref_keys: list[str] = dataclasses.field(default_factory=list)
    #: The load_state_dict post-hook that re-syncs them, removed by restore.
    load_hook: Any = None
    #: For entries: the modules with sites or detached parameters at or below this one.
    holders: list[nn.Module] = dataclasses.field(default_factory=list)
    #: For entries: every entry at or below this one (stamped when a scope opens here).
    entries: list[nn.Module] = dataclasses.field(default_factory=list)
    stamp: int = 0


def state_of(module: nn.Module) -> ModuleState | None:
    return module.__dict__.get(STATE_ATTR)
