"""The inline strategy: compute a parametrized tensor where it is read, through generated getters.

:func:`inline_property` makes, per chain shape, a property whose getter has the chain unrolled
into one expression over plain module attributes (:func:`install_refs`), so dynamo traces a few
bytecodes per read instead of stock's ``ParametrizationList`` machinery, with the same ops (and
results) as :func:`paramfold.compute.compute`. Sites whose originals are themselves parametrized
(nested) are served by the shared classes' descriptor instead, which computes in-graph too.
"""

from __future__ import annotations

import dis
import functools
import types

from torch import nn
from torch.nn.utils import parametrize

from paramfold.compute import (GLOBAL_HOOKS, calls_its_forward, direct_forward, eager_value, has_own_hooks,
                               hook_dicts, members, original_names, parametrized_here)
from paramfold.frames import run_eagerly_as_frame, run_module_eagerly_as_frames
from paramfold.state import SiteState


def ref_keys(name: str, signature: tuple) -> tuple[list[str], list[str]]:
    """Instance ``__dict__`` keys of a generated getter's inputs: chain members, then the dict
    holding each original, in a :class:`DictRef` (the getter reads ``self.<key>.d[<original's name>]``)."""
    return (
        [f"_paramfold_{name}_m{i}" for i in range(len(signature[2]))],
        [f"_paramfold_{name}_{o}" for o in _originals(signature)],
    )


def _originals(signature: tuple) -> list[str]:
    ntensors = signature[0]
    return ["original"] if ntensors is None else [f"original{i}" for i in range(ntensors)]


def install_refs(module: nn.Module, name: str, site: SiteState) -> list[str]:
    """Store a generated getter's inputs as plain attributes of ``module``; returns their keys.

    Compiled code then reaches each chain member with one attribute read and each original with
    one read of the ``ParametrizationList``'s own ``_parameters`` (or ``_buffers``) dict, without
    dynamo wrapping the ``parametrizations`` ModuleDict or the ``ParametrizationList`` on every
    read. The dict, not the tensor: an original replaced where no call scope runs (by
    ``torch.func.functional_call`` inside compiled code, or ``load_state_dict(assign=True)``) is
    read as it is then. Members and dicts are checked at every call scope (the dicts are pinned
    to their owners, see ``SiteState.dict_pins``).
    """
    member_keys, original_keys = ref_keys(name, chain_signature(module, name))
    for key, member in zip(member_keys, site.chain):
        module.__dict__[key] = member
    site.original_refs = tuple((key, DictRef(d), k) for key, (d, k) in zip(original_keys, site.originals))
    sync_refs(module, site)
    return member_keys + original_keys


class DictRef:
    """Holds a dict for a generated getter, as an object no pytree flattens: ``torch.export``
    snapshots every dict- or list-valued module attribute when it begins (the fake tensors it
    swapped in by then included) and puts back those copies when it ends; the dict itself, so
    stored, would be left pointing at fake tensors, which compiled code outside a call scope
    would then read."""

    __slots__ = ("d",)

    def __init__(self, d: dict) -> None:
        self.d = d


def sync_refs(module: nn.Module, site: SiteState) -> None:
    """Point the stored original dicts of a site at the ParametrizationList's (put back if removed)."""
    values = module.__dict__
    for key, ref, _ in site.original_refs:
        if values.get(key) is not ref:
            values[key] = ref


def chain_signature(module: nn.Module, name: str) -> tuple[int | None, str, tuple, bool]:
    """What the generated getter of ``module.<name>`` is specialised on.

    ``(number of originals or None for a single ``original``, the dict holding them, one entry
    per chain member, whether the ``ParametrizationList`` itself is called)``. An entry is the
    member's class's ``forward`` function, called directly (dynamo then has no module call to
    set up), or ``None`` when the member has hooks, a ``forward`` of its own (set on the
    instance) or a class ``forward`` that is no plain function (a ``staticmethod``), and must be
    called as a module, as stock does; a
    ``ParametrizationList`` with hooks of its own, or whose call is more than its ``forward``
    (a subclass, a patched ``nn.Module.__call__``), is called as stock calls it, and so is every
    module of the chain while global module hooks are registered. Modules with
    equal signatures share one getter, and so one class.
    """
    plist = module._modules["parametrizations"]._modules[name]
    ntensors = None if plist.is_tensor else plist.ntensors
    first = original_names(plist)[0]
    where = "_parameters" if first in plist._parameters else "_buffers"
    hooked = any(GLOBAL_HOOKS)  # global module hooks run for the list and every member, as in stock
    forwards = tuple(None if hooked else direct_forward(m) for m in members(plist))
    return ntensors, where, forwards, hooked or has_own_hooks(plist) or not calls_its_forward(plist)


def still_exact(module: nn.Module, name: str, signature: tuple) -> bool:
    """Whether the getter made for ``signature`` still computes ``module.<name>`` like stock: a
    call of each member whose class's ``forward`` it calls directly still is just that
    (:func:`~paramfold.compute.direct_forward`: no hook of its own added since, nor a ``forward``
    set, nor the class's call path or ``forward`` replaced), and no hook on the
    ``ParametrizationList`` it does not call, nor its call made more than its ``forward``
    (:func:`~paramfold.compute.calls_its_forward`). Global hooks added since are a documented limit
    (README): refusing them would refuse every call under ``FlopCounterMode``."""
    plist = module._modules["parametrizations"]._modules[name]
    # torch.fx's tracer patches nn.Module.__call__ for every thread while it traces (AOTAutograd's
    # first compile in another thread): a call made meanwhile is computed like stock's eagerly,
    # and compiled getters read nothing of it, as stock's compiled code does not.
    # An original shadowed in the list's __dict__ is not asked about: FSDP1 (use_orig_params=True)
    # puts its unsharded views there at every forward, which inline serves (tests/test_distributed.py).
    if not signature[3] and (has_own_hooks(plist) or not calls_its_forward(plist, through_fx=True, shadowed=False)):
        return False
    return not any(f is not None and direct_forward(m, through_fx=True) is not f
                   for m, f in zip(members(plist), signature[2]))


