"""The checker: run a model stock and prepared side by side (:func:`assert_equivalent`).

Why a module of its own: it is what a test suite calls (:func:`assert_equivalent`,
:func:`grad_mode`), on any model, drawn by :mod:`paramfold.testing.strategies` or built by hand,
and it needs no Hypothesis. How two results are compared is :mod:`paramfold.testing.compare`;
the structure snapshots it takes around ``restore`` are :mod:`paramfold.testing.structure`.

Tolerances. In eager mode every comparison is bitwise: bit patterns (``-0.0`` is not ``0.0``, a
NaN equals only the same NaN), dtypes, shapes, the strides of dimensions longer than one, and the
types of Python values (``1.0`` is not ``1``) (:func:`paramfold.testing.compare.compare`). One
case has two bitwise references: gradients of originals that autograd sums from several
contributions in an order ``prepare`` may change. That is

* a parametrized module *called more than once per forward*, or whose tensor is read more than
  once (the same instance registered at two places, called twice by a forward, or its weight
  read directly besides, as a tied output projection does; calls and reads are counted in each
  of stock's steps): stock computes its tensor at every read and autograd sums after the
  chain's backward (``J^T g1 + J^T g2``); hoist, freeze and auto compute it once per forward and
  sum before it (``J^T (g1 + g2)``), except a stateful chain in training (spectral_norm), which
  they compute at every read after the first, as stock does;
* an original *shared by several sites* (tied): hoisted sites are computed when the forward
  starts, in module order, so their backward nodes run in a different order than stock's
  when the forward reads them in another order or only some of them are prepared
  (``filter_fn``), and sums of three or more terms (spectral_norm reads its weight twice)
  round differently.

Mathematically equal, they differ by rounding. So in modes other than ``"inline"`` the
gradient of such an original must equal, bitwise, either stock's or that of a third copy run
stock computing its parametrized tensors as hoist does (``_once_per_forward``: once per forward,
when it starts, in module order; a chain whose computation moves its buffers, spectral_norm
training, again at each later read; a chain that draws random numbers at every read), each read
getting a view of its own (stock's fresh tensor per read: a gradient hook the forward registers
at each read scales that read's gradient only, where paramfold's shared value carries every
read's hooks, README "Notes and limits", and the check reports it). That copy sums as paramfold
does, from stock's values. Only a tied original (eagerly), or any of them under a compiler
(which reorders sums too), may also differ from stock by the rounding of its own summed terms
(a stateful tied chain's later reads are not ordered as in that copy): ``rtol`` =
``torch.testing.assert_close``'s default for the lowest-precision floating dtype of the model
and its outputs (bfloat16: 1.6e-2, float32: 1.3e-6), ``atol`` = the step's ``atol`` + ``rtol``
times the largest element of this tensor's gradient, stock's or the third copy's. Until
2026-12-04 every such gradient was held to stock within ``max(1e-5, rtol * (largest gradient
anywhere in the model))``, even eagerly, which let paramfold's 2x stock pass on small gradients
or beside a large one. Everything else, outputs and buffers included, stays bitwise.
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import paramfold
from paramfold.compute import has_parametrizations, members, original_names
from paramfold.held import global_generator_states, set_global_generator_states
from paramfold import hooknorms
from paramfold.sites import parametrization_paths
from paramfold.testing.compare import (
    BITWISE,
    Tolerance,
    compare,
    compare_dicts,
    compare_outputs,
    compare_tree,
    largest,
    tensors_of,
)
from paramfold.testing.structure import Structure, assert_same_structure, structure

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
    lr: float = 1e-3,
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
    objects, ``__dict__`` keys, hooks, training flags and plain attribute values, bar what stock's
    own calls changed too, as transformers' ``_output_capturing_hooks_installed`` and the hooks
    it registers), stock's parameter and buffer values (persistent or not), gradients where
    stock has them and bitwise as they were before ``restore``, no tensor copy-on-write where
    stock's is not, and must still compute the stock outputs. Neither ``prepare`` nor ``restore``
    may add or remove a global module hook (``torch.nn.modules.module``'s process-wide dicts).
    An exception of the stock copy's own run gets a note saying so (Python >= 3.11).

    Step comparisons are bitwise (bit patterns, strides and value types too) unless
    ``atol``/``rtol`` are given (then as in ``torch.testing.assert_close``), or compiled
    (:data:`COMPILE_TOLERANCES`; a backend without a measured tolerance, or a callable backend,
    needs ``atol``/``rtol``); see the module docstring for originals whose gradient paramfold
    sums in another order (modules called twice per forward: bitwise stock's, or stock's
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
        ValueError: for a model or inputs on the meta device (no values to compare), or ``steps < 1``.

    Example::

        >>> import torch, paramfold.testing as pt
        >>> from torch.nn.utils.parametrizations import spectral_norm
        >>> model = torch.nn.Sequential(spectral_norm(torch.nn.Linear(4, 4)), torch.nn.ReLU())
        >>> pt.assert_equivalent(model, torch.randn(3, 4), "hoist", steps=3)
    """
    if steps < 1:
        raise ValueError(f"assert_equivalent: steps={steps} runs nothing, so nothing would be compared; pass steps=1 or more")
    if isinstance(inputs, torch.Tensor):
        args: _Args = ((inputs,), dict(kwargs or {}))
    elif isinstance(inputs, Mapping):
        args = ((), {**inputs, **(kwargs or {})})
    else:
        args = (tuple(inputs), dict(kwargs or {}))
    meta = [t for t in (*model.parameters(), *model.buffers(), *_tensors_in(args)) if t.is_meta]
    if meta:
        raise ValueError(
            "assert_equivalent: the model or its inputs are on the meta device, where tensors hold no "
            "values, so nothing could be compared; materialize the model on a real device first "
            "(model.to_empty(device='cpu') and initialize its weights, or build it there) and pass "
            "inputs on that device"
        )
    entry_rng = _rng_state()
    try:
        _assert_equivalent(model, args, mode, steps, compile, atol, rtol, filter_fn, lr)
    finally:
        _set_rng_state(entry_rng)


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
    stock_before = structure(stock, values=False)

    hooks_before = _global_hook_keys()
    paramfold.prepare(candidate, mode, filter_fn=filter_fn)
    _compare_global_hooks(hooks_before, " by paramfold.prepare")
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
    # them with besides stock: see the module docstring. Modules called
    # more than once per forward are counted in stock's first step, before the copy runs.
    loose = _reordered_originals(candidate) if mode != "inline" else set()
    tied = _tied_originals(candidate) if mode != "inline" else set()
    spare: nn.Module | None = None
    cached: nn.Module | None = None
    # Stock run once more on the first step's inputs (a forward only): a model whose forward
    # reads something that changes from run to run would otherwise be blamed on paramfold.
    twin: nn.Module | None = None

    tol = BITWISE
    for step in range(steps):
        if step:
            _update(stock, [candidate] + ([cached] if cached is not None else []), lr, step)
        at = f" at step {step + 1}" if steps > 1 else ""
        # Compiled steps may leave state (spectral_norm's _u/_v) within the step tolerance.
        _compare_reads(candidate, stock, f" before step {step + 1}", tol, [cached] if cached is not None else [])
        if not step:
            # Copied after the reads, which move a chain's own state (a generator of its own, a
            # read counter) in stock and prepared alike: the copies start where stock's step does.
            spare = _deepcopy(stock) if mode != "inline" else None
            twin = _deepcopy(stock)
        # Where torch compiles a module differently from its eager run, stock itself differs
        # compiled: a compiled step that does not match eager stock is held to stock compiled
        # the same way from the same state, and the check goes on from that stock's state.
        at_start = _copy_or_none(stock) if compile is not None else None
        # Every run of a step draws the same random numbers (dropout), from where stock's began.
        rng = _rng_state()
        with _calls(stock) as calls:
            try:
                expected = _step(stock, args, None)
            except Exception as exc:
                if hasattr(exc, "add_note"):  # Python >= 3.11
                    exc.add_note(f"(raised by the stock copy's step{at or ' 1'} in paramfold.testing.assert_equivalent, "
                                 "the model not prepared: the model or its inputs fail without paramfold)")
                raise
        after = _rng_state()
        if twin is not None:
            _set_rng_state(rng)
            _check_reproducible(_step(twin, args, False).outputs, expected.outputs, Tolerance(rtol or 0.0, atol or 0.0))
            twin = None
        twice = {path for path, n in calls.items() if n > 1}
        if mode != "inline":
            loose |= _originals_of(candidate, twice)
        if step == 0 and loose:
            cached = spare
        backward = expected.backward
        _set_rng_state(rng)
        actual = _step(run, args, backward, at)
        left = _rng_state()
        if cached is not None:
            _set_rng_state(rng)
            with _once_per_forward(cached):
                _step(cached, args, backward)
        # Gradients that may differ from both references by the rounding of their summed terms:
        # compiled, any reordered one; eagerly, tied originals (module docstring).
        rounded = loose if compile is not None else tied
        try:
            tol = _compare_step(candidate, stock, cached, expected, actual, at, loose, factor, rtol, atol, rounded)
        except AssertionError as exc:
            if at_start is None:
                raise
            _set_rng_state(rng)
            reference = _step(torch.compile(at_start, **compile), args, backward)
            reference_left = _rng_state()
            try:
                tol = _compare_step(
                    candidate, at_start, cached, reference, actual, at, loose, factor, rtol, atol, rounded
                )
            except AssertionError:
                raise AssertionError(f"{exc}, and from stock compiled the same way") from None
            stock, after = at_start, reference_left
        _compare_rng(left, after, at)
        _set_rng_state(after)
    _compare_reads(candidate, stock, f" after step {steps}", tol)

    grads_before = {id(p): None if p.grad is None else p.grad.clone() for p in candidate.parameters()}
    hooks_before = _global_hook_keys()
    paramfold.restore(candidate)
    try:
        _compare_global_hooks(hooks_before, " by paramfold.restore")
        expected_structure = _with_changes_by_stock(before, stock_before, structure(stock, values=False))
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
        _compare_copy_on_write(params, stock_params, "parameter")
        _compare_copy_on_write(buffers, dict(stock.named_buffers(remove_duplicate=False)), "buffer")
    except AssertionError as exc:
        raise AssertionError(f"after paramfold.restore: {exc}") from None
    with torch.no_grad():
        rng = _rng_state()
        restored = _step(candidate, args, False).outputs
        _set_rng_state(rng)
        compare_outputs(restored, _step(stock, args, False).outputs, " after restore", BITWISE)


