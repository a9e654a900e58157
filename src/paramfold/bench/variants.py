"""The variants a run compares: baseline (plain), stock, and each ``paramfold.prepare`` mode.

A :class:`Variant` is a name and a function turning the freshly built stock model into the model
that gets compiled; custom variants (another preparer, a mode with options) are passed to
:func:`~paramfold.bench.run.run_bench` the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from paramfold.bench.zoo import unparametrize

__all__ = ["VARIANT_NAMES", "Variant", "default_variants"]


@dataclass(frozen=True)
class Variant:
    """A named way to turn the freshly built stock model into the model that gets compiled.

    ``prepare`` may return the same module (changed in place) or a new one.  ``unavailable`` is a
    reason to skip the variant in every configuration; ``eval_only`` skips it where the model is
    trainable (``train`` or ``grad``).
    """

    name: str
    prepare: Callable[[nn.Module], nn.Module]
    description: str = ""
    eval_only: bool = False
    unavailable: str | None = None


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
    """baseline, stock and every paramfold mode (``freeze`` is inference only)."""
    variants = [
        Variant("baseline", unparametrize, "same architecture, no parametrization"),
        Variant("stock", lambda model: model, "torch.nn.utils.parametrize as is"),
    ]
    for mode, text in _MODE_DESCRIPTIONS.items():
        variants.append(
            Variant(mode, _paramfold_prepare(mode), text, eval_only=mode == "freeze")
        )
    return variants


VARIANT_NAMES = ("baseline", "stock", *_MODE_DESCRIPTIONS)
