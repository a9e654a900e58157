"""More real third-party model code, and what their users call on it, bitwise against stock.

``tests/test_third_party.py`` covers SpeechT5's HiFi-GAN, DAC, EnCodec, Wav2Vec2 and three
geotorch constraints. This file adds the other transformers models that carry weight_norm
parametrizations -- VITS (weight-normed WaveNets in its flows, a HiFi-GAN, and noise drawn in
its forward), UnivNet (kernel predictor), SeamlessM4T's unit HiFi-GAN (embeddings and a variance
predictor around it), Xcodec (DAC convs plus a HuBERT semantic model run under ``no_grad`` inside
the forward, which sets an attribute on first use), Mimi and WavTokenizer codecs, and the
speech encoders whose positional conv is weight-normed (HuBERT, WavLM, SEW, SEW-D, UniSpeech,
UniSpeech-SAT, Wav2Vec2-Conformer, FastSpeech2Conformer's HiFi-GAN) -- and geotorch's other
constraints, including their ``sample()`` + ``right_inverse`` initialisation. It also pins the
calls users make on such models while prepared: HF ``remove_weight_norm()`` (Xcodec's works in
stock and is then refused at the next call as documented; the HiFi-GAN family's raises in stock
and raises the same while prepared), weight_norm registered on a layer that was not prepared,
and ``save_pretrained`` / ``from_pretrained`` (local directory). Built from tiny configs with
random weights (no hub access); skipped without transformers / geotorch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import paramfold
import paramfold.testing as pt
from helpers import Audio

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _weight_normed(model: nn.Module) -> nn.Module:
    """``model`` with its weight_norm parametrizations: those its constructor adds, else those of
    its (or, where the model has none, its submodules') ``apply_weight_norm``."""
    if not paramfold.find(model):
        owners = [model] if hasattr(model, "apply_weight_norm") else model.modules()
        for module in owners:
            if hasattr(module, "apply_weight_norm"):
                module.apply_weight_norm()
    assert paramfold.find(model), "the model should carry weight_norm parametrizations"
    return model


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------

_ENCODER = dict(
    hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
    conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 3), num_conv_pos_embeddings=8,
    num_conv_pos_embedding_groups=2, hidden_dropout=0.0, activation_dropout=0.0,
    attention_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
    apply_spec_augment=False,
)
_HIFIGAN = dict(
    upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4], resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]],
)


def vits():
    config = transformers.VitsConfig(
        vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, ffn_dim=16, flow_size=8,
        spectrogram_bins=9, upsample_initial_channel=8, depth_separable_num_layers=1,
        duration_predictor_num_flows=1, duration_predictor_filter_channels=8, prior_encoder_num_flows=1,
        prior_encoder_num_wavenet_layers=2, posterior_encoder_num_wavenet_layers=2, wavenet_kernel_size=3,
        layerdrop=0.0, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        duration_predictor_dropout=0.0, **_HIFIGAN,
    )
    return Audio(_weight_normed(transformers.VitsModel(config)), "waveform"), torch.randint(0, 10, (1, 5))


class _UnivNet(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, spectrogram, noise):
        return self.model(input_features=spectrogram, noise_sequence=noise).waveforms


def _univnet_config():
    # UnivNet's kernel predictor needs kernel_predictor_hidden_channels == model_in_channels.
    return transformers.UnivNetConfig(
        model_in_channels=4, model_hidden_channels=4, num_mel_bins=4, resblock_kernel_sizes=[3],
        resblock_stride_sizes=[2], resblock_dilation_sizes=[[1, 2]], kernel_predictor_num_blocks=1,
        kernel_predictor_hidden_channels=4, kernel_predictor_conv_size=3, kernel_predictor_dropout=0.0,
    )


def univnet():
    model = _UnivNet(_weight_normed(transformers.UnivNetModel(_univnet_config())))
    return model, (torch.randn(2, 5, 4), torch.randn(2, 5, 4))


