"""What one benchmark run measures (:class:`BenchConfig`), and the model and input it builds.

A config is plain data, validated on construction (so the CLI can turn a bad value into one line)
and written into every result, so a saved ``--json`` document says what was measured.
:func:`build_model` and :func:`make_input` live here, not in :mod:`~paramfold.bench.zoo`, because
they read a config: the zoo knows nothing of configs, and nothing imports in a cycle.
"""

from __future__ import annotations

import reprlib
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from paramfold.bench.variants import VARIANT_NAMES
from paramfold.bench.zoo import MODELS, ZooModel
from paramfold.errors import one_line

__all__ = ["BACKENDS", "ENTRIES", "LIMITS", "PHASES", "BenchConfig", "Phase", "build_model", "make_input", "parse_layer_counts"]

BACKENDS = ("eager", "aot_eager", "inductor")
ENTRIES = ("model", "method", "layers")

#: The range (lowest, highest) of every integer setting of :class:`BenchConfig`, checked on
#: construction; ``paramfold bench --help`` states those of its options (the CLI holds a copy,
#: which test_cli checks against this table). The ceilings are practical: far above any run worth
#: timing (README's largest is ``--layers 512``; one ``width`` x ``width`` float32 weight at the
#: ceiling is 1 GiB), and low enough that every accepted value builds a model and an input torch
#: can size, instead of an ``OverflowError`` in every variant after the work has started.
LIMITS: dict[str, tuple[int, int]] = {
    "layers": (1, 10_000),
    "width": (2, 16_384),
    "batch": (1, 65_536),
    "repeats": (1, 1_000),
    "steady_rounds": (1, 1_000),
    "steady_calls": (1, 10_000),
    "warmup_calls": (0, 10_000),
    # A fixed ceiling, not one from this machine's CPU count: a config is also read back from a
    # saved document (BenchResult.from_dict), perhaps on another machine. It is above the CPUs of
    # nearly any machine (the bench runs best on 1); far above it OpenMP cannot start the threads
    # and ends the process itself (30000: libgomp exits; 100000: a segmentation fault).
    "threads": (1, 1_024),
}


def check_range(name: str, value: int) -> None:
    """Raise ``ValueError`` (``"<name> must be at least/most ..."``) if ``value`` is outside ``LIMITS[name]``."""
    low, high = LIMITS[name]
    if value < low:
        raise ValueError(f"{name} must be at least {low}, got {_number(value)}")
    if value > high:
        raise ValueError(f"{name} must be at most {high}, got {_number(value)}")


