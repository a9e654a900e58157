"""Write marks and byte checks: how a frozen value (:mod:`paramfold.freeze`) sees a write to one of
its inputs that bumps no version counter.

A version counter shows writes made through torch's ops; a write through ``.data``
(``p.data.mul_()``, init code, EMA loops), through a numpy array (``.detach().numpy()``) or
DLPack bumps none. :mod:`paramfold.freeze` keys a frozen value on its inputs' identities,
addresses, versions and descriptions and on the chain's settings; this module holds the rest:
the marks it sets on its inputs' storages (:func:`arm`, torch's copy-on-write storages), the
stamps that tell one arming of a storage from another (:data:`ARMINGS`, :func:`arming_stamps`),
the marks set again where nothing was written (:func:`rearm_unwritten`, :func:`rearm_compiled`)
or cleared where a value is dropped (:func:`release`), and the checks of the bytes of inputs
that cannot be marked (:func:`same_bytes`, :data:`digest`). The steady-call plan
(:mod:`paramfold.scope_plan`), the check of a call nested in a scope
(:mod:`paramfold.scope_nested`), compiles (:mod:`paramfold.compile_leaves`), ``restore`` and
``export`` use them too. It imports no module of paramfold's but :mod:`paramfold.state` and
:mod:`paramfold.frames`: :mod:`paramfold.freeze` imports it, never the other way round.

With ``freeze_check="content"`` (the default), writes that bump no version counter — through
``.data``, ``.detach().numpy()``, DLPack — are seen. A host input that is the only tensor on its
storage (:func:`unshared`) is watched for writes (:func:`arm`): any write through torch and any
later hand-out of a pointer to its bytes (numpy, DLPack, ``data_ptr()``) is seen, with no byte
read per call (a mark cleared with nothing written is set again: :func:`rearm_unwritten`). An
input something else already holds (a numpy array or DLPack capsule made before, a view, memory
torch did not allocate) has its bytes checked at every call: hashed in place on the host
(:data:`digest`, 16 bytes kept per input), compared with a copy on a device. Not seen: a write
through an address taken earlier as a bare integer, with nothing holding the memory. A subclass
that is a plain tensor underneath (:func:`plain_underneath`) is marked or hashed as a plain one.
``freeze_check="version"`` reads no bytes: besides identity, address and version it watches each
host input's storage for writes (:func:`arm`), which sees ``.data`` writes and every other write
made through torch, but not one through memory exported before (a numpy array, DLPack, a raw
pointer, another process). An input whose mark is found cleared with no version bump while
something besides it holds its storage (a numpy array or DLPack export taken after the value was
computed) is the exception: its bytes are hashed at every call from then on, and in the values
computed after while that holds (:func:`rearm_unwritten`, :func:`_exported_since`).
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from collections.abc import Iterable

import torch
import xxhash
from torch import nn

from paramfold.frames import run_module_eagerly_as_frames
from paramfold.state import PLAIN_TENSOR_TYPES, STATE_ATTR, FrozenValue, SiteState, version_of
from paramfold.state import functorch_wrapped as _wrapped
from paramfold.state import tensor_data_ptr as _data_ptr


_lazy_clone = getattr(torch, "_lazy_clone", None)
#: Whether a tensor's storage is still armed by :func:`arm` (no write since), where torch has it.
is_armed = getattr(torch._C, "_is_cow_tensor", None)
#: A storage's identity (its StorageImpl's address), read without touching its data.
_storage_key = getattr(torch._C, "_storage_address", None)
#: When :func:`arm` last armed each storage (by :data:`_storage_key`), as :data:`ARMINGS`' count
#: then: unique to that arming. One storage may feed several frozen values (a shared
#: parametrization's buffer, tied weights, views of one flat buffer, two models): the first to
#: see it disarmed arms it again, so each value records the stamp it was computed at, and a later
#: one is a change for the others too. An entry lives while a frozen value records it
#: (:func:`_keep_keys`): a process that prepares and drops models does not grow.
_armings: dict[int, int] = {}
#: How many live frozen values record each entry of :data:`_armings`.
_recorders: dict[int, int] = {}
#: Bumped at every arming anywhere: a steady plan built at one count reads its storages' stamps
#: (:func:`arming_stamps`) only once the count has moved.
ARMINGS = [0]


def _keep_keys(frozen: FrozenValue) -> FrozenValue:
    """Count ``frozen`` among the recorders of its storages' :data:`_armings` entries until it
    is freed; the last one freed drops them (its storage may be freed too, and its address reused)."""
    keys = frozen.armed_keys
    if keys:
        for key in keys:
            _recorders[key] = _recorders.get(key, 0) + 1
        weakref.finalize(frozen, _drop_keys, keys)
    return frozen


def _drop_keys(keys: tuple[int, ...]) -> None:
    for key in keys:
        left = _recorders.get(key, 0) - 1
        if left > 0:
            _recorders[key] = left
        else:  # no value compares this entry now: one armed later is stamped afresh
            _recorders.pop(key, None)
            _armings.pop(key, None)


def plain_underneath(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain strided tensor, or a subclass of one that changes nothing below
    Python (``t.as_subclass(MyT)``, a subclass of ``nn.Parameter``): its storage is its own and
    can be marked or hashed as a plain tensor's is. Not a wrapper subclass (DTensor, torchao's),
    one that dispatches itself (``__torch_dispatch__``), or one flattened into inner tensors."""
    cls = type(t)
    if cls in PLAIN_TENSOR_TYPES:
        return True
    return (getattr(cls, "__torch_dispatch__", None) is _no_dispatch and not hasattr(cls, "__tensor_flatten__")
            and not _subclass_like(t))


