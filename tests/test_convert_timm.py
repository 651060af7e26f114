"""timm `VisionTransformer` state dicts: exact mapping, config inference, unsupported layouts, and logits against
transformers' own ViT holding the same weights (an implementation hf-vit did not write)."""

import argparse
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from safetensors.torch import save_file
from transformers import ViTConfig, ViTForImageClassification, ViTModel

from hf_vit import VisionTransformerForImageClassification
from hf_vit.convert import (
    ConversionError,
    convert_timm_checkpoint,
    hf_vit_to_timm_state_dict,
    infer_config_from_timm,
    load_timm_state_dict,
    timm_to_hf_vit_state_dict,
)
from hf_vit.model.resolution import resample_position_embeddings

ROOT = Path(__file__).resolve().parents[1]
SPECS = {
    "tiny": dict(width=32, depth=2, heads=4, mlp=64, patch=8, image=32, classes=5),
    "no-qkv-bias": dict(width=48, depth=2, heads=3, mlp=96, patch=8, image=24, classes=4, qkv_bias=False),
    "patch4": dict(width=24, depth=1, heads=2, mlp=40, patch=4, image=16, classes=3),
}


def random_timm(width, depth, mlp, patch, image, classes, heads=None, cls=True, rep=None, qkv_bias=True, seed=0):
    """Random weights under timm's names, written from timm's module tree, not from hf-vit."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    grid = image // patch
    sd = {
        "patch_embed.proj.weight": normal(width, 3, patch, patch, scale=(3 * patch * patch) ** -0.5),
        "patch_embed.proj.bias": normal(width, scale=0.1),
        "pos_embed": normal(1, grid * grid + cls, width, scale=0.5),
    }
    if cls:
        sd["cls_token"] = normal(1, 1, width, scale=0.5)
    for i in range(depth):
        b = f"blocks.{i}."
        for norm in ("norm1", "norm2"):
            sd[f"{b}{norm}.weight"] = 1 + normal(width, scale=0.1)
            sd[f"{b}{norm}.bias"] = normal(width, scale=0.1)
        sd[f"{b}attn.qkv.weight"] = normal(3 * width, width, scale=width**-0.5)
        if qkv_bias:
            sd[f"{b}attn.qkv.bias"] = normal(3 * width, scale=0.1)
        sd[f"{b}attn.proj.weight"] = normal(width, width, scale=width**-0.5)
        sd[f"{b}attn.proj.bias"] = normal(width, scale=0.1)
        sd[f"{b}mlp.fc1.weight"] = normal(mlp, width, scale=width**-0.5)
        sd[f"{b}mlp.fc1.bias"] = normal(mlp, scale=0.1)
        sd[f"{b}mlp.fc2.weight"] = normal(width, mlp, scale=mlp**-0.5)
        sd[f"{b}mlp.fc2.bias"] = normal(width, scale=0.1)
    sd["norm.weight"] = 1 + normal(width, scale=0.1)
    sd["norm.bias"] = normal(width, scale=0.1)
    features = width
    if rep:
        sd["pre_logits.fc.weight"] = normal(rep, width, scale=width**-0.5)
        sd["pre_logits.fc.bias"] = normal(rep, scale=0.1)
        features = rep
    if classes:
        sd["head.weight"] = normal(classes, features, scale=features**-0.5)
        sd["head.bias"] = normal(classes, scale=0.1)
    return sd


def transformers_vit(sd, heads, image, patch, with_head=True, qkv_bias=True):
    """transformers' ViT holding timm weights `sd` (class-token pooling, LayerNorm eps 1e-6 as timm uses)."""
    width, depth = sd["patch_embed.proj.weight"].shape[0], 1 + max(int(k.split(".")[1]) for k in sd if "blocks" in k)
    fields = dict(
        hidden_size=width,
        num_hidden_layers=depth,
        num_attention_heads=heads,
        intermediate_size=sd["blocks.0.mlp.fc1.weight"].shape[0],
        image_size=image,
        patch_size=patch,
        layer_norm_eps=1e-6,
        hidden_act="gelu",
        qkv_bias=qkv_bias,
    )
    mapped = {
        "vit.embeddings.cls_token": sd["cls_token"],
        "vit.embeddings.position_embeddings": sd["pos_embed"],
        "vit.embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
        "vit.embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
        "vit.layernorm.weight": sd["norm.weight"],
        "vit.layernorm.bias": sd["norm.bias"],
    }
    for i in range(depth):
        b, t = f"blocks.{i}.", f"vit.layers.{i}."
        for part, name in zip(sd[f"{b}attn.qkv.weight"].chunk(3), ("q_proj", "k_proj", "v_proj")):
            mapped[f"{t}attention.{name}.weight"] = part
        if qkv_bias:
            for part, name in zip(sd[f"{b}attn.qkv.bias"].chunk(3), ("q_proj", "k_proj", "v_proj")):
                mapped[f"{t}attention.{name}.bias"] = part
        pairs = [("attn.proj", "attention.o_proj"), ("norm1", "layernorm_before"), ("norm2", "layernorm_after")]
        pairs += [("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")]
        for ours, theirs in pairs:
            for kind in ("weight", "bias"):
                mapped[f"{t}{theirs}.{kind}"] = sd[f"{b}{ours}.{kind}"]
    if with_head:
        model = ViTForImageClassification(ViTConfig(**fields, num_labels=sd["head.weight"].shape[0]))
        mapped.update({"classifier.weight": sd["head.weight"], "classifier.bias": sd["head.bias"]})
    else:  # the base model with its pooler (dense + tanh on the class token): timm's pre_logits
        model = ViTModel(ViTConfig(**fields, pooler_output_size=sd["pre_logits.fc.weight"].shape[0]))
        mapped = {k.removeprefix("vit."): v for k, v in mapped.items()}
        mapped.update(
            {"pooler.dense.weight": sd["pre_logits.fc.weight"], "pooler.dense.bias": sd["pre_logits.fc.bias"]}
        )
    model.load_state_dict(mapped, strict=True)
    return model.eval()


