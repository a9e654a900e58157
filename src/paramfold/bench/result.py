"""What a run measured: samples, per-variant summaries, ratios, and the ``--json`` documents.

The result types are kept apart from the measurement so that a saved document can be read back
(:meth:`BenchResult.from_dict`, :meth:`SweepResult.from_dict`), rendered or plotted without
running anything. A document's ``schema`` field names the layout; a reader refuses another.

``paramfold.bench/2`` (:meth:`BenchResult.to_dict`, ``paramfold bench --json``)::

    schema        "paramfold.bench/2"
    config        BenchConfig's fields (layers and width resolved)
    environment   torch, python, platform, cpu_count, torch_threads, device
    steady_unit   what one steady time is: a call (eval, no_grad) or a training step
    variants[]    name, description, status ("ok", "skipped", "error"), note,
                  first_call_s {min, median}, first_call_cpu_s_min,
                  ratio_to_baseline {min, median, cpu}         (first call / baseline's)
                  steady_s {min, median, rounds[]}             (seconds per call or step)
                  steady_ratio_to_baseline {min, median}       (steady / baseline's)
                  steady_call_s_median                         (= steady_s.median)
                  steady_compiles, steady_max_abs_diff_vs_stock,
                  prepare_s_median, proxies {graphs, graph_breaks, recompiles, captured_calls,
                  frames, recompile_limit_hits}, proxies_stable, max_abs_diff_vs_stock,
                  samples[] (one per repeat: Sample's fields)

Schema 1 (before the interleaved steady rounds) is still read: its steady time is the median of
each sample's own calls. ``paramfold.bench.sweep/1`` (:meth:`SweepResult.to_dict`, ``paramfold
bench --sweep-layers ... --json``) holds ``layers`` and one ``paramfold.bench/2`` document per
layer count in ``runs``.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from paramfold.bench.config import BenchConfig

__all__ = ["SCHEMA_VERSION", "BenchResult", "Proxies", "Sample", "SweepResult", "VariantResult"]

SCHEMA_VERSION = 2
_READS = ("paramfold.bench/1", f"paramfold.bench/{SCHEMA_VERSION}")
SWEEP_SCHEMA = "paramfold.bench.sweep/1"

# BenchResult.ratio's statistics: the VariantResult property each one compares
_RATIO_STATS = {
    "min": "first_call_min",
    "median": "first_call_median",
    "cpu": "first_call_cpu_min",
    "steady_min": "steady_call_min",
    "steady_median": "steady_call_median",
}


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
    """One first-call measurement of one variant.

    ``steady_call_s`` and ``steady_calls_s`` are kept for documents of schema 1, where each
    measurement timed a few calls of its own; since schema 2 they are ``None`` and ``[]`` and the
    steady time is measured in interleaved rounds (:attr:`VariantResult.steady_rounds_s`).
    """

    repeat: int
    prepare_s: float
    first_call_s: float
    first_call_cpu_s: float
    steady_call_s: float | None
    steady_calls_s: list[float]
    proxies: Proxies
    max_abs_diff: float | None = None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _paired_median(rounds: list[float], baseline: list[float]) -> float | None:
    # Round i of every variant ran in the same interleaved round; a variant that failed midway
    # has fewer rounds and no pairing.
    if not rounds or len(rounds) != len(baseline) or not all(baseline):
        return None
    return statistics.median(t / b for t, b in zip(rounds, baseline))


@dataclass
class VariantResult:
    """All measurements of one variant; ``status`` is ``ok``, ``skipped`` or ``error`` (see ``note``).

    ``steady_rounds_s`` holds one steady time per interleaved round (seconds per call, or per
    training step); ``steady_compiles`` counts graphs compiled during those rounds (0 unless
    something recompiled while being timed); ``steady_max_abs_diff`` is the difference from stock
    of the first output of the steady phase's model.
    """

    name: str
    description: str
    status: str = "ok"
    note: str = ""
    samples: list[Sample] = field(default_factory=list)
    steady_rounds_s: list[float] = field(default_factory=list)
    steady_compiles: int = 0
    steady_max_abs_diff: float | None = None

    def _first(self) -> list[float]:
        return [s.first_call_s for s in self.samples]

    @property
    def first_call_min(self) -> float | None:
        return min(self._first()) if self.samples else None

    @property
    def first_call_median(self) -> float | None:
        return _median(self._first())

    @property
    def first_call_cpu_min(self) -> float | None:
        return min(s.first_call_cpu_s for s in self.samples) if self.samples else None

    def _steady(self) -> list[float]:
        if self.steady_rounds_s:
            return self.steady_rounds_s
        # schema 1: each sample's own steady calls
        return [s.steady_call_s for s in self.samples if s.steady_call_s is not None]

    @property
    def steady_call_min(self) -> float | None:
        """Fastest interleaved round: seconds per call (eval) or per training step (train)."""
        return min(self._steady()) if self._steady() else None

    @property
    def steady_call_median(self) -> float | None:
        """Median over the interleaved rounds: seconds per call (eval) or per training step."""
        return _median(self._steady())

    @property
    def prepare_median(self) -> float | None:
        return _median([s.prepare_s for s in self.samples])

    @property
    def proxies(self) -> Proxies | None:
        """The proxies of the first sample (they are deterministic; see ``proxies_stable``)."""
        return self.samples[0].proxies if self.samples else None

    @property
    def proxies_stable(self) -> bool:
        return all(s.proxies == self.samples[0].proxies for s in self.samples)

    @property
    def max_abs_diff(self) -> float | None:
        """Largest difference from stock's output over every sample and the steady phase."""
        diffs = [s.max_abs_diff for s in self.samples if s.max_abs_diff is not None]
        if self.steady_max_abs_diff is not None:
            diffs.append(self.steady_max_abs_diff)
        return max(diffs) if diffs else None