class _UnitVocoder(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, units):
        return self.model(units, spkr_id=torch.tensor([[1]]), lang_id=torch.tensor([[1]]))[0]


def seamless_vocoder():
    config = transformers.SeamlessM4TConfig(
        upsample_initial_channel=8, unit_hifi_gan_vocab_size=10, unit_embed_dim=8, lang_embed_dim=4,
        spkr_embed_dim=4, vocoder_num_langs=2, vocoder_num_spkrs=2, var_pred_dropout=0.0, **_HIFIGAN,
    )
    return _UnitVocoder(_weight_normed(transformers.SeamlessM4TCodeHifiGan(config))), torch.randint(0, 10, (1, 7))


def xcodec():
    semantic = transformers.HubertConfig(**{**_ENCODER, "conv_kernel": (4, 2), "conv_stride": (4, 2)})
    config = transformers.XcodecConfig(
        target_bandwidths=[0.5], sample_rate=400, kernel_size=3, channel_ratios=[1], strides=[1],
        block_dilations=[1], unit_kernel_size=3, codebook_size=8, semantic_model_config=semantic,
        acoustic_model_config=dict(
            encoder_hidden_size=4, downsampling_ratios=[8], upsampling_ratios=[8], decoder_hidden_size=8,
            hidden_size=8, n_codebooks=2, codebook_size=8, codebook_dim=4, quantizer_dropout=0.0,
        ),
    )
    model = transformers.XcodecModel(config)
    model.apply_weight_norm()  # its HuBERT's positional conv is weight-normed already
    assert len(paramfold.find(model)) > 1
    return Audio(model, "audio_values"), torch.randn(2, 1, 64)


def mimi():
    config = transformers.MimiConfig(
        hidden_size=16, num_filters=4, num_residual_layers=1, upsampling_ratios=[2, 2], codebook_size=8,
        codebook_dim=8, vector_quantization_hidden_dimension=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, intermediate_size=32, num_quantizers=2, num_semantic_quantizers=1,
        frame_rate=None, sampling_rate=400, kernel_size=3, last_kernel_size=3, residual_kernel_size=3, compress=2,
        upsample_groups=16, sliding_window=16, use_cache=False,
    )
    return Audio(_weight_normed(transformers.MimiModel(config)), "audio_values"), torch.randn(2, 1, 64)


def wavtokenizer():
    config = transformers.WavTokenizerConfig(
        num_filters=4, upsampling_ratios=[2, 2], num_lstm_layers=1, hidden_size=8, codebook_size=8, codebook_dim=8,
        decoder_hidden_size=8, decoder_intermediate_size=16, decoder_num_layers=1, decoder_attention_num_groups=2,
        kernel_size=3, last_kernel_size=3, sampling_rate=400,
    )
    return Audio(_weight_normed(transformers.WavTokenizerModel(config)), "audio_values"), torch.randn(2, 1, 64)


def _encoder(model_class: str, config_class: str, **extra):
    def build():
        config = getattr(transformers, config_class)(**_ENCODER, **extra)
        model = _weight_normed(getattr(transformers, model_class)(config))
        return Audio(model, "last_hidden_state"), torch.randn(2, 400)

    return build


def fastspeech2_hifigan():
    config = transformers.FastSpeech2ConformerHifiGanConfig(
        model_in_dim=8, upsample_initial_channel=16, normalize_before=False, **_HIFIGAN,
    )
    return _weight_normed(transformers.FastSpeech2ConformerHifiGan(config)), torch.randn(2, 6, 8)


