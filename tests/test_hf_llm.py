"""Hugging Face decoder-only language models with parametrizations, used as a new user uses them.

The other transformers tests cover audio models (weight_norm convs) and PEFT's LoRA; none called
``generate``. Here a tiny Llama (and GPT-2, whose projections are transformers' ``Conv1D``)
carries weight_norm, orthogonal, spectral_norm and a custom low-rank delta (W + A @ B) on its
projections, and is driven through ``model.generate`` (greedy, sampling, beam search, a static
cache, and compiled through transformers' own ``compile_config`` path, with weight changes
between calls), training steps with labels (HF gradient
checkpointing, autocast, ``train()``/``eval()`` switches with generation between steps), tied
embeddings (``tie_weights``, ``resize_token_embeddings`` after ``prepare``),
``save_pretrained``/``from_pretrained``, assisted (speculative) decoding and generation under
``torch.autocast``. Everything is compared bitwise with the stock model built
from the same seed: tokens, ``output_scores``, losses, gradients and ``state_dict``. Built from
tiny configs with random weights (no hub access); skipped without transformers.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from helpers import assert_same_nested, classes
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm

import paramfold

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

pytestmark = [
    pytest.mark.usefixtures("fresh_dynamo"),
    # transformers' notices about generation flags and gradient checkpointing's use_cache.
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

MODES = ["hoist", "inline", "freeze", "auto"]
TRAIN_MODES = ["hoist", "inline", "auto"]
VOCAB = 64
PROMPT = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))


class LowRank(torch.nn.Module):
    """A LoRA-like merge as a parametrization: W + A @ B, A and B owned (and trained) here."""

    def __init__(self, out_features: int, in_features: int, rank: int = 2):
        super().__init__()
        self.A = torch.nn.Parameter(torch.randn(out_features, rank) * 0.1)
        self.B = torch.nn.Parameter(torch.randn(rank, in_features) * 0.1)

    def forward(self, weight):
        return weight + self.A @ self.B


def llama_config(tie: bool = False) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie,
    )


def llama(*, spectral: bool = False, eval_only: bool = False) -> torch.nn.Module:
    """A 2-layer Llama, seeded, with weight_norm, orthogonal and a low-rank delta on projections
    (and spectral_norm on a k_proj where ``spectral``); in eval mode, no grad where ``eval_only``."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config())
    first, second = model.model.layers
    weight_norm(first.self_attn.q_proj)
    orthogonal(first.self_attn.o_proj)
    parametrize.register_parametrization(first.mlp.up_proj, "weight", LowRank(64, 32))
    weight_norm(second.mlp.down_proj)
    if spectral:
        spectral_norm(second.self_attn.k_proj)
    model.eval()
    if eval_only:
        model.requires_grad_(False)
    return model


def twins(mode: str, build=llama, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Stock and prepared, built alike from the same seed (freeze: inference only)."""
    if mode == "freeze":
        kwargs["eval_only"] = True
    return build(**kwargs), paramfold.prepare(build(**kwargs), mode)


def generate(model, prompt=PROMPT, **kwargs):
    """``model.generate``, seeded, with the scores: (tokens, scores)."""
    torch.manual_seed(7)
    kwargs.setdefault("max_new_tokens", 6)
    out = model.generate(prompt, pad_token_id=0, output_scores=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, tuple(out.scores)


def assert_same_state(stock, ours):
    assert_same_nested(stock.state_dict(), ours.state_dict(), "state_dict")


def eager_compile_config(backend: str = "eager") -> transformers.CompileConfig:
    """transformers' automatic compile of the decoding steps (static cache), allowed on CPU."""
    config = transformers.CompileConfig(backend=backend, mode=None)
    config._compile_all_devices = True  # transformers' own switch for compiling off the GPU
    return config


STRATEGIES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=0),
    "beams": dict(do_sample=False, num_beams=2),
    "static_cache": dict(do_sample=True, top_k=0, cache_implementation="static"),
}


@pytest.mark.parametrize("mode", MODES)
def test_generate_like_stock(mode):
    stock, ours = twins(mode)
    for strategy, kwargs in STRATEGIES.items():  # later calls reuse frozen values
        assert_same_nested(generate(stock, **kwargs), generate(ours, **kwargs), strategy)
    assert_same_state(stock, ours)


def _change(model, how: str, step: int) -> None:
    """Change the originals between two generates, the same way on stock and prepared."""
    q = model.model.layers[0].self_attn.q_proj.parametrizations.weight
    delta = model.model.layers[0].mlp.up_proj.parametrizations.weight[0]
    with torch.no_grad():
        if how == "in_place":
            for p in model.parameters():
                p.add_(1e-3 * (step + 1))
        elif how == "data":
            q.original1.data.mul_(1.5)
            delta.A.data.mul_(2.0)
        elif how in ("load_state_dict", "assign"):
            torch.manual_seed(11 + step)
            new = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
            model.load_state_dict(new, assign=how == "assign")
        elif how == "dtype":
            model.to(torch.bfloat16 if step == 0 else torch.float32)


