"""Whether a prepared chain draws random numbers now, decided again when its settings change.

:func:`~paramfold.sites.find` probes each chain once, at ``prepare``: a chain that draws is
computed where it is read (auto, inline) or refused (hoist, freeze). A chain can start drawing
later, when a dropout probability or a noise scale is set above 0: computed once per call before
the forward (hoist, auto in a grad call) it would draw before the forward's own random ops, and
frozen it would repeat one sample. What switches a chain on is one of its settings (its members'
attributes, submodules, hooks and classes: :func:`~paramfold.freeze.settings`) or a tensor it
holds (a flag buffer: torch.ao's ``enable_observer`` fills ``observer_enabled`` with 1), so each
site keeps a :class:`SettingsWatch` of them (of a chain of torch's own members, only its hooks:
:func:`watch`); when one changes, the chain is probed again, as
``find`` probes it, and ``SiteState.draws`` says how it is served from then on. A chain switched
on to write its attributes or originals, or to change its buffers where ``prepare`` found it did
not (no read-once class or freeze refusal was planned for it), is served the same way: stock
changes them at every read.

A chain switched on by what no watch sees (a condition on its originals, a write that bumped no
version counter) is seen where its value is computed: a value to freeze is computed under
``freeze``'s dispatch mode, which stops it before its first write to a tensor of the chain (the
model left as it was: freeze refuses the call, auto computes it where it is read from then on);
a value computed for one call (hoist, auto) moves a watched tensor's version counter, and the
next call probes the chain again. That call's value is stock's first read's (the update ran
once, as stock's read runs it); a second read in that call is served the same value.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from paramfold.compute import GLOBAL_HOOKS, dispatch_modes
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.freeze import own_tensors, settings
from paramfold.probe import CannotProbeNow
from paramfold.sites import draws_random_numbers, probed, runs_hooks
from paramfold.state import SiteState, tensor_version, version_of
from paramfold.watch import tag

#: A member's attribute that switches nothing on: ``find``'s probe runs each member in training
#: and in eval mode.
_PROBED_BOTH_WAYS = "training"


class SettingsWatch:
    """The settings of one chain when it was last probed: the empty dicts, the others with their
    version tags and a shallow copy each (a tag changes at every write, ``train()`` included),
    and the version counters of the tensors that may switch it on (:func:`switches`)."""

    __slots__ = ("empty", "full", "tags", "copies", "tensors", "versions")

    def __init__(self, site: SiteState, live: tuple[dict, ...] | None = None, draws: bool | None = None) -> None:
        live = settings(site) if live is None else live
        self.empty = tuple(d for d in live if not d)
        self.full = tuple(d for d in live if d)
        self.tags = list(map(tag, self.full))
        self.copies = tuple(map(dict, self.full))
        self.tensors = switches(site, draws)
        self.versions = list(map(tensor_version, self.tensors))

    def unchanged(self) -> bool:
        """Whether every setting is as it was probed; a write that put back what was there, or
        only changed a ``training`` flag, counts as unchanged (and is remembered as seen)."""
        if any(self.empty):
            return False
        if self.tensors and list(map(tensor_version, self.tensors)) != self.versions:
            return False
        try:
            tags = list(map(tag, self.full))
        except Exception:  # a copy's entry replaced by a tensor, where torch reads no tags
            return False
        if tags == self.tags:
            return True
        for d, then in zip(self.full, self.copies):
            if d.keys() != then.keys() or any(d[k] is not v for k, v in then.items() if k != _PROBED_BOTH_WAYS):
                return False
        self.tags = tags
        return True

    def __deepcopy__(self, memo: dict) -> _ProbeAgain:
        # A copied model's chain has dicts of its own, which copies of these would not follow
        # (a member is copied through its __getstate__, a new dict): its first call probes again.
        return PROBE_AGAIN


class _ProbeAgain:
    """The watch of a copied site: nothing seen yet, so the chain is probed at its next check."""

    __slots__ = ()
    empty = full = tensors = ()
    tags: list = []
    versions: list = []

    def unchanged(self) -> bool:
        return False

    def __deepcopy__(self, memo: dict) -> _ProbeAgain:
        return self


PROBE_AGAIN = _ProbeAgain()


def switches(site: SiteState, draws: bool | None = None) -> tuple:
    """The tensors ``site``'s chain holds (:func:`~paramfold.freeze.own_tensors`) whose writes may
    switch it on, with a version counter: none where it changes them itself at its computations
    (``stateful``, or ``draws``, ``site.draws`` unless given: computed at every read since), nor
    one that requires grad (a trained parameter, which an optimizer step writes: no switch)."""
    if site.stateful or (site.draws if draws is None else draws):
        return ()
    return tuple(t for t in own_tensors(site) if not t.requires_grad and version_of(t) is not None)


def watch(site: SiteState, draws: bool | None = None) -> SettingsWatch | None:
    """A watch of ``site``'s settings, or None where its chain cannot start drawing: a hook-based
    norm. A chain of torch's and torchao's known parametrizations only (nested ones included)
    starts drawing or writing only by a forward hook or pre-hook registered on its modules (probed
    then, as a custom member is): a watch of their hook dicts alone, and of the global ones (a
    frozen value refused for a global hook's draw is served again once it is removed), until one
    of them has a hook."""
    if site.hook is not None:
        return None
    modules = tuple(site.plist.modules())
    if any(map(probed, modules)) or any(map(runs_hooks, filter(_is_list, modules))):
        return SettingsWatch(site, draws=draws)
    hooks = tuple(d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks))
    return SettingsWatch(site, (*hooks, *GLOBAL_HOOKS[:2]), draws)


def _is_list(module: nn.Module) -> bool:
    return isinstance(module, parametrize.ParametrizationList)


_MODE_KEYS = getattr(torch._C, "_TorchDispatchModeKey", None)
#: The modes torch keeps apart from the dispatch mode stack (fake, proxy, functional).
_INFRA_MODES = tuple(_MODE_KEYS.__members__.values()) if _MODE_KEYS is not None else ()


def _tracing() -> bool:
    """Whether a dispatch mode runs now (``make_fx``'s proxy and fake modes, ``torch.export``'s
    functionalization, a user's mode): a probe would run on its tensors (fakes swapped in by
    ``functional_call``), record its ops in the trace and read its copies' writes as the chain's
    own. The chain is not probed then: computed where it is read, as stock computes it."""
    return bool(dispatch_modes()) or any(torch._C._get_dispatch_mode(key) is not None for key in _INFRA_MODES)


def recheck(holder: nn.Module, name: str, site: SiteState) -> bool | None:
    """Whether ``holder.<name>`` draws random numbers (or changes its state as prepare did not
    plan for: :func:`~paramfold.sites.draws_random_numbers`) now, probed again where its settings
    changed since the last probe (``site.draws`` and ``site.draw_watch`` updated); None where it
    cannot be probed now (:class:`~paramfold.probe.CannotProbeNow`: nothing is updated, so a
    later call probes it)."""
    if site.draw_watch is not None and not site.draw_watch.unchanged():
        if _tracing():
            return None
        # Watched as it is before the probe: a setting or switch written while the probe runs
        # (another thread) is a change at the next call, which probes again. (A chain found
        # drawing is computed at every read, as stock's: its watch only sees it switched off.)
        before = watch(site, draws=False)
        try:
            draws = draws_random_numbers(holder, name, site.stateful, site.stateful_in_eval)
        except CannotProbeNow:
            return None
        site.draws = draws
        site.draw_watch = watch(site) if draws else before
    return site.draws


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