def hook_keys(plist: nn.Module) -> tuple:
    """The keys of every forward and backward hook dict of each module of ``plist``'s tree, in
    order: what a nested inline site, computed by stock's property inside compiled code, is
    prepared with. Dynamo does not guard on hooks, so code compiled before a hook was added would
    run without it, where a later compile would (``model.compile()`` after ``torch.compile(model)``
    reaches the same frames through the prepared entry): a change is refused at the next call,
    as :func:`still_exact` refuses one for the generated getters."""
    return tuple(tuple(d) for m in plist.modules() for d in hook_dicts(vars(m)))


class _InlineProperty(property):
    """A property whose ``fget`` is the lean, compiled-only getter.

    Dynamo resolves a ``property`` (subclasses included) by tracing its ``fget``, so compiled
    code runs the generated getter with no eager-mode branch in it. Plain Python calls
    ``__get__`` instead, which computes like stock and honours ``parametrize.cached()``. Were a
    future dynamo to trace ``__get__``, it would trace that stock-like path: slower, still exact.
    """

    def __init__(self, fget, fset, name: str) -> None:
        super().__init__(fget, fset)
        self.name = name

    def __get__(self, module, owner=None):
        if module is None:
            return self
        if not parametrized_here(module, self.name):
            raise AttributeError(self.name)  # removed while prepared: the plain tensor is back
        return eager_value(module, self.name)


@functools.cache
def inline_property(name: str, signature: tuple) -> property:
    """A property computing ``module.<name>`` with the chain unrolled into straight-line code.

    Under dynamo it reads the chain members and originals that :func:`install_refs` stored on the
    module and calls the members' forwards directly: a few bytecodes per read instead of stock's
    ``ParametrizationList`` machinery, with the same ops (and results). In eager it computes
    like stock, honouring ``parametrize.cached()``.
    """
    member_keys, original_keys = ref_keys(name, signature)
    expr = ", ".join(f"self.{key}.d[{o!r}]" for key, o in zip(original_keys, _originals(signature)))
    for i, (key, forward) in enumerate(zip(member_keys, signature[2])):
        if forward is None:
            expr = f"self.{key}({expr})"
        else:
            # A forward that never reads its module is given None in its place: dynamo then
            # neither wraps nor guards the member, most of what a read costs it beyond the ops.
            expr = f"F{i}({f'self.{key}' if reads_first_argument(forward) else 'None'}, {expr})"
    if signature[3]:  # stock's call of the ParametrizationList, its hooks and all
        expr = f"self._modules['parametrizations']._modules[{name!r}]()"
    source = (
        "def get(self):\n"
        # Inside parametrize.cached(), stock's property (traced by dynamo too) serves the block's
        # first value of the tensor: so does the getter, through the same cache.
        "    if P._cache_enabled:\n"
        f"        return cached_value(self, {name!r})\n"
        f"    return {expr}\n"
        "def set(self, value):\n"
        f"    self._modules['parametrizations']._modules[{name!r}].right_inverse(value)\n"
    )
    namespace = {f"F{i}": f for i, f in enumerate(signature[2]) if f is not None}
    namespace.update(P=parametrize, cached_value=eager_value)
    exec(compile(source, f"<paramfold inline getter {name}{signature}>", "exec"), namespace)
    return _InlineProperty(run_eagerly_as_frame(namespace["get"]), namespace["set"], name)


#: Names through which a function could reach its first argument without a local read of it:
#: zero-argument ``super()`` (which takes it from the frame), and frame or namespace introspection.
_INDIRECT_READS = frozenset({"super", "locals", "vars", "eval", "exec", "_getframe", "currentframe",
                             "f_locals", "getframeinfo", "stack"})


@functools.cache
def reads_first_argument(fn) -> bool:
    """Whether plain function ``fn`` may read its first positional parameter (``self``).

    Decided from the bytecode, conservatively: a local or closure access of that name anywhere in
    ``fn`` or in the functions, lambdas and comprehensions defined in it, or any name in
    :data:`_INDIRECT_READS`, counts as a read; so does anything but a plain function with a
    first positional parameter (a decorator's ``*args`` wrapper, a builtin).
    """
    if not isinstance(fn, types.FunctionType) or fn.__code__.co_argcount < 1:
        return True
    code = fn.__code__
    first = code.co_varnames[0]
    if first in code.co_cellvars:  # read by a nested function or comprehension
        return True
    for inner in _codes(code):
        if _INDIRECT_READS.intersection(inner.co_names):
            return True
        if inner is code:
            for ins in dis.get_instructions(inner):
                arg = ins.argval
                if ("FAST" in ins.opname or "DEREF" in ins.opname or "CLOSURE" in ins.opname) and (
                        arg == first or (isinstance(arg, tuple) and first in arg)):
                    return True
    return False


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


run_eagerly_as_frame(_InlineProperty.__get__)


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
