"""Packed training batches with a fixed number of tokens (`hf_vit.data.packed_batches`): every batch is its rows of
patch slots, whole images in them, every image once an epoch, in batches drawn from the seed and the epoch, dealt out
whole to several processes."""

import io

import numpy as np
import PIL.Image
import pytest
import torch
from accelerate.data_loader import BatchSamplerShard

from hf_vit import VisionTransformerImageProcessor
from hf_vit.data.augment.train_transform import make_train_transform
from hf_vit.data.packed_batches import PackedBatchSampler, best_fit_decreasing, image_size, planned_patches
from hf_vit.data.transforms import collate_fn
from hf_vit.model.layout import slot_image_index
from hf_vit.train.trainer import SeededAugmentation

# Heights and widths of several aspect ratios: grids of 3 to 6 patches of 4 pixels at 6 patches an image.
SIZES = [(8, 8), (8, 24), (30, 10), (12, 20), (5, 40), (16, 12), (20, 20), (9, 30), (40, 8), (14, 14), (6, 18)]
ROWS, LENGTH, MOST = 3, 12, 6


def png(height, width, seed):
    buffer = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    PIL.Image.fromarray(pixels).save(buffer, format="PNG")
    return {"path": None, "bytes": buffer.getvalue()}


def training_split(copies=2):
    """Raw rows (encoded images, as a data set's after `apply_transforms`) and their seeded training split."""
    rows = [{"image": png(h, w, i), "label": i % 3} for i, (h, w) in enumerate(SIZES * copies)]
    processor = VisionTransformerImageProcessor(size=8, max_num_patches=MOST, patch_size=4)
    transform = make_train_transform(processor, scale=(0.3, 1.0), token_drop_rate=0.25)
    return rows, SeededAugmentation(rows, seed=0, transform=transform)


def epoch_batches(sampler, data, epoch):
    data.set_epoch(epoch)
    return list(sampler)


