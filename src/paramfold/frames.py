"""Which of paramfold's functions dynamo runs eagerly when it meets them as frames of their own.

Dynamo compiles every Python frame it meets under an active ``torch.compile``, except torch's own
code. When it falls back to running a user's frame eagerly (a graph break in a loop), the frames
that frame calls are compiled one by one: a paramfold getter or descriptor would become a graph of
its own, per weight shape, where stock's parametrize code (a file of torch) is skipped. Functions
registered here are skipped the same way; inlined into traced code they are traced as usual.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def run_eagerly_as_frame(fn: Callable) -> Callable:
    """Have dynamo run ``fn`` eagerly (compiling what it calls) when it meets it as a frame."""
    torch._dynamo.eval_frame.skip_code(fn.__code__)
    return fn
