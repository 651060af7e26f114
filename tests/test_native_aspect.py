"""Native-aspect batches: the processor's patches (max_num_patches); the model on them equals each image alone."""

import importlib
import io
import logging

import numpy as np
import pytest
import torch
from conftest import tiny_config
from PIL import Image
from torch.nn import functional as F

from hf_vit import (
    VisionTransformerBackbone,
    VisionTransformerForImageClassification,
    VisionTransformerForMaskedPatchPrediction,
    VisionTransformerImageProcessor,
    VisionTransformerModel,
)
from hf_vit.model.image_processing_vit import grid_for_max_patches
from hf_vit.model.modeling_mpp import PATCH_CLEAN, PATCH_MASKED, PatchCorruption, draw_patch_corruption

# (height, width) of images of several aspect ratios: square, wide, tall, extreme both ways, tiny
SIZES = [(40, 40), (20, 80), (90, 30), (7, 200), (300, 5), (2, 5), (64, 48)]


def images(sizes=SIZES, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for height, width in sizes]


def siglip2_grid(height, width, patch, max_patches):
    """transformers' SigLIP 2 choice of size (its numpy processor, which needs no torchvision), as a patch grid."""
    module = importlib.import_module("transformers.models.siglip2.image_processing_pil_siglip2")
    size = module.get_image_size_for_max_num_patches(height, width, patch, max_patches)
    return size[0] // patch, size[1] // patch


@pytest.mark.parametrize("max_patches", [1, 5, 12, 16, 64])
def test_grid_is_the_largest_that_keeps_the_aspect_ratio(max_patches):
    for height, width in SIZES + [(1000, 999), (17, 3000)]:
        grid = grid_for_max_patches(height, width, 8, max_patches)
        assert grid == siglip2_grid(height, width, 8, max_patches), (height, width)
        assert grid[0] * grid[1] <= max_patches and min(grid) >= 1


def test_processor_returns_patches_mask_and_grids():
    patch, max_patches = 8, 16
    processor = VisionTransformerImageProcessor(max_num_patches=max_patches, patch_size=patch, resample="bicubic")
    out = processor(images(), return_tensors="pt")
    assert set(out) == {"pixel_values", "pixel_attention_mask", "spatial_shapes"}
    assert out["pixel_values"].shape == (len(SIZES), max_patches, patch * patch * 3)
    assert out["pixel_values"].dtype == torch.float32
    assert out["pixel_attention_mask"].shape == (len(SIZES), max_patches)
    assert out["spatial_shapes"].tolist() == [list(grid_for_max_patches(h, w, patch, max_patches)) for h, w in SIZES]
    for row, (rows, cols) in enumerate(out["spatial_shapes"].tolist()):
        count = rows * cols
        assert out["pixel_attention_mask"][row].tolist() == [1] * count + [0] * (max_patches - count)
        assert torch.all(out["pixel_values"][row, count:] == 0)
    # numpy and lists as for whole images
    as_numpy = processor(images(), return_tensors="np")
    assert isinstance(as_numpy["pixel_values"], np.ndarray)
    np.testing.assert_array_equal(as_numpy["spatial_shapes"], out["spatial_shapes"].numpy())
    as_lists = processor(images())
    assert len(as_lists["pixel_values"]) == len(SIZES) and as_lists["pixel_values"][0].shape == (16, 192)


def test_patches_are_the_resized_image_unfolded_in_row_column_channel_order():
    patch, max_patches = 8, 12
    processor = VisionTransformerImageProcessor(max_num_patches=max_patches, patch_size=patch)
    image = images([(30, 70)])[0]
    native = processor(image, return_tensors="pt")
    rows, cols = native["spatial_shapes"][0].tolist()
    assert (rows, cols) == (2, 5)
    # The ordinary path at the chosen size, cut with torch's unfold: (1, C * P * P, L) in (channel, row, column)
    whole = VisionTransformerImageProcessor(size=(rows * patch, cols * patch))(image, return_tensors="pt")
    unfolded = F.unfold(whole["pixel_values"], kernel_size=patch, stride=patch)[0]
    expected = unfolded.reshape(3, patch, patch, rows * cols).permute(3, 1, 2, 0).reshape(rows * cols, -1)
    assert torch.equal(native["pixel_values"][0, : rows * cols], expected)


