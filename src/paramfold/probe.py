"""Probing a chain: what a parametrization does when it computes its tensor, learnt by running
it on copies.

:func:`~paramfold.sites.find` cannot tell from a custom parametrization's code whether it changes
its buffers (a power iteration), draws random numbers, writes its own attributes or originals,
computes another value with grad enabled, or issues a collective: it runs each member on a deep
copy of itself, with clones of its tensors, under a dispatch mode (:class:`Probe`) that sees every
op and gives drawing ops numbers of its own. Nothing of the model changes and no generator of the
user's moves. The verdicts become :class:`~paramfold.sites.Site`'s flags, which decide how each
site is served.
"""

from __future__ import annotations

import copy
import inspect
import operator
import types
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils import _pytree as pytree
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode

from paramfold.errors import FoldError
from paramfold.compute import members, original_names
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.global_generators import GlobalGenerators, holds_global_generator
from paramfold.held import generator_state, generators, same, snapshot
from paramfold.state import innermost_transform, version_of

T = TypeVar("T")


def copy_failure(chain: tuple[nn.Module, ...], plist: nn.Module) -> str:
    """Why a copy of a member of ``chain`` (or of ``plist``, whose forward hooks are probed on a
    copy of it) cannot be made to probe it, or ``""``: :func:`_probe_call` then counts the member
    as one that writes itself."""
    for module in (*chain, plist):
        try:
            _deepcopy(module)
        except CannotProbeNow:
            raise
        except Exception as e:
            return f"copy.deepcopy of its {type(module).__name__} failed ({type(e).__name__}: {e})"
    return ""


def forward_hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def run_now(plist: nn.Module, inputs: dict[str, torch.Tensor], grad: bool) -> tuple[list, list] | str:
    """``plist``'s members (and the list itself where it has forward hooks) run on copies, each
    in its current training mode, under ``grad``: their ``(outputs, ops)``, or why the
    computation is no constant (:func:`~paramfold.sites.computed_per_call`)."""
    computed = frozenset(n for n in inputs if parametrize.is_parametrized(plist, n))
    modules = (*members(plist), *((plist,) if forward_hooked(plist) else ()))
    fed, runs = _run_plainly(modules, inputs, grad, lists=plist)
    for _, probe in runs:
        if probe.random:
            return "it draws random numbers"
        if probe.writes_itself or probe.mutated:  # (the list's: its originals and members' buffers too)
            return "it changes its own attributes, buffers or originals"
    if any(version_of(t) != v for n, (t, v) in zip(inputs, fed) if n not in computed):
        return "it changes its own attributes, buffers or originals"
    return [out for out, _ in runs], [probe.ops for _, probe in runs]


def _run_plainly(modules: tuple[nn.Module, ...], originals: dict[str, torch.Tensor], grad: bool,
                 training: bool | None = None, lists: nn.Module | None = None) -> tuple[list, list]:
    """``modules`` run in turn on copies (:func:`_probe_call`), under ``grad``, in ``training``
    mode (each its own where None), from clones of ``originals`` and of their own tensors, none
    requiring grad; each is given the previous one's output, but ``lists`` (their
    ``ParametrizationList``, run for its own hooks) is called as stock calls it, with nothing:
    ``([(a clone of an original, its version before the runs)], [(output, probe) per module])``."""
    with torch.inference_mode(False), torch.set_grad_enabled(grad):
        value = tuple(_clone(t, plain=True) for t in originals.values())
        fed = [(t, version_of(t)) for t in value]
        runs = []
        for module in modules:
            listed = module is lists
            args = () if listed else value if isinstance(value, tuple) else (value,)
            _, out, probe = _probe_call(module, args, module.training if training is None else training, plain=True)
            runs.append((out, probe))
            value = value if listed else out
    return fed, runs


class CannotProbeNow(FoldError):
    """A chain cannot be probed now: inside a ``torch.func`` transform, tensors swapped into it
    (``vmap(functional_call(model, stacked))``) are the transform's wrappers, which cannot be
    copied; fake tensors (``FakeTensorMode``) are not copied either. Inside a call, the caller
    computes the value where it is read, as stock does, and probes later; ``find`` and
    ``prepare`` refuse (a model built under ``FakeTensorMode``)."""


