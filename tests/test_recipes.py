"""The recipes' parts, each against a property computed here: layer-wise learning-rate decay (the first SGD update of
each block), the weights' EMA (its closed form), Mixup/CutMix (the targets as lambda says, the box's area),
RandAugment (the parser, seeding, and each operation's effect on a small image), random erasing (its rectangles,
fills and seeding, in the training transform) and the recipe table."""

import json
import math
import sys

import numpy as np
import PIL.Image
import pytest
import torch
from conftest import tiny_config
from safetensors.torch import load_file
from transformers import TrainerCallback

from hf_vit.data.augment.mixing import (
    Mixing,
    cutmix_box,
    draw_lambda,
    mix_batch,
    mixing_seed,
    smooth_targets,
    soft_target_cross_entropy,
)
from hf_vit.data.augment.rand_augment import (
    OPERATIONS,
    RandAugment,
    RandAugmentPolicy,
    parse_rand_augment,
)
from hf_vit.data.augment.random_erasing import RandomErasing
from hf_vit.train.ema import WeightAverage, ema_decay_at
from hf_vit.train.recipes import NAMED_RECIPES, layer_decay_param_groups, layer_of, scaled_learning_rate

# ---------------------------------------------------------------------------------------------------------------------
# Layer-wise learning-rate decay


def to_pil(pixels: torch.Tensor) -> PIL.Image.Image:
    """A uint8 [C, H, W] tensor (C = 1 or 3) as a PIL image (mode L or RGB). Each channel plane is wrapped as it lies
    (no copy) and PIL interleaves them: several times faster than transposing the tensor to [H, W, C] first."""
    planes = np.ascontiguousarray(pixels.numpy())
    height, width = planes.shape[1:]
    bands = [PIL.Image.frombuffer("L", (width, height), plane, "raw", "L", 0, 1) for plane in planes]
    return bands[0] if len(bands) == 1 else PIL.Image.merge("RGB", bands)


def from_pil(image: PIL.Image.Image) -> torch.Tensor:
    array = np.array(image)
    return torch.from_numpy(array[..., None] if array.ndim == 2 else array).permute(2, 0, 1)


def _classifier(layers=3, **fields):
    from hf_vit import VisionTransformerForImageClassification

    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(tiny_config(num_hidden_layers=layers, **fields))
    with torch.no_grad():  # a zero-initialised head would give the blocks no gradient
        model.classifier.weight.normal_(0, 0.5)
    return model


def _first_sgd_update(model, groups, inputs):
    optimizer = torch.optim.SGD(groups, lr=1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(**inputs).loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    return {n: (before[n] - p.detach(), grads[n]) for n, p in model.named_parameters() if n in grads}


def _scale_of(update, grad, lr):
    mask = grad.abs() > 1e-6
    return (update[mask] / (lr * grad[mask])).mean().item()


@pytest.mark.parametrize("decay", [0.5, 0.75])
def test_layer_decay_scales_each_block_first_sgd_update(decay):
    """With SGD the first update is lr_group * grad: block i of L moves by lr * D^(L-i) times its gradient, the
    embeddings by lr * D^(L+1), the final norm and head by lr."""
    model, lr, depth = _classifier(layers=3), 0.1, 3
    groups = layer_decay_param_groups(model, learning_rate=lr, weight_decay=0.0, layer_decay=decay)
    inputs = {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.tensor([0, 1, 2, 3])}
    updates = _first_sgd_update(model, groups, inputs)
    expected = {
        "vit.embeddings.patch_embedding.weight": decay ** (depth + 1),
        "vit.embeddings.position_embedding": decay ** (depth + 1),
        "vit.embeddings.cls_token": decay ** (depth + 1),
        "vit.norm.weight": 1.0,
        "classifier.weight": 1.0,
        **{f"vit.layers.{i}.mlp.fc1.weight": decay ** (depth - i) for i in range(depth)},
        **{f"vit.layers.{i}.attention.qkv.weight": decay ** (depth - i) for i in range(depth)},
    }
    for name, scale in expected.items():
        update, grad = updates[name]
        assert _scale_of(update, grad, lr) == pytest.approx(scale, rel=1e-4), name
    # every parameter moved by exactly its group's lr times its gradient
    for group in groups:
        for name in group["param_names"]:
            update, grad = updates[name]
            torch.testing.assert_close(update, group["lr"] * grad, rtol=1e-5, atol=1e-7)


def test_layer_decay_weight_decay_groups():
    """No weight decay on biases, norms, position embeddings and the class token; decay on the weight matrices.
    With AdamW at a zero gradient, the first update is lr_group * weight_decay * w exactly where decay applies."""
    model = _classifier(layers=2)
    groups = layer_decay_param_groups(model, learning_rate=0.01, weight_decay=0.3, layer_decay=0.5)
    by_name = {n: g for g in groups for n in g["param_names"]}
    for name in (
        "vit.embeddings.position_embedding",
        "vit.embeddings.cls_token",
        "vit.layers.0.norm1.weight",
        "vit.layers.1.mlp.fc1.bias",
        "vit.norm.bias",
        "classifier.bias",
    ):
        assert by_name[name]["weight_decay"] == 0.0, name
    for name in ("vit.embeddings.patch_embedding.weight", "vit.layers.0.attention.qkv.weight", "classifier.weight"):
        assert by_name[name]["weight_decay"] == 0.3, name
    optimizer = torch.optim.AdamW(groups, lr=1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        group = by_name[name]
        expected = before[name] * (1 - group["lr"] * group["weight_decay"])
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-7)


def test_layer_decay_numbering_of_lora_and_mpp_models():
    """The same numbering inside peft's wrapper (frozen weights left out) and for masked patch prediction."""
    from peft import LoraConfig, get_peft_model

    from hf_vit import VisionTransformerForMaskedPatchPrediction

    model = _classifier(layers=2)
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["qkv"], modules_to_save=["classifier"]))
    groups = layer_decay_param_groups(lora, learning_rate=1.0, weight_decay=0.1, layer_decay=0.5)
    names = [n for g in groups for n in g["param_names"]]
    assert names and all("lora_" in n or "classifier" in n for n in names)
    for group in groups:
        for name in group["param_names"]:
            if ".layers.0." in name:
                assert group["lr"] == 0.5**2, name
            elif ".layers.1." in name:
                assert group["lr"] == 0.5, name
            else:
                assert group["lr"] == 1.0, name
    mpp = VisionTransformerForMaskedPatchPrediction(tiny_config(num_hidden_layers=2))
    groups = layer_decay_param_groups(mpp, learning_rate=1.0, weight_decay=0.1, layer_decay=0.5)
    scale = {n: g["lr_scale"] for g in groups for n in g["param_names"]}
    assert scale["vit.embeddings.mask_token"] == 0.5**3
    assert scale["vit.layers.0.mlp.fc2.weight"] == 0.5**2
    assert scale["mpp_head.weight"] == 1.0
    assert layer_of("module.base_model.model.vit.layers.11.norm1.weight", 12) == 12
    with pytest.raises(ValueError, match="--layer_decay"):
        layer_decay_param_groups(mpp, 1.0, 0.0, 1.5)


# ---------------------------------------------------------------------------------------------------------------------
# EMA of the weights


