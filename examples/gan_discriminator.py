"""A vocoder GAN's discriminator step with torch's hook-based norms, stock against paramfold.

HiFi-GAN's multi-scale discriminator wraps its first scale's convolutions in the deprecated
hook-based ``torch.nn.utils.spectral_norm`` and the others' in ``torch.nn.utils.weight_norm``,
and scores a real and a generated batch in one step, each layer called twice. This runs the
same discriminator steps (LSGAN loss, Adam) on a stock copy and a prepared one (``auto``), both
under ``torch.compile``, checks every step's loss and spectral_norm buffers against stock
bitwise (gradients: see ``close``), times the first compiled step of each against the same
network without norms (one run: a rough figure; ``paramfold bench`` repeats its own), then
times steady steps interleaved in one process and counts the Python calls of one step
(``sys.setprofile``, deterministic).

    python examples/gan_discriminator.py                     # eager backend, 3 scales
    python examples/gan_discriminator.py --backend inductor  # compiled kernels (tolerance, not bitwise)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import paramfold


class ScaleDiscriminator(nn.Module):
    """One scale of HiFi-GAN's multi-scale discriminator (channels cut down)."""

    def __init__(self, norm, width: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList([
            norm(nn.Conv1d(1, width, 15, 1, padding=7)),
            norm(nn.Conv1d(width, 2 * width, 41, 4, groups=4, padding=20)),
            norm(nn.Conv1d(2 * width, 2 * width, 41, 4, groups=8, padding=20)),
            norm(nn.Conv1d(2 * width, 2 * width, 5, 1, padding=2)),
        ])
        self.post = norm(nn.Conv1d(2 * width, 1, 3, 1, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.1)
        return self.post(x).flatten(1)


class MultiScale(nn.Module):
    """Scores the real and the generated audio at ``scales`` resolutions."""

    def __init__(self, scales: int, width: int, plain: bool = False) -> None:
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the hook-based norms are deprecated
            norms = [nn.utils.spectral_norm] + [nn.utils.weight_norm] * (scales - 1)
            if plain:  # the same layers without norms: what compiling the network itself costs
                norms = [lambda layer: layer] * scales
            self.discriminators = nn.ModuleList([ScaleDiscriminator(norm, width) for norm in norms])
        self.pool = nn.AvgPool1d(4, 2, padding=2)

    def forward(self, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        loss = real.new_zeros(())
        for i, d in enumerate(self.discriminators):
            if i:
                real, fake = self.pool(real), self.pool(fake)
            loss = loss + ((d(real) - 1) ** 2).mean() + (d(fake) ** 2).mean()
        return loss


def _calls(step) -> int:
    count = [0]

    def profile(frame, event, arg):
        if event == "call":
            count[0] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return count[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", type=int, default=3)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--checked", type=int, default=6, help="steps compared with stock")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds")
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    stock = MultiScale(args.scales, args.width)
    torch.manual_seed(0)  # (a weight_norm layer's weight attribute has a history: deepcopy refuses it)
    ours = paramfold.prepare(MultiScale(args.scales, args.width), "auto")
    models = {"stock": stock, "paramfold auto": ours}
    calls = {name: torch.compile(m, backend=args.backend) for name, m in models.items()}

    # The first compiled step (forward and backward) of each, from an empty compile cache (the
    # first compile in a process also pays dynamo's own start: a warm-up takes that), against
    # the same network without norms.
    real, fake = torch.randn(4, 1, args.samples), torch.randn(4, 1, args.samples).tanh()
    plain = MultiScale(args.scales, args.width, plain=True)
    first: dict[str, float] = {}
    for name, call in [("(warm-up)", torch.compile(plain, backend=args.backend)),
                       ("plain", torch.compile(plain, backend=args.backend)), *calls.items()]:
        torch._dynamo.reset()
        start = time.perf_counter()
        call(real, fake).backward()
        first[name] = time.perf_counter() - start
    del first["(warm-up)"]
    for m in models.values():
        m.zero_grad()
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=2e-4, betas=(0.8, 0.99)) for name, m in models.items()}
    exact = args.backend == "eager"

    def step(name: str, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        loss = calls[name](real, fake)
        loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad()
        return loss

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(4, 1, args.samples), torch.randn(4, 1, args.samples).tanh()

    # A weight_norm layer called twice in a step is served one value, so its gradients sum before
    # the norm's backward, not after: the last bit may differ (README, "read several times").
    # The spectral_norm layers compute afresh at the second call, as stock's hook does.
    def close(a, b):
        return torch.allclose(a, b, rtol=1e-4 if not exact else 1e-5, atol=1e-6)

    worst = 0.0
    for i in range(args.checked):
        real, fake = batch()
        losses = {}
        for name, m in models.items():
            losses[name] = calls[name](real, fake)
            losses[name].backward()
        grads = [{n: p.grad for n, p in m.named_parameters()} for m in models.values()]
        buffers = [dict(m.named_buffers()) for m in models.values()]
        same = torch.equal if exact else close
        worst = max(worst, max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0]))
        assert same(losses["stock"], losses["paramfold auto"]), (i, losses)
        assert all(close(grads[0][n], grads[1][n]) for n in grads[0]), i
        assert all(same(buffers[0][n], buffers[1][n]) for n in buffers[0]), i
        for name in models:
            optimizers[name].step()
            optimizers[name].zero_grad()
    print(f"{args.checked} steps: loss and spectral_norm buffers {'bitwise' if exact else 'allclose'} stock's, "
          f"gradients within {worst:.1e}")
    print("first compiled step (forward and backward): "
          + ", ".join(f"{name} {seconds:.2f} s ({seconds / first['plain']:.2f}x plain)" for name, seconds in first.items()))
    real, fake = batch()
    counted = {name: _calls(lambda: step(name, real, fake)) for name in models}
    times = {name: [] for name in models}
    for _ in range(args.rounds):
        for name in models:
            start = time.perf_counter()
            for _ in range(args.steps):
                step(name, real, fake)
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    base = statistics.median(times["stock"])
    print(f"backend={args.backend} scales={args.scales} width={args.width} samples={args.samples}, "
          f"{args.rounds} interleaved rounds of {args.steps} steps")
    for name in models:
        print(f"  {name:15s} steady step min {min(times[name]):7.2f} ms  median {statistics.median(times[name]):7.2f} ms"
              f"  x stock {statistics.median(times[name]) / base:.2f}  Python calls per step {counted[name]}")


if __name__ == "__main__":
    main()