#: torch's process-wide module hook dicts: a prepare or restore that leaves one behind changes
#: every model's calls.
_GLOBAL_HOOK_DICTS = tuple(
    name for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                      "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
                      "_global_forward_hooks_with_kwargs", "_global_module_registration_hooks",
                      "_global_parameter_registration_hooks", "_global_buffer_registration_hooks")
    if hasattr(torch.nn.modules.module, name)
)


def _global_hook_keys() -> dict[str, tuple]:
    return {name: tuple(getattr(torch.nn.modules.module, name)) for name in _GLOBAL_HOOK_DICTS}


def _compare_global_hooks(before: dict[str, tuple], by: str) -> None:
    for name, keys in _global_hook_keys().items():
        added = [k for k in keys if k not in before[name]]
        removed = [k for k in before[name] if k not in keys]
        if added or removed:
            raise AssertionError(
                f"torch.nn.modules.module.{name} changed{by}: {len(added)} added, {len(removed)} removed "
                "(a global module hook runs for every model in the process)"
            )


def _compare_copy_on_write(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], what: str) -> None:
    """A restored tensor is copy-on-write (``torch._lazy_clone``'s) only where stock's is: a
    storage paramfold's freeze shared with a frozen value and did not take back makes a later
    ``resize_`` and in-place write fail inside torch."""
    is_cow = getattr(torch._C, "_is_cow_tensor", None)
    if is_cow is None:
        return
    for key, tensor in actual.items():
        other = expected.get(key)
        if (isinstance(tensor, torch.Tensor) and isinstance(other, torch.Tensor)
                and not is_traceable_wrapper_subclass(tensor) and is_cow(tensor) != is_cow(other)):
            raise AssertionError(
                f"{what} {key!r}: {'copy-on-write' if is_cow(tensor) else 'not copy-on-write'} after restore, "
                f"stock's {'is' if is_cow(other) else 'is not'}"
            )


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


