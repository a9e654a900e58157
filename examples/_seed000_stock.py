"""Scratch reproduction of seed 000 (torchtune RLHF, four same-architecture models), stock compile.

Policy, value, frozen reference and frozen reward models share one small transformer
architecture; each layer is compiled on its own (``layer.compile(backend="eager")``, the torchtune
style). Generation runs under ``no_grad`` with sequence lengths 64, 1 (x4), 68, 68, 66, then one
training step.

    python examples/_seed000_stock.py            # run it
    paramfold recompiles -- python examples/_seed000_stock.py   # and see why it recompiled
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, HEADS, VOCAB = 64, 4, 128


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, attn_dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.output_proj = nn.Linear(dim, dim, bias=False)
        self.attn_dropout = attn_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        # As torchtune's MultiHeadAttention: dropout only in training mode (reads self.training).
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_dropout if self.training else 0.0, is_causal=True
        )
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
        models[name].eval()
        models[name].requires_grad_(False)
    return models


def compile_layers(models: dict[str, Model], backend: str = "eager") -> None:
    for model in models.values():
        for layer in model.layers:
            layer.compile(backend=backend)


def run(models: dict[str, Model]) -> dict[str, torch.Tensor]:
    full, single = torch.ones(1, 64, dtype=torch.long), torch.ones(1, 1, dtype=torch.long)
    longer, medium = torch.ones(1, 68, dtype=torch.long), torch.ones(1, 66, dtype=torch.long)
    outs: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        outs["policy_gen"] = models["policy"](full)
        for _ in range(4):
            outs["policy_step"] = models["policy"](single)
        outs["reference"] = models["reference"](longer)
        outs["value_gen"] = models["value"](longer)
        outs["reward"] = models["reward"](medium)
    out1 = models["policy"](full)
    out2 = models["value"](longer)
    out1.mean().backward()
    out2.mean().backward()
    outs["policy_train"], outs["value_train"] = out1.detach(), out2.detach()
    return outs


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--recompile-limit", type=int, default=None,
                        help="set torch._dynamo.config.recompile_limit (default: torch's, 8)")
    args = parser.parse_args()
    if args.recompile_limit is not None:
        torch._dynamo.config.recompile_limit = args.recompile_limit
    models = build(args.layers)
    compile_layers(models, args.backend)
    outs = run(models)
    print({k: tuple(v.shape) for k, v in outs.items()})
