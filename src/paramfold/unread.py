"""A training stateful chain's state, put back where a call did not read the value computed for it.

hoist and auto compute a training spectral_norm's value before the call, and computing it runs
the power iteration (``_u``/``_v``, a hook-based norm's ``weight_u``/``weight_v``, change in
place). Stock runs it at a read. So where the forward never reads the tensor (a branch that skips
the layer, an exception raised before it) or drops the value before reading it (a nested call
that swapped or changed the originals first: ``functional_call`` of the layer, MoCo's momentum
update, which then computes afresh, ``scope_nested.call_changed``), the state must be as if the
scope had not computed it. Before computing, the scope copies the buffers the chain may change
(:class:`Copies`, one ``torch.cat`` for all of a steady plan's); where the value goes unread,
each buffer that nothing but the scope's computation wrote since is copied back
(:func:`put_back`). A read takes the value (the read-once class, ``classes.read_once_class``),
and with it the copy's last use (:func:`release`). Where the computation's assignment stored
another tensor in a buffer's dict entry than the one it changed in place (a global buffer
registration hook returning a copy, for device placement or offloading, runs at spectral_norm's
``self._u = ...``), the entry gets its tensor back too: stock, which never assigned it, holds
the same tensor there with the same contents. In a non-reentrant ``torch.utils.checkpoint``
region's recomputation stopped inside compiled code, a read is taken from the forward's
(:func:`checkpointed`).
"""

from __future__ import annotations

from operator import attrgetter, is_

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.nn.utils import parametrize

from paramfold import hooknorms
from paramfold.compute import checkpoint_frame, dispatch_modes, function_modes
from paramfold.errors import FoldError
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.state import STATE_ATTR, SiteState, tensor_label, version_of
from paramfold.state import tensor_version as _version
from paramfold.write_marks import bitwise

_dtype = attrgetter("dtype")


def state_entries(holder: nn.Module, site: SiteState) -> list[tuple[dict, str]]:
    """Where the tensors computing ``site``'s value may change are held: ``(dict, key)`` of each
    of its members' buffers (a hook-based spectral_norm's ``<name>_u``/``<name>_v``)."""
    if site.hook is not None:
        return [(d, k) for _, d, k in hooknorms.state_tensors(holder, site.hook, site.hook_kind)]
    return [(m._buffers, k) for m in site.chain for k, b in m._buffers.items() if b is not None]


def state_tensors(holder: nn.Module, site: SiteState) -> list[torch.Tensor]:
    """The tensors computing ``site``'s value may change in place (:func:`state_entries`)."""
    return [d[k] for d, k in state_entries(holder, site)]


def fusable(tensors: list[torch.Tensor]) -> tuple | None:
    """The dtypes of ``tensors`` where one ``torch.cat`` copies them all exactly (plain 1-D
    tensors of one dtype and device, spectral_norm's vectors), else None."""
    if not tensors:
        return None
    first = tensors[0]
    for t in tensors:
        if type(t) not in (torch.Tensor, nn.Parameter) or t.dim() != 1 or t.dtype != first.dtype or t.device != first.device:
            return None
    return tuple(map(_dtype, tensors))


