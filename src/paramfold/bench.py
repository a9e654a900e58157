"""Compile-time benchmark: baseline vs stock parametrized vs each paramfold mode.

This module is a library; ``paramfold bench`` (in :mod:`paramfold.cli`) only renders what
:func:`run_bench` returns.  One run measures every variant side by side in the same process:

* ``baseline``: the same architecture without any parametrization, its tensors holding the values
  the parametrized model computes (same dtype);
* ``stock``: the parametrized model as ``torch.nn.utils.parametrize`` leaves it;
* ``hoist``, ``inline``, ``freeze``, ``auto``: the parametrized model after
  ``paramfold.prepare(model, mode=...)``.

For every repeat the variants are measured one after the other (their order rotates from repeat to
repeat), each from a fresh ``torch._dynamo.reset()``, a model rebuilt from the same seed and cold
inductor caches, after one discarded warm-up round of every variant.  A measurement times the
first call (compile + run, with the cyclic GC paused as ``timeit`` does), in wall time and in CPU
time (steadier when other processes share the cores), and the steady per-call time, and records
deterministic proxies (graphs, graph breaks, recompiles, captured calls) and the largest absolute
difference between the variant's output and the stock model's.

Example::

    >>> from paramfold.bench import BenchConfig, run_bench
    >>> result = run_bench(BenchConfig(layers=2, repeats=1, steady_calls=1, warmup_calls=0,
    ...                                variants=("baseline", "stock")))
    >>> [v.name for v in result.variants]
    ['baseline', 'stock']
    >>> result.variant("stock").max_abs_diff
    0.0
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from paramfold.recompiles import is_limit_message, is_recompile  # torch 2.5 .. 2.15 wording

__all__ = [
    "BACKENDS",
    "ENTRIES",
    "MODELS",
    "VARIANT_NAMES",
    "BenchConfig",
    "BenchResult",
    "ModelSpec",
    "Proxies",
    "Sample",
    "Variant",
    "VariantResult",
    "build_model",
    "describe_config",
    "default_variants",
    "make_input",
    "plain_progress",
    "print_table",
    "run_bench",
    "to_rich_table",
    "unparametrize",
]

SCHEMA_VERSION = 1
BACKENDS = ("eager", "aot_eager", "inductor")
ENTRIES = ("model", "method", "layers")


# --------------------------------------------------------------------------------------------
# Model zoo
# --------------------------------------------------------------------------------------------


class Layer(nn.Module):
    """One layer of the zoo: a ``Linear``, then the activation if there is one.

    The layers are a user-defined class, as in torchtune, because ``.compile()`` on a built-in
    ``nn.Linear`` compiles nothing (dynamo skips frames of ``torch.nn`` itself), which would leave
    ``--entry layers`` measuring plain eager execution.
    """

    def __init__(self, in_features: int, out_features: int, act: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=True)
        self.act = nn.GELU() if act else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        return self.act(x) if self.act is not None else x


class Stack(nn.Module):
    """``self.seq``: an ``nn.Sequential`` of :class:`Layer` with the given widths."""

    def __init__(self, dims: Sequence[int], act: bool) -> None:
        super().__init__()
        self.seq = nn.Sequential(*[Layer(a, b, act) for a, b in zip(dims[:-1], dims[1:])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(x)


class CastToBFloat16(nn.Module):
    """The seed's dtype-changing parametrization (``half`` on CUDA there, ``bfloat16`` on CPU here)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16)

    def right_inverse(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32)


def _build_seed(layers: int, width: int) -> nn.Module:
    # Seed 003: a Sequential of N Linear(W, W), no activation, every parameter cast on access.
    model = Stack([width] * (layers + 1), act=False)
    for module in list(model.modules()):
        for name, param in list(module._parameters.items()):
            if param is not None:
                parametrize.register_parametrization(module, name, CastToBFloat16(), unsafe=True)
    return model


