"""How a parametrized tensor's value is computed: the one stock-equivalent computation every mode uses.

Stock ``parametrize`` reads ``module.weight`` through a per-instance property, the
``ParametrizationList`` module call, ``ModuleList.__getitem__`` and a ``hasattr`` loop.
:func:`compute` goes straight from the ``_modules`` and ``_parameters`` dicts to the
parametrization modules: the same module calls in the same order (so the same ops, bitwise),
with far less Python for dynamo to trace. hoist calls it before compiled code runs, freeze
under ``no_grad`` when its inputs change, and the descriptors of :mod:`paramfold.site_reads` and
:mod:`paramfold.inline` wherever a value is read outside a call scope.

An original may itself be parametrized (a parametrization registered on
``m.parametrizations.weight.original``, which stock supports): reading it through the
``ParametrizationList``'s own property computes the inner chain first, as stock does.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable
from operator import attrgetter, call, itemgetter
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary
from torch import nn
from torch.ao.quantization.fake_quantize import FakeQuantizeBase
from torch.ao.quantization.observer import ObserverBase
from torch.nn.modules import module as _module_globals
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.utils import parametrize
from torch.utils._device import DeviceContext

from paramfold.frames import run_module_eagerly_as_frames


def original_names(plist: nn.Module) -> list[str]:
    """``["original"]``, or ``["original0", ...]`` when ``right_inverse`` returned several tensors."""
    return ["original"] if plist.is_tensor else [f"original{i}" for i in range(plist.ntensors)]


def members(plist: nn.Module) -> tuple[nn.Module, ...]:
    """The parametrizations of a ``ParametrizationList``, in the order stock applies them.

    Stock indexes them ``"0"``, ``"1"``, ...; a nested parametrization adds a ``parametrizations``
    ModuleDict to the list's ``_modules``, which is not a member.
    """
    found = []
    modules = plist._modules
    while str(len(found)) in modules:
        found.append(modules[str(len(found))])
    return tuple(found)


def is_nested(plist: nn.Module) -> bool:
    """Whether an original of ``plist`` is itself parametrized."""
    return has_parametrizations(plist)


def has_parametrizations(module: nn.Module) -> bool:
    """Whether ``module`` itself is parametrized: its own ``parametrizations`` ModuleDict.

    torch's ``parametrize.is_parametrized`` reads the attribute, so it also says True of a wrapper
    that forwards unknown attributes to the module it wraps (PEFT's ``ModulesToSaveWrapper``,
    ``torch.compile(layer)``'s ``OptimizedModule``): the wrapped module is the parametrized one.
    """
    return isinstance(module.__dict__.get("_modules", {}).get("parametrizations"), nn.ModuleDict)


def parametrized_here(module: nn.Module, name: str) -> bool:
    """Whether ``module`` is (still) parametrized for ``name`` (a cheaper ``is_parametrized``)."""
    plists = module._modules.get("parametrizations")
    return plists is not None and name in plists._modules


def leaf_originals(plist: nn.Module) -> list[tuple[str, dict, str]]:
    """``(path, dict, key)`` of every tensor the originals of ``plist`` are stored in.

    ``path`` is relative to ``plist`` (``"original0"``, or
    ``"parametrizations.original.original"`` for a nested original); ``dict[key]`` is the tensor,
    looked up through its ``_parameters``/``_buffers`` dict so that reads see replacements.
    """
    found = []
    for name in original_names(plist):
        if parametrize.is_parametrized(plist, name):
            inner = plist._modules["parametrizations"]._modules[name]
            found += [(f"parametrizations.{name}.{p}", d, k) for p, d, k in leaf_originals(inner)]
        else:
            found.append((name, plist._parameters if name in plist._parameters else plist._buffers, name))
    return found


def compute(module: nn.Module, name: str) -> torch.Tensor:
    """Evaluate the parametrization chain of ``module.<name>`` like stock, minus the plumbing.

    Stock calls the ``ParametrizationList`` as a module; so does this where that call would run
    hooks (the list's own, or global ones) or is more than ``ParametrizationList.forward``
    (:func:`calls_its_forward`: a subclass, a patched ``nn.Module.__call__`` such as
    ``torch.fx``'s tracer's): otherwise it is just the members' calls below.
    """
    plist = module._modules["parametrizations"]._modules[name]
    # has_own_hooks(plist), written out: this runs for every site a call computes. Traced by
    # dynamo (a value computed in-graph) the list's call is not checked: dynamo cannot trace the
    # check, and tracing it in plain Python would cost every such read (a documented limit).
    if (plist._forward_hooks or plist._forward_pre_hooks or plist._backward_hooks or plist._backward_pre_hooks
            or any(GLOBAL_HOOKS) or (not (torch.compiler.is_compiling() and compiling_here())
                                     and not calls_its_forward(plist))):
        return plist()
    modules = plist._modules
    if "parametrizations" in modules:  # nested: the list's own properties compute the originals
        originals = [getattr(plist, n) for n in original_names(plist)]
    else:
        params, buffers = plist._parameters, plist._buffers
        originals = [params[n] if n in params else buffers[n] for n in original_names(plist)]
    value = modules["0"](*originals)
    index = 1
    while (key := str(index)) in modules:
        value = modules[key](value)
        index += 1
    return value


class InPlaceEdit(NamedTuple):
    """A torch module class whose ``forward`` edits some of the module's own tensors in place:
    ``names``, in a call of an instance of ``classes`` where ``when`` says so, given the module's
    attributes ``reads`` (the steady plan, :mod:`paramfold.scope_plan`, pins them)."""

    classes: type | tuple[type, ...]
    names: frozenset[str]
    reads: tuple[str, ...]
    when: Callable[..., bool]


def _always() -> bool:
    return True


#: Every torch module class (subclasses included) whose ``forward`` edits a tensor of its own in
#: place (:func:`edits_in_place`). A condition read from a tensor's contents is left out, so the
#: entry holds at every call (reading one would cost a device sync per call).
IN_PLACE_EDITS = (
    # F.embedding and F.embedding_bag renormalise the looked-up rows of the weight they are given
    # (torch.embedding_renorm_), which a tied head reads after the lookup.
    InPlaceEdit((nn.Embedding, nn.EmbeddingBag), frozenset({"weight"}), ("max_norm",),
                lambda max_norm: max_norm is not None),
    # num_batches_tracked.add_(1), then read again for the momentum=None averaging factor;
    # F.batch_norm (and SyncBatchNorm's sync) updates the running statistics it is given.
    InPlaceEdit(_BatchNorm, frozenset({"running_mean", "running_var", "num_batches_tracked"}),
                ("training", "track_running_stats"), lambda training, track: training and track),
    # F.instance_norm copies the updated running statistics into the ones it is given where it
    # uses the input's statistics.
    InPlaceEdit(_InstanceNorm, frozenset({"running_mean", "running_var"}), ("training", "track_running_stats"),
                lambda training, track: training or not track),
    # FakeQuantize copies its observer's qparams into scale and zero_point (observer_enabled[0] == 1),
    # then reads them to fake-quantize; FusedMovingAvgObsFakeQuantize's fused op writes them (same
    # flag); _LearnableFakeQuantize writes their .data (copy_, or clamp_ with static_enabled off).
    InPlaceEdit(FakeQuantizeBase, frozenset({"scale", "zero_point"}), (), _always),
    # Observers copy the statistics they keep at every non-empty input (FakeQuantize's
    # calculate_qparams reads min_val and max_val again in the same call; FusedMovingAvgObsFakeQuantize's
    # fused op writes its observer's): the MinMax and MovingAverage ones, per channel too, min_val
    # and max_val; HistogramObserver histogram too; ModelReportObserver its own statistics.
    InPlaceEdit(ObserverBase, frozenset({"min_val", "max_val", "histogram", "epoch_activation_min",
                                         "epoch_activation_max", "percentile_batches_tracked",
                                         "average_percentile_ratio", "constant_channels"}), (), _always),
)


def edits_in_place(module: nn.Module, name: str) -> bool:
    """Whether a call of ``module`` edits its tensor ``name`` in place now (:data:`IN_PLACE_EDITS`).

    Stock computes a fresh tensor at every read, so the edit is lost: a later read in the same
    call (BatchNorm's ``float(self.num_batches_tracked)`` after its ``add_(1)``, a tied head's
    ``self.emb.weight`` after a ``max_norm`` lookup, the module's next call) sees the value
    unedited. A value served once per call would show the edit; such a site is computed where it
    is read, as stock.
    """
    return any(name in edit.names and isinstance(module, edit.classes)
               and edit.when(*(getattr(module, key, None) for key in edit.reads)) for edit in IN_PLACE_EDITS)


def compiling() -> bool:
    """``torch.compiler.is_compiling()`` for this thread: whether the code asking is being traced
    (dynamo folds ``is_compiling()`` to True there) or runs inside this thread's own compile or
    export. Read in eager code, ``is_compiling()`` alone is process-wide (a flag set for any
    thread's compile session): a call of a prepared model made while another thread compiles
    would take itself for traced, open no call scope and read that thread's values as they are."""
    return torch.compiler.is_compiling() and compiling_here()


@torch.compiler.assume_constant_result  # traced: True, folded (dynamo traces it in this thread's compile)
def compiling_here() -> bool:
    """Whether this thread is in a compile session or an export (asked only where
    ``torch.compiler.is_compiling()`` is True: written ``is_compiling() and compiling_here()`` on
    paths where :func:`compiling`'s own frame would cost every eager call)."""
    guards = torch._guards
    return (guards.CompileContext.try_get() is not None or guards.TracingContext.try_get() is not None
            or torch.compiler.is_exporting())


def inspected_by_dynamo() -> bool:
    """Whether this code runs for real inside dynamo's compile of a frame on this thread, called
    by dynamo itself rather than traced: the guards of a traced ``hasattr(module, name)`` or
    ``getattr(module, name, default)`` evaluate both on the real module while they are built.
    Traced, ``is_dynamo_compiling()`` is True; a non-strict export, which runs the model's code
    for real, opens no ``CompileContext``. (``torch.compiler.is_compiling()`` tells neither: recent
    torch, 2.13 among them, holds it True for real code during a compile; older torch left it False.)"""
    return not torch.compiler.is_dynamo_compiling() and torch._guards.CompileContext.try_get() is not None


def cache_key(module: nn.Module, name: str) -> tuple[int, str]:
    """The key of ``module.<name>`` in ``parametrize.cached()``'s cache, as stock's property makes
    it: the id of the module it was registered on (its getter's closure), whatever object the
    getter was reached through. Non-strict ``torch.export`` calls a module the model holds at
    several paths (a shared layer) through a proxy per path, which shares the module's
    ``__dict__`` (torch.fx's ``_AttrProxy``): the module behind it."""
    proxies = sys.modules.get("torch.fx.experimental.proxy_tensor")
    if proxies is not None and isinstance(module, proxies._AttrProxy):
        module = module.get_base()
    return id(module), name


def eager_value(module: nn.Module, name: str) -> torch.Tensor:
    """:func:`compute`, honouring ``parametrize.cached()`` exactly like stock's property."""
    if not parametrize._cache_enabled:
        return compute(module, name)
    key = cache_key(module, name)
    value = parametrize._cache.get(key)
    if value is None:
        value = parametrize._cache[key] = compute(module, name)
    return value


def read_without_grad(value: torch.Tensor) -> torch.Tensor:
    """``value`` as stock's read computes it under ``no_grad``, holding no base: the same bits
    without a history, a leaf that requires grad where ``value`` is a view of one (``w.T`` or
    ``w[:]`` of an original that requires grad: torch makes a view so under ``no_grad``), and
    ``value`` itself where it is a leaf already (the original, as an identity chain returns it).

    >>> w = torch.nn.Parameter(torch.ones(2, 3))
    >>> read_without_grad(w.T * 1).requires_grad, read_without_grad(w.T).requires_grad
    (False, True)
    >>> read_without_grad(w) is w
    True
    """
    base = value._base
    if base is None and value.grad_fn is None:
        return value
    return value.detach().requires_grad_(base is not None and base.is_leaf and base.requires_grad)


#: The hook dicts ``nn.Module._call_impl`` reads from a module's ``__dict__``.
HOOK_DICTS = ("_backward_hooks", "_backward_pre_hooks", "_forward_hooks", "_forward_pre_hooks")
#: Those dicts of a module's ``__dict__`` (``hook_dicts(vars(module))``).
hook_dicts = itemgetter(*HOOK_DICTS)
#: What a module's call resolves through its class (read live, so a class patched later is seen).
call_path = attrgetter("__call__", "_wrapped_call_impl", "_call_impl", "forward", "__getattribute__",
                       "_compiled_call_impl")


def _torchs(fn: object, name: str) -> bool:
    """Whether ``fn`` is ``nn.Module``'s own method ``name`` as torch defines it, not a wrapper
    patched over it (a profiler's, ``torch.fx``'s tracer's), even one patched before paramfold
    was imported."""
    return (isinstance(fn, types.FunctionType) and fn.__globals__ is _module_globals.__dict__
            and fn.__code__.co_name == name)


def _calls_like_torch(path: tuple) -> bool:
    """Whether a class's :data:`call_path` is torch's own ``nn.Module`` call, attribute lookup
    and no compiled call on the class."""
    return (_torchs(path[0], "_wrapped_call_impl") and _torchs(path[1], "_wrapped_call_impl")
            and _torchs(path[2], "_call_impl") and path[4] is object.__getattribute__ and path[5] is None)


_PList = parametrize.ParametrizationList
#: ``ParametrizationList``'s call path where it is torch's own, else None (then every list is
#: called as a module, as stock calls it).
_LIST_PATH = call_path(_PList) if (
    _calls_like_torch(call_path(_PList)) and isinstance(_PList.__dict__.get("forward"), types.FunctionType)
    and _PList.forward.__globals__ is parametrize.__dict__) else None


def _through_fx(path: tuple) -> tuple:
    """``path`` (a :data:`call_path`) with torch.fx's tracer wrapper of ``nn.Module.__call__``
    replaced by the function it wraps. The tracer patches ``nn.Module.__call__`` for every thread
    while it traces (AOTAutograd's first compile in any thread), so a call in another thread
    meanwhile runs through it; for make_fx's tracer that is the wrapped call itself."""
    call = path[0]
    wrapped = getattr(call, "__wrapped__", None)
    if (wrapped is None or not isinstance(call, types.FunctionType) or call.__code__.co_name != "module_call_wrapper"
            or call.__globals__.get("__name__") != "torch.fx._symbolic_trace"):  # (functools.wraps copied the rest)
        return path
    return (wrapped, *path[1:])


def calls_its_forward(plist: nn.Module, through_fx: bool = False, shadowed: bool = True) -> bool:
    """Whether stock's call of ``plist``, hooks aside, is exactly ``ParametrizationList.forward``
    (its members called in turn on the originals as stored), so that calling the members is the
    same: no subclass or patch changed its call or ``forward``, none is set on the instance, and
    no entry of its own ``__dict__`` shadows an original (the forward's ``self.original`` finds
    that first, where :func:`compute` reads ``_parameters``). Cheap: it runs per computed value.
    ``through_fx``: torch.fx's tracer's patch of the call is taken for torch's own (:func:`_through_fx`);
    ``shadowed=False``: an original shadowed in its ``__dict__`` is not asked about."""
    own = plist.__dict__
    path = call_path(type(plist))
    return ((path if not through_fx else _through_fx(path)) == _LIST_PATH and "forward" not in own
            and "_call_impl" not in own and own.get("_compiled_call_impl") is None
            and (not shadowed or own.keys().isdisjoint(original_names(plist))))


def class_forward(cls: type, through_fx: bool = False) -> types.FunctionType | None:
    """The function a call of a ``cls`` instance with no hooks runs, where that call is exactly
    ``cls.forward(module, *args)``: ``cls`` calls like ``nn.Module`` (its ``__call__`` and
    ``_call_impl`` are torch's, attribute lookup is object's, no class shadows the hook dicts)
    and its ``forward`` is a plain function found along the MRO (not a ``staticmethod`` or
    ``classmethod``). ``None`` otherwise: the module must be called, as stock calls it.
    ``through_fx``: as :func:`calls_its_forward`'s."""
    path = call_path(cls)
    if not _calls_like_torch(path if not through_fx else _through_fx(path)):
        return None
    if any(name in vars(c) for c in cls.__mro__ for name in HOOK_DICTS):
        return None
    forward = inspect.getattr_static(cls, "forward", None)
    return forward if isinstance(forward, types.FunctionType) else None


def direct_forward(module: nn.Module, through_fx: bool = False) -> types.FunctionType | None:
    """:func:`class_forward` of ``module``'s class where calling ``module`` now is exactly calling
    it but for global hooks (``any(GLOBAL_HOOKS)``, the caller's to check): no hooks of its own,
    and no ``forward``, ``_call_impl`` or compiled call (``module.compile()``) set on the instance.
    ``through_fx``: as :func:`calls_its_forward`'s."""
    return None if overrides_its_call(module) else class_forward(type(module), through_fx)


def overrides_its_call(module: nn.Module) -> bool:
    """Whether something set on ``module`` itself makes its call more than its class's: a hook of
    its own, a ``forward`` or ``_call_impl`` in its ``__dict__`` (:func:`sets_its_own_forward`),
    or a compiled call (``module.compile()``)."""
    return (has_own_hooks(module) or sets_its_own_forward(module)
            or vars(module).get("_compiled_call_impl") is not None)


#: The keys of a module's ``__dict__`` whose values ``nn.Module``'s call runs instead of its class's.
OWN_FORWARD_KEYS = ("forward", "_call_impl")


def sets_its_own_forward(module: nn.Module) -> bool:
    """Whether a call of ``module`` runs, instead of its class's ``forward``, a ``forward`` or
    ``_call_impl`` set on the instance (``m.forward = torch.autocast(...)(m.forward)``,
    Accelerate's mixed-precision wrapper and hooks, ``torch.compiler.disable(m.forward)``)."""
    own = vars(module)
    return "forward" in own or "_call_impl" in own


def wraps_its_forward(module: nn.Module) -> bool:
    """Whether a call of ``module`` may run something between ``nn.Module``'s call and its class's
    own ``forward`` that changes what a tensor the forward reads is computed under (an autocast
    region, a grad mode) or from: a ``forward`` or ``_call_impl`` set on the instance
    (:func:`sets_its_own_forward`), or a ``forward`` of its class or a base that wraps another
    function (``__wrapped__``, as ``@torch.autocast(...)``, ``@torch.amp.custom_fwd``,
    ``@torch.enable_grad()`` and ``functools.wraps`` leave) or is no plain function. paramfold's
    own classes are passed over: their forwards (the read-once class's, a torch-defined root's)
    enter no region."""
    if sets_its_own_forward(module):
        return True
    for cls in type(module).__mro__:
        own = vars(cls)
        forward = own.get("forward")
        if forward is not None and not own.get("_paramfold_sealed") and (
                not isinstance(forward, types.FunctionType) or hasattr(forward, "__wrapped__")):
            return True
    return False


def has_own_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward or backward hooks of its own (not global ones)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


#: torch's dicts of global module hooks (``register_module_forward_hook`` and friends): any of
#: them non-empty (``any(GLOBAL_HOOKS)``) means every module call runs hooks.
GLOBAL_HOOKS = (
    _module_globals._global_forward_hooks, _module_globals._global_forward_pre_hooks,
    _module_globals._global_backward_hooks, _module_globals._global_backward_pre_hooks,
)


def _autocast_devices() -> tuple[str, ...]:
    found = []
    for device_type in ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "privateuseone"):
        try:
            torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
        except Exception:  # a device type this torch has no autocast for
            continue
        found.append(device_type)
    return tuple(found)


_AUTOCAST_DEVICES = _autocast_devices()
#: Whether autocast is on for any device type (one C call).
any_autocast = torch._C._is_any_autocast_enabled


def autocast_state() -> tuple | None:
    """The autocast state a value computed now is computed under: None where autocast is off
    for every device type, else ``(enabled, dtype)`` per device type. Stock computes a value
    where it is read, so under that read's state (``torch.autocast`` casts a chain's matmuls)."""
    if not any_autocast():
        return None
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES)


def _numerics_getters() -> tuple:
    """Zero-argument readers of torch's process-wide settings that decide how an op computes (which
    kernel, in which precision), each where this torch has it."""
    C = torch._C
    # torch's C readers where it has them: no Python frame at each call.
    found = [torch.get_default_dtype, getattr(C, "_get_float32_matmul_precision", torch.get_float32_matmul_precision),
             torch.get_num_threads, getattr(C, "_get_deterministic_algorithms", torch.are_deterministic_algorithms_enabled)]
    names = ["_get_mkldnn_enabled", "_get_mkldnn_deterministic"]
    pairs = [("generic", "all"), ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn")]
    if torch.backends.cuda.is_built():  # without CUDA, its settings decide nothing
        names += ["_get_cublas_allow_tf32", "_get_cudnn_allow_tf32", "_get_cudnn_enabled", "_get_cudnn_benchmark",
                  "_get_cudnn_deterministic", "_get_cublas_allow_fp16_reduced_precision_reduction",
                  "_get_cublas_allow_bf16_reduced_precision_reduction", "_get_cublas_allow_fp16_accumulation",
                  "_get_blas_preferred_backend", "_get_linalg_preferred_backend"]
        pairs += [("cuda", "matmul"), ("cudnn", "conv"), ("cudnn", "rnn")]
    for name in names:
        getter = getattr(C, name, None)
        if getter is not None:
            found.append(getter)
    precision = getattr(C, "_get_fp32_precision_getter", None)
    if precision is not None:  # torch >= 2.9: per backend and op (``torch.backends.mkldnn.matmul.fp32_precision``)
        for backend, op in pairs:
            try:
                precision(backend, op)
            except Exception:  # a pair this torch does not know
                continue
            found.append(functools.partial(precision, backend, op))
    return tuple(found)


_NUMERICS = _numerics_getters()
#: How many torch function and dispatch modes are active on this thread (one C call each).
function_modes = torch._C._len_torch_function_stack
dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode_at = torch._C._get_function_stack_at
_dispatch_mode_at = torch._C._get_dispatch_stack_at


def mode_stack() -> tuple | None:
    """The torch function and dispatch modes active on this thread, outermost first, or None:
    compared by identity, whether a call nested in a scope runs under the modes its values were
    computed under (:mod:`paramfold.scope_nested`)."""
    n, dispatch = function_modes(), dispatch_modes()
    if not n and not dispatch:
        return None
    return (*map(_function_mode_at, range(n)), None, *map(_dispatch_mode_at, range(dispatch)))


def modes_now() -> object:
    """None where no torch function or dispatch mode is active on this thread; the devices of the
    ``torch.device`` contexts where only they are (``torch.set_default_device`` keeps one pushed);
    else a new object, equal to no other: a mode (``FlopCounterMode``, a user's
    ``TorchDispatchMode``) may do anything with each op, and stock runs the chain under it at each
    read, so a value computed under one serves no later read."""
    stack = mode_stack()
    if stack is None:
        return None
    if stack[-1] is None and all(type(m) is DeviceContext for m in stack[:-1]):  # no dispatch mode
        return tuple(m.device for m in stack[:-1])
    return object()


def computed_under() -> tuple:
    """What a value computed now is computed under, besides its inputs and the grad mode: the
    autocast state (:func:`autocast_state`), torch's settings that decide how its ops compute
    (the default dtype, matmul precisions, TF32, deterministic algorithms, the thread count:
    :data:`_NUMERICS`) and the modes active on this thread (:func:`modes_now`). A frozen value
    serves a call only where this is equal. (Not read: ``torch.set_flush_denormal``, which torch
    cannot report, and ``torch.backends.opt_einsum``'s contraction order.)"""
    try:
        numerics = tuple(map(call, _NUMERICS))
    except Exception:  # torch.get_float32_matmul_precision() raises once old and new APIs were mixed
        numerics = tuple(map(_read_or_error, _NUMERICS))
    # Read at every call: no frame of the helpers where autocast is off and no mode is active.
    return (autocast_state() if any_autocast() else None, numerics,
            modes_now() if function_modes() or dispatch_modes() else None)


def _read_or_error(getter) -> object:
    try:
        return getter()
    except Exception as e:  # the per-backend readers still say what this one would have
        return type(e)


_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


#: Values a call nested in a scope computed for itself inside a non-reentrant
#: ``torch.utils.checkpoint`` region, with autograd there (``scope_nested.call_changed``: a
#: ``torch.autocast`` or grad mode entered inside the region): the region's recomputation computes
#: them there again, where a value the scope computed before the region is replayed without
#: autograd (``hooknorm_regions``, ``compiled_entry_regions``).
#: (By identity, each kept only while it lives: a ``WeakSet`` would compare tensors with ``==``.)
computed_in_region: WeakIdKeyDictionary = WeakIdKeyDictionary()


def checkpoint_frame() -> tuple[object, bool] | None:
    """``(frame, recomputing)`` of the innermost non-reentrant ``torch.utils.checkpoint`` region
    this thread runs in, else None: torch's ``_CheckpointFrame`` of the region, and whether this is
    its recomputation (during backward) rather than its forward.

    Found from the saved-tensor hooks the region pushed: ``_checkpoint_hook``'s pack hook holds
    the frame in its closure (``frame``), ``_recomputation_hook``'s a weak reference to it
    (``target_frame_ref``). A region whose frame cannot be found this way gives ``(None, ...)``.
    """
    hooks = _top_saved_tensors_hooks(True)
    if hooks is None:
        return None
    pack = hooks[0]
    qualname = getattr(pack, "__qualname__", "")
    if "_recomputation_hook" in qualname:
        recomputing = True
    elif "_checkpoint_hook" in qualname:
        recomputing = False
    else:
        return None
    frame = None
    try:
        fn = pack
        while hasattr(fn, "__wrapped__"):  # torch._dynamo.disable's wrapper
            fn = fn.__wrapped__
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        if recomputing:
            frame = cells["target_frame_ref"].cell_contents()
        else:
            frame = cells["frame"].cell_contents
    except (AttributeError, KeyError, TypeError, ValueError):  # another torch's layout
        frame = None
    return frame, recomputing


def computed_for_recomputation(value: Callable[[], torch.Tensor], requires_grad: bool) -> torch.Tensor:
    """``value()`` for a checkpointed region's recomputation, where its forward was served a value
    computed before the region: without autograd (the gradient flows through the graph the
    forward's value recorded), outside the region's dispatch modes (selective checkpointing's
    cache refuses ops its forward never ran), a leaf that requires grad where the forward's did
    (the recomputation runs with grad enabled, as the forward did)."""
    with torch.no_grad(), _disable_current_modes():
        computed = value()
    return computed.detach().requires_grad_(requires_grad)


def replay_index(notes: dict, attr: str, key: object) -> int:
    """Which call of ``key`` (0 for the first) this is in the recomputation under way of a
    checkpointed region, counted in ``notes[attr]`` (the region's frame's ``__dict__``): each
    backward recomputes under a pack hook of its own, and counts from 0 again."""
    pack = _top_saved_tensors_hooks(True)[0]
    replayed = notes.get(attr)
    if replayed is None or replayed[0] is not pack:
        replayed = notes[attr] = (pack, {})
    i = replayed[1][key] = replayed[1].get(key, -1) + 1
    return i


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