def _with_changes_by_stock(before: Structure, stock_before: Structure, stock_after: Structure) -> Structure:
    """``before`` with what stock's own calls changed, module by module (matched by path), as the
    prepared copy's calls change it too, which is no difference from stock: ``__dict__`` keys
    added or deleted (transformers marks a model ``_output_capturing_hooks_installed`` when it
    first runs with ``output_hidden_states``, and registers hooks then), hooks registered or
    removed, and plain attributes' values (those are stock's, as stock has them now)."""
    old = {row[0]: row for row in stock_before.modules}
    new = {row[0]: row for row in stock_after.modules}
    rows = []
    for row in before.modules:
        path, keys, hooks, plain = row[0], set(row[3]), row[6], row[7]
        if path in old and path in new:
            keys = (keys | (set(new[path][3]) - set(old[path][3]))) - (set(old[path][3]) - set(new[path][3]))
            hooks = _hooks_changed_by_stock(hooks, dict(old[path][6]), dict(new[path][6]))
            plain = new[path][7]
        rows.append((*row[:3], tuple(sorted(keys)), *row[4:6], hooks, plain))
    return Structure(tuple(rows), before.state)


def _hooks_changed_by_stock(hooks: tuple, old: dict[str, tuple], new: dict[str, tuple]) -> tuple:
    """``hooks`` (a module's, :func:`~paramfold.testing.structure`'s field) less those that stock's
    calls removed, plus those they registered: the prepared copy's own calls registered theirs
    under other handle ids, so those are matched by kind (:class:`_LikeStocks`)."""
    result = []
    for name, items in hooks:
        was, now = dict(old.get(name, ())), dict(new.get(name, ()))
        if list(was.items()) != list(now.items()):
            items = tuple((key, hook) for key, hook in items if key in now or key not in was) + tuple(
                (_ANY_HANDLE, _LikeStocks(hook)) for key, hook in now.items() if key not in was
            )
        result.append((name, items))
    return tuple(result)