@pytest.mark.parametrize("warmup", [False, True])
def test_ema_matches_its_closed_form(warmup):
    """After steps 1..T the average is sum_t w_t (1 - d_t) prod_{s>t} d_s (the first update copies: d_1 = 0),
    computed here from the raw weights after each step; LoRA-style frozen weights are not averaged."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].weight.requires_grad_(False)
    average = WeightAverage(model, decay=0.9, warmup=warmup)
    assert average.names == ["0.weight", "0.bias", "1.bias"]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    history, decays = [], []
    for step in range(1, 6):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        optimizer.step()
        decays.append(average.update(step))
        history.append([p.detach().clone() for p in average.params])
    expected_decays = [0.0] + [min(0.9, 1 - (1 + s) ** (-2 / 3)) if warmup else 0.9 for s in range(1, 5)]
    assert decays == pytest.approx(expected_decays)
    assert ema_decay_at(1, 0.9, warmup) == 0.0
    for index in range(len(average.params)):
        closed = sum(history[t][index] * (1 - decays[t]) * math.prod(decays[t + 1 :]) for t in range(len(history)))
        torch.testing.assert_close(average.averages[index], closed, rtol=1e-6, atol=1e-7)
    # applied() swaps the average in and back out
    raw = [p.detach().clone() for p in average.params]
    with average.applied():
        for p, a in zip(average.params, average.averages):
            assert torch.equal(p, a)
    for p, r in zip(average.params, raw):
        assert torch.equal(p, r)


def test_ema_state_round_trip_and_refusals(tmp_path):
    model = torch.nn.Linear(4, 3)
    average = WeightAverage(model, decay=0.5)
    with torch.no_grad():
        model.weight.add_(1.0)
    average.update(2)
    average.save(tmp_path)
    other = WeightAverage(torch.nn.Linear(4, 3), decay=0.5)
    other.load(tmp_path)
    for a, b in zip(average.averages, other.averages):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="does not average this model"):
        WeightAverage(torch.nn.Linear(4, 3, bias=False), decay=0.5).load(tmp_path)
    with pytest.raises(ValueError, match="holds no ema_state.safetensors"):
        other.load(tmp_path / "missing")
    with pytest.raises(ValueError, match="--ema_decay must be in"):
        WeightAverage(model, decay=1.0)


# ---------------------------------------------------------------------------------------------------------------------
# Mixup and CutMix


def _batch(n=6, classes=5, size=16):
    torch.manual_seed(1)
    return torch.randn(n, 3, size, size), torch.arange(n) % classes


def test_mixup_targets_and_images_are_as_lambda_says():
    pixels, _ = _batch()
    labels = torch.tensor([0, 1, 2, 3, 4, 3])
    mixing = Mixing(num_classes=5, mixup_alpha=0.8, label_smoothing=0.1)
    mixed, targets, lam = mix_batch(pixels, labels, mixing, np.random.default_rng(3))
    assert 0 < lam < 1
    torch.testing.assert_close(mixed, lam * pixels + (1 - lam) * pixels.flip(0))
    smooth = torch.full((6, 5), 0.1 / 5)
    smooth[torch.arange(6), labels] = 1 - 0.1 + 0.1 / 5
    torch.testing.assert_close(targets, lam * smooth + (1 - lam) * smooth.flip(0))
    torch.testing.assert_close(targets.sum(1), torch.ones(6))
    # image 0 holds lam of its class and 1 - lam of the last image's (plus smoothing)
    assert targets[0, labels[0]].item() == pytest.approx(lam * (0.9 + 0.02) + (1 - lam) * 0.02)
    assert targets[0, labels[-1]].item() == pytest.approx(lam * 0.02 + (1 - lam) * (0.9 + 0.02))


def test_cutmix_lambda_is_corrected_to_the_box_area():
    pixels, labels = _batch(size=20)
    mixing = Mixing(num_classes=5, cutmix_alpha=1.0)
    for seed in range(20):
        mixed, targets, lam = mix_batch(pixels, labels, mixing, np.random.default_rng(seed))
        pasted = (mixed != pixels).any(dim=1)[0]  # where image 0 took the last image's pixels
        area = pasted.sum().item()
        assert lam == pytest.approx(1 - area / (20 * 20))
        one_hot = torch.nn.functional.one_hot(labels, 5).float()
        torch.testing.assert_close(targets, lam * one_hot + (1 - lam) * one_hot.flip(0))
        if area:  # the pasted pixels form one box, the same in every image
            rows, cols = pasted.any(1).nonzero(), pasted.any(0).nonzero()
            assert area == (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
            assert torch.equal((mixed != pixels).any(dim=1)[1], pasted)
    # a box drawn for lam has sides int(H sqrt(1 - lam)) (clipped at the borders)
    (top, bottom, left, right), corrected = cutmix_box(100, 100, 0.75, np.random.default_rng(0))
    assert bottom - top <= 50 and right - left <= 50
    assert corrected == pytest.approx(1 - (bottom - top) * (right - left) / 1e4)
    (top, bottom, left, right), corrected = cutmix_box(100, 80, 0.5, np.random.default_rng(0), minmax=(0.2, 0.4))
    assert 20 <= bottom - top < 40 and 16 <= right - left < 32
    assert corrected == pytest.approx(1 - (bottom - top) * (right - left) / 8000)


@pytest.mark.parametrize("minmax", [None, (0.3, 0.9)])
def test_cutmix_of_native_aspect_batches_cuts_whole_patches_on_each_images_grid(minmax):
    # images of grids 1x8, 2x3, 3x2 and 2x4 patches (of 2x2x3 values), padded to 8 patch slots with zeros
    grids = [(1, 8), (2, 3), (3, 2), (2, 4)]
    patches = torch.zeros(len(grids), 8, 12)
    for image, (rows, cols) in enumerate(grids):
        patches[image, : rows * cols] = torch.rand(rows * cols, 12, generator=torch.Generator().manual_seed(image))
    labels = torch.arange(len(grids))
    mixing = Mixing(num_classes=4, cutmix_alpha=1.0, cutmix_minmax=minmax)
    cut = 0
    for seed in range(30):
        mixed, targets, _ = mix_batch(patches, labels, mixing, np.random.default_rng(seed), torch.tensor(grids))
        for image, (rows, cols) in enumerate(grids):
            partner = len(grids) - 1 - image
            other_rows, other_cols = grids[partner]
            replaced_values = (mixed[image] != patches[image]).sum().item()
            slots = (mixed[image] != patches[image]).any(-1).nonzero().flatten().tolist()
            # whole patches of the image's own grid, in the part of it its partner's grid has too, each the partner's
            # patch at the same grid place, together one box
            assert replaced_values == len(slots) * 12 and all(slot < rows * cols for slot in slots)
            places = [divmod(slot, cols) for slot in slots]
            assert all(row < other_rows and col < other_cols for row, col in places)
            for slot, (row, col) in zip(slots, places):
                assert torch.equal(mixed[image, slot], patches[partner, row * other_cols + col])
            if places:
                box_rows = {row for row, _ in places}
                box_cols = {col for _, col in places}
                assert len(places) == len(box_rows) * len(box_cols)
                assert max(box_rows) - min(box_rows) + 1 == len(box_rows)
                assert max(box_cols) - min(box_cols) + 1 == len(box_cols)
                cut += 1
            # the target's share of the other class is the share of the image's pixel values replaced
            share = replaced_values / (rows * cols * 12)
            assert targets[image, labels[partner]].item() == pytest.approx(share)
            assert targets[image, labels[image]].item() == pytest.approx(1 - share)
    assert cut > 20  # most draws cut something


def test_mixup_of_native_aspect_batches_blends_each_pixel_with_a_pixel_of_the_partner_never_padding():
    # the case: a 4x4 grid of ones mixed with a 2x4 grid of twos (padded to 16 slots), and two more images
    grids = [(4, 4), (1, 5), (3, 2), (2, 4)]
    images = [torch.rand(rows, cols, 12, generator=torch.Generator().manual_seed(i)) for i, (rows, cols) in
              enumerate(grids)]  # fmt: skip
    images[0], images[3] = torch.ones(4, 4, 12), torch.full((2, 4, 12), 2.0)
    patches = torch.zeros(len(grids), 16, 12)
    for index, image in enumerate(images):
        patches[index, : image.shape[0] * image.shape[1]] = image.flatten(0, 1)
    labels = torch.arange(len(grids))
    mixing = Mixing(num_classes=4, mixup_alpha=0.8, label_smoothing=0.0)
    mixed, targets, lam_mean = mix_batch(patches, labels, mixing, np.random.default_rng(5), torch.tensor(grids))
    lam, _ = draw_lambda(mixing, np.random.default_rng(5))
    assert 0 < lam < 1
    lams = []
    for index, (rows, cols) in enumerate(grids):
        partner = images[len(grids) - 1 - index]
        expected = images[index].clone()  # each grid place: blended where the partner has that place, else its own
        for row in range(rows):
            for col in range(cols):
                if row < partner.shape[0] and col < partner.shape[1]:
                    expected[row, col] = lam * images[index][row, col] + (1 - lam) * partner[row, col]
        torch.testing.assert_close(mixed[index, : rows * cols], expected.flatten(0, 1))
        assert torch.equal(mixed[index, rows * cols :], patches[index, rows * cols :])  # the padding stays padding
        blended = min(rows, partner.shape[0]) * min(cols, partner.shape[1])
        lams.append(1 - (1 - lam) * blended / (rows * cols))
        assert targets[index, index].item() == pytest.approx(lams[-1])
        assert targets[index, len(grids) - 1 - index].item() == pytest.approx(1 - lams[-1])
    # 8 of image 0's 16 patches blended (ones with twos: 1 * lam + 2 * (1 - lam)), 8 kept; none with padding (lam)
    values = mixed[0, :16, 0]
    assert (values == 1.0).sum() == 8 and torch.allclose(values[:8], torch.tensor(2 - lam))
    assert targets[0, 3].item() == pytest.approx((1 - lam) / 2) and lam_mean == pytest.approx(sum(lams) / 4)


def test_mixing_is_reproducible_per_seed_and_switches():
    pixels, labels = _batch()
    mixing = Mixing(num_classes=5, mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5, prob=0.7)
    runs = [
        [mix_batch(pixels, labels, mixing, np.random.default_rng(mixing_seed(0, step)))[2] for step in range(40)]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    other = [mix_batch(pixels, labels, mixing, np.random.default_rng(mixing_seed(1, step)))[2] for step in range(40)]
    assert other != runs[0]
    assert 0 < sum(lam == 1.0 for lam in runs[0]) < 40  # mixup_prob 0.7: some batches are left alone
    assert mixing_seed(0, 5, 1) != mixing_seed(0, 5, 0)


def test_mixing_multi_label_targets():
    pixels = torch.randn(4, 3, 8, 8)
    multi_hot = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.float32)
    mixing = Mixing(num_classes=3, mixup_alpha=1.0, label_smoothing=0.3)
    _, targets, lam = mix_batch(pixels, multi_hot, mixing, np.random.default_rng(0))
    smooth = multi_hot * 0.7 + 0.1
    torch.testing.assert_close(targets, lam * smooth + (1 - lam) * smooth.flip(0))
    assert torch.equal(smooth_targets(multi_hot, 3, 0.0), multi_hot)


def test_soft_target_cross_entropy_and_refusals():
    logits = torch.randn(4, 5)
    labels = torch.tensor([0, 3, 1, 4])
    one_hot = torch.nn.functional.one_hot(labels, 5).float()
    torch.testing.assert_close(
        soft_target_cross_entropy(logits, one_hot), torch.nn.functional.cross_entropy(logits, labels)
    )
    soft = smooth_targets(labels, 5, 0.1)
    torch.testing.assert_close(
        soft_target_cross_entropy(logits, soft, num_items_in_batch=8),
        torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.1, reduction="sum") / 8,
    )
    with pytest.raises(ValueError, match="--mixup_prob"):
        Mixing(num_classes=5, mixup_alpha=1.0, prob=1.5)
    with pytest.raises(ValueError, match="--cutmix_minmax"):
        Mixing(num_classes=5, cutmix_minmax=(0.5, 0.2))
    with pytest.raises(ValueError, match="--mixup_alpha"):
        Mixing(num_classes=5, mixup_alpha=-1)


# ---------------------------------------------------------------------------------------------------------------------
# RandAugment


def test_rand_augment_parser():
    assert parse_rand_augment("rand-m9-mstd0.5-inc1") == RandAugmentPolicy(9, 2, 0.5, 10, True)
    assert parse_rand_augment("rand-m7-n3") == RandAugmentPolicy(7, 3, 0.0, 10, False)
    assert parse_rand_augment("rand") == RandAugmentPolicy()
    assert parse_rand_augment("rand-m15-n2-mmax15").magnitude_max == 15
    assert parse_rand_augment("rand-m9-mstd101").magnitude_std == math.inf
    assert parse_rand_augment("rand-inc1").ops[4] == "PosterizeIncreasing"
    assert len(parse_rand_augment("rand").ops) == 15
    for bad, message in (
        ("auto-m9", "timm's notation"),
        ("rand-m9-w0", "weighted"),
        ("rand-x3", "unknown section"),
        ("rand-n0", "whole number"),
        ("rand-inc2", "inc takes 0 or 1"),
        ("rand-mfoo", "cannot read"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_rand_augment(bad)


def _image(size=12):
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=generator)


def test_rand_augment_is_reproducible_per_seed():
    augment = RandAugment("rand-m9-mstd0.5-inc1")
    image = _image(16)

    def run(seed):
        generator = torch.Generator().manual_seed(seed)
        return [augment(image, generator) for _ in range(8)]

    first, again, other = run(0), run(0), run(1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    assert any(not torch.equal(a, image) for a in first)
    grey = augment(image[:1], torch.Generator().manual_seed(0))
    assert grey.shape == (1, 16, 16) and grey.dtype == torch.uint8
    with pytest.raises(ValueError, match="1 or 3 channels"):
        augment(torch.zeros(4, 8, 8, dtype=torch.uint8))


def _apply(name, magnitude, image, sign_seed=None):
    augment = RandAugment(RandAugmentPolicy(), fill=0, resample="nearest")
    generator = None if sign_seed is None else torch.Generator().manual_seed(sign_seed)
    return from_pil(augment.apply(to_pil(image), name, magnitude, generator))


def test_each_operation_does_what_it_says():
    image = _image()
    x = image.int()
    # Posterize at magnitude 5 keeps int(5/10 * 4) = 2 bits; the increasing variant 4 - 2 = 2, at 7.5: 4 - 3 = 1.
    assert torch.equal(_apply("Posterize", 5, image).int(), x & 0b11000000)
    assert torch.equal(_apply("PosterizeIncreasing", 7.5, image).int(), x & 0b10000000)
    # At the strongest magnitudes they keep no bit: a black image (Pillow's own posterize refuses 0 bits; a
    # DeiT run's RandAugment m9-mstd0.5 draws magnitude 10 for about 2% of its operations).
    assert int(_apply("PosterizeIncreasing", 10, image).max()) == 0
    assert int(_apply("Posterize", 2, image).max()) == 0
    grey = image[:1]
    assert torch.equal(_apply("PosterizeIncreasing", 5, grey).int(), grey.int() & 0b11000000)
    # The tensor to PIL and back is exact for grey and RGB, whatever the tensor's strides (a transposed view).
    for pixels in (image, grey, image.transpose(1, 2)):
        assert torch.equal(from_pil(to_pil(pixels)), pixels)
    # Solarize at magnitude 5 inverts pixels >= int(0.5 * 256) = 128; increasing at 2.5: >= 256 - 64 = 192.
    assert torch.equal(_apply("Solarize", 5, image).int(), torch.where(x >= 128, 255 - x, x))
    assert torch.equal(_apply("SolarizeIncreasing", 2.5, image).int(), torch.where(x >= 192, 255 - x, x))
    # SolarizeAdd adds int(m/10 * 110) below 128, clipped at 255.
    assert torch.equal(_apply("SolarizeAdd", 10, image).int(), torch.where(x < 128, (x + 110).clamp(max=255), x))
    assert torch.equal(_apply("Invert", 3, image).int(), 255 - x)
    # Brightness at magnitude 0 multiplies by 0.1 (PIL rounds and clips).
    expected = (x.float() * 0.1).round().clamp(0, 255).int()
    assert (_apply("Brightness", 0, image).int() - expected).abs().max() <= 1
    # AutoContrast stretches each channel to 0..255.
    stretched = _apply("AutoContrast", 0, image)
    assert stretched.amin(dim=(1, 2)).tolist() == [0, 0, 0] and stretched.amax(dim=(1, 2)).tolist() == [255] * 3


def test_geometric_operations_move_pixels_by_their_magnitude():
    """A bright 3x3 block centred on pixel (x 16, y 10) of a dark 21x21 image moves where the operation says (PIL
    samples output pixel centres, nearest neighbour here): its centroid is checked to within 0.6 pixel."""
    image = torch.zeros(3, 21, 21, dtype=torch.uint8)
    image[:, 9:12, 15:18] = 255

    def centroid(result):
        ys, xs = result[0].nonzero(as_tuple=True)
        assert len(xs) >= 4
        return xs.float().mean().item(), ys.float().mean().item()

    def sign_of(seed):  # the operation's first draw says its sign
        return -1 if torch.rand((), generator=torch.Generator().manual_seed(seed)).item() > 0.5 else 1

    # Rotate at magnitude 10: +-30 degrees about the image's centre (10.5, 10.5), counter-clockwise when positive.
    signs = set()
    for seed in range(6):
        angle = math.radians(30 * sign_of(seed))
        signs.add(sign_of(seed))
        x, y = centroid(_apply("Rotate", 10, image, sign_seed=seed))
        assert x == pytest.approx(10.5 + 6 * math.cos(angle) - 0.5, abs=0.6)
        assert y == pytest.approx(10.5 - 6 * math.sin(angle) - 0.5, abs=0.6)
    assert signs == {-1, 1}
    # Translations and shears of a block centred on (10, 10).
    image = torch.zeros(3, 21, 21, dtype=torch.uint8)
    image[:, 9:12, 9:12] = 255
    # TranslateXRel at magnitude 5: output (x, y) samples input (x + t, y), t = +-0.225 of the width (4.725 px).
    for seed in range(2):
        x, y = centroid(_apply("TranslateXRel", 5, image, sign_seed=seed))
        assert x == pytest.approx(10 - sign_of(seed) * 0.225 * 21, abs=0.6) and y == pytest.approx(10)
    x, y = centroid(_apply("TranslateYRel", 5, image, sign_seed=0))
    assert y == pytest.approx(10 - sign_of(0) * 0.225 * 21, abs=0.6) and x == pytest.approx(10)
    # ShearX at magnitude 10 (+-0.3): output (x, y) samples input (x + 0.3 y, y), y = 10.5 at the block's centre.
    x, y = centroid(_apply("ShearX", 10, image, sign_seed=0))
    assert x == pytest.approx(10 - sign_of(0) * 0.3 * 10.5, abs=0.6) and y == pytest.approx(10)
    x, y = centroid(_apply("ShearY", 10, image, sign_seed=1))
    assert y == pytest.approx(10 - sign_of(1) * 0.3 * 10.5, abs=0.6) and x == pytest.approx(10)
    assert set(OPERATIONS) >= set(parse_rand_augment("rand").ops) | set(parse_rand_augment("rand-inc1").ops)


def _photo(height=37, width=52):
    """A photograph's crop (scikit-learn's sample photo), of odd, non-square size: edges, flat areas and texture."""
    from sklearn.datasets import load_sample_images

    photo = load_sample_images().images[0]
    return np.ascontiguousarray(photo[200 : 200 + height * 4 : 4, 300 : 300 + width * 4 : 4])


@pytest.mark.parametrize("magnitude_max", [10, 15])
def test_operations_match_pillows(magnitude_max):
    """Each operation on uint8 arrays against Pillow's own (the calls timm makes), for RGB and grey, every magnitude
    step and both signs, bilinear, with a fill colour: the colour operations and Pillow-run rotations give the same
    pixels; the shears and translations (interpolated here in float32, in float64 by Pillow) differ by at most 1,
    on few pixels, and fill exactly the pixels Pillow fills."""
    fill = (124, 116, 104)
    augment = RandAugment(RandAugmentPolicy(magnitude_max=magnitude_max), fill=fill, resample="bilinear")
    rgb = _photo()
    two_levels = np.where(rgb > 120, 200, 30).astype(np.uint8)  # a histogram of two levels per channel
    flat = np.full_like(rgb, 77)  # one level: AutoContrast and Equalize leave it
    worst = {}
    for name in OPERATIONS:
        for magnitude in np.linspace(0, magnitude_max, 7):
            for seed, image in ((0, rgb), (1, rgb), (2, rgb[..., :1]), (3, two_levels), (4, flat)):
                ours = augment.apply(image, name, magnitude, torch.Generator().manual_seed(seed))
                pils = augment.apply(image, name, magnitude, torch.Generator().manual_seed(seed), reference=True)
                assert ours.shape == image.shape and ours.dtype == np.uint8, name
                difference = np.abs(ours.astype(int) - pils.astype(int))
                worst[name] = max(worst.get(name, (0, 0.0)), (int(difference.max()), float((difference > 0).mean())))
                # the filled pixels are Pillow's: a pixel of the fill colour in one is the fill colour in the other
                filled_pil = (pils == np.array(fill[: image.shape[2]], np.uint8)).all(axis=2)
                filled_ours = (ours == np.array(fill[: image.shape[2]], np.uint8)).all(axis=2)
                assert (filled_pil == filled_ours).mean() > 0.99, name
    geometric = {"ShearX", "ShearY", "TranslateXRel", "TranslateYRel"}
    for name, (largest, share) in worst.items():
        if name in geometric:
            assert largest <= 1 and share < 0.1, (name, largest, share)
        else:
            assert largest == 0, (name, largest, share)


def test_rand_augment_draws_follow_the_policy():
    """Over 4,000 images of `rand-m9-mstd0.5-n2`: every operation is chosen about equally often, each applies with
    probability 1/2, magnitudes are N(9, 0.5) (clipped at 10), signs are + or - one half each; `mstd101` draws the
    magnitude uniformly in [0, 9]."""
    drawn = []

    def record(augment):
        augment.apply = lambda image, name, magnitude, sign=None, **_: drawn.append((name, magnitude, sign)) or image
        return augment

    image = _image(8)
    generator = torch.Generator().manual_seed(0)
    augment = record(RandAugment("rand-m9-mstd0.5-n2"))
    for _ in range(4000):
        augment(image, generator)
    names = [name for name, _, _ in drawn]
    counts = np.array([names.count(name) for name in augment.policy.ops])
    assert abs(len(drawn) / 8000 - 0.5) < 0.02 and counts.min() > 0.8 * counts.mean()
    magnitudes = np.array([m for _, m, _ in drawn])
    assert abs(magnitudes.mean() - 9) < 0.05 and 0.4 < magnitudes.std() < 0.5 and magnitudes.max() <= 10
    assert abs(np.mean([sign > 0.5 for _, _, sign in drawn]) - 0.5) < 0.03
    drawn.clear()
    augment = record(RandAugment("rand-m9-mstd101"))
    for _ in range(2000):
        augment(image, generator)
    magnitudes = np.array([m for _, m, _ in drawn])
    assert magnitudes.min() >= 0 and magnitudes.max() <= 9 and abs(magnitudes.mean() - 4.5) < 0.25


def test_rand_augment_takes_either_layout_and_leaves_its_input():
    """The pixel path's channels-last tensors and contiguous [C, H, W] ones give the same images; the input is never
    written to."""
    augment = RandAugment("rand-m9-mstd0.5-inc1-n3", fill=(124, 116, 104))
    photo = torch.from_numpy(_photo())
    channels_last, planar = photo.permute(2, 0, 1), photo.permute(2, 0, 1).contiguous()
    for seed in range(12):
        before = planar.clone()
        first = augment(channels_last, torch.Generator().manual_seed(seed))
        second = augment(planar, torch.Generator().manual_seed(seed))
        assert torch.equal(first, second) and torch.equal(planar, before) and torch.equal(channels_last, before)


# ---------------------------------------------------------------------------------------------------------------------
# Random erasing


def _changed_boxes_hold(image, before, boxes):
    """The pixels that changed are exactly those of the returned boxes (their union, when they overlap)."""
    inside = torch.zeros(image.shape[1:], dtype=torch.bool)
    for top, left, height, width in boxes:
        inside[top : top + height, left : left + width] = True
    return torch.equal((image != before).any(0), inside)


@pytest.mark.parametrize("count", [1, 3])
def test_random_erasing_boxes_follow_the_area_and_aspect_draws(count):
    """Over many seeds at P=1: the changed pixels are the returned rectangles, each strictly inside the image, its
    size compatible with a target area in [0.02, 1/3] of the image / count and an aspect in [0.3, 1/0.3] (h and w
    are rounded square roots, so each is within 0.5 of sqrt(area * aspect) and sqrt(area / aspect)); with recount 3
    every count 1..3 occurs."""
    erasing = RandomErasing(1.0, "pixel", count)
    height, width, counts = 16, 24, set()
    for seed in range(150):
        image = torch.full((3, height, width), 5.0)
        boxes = erasing.erase(image, torch.Generator().manual_seed(seed))
        assert _changed_boxes_hold(image, torch.full_like(image, 5.0), boxes)
        counts.add(len(boxes))
        for top, left, h, w in boxes:
            assert 0 <= top and top + h <= height and 0 <= left and left + w <= width and h < height and w < width
            share = height * width / len(boxes)  # no attempt fails at these sizes: as many boxes as the count
            assert (h - 0.5) * (w - 0.5) <= share / 3 and (h + 0.5) * (w + 0.5) >= 0.02 * share
            assert (h + 0.5) / max(w - 0.5, 1e-9) >= 0.3 and (h - 0.5) / (w + 0.5) <= 1 / 0.3
    assert counts == ({1} if count == 1 else {1, 2, 3})


def test_random_erasing_fills_probability_and_seeding():
    image = torch.full((3, 64, 64), 5.0)
    big = dict(min_area=0.3, max_area=0.3)  # a large box, for the fill's statistics

    def erased(mode, seed, probability=1.0, **fields):
        out = image.clone()
        boxes = RandomErasing(probability, mode, **fields).erase(out, torch.Generator().manual_seed(seed))
        return out, boxes

    # pixel: per-pixel standard normal noise
    out, [(top, left, h, w)] = erased("pixel", 0, **big)
    noise = out[:, top : top + h, left : left + w]
    assert noise.numel() > 3000 and abs(noise.mean().item()) < 0.1 and abs(noise.std().item() - 1) < 0.1
    assert _changed_boxes_hold(out, image, [(top, left, h, w)])
    # rand: one normal value per channel, constant over the box, the channels differ
    out, [(top, left, h, w)] = erased("rand", 0, **big)
    colour = out[:, top, left]
    assert torch.equal(out[:, top : top + h, left : left + w], colour[:, None, None].expand(3, h, w))
    assert len(set(colour.tolist())) == 3
    # const: zeros (the mean colour of a normalised image)
    out, [(top, left, h, w)] = erased("const", 0, **big)
    assert torch.equal(out[:, top : top + h, left : left + w], torch.zeros(3, h, w))
    # reproducible per seed, different across seeds
    assert torch.equal(erased("pixel", 3)[0], erased("pixel", 3)[0])
    assert not torch.equal(erased("pixel", 3)[0], erased("pixel", 4)[0])
    # P=0: unchanged, and nothing drawn from the generator
    generator = torch.Generator().manual_seed(1)
    state = generator.get_state()
    out = image.clone()
    assert RandomErasing(0.0).erase(out, generator) == [] and torch.equal(out, image)
    assert torch.equal(generator.get_state(), state)
    # P=0.5: about half the images erased (binomial: 400 draws, sd 10)
    erased_images = sum(bool(erased("pixel", seed, 0.5)[1]) for seed in range(400))
    assert 160 <= erased_images <= 240
    with pytest.raises(TypeError, match="float"):
        RandomErasing(1.0).erase(torch.zeros(3, 8, 8, dtype=torch.uint8))


def test_random_erasing_in_the_training_transform():
    """After normalisation, image by image in order, from the transform's generator: the batch equals the plain
    transform's batch erased here with a generator of the same seed (crop and flip off, so they draw nothing);
    the same seed gives the same batch again (a resumed epoch), another seed another; inside DataLoader workers
    (torch's global generator, seeded per worker and epoch) likewise. Native-aspect images are erased within their
    own size, before they are cut into patches: the padding stays zeros."""
    from hf_vit import VisionTransformerImageProcessor
    from hf_vit.data.augment.train_transform import make_train_transform
    from hf_vit.model.image_processing_vit import native_patch_batch

    images = [PIL.Image.fromarray(np.asarray(_image(24).permute(1, 2, 0))) for _ in range(4)]
    batch = {"image": images, "label": [0, 1, 2, 3]}
    processor = VisionTransformerImageProcessor(size={"height": 16, "width": 16})

    def transform(seed, **erasing):
        return make_train_transform(processor, random_resized_crop=False, hflip=False, seed=seed, **erasing)(batch)

    plain = transform(0)["pixel_values"]
    generator = torch.Generator().manual_seed(0)
    expected = torch.stack([RandomErasing(1.0, "rand", 2)(image.clone(), generator) for image in plain])
    first = transform(0, reprob=1.0, remode="rand", recount=2)
    assert torch.equal(first["pixel_values"], expected) and not torch.equal(expected, plain)
    assert torch.equal(first["labels"], torch.tensor([0, 1, 2, 3]))
    assert torch.equal(transform(0, reprob=1.0, remode="rand", recount=2)["pixel_values"], expected)  # resumed
    assert not torch.equal(transform(1, reprob=1.0, remode="rand", recount=2)["pixel_values"], expected)
    # with the crop and flip on, from torch's global generator (as in DataLoader workers)
    augmented = make_train_transform(processor, seed=None, reprob=0.5)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(augmented(batch)["pixel_values"])
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    # native aspect: each normalised image erased on its own grid, then patchified
    native = VisionTransformerImageProcessor(max_num_patches=12, patch_size=4, do_center_crop=False)
    wide = [PIL.Image.fromarray(np.asarray(_image(24)[:, :8].permute(1, 2, 0))), images[0]]
    native_batch = {"image": wide, "label": [0, 1]}

    def native_transform(**erasing):
        return make_train_transform(native, random_resized_crop=False, hflip=False, seed=0, **erasing)(native_batch)

    generator = torch.Generator().manual_seed(0)
    plain = native_transform()
    erased = native_transform(reprob=1.0)
    grids = plain["spatial_shapes"].tolist()
    assert grids != [grids[0]] * len(grids)  # images of two shapes
    padding = ~plain["pixel_attention_mask"].bool()
    assert padding.any() and torch.equal(
        erased["pixel_values"][padding], torch.zeros_like(erased["pixel_values"][padding])
    )
    own = []
    for row, (rows, cols) in enumerate(grids):  # the plain image back from its patches, erased here
        image = plain["pixel_values"][row, : rows * cols].view(rows, cols, 4, 4, 3).permute(4, 0, 2, 1, 3)
        own.append(RandomErasing(1.0)(image.reshape(3, rows * 4, cols * 4).clone(), generator))
    assert torch.equal(erased["pixel_values"], native_patch_batch(own, 4, 12)["pixel_values"])
    assert not torch.equal(erased["pixel_values"], plain["pixel_values"])
    with pytest.raises(ValueError, match="--reprob .*do_normalize=False"):
        make_train_transform(VisionTransformerImageProcessor(size=16, do_normalize=False), reprob=0.5)
    with pytest.raises(ValueError, match="--remode must be one of"):
        make_train_transform(processor, remode="noise")


# ---------------------------------------------------------------------------------------------------------------------
# The recipe table


def test_recipe_table():
    assert set(NAMED_RECIPES) == {"augreg", "deit", "finetune"}
    for recipe in NAMED_RECIPES.values():
        flags = recipe.flags
        assert {"optim", "learning_rate", "lr_scheduler_type", "warmup_steps", "drop_path_rate"} <= set(flags)
        if "rand_augment" in flags:
            parse_rand_augment(flags["rand_augment"])
    assert scaled_learning_rate(NAMED_RECIPES["deit"], 1024) == pytest.approx(1e-3)
    assert scaled_learning_rate(NAMED_RECIPES["augreg"], 32) == 1e-3
    assert NAMED_RECIPES["finetune"].flags["layer_decay"] == 0.65
    PIL.Image.new("RGB", (1, 1))  # PIL is the operations' backend


# ---------------------------------------------------------------------------------------------------------------------
# The Trainer's part


class _Images(torch.utils.data.Dataset):
    def __init__(self, n=16, classes=5):
        generator = torch.Generator().manual_seed(0)
        self.pixels = torch.randn(n, 3, 32, 32, generator=generator)
        self.labels = torch.arange(n) % classes

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"pixel_values": self.pixels[i], "labels": self.labels[i]}


def _recipe_trainer(tmp_path, model, layer_decay=None, mixing=None, ema=None, **fields):
    from transformers import TrainingArguments

    from hf_vit.train.trainer import VisionTransformerTrainer

    args = TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, per_device_train_batch_size=8, **fields
    )
    return VisionTransformerTrainer(
        model=model, args=args, train_dataset=_Images(), callbacks=[ema] if ema else None,
        layer_decay=layer_decay, mixing=mixing, ema=ema,
    )  # fmt: skip


def test_trainer_builds_layer_decay_groups_and_the_schedule_keeps_their_ratios(tmp_path):
    model = _classifier(layers=3)
    trainer = _recipe_trainer(
        tmp_path, model, layer_decay=0.5, optim="sgd", learning_rate=0.1, weight_decay=0.02, warmup_steps=2
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    groups = trainer.optimizer.param_groups
    assert [g["layer"] for g in groups] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    for group in groups:
        assert group["initial_lr"] == pytest.approx(0.1 * 0.5 ** (4 - group["layer"]))
        assert group["weight_decay"] in (0.0, 0.02)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    for _ in range(3):
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    for group in groups:  # every group follows the same warmup and decay
        assert group["lr"] / group["initial_lr"] == pytest.approx(groups[-1]["lr"] / groups[-1]["initial_lr"])


def test_trainer_mixes_training_batches_and_learns_soft_targets(tmp_path):
    model = _classifier(layers=2)
    mixing = Mixing(num_classes=5, mixup_alpha=1.0, cutmix_alpha=1.0, label_smoothing=0.1)
    trainer = _recipe_trainer(tmp_path, model, mixing=mixing, seed=7)
    seen = []
    original = trainer.compute_loss

    def record(model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = original(model, inputs, return_outputs, num_items_in_batch)
        seen.append((inputs["pixel_values"].clone(), inputs["labels"].clone(), loss.detach(), num_items_in_batch))
        return loss

    trainer.compute_loss = record
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop
    batch = {"pixel_values": _Images().pixels[:8], "labels": _Images().labels[:8]}
    model.train()
    trainer.training_step(model, dict(batch), num_items_in_batch=torch.tensor(8))
    pixels, targets, loss, _ = seen[0]
    rng = np.random.default_rng(mixing_seed(7, 0, 0))
    expected_pixels, expected_targets, _ = mix_batch(batch["pixel_values"], batch["labels"], trainer.mixing, rng)
    assert torch.equal(pixels, expected_pixels) and torch.equal(targets, expected_targets)
    with torch.no_grad():
        logits = model(pixel_values=pixels).logits
    expected_loss = soft_target_cross_entropy(logits, targets, 8)
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-5)
    # the next batch of the same optimiser step is mixed with the next seed
    trainer.training_step(model, dict(batch), num_items_in_batch=torch.tensor(8))
    rng = np.random.default_rng(mixing_seed(7, 0, 1))
    assert torch.equal(seen[1][1], mix_batch(batch["pixel_values"], batch["labels"], trainer.mixing, rng)[1])
    # evaluation is unchanged: class ids, the model's loss
    model.eval()
    with torch.no_grad():
        eval_loss = trainer.compute_loss(model, dict(batch))
        assert eval_loss.item() == pytest.approx(model(**batch).loss.item())


def test_given_flags_and_recipe_summary():
    from transformers import HfArgumentParser, TrainingArguments

    from hf_vit.train.recipes import given_flags, recipe_summary

    parser = HfArgumentParser(TrainingArguments)
    parser.set_defaults(learning_rate=0.5, weight_decay=0.3)
    argv = ["--output_dir", "x", "--learning_rate=0.1", "--no_remove_unused_columns", "--seed", "3"]
    assert set(given_flags(parser, argv)) == {"output_dir", "learning_rate", "remove_unused_columns", "seed"}
    text = recipe_summary(NAMED_RECIPES["deit"], {"learning_rate": 0.1, "mixup_alpha": 0.8}, {"learning_rate"})
    assert text.startswith("recipe deit (Touvron et al. 2021")
    assert "learning_rate=0.1 (given on the command line)" in text and "mixup_alpha=0.8," in text
    assert "reprob=0.25, remode=pixel, recount=1," in text
    assert "Left out: repeated augmentation" in text and "scaled from" not in text


def test_trainer_evaluates_the_average_and_ends_holding_it(tmp_path):
    from hf_vit.train.ema import EMA_FILE, EmaCallback

    model = _classifier(layers=2)
    ema = EmaCallback(decay=0.5)
    trainer = _recipe_trainer(
        tmp_path, model, ema=ema, optim="sgd", learning_rate=0.5, max_steps=4, save_strategy="no"
    )
    evaluations = []

    class EvaluateMidway(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                averaged = [a.clone() for a in trainer.ema.average.averages]
                raw = [p.detach().clone() for p in trainer.ema.average.params]
                loss = trainer.evaluate(eval_dataset=_Images(8))["eval_loss"]
                evaluations.append((loss, averaged, raw))
                trainer.save_model(str(tmp_path / "midway"))

    trainer.add_callback(EvaluateMidway())
    trainer.train()
    loss, averaged, raw = evaluations[0]
    assert any(not torch.equal(a, r) for a, r in zip(averaged, raw))  # the average is not the weights
    # the evaluation saw the average, and training went on from the raw weights
    check = _classifier(layers=2)
    with torch.no_grad():
        for p, a in zip(check.parameters(), averaged):
            p.copy_(a)
        batch = _Images(8)
        expected = check(pixel_values=batch.pixels, labels=batch.labels).loss.item()
    assert loss == pytest.approx(expected, rel=1e-5)
    # at the end, the model holds the average (what the run saves and evaluates)
    for p, a in zip(trainer.ema.average.params, trainer.ema.average.averages):
        assert torch.equal(p, a)
    assert not (tmp_path / "midway" / EMA_FILE).exists()  # only checkpoints carry the EMA state


# ---------------------------------------------------------------------------------------------------------------------
# A run with the recipes


def test_named_recipes_set_the_flags_and_given_flags_win(tmp_path, capsys):
    from hf_vit.train.arguments import parse_args

    out = ["--output_dir", str(tmp_path)]
    model_args, data_args, args = parse_args(
        "finetune", out + ["--recipe", "deit", "--mixup_alpha", "0.3", "--per_device_train_batch_size", "16"]
    )
    assert (args.optim.value, args.weight_decay, args.lr_scheduler_type.value) == ("adamw_torch", 0.05, "cosine")
    assert (args.mixup_alpha, args.cutmix_alpha, args.ema_decay, args.label_smoothing_factor) == (
        0.3,
        1.0,
        0.99996,
        0.1,
    )
    assert model_args.drop_path_rate == 0.1 and data_args.rand_augment == "rand-m9-mstd0.5-inc1"
    assert (data_args.reprob, data_args.remode, data_args.recount) == (0.25, "pixel", 1)  # DeiT's random erasing
    _, data_args, _ = parse_args("finetune", out + ["--recipe", "deit", "--reprob", "0"])
    assert data_args.reprob == 0  # an explicit --reprob 0 wins
    assert args.learning_rate == pytest.approx(5e-4 * 16 / 512)  # DeiT's rule, at this run's global batch
    assert "mixup_alpha" in args.recipe_flags_given and "cutmix_alpha" not in args.recipe_flags_given
    _, _, args = parse_args("finetune", out + ["--recipe", "finetune", "--learning_rate=0.01", "--layer_decay", "0.8"])
    assert (args.learning_rate, args.layer_decay, args.warmup_steps) == (0.01, 0.8, 0.05)
    _, _, plain = parse_args("finetune", out)
    assert (plain.optim.value, plain.mixup_alpha, plain.ema_decay, plain.layer_decay) == ("sgd", 0.0, None, None)
    for argv, message in (
        (["--recipe", "mae"], "--recipe must be one of"),
        (["--layer_decay", "1.5"], "--layer_decay must be in"),
        (["--ema_decay", "1.0"], "--ema_decay must be in"),
        (["--ema_warmup", "True"], "--ema_warmup"),
        (["--mixup_prob", "0.5"], "--mixup_prob says how batches are mixed"),
        (["--mixup_alpha", "0.2", "--mixup_switch_prob", "0.3"], "--mixup_switch_prob chooses"),
        (["--cutmix_minmax", "0.6", "0.2"], "--cutmix_minmax"),
        (["--cutmix_minmax", "0.2", "0.4", "0.6"], "--cutmix_minmax takes two"),
        (["--rand_augment", "rand-m9-w0"], "weighted"),
        (["--reprob", "1.5"], r"--reprob is the probability of erasing an image: it must be in \[0, 1\]"),
        (["--reprob", "0.25", "--remode", "noise"], "--remode must be one of pixel, rand, const"),
        (["--reprob", "0.25", "--recount", "0"], "--recount is the largest number"),
        (["--recount", "2"], "--recount says how images are erased, but --reprob is 0"),
        (["--recipe", "deit", "--reprob", "0", "--remode", "rand"], "--remode says how images are erased"),
        (["--ema_decay", "0.9", "--load_best_model_at_end", "True", "--save_strategy", "epoch"], "load_best_model"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_args("finetune", out + argv)
    from hf_vit.train.training import train

    mpp = out + [
        "--objective",
        "mpp",
        "--recipe",
        "augreg",
        "--config_overrides",
        "hidden_size=32,num_hidden_layers=1",
    ]
    with pytest.raises(ValueError, match="--mixup_alpha, --rand_augment augment"):
        train("pretrain", *parse_args("pretrain", mpp + ["--image_size", "8", "--patch_size", "4"]))
    from hf_vit.train.recipes import refuse_augmentation

    # masked patch prediction would reconstruct the noise of the erased rectangles
    _, data_args, args = parse_args("pretrain", out + ["--objective", "mpp", "--reprob", "0.25"])
    with pytest.raises(ValueError, match=r"^--reprob augment\(s\) images .* --reprob 0"):
        refuse_augmentation("mpp", False, data_args.augmentation(), args.recipe_settings())
    with pytest.raises(SystemExit):
        parse_args("finetune", ["--help"])
    shown = capsys.readouterr().out
    for flag in (
        "--recipe", "--layer_decay", "--ema_decay", "--ema_warmup", "--mixup_alpha", "--cutmix_alpha",
        "--cutmix_minmax", "--mixup_prob", "--mixup_switch_prob", "--rand_augment", "--reprob", "--remode",
        "--recount",
    ):  # fmt: skip
        assert flag in shown, flag


def test_rand_augment_in_the_training_transform_is_seeded_per_example():
    from hf_vit import VisionTransformerImageProcessor
    from hf_vit.data.augment.train_transform import make_train_transform

    processor = VisionTransformerImageProcessor(size={"height": 16, "width": 16})
    images = [PIL.Image.fromarray(np.asarray(_image(24).permute(1, 2, 0))) for _ in range(4)]
    batch = {"image": images, "label": [0, 1, 2, 3]}
    plain = make_train_transform(processor, random_resized_crop=False, hflip=False, seed=0)(batch)
    augmented = make_train_transform(
        processor, random_resized_crop=False, hflip=False, seed=0, rand_augment="rand-m9-n3"
    )
    first, again = (
        augmented(batch),
        make_train_transform(processor, random_resized_crop=False, hflip=False, seed=0, rand_augment="rand-m9-n3")(
            batch
        ),
    )
    other = make_train_transform(processor, random_resized_crop=False, hflip=False, seed=1, rand_augment="rand-m9-n3")(
        batch
    )
    assert torch.equal(first["pixel_values"], again["pixel_values"])
    assert not torch.equal(first["pixel_values"], other["pixel_values"])
    assert not torch.equal(first["pixel_values"], plain["pixel_values"])
    assert first["pixel_values"].shape == plain["pixel_values"].shape


def test_measuring_a_train_split_sees_no_augmentation():
    """`measure_model` on the train split of data flags that carry the recipes' augmentations (their data source)
    measures the processor's pixels, as a plain evaluation of that split does: the same accuracy, twice."""
    from conftest import measure_model

    from hf_vit import VisionTransformerForImageClassification, VisionTransformerImageProcessor
    from hf_vit.data.datasets import DataSource
    from hf_vit.train.arguments import DataArguments

    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(tiny_config(image_size=16, patch_size=8, num_labels=10)).eval()
    with torch.no_grad():
        model.classifier.weight.normal_(0, 1.0)  # a head that is not zero, so that the pixels decide the predictions
    processor = VisionTransformerImageProcessor(size={"height": 16, "width": 16})
    augmented = DataArguments(rand_augment="rand-m9-n3-mstd0.5", reprob=1.0, max_train_samples=96).source()
    plain = measure_model(model, processor, DataSource(max_train_samples=96), split="train")
    measured = [measure_model(model, processor, augmented, split="train") for _ in range(2)]
    assert measured[0] == measured[1] == plain


def test_recipe_run_saves_the_average_and_resumes_bit_for_bit(tmp_path, caplog):
    """A fine-tuning run with every recipe part on (layer decay, EMA with warmup, Mixup and CutMix with label
    smoothing, RandAugment, the recipe's random erasing, dropout), checkpointed every 2 steps and evaluated every 3,
    killed after step 5 and resumed from checkpoint-4, ends as the uninterrupted run did, bit for bit. The two full
    runs train in this process (one torch thread, as the killed run in its own process), the killed one in a
    worker."""
    from test_training import WORKER, deterministic_finetune_args, pretrained_folder, run

    from hf_vit.train.arguments import parse_args
    from hf_vit.train.ema import EMA_FILE
    from hf_vit.train.training import train

    source = pretrained_folder(tmp_path / "pre")
    extra = ["--save_strategy", "steps", "--save_steps", "2", "--eval_strategy", "steps", "--eval_steps", "3"]
    extra += ["--random_resized_crop", "True", "--crop_scale_min", "0.5", "--hidden_dropout_prob", "0.1"]
    extra += ["--recipe", "finetune", "--learning_rate", "0.01", "--ema_decay", "0.8", "--ema_warmup", "True"]
    extra += ["--rand_augment", "rand-m9-mstd0.5-inc1", "--cutmix_minmax", "0.3", "0.7"]

    def flags(output_dir, *more):
        return deterministic_finetune_args(source, output_dir, 8, max_steps=8, extra=extra + list(more))

    def train_here(*args):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with caplog.at_level("INFO", logger="hf_vit"):
                train(args[0], *parse_args(args[0], list(args[1:])))
        finally:
            torch.set_num_threads(threads)

    out, killed = tmp_path / "straight", tmp_path / "killed"
    train_here(*flags(out))
    assert "Layer-wise learning-rate decay 0.65: layer 0: lr x 0.2746" in caplog.text  # 0.65^3, 2 blocks
    assert "Training with the recipe finetune (He et al. 2021" in caplog.text
    assert "learning_rate=0.01 (given on the command line)" in caplog.text
    # the saved model is the average; the last checkpoint holds the raw weights and the same average
    final = load_file(out / "model.safetensors")
    raw = load_file(out / "checkpoint-8" / "model.safetensors")
    average = load_file(out / "checkpoint-8" / EMA_FILE)
    assert average.keys() <= final.keys() and all(torch.equal(final[k], average[k]) for k in average)
    assert any(not torch.equal(final[k], raw[k]) for k in average)
    card = (out / "README.md").read_text()
    assert "Named recipe finetune (He et al. 2021" in card and "layer-wise learning-rate decay 0.65" in card
    assert "EMA of the weights (decay 0.8 with warmup" in card and "RandAugment rand-m9-mstd0.5-inc1" in card
    assert "random erasing 0.25 (pixel fill)" in card and "reprob=0.25, remode=pixel, recount=1" in card

    run([sys.executable, str(WORKER), *flags(killed, "--kill_at_step", "5")], expect=17)
    assert (killed / "checkpoint-4" / EMA_FILE).is_file() and not (killed / "checkpoint-6").exists()
    train_here(*flags(killed, "--resume_from_checkpoint", "True"))
    for name in ("model.safetensors", "checkpoint-8/model.safetensors", f"checkpoint-8/{EMA_FILE}"):
        first, again = load_file(out / name), load_file(killed / name)
        assert all(torch.equal(first[k], again[k]) for k in first), name
    history = [json.loads((folder / "trainer_state.json").read_text())["log_history"] for folder in (out, killed)]
    evaluated = [{e["step"]: e["eval_loss"] for e in h if "eval_loss" in e} for h in history]
    assert {3, 6} <= set(evaluated[0])
    assert all(evaluated[0][step] == evaluated[1][step] for step in evaluated[1] if step > 4)  # after resuming


@pytest.mark.parametrize("ema", [True, False])
def test_a_run_resumed_at_its_last_step_saves_the_uninterrupted_model(tmp_path, ema):
    """Resuming the checkpoint of the last step, which ends mid-epoch (3 steps of 2 per epoch), trains no step more:
    a killed run resumed there, and a finished run re-run with --resume_from_checkpoint True, save the same model."""
    import shutil

    from test_training import deterministic_finetune_args, pretrained_folder

    from hf_vit.train.arguments import parse_args
    from hf_vit.train.training import train

    source = pretrained_folder(tmp_path / "pre")
    extra = ["--save_strategy", "steps", "--save_steps", "1", "--learning_rate", "0.01"]
    extra += ["--ema_decay", "0.8"] if ema else []

    def run_into(output_dir, *more):
        flags = deterministic_finetune_args(source, output_dir, 8, max_steps=3, extra=extra + list(more))
        train(flags[0], *parse_args(flags[0], flags[1:]))

    out, cut = tmp_path / "straight", tmp_path / "cut"
    run_into(out)
    first = load_file(out / "model.safetensors")
    cut.mkdir()  # killed after its last checkpoint, before the final save
    shutil.copytree(out / "checkpoint-3", cut / "checkpoint-3")
    run_into(cut, "--resume_from_checkpoint", "True")
    run_into(out, "--resume_from_checkpoint", "True")  # the finished run, re-run
    for folder in (cut, out):
        again = load_file(folder / "model.safetensors")
        assert all(torch.equal(first[k], again[k]) for k in first), folder.name
        state = json.loads((folder / "trainer_state.json").read_text())
        assert state["global_step"] == 3
