"""Real third-party model code through every mode, eager and compiled, bitwise against stock.

transformers' HiFi-GAN vocoder, DAC and EnCodec codecs and Wav2Vec2 encoder (weight_norm in
their convolutions) and a geotorch-constrained model, built from small configs with random
weights (no hub access). Skipped with a reason when the package is absent; ``.[test]``
installs both.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paramfold
import paramfold.testing as pt
from helpers import Audio

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")


def _weight_normed(model: nn.Module) -> nn.Module:
    if not paramfold.find(model) and hasattr(model, "apply_weight_norm"):
        model.apply_weight_norm()
    assert paramfold.find(model), "the model should carry weight_norm parametrizations"
    return model


def hifigan():
    config = transformers.SpeechT5HifiGanConfig(
        model_in_dim=8, upsample_initial_channel=16, upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4],
        resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]], normalize_before=False,
    )
    model = _weight_normed(transformers.SpeechT5HifiGan(config))
    return model, torch.randn(2, 6, 8)


def dac():
    config = transformers.DacConfig(
        encoder_hidden_size=4, downsampling_ratios=[2, 2], decoder_hidden_size=8, n_codebooks=2,
        codebook_size=8, codebook_dim=4, quantizer_dropout=0.0,
    )
    model = _weight_normed(transformers.DacModel(config))
    return Audio(model, "audio_values"), torch.randn(2, 1, 64)


def encodec():
    config = transformers.EncodecConfig(
        target_bandwidths=[1.5], sampling_rate=400, audio_channels=1, hidden_size=8, num_filters=4,
        num_residual_layers=1, upsampling_ratios=[2, 2], codebook_size=8, codebook_dim=8,
        num_lstm_layers=1, norm_type="weight_norm",
    )
    model = _weight_normed(transformers.EncodecModel(config))
    return Audio(model, "audio_values"), torch.randn(2, 1, 64)


def wav2vec2():
    config = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, hidden_dropout=0.0, activation_dropout=0.0,
        attention_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
        apply_spec_augment=False,
    )
    model = _weight_normed(transformers.Wav2Vec2Model(config))
    return Audio(model, "last_hidden_state"), torch.randn(2, 400)


def geotorch_model():
    geotorch = pytest.importorskip("geotorch", reason="geotorch is not installed (pip install -e '.[test]')")
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 6))
    geotorch.orthogonal(model[0], "weight")
    geotorch.sphere(model[2], "bias")
    geotorch.grassmannian(model[4], "weight")
    assert paramfold.find(model)
    return model, torch.randn(3, 6)


MODELS = {"hifigan": hifigan, "dac": dac, "encodec": encodec, "wav2vec2": wav2vec2, "geotorch": geotorch_model}


def _build(name):
    torch.manual_seed(0)
    model, x = MODELS[name]()
    return model.train(), x


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_bitwise_equal_to_stock(name, mode):
    model, x = _build(name)
    pt.assert_equivalent(model, x, mode, steps=2)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_freeze_inference_bitwise_equal_to_stock(name):
    model, x = _build(name)
    model.eval().requires_grad_(False)
    with torch.no_grad():
        pt.assert_equivalent(model, x, "freeze", steps=2)


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_compiled_bitwise_equal_to_stock(name, mode):
    model, x = _build(name)
    torch._dynamo.reset()
    pt.assert_equivalent(model, x, mode, steps=1, compile={"backend": "aot_eager"})


@pytest.mark.parametrize("name", sorted(MODELS))
def test_compiled_freeze_bitwise_equal_to_stock(name):
    model, x = _build(name)
    model.eval().requires_grad_(False)
    torch._dynamo.reset()
    with torch.no_grad():
        pt.assert_equivalent(model, x, "freeze", steps=1, compile={"backend": "aot_eager"})