def test_without_max_num_patches_the_output_is_unchanged(tmp_path):
    batch = images([(40, 40), (20, 80)])
    default = VisionTransformerImageProcessor()(batch, return_tensors="pt")
    with_patch = VisionTransformerImageProcessor(patch_size=8)(batch, return_tensors="pt")
    assert set(with_patch) == {"pixel_values"} and with_patch["pixel_values"].shape == (2, 3, 224, 224)
    assert torch.equal(default["pixel_values"], with_patch["pixel_values"])
    # the field is saved, reloaded, and a call may override it
    VisionTransformerImageProcessor(max_num_patches=9, patch_size=8).save_pretrained(tmp_path)
    reloaded = VisionTransformerImageProcessor.from_pretrained(tmp_path)
    assert (reloaded.max_num_patches, reloaded.patch_size) == (9, 8)
    assert reloaded(batch, return_tensors="pt")["pixel_values"].shape == (2, 9, 192)
    assert reloaded(batch, max_num_patches=4, return_tensors="pt")["pixel_values"].shape == (2, 4, 192)


def test_processor_refuses_options_that_contradict_native_patches():
    with pytest.raises(ValueError, match="do_center_crop=False"):
        VisionTransformerImageProcessor(max_num_patches=16, do_center_crop=True)
    with pytest.raises(ValueError, match="max_num_patches"):
        VisionTransformerImageProcessor(max_num_patches=0)
    processor = VisionTransformerImageProcessor(max_num_patches=4, patch_size=8, do_resize=False)
    assert processor(images([(16, 16)]), return_tensors="pt")["spatial_shapes"].tolist() == [[2, 2]]
    with pytest.raises(ValueError, match="leave do_resize on"):
        processor(images([(16, 17)]), return_tensors="pt")


def native_and_alone(model, max_patches, sizes=((40, 40), (20, 80), (90, 30), (7, 200)), **call):
    """The model on a native-aspect batch, and on each image alone at its own size through the ordinary path."""
    processor = VisionTransformerImageProcessor(max_num_patches=max_patches, patch_size=model.config.patch_size)
    batch = images(sizes)
    inputs = processor(batch, return_tensors="pt")
    with torch.no_grad():
        native = model(**inputs, **call)
        alone = []
        for image, (rows, cols) in zip(batch, inputs["spatial_shapes"].tolist()):
            size = (rows * model.config.patch_size, cols * model.config.patch_size)
            pixels = VisionTransformerImageProcessor(size=size)(image, return_tensors="pt")["pixel_values"]
            alone.append(model(pixels, interpolate_pos_encoding=True, **call))
    return inputs, native, alone


