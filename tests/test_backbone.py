"""Dense features: intermediate blocks' outputs, the AutoBackbone inside a transformers segmentation model, and
feature extraction through transformers' pipeline."""

import numpy as np
import pytest
import torch
from conftest import tiny_config
from PIL import Image

from hf_vit import (
    VisionTransformerBackbone,
    VisionTransformerForImageClassification,
    VisionTransformerImageProcessor,
    VisionTransformerModel,
)


def model(**overrides):
    torch.manual_seed(0)
    return VisionTransformerModel(tiny_config(num_hidden_layers=3, **overrides)).eval()


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_intermediates_are_the_blocks_outputs_on_the_patch_grid(classifier):
    vit = model(classifier=classifier)
    x = torch.randn(2, 3, 48, 24)  # non-square, 6x3 patches of 8
    hidden = vit(x, interpolate_pos_encoding=True, output_hidden_states=True).hidden_states
    prefix = vit.config.num_prefix_tokens
    out = vit.forward_intermediates(x, indices=[0, -1], interpolate_pos_encoding=True)
    assert [f.shape for f in out.features] == [(2, 32, 6, 3)] * 2
    for block, features, tokens in zip((1, 3), out.features, out.prefix_tokens):
        expected = hidden[block][:, prefix:].reshape(2, 6, 3, 32).permute(0, 3, 1, 2)
        torch.testing.assert_close(features, expected)
        assert torch.equal(tokens, hidden[block][:, :prefix]) and tokens.shape == (2, prefix, 32)
    normed = vit.forward_intermediates(x, indices=2, norm=True, output_fmt="NLC", interpolate_pos_encoding=True)
    assert [f.shape for f in normed.features] == [(2, 18, 32)] * 2  # the last 2 blocks, as tokens
    torch.testing.assert_close(normed.features[1], vit.norm(hidden[3])[:, prefix:])
    with pytest.raises(ValueError, match="indices must name blocks 0..2"):
        vit.forward_intermediates(x, indices=[3], interpolate_pos_encoding=True)


def test_intermediates_stop_after_the_last_block_asked_for():
    vit = model()
    ran = []
    for index, block in enumerate(vit.layers):
        block.register_forward_hook(lambda *args, index=index: ran.append(index))
    vit.forward_intermediates(torch.randn(1, 3, 32, 32), indices=[0])
    assert ran == [0]


def test_the_backbone_loads_a_classifiers_encoder_and_gives_feature_maps(tmp_path):
    torch.manual_seed(0)
    classifier = VisionTransformerForImageClassification(tiny_config(num_hidden_layers=3)).eval()
    classifier.save_pretrained(tmp_path)
    # (AutoBackbone.from_pretrained in transformers 5.23 asks the Hub whether a local folder is a repo, and fails)
    backbone = VisionTransformerBackbone.from_pretrained(tmp_path, out_indices=[1, 3]).eval()
    assert backbone.channels == [32, 32]
    assert backbone.out_features == ["stage1", "stage3"]
    x = torch.randn(2, 3, 40, 56)  # any patch-divisible size
    maps = backbone(x).feature_maps
    expected = classifier.vit.forward_intermediates(x, indices=[0, 2], norm=True, interpolate_pos_encoding=True)
    for got, want in zip(maps, expected.features):
        assert got.shape == (2, 32, 5, 7)
        torch.testing.assert_close(got, want)


def segmentation_set(count=32, size=32, seed=0):
    """Digits pasted at random places on a dark canvas; the mask is 1 where the digit's strokes are."""
    from hf_vit.data.datasets import load_digits_dataset

    rng = np.random.default_rng(seed)
    digits = load_digits_dataset()["train"]
    images, masks = [], []
    for i in range(count):
        digit = np.asarray(digits[i]["image"].resize((16, 16)), dtype=np.float32) / 255
        top, left = rng.integers(0, size - 16, 2)
        canvas = np.zeros((size, size), np.float32)
        canvas[top : top + 16, left : left + 16] = digit
        images.append(np.repeat(canvas[None], 3, 0))
        masks.append((canvas > 0.3).astype(np.int64))
    return torch.tensor(np.stack(images)), torch.tensor(np.stack(masks))


def test_a_transformers_segmentation_model_trains_on_the_backbone():
    from transformers import UperNetConfig, UperNetForSemanticSegmentation

    backbone_config = tiny_config(num_hidden_layers=4, out_indices=[1, 2, 3, 4])
    config = UperNetConfig(
        backbone_config=backbone_config, hidden_size=32, num_labels=2, use_auxiliary_head=False, pool_scales=[1, 2]
    )
    torch.manual_seed(0)
    segmenter = UperNetForSemanticSegmentation(config)
    assert isinstance(segmenter.backbone, VisionTransformerBackbone)
    images, masks = segmentation_set()
    optimizer = torch.optim.AdamW(segmenter.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        batch = slice(8 * (step % 4), 8 * (step % 4 + 1))
        loss = segmenter(pixel_values=images[batch], labels=masks[batch]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(f"UperNet on hf-vit: loss {np.mean(losses[:4]):.3f} -> {np.mean(losses[-4:]):.3f}")
    assert np.mean(losses[-4:]) < 0.6 * np.mean(losses[:4])


def test_image_feature_extraction_pipeline_on_a_saved_folder(tmp_path):
    from transformers import pipeline

    vit = model()
    vit.save_pretrained(tmp_path)
    VisionTransformerImageProcessor(size=32).save_pretrained(tmp_path)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 30, 3), dtype=np.uint8))
    extractor = pipeline("image-feature-extraction", model=str(tmp_path), trust_remote_code=False)
    pixels = VisionTransformerImageProcessor(size=32)(image, return_tensors="pt").pixel_values
    with torch.no_grad():
        expected = vit(pixels)
    tokens = torch.tensor(extractor(image))
    assert tokens.shape == (1, 17, 32)
    torch.testing.assert_close(tokens, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
    pooled = torch.tensor(extractor(image, pool=True))
    torch.testing.assert_close(pooled, expected.pooler_output, atol=1e-5, rtol=1e-5)
