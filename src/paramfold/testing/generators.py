"""The process-wide random generators a run draws from (torch's CPU and CUDA ones, Python's
``random``, NumPy's ``np.random``): their states read (:func:`rng_state`), set back
(:func:`set_rng_state`) and compared after a run (:func:`compare_rng`).

Why a module of its own: the checker (:mod:`~paramfold.testing.check`) sets every run of a step
back to where stock's began and holds the prepared run to the state stock's left, and the
reference that sums gradients as paramfold does (:mod:`~paramfold.testing.resummed`) undoes a
chain's draws; the checker imports that reference, so these cannot live in the checker. The
state is a tuple whose layout :func:`compare_rng` names entry by entry, so both sit here. Its
names are the testing package's internals, shared across its modules, not part of
:mod:`paramfold.testing`'s API.
"""

from __future__ import annotations

from typing import Any

import torch

from paramfold.global_generators import global_generator_states, set_global_generator_states

__all__ = ["compare_rng", "rng_state", "set_rng_state"]


def rng_state() -> tuple[Any, ...]:
    """The global generators' states: torch's CPU one, CUDA's where CUDA is in use, Python's
    ``random`` and NumPy's (``np.random.*``, which transformers' SpecAugment masks draw from)
    where NumPy is imported."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, *global_generator_states()


def set_rng_state(state: tuple[Any, ...]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])
    set_global_generator_states(state[2:])


def compare_rng(left: tuple[Any, ...], after: tuple[Any, ...], at: str) -> None:
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