class Copies:
    """Copies of some sites' state tensors, held at ``dicts[i][keys[i]]``, taken before the scope
    computes their values, and their version counters after (:meth:`computed`)."""

    __slots__ = ("tensors", "dicts", "keys", "copy", "versions", "after", "replaced")

    def __init__(self, tensors: list[torch.Tensor], dicts: list[dict], keys: list[str],
                 dtypes: tuple | None = None) -> None:
        self.tensors, self.dicts, self.keys = tensors, dicts, keys
        try:
            self.versions = list(map(_version, tensors))
        except RuntimeError:  # an inference tensor, which has none (version_of)
            self.versions = list(map(version_of, tensors))
        if function_modes() or dispatch_modes():
            # A user's torch mode (one that rounds every result) must neither see nor change
            # this copy: stock makes none, and what it holds is put back as the state.
            with torch._C.DisableTorchFunction(), _disable_current_modes():
                self.copy = _copied(tensors, dtypes)
        else:
            self.copy = _copied(tensors, dtypes)
        self.after: list[int] | None = None
        #: By index, each entry the computation's assignment stored another tensor in: what it
        #: stored (None: taken out) and that tensor's version then.
        self.replaced: dict[int, tuple] | None = None

    def computed(self) -> None:
        tensors = self.tensors
        try:
            self.after = list(map(_version, tensors))
        except RuntimeError:  # an inference tensor: its bytes instead (stamp)
            self.after = list(map(stamp, tensors))
        if not all(map(is_, map(dict.get, self.dicts, self.keys), tensors)):
            self.replaced = {i: (t, None if t is None else stamp(t))
                             for i, t in enumerate(map(dict.get, self.dicts, self.keys)) if t is not tensors[i]}

    def put_back_parts(self, lo: int, hi: int) -> list[torch.Tensor | None]:
        """For ``tensors[lo:hi]``, what :meth:`restore` copies back into each: its copy where no
        one but the computation wrote it (nor its dict entry) since, else None (left as it is)."""
        tensors, copy, after = self.tensors, self.copy, self.after
        if after is None:
            return [None] * (hi - lo)
        if type(copy) is list:
            parts = copy
        else:
            sizes = [t.numel() for t in tensors]
            if sum(sizes) != copy.numel() or any(t.dtype != copy.dtype for t in tensors):
                return [None] * (hi - lo)  # re-described through .data meanwhile: nothing exact to put back
            parts = copy.split(sizes)
        replaced = self.replaced or {}
        kept = []
        for i in range(lo, hi):
            unwritten = unwritten_since(tensors[i], after[i]) and tensors[i].shape == parts[i].shape
            if unwritten and i in replaced:  # and the entry holds what the computation stored, unwritten
                stored, then = replaced[i]
                unwritten = self.dicts[i].get(self.keys[i]) is stored and (stored is None or unwritten_since(stored, then))
            kept.append(parts[i] if unwritten else None)
        return kept

    def restore(self, lo: int, hi: int) -> None:
        """Copy back ``tensors[lo:hi]``, each where no one but the computation wrote it since, into
        its dict entry again where the computation stored another tensor there (outside any
        user's torch mode, as the copy was taken)."""
        replaced = self.replaced or ()
        with torch.no_grad(), torch._C.DisableTorchFunction(), _disable_current_modes():
            for i, part in enumerate(self.put_back_parts(lo, hi), lo):
                if part is not None:
                    copy_back(self.tensors[i], part, self.versions[i])
                    if i in replaced:  # straight into the dict: stock ran no assignment (nor its hooks)
                        self.dicts[i][self.keys[i]] = self.tensors[i]


def _copied(tensors: list[torch.Tensor], dtypes: tuple | None) -> torch.Tensor | list[torch.Tensor]:
    """A copy of ``tensors``: one op for all where nothing changed their dtypes since ``dtypes``
    was taken (through ``.data``, which no dict tag sees); else one clone each."""
    if dtypes is not None and tuple(map(_dtype, tensors)) == dtypes:
        try:
            return torch.cat(tensors)
        except RuntimeError:  # not 1-D any more
            pass
    return [t.clone() for t in tensors]


def stamp(t: torch.Tensor) -> int | torch.Tensor | None:
    """What shows whether ``t`` is written from now on (:func:`unwritten_since`): its version
    counter; for an inference tensor, which has none (it can be written in place inside
    ``torch.inference_mode()``, where no counter moves), a copy of its bytes (a chain's state
    vectors: small). None where neither can be read."""
    version = version_of(t)
    if version is not None:
        return version
    now = bitwise(t)
    return None if now is None else now.clone()


def unwritten_since(t: torch.Tensor, then: int | torch.Tensor | None) -> bool:
    """Whether ``t`` is as :func:`stamp` found it: the same version, or the same bytes (a write
    storing exactly the bytes there is not told apart: put back, what the computation wrote is
    undone)."""
    if not isinstance(then, torch.Tensor):
        return version_of(t) == then
    now = bitwise(t)
    return now is not None and now.shape == then.shape and torch.equal(now, then)


#: Sets tensors' version counters; None in a torch without it (the counter then moves).
_set_versions = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)