def _deepcopy(module: nn.Module) -> nn.Module:
    if any(map(is_fake, module.parameters())) or any(map(is_fake, module.buffers())):
        # torch's deepcopy of some fake tensors fails (a 0-d fake Parameter), and a few failed
        # copies corrupt the process's heap: never tried.
        raise CannotProbeNow(
            f"{type(module).__name__} holds fake tensors (built under FakeTensorMode, as memory "
            "estimators do): paramfold probes a custom parametrization on a copy of it, which "
            "torch cannot make of fake tensors. Prepare the real model, or one built on the meta "
            "device (then to_empty() and load the weights); the model was not changed."
        )
    try:
        return copy.deepcopy(module)
    except Exception:
        if innermost_transform() is not None:
            raise CannotProbeNow(
                f"{type(module).__name__} cannot be copied inside a torch.func transform (its tensors "
                "are the transform's wrappers): prepare the model outside the transform."
            ) from None
        raise


def computed_originals(plist: nn.Module) -> dict[str, torch.Tensor]:
    """The originals of ``plist`` as its chain sees them, a nested one computed on cloned state."""
    values = {}
    with torch.inference_mode(False), torch.no_grad():
        for n in original_names(plist):
            if not parametrize.is_parametrized(plist, n):
                values[n] = getattr(plist, n)
                continue
            inner = _deepcopy(plist.parametrizations[n])  # its calls change nothing of the model's
            _call_without_global_hooks(inner)
            state = {k: v.clone() for k, v in (*inner.named_parameters(), *inner.named_buffers())}
            values[n] = torch.func.functional_call(inner, state, ())
            _call_without_global_hooks(inner, False)
    return values


def probe_chain(
    chain: tuple[nn.Module, ...],
    originals: dict[str, torch.Tensor],
    kinds: list[str | None],
    computed: frozenset[str] = frozenset(),
    runs: list | None = None,
    stateless: frozenset[str] = frozenset(),
) -> tuple[list[str], bool, bool, bool, bool]:
    """Run the chain on cloned state to tell casts from custom maps, find buffer mutation, random
    draws and other writes: ``(kinds, stateful, stateful_in_eval, random, writes_itself)``.
    ``runs`` (a list) is given the outputs and ops of the members of unknown kind, per run:
    ``(outputs, ops)`` in training then eval mode, under ``no_grad`` then with grad enabled
    (:func:`differ`).
    A write to a clone of an original (not to one of the ``computed`` inputs, a nested chain's
    fresh values) counts as the chain writing itself.
    A member of one of the ``stateless`` kinds that changes a clone of its state (a cache) is
    not stateful.

    Each module is called on a copy of itself (:func:`_probe_call`) through
    ``torch.func.functional_call`` with clones of its own parameters and buffers in training mode,
    so the real module never changes, then again in eval mode to see whether it mutates its
    buffers, draws random numbers or writes its attributes there too (its draws come from the
    probe's own generator: see :class:`Probe`). The whole chain is probed under ``no_grad`` and
    again with grad enabled, on clones that require grad where the originals and parameters do:
    a chain may change its state or draw in one grad mode only (``if torch.is_grad_enabled():``),
    and stock runs it in both. Kinds are told from the ``no_grad`` run.
    """
    resolved: list[str] = []
    stateful = stateful_in_eval = random = writes_itself = False
    unknown = [k is None for k in kinds]
    runs = runs if runs is not None else []
    # Outside inference_mode too (a call inside it probes a chain again after its settings
    # changed): the clones must be ordinary tensors, whose version counters show writes.
    for grad in (False, True):
        trained, evaluated = ([], []), ([], [])  # (outputs, ops) of the members found unknown
        runs.extend((trained, evaluated))
        with torch.inference_mode(False), torch.set_grad_enabled(grad):
            # Clones of the originals too: a member (or its pre-hook) may edit its input in place,
            # as stock's then edits the original at every read (a view of it shares its counter).
            value: object = tuple(_clone(t) for t in originals.values())
            inputs = [(t, version_of(t)) for n, t in zip(originals, value) if n not in computed]
            for i, (module, kind) in enumerate(zip(chain, kinds)):
                args = value if isinstance(value, tuple) else (value,)
                state, out, probe = _probe_call(module, args, training=True)
                if unknown[i]:
                    trained[0].append(out), trained[1].append(probe.ops)
                if grad:
                    kind = resolved[i]
                if probe.mutated and kind not in stateless:
                    stateful = True
                if kind is None:
                    collective = probe.collective
                    kind = "communication" if collective else "cast" if not state and _is_cast(args, out) else "custom"
                if not probe.collective:
                    _, in_eval_out, in_eval = _probe_call(module, args, training=False)
                    if unknown[i]:
                        evaluated[0].append(in_eval_out), evaluated[1].append(in_eval.ops)
                    random = random or in_eval.random
                    stateful_in_eval = stateful_in_eval or (in_eval.mutated and kind not in stateless)
                    writes_itself = writes_itself or in_eval.writes_itself
                elif grad:  # issued only with grad enabled: left stock, as one issued in both modes
                    resolved[i] = "communication"
                random = random or probe.random
                writes_itself = writes_itself or probe.writes_itself
                if not grad:
                    resolved.append(kind)
                value = out
            writes_itself = writes_itself or any(version_of(t) != v for t, v in inputs)
    return resolved, stateful, stateful_in_eval, random, writes_itself


