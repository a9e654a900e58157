"""How one variant is measured: compile it, time its first call, read dynamo's counters.

Everything that touches torch's global compile state (``torch._dynamo.reset()``, counters,
inductor caches, thread count, the cyclic GC) is here, as small context managers, so that the
order of a run (:mod:`~paramfold.bench.run`) reads apart from how each step is done.
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from paramfold.bench.config import BenchConfig, build_model
from paramfold.bench.result import Proxies, Sample
from paramfold.bench.variants import Variant
from paramfold.recompiles import is_limit_message, is_recompile  # torch 2.5 .. 2.15 wording


def _compile(model: nn.Module, config: BenchConfig) -> Callable[[torch.Tensor], torch.Tensor]:
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


def _cpu_seconds() -> float:
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


def _step(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, train: bool) -> torch.Tensor:
    if train:
        out = fn(x)
        out.mean().backward()
        out = out.detach()
    else:
        with torch.no_grad():
            out = fn(x)
    if out.is_cuda:  # time the work, not its launch
        torch.cuda.synchronize(out.device)
    return out


def _read_proxies() -> Proxies:
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
def _fresh_compile_state(cold_caches: bool) -> Iterator[None]:
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
        stack.enter_context(fresh_cache())
        yield


@contextlib.contextmanager
def _num_threads(threads: int | None) -> Iterator[None]:
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
def _metrics_limit(size: int) -> Iterator[None]:
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
def _gc_paused() -> Iterator[None]:
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


def _measure(variant: Variant, config: BenchConfig, x: torch.Tensor, repeat: int
             ) -> tuple[Sample, torch.Tensor]:
    with _fresh_compile_state(config.cold_caches):
        model = build_model(config)
        gc.collect()
        t0 = time.perf_counter()
        model = variant.prepare(model)
        prepare_s = time.perf_counter() - t0
        fn = _compile(model, config)
        with _gc_paused():
            c0, t0 = _cpu_seconds(), time.perf_counter()
            out = _step(fn, x, config.train)
            first_s = time.perf_counter() - t0
            first_cpu_s = _cpu_seconds() - c0
        for _ in range(config.warmup_calls):
            model.zero_grad(set_to_none=True)
            _step(fn, x, config.train)
        steady: list[float] = []
        for _ in range(config.steady_calls):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            _step(fn, x, config.train)
            steady.append(time.perf_counter() - t0)
        proxies = _read_proxies()
    sample = Sample(
        repeat=repeat,
        prepare_s=prepare_s,
        first_call_s=first_s,
        first_call_cpu_s=first_cpu_s,
        steady_call_s=statistics.median(steady),
        steady_calls_s=steady,
        proxies=proxies,
    )
    return sample, out


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.float() - b.float()).abs().max().item()) if a.numel() else 0.0


def _environment(device: str) -> dict[str, Any]:
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