class _AnyHandle:
    """Equal to any handle id: the one the prepared copy's call registered a hook under."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, int)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "(a handle id)"


_ANY_HANDLE = _AnyHandle()


class _LikeStocks:
    """Equal to a hook of the same class and name as ``hook``, which stock's call registered."""

    def __init__(self, hook: Any) -> None:
        self.hook = hook
        self.__qualname__ = f"{_kind(hook)} (as stock's calls registered)"

    def __eq__(self, other: object) -> bool:
        return _kind(other) == _kind(self.hook)

    __hash__ = None  # type: ignore[assignment]


def _kind(hook: Any) -> str:
    hook = hook.hook if isinstance(hook, _LikeStocks) else hook
    return f"{type(hook).__qualname__} {getattr(hook, '__module__', '')}.{getattr(hook, '__qualname__', '')}"


def _rng_state() -> tuple[Any, ...]:
    """The global generators' states: torch's CPU one, CUDA's where CUDA is in use, Python's
    ``random`` and NumPy's (``np.random.*``, which transformers' SpecAugment masks draw from)
    where NumPy is imported."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, *global_generator_states()


def _set_rng_state(state: tuple[Any, ...]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])
    set_global_generator_states(state[2:])


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


@contextlib.contextmanager
def _calls(model: nn.Module) -> Iterator[dict[str, int]]:
    """Counts, for each parametrized module of ``model`` and each with a hook-based norm (by
    path), how many times the block called it or read one of its parametrized tensors, whichever
    is more: stock computes a tensor
    at every read (its ``ParametrizationList`` is called), so a forward that reads a module's
    weight directly besides calling it (a tied output projection) reads it twice. Calls during
    backward (a checkpointed region's recomputation) are not counted: they replay the forward's."""
    counts: dict[str, int] = {}
    seen: dict[object, int] = {}
    handles = []

    def counter(path: str, key: object) -> Callable[..., None]:
        def count(*_: Any) -> None:
            if _in_backward():
                return
            seen[key] = seen.get(key, 0) + 1
            counts[path] = max(counts.get(path, 0), seen[key])
        return count

    for path, module in _parametrized(model):
        handles.append(module.register_forward_pre_hook(counter(path, path)))
        for name, plist in module.parametrizations.items():
            handles.append(plist.register_forward_pre_hook(counter(path, (path, name))))
    for path, module in dict.fromkeys((path, module) for path, module, _, _ in _hook_norms(model)):
        handles.append(module.register_forward_pre_hook(counter(path, (path, "hook-based norm"))))
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward in this thread."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _originals_of(model: nn.Module, paths: set[str]) -> set[int]:
    """The ids of the originals of the parametrized modules at ``paths``, and of the parameters
    of their chains' members (a LoRA member's ``A`` and ``B``): every tensor whose gradient sums
    one term per computation of the value."""
    found = {
        id(tensor)
        for path, module in _parametrized(model)
        if path in paths
        for plist in module.parametrizations.values()
        for tensor in _chain_tensors(plist)
    }
    for path, module, hook, kind in _hook_norms(model):
        if path in paths:
            found.update(id(tensors[key]) for _, tensors, key in hooknorms.originals(module, hook, kind))
    return found


def _hook_norms(model: nn.Module) -> list[tuple[str, nn.Module, Any, str]]:
    """``(path, module, hook, kind)`` of every hook-based norm paramfold serves in ``model``."""
    inside = parametrization_paths(model)
    return [(path, module, hook, kind) for path, module in model.named_modules() if path not in inside
            for _, hook, kind in hooknorms.hook_norms(module)]


def _chain_tensors(plist: nn.Module) -> list[torch.Tensor]:
    """A parametrization list's originals and its members' own parameters."""
    return [*(getattr(plist, name) for name in original_names(plist)), *plist.parameters()]


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
        (path, c, s, [dict(_parametrized(o))[path] for o in others])
        for (path, c), (_, s) in zip(_parametrized(candidate), _parametrized(stock))
    ]
    flags = [
        (m, m.training) for _, c, s, rest in pairs for owner in (c, s, *rest) for m in owner.parametrizations.modules()
    ]
    rng = _rng_state()

    def read_all(how: str) -> None:
        with torch.no_grad():
            for path, c, s, rest in pairs:
                for name in s.parametrizations:
                    where = f"{path}.{name}" if path else name
                    ours = getattr(c, name)
                    for other in rest:
                        _set_rng_state(rng)
                        getattr(other, name)
                    _set_rng_state(rng)
                    compare(f"{where} read outside forward{how}{at}", ours, getattr(s, name), tol)
                    _set_rng_state(rng)

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
        for path, module, hook, kind in _hook_norms(stock):
            # A plain attribute torch's pre-hook writes at each call of the module.
            where = f"{path}.{hook.name}" if path else hook.name
            where = f"{where} (hook-based {kind})"
            ours = getattr(candidate.get_submodule(path), hook.name, None)
            compare(f"{where} read outside forward{at}", ours, getattr(module, hook.name, None), tol)
    finally:
        _set_rng_state(rng)
        for m, training in flags:
            m.training = training


def _parametrized(model: nn.Module) -> list[tuple[str, nn.Module]]:
    inside = parametrization_paths(model)
    return [
        (path, m)
        for path, m in model.named_modules()
        if has_parametrizations(m) and path not in inside
    ]


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
    sums several contributions in an order prepare may change (``loose``, module docstring) may
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
            _compare_resummed(what, param.grad, want[name].grad, reference, tol, eps, id(param) in rounded, exc)


def _compare_resummed(
    what: str,
    grad: torch.Tensor | None,
    stocks: torch.Tensor | None,
    once: torch.Tensor | None,
    tol: Tolerance,
    eps: float,
    rounding: bool,
    exc: AssertionError,
) -> None:
    """A gradient that differs from stock's (``exc``) and that paramfold sums in another order:
    it must equal ``once``, stock's computing each tensor as paramfold's hoist does, or, where
    ``rounding``, differ from stock's by the rounding of its own summed terms."""
    if once is not None:
        try:
            compare(what, grad, once, tol)
            return
        except AssertionError:
            pass
    if not rounding or grad is None or stocks is None:
        raise AssertionError(
            f"{exc}, and from stock computing each parametrized tensor once per forward, as hoist does, with a "
            "view of it at each read (the order in which paramfold sums the gradients of a tensor read several "
            "times; a gradient hook registered at each read still scales only that read's gradient there, as in "
            "stock, where paramfold's shared value has every read's hooks: README, Notes and limits)"
        ) from None
    # The size of the summed terms, this tensor's own (not the model's largest gradient).
    rtol = {torch.finfo(torch.bfloat16).eps: 1.6e-2, torch.finfo(torch.float16).eps: 1e-3}.get(eps, 1.3e-6)
    size = max(largest(stocks), largest(once) if once is not None else 0.0)
    compare(f"{what} (and differs from stock computing each tensor once per forward)", grad, stocks,
            Tolerance(max(tol.rtol, rtol), tol.atol + rtol * size, tol.of_max))