@pytest.mark.parametrize("classifier", ["token", "gap", "map"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_each_row_equals_the_image_alone_at_its_own_size(classifier, implementation):
    torch.manual_seed(0)
    config = tiny_config(classifier=classifier, attn_implementation=implementation)
    model = VisionTransformerForImageClassification(config).eval()
    with torch.no_grad():  # a non-zero head, so the logits say something
        model.classifier.weight.normal_()
    inputs, native, alone = native_and_alone(model.vit, 12)
    prefix = config.num_prefix_tokens
    for row, one in enumerate(alone):
        count = int(inputs["pixel_attention_mask"][row].sum())
        valid = native.last_hidden_state[row, : prefix + count]
        torch.testing.assert_close(valid, one.last_hidden_state[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(native.pooler_output[row], one.pooler_output[0], atol=1e-4, rtol=0)
    inputs, logits, alone_logits = native_and_alone(model, 12)
    torch.testing.assert_close(logits.logits, torch.cat([one.logits for one in alone_logits]), atol=1e-4, rtol=0)
    assert logits.logits.std() > 0.1
    # more padding, holding anything, changes no logit
    noise = torch.randn(4, 9, inputs["pixel_values"].shape[-1]) * 100
    with torch.no_grad():
        padded = model(
            pixel_values=torch.cat([inputs["pixel_values"], noise], dim=1),
            pixel_attention_mask=F.pad(inputs["pixel_attention_mask"], (0, 9)),
            spatial_shapes=inputs["spatial_shapes"],
        )
    torch.testing.assert_close(padded.logits, logits.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "family",
    [
        dict(use_distillation_token=True, num_register_tokens=2, layer_scale_init_value=0.1, pre_norm=True),
        dict(classifier="gap", num_register_tokens=3, fc_norm=True, interpolation_mode="bilinear"),
    ],
)
def test_the_family_blocks_on_native_batches(family):
    # distillation and register tokens, LayerScale, pre-norm, fc_norm, GAP beside registers, another resampling mode:
    # each row still equals the image alone at its own size
    torch.manual_seed(0)
    config = tiny_config(attn_implementation="sdpa", **family)
    model = VisionTransformerModel(config).eval()
    inputs, native, alone = native_and_alone(model, 12)
    prefix = config.num_prefix_tokens
    for row, one in enumerate(alone):
        count = int(inputs["pixel_attention_mask"][row].sum())
        torch.testing.assert_close(
            native.last_hidden_state[row, : prefix + count], one.last_hidden_state[0], atol=1e-4, rtol=0
        )
        torch.testing.assert_close(native.pooler_output[row], one.pooler_output[0], atol=1e-4, rtol=0)


def test_attentions_of_a_native_batch_never_look_at_padding():
    torch.manual_seed(0)
    model = VisionTransformerModel(tiny_config(attn_implementation="sdpa")).eval()
    inputs, native, alone = native_and_alone(model, 12, output_attentions=True)
    heads, tokens = model.config.num_attention_heads, 1 + 12
    assert len(native.attentions) == model.config.num_hidden_layers
    for layer, probs in enumerate(native.attentions):
        assert probs.shape == (4, heads, tokens, tokens)
        keys = torch.cat([torch.ones(4, 1), inputs["pixel_attention_mask"].float()], dim=1)
        assert torch.all(probs * (1 - keys)[:, None, None, :] == 0)
        for row, one in enumerate(alone):
            count = 1 + int(inputs["pixel_attention_mask"][row].sum())
            torch.testing.assert_close(probs[row, :, :count, :count], one.attentions[layer][0], atol=1e-5, rtol=0)


def test_backbone_maps_each_image_at_the_top_left_of_the_largest_grid():
    torch.manual_seed(0)
    backbone = VisionTransformerBackbone(tiny_config(out_indices=[1, 2])).eval()
    inputs, native, alone = native_and_alone(backbone, 12)
    grids = inputs["spatial_shapes"].tolist()
    rows, cols = max(grid[0] for grid in grids), max(grid[1] for grid in grids)
    for stage, maps in enumerate(native.feature_maps):
        assert maps.shape == (4, 32, rows, cols)
        for row, ((height, width), one) in enumerate(zip(grids, alone)):
            torch.testing.assert_close(maps[row, :, :height, :width], one.feature_maps[stage][0], atol=1e-4, rtol=0)
            assert maps[row, :, height:].abs().sum() == 0 and maps[row, :, :, width:].abs().sum() == 0


def test_masked_patch_prediction_on_a_native_batch():
    torch.manual_seed(0)
    config = tiny_config()
    model = VisionTransformerForMaskedPatchPrediction(config).eval()
    processor = VisionTransformerImageProcessor(max_num_patches=12, patch_size=8)
    batch = images([(40, 40), (20, 80)])
    inputs = processor(batch, return_tensors="pt")
    # the corruption drawn for a native batch: a share of each image's own patches, padding clean
    shares = PatchCorruption(corrupt_ratio=0.3)
    draws = draw_patch_corruption(2, 12, shares, patch_mask=inputs["pixel_attention_mask"])
    counts = inputs["pixel_attention_mask"].sum(1)
    assert ((draws != PATCH_CLEAN).sum(1) == (0.3 * counts + 0.5).long()).all()
    assert torch.all(draws[inputs["pixel_attention_mask"] == 0] == PATCH_CLEAN)
    # with the same [mask] corruption, each row's valid logits equal the image alone
    codes = torch.zeros(2, 12, dtype=torch.long)
    codes[:, 1] = PATCH_MASKED
    labels = torch.randint(0, config.mpp_num_classes, (2, 12))
    with torch.no_grad():
        native = model(**inputs, patch_corruption=codes, labels=labels)
        for row, (rows, cols) in enumerate(inputs["spatial_shapes"].tolist()):
            pixels = VisionTransformerImageProcessor(size=(rows * 8, cols * 8))(batch[row], return_tensors="pt")
            one = model(
                pixels["pixel_values"],
                patch_corruption=codes[row : row + 1, : rows * cols],
                interpolate_pos_encoding=True,
            )
            torch.testing.assert_close(native.logits[row, : rows * cols], one.logits[0], atol=1e-4, rtol=0)
    expected = F.cross_entropy(native.logits[:, 1], labels[:, 1])
    torch.testing.assert_close(native.loss, expected)
    # training draws its own corruption, and the loss backpropagates
    model.train()
    out = model(**inputs, labels=labels)
    out.loss.backward()
    assert torch.all(out.patch_corruption[inputs["pixel_attention_mask"] == 0] == PATCH_CLEAN)
    assert model.vit.embeddings.position_embedding.grad.abs().sum() > 0


def test_native_batches_that_cannot_be_embedded_are_refused():
    torch.manual_seed(0)
    model = VisionTransformerModel(tiny_config()).eval()
    inputs = VisionTransformerImageProcessor(max_num_patches=12, patch_size=8)(images([(40, 40)]), return_tensors="pt")
    with pytest.raises(ValueError, match="patch_size=8"):
        model(
            **VisionTransformerImageProcessor(max_num_patches=12, patch_size=4)(images([(8, 8)]), return_tensors="pt")
        )
    wrong = inputs["pixel_attention_mask"].clone()
    wrong[0, -1] = 1
    # values are checked on the device (no synchronisation): a RuntimeError naming what is wrong
    with pytest.raises(RuntimeError, match="pixel_attention_mask"):
        model(inputs["pixel_values"], pixel_attention_mask=wrong, spatial_shapes=inputs["spatial_shapes"])
    with pytest.raises(RuntimeError, match="at most 12 patches"):
        model(inputs["pixel_values"], spatial_shapes=torch.tensor([[4, 4]]))
    with pytest.raises(ValueError, match="pixel_attention_mask"):  # shapes before anything runs
        model(inputs["pixel_values"], pixel_attention_mask=wrong[:, :5], spatial_shapes=inputs["spatial_shapes"])
    hybrid = VisionTransformerModel(tiny_config(resnet_layers=[], resnet_width=32, patch_size=8)).eval()
    with pytest.raises(ValueError, match="hybrid"):
        hybrid(**inputs)
    # the mask may be left out: the grids say it
    with torch.no_grad():
        left_out = model(inputs["pixel_values"], spatial_shapes=inputs["spatial_shapes"]).pooler_output
        torch.testing.assert_close(left_out, model(**inputs).pooler_output, atol=0, rtol=0)


def test_a_native_batch_without_spatial_shapes_is_told_to_pass_them():
    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(tiny_config()).eval()
    inputs = VisionTransformerImageProcessor(max_num_patches=12, patch_size=8)(images(SIZES[:2]), return_tensors="pt")
    for call in (
        lambda: model(inputs["pixel_values"]),
        lambda: model(inputs["pixel_values"], pixel_attention_mask=inputs["pixel_attention_mask"]),
        lambda: model.vit.forward_intermediates(inputs["pixel_values"]),
        lambda: VisionTransformerForMaskedPatchPrediction(tiny_config()).train()(inputs["pixel_values"]),
    ):
        with pytest.raises(ValueError, match="without `spatial_shapes`") as info:
            call()
        assert "batch dimension" not in str(info.value)
    with pytest.raises(ValueError, match="Add a batch dimension"):  # one image is still told what it lacks
        model(torch.randn(3, 32, 32))


@pytest.mark.parametrize("family", [{}, {"num_register_tokens": 2, "classifier": "gap"}])
def test_forward_intermediates_of_a_native_batch(family):
    torch.manual_seed(0)
    model = VisionTransformerModel(tiny_config(**family)).eval()
    inputs, native, alone = native_and_alone(model, 12)
    prefix = model.config.num_prefix_tokens
    with torch.no_grad():
        tokens = model.forward_intermediates(**inputs, indices=[0, -1], norm=True, output_fmt="NLC")
        maps = model.forward_intermediates(**inputs, indices=1, norm=True)
    # the last block's features, normed, are forward's tokens (padding included), and its prefix tokens forward's
    assert torch.equal(tokens.features[-1], native.last_hidden_state[:, prefix:])
    assert torch.equal(tokens.prefix_tokens[-1], native.last_hidden_state[:, :prefix])
    grids = inputs["spatial_shapes"].tolist()
    rows, cols = max(grid[0] for grid in grids), max(grid[1] for grid in grids)
    assert maps.features[0].shape == (4, 32, rows, cols)
    for row, ((height, width), one) in enumerate(zip(grids, alone)):
        expected = one.last_hidden_state[0, prefix:].reshape(height, width, -1).permute(2, 0, 1)
        torch.testing.assert_close(maps.features[0][row, :, :height, :width], expected, atol=1e-4, rtol=0)
        assert (
            maps.features[0][row, :, height:].abs().sum() == 0 and maps.features[0][row, :, :, width:].abs().sum() == 0
        )


def test_flex_attention_masks_the_padding_as_sdpa_does():
    torch.manual_seed(0)
    model = VisionTransformerModel(tiny_config(attn_implementation="sdpa")).eval()
    inputs = VisionTransformerImageProcessor(max_num_patches=12, patch_size=8)(
        images([(40, 40), (90, 30)]), return_tensors="pt"
    )
    with torch.no_grad():
        sdpa = model(**inputs).last_hidden_state
        model.set_attn_implementation("flex_attention")
        flex = model(**inputs).last_hidden_state
    valid = torch.cat([torch.ones(2, 1), inputs["pixel_attention_mask"]], dim=1).bool()
    assert not bool(valid.all())
    torch.testing.assert_close(flex[valid], sdpa[valid], atol=1e-5, rtol=0)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_native_batches_run_in_half_precision_and_under_autocast(implementation):
    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(tiny_config(attn_implementation=implementation)).eval()
    with torch.no_grad():
        model.classifier.weight.normal_()
    inputs = VisionTransformerImageProcessor(max_num_patches=12, patch_size=8)(
        images([(40, 40), (90, 30)]), return_tensors="pt"
    )
    with torch.no_grad():
        reference = model(**inputs).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(**inputs).logits
        half = model.to(torch.bfloat16)(**inputs).logits
    for logits in (autocast, half):
        assert logits.dtype == torch.bfloat16
        torch.testing.assert_close(logits.float(), reference, atol=0.1 * reference.abs().max().item(), rtol=0)


def test_training_transform_crops_at_their_own_aspect_ratio_and_the_collator_pads():
    from hf_vit.data.augment.train_transform import make_train_transform
    from hf_vit.data.transforms import collate_fn, make_eval_transform

    processor = VisionTransformerImageProcessor(max_num_patches=12, patch_size=8)
    batch = {"image": images([(40, 40), (20, 80), (90, 30)]), "label": [0, 1, 2]}
    # without augmentation the training transform is the processor
    plain = make_train_transform(processor, random_resized_crop=False, hflip=False)(batch)
    expected = processor(batch["image"], return_tensors="pt")
    for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes"):
        assert torch.equal(plain[key], expected[key]), key
    assert plain["labels"].tolist() == [0, 1, 2]
    evaluated = make_eval_transform(processor)(batch)
    assert torch.equal(evaluated["pixel_values"], expected["pixel_values"]) and "spatial_shapes" in evaluated
    # crops: each on the largest grid of at most 12 patches at the crop's own aspect ratio
    crops = make_train_transform(processor, scale=(0.2, 0.5), ratio=(0.3, 3.0), seed=0)(batch)
    assert crops["pixel_values"].shape == (3, 12, 192)
    grids = crops["spatial_shapes"].tolist()
    assert all(rows * cols <= 12 for rows, cols in grids) and len({tuple(grid) for grid in grids}) > 1
    assert torch.equal(crops["pixel_attention_mask"].sum(1), crops["spatial_shapes"].prod(1).int())
    # the collator pads examples of different lengths to the longest, with the mask to match
    examples = [
        {"pixel_values": crops["pixel_values"][i, : rows * cols], "spatial_shapes": crops["spatial_shapes"][i],
         "labels": crops["labels"][i]}
        for i, (rows, cols) in enumerate(grids)
    ]  # fmt: skip
    collated = collate_fn(examples)
    longest = max(rows * cols for rows, cols in grids)
    assert collated["pixel_values"].shape == (3, longest, 192) and collated["labels"].tolist() == [0, 1, 2]
    for row, (rows, cols) in enumerate(grids):
        count = rows * cols
        assert torch.equal(collated["pixel_values"][row, :count], crops["pixel_values"][row, :count])
        assert collated["pixel_attention_mask"][row].tolist() == [1] * count + [0] * (longest - count)
    assert torch.equal(collate_fn([dict(zip(crops, values)) for values in zip(*crops.values())])["pixel_values"],
                       crops["pixel_values"])  # fmt: skip
    # encoded JPEGs take the transform's fast road (the crop decoded at a reduced scale): the same grids
    encoded = []
    for array in images([(400, 160), (160, 400)]):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, "JPEG")
        encoded.append(buffer.getvalue())
    jpegs = make_train_transform(processor, scale=(0.9, 1.0), ratio=(1.0, 1.0), seed=0)({"image": encoded})
    assert jpegs["spatial_shapes"].tolist() == [[3, 3], [3, 3]]  # square crops: the largest square grid of 12
    assert jpegs["pixel_values"].shape == (2, 12, 192) and jpegs["pixel_attention_mask"].sum().item() == 18


def test_fine_tuning_with_max_num_patches(tmp_path):
    from hf_vit.train.arguments import parse_args
    from hf_vit.train.training import train

    config = tiny_config(image_size=8, patch_size=4, num_labels=10, zero_init_head=False)
    torch.manual_seed(0)
    VisionTransformerForImageClassification(config).save_pretrained(tmp_path / "pre")
    flags = ["--output_dir", str(tmp_path / "fine"), "--model_name_or_path", str(tmp_path / "pre")]
    flags += ["--max_num_patches", "6", "--max_steps", "4", "--max_train_samples", "64", "--learning_rate", "0.05"]
    flags += ["--per_device_train_batch_size", "16", "--eval_strategy", "no", "--save_strategy", "no"]
    flags += ["--per_device_eval_batch_size", "120", "--check_eval_images", "False"]
    flags += ["--disable_tqdm", "True", "--report_to", "none", "--dataloader_num_workers", "0"]
    metrics = train("finetune", *parse_args("finetune", flags))
    # trained (the new head started at zero) and evaluated on the test split's native-aspect batches
    assert 0 <= metrics["eval_accuracy"] <= 1 and np.isfinite(metrics["eval_loss"])
    model = VisionTransformerForImageClassification.from_pretrained(tmp_path / "fine").eval()
    assert model.classifier.weight.abs().sum() > 0
    saved = VisionTransformerImageProcessor.from_pretrained(tmp_path / "fine")
    assert (saved.max_num_patches, saved.patch_size) == (6, 4)
    inputs = saved(images([(16, 8), (8, 24)]), return_tensors="pt")
    assert inputs["spatial_shapes"].tolist() == [[3, 2], [1, 3]]  # the largest grids of at most 6 patches
    with torch.no_grad():
        assert model(**inputs).logits.shape == (2, 10)
    # the compute dial, measured at the end of the run: accuracy at each number of patches up to the 2x2 grid the
    # 8x8 digits have at patch 4, and at the 6 trained; each row as an evaluation here measures it; linked in the card
    import json

    from conftest import measure_model

    from hf_vit.data.datasets import DataSource

    rows = json.loads((tmp_path / "fine" / "compute_dial.json").read_text())
    assert [(row["series"], row["max_num_patches"]) for row in rows] == [("tokens", 1), ("tokens", 4), ("tokens", 6)]
    for row in rows:
        processor = VisionTransformerImageProcessor.from_pretrained(
            tmp_path / "fine", max_num_patches=row["max_num_patches"]
        )
        split, measured = measure_model(model, processor, DataSource(), None, 512)
        assert row["split"] == split == "test" and row["accuracy"] == pytest.approx(measured["accuracy"])
    assert [row["tokens_per_image"] for row in rows] == [1, 4, 4]  # square digits: at most 6 patches is a 2x2 grid
    with Image.open(tmp_path / "fine" / "compute_dial.png") as image:
        assert image.size[0] > 300
    assert "![compute dial](compute_dial.png)" in (tmp_path / "fine" / "README.md").read_text()
    with pytest.raises(ValueError, match="max_num_patches"):
        train("pretrain", *parse_args("pretrain", ["--output_dir", str(tmp_path / "mpp"), "--objective", "mpp",
                                                    "--max_num_patches", "6", "--max_steps", "1"]))  # fmt: skip


@pytest.mark.parametrize("mode", ["bicubic", "bilinear"])
@pytest.mark.parametrize("antialias", [False, True])
def test_exported_position_embeddings_equal_the_resampling_per_grid(mode, antialias, monkeypatch):
    # what the model and an exported graph compute from the grids as data (the interpolation's taps): the same
    # embeddings as F.interpolate to each grid, and zero on the padding
    from hf_vit.model.resolution import position_embeddings_at, resample_position_embeddings

    torch.manual_seed(0)
    config = tiny_config(interpolation_mode=mode, interpolation_antialias=antialias, use_distillation_token=True)
    table = VisionTransformerModel(config).embeddings.position_embedding.detach()  # a 4x4 grid, two prefix tokens
    shapes = torch.tensor([[4, 4], [1, 12], [3, 5], [7, 2], [2, 1], [9, 1], [1, 1]])  # same, up, down, both, padded
    prefix = config.num_position_prefix_tokens
    args = (table, config.grid_size, shapes[:, None], torch.arange(16)[None], prefix, mode, antialias)
    per_image = position_embeddings_at(*args)
    for row, (rows, cols) in enumerate(shapes.tolist()):
        alone = resample_position_embeddings(table, config.grid_size, (rows, cols), prefix, mode, antialias)
        torch.testing.assert_close(per_image[row, : rows * cols], alone[0, prefix:], atol=1e-6, rtol=0)
        assert (per_image[row, rows * cols :] == 0).all()
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    exported = position_embeddings_at(*args)
    torch.testing.assert_close(exported, per_image, atol=1e-6, rtol=0)


def test_a_compiled_model_takes_native_batches_of_other_grids_without_recompiling():
    # compiled, the grids are data: batches of other grids (and other images) of one K reuse the graphs; the checks
    # that read the grids run outside the graphs, without Dynamo's graph-break warning
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = VisionTransformerModel(tiny_config()).eval()
    processor = VisionTransformerImageProcessor(max_num_patches=12, patch_size=model.config.patch_size)
    # three batches of other grids, each with a fifth of its slots padding (one attention path on CPU)
    batches = [((33, 70), (80, 80), (12, 30), (45, 90)), ((40, 40), (30, 30), (50, 50), (20, 80)),
               ((64, 64), (33, 70), (80, 80), (45, 90))]  # fmt: skip
    records = []

    class Record(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Record(logging.WARNING)
    logging.getLogger("torch._dynamo").addHandler(handler)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    graphs = []
    for sizes in batches:
        inputs = processor(images(sizes), return_tensors="pt")
        with torch.no_grad():
            torch.testing.assert_close(
                compiled(**inputs).pooler_output, model(**inputs).pooler_output, atol=1e-5, rtol=0
            )
        graphs.append(counters["stats"]["unique_graphs"])
    assert len({tuple(map(tuple, processor(images(s), return_tensors="pt")["spatial_shapes"].tolist()))
                for s in batches}) == 3  # fmt: skip
    assert graphs[2] == graphs[1], graphs  # the third batch of new grids compiled nothing new
    logging.getLogger("torch._dynamo").removeHandler(handler)
    assert not [message for message in records if "Graph break" in message]


def test_the_grids_as_data_resample_in_float32_under_autocast():
    # bf16 autocast would round the taps' weighted sums to bf16: the table is computed in float32 as per grid
    from hf_vit.model.resolution import position_embeddings_at

    table = torch.randn(1, 17, 8)
    args = (table, (4, 4), torch.tensor([[[3, 5]], [[2, 2]]]), torch.arange(16)[None], 1, "bicubic", False)
    exact = position_embeddings_at(*args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = position_embeddings_at(*args)
    assert under_autocast.dtype == torch.float32
    torch.testing.assert_close(under_autocast, exact, atol=1e-6, rtol=0)