def copy_back(t: torch.Tensor, then: torch.Tensor, version: int | None) -> None:
    """``t.copy_(then)``, undoing a computation's in-place writes to ``t``, with ``t``'s version
    counter set back to ``version``, what it was before that computation: stock never wrote it,
    so a graph recorded earlier that saved ``t`` for its backward (a hook-based spectral_norm's
    eval call saves ``weight_u`` itself, a chain may divide by its own buffer) must find it as it
    saved it, not raise autograd's "modified by an inplace operation" at backward."""
    if version is None and t.is_inference():
        # No counter to set. Writable only inside inference_mode, and only the computation
        # wrote it (outside, it raised stock's error before writing): its bytes put back.
        with torch.inference_mode():
            t.copy_(then)
        return
    t.copy_(then)
    if _set_versions is not None and version is not None:  # (None: an inference tensor, which has none)
        _set_versions((t,), (version,))


#: ``SiteState.before``: ``(copies, lo, hi, value, cache key)``, one site's part of a
#: :class:`Copies` (``copies.tensors[lo:hi]``), and where ``parametrize.cached()`` is open the
#: value computed and its key in the cache. A tuple: a steady plan makes one per site in C.


def take(holder: nn.Module, name: str, site: SiteState) -> None:
    """Before the general path of a scope computes ``site``'s value (a training stateful chain the
    read-once class serves): a copy of its state, kept on the site. Nothing where the value
    comes from ``parametrize.cached()``'s cache (no power iteration runs)."""
    cache_key = None
    if site.hook is None and parametrize._cache_enabled:
        cache_key = (id(holder), name)
        if cache_key in parametrize._cache:
            site.before = None
            return
    entries = state_entries(holder, site)
    tensors = [d[k] for d, k in entries]
    copies = Copies(tensors, [d for d, _ in entries], [k for _, k in entries], fusable(tensors))
    site.before = (copies, 0, len(tensors), None, cache_key)


def computed(site: SiteState, value: torch.Tensor | None) -> None:
    """After the general path computed ``site``'s value. ``None`` (the value is to be computed
    where it is read instead): put back at once, that read runs the iteration again."""
    before = site.before
    if before is None:
        return
    copies, lo, hi, _, key = before
    copies.computed()
    site.before = (copies, lo, hi, value, key)
    if value is None:
        put_back(site)


def as_before(holder: nn.Module, name: str, site: SiteState) -> list[torch.Tensor | None] | None:
    """Where ``site``'s value is unread now (:func:`release` would put its state back): for each
    state tensor, what :func:`put_back` would leave in it (None: one it would leave as it is);
    else None. For a copy of ``holder`` made now, which must hold the state as stock's has it."""
    before = site.before
    if before is None or not _unread(holder, name, site):
        return None
    copies, lo, hi, _, _ = before
    return copies.put_back_parts(lo, hi)


def put_back(site: SiteState) -> None:
    """The value ``site`` was computed for the call goes unread: its state as it was before that
    computation (each tensor nothing else wrote since); inside ``parametrize.cached()`` the value
    leaves the cache too, so a later read in the block computes it, as stock's first read does."""
    before = site.before
    site.before = None
    if before is None:
        return
    copies, lo, hi, value, key = before
    copies.restore(lo, hi)
    # (value None: the chain raised before a value was computed, and nothing was cached.)
    if key is not None and value is not None and parametrize._cache_enabled and parametrize._cache.get(key) is value:
        del parametrize._cache[key]


def drop(holder: nn.Module, name: str, site: SiteState) -> None:
    """Where no read took the value the scope computed for ``site`` yet: its state put back and
    the value given up, so that the reads (a hook-based norm: the module's calls) from now on in
    the call compute it afresh from that state, each advancing it, as stock's do."""
    if site.before is None or not _unread(holder, name, site):
        return
    if site.hook is not None:
        site.once_hook.served = True
        last_back(holder.__dict__, name)
    else:
        del holder.__dict__[name]
    put_back(site)


def last_back(values: dict, name: str) -> None:
    """A hook-based norm's value no call of its module took (``values``: the module's
    ``__dict__``): until the module's call runs the norm's hook, stock's ``__dict__`` holds the
    last call's value, and keeps it after a call that did not call the module."""
    for replaced, last in values[STATE_ATTR].replaced:
        if replaced == name and isinstance(last, torch.Tensor):
            values[name] = last