#: The most distinctive models, run through every mode.
MODELS = {"vits": vits, "univnet": univnet, "xcodec": xcodec}
#: The rest (weight_norm in a positional conv, or another HiFi-GAN or codec): one cheap check each.
MORE = {
    "hubert": _encoder("HubertModel", "HubertConfig"),
    "wavlm": _encoder("WavLMModel", "WavLMConfig", num_buckets=8, max_bucket_distance=20),
    "sew": _encoder("SEWModel", "SEWConfig", squeeze_factor=2),
    "sew_d": _encoder("SEWDModel", "SEWDConfig", squeeze_factor=2, position_buckets=8, max_position_embeddings=32),
    "unispeech": _encoder("UniSpeechModel", "UniSpeechConfig"),
    "unispeech_sat": _encoder("UniSpeechSatModel", "UniSpeechSatConfig"),
    "wav2vec2_conformer": _encoder(
        "Wav2Vec2ConformerModel", "Wav2Vec2ConformerConfig", position_embeddings_type="relative",
        conv_depthwise_kernel_size=3,
    ),
    "fastspeech2_hifigan": fastspeech2_hifigan,
    "seamless_vocoder": seamless_vocoder,
    "mimi": mimi,
    "wavtokenizer": wavtokenizer,
}


def _build(builder):
    torch.manual_seed(0)
    model, x = builder()
    return model.train(), x


def _frozen(builder):
    model, x = _build(builder)
    return model.eval().requires_grad_(False), x


@pytest.mark.parametrize(
    ("name", "mode"),
    [(name, mode) for name in ("univnet", "vits") for mode in ("hoist", "inline", "auto")] + [("xcodec", "auto")],
)
def test_training_bitwise_equal_to_stock(name, mode):
    model, x = _build(MODELS[name])
    pt.assert_equivalent(model, x, mode, steps=2)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_freeze_inference_bitwise_equal_to_stock(name):
    model, x = _frozen(MODELS[name])
    with torch.no_grad():
        pt.assert_equivalent(model, x, "freeze", steps=2)


@pytest.mark.parametrize("name", sorted(MORE))
def test_more_models_train_and_freeze_bitwise_equal_to_stock(name):
    model, x = _build(MORE[name])
    pt.assert_equivalent(model, x, "auto", steps=1)
    model, x = _frozen(MORE[name])
    with torch.no_grad():
        pt.assert_equivalent(model, x, "freeze", steps=1)


@pytest.mark.parametrize("name", ["univnet"])
def test_compiled_bitwise_equal_to_stock(name):
    model, x = _build({**MODELS, **MORE}[name])
    pt.assert_equivalent(model, x, "auto", steps=1, compile={"backend": "aot_eager"})
    torch._dynamo.reset()
    model, x = _frozen({**MODELS, **MORE}[name])
    with torch.no_grad():
        pt.assert_equivalent(model, x, "freeze", steps=1, compile={"backend": "aot_eager"})


# --------------------------------------------------------------------------------------------
# What users call on these models while prepared
# --------------------------------------------------------------------------------------------


def _state_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("mode", ["hoist", "freeze"])
def test_xcodec_remove_weight_norm_while_prepared_is_refused_then_restore_matches_stock(mode):
    """Xcodec's ``remove_weight_norm`` (``remove_parametrizations(leave_parametrized=True)``)
    works in stock. While prepared it changes the modules like stock, the next call raises a
    FoldError (README, "Changing parametrizations while prepared") and leaves them as they were;
    ``restore`` then gives stock's model, which prepares and runs like stock again."""
    wrapper, x = _frozen(xcodec)
    stock, ours = copy.deepcopy(wrapper), paramfold.prepare(copy.deepcopy(wrapper), mode)
    with torch.no_grad():
        assert torch.equal(ours(x), stock(x))
    stock.model.remove_weight_norm()
    ours.model.remove_weight_norm()
    assert _state_equal(ours, stock)
    with torch.no_grad():
        expected = stock(x)
        with pytest.raises(paramfold.FoldError, match="changed after paramfold.prepare"):
            ours(x)
        assert _state_equal(ours, stock)
        paramfold.restore(ours)
        assert torch.equal(ours(x), expected)
        assert [s.module_path for s in paramfold.find(ours)] == [s.module_path for s in paramfold.find(stock)]
        paramfold.prepare(ours, mode)
        assert torch.equal(ours(x), expected)
    assert _state_equal(ours, stock)


