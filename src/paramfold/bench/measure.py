"""How one variant is measured: its first compiled call, a steady round, dynamo's counters.

Everything that touches torch's global compile state (``torch._dynamo.reset()``, counters,
inductor caches, thread count, the cyclic GC, dynamo's per-code caches) is here, as small
functions and context managers, so that the order of a run (:mod:`~paramfold.bench.run`) reads
apart from how each step is done.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import platform
import tempfile
import time
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paramfold.bench.config import BenchConfig, build_model
from paramfold.bench.result import Proxies, Sample
from paramfold.bench.variants import Variant
from paramfold.bench.zoo import Layer, Stack
from paramfold.recompiles import is_limit_message, is_recompile  # torch 2.5 .. 2.15 wording

__all__ = [
    "Compiled",
    "compile_model",
    "compiled_for_steady",
    "cpu_seconds",
    "environment",
    "first_call",
    "fresh_compile_state",
    "gc_paused",
    "heap_frozen",
    "max_abs_diff",
    "metrics_limit",
    "num_threads",
    "own_code",
    "read_proxies",
    "step",
    "time_round",
]


def compile_model(model: nn.Module, config: BenchConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    if config.entry == "model":
        return torch.compile(model, backend=config.backend)
    if config.entry == "method":
        model.compile(backend=config.backend)
        return model
    seq = getattr(model, "seq", None)
    if not isinstance(seq, nn.Sequential):
        raise ValueError("entry 'layers' needs the model's layers in an nn.Sequential at .seq")
    for layer in seq:
        layer.compile(backend=config.backend)
    return model


def cpu_seconds() -> float:
    """CPU time of this process, its waited-for children (g++) and its live children.

    Less sensitive than wall time to other processes sharing the cores.  Live children (inductor's
    compile workers) are only seen when psutil is installed.
    """
    try:
        import resource
    except ImportError:  # Windows
        total = time.process_time()
    else:
        own = resource.getrusage(resource.RUSAGE_SELF)
        waited = resource.getrusage(resource.RUSAGE_CHILDREN)
        total = own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime
    try:
        import psutil
    except ImportError:
        return total
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system
    return total


def step(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, phase: str) -> torch.Tensor:
    """One timed call of ``phase`` (:data:`~paramfold.bench.config.PHASES`): its output, detached."""
    if phase == "train":
        out = fn(x)
        out.mean().backward()
        out = out.detach()
    elif phase == "grad":
        with torch.enable_grad():
            out = fn(x).detach()
    else:
        with torch.no_grad():
            out = fn(x)
    if out.is_cuda:  # time the work, not its launch
        torch.cuda.synchronize(out.device)
    return out


def read_proxies() -> Proxies:
    from torch._dynamo.utils import counters, get_compilation_metrics

    return Proxies(
        graphs=int(counters["stats"]["unique_graphs"]),
        graph_breaks=int(sum(counters["graph_break"].values())),
        recompiles=sum(1 for m in get_compilation_metrics() if is_recompile(m)),
        captured_calls=int(counters["stats"]["calls_captured"]),
        frames=int(counters["frames"]["ok"]),
        recompile_limit_hits=int(
            sum(n for msg, n in counters["unimplemented"].items() if is_limit_message(msg))
        ),
    )


@contextlib.contextmanager
def fresh_compile_state(cold_caches: bool) -> Iterator[None]:
    """``torch._dynamo.reset()``, cleared counters and, if asked, empty inductor caches."""
    from torch._dynamo.utils import clear_compilation_metrics, counters

    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    if not cold_caches:
        yield
        return
    # A fresh cache directory per measurement (deleted afterwards) and no FX-graph/AOT caches, so
    # that a variant whose graphs equal the baseline's is not served from the baseline's cache.
    from torch._inductor import utils as inductor_utils

    fresh_cache = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
    compiler_config = getattr(torch.compiler, "config", None)
    if compiler_config is not None and hasattr(compiler_config, "force_disable_caches"):
        no_caches = compiler_config.patch(force_disable_caches=True)
    else:  # torch < 2.6
        no_caches = torch._inductor.config.patch(force_disable_caches=True)
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
        stack.enter_context(no_caches)
        # torch's fresh cache keeps its folder when an exception (a failing variant, a Ctrl-C)
        # passes through it: made inside a folder of ours, removed whatever happens.
        parent = stack.enter_context(tempfile.TemporaryDirectory(prefix="paramfold-bench-"))
        accepts_dir = "dir" in inspect.signature(fresh_cache).parameters
        stack.enter_context(fresh_cache(dir=parent) if accepts_dir else fresh_cache())
        yield


@contextlib.contextmanager
def num_threads(threads: int | None) -> Iterator[None]:
    if threads is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextlib.contextmanager
def metrics_limit(size: int) -> Iterator[None]:
    # Recompiles are counted from the compile metrics, which torch keeps only for the last 64.
    from torch._dynamo import utils

    if not hasattr(utils, "set_compilation_metrics_limit"):
        yield
        return
    old = utils._compilation_metrics.maxlen or utils.DEFAULT_COMPILATION_METRICS_LIMIT
    utils.set_compilation_metrics_limit(size)
    try:
        yield
    finally:
        utils.set_compilation_metrics_limit(old)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect, then keep the cyclic GC off while timing, as ``timeit`` does.

    A compile allocates a great many objects; whether a full collection of the whole heap happens
    to fall inside one sample or another is what made single samples swing by 10% here.
    """
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def heap_frozen() -> Iterator[Callable[[], None]]:
    """Keep the objects alive at the start (torch's import, the caller's own) out of every
    collection until the end (:func:`gc.freeze`); the function it gives freezes what is alive
    then too (call it once what a run made to keep is made: dynamo's lazy imports, the compiled
    models of the steady phase).

    :func:`gc_paused` collects before each timed call so that no collection falls inside one;
    each such collection scans the whole heap, 0.1 s or more, and together they were half of a
    default ``paramfold bench``'s wall time. Frozen, it scans only what the run made since.
    Where the caller has already frozen objects of its own, nothing is frozen or thawed here.
    """
    if gc.get_freeze_count():
        yield lambda: None
        return

    def settle() -> None:
        gc.collect()
        gc.freeze()

    settle()
    try:
        yield settle
    finally:
        gc.unfreeze()