@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_generate_after_weight_changes_is_never_stale(mode):
    stock, ours = twins(mode)
    before = None
    kwargs = dict(do_sample=True, top_k=0, max_new_tokens=4)
    for step, how in enumerate(("in_place", "data", "load_state_dict", "assign", "dtype", "dtype", None)):
        expected = generate(stock, **kwargs)  # after the previous change
        assert before is None or not torch.equal(before[1][0], expected[1][0]), "the change should show"
        before = expected
        assert_same_nested(expected, generate(ours, **kwargs), f"step {step}, before {how}")
        for model in (stock, ours):
            if how is not None:
                _change(model, how, 0 if step == 4 else 1)  # dtype: to bf16, then back
            if mode == "freeze":
                model.requires_grad_(False)
    assert_same_state(stock, ours)


# transformers' own path compiles only the decoding steps (a static cache: one shape), the
# cheapest to compile here. ``model.compile()`` and ``model.forward = torch.compile(model.forward)``
# passed with every mode too when this was written, but compile the prefill as well (slow here).
@pytest.mark.parametrize("mode", ["freeze", "auto", "inline"])
def test_compiled_generate_follows_weight_changes_like_stock(mode):
    # Both compiled alike (transformers takes other code paths under dynamo, so a compiled stock
    # is the reference); the eager backend runs the same ops, so bitwise.
    stock, ours = twins(mode)
    kwargs = dict(do_sample=True, top_k=0, max_new_tokens=3, cache_implementation="static")
    for step in range(2):
        results = [generate(model, compile_config=eager_compile_config(), **kwargs) for model in (stock, ours)]
        assert_same_nested(*results, f"step {step}")
        for model in (stock, ours):
            _change(model, "in_place" if step == 0 else "data", step)
    assert hasattr(stock, "_compiled_call") and hasattr(ours, "_compiled_call")  # it did compile
    assert_same_state(stock, ours)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _train_and_generate(stock, ours, *, steps=2, autocast=False, **generate_kwargs):
    """AdamW steps with labels (train mode), each followed by a generate in eval mode: losses,
    logits, gradients, generated tokens and scores, and the final state_dict bitwise equal."""
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (stock, ours)]
    for step in range(steps):
        results = []
        for model, optimizer in zip((stock, ours), optimizers):
            model.train()
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                out = model(PROMPT, labels=PROMPT)
            out.loss.backward()
            optimizer.step()
            model.eval()
            sample = generate(model, do_sample=True, top_k=0, **generate_kwargs)
            results.append((out.loss.detach(), out.logits.detach(), _grads(model), sample))
        assert results[0][2], "the originals should have gradients"
        assert_same_nested(results[0], results[1], f"step {step}")
    assert_same_state(stock, ours)


@pytest.mark.parametrize(("mode", "variant"), [("hoist", "spectral_norm"), ("inline", "autocast_bf16"),
                                               ("auto", "spectral_norm"), ("auto", "autocast_bf16")])
def test_training_steps_with_generate_between_like_stock(mode, variant):
    stock, ours = twins(mode, spectral=variant == "spectral_norm")
    _train_and_generate(stock, ours, autocast=variant == "autocast_bf16")


@pytest.mark.parametrize(("mode", "reentrant"), [("hoist", True), ("inline", False), ("auto", False), ("auto", True)])
def test_hf_gradient_checkpointing_trains_like_stock(mode, reentrant):
    stock, ours = twins(mode)
    for model in (stock, ours):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    _train_and_generate(stock, ours)