@contextlib.contextmanager
def _once_per_forward(model: nn.Module) -> Iterator[None]:
    """``model``'s parametrized tensors computed as paramfold's hoist computes them: once per
    forward, when it starts, in module order (``parametrize.cached()`` computes at the first
    read, in the forward's order), each read getting a view of its own, as stock's fresh tensor
    at each read (so a gradient hook registered on a read acts on that read's gradient only, as
    in stock). A chain whose computation moves its buffers (spectral_norm's power iteration in
    training) gives its first read that value and computes again at each later read; one that
    draws random numbers is computed at every read instead. A hook-based norm's tensor is
    computed once per forward too, where it moves no buffer. So the gradients of the originals
    are summed in paramfold's order, from stock's values."""
    plists = [m for _, module in _parametrized(model) for m in module.parametrizations.values()]
    plists += [m for m in model.modules() if isinstance(m, parametrize.ParametrizationList) and m not in plists]
    values: dict[int, torch.Tensor] = {}
    first_read_only: set[int] = set()
    for plist in plists:
        before = _chain_state(plist)
        rng = _rng_state()
        value = plist()
        after = _chain_state(plist)
        if not torch.equal(before[1], after[1]) or any(not torch.equal(x, y) for x, y in zip(before[2], after[2])):
            # draws random numbers: undone, computed where it is read
            _set_rng_state(rng)
            for generator, state in zip(_generators(plist), before[2]):
                generator.set_state(state)
            continue
        values[id(plist)] = value
        if before[0] != after[0]:
            first_read_only.add(id(plist))

    def once(plist: nn.Module) -> Callable[[], torch.Tensor]:
        def forward() -> torch.Tensor:
            value = values.get(id(plist))
            if value is None:
                return type(plist).forward(plist)
            if id(plist) in first_read_only:
                del values[id(plist)]
            try:
                return value.view_as(value)
            except Exception:  # noqa: BLE001 - a tensor subclass without views: the value itself
                return value
        return forward

    # A hook-based norm that moves no buffer (weight_norm; spectral_norm in eval) is computed
    # once too, and each call of its module gets a view of that value, where stock's hook
    # computes it at every call. (In training, spectral_norm's hook runs at each call in both.)
    hooked: list[tuple[nn.Module, int, Any]] = []
    for _, module, hook, kind in _hook_norms(model):
        if kind == "weight_norm" or not module.training:
            key = next(k for k, h in module._forward_pre_hooks.items() if h is hook)
            hooked.append((module, key, hook))
            module._forward_pre_hooks[key] = _serving(hook.name, hooknorms.compute(module, hook, kind))
    for plist in plists:
        plist.__dict__["forward"] = once(plist)
    try:
        yield
    finally:
        for plist in plists:
            plist.__dict__.pop("forward", None)
        for module, key, hook in hooked:
            module._forward_pre_hooks[key] = hook