def max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_converted_logits_match_transformers(tmp_path, name):
    spec = SPECS[name]
    sd = random_timm(**spec)
    save_file(sd, tmp_path / "model.safetensors")
    ours = convert_timm_checkpoint(tmp_path / "model.safetensors", tmp_path / "out", num_attention_heads=spec["heads"])
    assert ours.config.qkv_bias == spec.get("qkv_bias", True)
    reference = transformers_vit(sd, spec["heads"], spec["image"], spec["patch"], qkv_bias=ours.config.qkv_bias)
    x = torch.randn(3, 3, spec["image"], spec["image"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = max_diff(ours(x).logits, reference(x).logits)
    print(f"{name}: max |logits - transformers ViT| = {err:.2e}")
    assert err < 1e-5


def test_pre_logits_match_transformers_pooler(tmp_path):
    sd = random_timm(width=32, depth=2, mlp=64, patch=8, image=32, classes=6, rep=20, seed=2)
    torch.save(sd, tmp_path / "weights.pth")
    ours = convert_timm_checkpoint(tmp_path / "weights.pth", tmp_path / "out", num_attention_heads=4)
    assert ours.config.representation_size == 20 and ours.config.num_labels == 6
    reference = transformers_vit(sd, 4, 32, 8, with_head=False)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(x).pooler_output @ sd["head.weight"].T + sd["head.bias"]
        err = max_diff(ours(x).logits, expected)
    print(f"pre-logits: max |logits - transformers ViT pooler + head| = {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"classifier": "gap"},
        {"representation_size": 24, "num_labels": 9},
        {"classifier": "gap", "patch_size": 4, "image_size": 16, "num_labels": 0},
        {"qkv_bias": False},
    ],
)
def test_round_trips_are_bitwise_exact(overrides):
    torch.manual_seed(0)
    config = tiny_config(zero_init_head=False, **overrides)
    state = VisionTransformerForImageClassification(config).state_dict()
    timm_state = hf_vit_to_timm_state_dict(state)
    back = timm_to_hf_vit_state_dict(timm_state, config)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    again = hf_vit_to_timm_state_dict(back)
    assert set(again) == set(timm_state) and all(torch.equal(again[k], timm_state[k]) for k in timm_state)
    inferred = infer_config_from_timm(timm_state, num_attention_heads=4)
    for field in ("hidden_size", "num_hidden_layers", "intermediate_size", "patch_size", "image_size", "classifier"):
        assert getattr(inferred, field) == getattr(config, field)
    assert (inferred.representation_size, inferred.num_labels, inferred.qkv_bias) == (
        config.representation_size,
        config.num_labels,
        config.qkv_bias,
    )


def test_config_inference_and_the_number_of_heads(tmp_path):
    sd = random_timm(width=192, depth=1, mlp=768, patch=16, image=64, classes=0, cls=False)
    config = infer_config_from_timm(sd)
    assert (config.hidden_size, config.num_attention_heads, config.intermediate_size) == (192, 3, 768)
    assert (config.patch_size, config.image_size, config.classifier, config.num_labels) == (16, 64, "gap", 0)
    assert config.layer_norm_eps == 1e-6 and config.representation_size is None
    assert infer_config_from_timm(sd, num_attention_heads=6).num_attention_heads == 6
    assert infer_config_from_timm(sd, timm_config={"model_args": {"num_heads": 2}}).num_attention_heads == 2
    assert infer_config_from_timm(sd, image_size=96).image_size == 96
    odd = random_timm(width=40, depth=1, mlp=80, patch=8, image=16, classes=2)
    with pytest.raises(ConversionError, match="number of heads of a width-40 model"):
        infer_config_from_timm(odd)
    with pytest.raises(ConversionError, match="hidden_size: the checkpoint has 40, preset 'vit-tiny-patch16-224'"):
        infer_config_from_timm(odd, preset="vit-tiny-patch16-224")
    base = {k: v for k, v in random_timm(**SPECS["tiny"]).items()}
    with pytest.raises(ConversionError, match="global_pool='avgmax'"):
        infer_config_from_timm(base, num_attention_heads=4, timm_config={"global_pool": "avgmax"})
    # global_pool='avg' beside a class token averages the patch tokens only, as hf-vit's "gap" does
    avg = infer_config_from_timm(base, num_attention_heads=4, timm_config={"global_pool": "avg"})
    assert (avg.classifier, avg.use_class_token, avg.num_prefix_tokens) == ("gap", True, 1)


def timm_resampled(pos_embed, old_grid, new_grid, prefix=1):
    """The position table as timm's `layers/pos_embed.py` `resample_abs_pos_embed` resamples it with its defaults
    (`interpolation="bicubic", antialias=True`, in float32; what `checkpoint_filter_fn` and `dynamic_img_size` use),
    computed with torch alone."""
    grid = pos_embed[:, prefix:].float().reshape(1, *old_grid, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=new_grid, mode="bicubic", antialias=True)
    patches = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], -1).to(pos_embed.dtype)
    return torch.cat([pos_embed[:, :prefix], patches], dim=1)