def tied_llama(where: str, *, eval_only: bool = False) -> torch.nn.Module:
    """A Llama with ``tie_word_embeddings=True`` and a parametrization on the shared weight's
    holders: weight_norm on ``lm_head`` (its v shares the embedding's storage), a low-rank delta
    on the input embedding (``lm_head`` then reads the original), or both."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(tie=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if where in ("lm_head", "both"):
        weight_norm(model.lm_head)
    if where in ("embed", "both"):
        parametrize.register_parametrization(model.model.embed_tokens, "weight", LowRank(VOCAB, 32))
    weight_norm(model.model.layers[0].self_attn.q_proj)
    model.eval()
    if eval_only:
        model.requires_grad_(False)
    return model


@pytest.mark.parametrize(("mode", "where"), [("hoist", "lm_head"), ("inline", "embed"), ("auto", "both")])
def test_tied_embeddings_train_and_generate_like_stock(mode, where):
    # Built twice from the seed, not deep-copied: deepcopy clones each Parameter, which would
    # untie weight_norm's v from the embedding in the copy.
    stock, ours = twins(mode, lambda **kw: tied_llama(where, **kw))
    assert_same_nested(generate(stock, do_sample=True, top_k=0), generate(ours, do_sample=True, top_k=0))
    _train_and_generate(stock, ours, steps=1)


@pytest.mark.parametrize("mode", ["hoist", "freeze"])
def test_tie_weights_and_resize_refused_like_stock_on_a_parametrized_tied_weight(mode):
    # transformers re-ties with get_parameter_or_buffer, which stock's parametrized property is
    # not: the same error while prepared, and the model generates as stock's after it.
    for where, call, error in (("lm_head", lambda m: m.tie_weights(), KeyError),
                               ("embed", lambda m: m.tie_weights(), AttributeError),
                               ("embed", lambda m: m.resize_token_embeddings(40), AttributeError)):
        stock, ours = twins(mode, lambda **kw: tied_llama(where, **kw))
        messages = []
        for model in (stock, ours):
            with pytest.raises(error) as raised:
                call(model)
            messages.append(str(raised.value))
        assert messages[0] == messages[1]
        prompt = PROMPT % 40  # tokens the shrunk embedding still has
        kwargs = dict(do_sample=True, top_k=0)
        assert_same_nested(generate(stock, prompt, **kwargs), generate(ours, prompt, **kwargs))
        assert_same_state(stock, ours)


def untied_llama(*, eval_only: bool = False) -> torch.nn.Module:
    """A Llama whose input embedding (low-rank delta) and lm_head (weight_norm) are parametrized."""
    model = llama(eval_only=eval_only)
    parametrize.register_parametrization(model.model.embed_tokens, "weight", LowRank(VOCAB, 32))
    weight_norm(model.lm_head)
    if eval_only:
        model.requires_grad_(False)
    return model


def outcome(call):
    """What ``call()`` gave: ("ok", its result), or the exception's type and message."""
    try:
        return "ok", call()
    except Exception as e:  # noqa: BLE001 -- compared with stock's
        return type(e).__name__, str(e)


@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_resize_token_embeddings_after_prepare_like_stock(mode):
    # transformers replaces the parametrized lm_head by a plain Linear holding its computed value,
    # and resizes the parametrized embedding in place through ``weight.data = ...``, which stock's
    # computed property drops (the embedding keeps 64 rows while lm_head has 80): the prepared
    # model must do the same, never serve its old values, and fail where stock fails.
    stock, ours = twins(mode, untied_llama)
    assert_same_nested(generate(stock, do_sample=True, top_k=0), generate(ours, do_sample=True, top_k=0))
    for model in (stock, ours):
        torch.manual_seed(5)  # the new rows are drawn
        model.resize_token_embeddings(80, mean_resizing=False)
    assert ours.lm_head.weight.shape == stock.lm_head.weight.shape == (80, 32)
    assert_same_state(stock, ours)
    for seed in range(3):  # sampled tokens past 64 make the next step's embedding raise
        torch.manual_seed(seed)
        results = [outcome(lambda m=m: generate(m, do_sample=True, top_k=0)) for m in (stock, ours)]
        assert_same_nested(*results)
    assert_same_state(stock, ours)


