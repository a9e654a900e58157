"""``restore``: the exact undo of :func:`paramfold.prepare`."""

from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize

from paramfold import compile_reads as reads
from paramfold.compute import has_parametrizations
from paramfold.errors import FoldError
from paramfold.rebase import rebased
from paramfold.scope import busy
from paramfold.state import STATE_ATTR, installed_keys, state_of
from paramfold.write_marks import release


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`paramfold.prepare` on ``model``, in place, and return it.

    Every module gets back its exact class object (stock's per-instance ``Parametrized*``
    classes included); parametrization modules and ``Parameter`` objects were never replaced,
    so optimizers built at any point keep working. Restoring a model that is not prepared
    does nothing; a module taken out of the model it was prepared in is restored on its own.

    Example::

        >>> import torch, paramfold
        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> layer = weight_norm(torch.nn.Linear(4, 4))
        >>> cls = type(layer)
        >>> type(paramfold.restore(paramfold.prepare(layer))) is cls
        True
    """
    # Atomic for calls, which open their scopes under the same lock: a call made meanwhile in
    # another thread waits, then runs on the model prepared (this refused) or restored, not on a
    # module whose paramfold state is gone while its class is still paramfold's.
    # Likewise for a compile in another thread that reads the model (paramfold.compile_reads).
    with reads.switching(list(model.modules())):
        return _restore(model)


def _restore(model: nn.Module) -> nn.Module:
    state = state_of(model)
    if state is None:
        for path, module in model.named_modules():
            found = state_of(module)
            if found is None:
                continue
            if found.root:
                raise FoldError(
                    f"this model is not the one passed to paramfold.prepare, but its submodule "
                    f"{path!r} was: call paramfold.restore(model.get_submodule({path!r}))."
                )
            raise FoldError(
                f"this model is not the one passed to paramfold.prepare, but its submodule {path!r} "
                f"is part of another model passed to it{found.prepared_model_label()}, which shares the module with "
                "this one: restore that model."
            )
        return model
    if not state.root and drop_detached(model):
        return model
    if not state.root:
        raise FoldError(
            f"this {type(model).__name__} is part of a model passed to paramfold.prepare{state.prepared_model_label()}, "
            "not that model itself: restore the model you prepared (restoring part of it would leave "
            "the rest calling into modules that are no longer prepared)."
        )
    if busy(state):
        raise FoldError(
            f"this prepared {type(model).__name__} is being called (in this thread or another): "
            "its values are in its modules until the call ends. Restore it after the call returns."
        )
    for module in state.entries:
        restore_module(module)
    return model


def drop_detached(module: nn.Module) -> bool:
    """Restore ``module``, prepared as part of a model that no longer holds it (swapped or moved
    out of it since ``prepare``), with what below it was prepared for that model and is not in
    it either, and take them off that model's lists (so that ``restore`` of it leaves a module
    prepared since for another model alone). False, changing nothing, where the model holds it."""
    state = state_of(module)
    root = state.prepared_model()
    in_model = set() if root is None else set(map(id, root.modules()))
    if id(module) in in_model:
        return False
    gone = [m for m in module.modules()
            if id(m) not in in_model and (s := state_of(m)) is not None and not s.root and s.prepared_model() is root]
    if root is not None and state_of(root) is not None:
        ids = set(map(id, gone))
        for entry in state_of(root).entries:
            es = state_of(entry)
            if es is not None and id(entry) not in ids:
                es.entries = [m for m in es.entries if id(m) not in ids]
                es.holders = [m for m in es.holders if id(m) not in ids]
                es.covers = es.covers - ids
                es.drop_caches()
    for m in gone:
        restore_module(m)
    return True


def restore_module(module: nn.Module) -> None:
    """Put one module back as it was: its class, and no paramfold values in ``__dict__``.

    Parametrizations registered or removed while prepared are kept, and the module gets the class
    stock would have given it for them (see :func:`_stock_class_for_now`).
    """
    state = module.__dict__.pop(STATE_ATTR, None)
    if state is None:
        return
    for site in state.sites.values():
        release(site.frozen)  # no copy-on-write mark left on the model's storages
    for key in installed_keys(module, state):
        module.__dict__.pop(key, None)
    for name, value in state.foreign.items():  # unless put there again since
        module.__dict__.setdefault(name, value)
    if state.load_hook is not None:
        state.load_hook.remove()
    # A library may have wrapped the prepared class since (FSDP2's fully_shard after prepare makes
    # FSDP<Prepared>(FSDPModule, <Prepared>)): keep its wrapper, put the original class back inside.
    # A prepare that failed midway may not have switched this module's class yet.
    cls = type(module)
    for inside_or_between in (state.between_class, state.read_once_class):
        if inside_or_between is not None and inside_or_between in cls.__mro__:
            cls = rebased(cls, inside_or_between, state.prepared_class)
    original = state.original_class
    plain = original.__bases__[0] if state.stock_names else original
    # torch's remove_parametrizations of a module's last parametrization takes its class one base
    # down (paramfold's between-calls class to its prepared class, that to the class it was made
    # from: the plain class, or stock's for an unselected module), and a register_parametrization
    # after that makes a class of its own over the one it finds there.
    under = next((c for c in cls.__mro__ if "_paramfold_names" in vars(c)), None)
    under = under or next((c for c in (original, plain) if c in cls.__mro__), None)
    made = next((c for c in cls.__mro__ if c.__bases__ == (under,) and _made_by_parametrize(c)), None)
    if under is plain:
        return  # the plain class, and what torch made over it since: stock's own classes
    if under is None:
        # A class none of paramfold's nor made from the module's own: the model gave it one since
        # prepare (a forward that assigns ``self.__class__`` at its first call, as torch's lazy
        # modules do), as it does in stock: it stays.
        return
    if made is not None:
        # Stock's is made over the plain class (so it copies with parametrize's default_deepcopy
        # where the plain class has no __deepcopy__, as paramfold's classes have).
        module.__class__ = rebased(cls, made, _new_stock_class(module, plain))
        return
    module.__class__ = rebased(cls, under, original)
    _stock_class_for_now(module, state.stock_names)


def _made_by_parametrize(cls: type) -> bool:
    """Whether ``cls`` is a per-instance class torch's ``parametrize._inject_new_class`` made
    (or a rebased copy of one), not one of paramfold's."""
    return cls.__module__ == parametrize.__name__ and "_paramfold_sealed" not in vars(cls)


