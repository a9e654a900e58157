"""Whether a prepared chain draws random numbers now, decided again when its settings change.

:func:`~paramfold.sites.find` probes each chain once, at ``prepare``: a chain that draws is
computed where it is read (auto, inline) or refused (hoist, freeze). A chain can start drawing
later, when a dropout probability or a noise scale is set above 0: computed once per call before
the forward (hoist, auto in a grad call) it would draw before the forward's own random ops, and
frozen it would repeat one sample. What switches a chain on is one of its settings (its members'
attributes, submodules, hooks and classes: :func:`~paramfold.freeze.settings`), so each site
keeps a :class:`SettingsWatch` of them; when one changes, the chain is probed again, as ``find``
probes it, and ``SiteState.draws`` says how it is served from then on. A chain switched on to
write its attributes or originals, or to change its buffers where ``prepare`` found it did not (no
read-once class or freeze refusal was planned for it), is served the same way: stock changes
them at every read.
"""

from __future__ import annotations

from torch import nn

from paramfold.freeze import settings
from paramfold.sites import CannotProbeNow, draws_random_numbers, probed
from paramfold.state import SiteState
from paramfold.watch import tag

#: A member's attribute that switches nothing on: ``find``'s probe runs each member in training
#: and in eval mode.
_PROBED_BOTH_WAYS = "training"


class SettingsWatch:
    """The settings of one chain when it was last probed: the empty dicts, the others with their
    version tags and a shallow copy each (a tag changes at every write, ``train()`` included)."""

    __slots__ = ("empty", "full", "tags", "copies")

    def __init__(self, site: SiteState) -> None:
        live = settings(site)
        self.empty = tuple(d for d in live if not d)
        self.full = tuple(d for d in live if d)
        self.tags = list(map(tag, self.full))
        self.copies = tuple(map(dict, self.full))

    def unchanged(self) -> bool:
        """Whether every setting is as it was probed; a write that put back what was there, or
        only changed a ``training`` flag, counts as unchanged (and is remembered as seen)."""
        if any(self.empty):
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
    empty = full = ()
    tags: list = []

    def unchanged(self) -> bool:
        return False

    def __deepcopy__(self, memo: dict) -> _ProbeAgain:
        return self


PROBE_AGAIN = _ProbeAgain()


def watch(site: SiteState) -> SettingsWatch | None:
    """A watch of ``site``'s settings, or None where its chain cannot start drawing: a hook-based
    norm, or a chain of torch's and torchao's known parametrizations only (nested ones included)."""
    if site.hook is not None or not any(map(probed, site.plist.modules())):
        return None
    return SettingsWatch(site)


def recheck(holder: nn.Module, name: str, site: SiteState) -> bool | None:
    """Whether ``holder.<name>`` draws random numbers (or changes its state as prepare did not
    plan for: :func:`~paramfold.sites.draws_random_numbers`) now, probed again where its settings
    changed since the last probe (``site.draws`` and ``site.draw_watch`` updated); None where it
    cannot be probed now (:class:`~paramfold.sites.CannotProbeNow`: nothing is updated, so a
    later call probes it)."""
    if site.draw_watch is not None and not site.draw_watch.unchanged():
        try:
            draws = draws_random_numbers(holder, name, site.stateful, site.stateful_in_eval)
        except CannotProbeNow:
            return None
        site.draws = draws
        site.draw_watch = SettingsWatch(site)
    return site.draws