def test_every_batch_is_its_rows_of_slots_holding_each_image_of_the_epoch_once():
    rows, data = training_split()
    budgets, counts = planned_patches([row["image"] for row in rows], 4, MOST, token_drop_rate=0.25)
    sampler = PackedBatchSampler(counts, ROWS, LENGTH, seed=0, budgets=budgets, dataset=data)
    assert len(sampler) == -(-len(best_fit_decreasing(counts, LENGTH)) // ROWS) > 1
    plans = {}
    for epoch in (0, 1):
        batches = epoch_batches(sampler, data, epoch)
        plans[epoch] = [[key[0] for key in batch] for batch in batches]
        assert len(batches) == len(sampler)  # the same number every epoch: Trainer's epochs and resumption count
        indices = sorted(index for batch in plans[epoch] for index in batch)
        assert indices == list(range(len(rows)))  # each image once
        images = []
        for batch in batches:
            collated = collate_fn([data[key] for key in batch], packed_sequence_length=LENGTH, packed_rows=ROWS)
            # every batch is ROWS x LENGTH, the partial last one padded with empty rows (all -1)
            assert collated["pixel_values"].shape[:2] == (ROWS, LENGTH)
            assert len(collated["labels"]) == len(collated["spatial_shapes"]) == len(batch)
            used = (slot_image_index(collated["image_slot_index"], ROWS, LENGTH) >= 0).sum(1)
            assert used.max() <= LENGTH and (used > 0).sum() == len({key[2] for key in batch})
            images.append(len(batch))
        assert len(set(images)) > 1  # the number of images varies
        assert sum(images[:-1]) / (len(images) - 1) > ROWS * (LENGTH // MOST)  # more than one row of 6s each holds
    again = PackedBatchSampler(counts, ROWS, LENGTH, seed=0, budgets=budgets, dataset=data)
    assert [[key[0] for key in batch] for batch in epoch_batches(again, data, 1)] == plans[1]  # from the seed
    assert plans[0] != plans[1]  # and the epoch
    other = PackedBatchSampler(counts, ROWS, LENGTH, seed=1, budgets=budgets, dataset=data)
    assert [[key[0] for key in batch] for batch in epoch_batches(other, data, 1)] != plans[1]


def test_each_image_takes_at_most_its_planned_slots_whatever_its_crop():
    # a random crop is resized to at most the image's planned grid: the collator never finds a row overfull
    rows, data = training_split(copies=1)
    budgets, counts = planned_patches([row["image"] for row in rows], 4, MOST, token_drop_rate=0.25)
    processor = VisionTransformerImageProcessor(size=8, max_num_patches=MOST, patch_size=4)
    grids = processor([row["image"]["bytes"] for row in rows])["spatial_shapes"]
    assert budgets == [int(grid.prod()) for grid in grids]
    assert counts == [budget - budget // 4 for budget in budgets]
    for epoch in range(3):
        data.set_epoch(epoch)
        for index, (budget, count) in enumerate(zip(budgets, counts)):
            example = data[(index, budget, 0)]
            assert example["packed_row"] == 0
            assert int(example["spatial_shapes"].prod()) <= budget
            assert int((example["patch_positions"] >= 0).sum()) <= count


@pytest.mark.parametrize(("processes", "rows"), [(2, 3), (3, 1)])
def test_processes_train_disjoint_whole_batches_that_cover_the_epoch(processes, rows):
    rng = np.random.default_rng(0)
    counts = rng.integers(2, MOST + 1, 31).tolist()
    sampler = PackedBatchSampler(counts, rows, LENGTH, seed=0, num_processes=processes)
    assert len(sampler) % processes == 0
    # as accelerate deals a batch sampler's batches out (process r: the r-th of every `processes`)
    shards = [list(BatchSamplerShard(sampler, processes, rank)) for rank in range(processes)]
    assert len({len(shard) for shard in shards}) == 1 and sum(map(len, shards)) == len(sampler)
    seen = [key[0] for shard in shards for batch in shard for key in batch]
    assert sorted(seen) == list(range(len(counts)))  # disjoint, and every image
    for shard in shards:
        for batch in shard:
            assert batch and max(key[2] for key in batch) < rows
            for row in range(rows):
                assert sum(counts[index] for index, _, place in batch if place == row) <= LENGTH
    whole = PackedBatchSampler(counts, rows, LENGTH, seed=0, num_processes=processes, drop_partial=True)
    assert all(len({key[2] for key in batch}) == rows for batch in whole)  # --dataloader_drop_last: full ones only


def test_best_fit_decreasing_fills_the_same_bins_in_any_order():
    sizes = np.random.default_rng(1).integers(1, 13, 200).tolist()
    first = best_fit_decreasing(sizes, 12, range(200))
    again = best_fit_decreasing(sizes, 12, torch.randperm(200).tolist())
    assert sorted(index for row in first for index in row) == list(range(200))
    assert all(sum(sizes[i] for i in row) <= 12 for row in first)
    assert sorted(sorted(sizes[i] for i in row) for row in first) == sorted(sorted(sizes[i] for i in r) for r in again)
    assert len(first) <= 1.12 * sum(sizes) / 12 + 1


def test_image_sizes_are_read_from_headers_and_give_the_processors_grids(tmp_path, monkeypatch):
    rotated = tmp_path / "rotated.jpg"
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # stored 10 x 30, shown turned: 30 high, 10 wide
    PIL.Image.fromarray(np.zeros((10, 30, 3), np.uint8)).save(rotated, format="JPEG", exif=exif)
    array = np.zeros((7, 9, 3), np.uint8)
    encoded = png(12, 20, 0)
    monkeypatch.setattr(PIL.Image.Image, "load", lambda self: pytest.fail("decoded pixels to read a size"))
    assert image_size(str(rotated)) == image_size({"path": str(rotated), "bytes": None}) == (10, 30)
    assert image_size(encoded) == image_size(encoded["bytes"]) == (12, 20)
    monkeypatch.undo()
    assert image_size(array) == (7, 9)
    # the grid of the turned image is the stored one's transposed: the same number of patches
    processor = VisionTransformerImageProcessor(size=8, max_num_patches=MOST, patch_size=4)
    images = [str(rotated), array, encoded["bytes"]]
    grids = processor(images)["spatial_shapes"]
    assert grids[0].tolist() == [3, 1]  # upright: 30 high, 10 wide
    assert planned_patches(images, 4, MOST) == ([int(g.prod()) for g in grids], [int(g.prod()) for g in grids])
    with pytest.raises(ValueError, match="5 bytes of image data: not an image file PIL can read"):
        image_size(b"nope!")


def test_the_collator_packs_planned_rows_and_pads_the_batch_to_its_rows():
    rows, data = training_split(copies=1)
    keys = [(0, 4, 2), (1, 3, 0), (2, 3, 2), (3, 6, 0)]  # rows 0 and 2 planned, row 1 and 3 empty
    batch = collate_fn([data[key] for key in keys], packed_sequence_length=LENGTH, packed_rows=4)
    index = slot_image_index(batch["image_slot_index"], 4, LENGTH)
    assert batch["pixel_values"].shape[:2] == (4, LENGTH) and (index[1] == -1).all() and (index[3] == -1).all()
    assert [sorted(set(row.tolist()) - {-1}) for row in index] == [[1, 3], [], [0, 2], []]
    assert (batch["pixel_values"][index < 0] == 0).all()
    assert batch["labels"].tolist() == [0, 1, 2, 0]  # one per image, in the order given
    with pytest.raises(ValueError, match="each row at most `packed_sequence_length` = 12"):
        collate_fn([data[(index, 6, 0)] for index in (3, 4, 5)], packed_sequence_length=LENGTH, packed_rows=2)


def test_the_padding_shares_are_those_of_the_batches_the_run_builds():
    from hf_vit.data.packed_batches import padding_shares

    counts = [10, 4, 7, 16, 16, 3, 9]
    padded, packed = padding_shares(counts, 16, 3, 32, seed=0)
    order = torch.randperm(len(counts), generator=torch.Generator().manual_seed(0)).tolist()
    batches = [order[start : start + 3] for start in range(0, len(order), 3)]
    slots = sum(len(batch) * max(counts[i] for i in batch) for batch in batches)  # each batch padded to its largest
    assert padded == pytest.approx(1 - sum(counts) / slots)
    rows = best_fit_decreasing(counts, 32)
    assert packed == pytest.approx(1 - sum(counts) / (32 * len(rows)))
    assert padding_shares(counts, 16, 3, None)[1] is None


@pytest.mark.parametrize("packed_length", [None, 64])
def test_the_runs_padding_line_says_whether_packing_pays(packed_length):
    from hf_vit.data.packed_batches import padding_line
    from hf_vit.data.transforms import BatchSizes

    sizes = BatchSizes(max_num_patches=16, packed_sequence_length=packed_length)
    full, sparse = padding_line([16, 15, 16, 16], sizes, 4, 0), padding_line([16, 4, 6, 2], sizes, 4, 0)
    assert "would leave 2% of their patch slots empty" in full
    assert "would leave 56% of their patch slots empty" in sparse
    if packed_length is None:
        assert "packing would not pay" in full and "--packed_sequence_length would pay" in sparse
    else:
        assert "leave out --packed_sequence_length" in full and "packing pays" in sparse
    assert "from about 5% padding" in full and "When packing pays" in full  # not 15%