def _serving(name: str, value: torch.Tensor) -> Callable[[nn.Module, Any], None]:
    """A forward pre-hook that sets ``module.<name>`` to a view of ``value`` at each call."""
    def serve(module: nn.Module, args: Any) -> None:
        setattr(module, name, value.view_as(value))
    return serve


#: A chain's buffer versions, torch's global CPU generator state and its own generators' states.
_ChainState = tuple[list[int], torch.Tensor, list[torch.Tensor]]


def _chain_state(plist: nn.Module) -> _ChainState:
    return [b._version for b in plist.buffers()], torch.get_rng_state(), [g.get_state() for g in _generators(plist)]


def _generators(plist: nn.Module) -> list[torch.Generator]:
    return [g for m in plist.modules() for g in vars(m).values() if isinstance(g, torch.Generator)]


def _compare_rng(left: tuple[Any, ...], after: tuple[Any, ...], at: str) -> None:
    """The global generators as the prepared run left them (``left``) against stock's (``after``)."""
    names = ("torch's CPU generator", "torch's CUDA generators", "Python's random", "NumPy's np.random")
    for name, mine, theirs in zip(names, left, after):
        if mine is None or theirs is None:
            same = mine is theirs
        elif name == names[0]:
            same = torch.equal(mine, theirs)
        elif name == names[1]:
            same = len(mine) == len(theirs) and all(torch.equal(a, b) for a, b in zip(mine, theirs))
        else:
            same = mine == theirs
        if not same:
            raise AssertionError(
                f"{name} is left in another state by prepared than by stock{at} (forward and backward): prepared draws "
                "other random numbers than stock, so the caller's next draws (a dropout mask, data shuffling) differ "
                "from stock's"
            )