def test_position_embeddings_resized_at_load_as_timm_resamples_them(tmp_path):
    sd = random_timm(**SPECS["tiny"])  # 4x4 grid
    save_file(sd, tmp_path / "model.safetensors")
    model = convert_timm_checkpoint(tmp_path / "model.safetensors", tmp_path / "out", image_size=48, preset=None,
                                    num_attention_heads=4)  # fmt: skip
    pos = model.vit.embeddings.position_embedding.detach()
    assert model.config.grid_size == (6, 6) and pos.shape == (1, 37, 32)
    torch.testing.assert_close(pos, timm_resampled(sd["pos_embed"], (4, 4), (6, 6)), atol=1e-7, rtol=0)
    assert not torch.allclose(pos, resample_position_embeddings(sd["pos_embed"], (4, 4), (6, 6)), atol=1e-4)
    # downsampling too, where antialiasing widens the filter
    small = convert_timm_checkpoint(tmp_path / "model.safetensors", tmp_path / "small", image_size=24, preset=None,
                                    num_attention_heads=4)  # fmt: skip
    expected = timm_resampled(sd["pos_embed"], (4, 4), (3, 3))
    torch.testing.assert_close(small.vit.embeddings.position_embedding.detach(), expected, atol=1e-7, rtol=0)


def test_a_timm_vit_at_another_size_resamples_as_timm_does(tmp_path):
    # loaded at another size, or run at one (timm's dynamic_img_size): the positions timm's resampling gives
    sd = random_timm(**SPECS["tiny"])  # 4x4 grid of 8-pixel patches
    folder = tmp_path / "timm-folder"
    folder.mkdir()
    save_file(sd, folder / "model.safetensors")
    timm_cfg = {"architecture": "vit_tiny_patch8", "num_classes": 5, "model_args": {"num_heads": 4}}
    (folder / "config.json").write_text(json.dumps({**timm_cfg, "pretrained_cfg": {"input_size": [3, 32, 32]}}))
    native = VisionTransformerForImageClassification.from_pretrained(folder).eval()
    assert native.config.interpolation_mode == "bicubic" and native.config.interpolation_antialias is True
    at_48 = VisionTransformerForImageClassification.from_pretrained(folder, image_size=48).eval()
    expected = timm_resampled(sd["pos_embed"], (4, 4), (6, 6))
    torch.testing.assert_close(at_48.vit.embeddings.position_embedding.detach(), expected, atol=1e-7, rtol=0)
    reference = transformers_vit({**sd, "pos_embed": expected}, 4, 48, 8)
    x = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_diff(at_48(x).logits, reference(x).logits) < 1e-5
        assert max_diff(native(x, interpolate_pos_encoding=True).logits, reference(x).logits) < 1e-5