_no_dispatch = torch.Tensor.__torch_dispatch__
#: Whether a tensor dispatches to Python or is a functorch or functional wrapper (a wrapper subclass does).
_subclass_like = getattr(torch._C, "_dispatch_isTensorSubclassLike", lambda t: True)


def _plain(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Where ops on ``t`` (:func:`plain_underneath`) run as on a plain tensor: outside its class's
    ``__torch_function__``, which may log, cast or wrap what they return."""
    return contextlib.nullcontext() if type(t) in PLAIN_TENSOR_TYPES else torch._C.DisableTorchFunctionSubclass()


def _storage_of(t: torch.Tensor) -> int | None:
    try:
        return _storage_key(t)
    except Exception:  # no storage (a wrapper subclass, sparse, meta)
        return None


def _address(t: torch.Tensor) -> int:
    try:
        # Not data_ptr() for a subclass that is a plain tensor underneath: it would clear its mark.
        return _data_ptr(t) if plain_underneath(t) else t.data_ptr()
    except RuntimeError:  # tensor subclasses without storage
        return 0


def release(frozen: FrozenValue | None) -> None:
    """Clear the marks :func:`arm` left on the storages of a frozen value that is dropped (the
    model restored, the site demoted or no longer frozen). A marked storage is copy-on-write: a
    storage resize keeps it so while giving it new memory, and the next write to it then fails
    in torch (``ctx != nullptr INTERNAL ASSERT FAILED at c10/core/impl/COW.cpp``). Handing out a
    writable pointer takes a marked storage back without a copy (nothing else owns it). A storage
    another frozen value still watches is then computed again for it, at worst."""
    if frozen is not None:
        _unmark(frozen.armed)


def _unmark(tensors) -> None:
    """Clear the marks of ``tensors`` (:func:`release`)."""
    if is_armed is None:
        return
    for t in tensors:
        if is_armed(t):
            with _plain(t):
                t.data_ptr()


def mark(t: torch.Tensor) -> int | None:
    """The count ``t``'s storage was last armed at (:data:`_armings`; 0 where not by :func:`arm`)
    while its mark stands, so nothing was written to it since; None where it has no mark."""
    if is_armed is None or _storage_key is None or not is_armed(t):
        return None
    return _armings.get(_storage_key(t), 0)


def arm(t: torch.Tensor, again: bool = False) -> bool:
    """Arm ``t``'s storage so that any later write to it is seen (:data:`is_armed` turns False);
    return whether it could be armed. ``again``: armed again where nothing was written since its
    stamp was taken (a value's own computation took it back: :func:`paramfold.freeze._freeze`), so
    the stamp stands.

    It uses torch's copy-on-write storages: lazily cloning a tensor and dropping the clone leaves
    its storage marked copy-on-write with no other owner. Reads leave the mark; the first write
    through torch, by any tensor sharing the storage (``p.data.mul_()``, a view, ``set_``,
    ``untyped_storage()``, an optimizer step), and any hand-out of a writable pointer
    (``data_ptr()``, ``numpy()``, DLPack, ``torch.save``) take the storage back without copying,
    which clears it: at worst a value is computed again for nothing. Only plain, unpinned host
    tensors are armed: memory torch did not allocate (numpy, shared memory) cannot be, and device
    and pinned memory are left alone, since their allocators look blocks up by the storage's
    deleter, which arming changes.

    A storage resize (``untyped_storage().resize_()``, ``t.resize_()`` to a larger size) of an
    armed storage keeps torch's copy-on-write materialiser while giving it memory that is not
    copy-on-write, and the next write to it fails inside torch (``ctx != nullptr INTERNAL
    ASSERT FAILED at c10/core/impl/COW.cpp``), which nothing here can prevent (README, Notes and
    limits: resize after a pointer hand-out, ``t.data_ptr()``, which clears the mark). So no mark
    outlives its value: :func:`release` clears those of a value that is dropped.
    """
    if is_armed is None or _lazy_clone is None or _storage_key is None or not plain_underneath(t) or _wrapped(t):
        return False
    try:
        with _plain(t):
            if t.device.type != "cpu" or t.layout != torch.strided or t.is_pinned():
                return False
            if is_armed(t):  # by another value, and unwritten since: its stamp stands
                return True
            with torch.no_grad():
                _lazy_clone(t.detach())
    except RuntimeError:  # storage not owned the plain way (numpy, shared memory)
        return False
    if not is_armed(t):
        return False
    if again:
        return True
    ARMINGS[0] += 1
    _armings[_storage_key(t)] = ARMINGS[0]
    return True


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def unshared(t: torch.Tensor) -> bool:
    """Whether ``t`` is the only tensor on its storage and nothing but its Python object holds
    it: no view, no ``.data`` alias, and so no numpy array or DLPack capsule made from it or
    from an alias before now (one made of ``t`` itself holds ``t``, one of an alias a tensor on
    the storage).

    With ``freeze_check="content"``, an input that is unshared and :func:`arm`-ed needs no byte
    check: every later way to write its bytes goes through torch or a pointer handed out after
    now, and either disarms it. Only an address taken earlier as a bare integer (``data_ptr()``
    kept, then written through ``ctypes``) is not seen; a shared input's bytes are hashed."""
    if _use_count is None or not plain_underneath(t):
        return False
    try:
        with _plain(t):
            # ``t``'s and the storage object's own; ``t`` held by its Python object alone.
            return _use_count(t.untyped_storage()._cdata) <= 2 and t._use_count() <= 1
    except Exception:  # no storage (meta, sparse), or a torch whose storages do not say
        return False


def same_armings(frozen: FrozenValue) -> bool:
    """Whether no storage ``frozen`` watches was armed afresh since (written, then armed for another value)."""
    return arming_stamps(frozen.armed_keys) == frozen.armed_counts


def arming_stamps(keys: Iterable[int]) -> list[int | None]:
    """The :data:`ARMINGS` count at which each storage (by :data:`_storage_key`) was last armed."""
    return list(map(_armings.get, keys))


def rearm_unwritten(site: SiteState, frozen: FrozenValue) -> bool:
    """Whether each of ``frozen``'s storages whose mark was cleared is unwritten: its version,
    address and bytes are those it was armed with. A kernel that takes a writable pointer and
    writes nothing clears a mark (inductor's ``freezing`` packs a frozen weight for MKL so while
    it compiles); computing the value again for that would give it a new identity, which
    compiled code guards on. Each is then watched as :func:`paramfold.freeze._fingerprint` watches
    an input: armed again where nothing else holds its storage, its count standing, as that of an
    input armed again in :func:`paramfold.freeze._freeze` (the caller checked it is the count the
    value was keyed on); its bytes checked at every call otherwise, since a numpy array or DLPack
    capsule on it writes unseen. So with ``freeze_check="version"`` too, the value's own storage
    included: a forward may return the value, and an array taken of it then writes what later
    calls read (stock's next read is a fresh tensor). A mark that a compile cleared (inductor's
    freezing packs a frozen weight, and keeps a view of it) is set again as that compile ends
    (:func:`rearm_compiled`), before anything else can hold the storage."""
    hashed = []
    for i, (t, armed_check) in enumerate(zip(frozen.armed, frozen.armed_checks, strict=True)):
        if is_armed(t):
            continue
        if not unwritten(t, armed_check):
            return False
        if not unshared(t) or not arm(t, again=True):
            hashed.append(i)
    if hashed:
        keep = [i for i in range(len(frozen.armed)) if i not in hashed]
        frozen.raw += tuple(frozen.armed_checks[i][2] for i in hashed)
        frozen.armed, frozen.armed_keys, frozen.armed_checks = (
            tuple(frozen.armed[i] for i in keep), tuple(frozen.armed_keys[i] for i in keep),
            tuple(frozen.armed_checks[i] for i in keep))
        frozen.armed_counts = [frozen.armed_counts[i] for i in keep]
    return True


def standing_marks(holders: Iterable[nn.Module]) -> list[tuple[torch.Tensor, tuple]]:
    """The frozen values of ``holders``' sites whose marks stand now, each with what it was armed
    with: the marks a compile beginning now may clear (:func:`rearm_compiled`). With
    ``freeze_check="version"`` only: another thread may take a pointer to a value while this one
    compiles, which the compiler's own view cannot be told from; the content check hashes what
    something else holds, whoever it is."""
    found = []
    if is_armed is None:
        return found
    for holder in holders:
        hs = holder.__dict__.get(STATE_ATTR)
        for site in (hs.sites.values() if hs is not None else ()):
            frozen = site.frozen
            if frozen is not None and site.freeze_check == "version":
                found += [(t, check) for t, check in zip(frozen.armed, frozen.armed_checks)
                          if t is frozen.value and is_armed(t)]
    return found


def rearm_compiled(marks: list[tuple[torch.Tensor, tuple]]) -> None:
    """Set again each mark of :func:`standing_marks` that the compile now ending cleared with
    nothing written (its version, address and bytes those it was armed with): a compiler that
    packs a weight takes a writable pointer to it (inductor's ``freezing``) and keeps a view of
    it, which :func:`rearm_unwritten` would take for an array a caller made, and hash at every
    call. Only this thread's compile ran since it began, where no other thread took a pointer to
    the value meanwhile (which the version check does not see: README). The caller holds the scope lock."""
    for t, armed_check in marks:
        if not is_armed(t) and unwritten(t, armed_check):
            arm(t, again=True)


def _exported_since(frozen: FrozenValue | None) -> frozenset[int]:
    """With the version check, the addresses of ``frozen``'s inputs that something took a
    pointer to after it was computed and holds (a numpy array, DLPack): hashed since
    (:func:`rearm_unwritten`), or found with their mark cleared, no version bump and their
    storage shared (the write through the array is what computes the value again). They stay
    hashed, not armed, in the value computed next: a write through the array is seen at every
    call, not at the first only."""
    if frozen is None:
        return frozenset()
    found = {*(ctypes.addressof(memory) for memory, _ in frozen.raw), *(view.data_ptr() for view, _ in frozen.views)}
    for t, (version, address, _) in zip(frozen.armed, frozen.armed_checks, strict=True):
        if t is not frozen.value and not is_armed(t) and version_of(t) == version and not unshared(t):
            found.add(address)
    return frozenset(found)


def _byte_check(t: torch.Tensor, address: int) -> tuple | None:
    """``(the bytes in place, their digest)`` of a contiguous host tensor, ``(byte view, copy)``
    of another, None where its bytes cannot be read (see :func:`same_bytes`)."""
    view = bitwise(t)
    if view is None:
        return None
    if address and view.device.type == "cpu" and view.is_contiguous():
        # The tensor's own bytes, read in place (its storage is kept alive by the tensor,
        # and its address is checked before each read).
        memory = (ctypes.c_char * view.nbytes).from_address(address)
        return memory, digest(memory)
    return view, view.clone(memory_format=torch.contiguous_format)


def _in_place(check: tuple | None) -> tuple | None:
    """A :func:`_byte_check` of bytes hashed in place (16 bytes kept), else None (not a copy)."""
    return check if check is not None and isinstance(check[0], ctypes.Array) else None


def _same_check(check: tuple) -> bool:
    """Whether the bytes of a :func:`_byte_check` are as they were."""
    return same_bytes((check,), ()) if isinstance(check[0], ctypes.Array) else same_bytes((), (check,))


def unwritten(t: torch.Tensor, armed_check: tuple) -> bool:
    """Whether ``t`` is as it was armed: ``armed_check`` is its ``(version, address, byte check)``
    then (:attr:`FrozenValue.armed_checks`); False where its bytes cannot be read."""
    version, address, check = armed_check
    return check is not None and version_of(t) == version and _address(t) == address and _same_check(check)


def same_bytes(raw: tuple[tuple[object, int], ...], views: tuple[tuple[torch.Tensor, torch.Tensor], ...]) -> bool:
    """Whether each input's bytes are as they were (see :class:`FrozenValue`)."""
    for memory, expected in raw:
        if digest(memory) != expected:
            return False
    for view, copy in views:
        if not torch.equal(view, copy):
            return False
    return True


#: The content check's hash of a host buffer: XXH3's 128 bits (a change kept undetected needs a
#: collision, about 3e-39 for a random change), read at memory speed in one pass, where a
#: comparison with a copy reads twice the bytes and keeps the copy in memory.
digest = xxhash.xxh3_128_intdigest


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitwise(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` viewed as integers of its element size (bitwise comparable: NaN and -0.0 included),
    or None where there are no bytes to read (wrapper subclasses, sparse and meta tensors)."""
    if not plain_underneath(t):
        return None
    with _plain(t):
        if t.layout != torch.strided or t.is_meta:
            return None
        t = t.detach()
        if t.is_complex():  # as (real, imaginary) pairs: complex128 has no integer of its size
            t = torch.view_as_real(t.conj() if t.is_conj() else t)  # the bytes in memory, not their conjugate
        if t.is_neg():
            t = torch._neg_view(t)
        as_int = _SAME_SIZE_INT.get(t.element_size())
        if as_int is not None:
            return t.view(as_int)
        return t.contiguous().view(torch.uint8) if t.is_contiguous() else None


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