def _new_stock_class(module: nn.Module, plain: type) -> type:
    """The class stock's ``register_parametrization`` makes for ``module``'s parametrizations now
    on a module of class ``plain``, built with torch's own helpers. ``module`` keeps its class."""
    cls = module.__class__
    module.__class__ = plain
    try:
        parametrize._inject_new_class(module)
        for name in module._modules["parametrizations"]._modules:
            parametrize._inject_property(module, name)
        return type(module)
    finally:
        module.__class__ = cls


def _stock_class_for_now(module: nn.Module, stock_names: frozenset[str]) -> None:
    """Bring stock's class of ``module`` in line with the parametrizations it has now.

    ``module`` has its class from before ``prepare`` (stock's per-instance class when it was
    parametrized), whose properties cover ``stock_names``. A parametrization registered or removed
    while prepared went to paramfold's class, not this one, so the difference is applied here with
    torch's own helpers, as ``register_parametrization`` / ``remove_parametrizations`` would have.
    """
    now = frozenset(module._modules["parametrizations"]._modules) if has_parametrizations(module) else frozenset()
    if now == stock_names:
        return
    cls = type(module)
    if not now:
        if "parametrizations" in module._modules:
            delattr(module, "parametrizations")
        if stock_names:
            module.__class__ = cls.__bases__[0]
        return
    if not stock_names and not any(isinstance(vars(cls).get(n), property) for n in now):
        parametrize._inject_new_class(module)
        cls = type(module)
    for name in stock_names - now:
        if name in vars(cls):
            delattr(cls, name)
    for name in sorted(now - stock_names):
        if name not in vars(cls):
            parametrize._inject_property(module, name)