@pytest.mark.parametrize("builder", [univnet, fastspeech2_hifigan, seamless_vocoder])
def test_hf_remove_weight_norm_raises_like_stock_and_the_model_keeps_working(builder):
    """The HiFi-GAN family's ``remove_weight_norm`` calls the hook-based
    ``nn.utils.remove_weight_norm`` on layers ``apply_weight_norm`` parametrized: stock raises
    ValueError at the first layer, having changed nothing. Prepared, the same error, the same
    (unchanged) model, and the next call still matches stock."""
    model, x = _frozen(builder)
    args = x if isinstance(x, tuple) else (x,)
    stock, ours = copy.deepcopy(model), paramfold.prepare(copy.deepcopy(model), "auto")
    hf_stock, hf_ours = (getattr(m, "model", m) for m in (stock, ours))
    with pytest.raises(ValueError) as expected:
        hf_stock.remove_weight_norm()
    with pytest.raises(ValueError) as actual:
        hf_ours.remove_weight_norm()
    assert str(actual.value) == str(expected.value)
    assert _state_equal(ours, stock)
    with torch.no_grad():
        assert torch.equal(ours(*args), stock(*args))


@pytest.mark.parametrize(
    ("mode", "compiled"), [("hoist", False), ("inline", False), ("auto", False), ("freeze", True)]
)
def test_weight_norm_on_a_layer_not_prepared_runs_like_stock(mode, compiled):
    """A user adding weight_norm, after some calls, to a layer that had none at ``prepare`` time
    (UnivNet's ``conv_post`` here): that layer is not paramfold's, so it computes as in stock,
    eager or compiled, and the prepared site (``conv_pre``) goes on being served; outputs and
    gradients bitwise."""
    torch.manual_seed(0)
    hf = transformers.UnivNetModel(_univnet_config()).train()
    weight_norm(hf.conv_pre)
    if mode == "freeze":
        hf.eval().requires_grad_(False)
    spectrogram, noise = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    stock, ours = _UnivNet(copy.deepcopy(hf)), paramfold.prepare(_UnivNet(copy.deepcopy(hf)), mode)
    run = torch.compile(ours, backend="aot_eager") if compiled else ours
    for step in range(3):
        if step == 1:
            for m in (stock, ours):
                weight_norm(m.model.conv_post)
        with torch.set_grad_enabled(mode != "freeze"):
            expected, actual = stock(spectrogram, noise), run(spectrogram, noise)
        assert torch.equal(actual, expected), step
        if mode != "freeze":
            expected.sum().backward()
            actual.sum().backward()
            for (name, p), q in zip(stock.named_parameters(), ours.parameters()):
                assert (p.grad is None) == (q.grad is None), name
                assert p.grad is None or torch.equal(q.grad, p.grad), name
        with torch.no_grad():
            for p, q in zip(stock.parameters(), ours.parameters()):
                delta = 1e-2 * (p.grad if p.grad is not None else p)
                p.sub_(delta)
                q.sub_(delta)
                p.grad = q.grad = None
    assert _state_equal(ours, stock)


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto", "freeze"])
def test_save_pretrained_of_a_prepared_model_matches_stock(mode, tmp_path):
    """``save_pretrained`` of a prepared HuBERT writes stock's tensors, and ``from_pretrained``
    of that directory builds a model that computes like stock's."""
    safetensors = pytest.importorskip("safetensors.torch")
    model, x = _frozen(MORE["hubert"])
    stock, ours = copy.deepcopy(model), paramfold.prepare(copy.deepcopy(model), mode)
    with torch.no_grad():
        expected = stock(x)
        assert torch.equal(ours(x), expected)
    stock.model.save_pretrained(tmp_path / "stock")
    ours.model.save_pretrained(tmp_path / "ours")
    saved = {k: safetensors.load_file(tmp_path / k / "model.safetensors") for k in ("stock", "ours")}
    assert list(saved["ours"]) == list(saved["stock"])
    assert all(torch.equal(saved["ours"][k], saved["stock"][k]) for k in saved["stock"])
    loaded = transformers.HubertModel.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert torch.equal(Audio(loaded, "last_hidden_state")(x), expected)
        assert torch.equal(ours(x), expected)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_auto_alternating_training_steps_and_eval_inference_matches_stock(compiled):
    """A user's loop on a vocoder: an Adam step in train mode, then ``eval()`` + ``no_grad()``
    inference (auto freezes there), and back; every output and the state as stock's."""
    model, args = _build(univnet)
    stock, ours = copy.deepcopy(model), paramfold.prepare(copy.deepcopy(model), "auto")
    run = torch.compile(ours, backend="aot_eager") if compiled else ours
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (stock, ours)]
    for step in range(2):
        outputs = []
        for module, call, optimizer in zip((stock, ours), (stock, run), optimizers):
            module.train()
            call(*args).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            module.eval()
            with torch.no_grad():
                outputs.append(call(*args))
        assert torch.equal(outputs[1], outputs[0]), step
        assert _state_equal(ours, stock)


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto", "freeze"])
def test_torchao_weight_norm_sparsifier_steps_then_squash_mask(mode):
    """torchao's WeightNormSparsifier on a model prepared after ``sparsifier.prepare``: training
    (or frozen inference) with ``sparsifier.step()`` rewriting the masks in place between calls
    runs like stock; ``squash_mask()`` while prepared removes the parametrizations like stock,
    the next call is refused (README, "Changing parametrizations while prepared"), and after
    ``restore`` the model is stock's."""
    pytest.importorskip("torchao")
    from torchao.prototype.sparsity.sparsifier.weight_norm_sparsifier import WeightNormSparsifier

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    if mode == "freeze":
        net.requires_grad_(False)
    copies, sparsifiers = [copy.deepcopy(net), copy.deepcopy(net)], []
    for model in copies:
        sparsifier = WeightNormSparsifier(sparsity_level=0.5, sparse_block_shape=(1, 4), zeros_per_block=2)
        sparsifier.prepare(model, [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "2.weight"}])
        sparsifiers.append(sparsifier)
    stock, ours = copies
    paramfold.prepare(ours, mode)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in copies] if mode != "freeze" else None
    x = torch.randn(4, 16)
    for _ in range(3):
        outputs = []
        for i, model in enumerate(copies):
            if optimizers:
                out = model(x)
                out.square().sum().backward()
                optimizers[i].step()
                optimizers[i].zero_grad()
            else:
                with torch.no_grad():
                    out = model(x)
            outputs.append(out.detach())
            sparsifiers[i].step()
        assert torch.equal(outputs[1], outputs[0])
        assert _state_equal(ours, stock)
    for sparsifier in sparsifiers:
        sparsifier.squash_mask()
    assert _state_equal(ours, stock)
    with torch.no_grad():
        expected = stock(x)
        with pytest.raises(paramfold.FoldError, match="changed after paramfold.prepare"):
            ours(x)
        paramfold.restore(ours)
        assert not paramfold.find(ours)
        assert torch.equal(ours(x), expected)