#: Seeds the checker's own generator of the between-step shrink factors.
_SHRINK_SEED = 0x5EED


def _update(stock: nn.Module, others: list[nn.Module], lr: float, step: int) -> None:
    """The same in-place step on ``stock`` and ``others``, driven by ``stock``'s gradients, before
    step ``step`` (1 for the second step).

    Updated: every floating parameter, every parametrized buffer, and every floating buffer of a
    chain's members (a custom member's scale, spectral_norm's ``_u``/``_v``), except, on a site
    computed from several of these, one of them in turn (its first original before the second
    step, the next before the third, ...): a value kept fresh by watching only some of its inputs
    (weight_norm's ``g`` but not ``v``, the originals but not a member's buffer) shows.
    """
    held = _held_out(stock, step)

    def tensors(model: nn.Module) -> list[torch.Tensor]:
        inside = parametrization_paths(model)
        buffers = [b for n, b in model.named_buffers()
                   if n.rsplit(".", 1)[-1].startswith("original") or n.rpartition(".")[0] in inside]
        state = [d[key] for _, module, hook, kind in _hook_norms(model)
                 for _, d, key in hooknorms.state_tensors(module, hook, kind)]
        return [*model.parameters(), *buffers, *state]

    # Where there is no gradient, each element shrinks by its own factor in (0.98, 1]: a uniform
    # shrink leaves scale-invariant chains (spectral_norm's W/sigma(W), a direction v/|v|) as they
    # were, so a stale value of theirs would pass within any tolerance.
    shrink = torch.Generator().manual_seed(_SHRINK_SEED)
    with torch.no_grad():
        for reference, *copies in zip(tensors(stock), *map(tensors, others)):
            # (A tensor subclass made of others, a torchao quantized base weight, may have no
            # in-place arithmetic: left as it is, as an optimizer leaves a frozen base.)
            if (not reference.is_floating_point() or id(reference) in held
                    or (reference.grad is None and is_traceable_wrapper_subclass(reference))):
                continue
            grad = reference.grad
            factors = None
            if grad is None:
                factors = (1 - 0.02 * torch.rand(reference.shape, generator=shrink)).to(reference.device, reference.dtype)
            for tensor in (reference, *copies):
                if grad is not None:
                    tensor.add_(grad, alpha=-lr)
                else:
                    tensor.mul_(factors)
    # Then zero_grad(set_to_none=True), as a training loop does: each step's gradients are its
    # own. (Accumulated into the last step's, a compiled candidate and stock compiled afresh from
    # the same state, the reference where eager stock differs, round them differently: two
    # compilations of stock itself do.)
    for model in (stock, *others):
        for param in model.parameters():
            param.grad = None


