"""The hybrid (section 3.1): a converted checkpoint in the authors' layout against an independent implementation of
their ResNet stem (numpy weight standardisation and GroupNorm, TF "SAME" padding from its general formula, torch's
functional convolution), and the model's size-dependent features on a hybrid."""

import numpy as np
import pytest
import torch
from conftest import tiny_config
from test_convert_jax import POS, random_npz
from torch.nn import functional as F

from hf_vit import VisionTransformerConfig, VisionTransformerForImageClassification, VisionTransformerModel
from hf_vit.convert import hf_vit_to_npz_arrays, infer_config_from_npz, npz_to_hf_vit_state_dict

WIDTH, LAYERS, IMAGE = 32, (1, 2), 32  # stride 4 * 2 = 8: a 4x4 grid of 1x1 patches of the feature map


def hybrid_npz(layers=LAYERS, width=WIDTH, image=IMAGE, seed=0):
    """Random arrays in the authors' hybrid layout: the stem's names from their Flax module tree, then a ViT."""
    rng = np.random.default_rng(seed)
    stride = 4 * 2 ** max(len(layers) - 1, 0)
    arrays = {}

    def conv(name, k, cin, cout):
        arrays[f"{name}/kernel"] = rng.standard_normal((k, k, cin, cout)).astype(np.float32)

    def gn(name, channels):
        arrays[f"{name}/scale"] = (1 + 0.2 * rng.standard_normal(channels)).astype(np.float32)
        arrays[f"{name}/bias"] = (0.2 * rng.standard_normal(channels)).astype(np.float32)

    conv("conv_root", 7, 3, width)
    gn("gn_root", width)
    channels = width
    for s, depth in enumerate(layers, 1):
        features = width * 2 ** (s - 1)
        for u in range(1, depth + 1):
            unit = f"block{s}/unit{u}"
            conv(f"{unit}/conv1", 1, channels, features)
            gn(f"{unit}/gn1", features)
            conv(f"{unit}/conv2", 3, features, features)
            gn(f"{unit}/gn2", features)
            conv(f"{unit}/conv3", 1, features, 4 * features)
            gn(f"{unit}/gn3", 4 * features)
            if u == 1:
                conv(f"{unit}/conv_proj", 1, channels, 4 * features)
                gn(f"{unit}/gn_proj", 4 * features)
            channels = 4 * features
    grid = image // stride
    vit = random_npz(32, 1, 2, 64, 1, grid, "token", None, 3, channels=channels, seed=seed)
    assert vit[POS].shape[1] == grid * grid + 1
    return {**arrays, **vit}


# --- An independent implementation of the authors' stem, from the .npz arrays ------------------------------------


def same_pads(size, kernel, stride):
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def std_conv(x, kernel, stride):
    w = kernel.astype(np.float64)
    w = (w - w.mean(axis=(0, 1, 2))) / (w.std(axis=(0, 1, 2)) + 1e-5)
    top, bottom = same_pads(x.shape[2], w.shape[0], stride)
    left, right = same_pads(x.shape[3], w.shape[1], stride)
    x = F.pad(x, (left, right, top, bottom))
    return F.conv2d(x, torch.from_numpy(w).permute(3, 2, 0, 1), stride=stride)


def group_norm(x, scale, bias, groups=32, eps=1e-6):
    n, c, h, w = x.shape
    g = x.reshape(n, groups, -1)
    g = (g - g.mean(-1, keepdim=True)) / torch.sqrt(g.var(-1, unbiased=False, keepdim=True) + eps)
    x = g.reshape(n, c, h, w)
    return (
        x * torch.from_numpy(scale.astype(np.float64))[:, None, None]
        + torch.from_numpy(bias.astype(np.float64))[:, None, None]
    )


def reference_stem(arrays, x):
    a = arrays
    x = std_conv(x, a["conv_root/kernel"], 2)
    x = torch.relu(group_norm(x, a["gn_root/scale"], a["gn_root/bias"]))
    top, bottom = same_pads(x.shape[2], 3, 2)
    left, right = same_pads(x.shape[3], 3, 2)
    x = F.max_pool2d(F.pad(x, (left, right, top, bottom), value=-np.inf), 3, 2)
    s = 1
    while f"block{s}/unit1/conv1/kernel" in a:
        u = 1
        while f"block{s}/unit{u}/conv1/kernel" in a:
            p = f"block{s}/unit{u}/"
            stride = 2 if (s > 1 and u == 1) else 1
            y = torch.relu(group_norm(std_conv(x, a[p + "conv1/kernel"], 1), a[p + "gn1/scale"], a[p + "gn1/bias"]))
            y = torch.relu(
                group_norm(std_conv(y, a[p + "conv2/kernel"], stride), a[p + "gn2/scale"], a[p + "gn2/bias"])
            )
            y = group_norm(std_conv(y, a[p + "conv3/kernel"], 1), a[p + "gn3/scale"], a[p + "gn3/bias"])
            if p + "conv_proj/kernel" in a:
                x = group_norm(
                    std_conv(x, a[p + "conv_proj/kernel"], stride), a[p + "gn_proj/scale"], a[p + "gn_proj/bias"]
                )
            x = torch.relu(x + y)
            u += 1
        s += 1
    return x


def reference_tokens(arrays, x):
    """Equation (1) of the hybrid: 1x1 patches of the stem's map embedded, class token, positions."""
    features = reference_stem(arrays, x)
    kernel = torch.from_numpy(arrays["embedding/kernel"].astype(np.float64)).permute(3, 2, 0, 1)
    patches = F.conv2d(features, kernel, torch.from_numpy(arrays["embedding/bias"].astype(np.float64)), stride=1)
    tokens = patches.flatten(2).transpose(1, 2)
    cls = torch.from_numpy(arrays["cls"].astype(np.float64)).expand(x.shape[0], -1, -1)
    return torch.cat([cls, tokens], 1) + torch.from_numpy(arrays[POS].astype(np.float64))


