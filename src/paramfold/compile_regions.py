"""A ``torch.compiler.nested_compile_region`` reuses a traced region only for a prepared module of
the same class.

Dynamo traces a nested compile region once and stamps the traced subgraph out for later calls
whose inputs pass the first trace's guards, re-evaluated on the new inputs. For a module input it
records no check of its own (``invoke_subgraph.build_reuse_condition`` keeps ``(MODULE, None)``
in torch 2.13, ``(OBJECT, None)`` in 2.14 and 2.15), and the module's type guard is installed on
a wrapped source that the condition's lookup by the argument's source does not find: a region
traced for one module is reused for another of any class whose reads pass. Stock's modules differ
in what their traced code reads, which the guards do see; paramfold's classes differ in what their
code does with the same reads. A training hook-based spectral_norm's read-once class marks its
value served when its call is traced (``classes.read_once_class``): stamped out from a region
traced for a weight_norm layer, the call was never traced, the scope found the value unread and
put the power iteration's state back, and every later step ran from stale vectors.

So where either module is prepared (it holds paramfold's state), a region is reused for it only
where the classes are the same: the region is traced again for another class, as stock's
differing reads have it. Modules that are not prepared keep torch's rule.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from paramfold.state import STATE_ATTR


def _prepared(module: object) -> bool:
    return isinstance(module, nn.Module) and STATE_ATTR in module.__dict__


def install() -> None:
    """Wrap dynamo's reuse check (once per process; nothing where this torch has none)."""
    try:
        from torch._dynamo.variables import invoke_subgraph as regions
    except ImportError:  # a torch without nested compile regions' reuse
        return
    build, reusable = getattr(regions, "build_reuse_condition", None), getattr(regions, "is_reusable", None)
    # A module input's tag: MODULE (torch 2.13), OBJECT (2.14, 2.15: any object with a source).
    tags = {getattr(getattr(regions, "InputTag", None), t, None) for t in ("MODULE", "OBJECT")} - {None}
    if build is None or reusable is None or not tags or getattr(build, "_paramfold", False):
        return

    def keyed(input_tag: object, vt: object) -> tuple[type, bool] | None:
        module = getattr(vt, "value", None) if input_tag in tags else None
        return (type(module), _prepared(module)) if isinstance(module, nn.Module) else None

    def build_reuse_condition(tx: Any, fingerprint: Any, *args: Any, **kwargs: Any) -> Any:
        condition = build(tx, fingerprint, *args, **kwargs)
        if condition is not None:
            # The modules' classes beside torch's checks, which read nothing for a module.
            condition._paramfold_modules = [keyed(t, vt) for t, vt in fingerprint.flat_vts]
        return condition

    def is_reusable(tx: Any, condition: Any, fingerprint: Any, *args: Any, **kwargs: Any) -> bool:
        then = getattr(condition, "_paramfold_modules", None)
        if then is not None and len(then) == len(fingerprint.flat_vts):
            for was, (t, vt) in zip(then, fingerprint.flat_vts):
                now = keyed(t, vt)
                if was is not None and now is not None and (was[1] or now[1]) and was[0] is not now[0]:
                    return False
        return reusable(tx, condition, fingerprint, *args, **kwargs)

    build_reuse_condition._paramfold = True
    regions.build_reuse_condition = build_reuse_condition
    regions.is_reusable = is_reusable

