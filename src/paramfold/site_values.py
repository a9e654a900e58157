"""Which value each site gets for a call: frozen, hoisted, or none (computed where it is read).

A call scope (:mod:`paramfold.scope`) asks this module for every site below the entry. The choice
follows the site's mode and what holds right now: FSDP2-managed and random-drawing chains,
values compiled code cannot take as graph inputs (:func:`_at_read`), and every value not frozen
while a global module forward hook is registered, are computed at each read like stock, inside
``parametrize.cached()`` the block's cached value is stock's, a freeze or auto site is frozen
while it can be (:func:`freezable`), and a site whose frozen values keep going stale is hoisted
for a while instead (:func:`_demote`). Under inductor's ``freezing`` a hoist site is served as an
auto one in ``no_grad`` calls (:func:`freezing_now`).
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from paramfold import hooknorms, randomness
from paramfold.compute import GLOBAL_HOOKS, eager_value
from paramfold.errors import FoldError, first_few
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.freeze import can_freeze, chain_needs_grad, frozen_value, random_now, unwatched
from paramfold.held import ADVICE
from paramfold.state import CALLS, PLAIN_TENSOR_TYPES, SiteState, distributed, tensor_label
from paramfold.write_marks import release

_tracing_state = torch._C._get_tracing_state
_GLOBAL_FORWARD_HOOKS = GLOBAL_HOOKS[:2]


def for_call(holder: nn.Module, name: str, site: SiteState, grad: bool, under: tuple) -> torch.Tensor | None:
    if distributed(site):
        # Computed where it is read (the descriptor, in-graph), after FSDP2's pre-forward hook
        # has gathered the originals, exactly like stock: never gathered early, never frozen.
        _drop_frozen(site)
        return None
    if _at_read(site, grad):
        _drop_frozen(site)
        return None
    if site.mode != "freeze" and site.hook is None and (_GLOBAL_FORWARD_HOOKS[0] or _GLOBAL_FORWARD_HOOKS[1]):
        # A global forward hook or pre-hook runs at every call of the chain's modules, so at
        # every read in stock, in the forward's order: computed where it is read, as stock does.
        _drop_frozen(site)
        return None
    draws = randomness.recheck(holder, name, site)
    if draws or draws is None:
        # Drawing random numbers now: stock draws at each read, in the forward's order. (None:
        # not known in this call, inside a torch.func transform: computed at each read too.)
        if draws and site.mode == "freeze":
            raise random_now(holder, name)
        _drop_frozen(site)
        return None
    if site.mode == "hoist" and (grad or not freezing_now()):
        # Frozen while inductor's freezing was on: dropped once it is off; kept through a grad
        # call while it is on, for the next no_grad call (_uncached).
        if site.frozen is not None and not (grad and freezing_now()):
            _drop_frozen(site)
        return _hoisted(holder, name, site, grad)
    if parametrize._cache_enabled:
        if site.hook is not None:
            # torch's hook-based norms ignore parametrize.cached(): their hook computes the value
            # at every call of the module, in the block too (spectral_norm's power iteration runs).
            site.from_cache = False
            return _uncached(holder, name, site, grad, under)
        # Inside parametrize.cached(): stock's first read in the block computes the value and
        # every later one (calls and reads between them) gets that one, whatever changed since.
        key = (id(holder), name)
        cached = parametrize._cache.get(key)
        site.from_cache = cached is not None
        if cached is not None:
            return _typed(site, cached, grad)
        cached = _uncached(holder, name, site, grad, under)
        if cached is not None:
            parametrize._cache[key] = cached
        return cached
    return _uncached(holder, name, site, grad, under)


def _uncached(holder: nn.Module, name: str, site: SiteState, grad: bool, under: tuple) -> torch.Tensor | None:
    # freeze's sites are freezable here (_open_holders refused the call otherwise); auto's are
    # frozen where they can be for this call, hoisted otherwise.
    if freezable(site, grad):
        if site.hoist_until > CALLS[0]:
            if torch.is_inference_mode_enabled():
                # As its frozen values are computed, outside inference_mode: the forward reads one
                # kind of tensor throughout (compiled code would recompile on the change).
                with torch.inference_mode(False), torch.no_grad():
                    return _hoisted(holder, name, site, grad)
            return _hoisted(holder, name, site, grad)
        value = _typed(site, frozen_value(holder, name, site, under), grad)
        if site.misses >= (1 if site.demotions else _MISSES):
            _demote(site)
        return value
    if site.frozen is not None and not freezing_now():
        # Not for this call (auto with grad on a trainable chain): dropped, and counted as a
        # frozen value that served no later call, as one whose inputs changed is. Under
        # inductor's freezing it is kept for the next no_grad call, whose compiled code is keyed
        # on its identity (a new one would recompile it at every switch of grad mode): that call
        # checks it as any other.
        _drop_frozen(site)
        site.misses += 1
    return _hoisted(holder, name, site, grad)


#: Frozen values in a row that served no later call (their inputs changed, or a grad call of
#: auto's dropped them) before the site is computed at every call instead (``_demote``; one, once
#: it was), and for how many calls: the first time, then four times as many each time, up to the
#: most.
_MISSES, _FIRST_PERIOD, _LONGEST_PERIOD = 2, 8, 1024


def freezing_now() -> bool:
    """Whether inductor's ``freezing`` is on. Code dynamo compiles under ``no_grad`` then takes
    each module's tensor attributes as constants, keyed on their identity (inductor folds them
    in): a value computed afresh at every call, as hoist's, would make every call recompile, up to
    dynamo's recompile limit and then run eagerly. So in ``no_grad`` calls a hoist site is served
    as an auto one: frozen where it can be, the same tensor while its inputs stay the same, a new
    one once they change (a recompile, where the plain model's code keeps the old weights folded
    in)."""
    config = sys.modules.get("torch._inductor.config")
    if config is None:  # not imported yet: only its environment variable can have set it
        return os.environ.get("TORCHINDUCTOR_FREEZING") == "1"
    return bool(config.freezing)


def _drop_frozen(site: SiteState) -> None:
    """Drop the site's frozen value, with the write marks it left (:func:`~paramfold.write_marks.release`)."""
    release(site.frozen)
    site.frozen = None


