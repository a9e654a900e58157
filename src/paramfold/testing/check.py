"""The checker: run a model stock and prepared side by side (:func:`assert_equivalent`).

Why a module of its own: it is what a test suite calls (:func:`assert_equivalent`,
:func:`grad_mode`), on any model, drawn by :mod:`paramfold.testing.strategies` or built by hand,
and it needs no Hypothesis. How two results are compared is :mod:`paramfold.testing.compare`;
the structure snapshots it takes around ``restore`` are :mod:`paramfold.testing.structure`; what
a prepared model must leave as stock leaves it besides values (process-wide settings, global
module hooks, the memory of its tensors, the modules ``filter_fn`` leaves out) is
:mod:`paramfold.testing.left_as_stock`; the change of the models between steps is
:mod:`paramfold.testing.between_steps`; the reference for gradients paramfold sums in another
order is :mod:`paramfold.testing.resummed`; the sites it walks and the global generators it sets
back are :mod:`paramfold.testing.walks` and :mod:`paramfold.testing.generators`.

Tolerances. In eager mode every comparison is bitwise: bit patterns (``-0.0`` is not ``0.0``, a
NaN equals only the same NaN), dtypes, shapes, the strides of dimensions longer than one, and the
types of Python values (``1.0`` is not ``1``) (:func:`paramfold.testing.compare.compare`), bar
gradients that paramfold sums in another order than stock: :mod:`paramfold.testing.resummed`.
Under ``compile=...`` the default tolerance is :data:`COMPILE_TOLERANCES` for the backend, and
a step that does not match eager stock is held to stock compiled the same way, run from the same
state: some modules take another path when compiled (``nn.MultiheadAttention``'s fused eval fast
path runs only eagerly), so stock itself differs there. The check then goes on from that stock's
state. Only where torch cannot deep-copy the stock model mid-run (an LSTM keeps computed weights
in ``_flat_weights``) is the eager comparison the only one. (A tensor a module keeps as a plain
attribute with a history, the ``module.weight`` a hook-based ``weight_norm`` last wrote, is
copied detached, with its values.)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import paramfold
from paramfold.errors import counted
from paramfold.testing.between_steps import update
from paramfold.testing.compare import (
    BITWISE,
    Tolerance,
    compare,
    compare_dicts,
    compare_outputs,
    compare_tree,
    tensors_of,
)
from paramfold.testing.generators import compare_rng, rng_state, set_rng_state
from paramfold.testing.left_as_stock import (
    StockChanges,
    compare_copy_on_write,
    compare_excluded,
    compare_global_hooks,
    compare_memory,
    compare_settings,
    excluded_modules,
    global_hook_keys,
    memory_of,
    set_settings,
    settings_now,
)
from paramfold.testing.resummed import (
    calls,
    compare_resummed,
    once_per_forward,
    originals_of,
    reordered_originals,
    tied_originals,
)
from paramfold.testing.walks import hook_norms, parametrized
from paramfold.testing.structure import assert_same_structure, structure

__all__ = ["COMPILE_TOLERANCES", "assert_equivalent", "grad_mode"]


def grad_mode(flags: Mapping[str, Any]) -> contextlib.AbstractContextManager:
    """``torch.enable_grad()`` or ``torch.no_grad()`` as a case's ``flags`` ask.

    Example::

        >>> import torch
        >>> from paramfold.testing import grad_mode
        >>> with grad_mode({"grad_enabled": False}):
        ...     torch.is_grad_enabled()
        False
    """
    return torch.enable_grad() if flags.get("grad_enabled", True) else torch.no_grad()


# --------------------------------------------------------------------------------------------
# assert_equivalent
# --------------------------------------------------------------------------------------------

#: Default tolerance factor ``k`` under ``compile=dict(backend=...)`` when neither ``atol`` nor
#: ``rtol`` is given: with ``eps`` that of the lowest-precision floating dtype among the model's
#: tensors and outputs (bfloat16 for the seed's cast), each element may differ from stock by
#: ``1e-5 + k * eps * (|stock element| + max|stock tensor|)``; 0 means bitwise. Measured on
#: random :func:`~paramfold.testing.cases` (float32, bfloat16 and cast models; hoist, inline,
#: auto, freeze; torch 2.13 CPU): ``"eager"`` and ``"aot_eager"`` run eager's ATen kernels and
#: matched bitwise in all ~380 cases tried (except the hoisted tensor-subclass gradient bug of
#: ``tests/test_properties.py``, which is not a rounding difference). Inductor generates its own kernels and
#: computes low-precision math in float32; its worst difference was 3.5 in units of
#: ``eps * max|stock tensor|`` (float32 gradients), and near-zero gradients that cancel in eager
#: (a LayerNorm of width 2) need the ``1e-5`` floor. The default 16 leaves a 4x margin.
#: Inductor on models *stored* in bfloat16 also produced different inf/NaN patterns in rare
#: near-singular cases (spectral_norm of a masked weight): pass ``atol``/``rtol`` for those.
COMPILE_TOLERANCES: dict[str, float] = {"eager": 0.0, "aot_eager": 0.0, "inductor": 16.0}




def assert_equivalent(
    model: nn.Module,
    inputs: torch.Tensor | Sequence[Any] | Mapping[str, Any],
    mode: str = "auto",
    *,
    kwargs: Mapping[str, Any] | None = None,
    steps: int = 1,
    compile: Mapping[str, Any] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    lr: float | torch.Tensor = 1e-3,
) -> None:
    """Assert that ``paramfold.prepare(model, mode)`` changes nothing observable, then undo it.

    ``model`` itself is never touched: it is deep-copied (a tensor a module keeps as a plain
    attribute with a history, as the ``module.weight`` a hook-based ``weight_norm`` last wrote, is
    copied detached): one copy stays stock (eager) and one is prepared (and compiled with ``torch.compile(copy, **compile)`` when ``compile``
    is given). For each of ``steps`` steps both copies run ``inputs`` (a tensor, a sequence
    of positional arguments, or a mapping of keyword arguments; ``kwargs`` adds keyword arguments
    to positional ones) under the caller's grad mode, on the same random numbers (torch's global
    CPU and CUDA generators, Python's ``random`` and NumPy's ``np.random`` are set back to where
    stock's step began, so dropout draws the same masks, and at the end to where they were when
    the check began); after each step the prepared run must leave these generators exactly as
    stock's left them (a run that draws other numbers moves the caller's next dropout mask or
    shuffle). Each run gets its own copy of
    the inputs (tensors cloned, inside lists, tuples and dicts too; other objects deep-copied
    where they can be), so a forward that writes into its inputs sees the caller's values every
    time and the caller's inputs are left as they were. When the stock output requires grad, both
    run backward on ``sum((o.float() * w).sum() for o in outputs)`` over the floating outputs that
    require grad (complex ones as ``torch.view_as_real``, nested ones by component), with weights
    ``w`` in [0.5, 1.5) drawn by a generator of the checker's own, the same for every run: a
    backward that permutes an output's gradient shows, which an all-ones cotangent hides.
    Checked after each step:
    outputs (their structure too: containers, dict keys, dataclass fields, other objects'
    attributes (``vars()``, ``__slots__``), ``None`` entries, and numbers, strings, NumPy arrays
    and nested tensors beside tensors, every entry against the prepared run's own: the same
    ``None`` or number met twice is compared twice; an object with neither attributes nor ``==``
    is refused), the inputs as the forward left them, the gradient of
    every parameter (originals included) and of every input that requires grad, every buffer (so
    spectral_norm's ``_u``/``_v`` must evolve identically) and ``state_dict()`` keys and values,
    its ``_metadata``, and per entry the tensor type ``keep_vars=True`` gives, its
    ``requires_grad``, whether it is the module's own and whether the plain entry shares its memory.
    Between steps every floating parameter, parametrized buffer and floating buffer of a chain's
    members is updated in place on both copies, except, on a site computed from several of
    these, one of them in turn (its first original before the second step, the next before the
    third, ...: a value kept fresh by watching only some of its inputs shows), as an optimizer or
    ``load_state_dict`` would (an SGD step with the *stock* gradient
    and rate ``lr``, or where there is none a shrink of each element by a factor of its own in
    (0.98, 1], drawn by the checker's own generator: not uniform, so a stale value of a
    scale-invariant chain, spectral_norm's, shows; then every gradient is set to ``None``,
    as ``zero_grad()`` does), so stale hoisted or frozen values
    would show from the second step on: with the default ``steps=1`` no forward runs after an
    update, so pass ``steps=2`` or more to check freshness; before each step and after the last every parametrized tensor is also read as an
    attribute outside any forward, first with the parametrizations' own training flags where
    one trains (a training spectral_norm's read runs a power iteration: the chains' buffers must
    then equal stock's), then in eval mode, and must equal stock's, and so
    must the ``module.weight`` a hook-based ``weight_norm``/``spectral_norm`` keeps (in stock the
    value of the layer's last call: a layer a call skips keeps it, where hoist and auto compute it
    for the call, README "Notes and limits", and the check reports that).
    On the first step a third copy (taken after the reads before it, which move a chain's own
    generator or counter in both copies) runs stock's forward once more and must give stock's outputs
    (within ``atol``/``rtol`` where given): a model that does not reproduce itself from run to
    run (a global counter, a generator of its own) fails saying so, not as a difference of paramfold's.
    Finally the prepared copy is restored with :func:`paramfold.restore` and must have exactly
    its structure from before ``prepare`` (classes, module, parametrization and ``Parameter``
    objects, ``__dict__`` keys, hooks, training flags and plain attribute values, the memory of
    every parameter and buffer (address, storage offset, strides), bar what stock's
    own calls changed too, read from stock running the same steps and applied by name, as
    transformers' ``_output_capturing_hooks_installed`` and the hooks it registers, a buffer a
    forward reassigns (``self.ema = 0.9 * self.ema + ...``, a step counter) or a buffer or
    parameter it registers at its first call, a submodule it registers, replaces or deletes (a head or
    cache module built at the first call), matched by path: the prepared copy's own objects there), stock's parameter and buffer values (persistent or not), gradients where
    stock has them and bitwise as they were before ``restore``, no tensor copy-on-write where
    stock's is not, and must still compute the stock outputs. Neither ``prepare`` nor ``restore``
    may add or remove a global module hook (``torch.nn.modules.module``'s process-wide dicts).
    While prepared (after ``prepare`` and after the last step) and after ``restore``, every
    parameter and buffer must be in the memory it had (address, storage offset, strides; a tensor
    subclass by its inner tensors; not compared where none can be read, on the meta device, nor
    where stock's own calls moved, replaced or added it), and
    ``named_parameters()``/``named_buffers()`` give stock's names in stock's order (those stock's
    calls registered too). A module ``filter_fn`` leaves out, parametrized or with a hook-based
    ``weight_norm``/``spectral_norm``, keeps, while prepared, stock's class (above a module of its
    own, a class made from stock's, as prepare makes for the modules whose calls serve those
    below), its parametrizations and hook-based norms, its properties and, where it holds no
    module, its ``__dict__`` keys (bar those stock's own calls change). ``prepare``, ``restore``
    and each prepared run must leave the process-wide settings (default dtype, grad and inference
    mode, deterministic algorithms and their ``warn_only``, float32 matmul precision, anomaly
    mode, autocast, the device ``torch.set_default_device`` set, ``torch.compiler.set_stance``'s
    stance, the ``TorchFunctionMode`` and ``TorchDispatchMode`` stacks, ``sys.getprofile()`` and
    ``sys.gettrace()``) as stock's run leaves them; every run of a step starts from the settings
    stock's run started from (a forward may flip one at each call), the step ends where stock's
    run left them, and the check sets them back when it ends, pass or fail. A read outside forward that differs is first tried on two copies of
    stock: a chain that reads a global counter fails saying the model is not reproducible.
    An exception of the stock copy's own run gets a note saying so (Python >= 3.11). Every
    failure message starts with the mode and whether the check ran eagerly or compiled
    (``[mode='hoist', eager] ...``).

    Step comparisons are bitwise (bit patterns, strides and value types too) unless
    ``atol``/``rtol`` are given (then as in ``torch.testing.assert_close``), or compiled
    (:data:`COMPILE_TOLERANCES`; a backend without a measured tolerance, or a callable backend,
    needs ``atol``/``rtol``); see :mod:`paramfold.testing.resummed` for originals whose gradient
    paramfold sums in another order (modules called twice per forward: bitwise stock's, or stock's
    computing each tensor once per forward as hoist does; tied originals also within the
    rounding of their own summed terms) and for compiled steps that stock itself computes
    differently compiled (held to stock compiled the same way).
    :class:`paramfold.FoldError` from ``prepare`` propagates (``mode="freeze"`` refuses
    originals that require grad and training stateful chains). Under ``compile`` call
    ``torch._dynamo.reset()`` between unrelated checks yourself.

    Raises:
        AssertionError: naming the first tensor that differs, and the step; or the generator
            the prepared run left in another state; or saying that stock does not reproduce itself.
        TypeError: for an output object it cannot walk or compare (no attributes, no ``==``).
        ValueError: for a model or inputs on the meta device (no values to compare), a model with
            uninitialized parameters or buffers (torch's ``nn.LazyLinear`` and other lazy modules before
            their first call: run it once first), ``steps < 1``,
            or, with ``steps > 1``, an ``lr`` that is not a finite real number above 0 (no update:
            stale values would pass; a Python or NumPy number, or a tensor of one element).

    Example::

        >>> import torch, paramfold.testing as pt
        >>> from torch.nn.utils.parametrizations import spectral_norm
        >>> model = torch.nn.Sequential(spectral_norm(torch.nn.Linear(4, 4)), torch.nn.ReLU())
        >>> pt.assert_equivalent(model, torch.randn(3, 4), "hoist", steps=3)
    """
    if steps < 1:
        raise ValueError(f"assert_equivalent: steps={steps} runs nothing, so nothing would be compared; pass steps=1 or more")
    rate = _rate(lr)
    if steps > 1 and not (rate is not None and math.isfinite(rate) and rate > 0):
        raise ValueError(
            f"assert_equivalent: lr={lr!r} with steps={steps}: the update between steps moves each original by "
            "-lr times its gradient, so an lr that is not a finite real number above 0 (a Python or NumPy number, "
            "or a tensor of one element) leaves the originals that have a gradient as they were (or makes them "
            "inf/NaN), and a stale hoisted or frozen value would pass: pass lr > 0 (the default is 1e-3)"
        )
    if isinstance(inputs, torch.Tensor):
        args: _Args = ((inputs,), dict(kwargs or {}))
    elif isinstance(inputs, Mapping):
        args = ((), {**inputs, **(kwargs or {})})
    else:
        args = (tuple(inputs), dict(kwargs or {}))
    lazy = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if is_lazy(t)]
    if lazy:
        # (no values to compare before prepare, nor after: stock's first call makes them)
        raise ValueError(
            f"assert_equivalent: {counted(len(lazy), 'tensor')} of the model ({', '.join(map(repr, lazy[:3]))}"
            f"{', ...' if len(lazy) > 3 else ''}) {'is' if len(lazy) == 1 else 'are'} uninitialized (torch.nn's Lazy "
            "modules), with no values to "
            "compare until a first call materialises them; run the model once first (with torch.no_grad(): "
            "model(inputs)) and check the materialised model"
        )
    meta = [t for t in (*model.parameters(), *model.buffers(), *_tensors_in(args)) if t.is_meta]
    if meta:
        raise ValueError(
            "assert_equivalent: the model or its inputs are on the meta device, where tensors hold no "
            "values, so nothing could be compared; materialize the model on a real device first "
            "(model.to_empty(device='cpu') and initialize its weights, or build it there) and pass "
            "inputs on that device"
        )
    entry_rng = rng_state()
    entry_settings = settings_now()
    try:
        _assert_equivalent(model, args, mode, steps, compile, atol, rtol, filter_fn, 1e-3 if rate is None else rate)
    except AssertionError as exc:
        # Every failure names what was checked (one place for all messages).
        how = "eager" if compile is None else f"compiled, backend={compile.get('backend', 'inductor')!r}"
        exc.args = (f"[mode={mode!r}, {how}] {exc.args[0] if exc.args else ''}", *exc.args[1:])
        raise
    finally:
        set_rng_state(entry_rng)
        set_settings(entry_settings)


def _rate(lr: Any) -> float | None:
    """``lr`` as a Python float: a real number (``numbers.Real``: int, float, a NumPy scalar) or a
    real tensor of one element (``torch.tensor(1e-3)``, a scheduler's); None for anything else."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or lr.is_complex() or lr.is_meta:
            return None
        return float(lr.detach())
    if isinstance(lr, numbers.Real):
        try:
            return float(lr)
        except (TypeError, ValueError, OverflowError):
            return None
    return None


#: Positional and keyword arguments of one call.
_Args = tuple[tuple[Any, ...], dict[str, Any]]


def _assert_equivalent(
    model: nn.Module,
    args: _Args,
    mode: str,
    steps: int,
    compile: Mapping[str, Any] | None,
    atol: float | None,
    rtol: float | None,
    filter_fn: Callable[[nn.Module, str], bool] | None,
    lr: float,
) -> None:
    stock, candidate = _deepcopy(model), _deepcopy(model)
    for copy_ in (stock, candidate):
        for param in copy_.parameters():
            param.grad = None
    before = structure(candidate, values=False)
    # What stock's own calls change (a buffer a forward reassigns, one it registers at its first
    # call, a hook, an attribute) is read from stock, the same steps run the same way.
    by_stock = StockChanges(stock)

    hooks_before = global_hook_keys()
    memory_before = memory_of(candidate)
    excluded = excluded_modules(candidate, filter_fn)
    settings = settings_now()
    paramfold.prepare(candidate, mode, filter_fn=filter_fn)
    compare_settings(settings, settings, settings, settings_now(), " by paramfold.prepare")
    compare_global_hooks(hooks_before, " by paramfold.prepare")
    compare_memory(" after prepare", memory_before, memory_of(candidate))
    compare_excluded(" after prepare", excluded)
    run: Callable[..., Any] = candidate
    factor = 0.0
    if compile is not None:
        run = torch.compile(candidate, **compile)
        backend = compile.get("backend", "inductor")
        if rtol is None and atol is None:
            if not isinstance(backend, str) or backend not in COMPILE_TOLERANCES:
                raise ValueError(
                    f"assert_equivalent has no measured tolerance for backend {backend!r} (known: "
                    f"{', '.join(COMPILE_TOLERANCES)}): pass atol= and/or rtol= for it"
                )
            factor = COMPILE_TOLERANCES[backend]
    _compare_state_dicts(" after prepare", candidate, stock, BITWISE)
    # Originals whose gradient sums several contributions in an order prepare may change, and
    # a stock copy computing one value per tensor per forward (like hoist and freeze) to compare
    # them with besides stock: see paramfold.testing.resummed. Modules called
    # more than once per forward are counted in stock's first step, before the copy runs.
    loose = reordered_originals(candidate) if mode != "inline" else set()
    tied = tied_originals(candidate) if mode != "inline" else set()
    spare: nn.Module | None = None
    cached: nn.Module | None = None
    # Stock run once more on the first step's inputs (a forward only): a model whose forward
    # reads something that changes from run to run would otherwise be blamed on paramfold.
    twin: nn.Module | None = None

    tol = BITWISE
    for step in range(steps):
        if step:
            update(stock, [candidate] + ([cached] if cached is not None else []), lr, step)
        at = f" at step {step + 1}" if steps > 1 else ""
        # Compiled steps may leave state (spectral_norm's _u/_v) within the step tolerance.
        _reads(candidate, stock, f" before step {step + 1}", tol, [cached] if cached is not None else [], rtol, atol)
        if not step:
            # Copied after the reads, which move a chain's own state (a generator of its own, a
            # read counter) in stock and prepared alike: the copies start where stock's step does.
            spare = _deepcopy(stock) if mode != "inline" else None
            twin = _deepcopy(stock)
        # Where torch compiles a module differently from its eager run, stock itself differs
        # compiled: a compiled step that does not match eager stock is held to stock compiled
        # the same way from the same state, and the check goes on from that stock's state.
        at_start = _copy_or_none(stock) if compile is not None else None
        fork = by_stock.fork(stock, at_start) if at_start is not None else None
        # Every run of a step draws the same random numbers (dropout), from where stock's began,
        # under the same process-wide settings (a forward may change one at each call).
        rng = rng_state()
        start = settings_now()
        with calls(stock) as counts:
            try:
                expected = _step(stock, args, None)
            except Exception as exc:
                if hasattr(exc, "add_note"):  # Python >= 3.11
                    exc.add_note(f"(raised by the stock copy's step{at or ' 1'} in paramfold.testing.assert_equivalent, "
                                 "the model not prepared: the model or its inputs fail without paramfold)")
                raise
        after = rng_state()
        stock_left = settings_now()
        if twin is not None:
            set_rng_state(rng)
            set_settings(start)
            _check_reproducible(_step(twin, args, False).outputs, expected.outputs, Tolerance(rtol or 0.0, atol or 0.0))
            twin = None
        twice = {path for path, n in counts.items() if n > 1}
        if mode != "inline":
            loose |= originals_of(candidate, twice)
        if step == 0 and loose:
            cached = spare
        backward = expected.backward
        set_rng_state(rng)
        set_settings(start)
        actual = _step(run, args, backward, at)
        left = rng_state()
        compare_settings(start, stock_left, start, settings_now(), f" by the prepared run{at or ' 1'}")
        if cached is not None:
            set_rng_state(rng)
            set_settings(start)
            with once_per_forward(cached):
                _step(cached, args, backward)
        # Gradients that may differ from both references by the rounding of their summed terms:
        # compiled, any reordered one; eagerly, tied originals (paramfold.testing.resummed).
        rounded = loose if compile is not None else tied
        try:
            tol = _compare_step(candidate, stock, cached, expected, actual, at, loose, factor, rtol, atol, rounded)
        except AssertionError as exc:
            if at_start is None:
                raise
            set_rng_state(rng)
            set_settings(start)
            reference = _step(torch.compile(at_start, **compile), args, backward)
            reference_left = rng_state()
            try:
                tol = _compare_step(
                    candidate, at_start, cached, reference, actual, at, loose, factor, rtol, atol, rounded
                )
            except AssertionError:
                raise AssertionError(f"{exc}, and from stock compiled the same way") from None
            stock, after, stock_left = at_start, reference_left, settings_now()
            by_stock.switch(fork)
        compare_rng(left, after, at)
        set_rng_state(after)
        set_settings(stock_left)  # where stock's run left them, as the generators
    _reads(candidate, stock, f" after step {steps}", tol, (), rtol, atol)
    compare_memory(f" after step {steps}", by_stock.memory(memory_before), memory_of(candidate))
    compare_excluded(f" after step {steps}", excluded, by_stock.structure(before))

    grads_before = {id(p): None if p.grad is None else p.grad.clone() for p in candidate.parameters()}
    hooks_before = global_hook_keys()
    settings = settings_now()
    paramfold.restore(candidate)
    try:
        compare_settings(settings, settings, settings, settings_now(), " by paramfold.restore")
        compare_global_hooks(hooks_before, " by paramfold.restore")
        expected_structure = by_stock.structure(before)
        assert_same_structure(expected_structure, structure(candidate, values=False))
        # Values (persistent or not) are held to stock's, as each step held them.
        params = dict(candidate.named_parameters(remove_duplicate=False))
        stock_params = dict(stock.named_parameters(remove_duplicate=False))
        compare_dicts("", "parameter", params, stock_params, tol)
        buffers = dict(candidate.named_buffers(remove_duplicate=False))
        compare_dicts("", "buffer", buffers, dict(stock.named_buffers(remove_duplicate=False)), tol)
        for name, param in params.items():
            if (param.grad is None) != (stock_params[name].grad is None):
                state = ("None", "a tensor") if param.grad is None else ("a tensor", "None")
                raise AssertionError(f"grad of {name!r}: prepared has {state[0]}, stock has {state[1]}")
            # (held to stock at the last step; restore must leave them as they were)
            compare(f"grad of {name!r} (against the prepared model's before restore)", param.grad,
                    grads_before.get(id(param)), BITWISE)
        compare_copy_on_write(params, stock_params, "parameter")
        compare_copy_on_write(buffers, dict(stock.named_buffers(remove_duplicate=False)), "buffer")
    except AssertionError as exc:
        raise AssertionError(f"after paramfold.restore: {exc}") from None
    with torch.no_grad():
        rng = rng_state()
        restored = _step(candidate, args, False).outputs
        set_rng_state(rng)
        compare_outputs(restored, _step(stock, args, False).outputs, " after restore", BITWISE)


def _check_reproducible(again: Any, first: Any, tol: Tolerance) -> None:
    """Stock's second run of the first step gave ``again`` where its first gave ``first``."""
    try:
        compare_tree("output", again, first, "", tol, sides=("stock's second run", "its first"))
    except AssertionError as exc:
        raise AssertionError(
            f"the model is not reproducible, so assert_equivalent cannot judge paramfold on it: stock run twice from "
            f"the same state on the same inputs and random numbers gives another output ({exc}); its forward reads "
            "something else that changes from run to run (a global counter, a random generator of its own, a "
            "nondeterministic kernel: see torch.use_deterministic_algorithms)"
        ) from None


def _fresh(args: _Args) -> _Args:
    """Each run's own copy of the arguments: every tensor cloned (a leaf of its own where it
    requires grad, so each copy's input gradient is its own), inside lists, tuples (named ones
    too) and dicts as well, one clone per tensor object; other objects deep-copied where they can
    be, shared where they cannot. So a forward that writes into its inputs sees the caller's
    values in every run, and leaves the caller's inputs alone."""
    memo: dict[int, Any] = {}

    def fresh(value: Any) -> Any:
        if id(value) in memo:
            return memo[id(value)]
        if isinstance(value, torch.Tensor):
            new = value.detach().clone()
            if value.requires_grad:
                new.requires_grad_()
        elif isinstance(value, (list, tuple)):
            items = [fresh(v) for v in value]
            new = type(value)(*items) if hasattr(type(value), "_fields") else type(value)(items)
        elif type(value) is dict:
            new = {k: fresh(v) for k, v in value.items()}
        elif value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            return value
        else:
            try:
                new = copy.deepcopy(value, memo)
            except Exception:  # noqa: BLE001 - an object that does not copy is shared, as before
                new = value
        memo[id(value)] = new
        return new

    positional, keywords = args
    return tuple(fresh(a) for a in positional), {k: fresh(v) for k, v in keywords.items()}


def _tensors_in(args: _Args) -> Iterator[torch.Tensor]:
    """The tensors among the arguments (inside lists, tuples, dicts and dataclasses too)."""
    yield from tensors_of(list(args[0]))
    yield from tensors_of(args[1])


def _named_inputs(args: _Args) -> Iterator[tuple[str, Any]]:
    """``("input 0", value)``, ``("input 'x'", value)``: the arguments, by position or keyword."""
    for i, value in enumerate(args[0]):
        yield f"input {i}", value
    for key, value in args[1].items():
        yield f"input {key!r}", value


def _copy_or_none(model: nn.Module) -> nn.Module | None:
    """A deep copy of ``model``, or None where none can be made mid-run (a module that keeps a
    computed tensor across calls, as an LSTM's ``_flat_weights`` after a training step, or any
    other state that does not copy): the step is then held to eager stock only."""
    try:
        return _deepcopy(model)
    except Exception:  # noqa: BLE001 - the fallback is optional; the eager comparison stands
        return None


def _deepcopy(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, where a tensor a module keeps as a plain attribute with a history
    (the ``module.weight`` torch's hook-based ``weight_norm``/``spectral_norm`` pre-hook last
    wrote), which deepcopy refuses, is copied detached: the same values, as ``paramfold.export``'s
    copies hold it; the hook computes it afresh at the module's next call anyway."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for value in module.__dict__.values():
            if isinstance(value, torch.Tensor) and not value.is_leaf and id(value) not in memo:
                memo[id(value)] = value.detach().clone()
    return copy.deepcopy(model, memo)


@dataclasses.dataclass
class _Ran:
    """One copy's step: its arguments (inputs that require grad get a leaf of their own), its
    outputs, and whether it ran backward."""

    args: _Args
    outputs: Any = None
    backward: bool = False


def _step(call: Callable[..., Any], args: _Args, backward: bool | None, at: str = "") -> _Ran:
    """Run ``call`` on fresh arguments; then backward on its loss if ``backward`` (None: if it
    requires grad, as for stock, whose output decides for the others)."""
    ran = _Ran(_fresh(args))
    ran.outputs = call(*ran.args[0], **ran.args[1])
    loss = _loss(ran.outputs)
    wants = loss is not None and loss.requires_grad
    if backward and not wants:
        raise AssertionError(f"stock output requires grad but prepared output does not{at}")
    ran.backward = wants if backward is None else backward
    if ran.backward:
        loss.backward()
    return ran


def _compare_step(
    candidate: nn.Module,
    stock: nn.Module,
    cached: nn.Module | None,
    expected: _Ran,
    actual: _Ran,
    at: str,
    loose: set[int],
    factor: float,
    rtol: float | None,
    atol: float | None,
    rounded: set[int],
) -> Tolerance:
    """Everything one step leaves, prepared against stock; returns the step's tolerance."""
    eps = torch.finfo(_lowest_precision(stock, expected.outputs)).eps
    tol = Tolerance(rtol or factor * eps, 1e-5 if factor else atol or 0.0, factor * eps)
    compare_outputs(actual.outputs, expected.outputs, at, tol)
    _compare_grads(candidate, stock, cached, at, loose, tol, eps, rounded)
    for (name, a), (_, e) in zip(_named_inputs(actual.args), _named_inputs(expected.args)):
        # as the forward left them (one that writes into its inputs must write the same)
        compare_tree(f"{name} after the call", a, e, at, tol, strict=False)
        for i, (ta, te) in enumerate(zip(tensors_of(a), tensors_of(e))):
            if te.requires_grad and te.is_leaf:
                where = name if isinstance(e, torch.Tensor) else f"{name} (tensor {i})"
                compare(f"grad of {where}{at}", ta.grad, te.grad, tol)
    compare_dicts(at, "buffer", dict(candidate.named_buffers()), dict(stock.named_buffers()), tol)
    _compare_state_dicts(at, candidate, stock, tol)
    return tol


def _compare_state_dicts(at: str, candidate: nn.Module, stock: nn.Module, tol: Tolerance) -> None:
    """``state_dict()`` keys and values, and what a caller of it relies on besides: its
    ``_metadata`` (the versions ``_load_from_state_dict`` reads), and, per entry, the tensor type
    ``keep_vars=True`` gives, its ``requires_grad``, whether that is the module's own tensor and
    whether the plain entry shares its memory (``model.state_dict()[k].zero_()`` writes the model)."""
    actual, expected = candidate.state_dict(), stock.state_dict()
    compare_dicts(at, "state_dict", actual, expected, tol)
    if getattr(actual, "_metadata", None) != getattr(expected, "_metadata", None):
        raise AssertionError(
            f"state_dict metadata differs{at}: prepared {getattr(actual, '_metadata', None)}, "
            f"stock {getattr(expected, '_metadata', None)}"
        )
    kinds = [_entry_kinds(model, d) for model, d in ((candidate, actual), (stock, expected))]
    for key, (ours, theirs) in zip(expected, zip(*kinds)):
        if ours != theirs:
            raise AssertionError(
                f"state_dict {key!r}{at}: prepared gives {_describe_entry(ours)}, stock {_describe_entry(theirs)}"
            )


def _entry_kinds(model: nn.Module, plain: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    own = {id(t) for _, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))}
    kinds = []
    for key, value in model.state_dict(keep_vars=True).items():
        entry = plain[key]
        if not isinstance(value, torch.Tensor):  # an extra state object
            kinds.append((type(value).__name__,))
            continue
        shares = None  # (a wrapper subclass, torchao's, has no storage of its own)
        if isinstance(entry, torch.Tensor) and not (is_traceable_wrapper_subclass(entry) or is_traceable_wrapper_subclass(value)):
            shares = (not entry.is_meta and entry.numel() > 0
                      and entry.untyped_storage().data_ptr() == value.untyped_storage().data_ptr())
        kinds.append((type(value).__name__, value.requires_grad, id(value) in own, shares))
    return kinds


def _describe_entry(kind: tuple[Any, ...]) -> str:
    if len(kind) == 1:
        return f"a {kind[0]}"
    name, requires_grad, own, shares = kind
    return (f"a {name} (keep_vars=True) with requires_grad={requires_grad}, "
            f"{'the' if own else 'not the'} module's own tensor"
            + ("" if shares is None else f", {'sharing' if shares else 'not sharing'} its memory in state_dict()"))






#: Seed of the loss weights (:func:`_loss`).
_LOSS_SEED = 20261204


def _loss(outputs: Any) -> torch.Tensor | None:
    """``sum((o * w).sum())`` over the floating and complex output tensors that require grad
    (complex as ``view_as_real``, nested ones by component), with weights ``w`` in [0.5, 1.5)
    drawn for every floating output, in order, from a generator of the checker's own seeded the
    same at each call: every run gets the same weights, the caller's random streams are not
    touched, and a backward that mixes up the elements of an output's gradient shows (under an
    all-ones cotangent it would not)."""
    weights = torch.Generator().manual_seed(_LOSS_SEED)
    terms = []
    for t in tensors_of(outputs):
        if not (t.is_floating_point() or t.is_complex()):
            continue
        for part in (t.unbind() if t.is_nested else (t,)):
            values = torch.view_as_real(part) if part.is_complex() else part
            w = torch.rand(values.shape, generator=weights, dtype=torch.float32) + 0.5
            if t.requires_grad:
                terms.append((values.float() * w.to(values.device)).sum())
    return sum(terms[1:], terms[0]) if terms else None


def _compare_reads(
    candidate: nn.Module, stock: nn.Module, at: str, tol: Tolerance, others: Sequence[nn.Module] = ()
) -> None:
    """Every parametrized tensor read as an attribute, outside any forward, equals stock's, and
    so does the ``module.weight`` that a hook-based ``weight_norm``/``spectral_norm`` last wrote.

    Read twice: first with the parametrizations' own training flags where any is training (a
    training spectral_norm's read runs a power iteration, as a read for logging does in a
    training loop), then every chain's buffers compared with stock's; then with the
    parametrizations in eval mode, where nothing advances; their training flags are put back
    after. Each read starts from the same random state (a chain may draw random numbers), and
    the reads leave the generators where they were. ``others`` (stock's further copies) are read
    the same way, so a chain's own state (its generator, a read counter) moves in them as in stock.
    """
    pairs = [
        (path, c, s, [dict(parametrized(o))[path] for o in others])
        for (path, c), (_, s) in zip(parametrized(candidate), parametrized(stock))
    ]
    flags = [
        (m, m.training) for _, c, s, rest in pairs for owner in (c, s, *rest) for m in owner.parametrizations.modules()
    ]
    rng = rng_state()

    def read_all(how: str) -> None:
        with torch.no_grad():
            for path, c, s, rest in pairs:
                for name in s.parametrizations:
                    where = f"{path}.{name}" if path else name
                    ours = getattr(c, name)
                    for other in rest:
                        set_rng_state(rng)
                        getattr(other, name)
                    set_rng_state(rng)
                    compare(f"{where} read outside forward{how}{at}", ours, getattr(s, name), tol)
                    set_rng_state(rng)

    try:
        if any(training for _, training in flags):
            read_all(" in training mode")
            for path, c, s, _ in pairs:
                prefix = f"{path}.parametrizations." if path else "parametrizations."
                compare_dicts(f" after reads outside forward in training mode{at}", "buffer",
                              {prefix + n: b for n, b in c.parametrizations.named_buffers()},
                              {prefix + n: b for n, b in s.parametrizations.named_buffers()}, tol)
        for m, _ in flags:
            m.training = False
        read_all("")
        for path, module, hook, kind in hook_norms(stock):
            # A plain attribute torch's pre-hook writes at each call of the module.
            where = f"{path}.{hook.name}" if path else hook.name
            where = f"{where} (hook-based {kind})"
            ours = getattr(candidate.get_submodule(path), hook.name, None)
            compare(f"{where} read outside forward{at}", ours, getattr(module, hook.name, None), tol)
    finally:
        set_rng_state(rng)
        for m, training in flags:
            m.training = training



def _compare_grads(
    candidate: nn.Module,
    stock: nn.Module,
    cached: nn.Module | None,
    at: str,
    loose: set[int],
    tol: Tolerance,
    eps: float,
    rounded: set[int],
) -> None:
    """Every parameter's gradient against stock's within ``tol``. An original whose gradient
    sums several contributions in an order prepare may change (``loose``, :mod:`~paramfold.testing.resummed`) may
    instead equal ``cached``'s, stock computing each tensor as paramfold's hoist does; one in
    ``rounded`` may also differ from stock by the rounding of its summed terms."""
    got, want = dict(candidate.named_parameters()), dict(stock.named_parameters())
    if list(got) != list(want):
        raise AssertionError(f"parameter names differ{at}: {sorted(set(got) ^ set(want))}")
    once = dict(cached.named_parameters()) if cached is not None else {}
    for name, param in got.items():
        what = f"grad of {name!r}{at}"
        try:
            compare(what, param.grad, want[name].grad, tol)
        except AssertionError as exc:
            if id(param) not in loose:
                raise
            reference = once[name].grad if name in once else None
            compare_resummed(what, param.grad, want[name].grad, reference, tol, eps, id(param) in rounded, exc)


def _lowest_precision(model: nn.Module, outputs: Any) -> torch.dtype:
    tensors = [*model.parameters(), *model.buffers(), *tensors_of(outputs)]
    dtypes = {t.dtype for t in tensors if t.is_floating_point()} or {torch.float32}
    return max(dtypes, key=lambda d: torch.finfo(d).eps)



def _reads(candidate: nn.Module, stock: nn.Module, at: str, tol: Tolerance, others: Sequence[nn.Module],
           rtol: float | None, atol: float | None) -> None:
    """:func:`_compare_reads`; where a read differs, two copies of stock read from the same state
    first tell whether stock's own reads reproduce: a chain reading a global counter fails
    saying the model is not reproducible, not as paramfold's difference."""
    try:
        _compare_reads(candidate, stock, at, tol, others)
    except AssertionError as exc:
        first, second = _copy_or_none(stock), _copy_or_none(stock)
        if first is None or second is None:
            raise
        try:
            _compare_reads(first, second, "", Tolerance(rtol or 0.0, atol or 0.0))
        except AssertionError as again:
            raise AssertionError(
                f"the model is not reproducible, so assert_equivalent cannot judge paramfold on it: two copies of "
                f"stock read from the same state and random numbers give other values ({again}); a parametrization "
                "reads something else that changes from read to read (a global counter, a random generator of its "
                f"own, a nondeterministic kernel). (The prepared model's read differed too: {exc})"
            ) from None
        raise