# --------------------------------------------------------------------------------------------
# geotorch's other constraints
# --------------------------------------------------------------------------------------------


def _geotorch_models():
    geotorch = pytest.importorskip("geotorch", reason="geotorch is not installed (pip install -e '.[test]')")
    torch.manual_seed(0)
    first = nn.Sequential(*(nn.Sequential(nn.Linear(5, 5), nn.Tanh()) for _ in range(5)))
    geotorch.positive_definite(first[0][0], "weight")
    geotorch.low_rank(first[1][0], "weight", 2)
    geotorch.almost_orthogonal(first[2][0], "weight", 0.5)
    geotorch.skew(first[3][0], "weight")
    geotorch.sln(first[4][0], "weight")
    second = nn.Sequential(*(nn.Sequential(nn.Linear(5, 5), nn.Tanh()) for _ in range(4)))
    geotorch.symmetric(second[0][0], "weight")
    geotorch.fixed_rank(second[1][0], "weight", 2)
    geotorch.invertible(second[2][0], "weight")
    geotorch.positive_semidefinite(second[3][0], "weight")
    return first, second


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto", "freeze"])
def test_geotorch_constraints_bitwise_equal_to_stock(mode):
    for model in _geotorch_models():
        assert len(paramfold.find(model)) == len(model)
        x = torch.randn(3, 5)
        if mode == "freeze":
            model.eval().requires_grad_(False)
            with torch.no_grad():
                pt.assert_equivalent(model, x, mode, steps=2)
        else:
            pt.assert_equivalent(model, x, mode, steps=2)


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto", "freeze"])
def test_geotorch_sample_initialisation_while_prepared_matches_stock(mode):
    """geotorch's initialisation idiom, ``layer.weight = layer.parametrizations.weight[0].sample()``
    (through ``right_inverse``), between training steps of a prepared model: the same originals,
    reads and outputs as stock (freeze serves the new value)."""
    first, _ = _geotorch_models()
    if mode == "freeze":
        first.eval().requires_grad_(False)
    stock, ours = copy.deepcopy(first), paramfold.prepare(copy.deepcopy(first), mode)
    x = torch.randn(3, 5)
    for step in range(2):
        with torch.set_grad_enabled(mode != "freeze"):
            expected, actual = stock(x), ours(x)
        assert torch.equal(actual, expected)
        if mode != "freeze":
            expected.sum().backward()
            actual.sum().backward()
            for p, q in zip(stock.parameters(), ours.parameters()):
                assert torch.equal(q.grad, p.grad)
        for model in (stock, ours):
            torch.manual_seed(10 + step)
            with torch.no_grad():
                for block in model:
                    block[0].weight = block[0].parametrizations.weight[0].sample()
        assert _state_equal(ours, stock)
        with torch.no_grad():
            assert all(torch.equal(a[0].weight, b[0].weight) for a, b in zip(stock, ours))


