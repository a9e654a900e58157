"""Modules whose forward edits a parametrized tensor of their own in place: ``F.embedding`` with
``max_norm`` renormalising the rows it looks up, a norm layer's running buffers, ``FakeQuantize``'s
qparams. Stock computes a fresh tensor at each read, so a read after the edit is unedited: such a
tensor is computed at each read (``paramfold.compute.IN_PLACE_EDITS``), and a switch to editing
between calls is seen. Compared with stock bitwise (eager, and compiled with the eager and
aot_eager backends).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import ALL_MODES, Doubled, assert_same_tensors, grads
from torch import nn
from torch.ao.quantization import FakeQuantize
from torch.nn.utils import parametrize as P
from torch.nn.utils.parametrizations import weight_norm

import paramfold


class _TiedEmbedding(nn.Module):
    """An embedding whose table is read again after its lookup in the same forward (a tied head)."""

    def __init__(self, table: nn.Module) -> None:
        super().__init__()
        self.emb = table

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        e = self.emb(idx) if isinstance(self.emb, nn.Embedding) else self.emb(idx).unsqueeze(1)
        return e @ self.emb.weight.T


def _tables():
    return {"embedding": lambda: nn.Embedding(10, 4, max_norm=1.0),
            "embedding_bag": lambda: nn.EmbeddingBag(10, 4, max_norm=1.0, mode="sum")}


@pytest.mark.parametrize("backend", [None, "eager"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto"])
@pytest.mark.parametrize("table", [*sorted(_tables()), "embedding_hook_based"])
def test_an_embedding_with_max_norm_read_again_in_the_forward_like_stock(table, mode, training, backend):
    # F.embedding(..., max_norm=) renormalises the rows it looks up in the weight it is given, in
    # place. Stock computes a fresh weight at each read, so the table read after the lookup is the
    # unrenormalised one; a value served once per call would have the looked-up rows renormalised.
    # (torch's hook-based weight_norm computes the weight once per call of the module: the read
    # after it sees the renormalised rows in stock too.)
    if mode == "freeze" and training:
        pytest.skip("freeze serves inference")

    def build():
        torch.manual_seed(0)
        if table == "embedding_hook_based":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                model = _TiedEmbedding(torch.nn.utils.weight_norm(_tables()["embedding"]()))
            model.emb.weight_v.data.mul_(3)
        else:
            model = _TiedEmbedding(weight_norm(_tables()[table]()))
            model.emb.parametrizations.weight.original1.data.mul_(3)  # rows of norm 3: renormalised to 1
        return model.train(training).requires_grad_(training)

    stock, ours = build(), paramfold.prepare(build(), mode)
    run_stock, run_ours = stock, ours
    if backend is not None:
        torch._dynamo.reset()
        run_stock, run_ours = torch.compile(stock, backend=backend), torch.compile(ours, backend=backend)
    idx = torch.tensor([[1, 2, 3], [3, 4, 5]])
    with torch.set_grad_enabled(training):
        for _ in range(3):
            want, got = run_stock(idx), run_ours(idx)
            assert torch.equal(got, want)
            if training:
                want.sum().backward(), got.sum().backward()
                assert_same_tensors(grads(stock), grads(ours))
    assert_same_tensors(stock.state_dict(), ours.state_dict())


def test_max_norm_set_on_a_prepared_embedding_between_calls_is_seen():
    def build():
        torch.manual_seed(0)
        model = _TiedEmbedding(weight_norm(nn.Embedding(10, 4)))
        model.emb.parametrizations.weight.original1.data.mul_(3)
        return model.eval().requires_grad_(False)

    stock, ours = build(), paramfold.prepare(build(), "freeze")
    idx = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for _ in range(3):  # into the steady plan
            assert torch.equal(ours(idx), stock(idx))
        for model in (stock, ours):
            model.emb.max_norm = 1.0
        for _ in range(2):
            assert torch.equal(ours(idx), stock(idx))


class _PlusOne(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class _MinusOne(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - 1


class _Normed(nn.Module):
    """A BatchNorm1d(momentum=None) or an InstanceNorm1d tracking running stats, one of its
    buffers parametrized; the forward may read that buffer again after the norm's call."""

    def __init__(self, buffer: str, read_after: bool = False, norm: str = "batch") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4, momentum=None) if norm == "batch" else nn.InstanceNorm1d(2, track_running_stats=True)
        P.register_parametrization(self.bn, buffer, _PlusOne())
        self.buffer, self.read_after = buffer, read_after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if isinstance(self.bn, nn.InstanceNorm1d):
            h = h.view(-1, 2, 2)
        y = self.bn(h)
        if self.read_after:
            y = y + (getattr(self.bn, self.buffer)[:, None] if y.dim() == 3 else getattr(self.bn, self.buffer))
        return y