def first_call(variant: Variant, config: BenchConfig, x: torch.Tensor, repeat: int
               ) -> tuple[Sample, torch.Tensor]:
    """Build, prepare and compile a fresh model in a fresh compile state; time its first call."""
    with fresh_compile_state(config.cold_caches):
        model = build_model(config)
        gc.collect()
        t0 = time.perf_counter()
        model = variant.prepare(model)
        prepare_s = time.perf_counter() - t0
        fn = compile_model(model, config)
        with gc_paused():
            c0, t0 = cpu_seconds(), time.perf_counter()
            out = step(fn, x, config.phase.name)
            first_s = time.perf_counter() - t0
            first_cpu_s = cpu_seconds() - c0
        proxies = read_proxies()
    sample = Sample(
        repeat=repeat,
        prepare_s=prepare_s,
        first_call_s=first_s,
        first_call_cpu_s=first_cpu_s,
        steady_call_s=None,
        steady_calls_s=[],
        proxies=proxies,
    )
    return sample, out


@dataclass
class Compiled:
    """A variant's model compiled and warmed up for the steady rounds (:func:`compiled_for_steady`)."""

    model: nn.Module
    fn: Callable[[torch.Tensor], torch.Tensor]
    first_out: torch.Tensor


def own_code(model: nn.Module) -> nn.Module:
    """Give ``model``'s :class:`~paramfold.bench.zoo.Stack` and ``Layer`` classes code of its own.

    Dynamo keeps what it compiled on the code object of the frame it compiled (``forward``), and
    looks at every entry there, up to the recompile limit, before it compiles again. Compiled
    side by side in one process, the variants' models would share ``Stack.forward``'s entries:
    one variant's calls would first try the others' guards, and with ``--entry layers`` stock's
    per-layer recompiles would use up the limit for every variant after it. So each model gets a
    subclass per zoo class (same name, same ``forward`` bytecode, a new code object), shared by
    the modules of that model only: each variant's cache is what it would be in a process of its
    own.
    """
    copies: dict[type, type] = {}
    for module in model.modules():
        cls = type(module)
        if cls not in (Stack, Layer):
            continue
        if cls not in copies:
            f = cls.forward
            forward = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__,
                                         f.__defaults__, f.__closure__)
            forward.__qualname__ = f.__qualname__
            copies[cls] = type(cls.__name__, (cls,), {
                "forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            })
        module.__class__ = copies[cls]
    return model


def compiled_for_steady(variant: Variant, config: BenchConfig, x: torch.Tensor) -> Compiled:
    """A fresh model of ``variant`` with code of its own (:func:`own_code`), compiled and warmed up."""
    model = variant.prepare(own_code(build_model(config)))
    fn = compile_model(model, config)
    out = step(fn, x, config.phase.name)
    for _ in range(config.warmup_calls):
        model.zero_grad(set_to_none=True)
        step(fn, x, config.phase.name)
    return Compiled(model, fn, out)


def time_round(compiled: Compiled, x: torch.Tensor, config: BenchConfig) -> tuple[float, int]:
    """One steady round: seconds per call (or training step) over ``config.steady_calls`` calls,
    and the number of graphs compiled meanwhile (0 unless a call recompiled)."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    model, fn = compiled.model, compiled.fn
    with gc_paused():
        t0 = time.perf_counter()
        for _ in range(config.steady_calls):
            if config.train:
                model.zero_grad(set_to_none=True)
            step(fn, x, config.phase.name)
        seconds = (time.perf_counter() - t0) / config.steady_calls
    return seconds, int(counters["stats"]["unique_graphs"] - graphs)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.float() - b.float()).abs().max().item()) if a.numel() else 0.0


def environment(device: str) -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": _device_name(device),
    }


def _device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()