def _demote(site: SiteState) -> None:
    """Compute a freeze or auto site at every call, as hoist does, for a while (under the call's
    grad mode, in which the site is freezable: no autograd history either way). Its inputs
    changed at the last calls (weights updated between calls: an EMA or target model, a policy
    sampled after each optimizer step), so freezing it would recompute its value and fingerprint
    its inputs, bytes included, at every call, for nothing. Then freezing is tried again; a
    period that ends with the inputs still changing at the next call starts a four times longer
    one. Exact either way: a value computed at every call is stock's."""
    _drop_frozen(site)
    site.misses = 0
    site.hoist_until = CALLS[0] + min(_FIRST_PERIOD << 2 * site.demotions, _LONGEST_PERIOD)
    site.demotions += 1


def freezable(site: SiteState, grad: bool) -> bool:
    # Under torch.jit.trace a frozen value would be recorded as a constant, stale once the weights
    # change: the trace records the chain's ops, as stock's does.
    return can_freeze(site, grad) and _tracing_state() is None


def unfreezable(holder: nn.Module, name: str, site: SiteState, path: str | None = None) -> FoldError:
    """The refusal of a call that freeze cannot serve; ``path``: the holder's, below the entry called."""
    places = unwatched(site)
    if places:
        why = (f"its chain now holds {first_few(places, 2)}, whose changes a frozen value cannot watch "
               f"({ADVICE})")
    else:
        why = ("a parameter of its chain requires grad or its stateful chain is in training mode; "
               "frozen values would not train")
    where = f"{path}.{name} ({type(holder).__name__})" if path else tensor_label(holder, name)
    return FoldError(
        f"{where} was prepared with mode='freeze' but now {why}. "
        "Call paramfold.restore(model) and prepare it with mode='auto' or 'hoist'."
    )


def _hoisted(holder: nn.Module, name: str, site: SiteState, grad: bool) -> torch.Tensor | None:
    # Inside parametrize.cached(), the value stock's property would return: the one cached for
    # this module and name by an earlier read or call in the same block, else computed and cached.
    if parametrize._cache_enabled:
        site.from_cache = site.hook is None and (id(holder), name) in parametrize._cache
    value = eager_value(holder, name) if site.hook is None else hooknorms.compute(holder, site.hook, site.hook_kind)
    return _typed(site, value, grad)


def _typed(site: SiteState, value: torch.Tensor | None, grad: bool) -> torch.Tensor | None:
    """``value``, or None where it shows that the site's values are to be computed where they are
    read (:func:`_at_read`); the site's ``subclass`` notes what it is."""
    if value is None:
        return None
    site.subclass = _subclass(value)
    if _at_read(site, grad):
        _drop_frozen(site)
        return None
    return value


def _subclass(value: torch.Tensor) -> str:
    if type(value) in PLAIN_TENSOR_TYPES:
        return ""
    return "wrapper" if is_traceable_wrapper_subclass(value) else "python"


def _at_read(site: SiteState, grad: bool) -> bool:
    """Whether the site's values are tensor subclasses that compiled code cannot be given in
    ``__dict__``, as graph inputs: a Python subclass (``x.as_subclass(MyT)``), which AOTAutograd
    cannot take (stock's graph computes it from plain originals, ``as_subclass`` included), or a
    wrapper subclass that needs grad, whose gradients AOTAutograd would not carry back to the
    originals it was computed from. Such values are computed where they are read, in-graph."""
    return site.subclass == "python" or bool(site.subclass and grad and chain_needs_grad(site))


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