def probe_list(plist: nn.Module, originals: frozenset[str]) -> tuple[bool, bool]:
    """``(random, writes_itself)`` of stock's call of the whole ``plist`` (members and originals
    included), as :func:`probe_chain` probes each member: in training and eval mode, with and
    without grad. For the list's own hooks, which :func:`probe_chain` does not run: an original
    (``originals``: their keys in ``plist``) edited in place counts as a write of its own, a
    member's buffers as they are for the member."""
    random = writes_itself = False
    for grad in (False, True):
        with torch.inference_mode(False), torch.set_grad_enabled(grad):
            for training in (True, False):
                _, _, probe = _probe_call(plist, (), training)
                random = random or probe.random
                writes_itself = writes_itself or probe.writes_itself or not probe.changed.isdisjoint(originals)
    return random, writes_itself


def plain_runs(chain: tuple[nn.Module, ...], unknown: list[bool], originals: dict[str, torch.Tensor],
                grads: tuple[bool, ...] = (False, True)) -> list:
    """The chain run under each of ``grads`` (``no_grad``, then grad enabled), in training then
    eval mode, from clones of ``originals`` and of the members' own tensors, none requiring grad
    (where one does, a value for a grad call is not frozen, and the chain is computed under the
    call's grad mode): ``(outputs, ops)`` of the members ``unknown`` says, per run (:func:`differ`)."""
    runs = []
    for grad in grads:
        for training in (True, False):
            _, each = _run_plainly(chain, originals, grad, training)
            ran = [run for run, probed_here in zip(each, unknown) if probed_here]
            runs.append(([out for out, _ in ran], [probe.ops for _, probe in ran]))
    return runs


def differ(runs: list, eval_only: bool = False, again: Callable[[], list] | None = None) -> bool:
    """Whether a custom member computes another value, or runs other ops, with grad enabled than
    under ``no_grad``: the runs with grad enabled (the last two of ``runs``: training, eval)
    against the ``no_grad`` ones (the first two); in eval mode only where ``eval_only``. A member
    that raised (its output None) in either is not compared. Where only values differ, ``again``
    (the ``no_grad`` runs made anew) tells a member whose bits change from run to run in one mode
    (a nondeterministic kernel: ``torch.linalg.lstsq``) from one that asks the grad mode."""
    if len(runs) != 4:
        return False
    pairs = [1] if eval_only else [0, 1]
    values = False
    for i in pairs:
        (outputs, ops), (then_outputs, then_ops) = runs[2 + i], runs[i]
        if len(outputs) != len(then_outputs):
            return False
        for out, then, op, then_op in zip(outputs, then_outputs, ops, then_ops):
            if out is None or then is None:
                return False
            if op != then_op:
                return True
            values = values or not same_bits(out, then)
    if not values or again is None:
        return values
    for _ in range(REPEATS):
        repeated = again()
        if not all(len(repeated[i][0]) == len(runs[i][0]) and all(map(same_bits, repeated[i][0], runs[i][0]))
                   for i in pairs):
            return False  # its bits change in one mode: what they are in the other tells nothing
    return True


#: How many times :func:`differ` runs a chain again under ``no_grad`` to see its bits change.
REPEATS = 3