@pytest.mark.parametrize("backend", [None, "eager", "aot_eager"])
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize(("norm", "buffer", "read_after"),
                         [("batch", "num_batches_tracked", False), ("batch", "running_mean", True),
                          ("instance", "running_mean", True)],
                         ids=["num_batches_tracked", "running_mean_read_after", "instance_norm_running_mean_read_after"])
def test_a_norm_buffer_its_forward_edits_in_place_is_computed_at_each_read_like_stock(norm, buffer, read_after, mode,
                                                                                      backend):
    # A training BatchNorm's forward does num_batches_tracked.add_(1), then reads it again for
    # the momentum=None averaging factor, and F.batch_norm (F.instance_norm) updates running_mean
    # in place (read again after the call here). Stock's every read is a fresh tensor, so the
    # edits are lost; a value served once per call kept them (running_mean off by 0.085 after 3 steps).
    training = mode != "freeze"
    stock = _Normed(buffer, read_after, norm)
    ours = paramfold.prepare(_Normed(buffer, read_after, norm).requires_grad_(training), mode)
    stock.requires_grad_(training)
    run_stock, run_ours = stock, ours
    if backend is not None:
        torch._dynamo.reset()
        run_stock, run_ours = torch.compile(stock, backend=backend), torch.compile(ours, backend=backend)
    with torch.set_grad_enabled(training):
        for step in range(3):
            x = torch.randn(5, 3, generator=torch.Generator().manual_seed(step))
            want, got = run_stock(x), run_ours(x)
            assert torch.equal(got, want), step
            if training:
                want.sum().backward(), got.sum().backward()
                assert_same_tensors(grads(stock), grads(ours), step)
            assert_same_tensors(stock.state_dict(), ours.state_dict(), step)
    stock.eval(), ours.eval()
    x = torch.randn(5, 3)
    with torch.no_grad():
        assert torch.equal(run_ours(x), run_stock(x))


@pytest.mark.parametrize("switch", ["train", "track_running_stats"])
@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto"])
def test_a_batchnorm_switched_to_editing_its_buffer_between_calls_is_seen(mode, switch):
    # The steady plan built while the BatchNorm's calls do not edit its buffer serves it once per
    # call; a switch to training with running stats tracked (whose calls edit it in place) is seen.
    stock = _Normed("num_batches_tracked").requires_grad_(False)
    ours = paramfold.prepare(_Normed("num_batches_tracked").requires_grad_(False), mode)
    x = torch.randn(5, 3)
    with torch.no_grad():
        for edits in (False, True, False, True):
            for model in (stock, ours):
                if switch == "train":
                    model.train(edits)
                else:
                    model.bn.track_running_stats = edits
            for _ in range(3):  # into the steady plan
                assert torch.equal(ours(x), stock(x)), edits
                assert_same_tensors(stock.state_dict(), ours.state_dict(), edits)


class _FakeQuantized(nn.Module):
    def __init__(self, buffer: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.fq = FakeQuantize()
        with torch.no_grad():
            self(torch.randn(5, 4))  # observed once: a finite min_val
        holder, _, name = f"fq.{buffer}".rpartition(".")
        P.register_parametrization(self.get_submodule(holder), name, Doubled() if name != "min_val" else _MinusOne())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fq(self.lin(x))


@pytest.mark.parametrize("backend", [None, "eager"])
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("buffer", ["scale", "zero_point", "activation_post_process.min_val"])
def test_a_fake_quantize_qparam_its_forward_edits_in_place_is_computed_at_each_read_like_stock(buffer, mode, backend):
    # torch.ao's FakeQuantize copies its observer's qparams into scale and zero_point, then reads
    # them again to fake-quantize; its observer copies the new min_val in, which FakeQuantize's
    # calculate_qparams reads again. Stock's reads give fresh tensors, without the copies.
    stock, ours = _FakeQuantized(buffer), paramfold.prepare(_FakeQuantized(buffer).requires_grad_(False), mode)
    stock.requires_grad_(False)
    run_stock, run_ours = stock, ours
    if backend is not None:
        torch._dynamo.reset()
        run_stock, run_ours = torch.compile(stock, backend=backend), torch.compile(ours, backend=backend)
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step)) * (step + 1)
            assert torch.equal(run_ours(x), run_stock(x)), step
            assert_same_tensors(stock.state_dict(), ours.state_dict(), step)