def converted(arrays):
    config = infer_config_from_npz(arrays)
    model = VisionTransformerForImageClassification(config).eval()
    model.load_state_dict(npz_to_hf_vit_state_dict(arrays, config), strict=True)
    return model


@pytest.mark.parametrize("layers", [LAYERS, (2, 1, 1), ()], ids=["r-1-2", "r-2-1-1", "root-only"])
def test_converted_hybrid_matches_an_independent_stem(layers):
    image = 64 if len(layers) == 3 else IMAGE
    arrays = hybrid_npz(layers, image=image)
    model = converted(arrays)
    stride = 4 * 2 ** max(len(layers) - 1, 0)
    assert model.config.resnet_layers == list(layers) and model.config.stem_stride == stride
    assert model.config.patch_size == stride and model.config.image_size == image  # patch in input pixels
    x = torch.randn(2, 3, image, image, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected_stem, expected_tokens = reference_stem(arrays, x), reference_tokens(arrays, x)
    with torch.no_grad():
        # In float64 the two implementations agree to rounding: any difference in the stem's definition shows.
        double = converted(arrays).double()
        stem = double.vit.embeddings.stem(x)
        tokens = double(x, output_hidden_states=True).hidden_states[0]
        # In float32, as the model runs, rounding grows through the stages: 1e-5 relative.
        single = model(x.float(), output_hidden_states=True).hidden_states[0]
    assert stem.shape == expected_stem.shape == (2, model.config.stem_channels, image // stride, image // stride)
    torch.testing.assert_close(stem, expected_stem, atol=1e-5, rtol=0)
    torch.testing.assert_close(tokens, expected_tokens, atol=1e-5, rtol=0)
    torch.testing.assert_close(single.double(), expected_tokens, atol=1e-5, rtol=1e-5)


def test_hybrid_round_trip_and_layout_names():
    arrays = hybrid_npz()
    config = infer_config_from_npz(arrays)
    state = npz_to_hf_vit_state_dict(arrays, config)
    assert "vit.embeddings.stem.block2.unit1.conv_proj.weight" in state
    back = hf_vit_to_npz_arrays(state, config)
    assert set(back) == set(arrays) and all(np.array_equal(back[k], arrays[k]) for k in arrays)


def test_presets_and_grid_semantics():
    r50 = VisionTransformerConfig.from_preset("r50-vit-base-patch16-224")
    assert r50.resnet_layers == [3, 4, 9] and r50.stem_stride == 16 and r50.embedding_patch_size == 1
    assert r50.grid_size == (14, 14) and r50.stem_channels == 1024
    large = VisionTransformerConfig.from_preset("r50-vit-large-patch16-384")
    assert large.hidden_size == 1024 and large.grid_size == (24, 24)
    r26 = VisionTransformerConfig.from_preset("r26-vit-small-patch32-224")
    assert r26.resnet_layers == [2, 2, 2, 2] and r26.hidden_size == 384 and r26.stem_channels == 2048
    assert r26.grid_size == (7, 7)
    with pytest.raises(ValueError, match="Unknown preset"):
        VisionTransformerConfig.from_preset("r26-vit-small-patch16-224")
    with pytest.raises(ValueError, match="multiple of the ResNet stem's stride"):
        tiny_config(resnet_layers=[1, 1], resnet_width=32, patch_size=4)
    with pytest.raises(ValueError, match="resnet_width"):
        tiny_config(resnet_layers=[1], resnet_width=48)


def hybrid_config(**overrides):
    return tiny_config(resnet_layers=[1, 1], resnet_width=32, patch_size=8, **overrides)


def test_hybrid_resolution_features_and_training(tmp_path):
    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(hybrid_config()).eval()
    x = torch.randn(2, 3, 32, 32)
    # Another size: positions resampled to the grid the stem gives.
    wide = torch.randn(2, 3, 48, 64)
    assert model(wide, interpolate_pos_encoding=True).logits.shape == (2, 5)
    intermediates = model.vit.forward_intermediates(wide, indices=[0, 1], interpolate_pos_encoding=True)
    assert [f.shape for f in intermediates.features] == [(2, 32, 6, 8)] * 2
    with pytest.raises(ValueError, match="not divisible by the patch size 8"):
        model(torch.randn(1, 3, 36, 36), interpolate_pos_encoding=True)
    expected = model(wide, interpolate_pos_encoding=True).logits
    model.set_input_size((48, 64))
    torch.testing.assert_close(model(wide).logits, expected)
    model.set_input_size(32)
    # Saved with its code (hybrid.py beside the model file) and reloaded exactly.
    model.save_pretrained(tmp_path)
    assert (tmp_path / "hybrid.py").is_file()
    reloaded = VisionTransformerForImageClassification.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(reloaded(x).logits, model(x).logits)
    encoder = VisionTransformerModel.from_pretrained(tmp_path)
    assert encoder.embeddings.stem is not None
    # One training step reaches the stem; its last GroupNorm of each unit starts at zero scale (the authors' init).
    fresh = VisionTransformerForImageClassification(hybrid_config(zero_init_head=False)).train()
    assert torch.count_nonzero(fresh.vit.embeddings.stem.block1.unit1.gn3.weight) == 0
    loss = fresh(x, labels=torch.tensor([0, 3])).loss
    loss.backward()
    assert fresh.vit.embeddings.stem.conv_root.weight.grad.abs().sum() > 0