def test_unsupported_timm_layouts(tmp_path):
    both_norms = dict(
        random_timm(**SPECS["tiny"]), **{"fc_norm.weight": torch.ones(32), "fc_norm.bias": torch.ones(32)}
    )
    qk_norm = dict(random_timm(**SPECS["tiny"]), **{"blocks.0.attn.q_norm.weight": torch.ones(8)})
    patch_norm = dict(random_timm(**SPECS["tiny"]), **{"patch_embed.norm.weight": torch.ones(32)})
    layer_scale_once = dict(random_timm(**SPECS["tiny"]), **{"blocks.0.ls1.gamma": torch.ones(32)})
    unknown = dict(random_timm(**SPECS["tiny"]), **{"mystery.weight": torch.ones(2)})
    missing = {k: v for k, v in random_timm(**SPECS["tiny"]).items() if k != "blocks.1.mlp.fc2.bias"}
    cases = {
        "both_norms": (both_norms, r"both norm and fc_norm"),
        "qk_norm": (qk_norm, r"QK-norm.*blocks\.0\.attn\.q_norm\.weight"),
        "patch_norm": (patch_norm, r"LayerNorm after the patch embedding"),
        # LayerScale in one block only: the other blocks' scales are named as missing
        "layer_scale_once": (layer_scale_once, r"lacks: \['blocks\.0\.ls2\.gamma', 'blocks\.1\.ls1\.gamma'"),
        "unknown": (unknown, r"no place in hf-vit: \['mystery\.weight'\]"),
        "missing": (missing, r"lacks: \['blocks\.1\.mlp\.fc2\.bias'\]"),
    }
    for name, (sd, pattern) in cases.items():
        save_file(sd, tmp_path / f"{name}.safetensors")
        with pytest.raises(ConversionError, match=pattern) as error:
            convert_timm_checkpoint(tmp_path / f"{name}.safetensors", tmp_path / "out", num_attention_heads=4)
        print(f"{name}: {error.value}")
        assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind


