"""What a run measured: samples, per-variant summaries, ratios, and the ``--json`` document.

The result types are kept apart from the measurement so that a saved document can be read back
(:meth:`BenchResult.from_dict`), rendered or plotted without running anything. The document's
``schema`` field (``paramfold.bench/<version>``) names the layout :meth:`BenchResult.to_dict`
writes; a reader refuses another.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from paramfold.bench.config import BenchConfig

__all__ = ["SCHEMA_VERSION", "BenchResult", "Proxies", "Sample", "VariantResult"]

SCHEMA_VERSION = 1


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
