"""Finding parametrization sites: every tensor registered with ``torch.nn.utils.parametrize``."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

from paramfold.compute import has_parametrizations, is_nested, leaf_originals, members, original_names
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.hooknorms import hook_norms
from paramfold.hooknorms import originals as hook_originals
from paramfold.probe import (REPEATS, Probe, computed_originals, copy_failure, differ, forward_hooked, own_tensors,
                             plain_runs, probe_chain, probe_list, run_now, run_probed, same_bits)
from paramfold.state import is_dtensor

__all__ = ["KINDS", "Site", "find"]

#: The kinds :func:`find` recognises; anything else is ``"custom"``. A chain of several
#: parametrizations on one tensor gets the kinds of its members joined by ``"+"``.
#: ``"communication"``: a parametrization of DTensor originals (not run by ``find``: it would
#: issue collectives on one rank), or one found to call a collective (SimpleFSDP's all-gather).
#: ``"computed_original"``: an original that is not a parameter or buffer of its
#: ``ParametrizationList`` but computed at each call by a hook (``torch.nn.utils.prune`` applied
#: to ``parametrizations.<name>.original``); ``originals`` then holds the list's own tensors.
#: ``prepare`` leaves modules with either kind stock.
KINDS = (
    "weight_norm",
    "spectral_norm",
    "orthogonal",
    "fake_sparsity",
    "torchao_subclass",
    "cast",
    "communication",
    "computed_original",
    "custom",
)

# Recognised by class name so that torch.ao, torchao and torch.nn.utils variants all match
# without importing torchao; only where the class is defined in torch or torchao (known_kind).
_KIND_BY_CLASS = {
    "_WeightNorm": "weight_norm",
    "_SpectralNorm": "spectral_norm",
    "_Orthogonal": "orthogonal",
    "FakeSparsity": "fake_sparsity",
    "UnwrapTensorSubclass": "torchao_subclass",
}
_STATEFUL_KINDS = {"spectral_norm"}
_STATELESS_KINDS = frozenset(_KIND_BY_CLASS.values()) - _STATEFUL_KINDS
_KNOWN_PACKAGES = ("torch", "torchao")


def known_kind(module: nn.Module) -> str | None:
    """The kind of ``module`` where it is one of torch's or torchao's parametrizations, else None.
    A class of the user's own named like one of them (a ``FakeSparsity`` of their repository) is
    not: what it reads and draws is probed, as for any custom member."""
    cls = type(module)
    kind = _KIND_BY_CLASS.get(cls.__name__)
    if kind is None or cls.__module__.partition(".")[0] not in _KNOWN_PACKAGES:
        return None
    return kind


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
    """One parametrized tensor: ``module.<tensor_name>`` computed by ``chain`` from ``originals``.

    Attributes:
        module_path: fully qualified name of the module ("" for the root).
        tensor_name: the attribute the parametrization replaces, e.g. ``"weight"``.
        module: the parametrized module itself.
        chain: the parametrization modules, in the order they are applied.
        originals: ``{"original": t}``, or ``{"original0": t0, ...}`` when the first
            parametrization's ``right_inverse`` returns several tensors. An original that is
            itself parametrized is replaced by the tensors it is computed from, under their
            path (``"parametrizations.original.original"``).
        kind: one of :data:`KINDS`, or several joined by ``"+"`` for a chain.
        requires_grad: whether any original requires grad.
        stateful: whether the chain mutates its buffers in forward when training
            (spectral_norm's power iteration, or a custom parametrization found to do so, with
            grad enabled or under ``no_grad``).
        stateful_in_eval: whether it does so in eval mode too (a custom parametrization that
            tracks a running statistic at every computation): its value is never frozen.
        is_buffer: whether the originals are buffers rather than parameters.
        tied_with: ``(module_path, tensor_name)`` of the other sites sharing an original tensor.
        nested: the sites of parametrizations registered on this site's own originals
            (``module.parametrizations.<name>.original``), which stock computes first.
        hook_based: whether the tensor is computed by torch's deprecated hook-based
            ``torch.nn.utils.weight_norm`` / ``spectral_norm`` (``chain`` is then the hook;
            originals ``weight_g``/``weight_v`` or ``weight_orig``) rather than a parametrization.
        random: whether the chain (or a nested chain) draws random numbers when it computes
            the tensor, in training or eval mode (DropConnect, weight noise, sampled Bayesian
            weights), from torch's generators, Python's ``random``, NumPy's ``np.random`` or a
            Python or NumPy generator a member holds, or a forward hook or pre-hook on a member or
            the ``ParametrizationList`` does: stock then draws at every read, in the forward's
            order. (Global module hooks are not the chain's: see :mod:`paramfold.site_values`.)
        writes_itself: whether computing the tensor changes the chain's own state outside its
            parameters and buffers (an attribute set, such as a step counter; a tensor attribute
            edited in place) or its originals (a member that edits its input in place,
            ``X.clamp_()``, where the input is an original or a view of one), or the probe could
            not tell (a member that cannot be copied): stock changes it at every read.
        grad_dependent: whether a custom member computes another value, or runs other ops, with
            grad enabled than under ``no_grad``, from the same tensors, none requiring grad (a
            straight-through estimator taken only where gradients are recorded,
            ``if torch.is_grad_enabled():``): stock's read then depends on the grad mode it is
            made in, which one value for a call, or for many, cannot follow.
        unprobed: why the probe could not run the chain (``copy.deepcopy`` of a member failed:
            it holds a lock, a mappingproxy, a memoryview), or ``""``: such a chain counts as one
            that ``writes_itself``, since what stock's read changes cannot be known.
    """

    module_path: str
    tensor_name: str
    module: nn.Module = dataclasses.field(repr=False)
    chain: tuple[nn.Module, ...] = dataclasses.field(repr=False)
    originals: dict[str, torch.Tensor] = dataclasses.field(repr=False)
    kind: str
    requires_grad: bool
    stateful: bool
    is_buffer: bool
    tied_with: tuple[tuple[str, str], ...] = ()
    nested: tuple[Site, ...] = ()
    hook_based: bool = False
    random: bool = False
    stateful_in_eval: bool = False
    writes_itself: bool = False
    grad_dependent: bool = False
    unprobed: str = ""

    @property
    def fqn(self) -> str:
        """``module_path.tensor_name``, the key this tensor has in an unparametrized state dict."""
        return f"{self.module_path}.{self.tensor_name}" if self.module_path else self.tensor_name

    @property
    def training(self) -> bool:
        """Whether any parametrization in the chain (the module, for a hook-based norm) is training."""
        if self.hook_based:
            return self.module.training
        return any(m.training for m in self.chain)


def find(model: nn.Module) -> list[Site]:
    """Return every parametrization registration in ``model``, in ``named_modules`` order.

    Nothing is modified: parametrizations whose kind is not known by class are probed on
    copies of their buffers, so no running statistics move, and with the random number
    generators' states put back, so the numbers a program draws next are stock's.

    Example::

        >>> import torch, paramfold
        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> model = torch.nn.Sequential(weight_norm(torch.nn.Linear(4, 4)), torch.nn.ReLU())
        >>> [(s.module_path, s.tensor_name, s.kind) for s in paramfold.find(model)]
        [('0', 'weight', 'weight_norm')]
    """
    every = {(path, name): _make_site(path, module, name) for path, module, name in _iter_registrations(model)}
    sites = _attach_nested(every) + _hook_sites(model)
    order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    sites.sort(key=lambda s: order[id(s.module)])  # stable: a module's own order is kept
    by_original: dict[int, list[Site]] = defaultdict(list)
    for site in sites:
        for tensor in site.originals.values():
            by_original[id(tensor)].append(site)
    tied = []
    for site in sites:
        others = {
            (o.module_path, o.tensor_name)
            for t in site.originals.values()
            for o in by_original[id(t)]
            if o is not site
        }
        tied.append(dataclasses.replace(site, tied_with=tuple(sorted(others))))
    return tied


def _hook_sites(model: nn.Module) -> list[Site]:
    sites = []
    # Those inside a parametrization too (on a submodule of a member), as _iter_registrations lists
    # the parametrizations there.
    for path, module in model.named_modules():
        for _, hook, kind in hook_norms(module):
            originals = {n: d[k] for n, d, k in hook_originals(module, hook, kind)}
            sites.append(
                Site(
                    module_path=path, tensor_name=hook.name, module=module, chain=(hook,),
                    originals=originals, kind=kind,
                    requires_grad=any(t.requires_grad for t in originals.values()),
                    stateful=kind == "spectral_norm", is_buffer=False, hook_based=True,
                )
            )
    return sites


def _attach_nested(every: dict[tuple[str, str], Site]) -> list[Site]:
    """Fold the sites registered on a site's own originals into that site's ``nested``."""
    inner: dict[tuple[str, str], list[Site]] = defaultdict(list)
    for (path, _), site in every.items():
        owner_path, sep, tail = path.rpartition(".parametrizations.")
        if not sep and path.startswith("parametrizations."):
            owner_path, tail = "", path[len("parametrizations."):]
        if "." not in tail and tail and (owner_path, tail) in every:
            inner[(owner_path, tail)].append(site)
    nested_ids = {id(s) for group in inner.values() for s in group}

    def attach(key: tuple[str, str], site: Site) -> Site:
        children = tuple(attach((s.module_path, s.tensor_name), s) for s in inner.get(key, ()))
        if not children:
            return site
        # A nested chain that changes its state (spectral_norm's power iteration in training, a
        # buffer updated in eval) does so at every read of the outer tensor in stock, which
        # computes it afresh each time: no read-once class or put-back covers the inner chain's
        # state, so the outer site is one that changes itself at every read.
        changes = any(c.writes_itself or c.stateful or c.stateful_in_eval for c in children)
        return dataclasses.replace(site, nested=children, random=site.random or any(c.random for c in children),
                                   writes_itself=site.writes_itself or changes,
                                   grad_dependent=site.grad_dependent or any(c.grad_dependent for c in children))

    return [attach(key, site) for key, site in every.items() if id(site) not in nested_ids]


def parametrization_paths(model: nn.Module) -> frozenset[str]:
    """The paths in ``model`` of the modules that live inside a parametrization: a parametrized
    module's ``parametrizations`` dict and whatever is reached through one of torch's
    ``ParametrizationList``s in it (its members, their submodules, nested parametrizations),
    under every path a shared module has. Told by structure, not by name: a container of the
    user's named ``parametrizations`` is not one."""
    inside: set[str] = set()
    for path, module in model.named_modules(remove_duplicate=False):
        if not has_parametrizations(module):
            continue
        at = f"{path}.parametrizations" if path else "parametrizations"
        for name, plist in module._modules["parametrizations"].items():
            if isinstance(plist, parametrize.ParametrizationList):
                inside.add(at)
                inside.update(f"{at}.{name}.{sub}" if sub else f"{at}.{name}"
                              for sub, _ in plist.named_modules(remove_duplicate=False))
    return frozenset(inside)


def _iter_registrations(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    for path, module in model.named_modules():
        if has_parametrizations(module):
            for name in module._modules["parametrizations"]:
                yield path, module, name


def _make_site(path: str, module: nn.Module, name: str) -> Site:
    plist = module.parametrizations[name]
    chain = members(plist)
    stored = {**plist._parameters, **plist._buffers}
    if any(n not in stored and not parametrize.is_parametrized(plist, n) for n in original_names(plist)):
        tensors = {n: t for n, t in stored.items() if t is not None}
        return Site(
            module_path=path, tensor_name=name, module=module, chain=chain, originals=tensors,
            kind="computed_original", requires_grad=any(t.requires_grad for t in tensors.values()),
            stateful=False, is_buffer=not any(isinstance(t, nn.Parameter) for t in tensors.values()),
        )
    originals = {p: d[k] for p, d, k in leaf_originals(plist)}
    kinds = [known_kind(m) for m in chain]
    stateful = any(k in _STATEFUL_KINDS for k in kinds)
    random = stateful_in_eval = writes_itself = grad_dependent = False
    dtensors = any(is_dtensor(t) for t in originals.values())
    if any(k is None for k in kinds) and dtensors:
        kinds = [k or "communication" for k in kinds]
    elif any(k is None for k in kinds) or (runs_hooks(plist) and not dtensors):
        # A member of torch's with a hook of its own, or on its list, is probed as a custom one:
        # what the hook draws or writes, stock does at every read.
        # An inner chain's draws come from the probe's own generator.
        inputs = run_probed(Probe(stop_at_collectives=False), computed_originals, plist) if is_nested(plist) else originals
        # A nested chain's value is computed afresh at each read: only the originals are state.
        computed = frozenset(n for n in inputs if parametrize.is_parametrized(plist, n))
        unknown = [k is None for k in kinds]
        runs: list = []
        kinds, probed_stateful, stateful_in_eval, random, writes_itself = probe_chain(
            chain, inputs, kinds, computed, runs, _STATELESS_KINDS)
        stateful = stateful or probed_stateful or stateful_in_eval
        # Whether it computes another value with grad enabled: not asked of a chain served at
        # every read already; of a chain that changes its state in training, asked in eval only
        # (in training its value is computed in each call's mode: the read-once class).
        asked = not (random or writes_itself or stateful_in_eval)
        if asked:
            if any(t.requires_grad for t in (*inputs.values(), *own_tensors(chain))):
                runs = plain_runs(chain, unknown, inputs)  # the grad run's clones required grad
            grad_dependent = differ(runs, stateful, lambda: plain_runs(chain, unknown, inputs, (False,)))
        if forward_hooked(plist):
            listed_random, listed_writes = probe_list(plist, frozenset(originals))
            random, writes_itself = random or listed_random, writes_itself or listed_writes
            if asked and not (grad_dependent or random or writes_itself):  # the list's hooks, in its call
                grad_dependent = differ(plain_runs((plist,), [True], {}), stateful,
                                         lambda: plain_runs((plist,), [True], {}, (False,)))
    return Site(
        module_path=path,
        tensor_name=name,
        module=module,
        chain=chain,
        originals=originals,
        kind="+".join(kinds),
        requires_grad=any(t.requires_grad for t in originals.values()),
        stateful=stateful,
        is_buffer=not any(isinstance(t, nn.Parameter) for t in originals.values()),
        random=random,
        stateful_in_eval=stateful_in_eval,
        writes_itself=writes_itself,
        grad_dependent=grad_dependent,
        unprobed=copy_failure(chain, plist) if writes_itself else "",
    )


def runs_hooks(plist: nn.Module) -> bool:
    """Whether stock's call of ``plist`` runs forward hooks or pre-hooks of its own: the list's,
    or a member's (a nested chain's are its own site's)."""
    return forward_hooked(plist) or any(map(forward_hooked, members(plist)))


def probed(module: nn.Module) -> bool:
    """Whether :func:`find` learns what ``module`` does by probing it: a module of a chain that
    is not one of torch's or torchao's known parametrizations, nor a container."""
    return (not isinstance(module, (parametrize.ParametrizationList, nn.ModuleDict))
            and known_kind(module) is None)


def draws_random_numbers(module: nn.Module, name: str, stateful: bool = False, stateful_in_eval: bool = False) -> bool:
    """Whether computing ``module.<name>`` now would draw random numbers: its chain, and the chains
    of its originals that are parametrized themselves, probed as :func:`find` probes them (on
    copies; no generator of the user's moves). A chain that writes its own attributes or its
    originals at each computation counts too: stock repeats that at every read as well. So does
    its own chain changing its buffers where it was prepared as one that does not (``stateful``,
    ``stateful_in_eval``: the verdicts it was prepared with): a flag switched on since, which no
    read-once class or freeze refusal was planned for."""
    site = _make_site("", module, name)
    if site.random or site.writes_itself or site.grad_dependent:
        return True
    if (site.stateful and not stateful) or (site.stateful_in_eval and not stateful_in_eval):
        return True
    plist = module.parametrizations[name]
    return any(draws_random_numbers(plist, n) for n in original_names(plist) if parametrize.is_parametrized(plist, n))


def computed_per_call(site: Site) -> str | None:
    """Why computing ``site``'s tensor now, each module of its chain in its current training
    mode, is no constant of the weights, or None: it changes its buffers in eval mode too, or,
    probed again as :func:`find` probes (on copies, under ``no_grad`` and with grad enabled) but
    in those modes only, it draws random numbers, writes its own state or originals, or computes
    another value with grad enabled. :func:`find`'s ``random``, ``writes_itself`` and
    ``grad_dependent`` hold for training or eval mode: a DropConnect draws in training only.
    What ``paramfold.export`` folds only where nothing says so; hook-based norms are not asked."""
    if site.hook_based:
        return None
    if site.stateful_in_eval:
        return "it changes its buffers, in eval mode too"
    nested = next((why for inner in site.nested for why in (computed_per_call(inner),) if why), None)
    if nested or not (site.random or site.writes_itself or site.grad_dependent):
        return nested
    plist = site.module.parametrizations[site.tensor_name]
    inputs = run_probed(Probe(stop_at_collectives=False), computed_originals, plist) if is_nested(plist) else {
        n: getattr(plist, n) for n in original_names(plist)}
    runs = [run_now(plist, inputs, grad) for grad in (False, True)]
    why = next((run for run in runs if isinstance(run, str)), None)
    if why is not None:
        return why
    (then_outputs, then_ops), (outputs, ops) = runs
    if ops != then_ops or (not all(map(same_bits, outputs, then_outputs)) and all(
            all(map(same_bits, run_now(plist, inputs, False)[0], then_outputs)) for _ in range(REPEATS))):
        # (Values alone differing: only where the no_grad run's bits repeat, as differ asks.)
        return "it computes another value with grad enabled than under no_grad"
    return None


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())