def test_loading_files_and_folders(tmp_path):
    sd = random_timm(**SPECS["patch4"])
    torch.save({"state_dict": sd, "epoch": 3}, tmp_path / "wrapped.pth")
    torch.save({"model": sd}, tmp_path / "model_key.pth")
    for name in ("wrapped.pth", "model_key.pth"):
        loaded = load_timm_state_dict(tmp_path / name)
        assert set(loaded) == set(sd) and all(torch.equal(loaded[k], sd[k]) for k in sd)

    torch.save({"args": argparse.Namespace(lr=0.1)}, tmp_path / "unsafe.pth")  # needs unpickling a Python object
    with pytest.raises(ConversionError, match="weights_only=True"):
        load_timm_state_dict(tmp_path / "unsafe.pth")
    with pytest.raises(ConversionError, match="not a file"):
        load_timm_state_dict(tmp_path / "absent.pth")

    hub = tmp_path / "hub"  # a timm folder as on the Hub: weights and timm's config.json
    hub.mkdir()
    save_file(sd, hub / "model.safetensors")
    timm_config = {
        "architecture": "vit_tiny_test",
        "num_classes": 3,
        "global_pool": "token",
        "model_args": {"num_heads": 2},
        "pretrained_cfg": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]},
        "label_names": ["cat", "dog", "fox"],
    }
    (hub / "config.json").write_text(json.dumps(timm_config))
    model = convert_timm_checkpoint(hub, tmp_path / "out")
    assert model.config.num_attention_heads == 2 and model.config.id2label == {0: "cat", 1: "dog", 2: "fox"}
    saved = json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())
    assert saved["image_mean"] == [0.485, 0.456, 0.406] and saved["image_std"] == [0.229, 0.224, 0.225]
    assert saved["size"] == {"height": 16, "width": 16}
    convert_timm_checkpoint(hub, tmp_path / "given", image_mean=[0.1] * 3, image_std=[0.2] * 3)
    saved = json.loads((tmp_path / "given" / "preprocessor_config.json").read_text())
    assert saved["image_mean"] == [0.1] * 3 and saved["image_std"] == [0.2] * 3


def test_command_line(tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    from hf_vit.commands import convert

    sd = random_timm(width=192, depth=1, mlp=768, patch=16, image=32, classes=4)  # standard Ti width: 3 heads
    save_file(sd, tmp_path / "model.safetensors")
    # the command in this process (test_convert_transformers.py runs the script in its own)
    arguments = ["--source", "timm", "--input", str(tmp_path / "model.safetensors")]
    assert convert.main([*arguments, "--output", str(tmp_path / "out")]) == 0
    model = AutoModelForImageClassification.from_pretrained(tmp_path / "out").eval()
    assert isinstance(model, VisionTransformerForImageClassification) and model.config.num_attention_heads == 3
    assert list(AutoImageProcessor.from_pretrained(tmp_path / "out").image_mean) == [0.5] * 3
    reference = transformers_vit(sd, 3, 32, 16)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert max_diff(model(x).logits, reference(x).logits) < 1e-5


def test_a_grid_of_n_by_n_plus_2_patches_has_its_class_position_when_the_size_is_known(tmp_path):
    # 4x6 patches + the class token = 25 positions, a square count: the size (given, or timm's input_size) says it
    # is a class-token model at 32x48, not a 5x5 grid without a class position.
    sd = random_timm(**SPECS["tiny"])
    sd["pos_embed"] = torch.randn(1, 4 * 6 + 1, 32, generator=torch.Generator().manual_seed(2))
    save_file(sd, tmp_path / "model.safetensors")
    # nothing says the size: the square count alone reads as a 5x5 grid without a class position (no_embed_class)
    guess = convert_timm_checkpoint(tmp_path / "model.safetensors", tmp_path / "guess", num_attention_heads=4)
    assert guess.config.grid_size == (5, 5)
    given = convert_timm_checkpoint(
        tmp_path / "model.safetensors", tmp_path / "given", image_size=[32, 48], num_attention_heads=4
    )
    folder = tmp_path / "hub-folder"
    folder.mkdir()
    save_file(sd, folder / "model.safetensors")
    timm_cfg = {"architecture": "vit_tiny_patch8", "num_classes": 5, "model_args": {"num_heads": 4}}
    (folder / "config.json").write_text(json.dumps({**timm_cfg, "pretrained_cfg": {"input_size": [3, 32, 48]}}))
    read = VisionTransformerForImageClassification.from_pretrained(folder)
    reference = transformers_vit(sd, 4, [32, 48], 8)
    x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(1))
    for model in (given, read):
        assert model.config.image_hw == (32, 48) and model.config.grid_size == (4, 6)
        with torch.no_grad():
            assert max_diff(model(x).logits, reference(x).logits) < 1e-5