def own_tensors(chain: tuple[nn.Module, ...]) -> list[torch.Tensor]:
    """The parameters and buffers of the chain's members (copied into each probe as clones)."""
    return [t for m in chain for t in (*m.parameters(), *m.buffers())]


def same_bits(a: object, b: object) -> bool:
    """Whether ``a`` and ``b`` hold tensors in the same places, equal bit for bit (NaNs and -0.0
    included) as far as their values can be read (not on the meta device)."""
    leaves, others = pytree.tree_leaves(a), pytree.tree_leaves(b)
    if len(leaves) != len(others):
        return False
    for x, y in zip(leaves, others):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                return False
            continue
        if type(x) is not type(y) or x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.is_meta or y.is_meta:  # no values (a model built on the meta device): the ops tell
            continue
        try:
            with torch.no_grad():
                same = torch.equal(x.detach().reshape(-1).contiguous().view(torch.uint8),
                                   y.detach().reshape(-1).contiguous().view(torch.uint8))
        except Exception:  # no bytes to view (a wrapper subclass): its own equality, where it has one
            try:
                same = bool(torch.equal(x, y))
            except Exception:
                continue
        if not same:
            return False
    return True


def _clone(t: torch.Tensor, plain: bool = False) -> torch.Tensor:
    """A copy of ``t`` without history (a leaf, as originals are), requiring grad where ``t``
    does and grad is enabled."""
    try:
        with torch.no_grad():
            c = t.clone()
    except Exception:  # a tensor subclass without clone: probed as it is, as before
        return t
    if t.requires_grad and torch.is_grad_enabled() and not plain:
        try:
            return c.requires_grad_()
        except RuntimeError:  # inside a torch.func transform (a probe again after a settings change)
            pass
    return c


def _probe_call(module: nn.Module, args: tuple, training: bool, plain: bool = False) -> tuple[dict, object, Probe]:
    """``module(*args)`` on a copy of it, with clones of its own parameters and buffers (none
    requiring grad where ``plain``), in the
    given mode: ``(the clones, the output or None where it raised, what the probe saw)``. The
    module itself is never called: a call may change its Python attributes (a step counter) or
    tensors it holds outside its parameters and buffers."""
    probe = Probe()
    probe.random = holds_global_generator(module)  # its copy would hold a copy
    try:
        module = _deepcopy(module)
    except CannotProbeNow:
        raise
    except Exception:  # cannot be probed without changing it: served as if it wrote itself
        probe.writes_itself = True
        return {}, None, probe
    _call_without_global_hooks(module)
    state = {
        **{k: _clone(v, plain) for k, v in module.named_parameters()},
        **{k: _clone(v, plain) for k, v in module.named_buffers()},
    }
    versions = {k: v._version for k, v in state.items()}
    module.train(training)
    attributes = [(vars(m), dict(vars(m))) for m in module.modules()]
    tensors = [(t, t._version) for _, then in attributes for t in then.values() if isinstance(t, torch.Tensor)]
    holdings = list(map(snapshot, module.modules()))  # a list it appends to, ...
    # A random.Random or NumPy generator a member holds (its copy's): a draw moves its state.
    rngs = [(g, generator_state(g)) for m in module.modules() for g in generators(m)]
    try:
        out = run_probed(probe, torch.func.functional_call, module, state, args)
    except _Collective:
        out, probe.collective = None, True
    except Exception:  # a probe must never break find(); unknown stays "custom"
        out = None
    probe.random = probe.random or any(generator_state(g) != then for g, then in rngs)
    probe.changed = frozenset(k for k, v in versions.items() if state[k]._version != v)
    probe.mutated = bool(probe.changed)
    probe.writes_itself = any(now.keys() != then.keys() or not all(map(operator.is_, now.values(), then.values()))
                              for now, then in attributes) or any(t._version != v for t, v in tensors)
    probe.writes_itself = probe.writes_itself or not all(map(same, holdings))
    _call_without_global_hooks(module, False)
    return state, out, probe