def _held_out(model: nn.Module, step: int) -> set[int]:
    """The tensors :func:`_update` leaves as they are before step ``step``: of each site's inputs
    (its originals, then its members' floating parameters and buffers), where it has several, the
    ``(step - 1) % n``-th (one another site shares and updates is updated)."""
    held: set[int] = set()
    updated: set[int] = set()
    sites = [[getattr(plist, name) for name in original_names(plist)]
             + [t for member in members(plist) for t in (*member.parameters(), *member.buffers()) if t.is_floating_point()]
             for _, module in _parametrized(model) for plist in module.parametrizations.values()]
    sites += [[d[key] for _, d, key in (*hooknorms.originals(module, hook, kind), *hooknorms.state_tensors(module, hook, kind))]
              for _, module, hook, kind in _hook_norms(model)]
    for originals in sites:
        if len(originals) > 1:
            keep = originals[(step - 1) % len(originals)]
            held.add(id(keep))
            updated.update(id(t) for t in originals if t is not keep)
        else:
            updated.update(map(id, originals))
    return held - updated


def _reordered_originals(model: nn.Module) -> set[int]:
    """Originals of modules called more than once per forward, and originals shared by sites."""
    calls: dict[int, int] = {}
    inside = parametrization_paths(model)
    for path, module in model.named_modules(remove_duplicate=False):
        if path not in inside:
            calls[id(module)] = calls.get(id(module), 0) + 1
    repeated: set[int] = set()
    for _, module in _parametrized(model):
        for plist in module.parametrizations.values():
            if calls.get(id(module), 0) > 1:
                repeated.update(map(id, _chain_tensors(plist)))
    return repeated | _tied_originals(model)


def _tied_originals(model: nn.Module) -> set[int]:
    """Originals shared by several sites, and the parameters of chain members several sites share
    (one LoRA pair or scale registered on several layers: Tied-LoRA)."""
    users: dict[int, int] = {}
    for _, module in _parametrized(model):
        for plist in module.parametrizations.values():
            for key in set(map(id, _chain_tensors(plist))):
                users[key] = users.get(key, 0) + 1
    return {key for key, count in users.items() if count > 1}


def _lowest_precision(model: nn.Module, outputs: Any) -> torch.dtype:
    tensors = [*model.parameters(), *model.buffers(), *tensors_of(outputs)]
    dtypes = {t.dtype for t in tensors if t.is_floating_point()} or {torch.float32}
    return max(dtypes, key=lambda d: torch.finfo(d).eps)
