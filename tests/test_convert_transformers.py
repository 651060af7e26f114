"""Parity with transformers' own ViT, an implementation hf-vit did not write."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from transformers import AutoModelForImageClassification, ViTConfig, ViTForImageClassification, ViTModel

from hf_vit import VisionTransformerForImageClassification
from hf_vit.convert import (
    ConversionError,
    convert_transformers_checkpoint,
    hf_vit_to_transformers_module_state_dict,
    hf_vit_to_transformers_state_dict,
    transformers_to_hf_vit_state_dict,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32),
    "no-qkv-bias": dict(
        hidden_size=48, num_hidden_layers=3, num_attention_heads=3, intermediate_size=96, image_size=48, qkv_bias=False
    ),
    "patch4-gelu-new": dict(
        hidden_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=40,
        image_size=24,
        patch_size=4,
        hidden_act="gelu_new",
        layer_norm_eps=1e-6,
    ),
}


def transformers_model(name, seed=0, cls=ViTForImageClassification, **extra):
    fields = {"patch_size": 8, "num_labels": 7, **CONFIGS[name], **extra}
    torch.manual_seed(seed)
    model = cls(ViTConfig(**fields)).eval()
    # Random, non-trivial weights everywhere (transformers zero-initialises some biases).
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_converted_checkpoint_matches_transformers(tmp_path, name):
    reference = transformers_model(name)
    reference.save_pretrained(tmp_path / "source")
    convert_transformers_checkpoint(tmp_path / "source", tmp_path / "converted")
    ours = AutoModelForImageClassification.from_pretrained(tmp_path / "converted").eval()
    assert isinstance(ours, VisionTransformerForImageClassification)
    size = reference.config.image_size
    x = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(x, output_hidden_states=True)
        got = ours(x, output_hidden_states=True)
        # A non-square size through interpolate_pos_encoding: both resample the positions bicubically in 2D.
        tall = torch.randn(2, 3, size + 16, size - 8, generator=torch.Generator().manual_seed(2))
        expected_tall = reference(tall, interpolate_pos_encoding=True).logits
        got_tall = ours(tall, interpolate_pos_encoding=True).logits
    logits_err, tall_err = max_diff(got.logits, expected.logits), max_diff(got_tall, expected_tall)
    print(f"{name}: max |logits diff| {logits_err:.2e}, non-square interpolated {tall_err:.2e}")
    assert logits_err < 1e-5 and tall_err < 1e-5
    for ours_h, ref_h in zip(got.hidden_states, expected.hidden_states):
        assert max_diff(ours_h, ref_h) < 1e-5
    assert ours.config.id2label == reference.config.id2label


def test_base_model_with_pooler_becomes_pre_logits(tmp_path):
    reference = transformers_model("tiny", cls=ViTModel)
    reference.save_pretrained(tmp_path / "source")
    ours = convert_transformers_checkpoint(tmp_path / "source", tmp_path / "converted")
    assert ours.config.representation_size == 32 and ours.config.num_labels == 0
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = reference(x)
        got = ours(x, output_hidden_states=True)
    assert max_diff(got.logits, expected.pooler_output) < 1e-5  # identity head: logits are tanh(pre_logits(y))
    assert max_diff(got.hidden_states[-1], ours.vit(x).last_hidden_state) > 0  # hidden states are pre-norm
    assert max_diff(ours.vit(x).last_hidden_state, expected.last_hidden_state) < 1e-5


def test_state_dict_round_trip_is_exact():
    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(tiny_config(zero_init_head=False))
    state = model.state_dict()
    back = transformers_to_hf_vit_state_dict(hf_vit_to_transformers_state_dict(state))
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    # hf-vit's weights in transformers' layout load into transformers' ViT and compute the same function.
    reference = ViTForImageClassification(
        ViTConfig(
            **{k: getattr(model.config, k) for k in CONFIGS["tiny"]},
            patch_size=8,
            num_labels=5,
            layer_norm_eps=model.config.layer_norm_eps,
        )
    ).eval()
    missing, unexpected = reference.load_state_dict(hf_vit_to_transformers_module_state_dict(state), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert max_diff(reference(x).logits, model.eval()(x).logits) < 1e-5


def test_in_memory_v5_names_are_accepted():
    reference = transformers_model("tiny")
    converted = transformers_to_hf_vit_state_dict(reference.state_dict())
    model = VisionTransformerForImageClassification(tiny_config(num_labels=7, layer_norm_eps=1e-12))
    model.load_state_dict(converted, strict=True)


def test_leftover_and_missing_arrays_are_listed(tmp_path):
    state = transformers_model("tiny").state_dict()
    incomplete = {k: v for k, v in state.items() if "layers.1.attention.k_proj" not in k}
    with pytest.raises(ConversionError) as error:
        transformers_to_hf_vit_state_dict({**incomplete, "vit.mystery.weight": torch.zeros(1)})
    message = str(error.value)  # everything wrong, listed at once, in transformers' (saved) names
    assert "no place in hf-vit: ['vit.mystery.weight']" in message
    key = "vit.encoder.layer.1.attention.attention.key"
    assert f"lacks: ['{key}.bias', '{key}.weight']" in message
    config = tiny_config(num_labels=7, layer_norm_eps=1e-12, num_hidden_layers=3)  # one block more than the weights
    with pytest.raises(ConversionError, match=r"lacks: \['vit\.encoder\.layer\.2\.attention\.attention\.key\.bias'"):
        transformers_to_hf_vit_state_dict(state, config)


def test_failed_conversion_writes_nothing(tmp_path):
    source = tmp_path / "source"
    transformers_model("tiny").save_pretrained(source)
    (source / "config.json").write_text(
        (source / "config.json").read_text().replace('"hidden_size": 32', '"hidden_size": 40')
    )
    with pytest.raises(ConversionError, match="does not fit"):
        convert_transformers_checkpoint(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["source"]  # no staging folder left behind


def test_command_line(tmp_path, capsys):
    transformers_model("tiny").save_pretrained(tmp_path / "source")
    cmd = [sys.executable, str(ROOT / "scripts" / "convert_checkpoint.py"), "--source", "transformers"]
    done = subprocess.run(
        cmd + ["--input", str(tmp_path / "source"), "--output", str(tmp_path / "out")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert {"model.safetensors", "config.json", "preprocessor_config.json", "modeling_vit.py"} <= {
        p.name for p in (tmp_path / "out").iterdir()
    }
    # the refusal through the same command's function in this process (each script start imports torch anew)
    from hf_vit.commands.convert import main

    capsys.readouterr()
    flags = ["--source", "transformers", "--input", str(tmp_path / "source"), "--output", str(tmp_path / "out")]
    assert main(flags) == 2
    assert "not empty" in capsys.readouterr().err