def _build_weight_norm(layers: int, width: int) -> nn.Module:
    half = max(width // 2, 1)
    model = Stack([half if i % 2 == 0 else width for i in range(layers + 1)], act=True)
    for layer in model.seq:
        torch.nn.utils.parametrizations.weight_norm(layer.linear)
    return model


def _build_spectral_norm(layers: int, width: int) -> nn.Module:
    model = Stack([width] * (layers + 1), act=True)
    for layer in model.seq:
        torch.nn.utils.parametrizations.spectral_norm(layer.linear)
    return model


def _build_orthogonal(layers: int, width: int) -> nn.Module:
    model = Stack([width] * (layers + 1), act=True)
    for layer in model.seq:
        torch.nn.utils.parametrizations.orthogonal(layer.linear)
    return model


def _build_weight_norm_hooks(layers: int, width: int) -> nn.Module:
    model = _build_weight_norm_plain(layers, width)
    for layer in model.seq:
        _hook_based(torch.nn.utils.weight_norm, layer.linear)
    return model


def _build_spectral_norm_hooks(layers: int, width: int) -> nn.Module:
    model = Stack([width] * (layers + 1), act=True)
    for layer in model.seq:
        _hook_based(torch.nn.utils.spectral_norm, layer.linear)
    return model


def _build_weight_norm_plain(layers: int, width: int) -> nn.Module:
    half = max(width // 2, 1)
    return Stack([half if i % 2 == 0 else width for i in range(layers + 1)], act=True)


def _hook_based(norm: Callable[[nn.Module], nn.Module], module: nn.Module) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the hook-based API
        norm(module)


@dataclass(frozen=True)
class ModelSpec:
    """One entry of the model zoo: how to build the stock parametrized model and its input."""

    name: str
    description: str
    default_layers: int
    default_width: int
    build: Callable[[int, int], nn.Module]
    input_features: Callable[[int], int]
    dtype: torch.dtype


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "seed",
            "seed 003: N Linear(W,W), every weight and bias cast to bfloat16 (unsafe=True)",
            32, 128, _build_seed, lambda w: w, torch.bfloat16,
        ),
        ModelSpec(
            "weight_norm",
            "N Linear alternating W/2 <-> W with parametrizations.weight_norm, GELU between",
            16, 128, _build_weight_norm, lambda w: max(w // 2, 1), torch.float32,
        ),
        ModelSpec(
            "spectral_norm",
            "N Linear(W,W) with parametrizations.spectral_norm, GELU between",
            16, 64, _build_spectral_norm, lambda w: w, torch.float32,
        ),
        ModelSpec(
            "weight_norm_hooks",
            "as weight_norm, with the deprecated hook-based torch.nn.utils.weight_norm",
            16, 128, _build_weight_norm_hooks, lambda w: max(w // 2, 1), torch.float32,
        ),
        ModelSpec(
            "spectral_norm_hooks",
            "as spectral_norm, with the deprecated hook-based torch.nn.utils.spectral_norm",
            16, 64, _build_spectral_norm_hooks, lambda w: w, torch.float32,
        ),
        ModelSpec(
            "orthogonal",
            "N Linear(W,W) with parametrizations.orthogonal (matrix_exp), GELU between",
            16, 64, _build_orthogonal, lambda w: w, torch.float32,
        ),
    )
}


# --------------------------------------------------------------------------------------------
# Configuration and variants
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    """What to measure.  ``layers``/``width`` of ``None`` mean the model's defaults.

    ``variants`` of ``None`` means every variant; ``baseline`` and ``stock`` are always measured
    (ratios are taken to the baseline, outputs are compared to stock).  ``threads`` is set with
    ``torch.set_num_threads`` for the run (``None``: leave torch's setting); one thread by default
    because compiling is single-threaded, the zoo's matmuls are tiny, and OpenMP threads waiting
    for each other on shared cores turn steady calls of ~1 ms into hundreds of ms.  ``device`` is
    where the model and input live (``"cuda"``: the run synchronises the device around each timed
    call).
    """

    model: str = "seed"
    layers: int | None = None
    width: int | None = None
    backend: str = "eager"
    entry: str = "model"
    train: bool = False
    repeats: int = 3
    steady_calls: int = 10
    warmup_calls: int = 2
    batch: int = 8
    seed: int = 0
    variants: tuple[str, ...] | None = None
    warmup_round: bool = True
    cold_caches: bool = True
    threads: int | None = 1
    device: str = "cpu"

    def __post_init__(self) -> None:
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"unknown device {self.device!r}: {exc}") from None
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(MODELS)}")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}"
            )
        if self.entry not in ENTRIES:
            raise ValueError(f"unknown entry {self.entry!r}; choose one of {', '.join(ENTRIES)}")
        for name, low in (("layers", 1), ("width", 2), ("threads", 1)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} must be at least {low}, got {value}")
        for name, low in (("repeats", 1), ("steady_calls", 1), ("warmup_calls", 0), ("batch", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be at least {low}, got {getattr(self, name)}")
        if self.variants is not None:
            unknown = [v for v in self.variants if v not in VARIANT_NAMES]
            if unknown:
                raise ValueError(
                    f"unknown variant(s) {', '.join(map(repr, unknown))}; "
                    f"choose from {', '.join(VARIANT_NAMES)}"
                )

    def check_device(self) -> None:
        """Raise ``ValueError`` if ``device`` cannot run here (a config read back from JSON may
        come from another machine, so this is checked before running, not on construction)."""
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} is not available here (no CUDA device)")

    @property
    def spec(self) -> ModelSpec:
        return MODELS[self.model]

    @property
    def n_layers(self) -> int:
        return self.layers if self.layers is not None else self.spec.default_layers

    @property
    def n_width(self) -> int:
        return self.width if self.width is not None else self.spec.default_width

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layers"], out["width"] = self.n_layers, self.n_width
        out["variants"] = list(self.variants) if self.variants is not None else None
        return out


@dataclass(frozen=True)
class Variant:
    """A named way to turn the freshly built stock model into the model that gets compiled.

    ``prepare`` may return the same module (changed in place) or a new one.  ``unavailable`` is a
    reason to skip the variant in every configuration; ``eval_only`` skips it for ``train=True``.
    """

    name: str
    prepare: Callable[[nn.Module], nn.Module]
    description: str = ""
    eval_only: bool = False
    unavailable: str | None = None


def unparametrize(model: nn.Module) -> nn.Module:
    """Turn ``model`` (in place) into the plain model holding the values its parametrizations compute.

    Unlike ``parametrize.remove_parametrizations(..., leave_parametrized=True)`` this also works
    when a parametrization changes the dtype (``unsafe=True``), as in seed 003.  Values are computed
    under ``no_grad`` in the model's current train/eval mode; ``requires_grad`` follows the originals.

    Example::

        >>> m = nn.Linear(3, 3)
        >>> _ = torch.nn.utils.parametrizations.weight_norm(m)
        >>> w = m.weight.detach().clone()
        >>> plain = unparametrize(m)
        >>> parametrize.is_parametrized(plain), torch.equal(plain.weight, w)
        (False, True)
    """
    from torch.nn.utils import remove_spectral_norm, remove_weight_norm

    from paramfold.hooknorms import hook_norms

    for module in list(model.modules()):
        for _, hook, kind in list(hook_norms(module)):
            originals = [module._parameters[n] for n in ((f"{hook.name}_g", f"{hook.name}_v") if kind == "weight_norm" else (f"{hook.name}_orig",))]
            requires_grad = any(t.requires_grad for t in originals)
            with torch.no_grad():
                # In training, stock's first forward runs one power iteration first: so does this.
                hook(module, None)
                (remove_weight_norm if kind == "weight_norm" else remove_spectral_norm)(module, hook.name)
            module._parameters[hook.name].requires_grad_(requires_grad)
        if not parametrize.is_parametrized(module):
            continue
        for name in list(module.parametrizations.keys()):
            plist = module.parametrizations[name]
            originals = [t for _, t in plist.named_parameters(recurse=False)] or list(
                plist.buffers(recurse=False)
            )
            is_param = any(isinstance(t, nn.Parameter) for t in originals)
            requires_grad = any(t.requires_grad for t in originals)
            with torch.no_grad():
                value = getattr(module, name).detach().clone()
            # torch refuses leave_parametrized=False for tuple originals, and True for a dtype
            # change; either way the value is replaced below.
            parametrize.remove_parametrizations(
                module, name, leave_parametrized=len(originals) > 1
            )
            delattr(module, name)
            if is_param:
                module.register_parameter(name, nn.Parameter(value, requires_grad=requires_grad))
            else:
                module.register_buffer(name, value)
    return model


def _paramfold_prepare(mode: str) -> Callable[[nn.Module], nn.Module]:
    def prepare(model: nn.Module) -> nn.Module:
        import paramfold

        return paramfold.prepare(model, mode=mode)

    prepare.__name__ = f"prepare_{mode}"
    return prepare


_MODE_DESCRIPTIONS = {
    "hoist": "values computed outside the compiled code",
    "inline": "values computed in-graph through a lean functional call",
    "freeze": "values materialised once (inference only)",
    "auto": "freeze what is frozen, hoist the rest",
}


def default_variants() -> list[Variant]:
    """baseline, stock and every paramfold mode (marked unavailable if ``paramfold.prepare`` is missing)."""
    import paramfold

    missing = None if hasattr(paramfold, "prepare") else "paramfold.prepare not available yet"
    variants = [
        Variant("baseline", unparametrize, "same architecture, no parametrization"),
        Variant("stock", lambda model: model, "torch.nn.utils.parametrize as is"),
    ]
    for mode, text in _MODE_DESCRIPTIONS.items():
        variants.append(
            Variant(mode, _paramfold_prepare(mode), text, eval_only=mode == "freeze",
                    unavailable=missing)
        )
    return variants


VARIANT_NAMES = ("baseline", "stock", *_MODE_DESCRIPTIONS)


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass
class Proxies:
    """Deterministic compile proxies, read from ``torch._dynamo.utils.counters`` and compile metrics."""

    graphs: int
    graph_breaks: int
    recompiles: int
    captured_calls: int
    frames: int
    recompile_limit_hits: int = 0


@dataclass
class Sample:
    """One measurement of one variant."""

    repeat: int
    prepare_s: float
    first_call_s: float
    first_call_cpu_s: float
    steady_call_s: float
    steady_calls_s: list[float]
    proxies: Proxies
    max_abs_diff: float | None = None


@dataclass
class VariantResult:
    """All samples of one variant; ``status`` is ``ok``, ``skipped`` or ``error`` (see ``note``)."""

    name: str
    description: str
    status: str = "ok"
    note: str = ""
    samples: list[Sample] = field(default_factory=list)

    def _first(self) -> list[float]:
        return [s.first_call_s for s in self.samples]

    @property
    def first_call_min(self) -> float | None:
        return min(self._first()) if self.samples else None

    @property
    def first_call_median(self) -> float | None:
        return statistics.median(self._first()) if self.samples else None

    @property
    def first_call_cpu_min(self) -> float | None:
        return min(s.first_call_cpu_s for s in self.samples) if self.samples else None

    @property
    def steady_call_median(self) -> float | None:
        return statistics.median(s.steady_call_s for s in self.samples) if self.samples else None

    @property
    def prepare_median(self) -> float | None:
        return statistics.median(s.prepare_s for s in self.samples) if self.samples else None

    @property
    def proxies(self) -> Proxies | None:
        """The proxies of the first sample (they are deterministic; see ``proxies_stable``)."""
        return self.samples[0].proxies if self.samples else None

    @property
    def proxies_stable(self) -> bool:
        return all(s.proxies == self.samples[0].proxies for s in self.samples)

    @property
    def max_abs_diff(self) -> float | None:
        diffs = [s.max_abs_diff for s in self.samples if s.max_abs_diff is not None]
        return max(diffs) if diffs else None


@dataclass
class BenchResult:
    """What :func:`run_bench` measured; :meth:`to_dict` is the ``--json`` document."""

    config: BenchConfig
    environment: dict[str, Any]
    variants: list[VariantResult]

    def variant(self, name: str) -> VariantResult:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(f"no variant {name!r} in this result")

    def ratio(self, name: str, stat: str = "min") -> float | None:
        """First-call time of ``name`` over the baseline's.

        ``stat`` is ``min`` or ``median`` (wall time), or ``cpu`` (min of CPU time).
        """
        attr = {"min": "first_call_min", "median": "first_call_median",
                "cpu": "first_call_cpu_min"}[stat]
        num, den = getattr(self.variant(name), attr), getattr(self.variant("baseline"), attr)
        return num / den if num is not None and den else None

    def to_dict(self) -> dict[str, Any]:
        variants = []
        for v in self.variants:
            proxies = v.proxies
            variants.append(
                {
                    "name": v.name,
                    "description": v.description,
                    "status": v.status,
                    "note": v.note,
                    "first_call_s": {"min": v.first_call_min, "median": v.first_call_median},
                    "first_call_cpu_s_min": v.first_call_cpu_min,
                    "ratio_to_baseline": {
                        "min": self.ratio(v.name, "min"),
                        "median": self.ratio(v.name, "median"),
                        "cpu": self.ratio(v.name, "cpu"),
                    },
                    "steady_call_s_median": v.steady_call_median,
                    "prepare_s_median": v.prepare_median,
                    "proxies": asdict(proxies) if proxies is not None else None,
                    "proxies_stable": v.proxies_stable,
                    "max_abs_diff_vs_stock": v.max_abs_diff,
                    "samples": [asdict(s) for s in v.samples],
                }
            )
        return {
            "schema": f"paramfold.bench/{SCHEMA_VERSION}",
            "config": self.config.to_dict(),
            "environment": self.environment,
            "variants": variants,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> BenchResult:
        """Rebuild a result from :meth:`to_dict` output (e.g. a saved ``--json`` document)."""
        if doc.get("schema") != f"paramfold.bench/{SCHEMA_VERSION}":
            raise ValueError(
                f"not a paramfold bench document (schema {doc.get('schema')!r}); "
                "write one with `paramfold bench --json`"
            )
        config = dict(doc["config"])
        if config.get("variants") is not None:
            config["variants"] = tuple(config["variants"])
        variants = []
        for v in doc["variants"]:
            samples = [
                Sample(**{**s, "proxies": Proxies(**s["proxies"])}) for s in v["samples"]
            ]
            variants.append(VariantResult(v["name"], v["description"], v["status"], v["note"],
                                          samples))
        return cls(BenchConfig(**config), dict(doc["environment"]), variants)


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------


def build_model(config: BenchConfig) -> nn.Module:
    """The stock parametrized model of ``config``, built from ``config.seed``, in train/eval mode.

    In eval mode nothing requires grad (an inference benchmark; it is what lets ``freeze`` apply).
    """
    torch.manual_seed(config.seed)
    model = config.spec.build(config.n_layers, config.n_width).to(config.device)
    model.train(config.train)
    if not config.train:
        model.requires_grad_(False)
    return model


def make_input(config: BenchConfig) -> torch.Tensor:
    """The input of ``config``'s model: ``(batch, features)`` from a generator seeded by ``config.seed``."""
    gen = torch.Generator().manual_seed(config.seed + 1)
    x = torch.randn(config.batch, config.spec.input_features(config.n_width), generator=gen)
    return x.to(device=config.device, dtype=config.spec.dtype)


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


def run_bench(
    config: BenchConfig,
    *,
    variants: Sequence[Variant] | None = None,
    on_progress: Callable[[int, int, str], None] | None = None,
) -> BenchResult:
    """Measure every variant of ``config`` side by side and return the samples.

    ``variants`` defaults to :func:`default_variants` filtered by ``config.variants`` (baseline and
    stock are always kept).  ``on_progress(done, total, label)`` is called before each measurement
    and once at the end.  A variant that fails is recorded with ``status="error"`` and the others
    still run.

    Example::

        >>> r = run_bench(BenchConfig(model="weight_norm", layers=2, repeats=1, steady_calls=1,
        ...                           variants=("baseline", "stock")))
        >>> r.variant("baseline").proxies.graph_breaks
        0
    """
    config.check_device()
    if variants is None:
        variants = default_variants()
    wanted = None if config.variants is None else {"baseline", "stock", *config.variants}
    variants = [v for v in variants if wanted is None or v.name in wanted]
    names = [v.name for v in variants]
    if "baseline" not in names or "stock" not in names:
        raise ValueError("variants must include 'baseline' and 'stock'")

    results = {v.name: VariantResult(v.name, v.description) for v in variants}
    active: list[Variant] = []
    for v in variants:
        if v.unavailable:
            results[v.name].status, results[v.name].note = "skipped", v.unavailable
        elif v.eval_only and config.train:
            results[v.name].status = "skipped"
            results[v.name].note = "inference only: skipped for --train"
        else:
            active.append(v)

    x = make_input(config)
    total = (config.repeats + int(config.warmup_round)) * len(active)
    done = 0

    def progress(label: str) -> None:
        if on_progress is not None:
            on_progress(done, total, label)

    with _metrics_limit(100_000), _num_threads(config.threads):
        if config.warmup_round:
            # Pays the process's one-time costs (imports, dynamo's per-code-object caches, the
            # first tokenizing of each source file for FX stack traces) outside the samples, for
            # every variant: otherwise whichever variant first runs some code pays for it.
            for v in active:
                progress(f"warm-up (discarded): {v.name}")
                with contextlib.suppress(Exception):  # a failing variant is recorded below
                    _measure(v, config, x, -1)
                done += 1
        for repeat in range(config.repeats):
            shift = repeat % len(active)
            order = active[shift:] + active[:shift]
            outputs: dict[str, torch.Tensor] = {}
            for v in order:
                progress(f"repeat {repeat + 1}/{config.repeats}: {v.name}")
                res = results[v.name]
                if res.status == "ok":
                    try:
                        sample, out = _measure(v, config, x, repeat)
                    except Exception as exc:  # recorded and shown; the other variants still run
                        res.status, res.note = "error", f"{type(exc).__name__}: {exc}"
                        res.samples.clear()
                    else:
                        res.samples.append(sample)
                        outputs[v.name] = out
                done += 1
            stock_out = outputs.get("stock")
            for name, out in outputs.items():
                if stock_out is not None and results[name].samples:
                    results[name].samples[-1].max_abs_diff = _max_abs_diff(out, stock_out)
        environment = _environment(config.device)
    torch._dynamo.reset()
    progress("done")
    return BenchResult(config, environment, [results[n] for n in names])


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def _ms(seconds: float | None, digits: int = 0) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _diff(value: float | None) -> str:
    if value is None:
        return "-"
    return "0" if value == 0 else f"{value:.2e}"


def describe_config(result: BenchResult) -> str:
    """One line saying what ``result`` measured and where."""
    c, env = result.config, result.environment
    mode = "train step" if c.train else "eval (no_grad)"
    return (
        f"model={c.model} layers={c.n_layers} width={c.n_width} batch={c.batch} "
        f"backend={c.backend} entry={c.entry} {mode} repeats={c.repeats} "
        f"| torch {env['torch']}, {env['torch_threads']} threads"
        + (f", {c.device} ({env.get('device', '?')})" if c.device != "cpu" else "")
    )


def _notes(v: VariantResult) -> str:
    p = v.proxies
    note = v.note.splitlines()[0][:100] if v.note else ""
    if p is not None and p.recompile_limit_hits:
        note = (note + "; " if note else "") + (
            "hit dynamo's recompile_limit: code past it runs uncompiled"
        )
    if v.samples and not v.proxies_stable:
        note = (note + "; " if note else "") + "proxies differ between repeats (see --json)"
    return note


def to_rich_table(result: BenchResult, *, wide: bool = True) -> Any:
    """A ``rich.table.Table`` of ``result``: first-call times and ratios, steady time, proxies.

    ``wide=False`` is the compact table ``paramfold bench`` prints by default (about 95 columns:
    no CPU-time, prepare-time or note columns; :func:`print_table` prints the notes under it).

    Example::

        >>> r = run_bench(BenchConfig(layers=1, repeats=1, steady_calls=1,
        ...                           variants=("baseline", "stock")))
        >>> to_rich_table(r).row_count, len(to_rich_table(r, wide=False).columns)
        (2, 9)
    """
    from rich import box
    from rich.table import Table

    table = Table(title="paramfold bench: first compiled call (compile + run)",
                  caption=describe_config(result),
                  box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD,
                  collapse_padding=not wide, pad_edge=wide)
    table.add_column("variant", style="bold", no_wrap=True)
    names = ["first ms\nmin / med", "x baseline\nmin / med"]
    if wide:
        names += ["first cpu\nms (min)", "x baseline\ncpu"]
    names += ["steady\nms/call"]
    if wide:
        names += ["prepare\nms"]
    names += ["graphs", "breaks", "recomp", "ops", "max|diff|\nvs stock"]
    for name in names:
        table.add_column(name, justify="right", no_wrap=True)
    if wide:
        table.add_column("note")
    for v in result.variants:
        p = v.proxies
        proxies = ["-"] * 4 if p is None else [
            str(p.graphs), str(p.graph_breaks), str(p.recompiles), str(p.captured_calls)
        ]
        cells = [
            v.name,
            f"{_ms(v.first_call_min)} / {_ms(v.first_call_median)}",
            f"{_ratio(result.ratio(v.name, 'min'))} / {_ratio(result.ratio(v.name, 'median'))}",
        ]
        if wide:
            cells += [_ms(v.first_call_cpu_min), _ratio(result.ratio(v.name, "cpu"))]
        cells += [_ms(v.steady_call_median, 3)]
        if wide:
            cells += [_ms(v.prepare_median, 1)]
        cells += [*proxies, _diff(v.max_abs_diff)]
        if wide:
            cells += [_notes(v)]
        style = {"error": "red", "skipped": "dim"}.get(v.status)
        table.add_row(*cells, style=style)
    return table


def print_table(result: BenchResult, *, wide: bool = False, console: Any = None) -> None:
    """Print the table of ``result`` (compact unless ``wide``) and, if compact, its notes under it.

    The console is ``rich``'s default on a terminal; when writing to a pipe or a file it is as wide
    as ``COLUMNS`` says, else wide enough for the table (nothing wrapped or cut).
    """
    from rich.console import Console
    from rich.markup import escape

    if console is None:
        console = Console()
        if not console.is_terminal and not os.environ.get("COLUMNS"):
            console = Console(width=200)
    console.print(to_rich_table(result, wide=wide))
    if not wide:
        for v in result.variants:
            note = _notes(v)
            if note:
                console.print(f"  {escape(v.name)}: {escape(note)}", highlight=False)
        console.print("  (--wide adds the CPU-time and prepare-time columns)", style="dim",
                      highlight=False)


def plain_progress(stream: Any) -> Callable[[int, int, str], None]:
    """An ``on_progress`` for :func:`run_bench` that writes one plain line per measurement.

    For a log, a CI job or ``| tee``: where ``rich``'s live progress bar would show nothing.

    Example::

        >>> import io
        >>> out = io.StringIO()
        >>> report = plain_progress(out)
        >>> report(0, 12, "warm-up (discarded): baseline")
        >>> out.getvalue().splitlines()
        ['paramfold bench: [ 1/12, 0 s] warm-up (discarded): baseline']
    """
    start = time.perf_counter()

    def report(done: int, total: int, label: str) -> None:
        step = min(done + 1, total) if label != "done" else done
        width = len(str(total))
        stream.write(f"paramfold bench: [{step:>{width}}/{total}, "
                     f"{time.perf_counter() - start:.0f} s] {label}\n")
        stream.flush()

    return report