def gpt2(*, eval_only: bool = False) -> torch.nn.Module:
    """A 2-layer GPT-2 with tied embeddings: weight_norm on a ``Conv1D`` (weights stored
    in x out), a low-rank delta on another and on the tied ``wte``."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    weight_norm(model.transformer.h[0].attn.c_attn)
    parametrize.register_parametrization(model.transformer.h[1].mlp.c_fc, "weight", LowRank(32, 128))
    parametrize.register_parametrization(model.transformer.wte, "weight", LowRank(VOCAB, 32))
    model.eval()
    if eval_only:
        model.requires_grad_(False)
    return model


@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_gpt2_conv1d_generate_and_train_like_stock(mode):
    stock, ours = twins(mode, gpt2)
    for strategy in ("sample", "beams"):
        assert_same_nested(generate(stock, **STRATEGIES[strategy]), generate(ours, **STRATEGIES[strategy]))
    if mode != "freeze":
        _train_and_generate(stock, ours, steps=1)
    assert_same_state(stock, ours)


@pytest.mark.parametrize("mode", ["auto", "hoist"])
def test_generate_in_train_mode_with_spectral_norm_and_inference_mode_like_stock(mode):
    # A user who forgets eval(): generate runs a training spectral_norm's power iteration at every
    # step (its _u/_v buffers move), also inside torch.inference_mode() and parametrize.cached().
    stock, ours = twins(mode, spectral=True)
    for model in (stock, ours):
        model.train()
    for ctx in (contextlib.nullcontext, torch.inference_mode, parametrize.cached):
        results = []
        for model in (stock, ours):
            with ctx():
                results.append(generate(model, do_sample=True, top_k=0))
        assert_same_nested(*results)
        assert_same_state(stock, ours)


class WeightNormedLlama(transformers.LlamaForCausalLM):
    """A user's subclass that adds its parametrizations in ``__init__``, so ``from_pretrained``
    rebuilds them (on the meta device) and loads their originals."""

    def __init__(self, config):
        super().__init__(config)
        first, second = self.model.layers
        weight_norm(first.self_attn.q_proj)
        parametrize.register_parametrization(first.mlp.up_proj, "weight", LowRank(64, 32))
        weight_norm(second.mlp.down_proj)


def _saved_files(path) -> dict[str, bytes]:
    return {name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))}


@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_save_pretrained_from_pretrained_and_restore_like_stock(mode, tmp_path):
    def build(eval_only=False):
        torch.manual_seed(0)
        model = WeightNormedLlama(llama_config()).eval()
        return model.requires_grad_(not eval_only)

    stock, ours = twins(mode, build)
    generate(ours, do_sample=True, top_k=0)  # values frozen or hoisted before saving
    stock.save_pretrained(tmp_path / "stock")
    ours.save_pretrained(tmp_path / "ours")
    assert _saved_files(tmp_path / "stock") == _saved_files(tmp_path / "ours")  # byte for byte

    loaded = [WeightNormedLlama.from_pretrained(tmp_path / name).eval() for name in ("stock", "ours")]
    assert_same_state(stock, loaded[1])
    if mode == "freeze":
        for model in loaded:
            model.requires_grad_(False)
    reloaded_stock, reloaded = loaded[0], paramfold.prepare(loaded[1], mode)
    assert_same_nested(generate(reloaded_stock, do_sample=True, top_k=0), generate(reloaded, do_sample=True, top_k=0))

    for prepared, twin in ((reloaded, reloaded_stock), (ours, stock)):
        paramfold.restore(prepared)
        names = [{path: cls.__name__ for path, cls in classes(m).items()} for m in (twin, prepared)]
        assert names[0] == names[1]
        assert_same_state(twin, prepared)
        assert_same_nested(generate(twin, do_sample=True, top_k=0), generate(prepared, do_sample=True, top_k=0))


def draft(*, eval_only: bool = False) -> torch.nn.Module:
    """A 1-layer Llama of the same vocabulary with weight_norm on v_proj: an assistant model."""
    torch.manual_seed(1)
    config = llama_config()
    config.num_hidden_layers = 1
    model = transformers.LlamaForCausalLM(config)
    weight_norm(model.model.layers[0].self_attn.v_proj)
    return model.eval().requires_grad_(not eval_only)


@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_assisted_and_prompt_lookup_generation_like_stock(mode):
    # Speculative decoding calls both models on candidate runs of varying lengths.
    (stock, ours), (stock_draft, our_draft) = twins(mode), twins(mode, draft)
    prompt = PROMPT[:1]  # transformers' assisted decoding takes one sequence
    for kwargs in (dict(do_sample=False), dict(do_sample=True, top_k=0)):
        assert_same_nested(generate(stock, prompt, assistant_model=stock_draft, **kwargs),
                           generate(ours, prompt, assistant_model=our_draft, **kwargs))
    lookup = dict(prompt_lookup_num_tokens=2)
    assert_same_nested(generate(stock, prompt, **lookup), generate(ours, prompt, **lookup))
    assert_same_state(stock, ours)
    assert_same_state(stock_draft, our_draft)


@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_generate_under_autocast_then_without_like_stock(mode):
    # Frozen values are keyed on the autocast state: bf16 generation, then fp32, then bf16 again.
    stock, ours = twins(mode, spectral=True)
    for enabled in (True, False, True):
        results = []
        for model in (stock, ours):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
                results.append(generate(model, do_sample=True, top_k=0, max_new_tokens=3))
        assert_same_nested(*results, f"autocast {enabled}")
    assert_same_state(stock, ours)


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


def test_assert_equivalent_compiled_over_several_steps_holds_a_parametrized_llama():
    # Regression (2026-12-05 hunt): from the second step, where eager stock differed, the check
    # held the persistent compiled candidate to stock compiled afresh from the same state, both
    # accumulating into the .grad the earlier steps left, which two compilations of stock itself
    # round differently: a false difference on a Llama (with or without parametrizations). Each
    # step's gradients are now its own, as after zero_grad().
    import paramfold.testing as pt

    model = _Logits(llama()).train()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    pt.assert_equivalent(model, ids, "hoist", steps=2, compile={"backend": "aot_eager"})