def _torch_call_impl_without_global_hooks() -> types.FunctionType | None:
    """torch's ``nn.Module._call_impl``, the same code, seeing the global module hook dicts empty
    (None where this torch's is not a function that reads them)."""
    impl = nn.Module._call_impl
    names = {f"_global_{kind}_hooks" for kind in ("forward", "forward_pre", "backward", "backward_pre")}
    if not isinstance(impl, types.FunctionType) or not names <= set(impl.__code__.co_names) or impl.__closure__:
        return None
    scope = {**impl.__globals__, **{name: {} for name in names}}
    return types.FunctionType(impl.__code__, scope, impl.__name__, impl.__defaults__)


_CALL_WITHOUT_GLOBAL_HOOKS = _torch_call_impl_without_global_hooks()


def _call_without_global_hooks(copied: nn.Module, on: bool = True) -> None:
    """Have the modules of a probe's copy called without global module hooks: those are the
    user's, to run on the model's own modules (a counter, an activation list, a profiler would
    see calls of modules that are not in the model). What they do at a prepared read is stock's
    anyway: while one is registered, a value not frozen is computed where it is read
    (:mod:`paramfold.site_values`), and a frozen one refused or computed there where it draws
    (:mod:`paramfold.freeze`). Only modules whose class calls like ``nn.Module``. ``on=False``
    takes it off again (the bound call refers to its module: a cycle, which would keep the copy's
    clones until the garbage collector runs)."""
    if _CALL_WITHOUT_GLOBAL_HOOKS is None:
        return
    for m in copied.modules():
        if not on:
            if getattr(vars(m).get("_call_impl"), "__func__", None) is _CALL_WITHOUT_GLOBAL_HOOKS:
                del vars(m)["_call_impl"]
        elif "_call_impl" not in vars(m) and inspect.getattr_static(type(m), "_call_impl") is nn.Module._call_impl:
            vars(m)["_call_impl"] = types.MethodType(_CALL_WITHOUT_GLOBAL_HOOKS, m)