def give_back(values: dict, name: str, site: SiteState) -> None:
    """At the end of a call that did not read the value computed for ``site`` (``values``: its
    module's ``__dict__``): its state as before, and a hook-based norm's last call's value back."""
    if site.hook is not None:
        last_back(values, name)
    put_back(site)


def release(holder: nn.Module, name: str, site: SiteState) -> None:
    """At the end of the call (before its values leave ``holder``'s ``__dict__``): put back where
    no read took the value (a hook-based norm: no call of the module was served it, which keeps
    the last call's value, as stock's does)."""
    if site.before is None:
        return
    if _unread(holder, name, site):
        give_back(holder.__dict__, name, site)
    else:
        site.before = None


def _unread(holder: nn.Module, name: str, site: SiteState) -> bool:
    """Whether no read took the value the scope computed for ``site`` (a hook-based norm: no call
    of the module was served it)."""
    if site.hook is not None:
        return site.once_hook is not None and not site.once_hook.served
    return name in holder.__dict__


#: On a non-reentrant ``torch.utils.checkpoint`` frame: for each training stateful chain
#: ``(id(holder), name)``, whether each call scope of the region's forward that computed its value
#: had it read, in the order those scopes closed.
_READ = "_paramfold_read_in_forward"
#: ... and ``(pack hook, {chain: scopes closed})`` of the recomputation running now.
_REPLAYED = "_paramfold_replayed"
_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def checkpointed(holders: list[nn.Module], stopped: bool) -> FoldError | None:
    """At the close of a call scope over ``holders`` inside a non-reentrant
    ``torch.utils.checkpoint`` region, before their values are released; ``stopped``: the call
    ended with the recomputation's early stop. Returns the error to raise once they are.

    The recomputation (at backward) replays the region's forward and stops at the last tensor
    that forward saved: torch raises ``_StopRecomputationError`` from that save. Raised inside
    compiled code (the call's own, or a compiled module it calls), it comes before dynamo
    applies what the code did to Python objects, the read-once class's taking of the value
    (``__dict__.pop``, a hook-based norm's ``ServedOnce.served``) among them: the value looks
    unread, and :func:`release` would put back the power iteration that computed it, which stock
    runs again at that read. So a value the matching scope of the forward read (the forward notes
    what its scopes read, the recomputation counts its scopes as they close, in the same order)
    and that requires grad counts as read: stock's read computes it with autograd, saving tensors
    of its own, so it comes before the stop. One that does not require grad may have been read
    after the forward's last saved tensor, which stock's recomputation never reaches; which,
    cannot be seen inside compiled code: refused."""
    region = checkpoint_frame()
    if region is None or region[0] is None:
        return None
    pending = [(holder, name, site) for holder in holders
               for name, site in holder.__dict__[STATE_ATTR].sites.items() if site.before is not None]
    if not pending:
        return None
    frame, recomputing = region
    notes = frame.__dict__
    if not recomputing:
        read = notes.setdefault(_READ, {})
        for holder, name, site in pending:
            read.setdefault((id(holder), name), []).append(not _unread(holder, name, site))
        return None
    pack = _top_saved_tensors_hooks(True)[0]
    replayed = notes.get(_REPLAYED)
    if replayed is None or replayed[0] is not pack:  # a recomputation of its own (each backward)
        replayed = notes[_REPLAYED] = (pack, {})
    closed, read = replayed[1], notes.get(_READ, {})
    for holder, name, site in pending:
        key = (id(holder), name)
        i = closed[key] = closed.get(key, -1) + 1
        if not (stopped and i < len(read.get(key, ())) and read[key][i] and _unread(holder, name, site)):
            continue
        if not getattr(holder.__dict__.get(name), "requires_grad", False):
            return FoldError(
                f"{tensor_label(holder, name)}: a stateful parametrization (spectral_norm) in training "
                "mode whose inputs do not require grad is read again while torch.utils.checkpoint("
                "use_reentrant=False) recomputes its forward, which stopped (at the forward's last saved "
                "tensor) before paramfold saw that read: whether stock's recomputation reaches it and runs "
                "the power iteration again cannot be told. Prepare this module with mode='inline' "
                "(filter_fn), or call model.eval()."
            )
        if site.hook is not None:
            site.once_hook.served = True
        else:
            del holder.__dict__[name]
    return None


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
