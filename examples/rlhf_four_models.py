"""Seed 000, small: four same-architecture models of an RLHF recipe, each layer compiled on its own.

Policy and value models train; frozen reference and reward models (``eval()``, parameters
``requires_grad=False``) share the architecture. Every transformer layer is compiled with
``layer.compile()`` (the torchtune style), generation runs under ``no_grad`` with sequence lengths
64, 1 (x4), 68, 68, 66, then one training step runs. All layers of all four models share one
code object, ``Layer.forward``, so every difference between calls is a recompile of it.

The script runs the scenario twice, stock and with the paramfold recipe, prints
``paramfold.recompiles()``'s report for each, and checks that outputs and gradients are equal:

* stock: 5 graphs (size 64 -> 1, 1 -> 68, frozen-vs-trainable ``requires_grad`` under
  ``no_grad``, grad mode);
* recipe: ``paramfold.prepare(model, detach_params_under_no_grad=True)`` on each model removes the
  ``requires_grad`` recompile, and one user-side line,
  ``torch.fx.experimental._config.backed_size_oblivious = True``, lets one graph serve every
  sequence length >= 2 -- 3 graphs remain: the no_grad graph for lengths >= 2, the no_grad
  graph for length 1 (sizes 0 and 1 are always specialised; ``mark_unbacked`` would remove it but
  makes ``scaled_dot_product_attention(is_causal=True)`` graph-break on torch 2.13), and the
  grad-mode graph of the training step (grad mode on/off always needs two). ``backed_size_oblivious``
  exists from torch 2.7 on; on older torch the recipe runs without it (and says so).

    python examples/rlhf_four_models.py [--layers 4] [--backend eager] [--recompile-limit N]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F
from torch import nn

import paramfold
from paramfold.recompiles import limit_config

WIDTH, HEADS, VOCAB = 64, 4, 128


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.output_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (
            proj(x).view(b, s, self.heads, d // self.heads).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output_proj(out.transpose(1, 2).reshape(b, s, d))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.sa_norm = nn.RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp_norm = nn.RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.SiLU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.sa_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class Model(nn.Module):
    def __init__(self, n_layers: int, out_dim: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Layer(WIDTH, HEADS) for _ in range(n_layers))
        self.norm = nn.RMSNorm(WIDTH)
        self.output = nn.Linear(WIDTH, out_dim, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def build(n_layers: int = 4, seed: int = 0) -> dict[str, Model]:
    torch.manual_seed(seed)
    models = {
        "policy": Model(n_layers, VOCAB),
        "value": Model(n_layers, 1),
        "reference": Model(n_layers, VOCAB),
        "reward": Model(n_layers, 1),
    }
    for name in ("reference", "reward"):
        models[name].eval().requires_grad_(False)
    return models


def run(models: dict[str, Model]) -> dict[str, torch.Tensor]:
    tokens = {n: torch.arange(n).remainder(VOCAB).unsqueeze(0) for n in (64, 1, 68, 66)}
    outs: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        outs["policy_gen"] = models["policy"](tokens[64])
        for _ in range(4):
            outs["policy_step"] = models["policy"](tokens[1])
        outs["reference"] = models["reference"](tokens[68])
        outs["value_gen"] = models["value"](tokens[68])
        outs["reward"] = models["reward"](tokens[66])
    policy_out = models["policy"](tokens[64])
    value_out = models["value"](tokens[68])
    policy_out.mean().backward()
    value_out.mean().backward()
    outs["policy_train"], outs["value_train"] = policy_out.detach(), value_out.detach()
    return outs


@dataclasses.dataclass
class Result:
    report: paramfold.RecompileReport
    outputs: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]

    @property
    def layer_graphs(self) -> int:
        return sum(n for fn, n in self.report.graphs_per_function().items() if fn.startswith("forward"))


HAS_SIZE_OBLIVIOUS = hasattr(fx_config, "backed_size_oblivious")  # torch >= 2.7


def size_oblivious() -> contextlib.AbstractContextManager:
    """``backed_size_oblivious = True`` for the block, where this torch has it (2.7 and later)."""
    if HAS_SIZE_OBLIVIOUS:
        return fx_config.patch(backed_size_oblivious=True)
    return contextlib.nullcontext()


def scenario(recipe: bool, n_layers: int = 4, backend: str = "eager") -> Result:
    """Build, compile per layer and run the four models; ``recipe`` applies paramfold's fixes."""
    torch._dynamo.reset()
    models = build(n_layers)
    if recipe:
        for model in models.values():
            paramfold.prepare(model, detach_params_under_no_grad=True)
    for model in models.values():
        for layer in model.layers:
            layer.compile(backend=backend)
    shapes = size_oblivious() if recipe else contextlib.nullcontext()
    with shapes, paramfold.recompiles(warn=False) as report:
        outputs = run(models)
    grads = {
        f"{name}.{p_name}": p.grad
        for name in ("policy", "value")
        for p_name, p in models[name].named_parameters()
    }
    return Result(report, outputs, grads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--recompile-limit", type=int, default=None,
                        help="set torch._dynamo.config.recompile_limit (cache_size_limit before "
                             "torch 2.7; torch's default: 8)")
    args = parser.parse_args()
    if args.recompile_limit is not None:
        setattr(torch._dynamo.config, limit_config(), args.recompile_limit)
    if not HAS_SIZE_OBLIVIOUS:
        print(f"note: torch {torch.__version__} has no torch.fx.experimental._config."
              "backed_size_oblivious (torch >= 2.7): the recipe runs without it, so each new "
              "sequence length can still recompile")

    stock = scenario(recipe=False, n_layers=args.layers, backend=args.backend)
    print("== stock torch.compile ==")
    stock.report.print()
    recipe = scenario(recipe=True, n_layers=args.layers, backend=args.backend)
    print("\n== paramfold recipe: prepare(detach_params_under_no_grad=True) + backed_size_oblivious ==")
    recipe.report.print()

    worst = max(
        (a - b).abs().max().item()
        for a, b in zip([*stock.outputs.values(), *stock.grads.values()],
                        [*recipe.outputs.values(), *recipe.grads.values()])
    )
    print(
        f"\nLayer.forward graphs: stock {stock.layer_graphs}, recipe {recipe.layer_graphs}; "
        f"max |difference| of outputs and gradients: {worst:.3g}"
    )


if __name__ == "__main__":
    main()