@dataclass
class BenchResult:
    """What :func:`~paramfold.bench.run.run_bench` measured; :meth:`to_dict` is the ``--json`` document."""

    config: BenchConfig
    environment: dict[str, Any]
    variants: list[VariantResult]

    def variant(self, name: str) -> VariantResult:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(f"no variant {name!r} in this result")

    def ratio(self, name: str, stat: str = "min") -> float | None:
        """A time of ``name`` over the baseline's (the plain, unparametrized model).

        ``stat`` is the first compiled call's ``min`` or ``median`` (wall time) or ``cpu`` (min of
        CPU time), or the steady time's ``steady_min`` or ``steady_median`` (over the rounds), or
        ``steady_paired``: the median over rounds of each round's time over the baseline's in the
        same round, which a machine whose speed drifts between rounds moves least.
        """
        if stat == "steady_paired":
            return _paired_median(self.variant(name).steady_rounds_s, self.variant("baseline").steady_rounds_s)
        attr = _RATIO_STATS[stat]
        num, den = getattr(self.variant(name), attr), getattr(self.variant("baseline"), attr)
        return num / den if num is not None and den else None

    @property
    def steady_unit(self) -> str:
        """What one steady time is, for tables and documents."""
        return self.config.phase.unit

    def _ratios(self, name: str, *stats: str) -> dict[str, float | None]:
        return {stat.removeprefix("steady_"): self.ratio(name, stat) for stat in stats}

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
                    "ratio_to_baseline": self._ratios(v.name, "min", "median", "cpu"),
                    "steady_s": {"min": v.steady_call_min, "median": v.steady_call_median,
                                 "rounds": list(v.steady_rounds_s)},
                    "steady_ratio_to_baseline": self._ratios(v.name, "steady_min", "steady_median", "steady_paired"),
                    "steady_call_s_median": v.steady_call_median,
                    "steady_compiles": v.steady_compiles,
                    "steady_max_abs_diff_vs_stock": v.steady_max_abs_diff,
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
            "steady_unit": self.steady_unit,
            "variants": variants,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> BenchResult:
        """Rebuild a result from :meth:`to_dict` output (e.g. a saved ``--json`` document)."""
        if doc.get("schema") not in _READS:
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
            variants.append(VariantResult(
                v["name"], v["description"], v["status"], v["note"], samples,
                steady_rounds_s=list(v.get("steady_s", {}).get("rounds", [])),
                steady_compiles=v.get("steady_compiles", 0),
                steady_max_abs_diff=v.get("steady_max_abs_diff_vs_stock"),
            ))
        return cls(BenchConfig(**config), dict(doc["environment"]), variants)


@dataclass
class SweepResult:
    """One :class:`BenchResult` per layer count (:func:`~paramfold.bench.run.run_sweep`)."""

    runs: list[BenchResult]

    @property
    def layers(self) -> list[int]:
        return [r.config.n_layers for r in self.runs]

    @property
    def variant_names(self) -> list[str]:
        """The variants, in the order of the first run (every run has the same)."""
        return [v.name for v in self.runs[0].variants] if self.runs else []

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SWEEP_SCHEMA, "layers": self.layers,
                "runs": [r.to_dict() for r in self.runs]}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> SweepResult:
        """Rebuild a sweep from :meth:`to_dict` output."""
        if doc.get("schema") != SWEEP_SCHEMA:
            raise ValueError(
                f"not a paramfold bench sweep document (schema {doc.get('schema')!r}); "
                "write one with `paramfold bench --sweep-layers ... --json`"
            )
        return cls([BenchResult.from_dict(r) for r in doc["runs"]])