@torch.compiler.disable  # the stance is set outside any compiled region
def run_probed(probe: Probe, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` under ``probe``, with every ``torch.compile``'d function in it run as plain
    Python (the global ``force_eager`` stance, for the probe's duration) so that the probe sees
    each op. Dynamo does not compile a frame it meets under a dispatch mode, and marks the frame's
    code to be skipped for good: a member compiled with ``member.compile()`` would have run
    eagerly from then on, in every model of the process.

    Python's global ``random`` and NumPy's global ``np.random`` cannot be kept from drawing as
    torch's generators are (no dispatch mode sees them), nor any global generator from being
    seeded (``torch.manual_seed`` is no op): a draw from them, or a seed or state set of any,
    counts as the chain drawing random numbers (stock's read reseeds at every computation, and
    later draws in the forward repeat), and what was used is put back
    (:class:`~paramfold.global_generators.GlobalGenerators`)."""
    generators = GlobalGenerators()
    try:
        with torch.compiler.set_stance("force_eager"), probe:
            return fn(*args)
    finally:
        if generators.moved():
            probe.random = True


class _Collective(Exception):
    pass


#: The arguments of an op a probe records with it (:attr:`Probe.ops`), by their ``repr``.
_PLAIN_ARGUMENTS = (bool, int, float, complex, str, torch.dtype, torch.device, torch.memory_format, torch.layout)


#: Arguments that switch a drawing op's draw off, with the value that does: attention with no
#: dropout, and dropout, RReLU and the RNNs outside training. None of their kernels reads a
#: generator then (torch 2.13: CPU checked by the generator's state; CUDA's flash and efficient
#: attention take a philox state only for ``dropout_p > 0``). ``native_dropout`` with ``p=0`` in
#: training does draw (``bernoulli_(1.0)``), so ``p`` is not among them.
_DRAW_OFF = {"dropout_p": 0.0, "train": False, "training": False}


def draws(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """Whether an op about to run draws random numbers: tagged ``nondeterministic_seeded``
    (dropout, ``bernoulli``, ``randn_like``, ...), unless an argument switches its draw off
    (``scaled_dot_product_attention`` with ``dropout_p=0``, ``native_dropout`` with
    ``train=False``): such an op runs as any other, where taking it as drawing would have its
    chain computed at every read (auto) or refused (freeze, export)."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    for i, argument in enumerate(func._schema.arguments):
        if argument.name in _DRAW_OFF:
            value = args[i] if i < len(args) else kwargs.get(argument.name, argument.default_value)
            off = _DRAW_OFF[argument.name]
            if type(value) is type(off) and value == off:
                return False
    return True


class Probe(TorchDispatchMode):
    """What a probe's ops do: it is stopped at its first collective, before it is issued (on
    one rank it would hang), and notes whether it draws random numbers (:func:`draws`: dropout,
    ``bernoulli``, ``randn_like``, ...).

    A drawing op is not run: its results (and the tensors it writes) get numbers from the
    probe's own generator, shaped as the op's meta kernel says. No torch generator of the user's
    (the shared CPU or device ones, a chain's own) moves, so nothing has to be put back, and
    another thread's draws meanwhile are its own (a state put back afterwards would rewind them).
    Python's and NumPy's generators are not torch ops: see :func:`run_probed`.
    """

    def __init__(self, stop_at_collectives: bool = True) -> None:
        super().__init__()
        self._stop_at_collectives = stop_at_collectives
        self.collective = False
        self.random = False
        #: Set by :func:`_probe_call`: whether the call changed a clone of the module's own state,
        #: and whether it changed anything else of the module's (an attribute set, a tensor
        #: attribute that is not a buffer edited in place).
        self.mutated = False
        self.changed: frozenset[str] = frozenset()  # the keys of the clones it changed
        self.writes_itself = False
        self.ops: list = []  # every op it saw, in order, with its plain arguments
        self._generator = torch.Generator().manual_seed(0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # with its plain arguments: a branch may change only a constant (``w * 2.0``)
        self.ops.append((func, *(repr(a) for a in args if a is None or isinstance(a, _PLAIN_ARGUMENTS)),
                         *(f"{k}={v!r}" for k, v in (kwargs or {}).items() if v is None or isinstance(v, _PLAIN_ARGUMENTS))))
        collective = func.namespace in ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
        if collective and self._stop_at_collectives:
            raise _Collective(func.name())
        kwargs = kwargs or {}
        if draws(func, args, kwargs):
            self.random = True
            return self._draw_privately(func, args, kwargs)
        return func(*args, **kwargs)

    def _draw_privately(self, func, args: tuple, kwargs: dict):
        schema = func._schema
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        device = kwargs.get("device") or (tensors[0].device if tensors else torch.get_default_device())
        meta_args, meta_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        if "device" in kwargs:
            meta_kwargs["device"] = "meta"
        shapes = func(*meta_args, **meta_kwargs)  # raises where there is no meta kernel: unprobed
        bound = dict(zip((a.name for a in schema.arguments), args)) | kwargs
        written = {}
        for argument in schema.arguments:
            if argument.alias_info is not None and argument.alias_info.is_write:
                target = bound.get(argument.name)
                if isinstance(target, torch.Tensor):
                    target.copy_(self._numbers(target, target.device))
                written[frozenset(argument.alias_info.before_set)] = target
        results = shapes if isinstance(shapes, tuple) else (shapes,)
        out = []
        for returned, shape in zip(schema.returns, results):
            alias = returned.alias_info
            if alias is not None and frozenset(alias.before_set) in written:
                out.append(written[frozenset(alias.before_set)])
            else:
                out.append(self._numbers(shape, device) if isinstance(shape, torch.Tensor) else shape)
        return tuple(out) if isinstance(shapes, tuple) else out[0]

    def _numbers(self, like: torch.Tensor, device) -> torch.Tensor:
        """A tensor shaped, strided and typed as ``like``: the probe's own random numbers, or
        zeros for integers and booleans (drawn indices, ``randperm``'s, ``multinomial``'s, must
        stay valid for whatever the chain indexes with them)."""
        out = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=device)
        if not (like.dtype.is_floating_point or like.dtype.is_complex):
            return out.zero_()
        return out.copy_(torch.rand(like.shape, generator=self._generator))


def _is_cast(args: tuple, out: object) -> bool:
    if len(args) != 1 or not isinstance(out, torch.Tensor) or type(out) is not torch.Tensor:
        return False
    (x,) = args
    if not isinstance(x, torch.Tensor) or out.dtype == x.dtype or out.shape != x.shape:
        return False
    expected = x.to(out.dtype)
    if out.is_floating_point() or out.is_complex():
        return torch.allclose(out, expected, rtol=0, atol=0, equal_nan=True)  # NaNs cast to NaNs
    return torch.equal(out, expected)


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