def _number(value: int | str) -> str:
    """``value`` for a one-line message: a number of hundreds of digits is shortened."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"


@dataclass(frozen=True)
class Phase:
    """What one timed call does, and the words tables, documents and figures use for it."""

    name: str
    option: str  # the CLI option that selects it
    label: str  # in a table's description line
    steady_what: str  # what the steady time is, in a title
    unit: str  # what one steady time is, in a JSON document
    count: str  # what a steady round counts
    short: str  # "per <short>", in a figure's axis


#: ``eval``: a ``no_grad`` forward in eval mode; ``grad``: a forward in training mode recording
#: autograd, no backward (what compiling costs where hoisted values require grad); ``train``: a
#: training step.
PHASES = {
    "eval": Phase("eval", "--eval", "eval (no_grad)", "per call (eval, no_grad)",
                  "seconds per call (eval, no_grad)", "calls", "call"),
    "grad": Phase("grad", "--grad", "grad forward (train mode, no backward)",
                  "per call (forward with grad, no backward)",
                  "seconds per call (forward in train mode recording autograd, no backward)",
                  "calls", "call"),
    "train": Phase("train", "--train", "train step", "per training step (forward + backward)",
                   "seconds per training step (zero_grad, forward, backward)", "steps", "training step"),
}


@dataclass(frozen=True)
class BenchConfig:
    """What to measure.  ``layers``/``width`` of ``None`` mean the model's defaults.

    ``variants`` of ``None`` means every variant; ``baseline`` and ``stock`` are always measured
    (ratios are taken to the baseline, outputs are compared to stock).  ``threads`` is set with
    ``torch.set_num_threads`` for the run (``None``: leave torch's setting; at most 1024, :data:`LIMITS`); one thread by default
    because compiling is single-threaded, the zoo's matmuls are tiny, and OpenMP threads waiting
    for each other on shared cores turn steady calls of ~1 ms into hundreds of ms.  ``device`` is
    where the model and input live (``"cuda"``: the run synchronises the device around each timed
    call).

    ``repeats`` first compiled calls are timed per variant, each in a fresh compile state. The
    steady time is then measured for all variants side by side: each is compiled once more and
    called ``warmup_calls`` times, then ``steady_rounds`` interleaved rounds of ``steady_calls``
    calls (a no_grad forward; with ``grad`` a forward in training mode that records autograd,
    and no backward; with ``train`` a training step: ``zero_grad``, forward, backward) time every
    variant in turn.
    """

    model: str = "seed"
    layers: int | None = None
    width: int | None = None
    backend: str = "eager"
    entry: str = "model"
    train: bool = False
    grad: bool = False
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
    steady_rounds: int = 5

    def __post_init__(self) -> None:
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"unknown device {self.device!r}: {one_line(str(exc))}") from None
        if self.train and self.grad:
            raise ValueError("--grad is a forward without backward and --train a whole step: give one of them")
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(MODELS)}")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}"
            )
        if self.entry not in ENTRIES:
            raise ValueError(f"unknown entry {self.entry!r}; choose one of {', '.join(ENTRIES)}")
        for name in LIMITS:  # layers and width: None is the model's default; threads: torch's setting
            if getattr(self, name) is not None:
                check_range(name, getattr(self, name))
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
        kind = torch.device(self.device).type
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r}: the bench runs on cpu or cuda")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} is not available here (no CUDA device)")

    @property
    def phase(self) -> Phase:
        """What one timed call does (:data:`PHASES`)."""
        return PHASES["train" if self.train else "grad" if self.grad else "eval"]

    @property
    def trainable(self) -> bool:
        """Whether the model is built trainable: in training mode, its tensors requiring grad."""
        return self.train or self.grad

    @property
    def spec(self) -> ZooModel:
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


def build_model(config: BenchConfig) -> nn.Module:
    """The stock parametrized model of ``config``, built from ``config.seed``, in train/eval mode.

    In eval mode nothing requires grad (an inference benchmark; it is what lets ``freeze`` apply).
    """
    torch.manual_seed(config.seed)
    model = config.spec.build(config.n_layers, config.n_width).to(config.device)
    model.train(config.trainable)
    if not config.trainable:
        model.requires_grad_(False)
    return model


def make_input(config: BenchConfig) -> torch.Tensor:
    """The input of ``config``'s model: ``(batch, features)`` from a generator seeded by ``config.seed``."""
    gen = torch.Generator().manual_seed(config.seed + 1)
    x = torch.randn(config.batch, config.spec.input_features(config.n_width), generator=gen)
    return x.to(device=config.device, dtype=config.spec.dtype)


def parse_layer_counts(text: str, layers: int | None = None) -> tuple[int, ...]:
    """The layer counts of ``--sweep-layers`` (``"32,128,512"``); ``ValueError`` says what is wrong.

    ``layers`` is ``--layers``, which a sweep replaces: giving both is an error.

    Example::

        >>> parse_layer_counts("2, 4,8")
        (2, 4, 8)
    """
    if layers is not None:
        raise ValueError("--sweep-layers replaces --layers: give one of them")
    words = [w.strip() for w in text.split(",")]
    if not all(w.isascii() and w.isdigit() for w in words):  # isdigit() alone takes '²', which int() refuses
        raise ValueError(
            f"--sweep-layers takes layer counts separated by commas, e.g. 32,128,512; got {reprlib.repr(text)}"
        )
    low, high = LIMITS["layers"]
    found: list[int] = []
    for word in words:
        digits = word.lstrip("0") or "0"
        # a count longer than the ceiling is too big without int(), which refuses thousands of digits
        n = int(digits) if len(digits) <= len(str(high)) else high + 1
        if not low <= n <= high:
            bound = f"least {low}" if n < low else f"most {high}"
            raise ValueError(f"--sweep-layers: each layer count must be at {bound}, got {_number(digits)}")
        found.append(n)
    counts = tuple(found)
    if len(set(counts)) != len(counts):
        raise ValueError(f"--sweep-layers lists a layer count twice: {text!r}")
    return counts