# --------------------------------------------------------------------------------------------
# paramfold.testing on models that set attributes in their forward
# --------------------------------------------------------------------------------------------


class _Lazy(nn.Module):
    """Sets an attribute on its first call, as transformers' output-capturing models do
    (``_output_capturing_hooks_installed``, Xcodec's HuBERT)."""

    def __init__(self):
        super().__init__()
        self.lin = weight_norm(nn.Linear(4, 4))

    def forward(self, x):
        if not getattr(self, "_hooks_installed", False):
            self._hooks_installed = True
        return self.lin(x)


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
def test_assert_equivalent_allows_attributes_stock_sets_in_its_forward(mode):
    torch.manual_seed(0)
    pt.assert_equivalent(_Lazy(), torch.randn(2, 4), mode, steps=2)


def test_assert_equivalent_still_reports_attributes_only_the_prepared_copy_keeps(monkeypatch):
    """The allowance is for what stock does too: an attribute left behind on the restored copy
    alone still fails the structure check."""
    torch.manual_seed(0)
    restore = paramfold.restore

    def leaky_restore(model):
        out = restore(model)
        model.lin.leftover = True
        return out

    monkeypatch.setattr(paramfold, "restore", leaky_restore)
    with pytest.raises(AssertionError, match=r"after paramfold.restore: .*added \['leftover'\]"):
        pt.assert_equivalent(_Lazy(), torch.randn(2, 4), "hoist")
