"""Quickstart: a small vocoder-style model full of weight_norm, compiled fast with paramfold.

1. ``paramfold.find`` lists the parametrizations;
2. ``paramfold.prepare(model, "auto")`` + ``torch.compile`` trains exactly like stock;
3. ``paramfold.restore`` undoes it; the checkpoint it saves is an ordinary parametrized one;
4. ``paramfold.audit_checkpoint`` / ``fold_checkpoint`` turn that checkpoint into the plain
   model's, which loads with ``strict=True`` and gives the same outputs.

    python examples/quickstart.py
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import paramfold


class Generator(nn.Module):
    def __init__(self, parametrized: bool = True) -> None:
        super().__init__()
        wn = weight_norm if parametrized else (lambda m: m)
        self.pre = wn(nn.Conv1d(16, 32, 7, padding=3))
        self.ups = nn.ModuleList(wn(nn.ConvTranspose1d(32, 32, 4, stride=2, padding=1)) for _ in range(2))
        self.post = wn(nn.Conv1d(32, 1, 7, padding=3))

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = self.pre(mel)
        for up in self.ups:
            x = up(nn.functional.leaky_relu(x, 0.1))
        return torch.tanh(self.post(x))


def main() -> None:
    torch.manual_seed(0)
    stock = Generator()
    model = copy.deepcopy(stock)

    for site in paramfold.find(model):
        print(f"{site.fqn:12s} {site.kind:12s} originals: {', '.join(site.originals)}")

    paramfold.prepare(model, "auto")
    compiled = torch.compile(model, backend="aot_eager")
    opt_stock = torch.optim.Adam(stock.parameters(), lr=1e-3)
    opt_ours = torch.optim.Adam(model.parameters(), lr=1e-3)
    mel = torch.randn(2, 16, 50)
    for step in range(3):
        loss_stock = stock(mel).square().mean()
        loss_ours = compiled(mel).square().mean()
        loss_stock.backward(), loss_ours.backward()
        opt_stock.step(), opt_ours.step()
        opt_stock.zero_grad(), opt_ours.zero_grad()
        print(f"step {step}: loss stock {loss_stock.item():.6f}  paramfold {loss_ours.item():.6f}")
        torch.testing.assert_close(loss_ours, loss_stock, atol=1e-6, rtol=1e-6)
    paramfold.restore(model)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt, plain = Path(tmp) / "generator.pt", Path(tmp) / "generator_plain.safetensors"
        torch.save(model.state_dict(), ckpt)
        report = paramfold.audit_checkpoint(ckpt)
        print(f"audit: {len(report.sites)} parametrized tensors, {report.plain_tensors} plain tensors")
        paramfold.fold_checkpoint(ckpt, plain)
        from safetensors.torch import load_file

        unparametrized = Generator(parametrized=False)
        unparametrized.load_state_dict(load_file(plain), strict=True)
        with torch.no_grad():
            same = torch.equal(unparametrized(mel), model(mel))
        print(f"folded checkpoint loads strict=True into the plain model; outputs equal: {same}")
        assert same


if __name__ == "__main__":
    main()
