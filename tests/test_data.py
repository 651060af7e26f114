import collections
import io
import time

import datasets
import huggingface_hub
import numpy as np
import PIL.Image
import pytest
import torch
from sklearn.datasets import load_digits

from hf_vit.data.augment.train_transform import draft_scale, make_train_transform, random_resized_crop_box
from hf_vit.data.datasets import DIGITS_SPLIT_SIZES, load_digits_dataset, load_image_dataset
from hf_vit.data.datasets import label_names as get_label_names
from hf_vit.data.transforms import CorruptImageError, apply_transforms, collate_fn, decode_rgb, make_eval_transform
from hf_vit.model.image_processing_vit import VisionTransformerImageProcessor, load_images, resize_images

SIZE = 16
COLORS = {"bird": (0, 0, 255), "cat": (255, 0, 0), "dog": (0, 255, 0)}
MODES = ["L", "RGBA", "P", "RGB"]


@pytest.fixture(scope="module")
def processor():
    return VisionTransformerImageProcessor(size={"height": SIZE, "width": SIZE})


@pytest.fixture(scope="module")
def digits():
    return load_digits_dataset()


def _key(image, label):
    return np.asarray(image).tobytes() + bytes([label])


def _colored_image(color, mode, size):
    image = PIL.Image.new("RGB", size, color)
    if mode == "P":
        return image.convert("P", palette=PIL.Image.Palette.ADAPTIVE)
    return image.convert(mode)


def _write_image_folder(root, sizes=((10, 12), (20, 7), (8, 8), (33, 17))):
    """Write root/<label>/<i>.png, each image uniformly its label's color, in varied modes and sizes."""
    for label, color in COLORS.items():
        (root / label).mkdir(parents=True)
        for i, (mode, size) in enumerate(zip(MODES, sizes)):
            _colored_image(color, mode, size).save(root / label / f"{i}.png")
    return root


def _color_name(pixel_values, processor):
    """Which of COLORS a transformed uniform image shows, by luma (grayscale copies of a color keep its luma)."""
    std, mean = torch.tensor(processor.image_std).view(3, 1, 1), torch.tensor(processor.image_mean).view(3, 1, 1)
    rgb = (pixel_values * std + mean).mean(dim=(-2, -1)) * 255
    luma = float(rgb @ torch.tensor([0.299, 0.587, 0.114]))
    return min(COLORS, key=lambda name: abs(np.dot(COLORS[name], [0.299, 0.587, 0.114]) - luma))


# ---------------------------------------------------------------------------------------------------------------------
# digits


def test_digits_splits_partition_the_data_set(digits):
    assert {split: len(ds) for split, ds in digits.items()} == DIGITS_SPLIT_SIZES
    assert sum(DIGITS_SPLIT_SIZES.values()) == 1797
    sk = load_digits()
    expected = collections.Counter(
        _key(np.rint(x * 255 / 16).astype(np.uint8), int(y)) for x, y in zip(sk.images, sk.target)
    )
    found = collections.Counter(_key(ex["image"], ex["label"]) for ds in digits.values() for ex in ds)
    assert found == expected  # together with the sizes: the splits are disjoint and cover every image


def test_digits_splits_are_stratified(digits):
    class_counts = np.bincount(load_digits().target)
    for split, ds in digits.items():
        counts = np.bincount(ds["label"], minlength=10)
        assert np.all(np.abs(counts - class_counts * len(ds) / 1797) <= 1), (split, counts)


def test_digits_features_and_images(digits):
    assert get_label_names(digits) == [str(d) for d in range(10)]
    assert isinstance(digits["train"].features["image"], datasets.Image)
    image = digits["train"][0]["image"]
    assert image.mode == "L" and image.size == (8, 8)
    pixels = np.stack([np.asarray(ex["image"]) for ex in digits["test"]])
    assert pixels.dtype == np.uint8 and pixels.min() == 0 and pixels.max() == 255


def test_digits_are_deterministic_and_seed_only_orders(digits):
    again = load_digits_dataset()
    reordered = load_digits_dataset(seed=1)
    for split in digits:
        assert again[split]["label"] == digits[split]["label"]
        assert [np.asarray(im).tobytes() for im in again[split]["image"]] == [
            np.asarray(im).tobytes() for im in digits[split]["image"]
        ]
        assert reordered[split]["label"] != digits[split]["label"]
        same = collections.Counter(_key(ex["image"], ex["label"]) for ex in digits[split])
        assert collections.Counter(_key(ex["image"], ex["label"]) for ex in reordered[split]) == same
    assert load_image_dataset("digits")["validation"]["label"] == digits["validation"]["label"]


# ---------------------------------------------------------------------------------------------------------------------
# local data sets


def test_image_folder_with_string_labels_mixed_sizes_and_modes(tmp_path, processor):
    root = _write_image_folder(tmp_path / "images")
    ds = load_image_dataset(str(root), validation_fraction=0.25, cache_dir=str(tmp_path / "cache"))
    assert set(ds) == {"train", "validation"}
    assert len(ds["train"]) + len(ds["validation"]) == 12 and len(ds["validation"]) == 3
    assert get_label_names(ds) == ["bird", "cat", "dog"]  # folder names, sorted
    assert ds["train"].column_names == ["image", "label"]
    all_examples = [ex for split in ds.values() for ex in split]
    assert {ex["image"].mode for ex in all_examples} == set(MODES)
    assert len({ex["image"].size for ex in all_examples}) == 4

    transformed = apply_transforms(ds, make_train_transform(processor, seed=0), make_eval_transform(processor))
    for split in ("train", "validation"):
        batch = collate_fn([transformed[split][i] for i in range(len(ds[split]))])
        assert batch["pixel_values"].shape == (len(ds[split]), 3, SIZE, SIZE)
        names = [get_label_names(ds)[label] for label in batch["labels"].tolist()]
        assert [_color_name(pixels, processor) for pixels in batch["pixel_values"]] == names  # labels match images


def test_the_carved_validation_split_does_not_depend_on_the_runs_seed(tmp_path):
    """The held-out images are the same whatever seed trains: evaluate and resize carve the run's validation split."""
    root = tmp_path / "images"
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(15):
            PIL.Image.new("RGB", (4, 4), (label == "a") * 200 + i).save(root / label / f"{i}.png")
    held_out = [
        sorted(
            _key(example["image"], example["label"])
            for example in load_image_dataset(str(root), seed=seed)["validation"]
        )
        for seed in (0, 1, 42)
    ]
    assert len(held_out[0]) == 3 and held_out[0] == held_out[1] == held_out[2]


def test_image_folder_with_split_directories(tmp_path):
    root = tmp_path / "images"
    _write_image_folder(root / "train")
    _write_image_folder(root / "test", sizes=[(9, 9)] * 4)
    ds = load_image_dataset(str(root), validation_fraction=0.25, seed=3, cache_dir=str(tmp_path / "cache"))
    assert {split: len(d) for split, d in ds.items()} == {"train": 9, "validation": 3, "test": 12}
    assert sorted(ds["validation"]["label"]) == [0, 1, 2]  # stratified: one image of each class
    again = load_image_dataset(str(root), validation_fraction=0.25, seed=3, cache_dir=str(tmp_path / "cache"))
    assert again["validation"]["label"] == ds["validation"]["label"]


def test_a_named_validation_split_the_data_set_lacks_is_refused_never_carved(tmp_path):
    # datasets names an image folder's `val` folder "validation": `--validation_split val` would find nothing, and
    # carving "validation" out of train instead would measure images unlike the ones the user held out
    root = tmp_path / "images"
    _write_image_folder(root / "train")
    _write_image_folder(root / "val", sizes=[(9, 9)] * 2)
    with pytest.raises(ValueError, match=r"no split 'val' .*names an image folder's `val` folder `validation`"):
        load_image_dataset(str(root), validation_split="val", cache_dir=str(tmp_path / "cache"))
    ds = load_image_dataset(str(root), cache_dir=str(tmp_path / "cache"))  # the default name finds it
    assert {split: len(d) for split, d in ds.items()} == {"train": 12, "validation": 6}
    with pytest.raises(ValueError, match="no split 'holdout'.*--test_split"):
        load_image_dataset(str(root), test_split="holdout", cache_dir=str(tmp_path / "cache"))


def test_save_to_disk_round_trip(tmp_path, digits):
    digits.save_to_disk(str(tmp_path / "digits"))
    loaded = load_image_dataset(str(tmp_path / "digits"))
    assert {split: len(d) for split, d in loaded.items()} == DIGITS_SPLIT_SIZES
    assert get_label_names(loaded) == get_label_names(digits)
    assert loaded["test"]["label"] == digits["test"]["label"]
    assert np.array_equal(np.asarray(loaded["test"][5]["image"]), np.asarray(digits["test"][5]["image"]))

    digits["validation"].save_to_disk(str(tmp_path / "single"))  # a lone Dataset is the train split
    single = load_image_dataset(str(tmp_path / "single"), validation_fraction=0.2)
    assert {split: len(d) for split, d in single.items()} == {"train": 144, "validation": 36}


def _saved(tmp_path, columns, features=None, name="custom"):
    path = str(tmp_path / name)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(columns, features=features)}).save_to_disk(path)
    return path


def test_custom_column_names_and_string_labels(tmp_path):
    images = [_colored_image(COLORS["cat"], "RGB", (6, 6))] * 6
    path = _saved(tmp_path, {"img": images, "species": ["dog", "cat", "dog", "bird", "cat", "dog"], "extra": [0] * 6})
    ds = load_image_dataset(path, image_column="img", label_column="species", validation_fraction=0.5)
    assert ds["train"].column_names == ["image", "label"]
    assert get_label_names(ds) == ["bird", "cat", "dog"]
    labels = sorted([*ds["train"]["label"], *ds["validation"]["label"]])
    assert labels == [0, 1, 1, 2, 2, 2]
    assert isinstance(ds["train"][0]["image"], PIL.Image.Image)


def test_integer_labels_without_names_get_numbers_as_names(tmp_path):
    images = [_colored_image(COLORS["dog"], "L", (5, 5))] * 4
    ds = load_image_dataset(_saved(tmp_path, {"image": images, "label": [0, 3, 1, 3]}), validation_fraction=0.25)
    assert get_label_names(ds) == ["0", "1", "2", "3"]


def test_missing_columns_error_lists_columns_and_flags(tmp_path):
    path = _saved(tmp_path, {"img": [_colored_image(COLORS["cat"], "RGB", (4, 4))], "target": [1]})
    with pytest.raises(ValueError) as info:
        load_image_dataset(path)
    message = str(info.value)
    for text in ("'image'", "'label'", "['img', 'target']", "--image_column_name", "--label_column_name"):
        assert text in message


def test_unknown_data_set_name_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.perf_counter()
    from hf_vit.hub_access import HubLookupError

    with pytest.raises(HubLookupError) as info:  # offline: one message, no retries
        load_image_dataset("nobody-here/no_such_image_dataset")
    assert time.perf_counter() - start < 10
    message = str(info.value)
    assert "'nobody-here/no_such_image_dataset'" in message and "'digits'" in message and "local" in message
    assert "HF_HUB_OFFLINE=1" in message
    assert info.value.__cause__ is not None


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_image_raises_naming_the_file(tmp_path, processor, damage):
    root = _write_image_folder(tmp_path / "images")
    bad = root / "cat" / "bad.png"
    if damage == "garbage":
        bad.write_bytes(b"this is not an image")
    else:
        _colored_image((1, 2, 3), "RGB", (64, 64)).save(bad)
        bad.write_bytes(bad.read_bytes()[:80])
    ds = load_image_dataset(str(root), validation_fraction=0.25, cache_dir=str(tmp_path / "cache"))
    transformed = apply_transforms(ds, make_train_transform(processor), make_eval_transform(processor))
    split = next(split for split in ds if any("bad.png" in (p or "") for p in _paths(ds[split])))
    index = _paths(ds[split]).index(str(bad))
    with pytest.raises(CorruptImageError, match="bad.png") as info:
        transformed[split][index]
    assert isinstance(info.value.__cause__, OSError)  # PIL's error, chained
    for transform in (make_train_transform(processor), make_eval_transform(processor)):
        batch = {"image": [_colored_image((0, 0, 0), "RGB", (4, 4)), {"path": str(bad), "bytes": None}]}
        with pytest.raises(CorruptImageError, match="image 1 of the batch"):
            transform(batch)
        with pytest.raises(CorruptImageError, match="20 bytes of image data") as bytes_info:
            transform({"image": [b"this is not an image"], "label": [0]})
        assert " object at 0x" not in str(bytes_info.value) and " object at 0x" not in str(info.value)


def test_an_image_of_nan_values_or_no_pixels_is_named(tmp_path, processor):
    """A float image holding NaN, in a folder a run reads, is refused naming its file (the processor named only its
    place in a batch); an image without pixels is refused as such, not by a parameter the user never passed."""
    from hf_vit.data.transforms import decode_image

    root = _write_image_folder(tmp_path / "images")
    PIL.Image.fromarray(np.full((6, 6), np.nan, dtype=np.float32), mode="F").save(root / "cat" / "nan.tiff")
    for transform in (make_train_transform(processor), make_eval_transform(processor)):
        batch = {"image": [{"path": str(root / "cat" / "0.png"), "bytes": None}, str(root / "cat" / "nan.tiff")]}
        with pytest.raises(CorruptImageError, match=r"nan.tiff \(image 1 of the batch\) contains NaN"):
            transform(batch)
    with pytest.raises(CorruptImageError, match="nan.tiff .*contains NaN or infinite"):
        decode_image(str(root / "cat" / "nan.tiff"))
    for empty in (np.zeros((0, 8, 3), dtype=np.uint8), torch.zeros(3, 8, 0)):
        with pytest.raises(CorruptImageError, match=r"image 2 of the batch\) has no pixels \(shape"):
            decode_image(empty, 2)
    assert decode_image(np.zeros((2, 2, 3), dtype=np.float32)).shape == (2, 2, 3)  # finite floats pass


def test_an_image_refused_in_a_dataloader_worker_is_one_error_line(tmp_path, processor, capsys):
    """A worker's error comes back with the worker's traceback as its message: the command prints the one line."""
    from hf_vit.flags import error_status

    root = _write_image_folder(tmp_path / "images")
    PIL.Image.fromarray(np.full((6, 6), np.nan, dtype=np.float32), mode="F").save(root / "cat" / "nan.tiff")
    ds = apply_transforms(
        load_image_dataset(str(root)), make_eval_transform(processor), make_eval_transform(processor)
    )
    loader = torch.utils.data.DataLoader(ds["train"], batch_size=16, num_workers=1, collate_fn=collate_fn)
    with pytest.raises(CorruptImageError) as info:
        next(iter(loader))
    assert "DataLoader worker" in str(info.value)
    capsys.readouterr()
    assert error_status(info.value) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert (
        line.startswith("error: Image ") and "nan.tiff (image " in line and line.endswith("numpy.nan_to_num) first.")
    )


def test_an_image_without_pixels_in_its_header_is_named(tmp_path, processor, monkeypatch):
    """A file whose header says 0 pixels wide is refused naming it, by the packing plan and by the training
    transform's JPEG road (not by a grid or a resize that never says which file it was)."""
    from hf_vit.data.packed_batches import planned_patches

    path = tmp_path / "empty.jpg"
    path.write_bytes(b"a JPEG header of 0x8 pixels")
    real_open = PIL.Image.open

    def open_empty(source, *args, **kwargs):
        name = getattr(source, "name", source)
        if str(name) != str(path) and not isinstance(source, io.BytesIO):
            return real_open(source, *args, **kwargs)
        image = PIL.Image.new("RGB", (0, 8))
        image.format = "JPEG"
        return image

    monkeypatch.setattr(PIL.Image, "open", open_empty)
    with pytest.raises(CorruptImageError, match=r"empty.jpg has no pixels \(0x8\)"):
        planned_patches([str(path)], 4, 16)
    native = VisionTransformerImageProcessor(size=16, max_num_patches=16, patch_size=4, do_center_crop=False)
    for transform in (make_train_transform(processor), make_train_transform(native)):
        with pytest.raises(CorruptImageError, match=r"empty.jpg \(image 0 of the batch\) has no pixels"):
            transform({"image": [str(path)], "label": [0]})


def _paths(ds):
    return [image["path"] for image in ds.cast_column("image", datasets.Image(decode=False))["image"]]


# ---------------------------------------------------------------------------------------------------------------------
# transforms


def _batch(digits, n=6):
    return digits["train"][:n]


def _bounds(processor):
    mean, std = torch.tensor(processor.image_mean), torch.tensor(processor.image_std)
    return ((0 - mean) / std).min().item() - 1e-5, ((1 - mean) / std).max().item() + 1e-5


def test_train_transform_shapes_and_ranges(digits, processor):
    out = make_train_transform(processor, hflip=False, seed=0)(_batch(digits))
    assert out["pixel_values"].shape == (6, 3, SIZE, SIZE) and out["pixel_values"].dtype == torch.float32
    assert out["labels"].dtype == torch.long and out["labels"].tolist() == _batch(digits)["label"]
    low, high = _bounds(processor)
    assert low <= out["pixel_values"].min() and out["pixel_values"].max() <= high
    assert out["pixel_values"].std() > 0.1
    grey = out["pixel_values"] * torch.tensor(processor.image_std).view(3, 1, 1)
    assert torch.allclose(grey[:, 0] + processor.image_mean[0], grey[:, 2] + processor.image_mean[2], atol=1e-5)


def test_train_transform_mixed_modes_and_sizes(processor):
    sizes = [(3, 9), (40, 11), (8, 8), (5, 5)]
    images = [_colored_image(COLORS["dog"], mode, size) for mode, size in zip(MODES, sizes)]
    out = make_train_transform(processor, seed=0)({"image": images, "label": [1, 2, 0, 1]})
    assert out["pixel_values"].shape == (4, 3, SIZE, SIZE)
    assert [_color_name(p, processor) for p in out["pixel_values"]] == ["dog"] * 4


def test_train_transform_randomness_and_seeding(digits, processor):
    batch = _batch(digits)
    transform = make_train_transform(processor, seed=0)
    first, second = transform(batch)["pixel_values"], transform(batch)["pixel_values"]
    assert not torch.equal(first, second)  # every call draws new crops
    assert torch.equal(make_train_transform(processor, seed=0)(batch)["pixel_values"], first)
    assert not torch.equal(make_train_transform(processor, seed=1)(batch)["pixel_values"], first)
    torch.manual_seed(5)
    unseeded = make_train_transform(processor)(batch)["pixel_values"]
    torch.manual_seed(5)
    assert torch.equal(make_train_transform(processor)(batch)["pixel_values"], unseeded)  # global RNG


def test_horizontal_flip_only_when_enabled(processor):
    image = PIL.Image.fromarray(np.tile(np.arange(0, 240, 30, dtype=np.uint8), (8, 1)))  # dark left, bright right
    batch = {"image": [image], "label": [0]}
    no_flip = make_train_transform(processor, random_resized_crop=False, hflip=False, seed=0)
    outputs = [no_flip(batch)["pixel_values"][0] for _ in range(20)]
    assert all(torch.equal(out, outputs[0]) for out in outputs)
    assert outputs[0][0, :, 0].mean() < outputs[0][0, :, -1].mean()  # still dark on the left
    flip = make_train_transform(processor, random_resized_crop=False, hflip=True, seed=0)
    flipped = [flip(batch)["pixel_values"][0] for _ in range(20)]
    assert all(torch.equal(out, outputs[0]) or torch.equal(out, outputs[0].flip(-1)) for out in flipped)
    assert 0 < sum(torch.equal(out, outputs[0]) for out in flipped) < 20


def test_random_resized_crop_box():
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        top, left, height, width = random_resized_crop_box(30, 50, (0.25, 0.5), (0.5, 2.0), generator)
        assert 0 <= top and top + height <= 30 and 0 <= left and left + width <= 50
        assert 0.2 <= height * width / 1500 <= 0.55 and 0.4 <= width / height <= 2.5
    # no crop of the whole area has an aspect ratio of 10..20: fall back to the central crop closest to it
    assert random_resized_crop_box(10, 10, (1.0, 1.0), (10.0, 20.0), generator) == (4, 0, 1, 10)
    with pytest.raises(ValueError):
        make_train_transform(VisionTransformerImageProcessor(), scale=(0.9, 0.1))


def test_eval_transform_matches_processor(digits, processor):
    batch = _batch(digits)
    out = make_eval_transform(processor)(batch)
    expected = processor([image.convert("RGB") for image in batch["image"]], return_tensors="pt")["pixel_values"]
    assert torch.equal(out["pixel_values"], expected)
    assert out["labels"].tolist() == batch["label"]
    assert torch.equal(make_eval_transform(processor)(batch)["pixel_values"], out["pixel_values"])


def test_with_transform_and_collate(digits, processor):
    train = digits["train"].with_transform(make_train_transform(processor, hflip=False))
    example = train[0]
    assert example["pixel_values"].shape == (3, SIZE, SIZE) and int(example["labels"]) == digits["train"][0]["label"]
    batch = collate_fn(train.__getitems__([0, 1, 2]))
    assert batch["pixel_values"].shape == (3, 3, SIZE, SIZE)
    assert batch["labels"].tolist() == digits["train"]["label"][:3]


# ---------------------------------------------------------------------------------------------------------------------
# streaming


def test_streaming_digits_yields_transformed_batches(digits, processor):
    stream = load_image_dataset("digits", streaming=True, shuffle_buffer_size=0)  # in order, to compare
    assert isinstance(stream, datasets.IterableDatasetDict) and get_label_names(stream) == get_label_names(digits)
    eval_transform = make_eval_transform(processor)
    mapped = stream["validation"].map(eval_transform, batched=True, batch_size=64, remove_columns=["image", "label"])
    loader = torch.utils.data.DataLoader(mapped, batch_size=50, collate_fn=collate_fn)
    batches = list(loader)
    assert [len(b["labels"]) for b in batches] == [50, 50, 50, 30]
    assert torch.cat([b["labels"] for b in batches]).tolist() == digits["validation"]["label"]
    expected = eval_transform(digits["validation"][:50])["pixel_values"]
    assert torch.allclose(batches[0]["pixel_values"], expected)

    transformed = apply_transforms(stream, make_train_transform(processor, hflip=False, seed=0), eval_transform)
    train_batch = next(iter(torch.utils.data.DataLoader(transformed["train"], batch_size=8, collate_fn=collate_fn)))
    assert train_batch["pixel_values"].shape == (8, 3, SIZE, SIZE)
    assert train_batch["labels"].tolist() == digits["train"]["label"][:8]


def test_streaming_image_folder_carves_validation(tmp_path, processor):
    root = _write_image_folder(tmp_path / "images")
    stream = load_image_dataset(str(root), streaming=True, validation_fraction=0.25, cache_dir=str(tmp_path / "c"))
    assert isinstance(stream["train"], datasets.IterableDataset) and set(stream) == {"train", "validation"}
    assert get_label_names(stream) == ["bird", "cat", "dog"]
    transformed = apply_transforms(stream, make_train_transform(processor, seed=0), make_eval_transform(processor))
    train, validation = list(transformed["train"]), list(transformed["validation"])
    assert (len(train), len(validation)) == (9, 3)
    assert all(ex["pixel_values"].shape == (3, SIZE, SIZE) for ex in train + validation)
    names = get_label_names(stream)
    for ex in train + validation:
        assert _color_name(ex["pixel_values"], processor) == names[int(ex["labels"])]


# ---------------------------------------------------------------------------------------------------------------------
# one pixel path: the transforms see what the processor sees


def _png_bytes(image):
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _awkward_images(tmp_path):
    """Images whose decoding or colour conversion is easy to get wrong, in the forms data sets hand them over."""
    rgba = np.zeros((20, 30, 4), np.uint8)
    rgba[..., 0] = 255  # red everywhere, hidden on the left by alpha 0
    rgba[:, 15:, 3] = 255
    rgba[:5, :, 3] = 128
    la = np.stack(
        [
            np.tile(np.arange(0, 240, 8, np.uint8), (20, 1)),
            np.tile(np.arange(20, dtype=np.uint8)[:, None] * 12, (1, 30)),
        ],
        -1,
    )
    palette = PIL.Image.fromarray(rgba[..., :3]).convert("P", palette=PIL.Image.Palette.ADAPTIVE, colors=4)
    palette.info["transparency"] = 0
    ramp = np.linspace(0, 65535, 20 * 30).round().astype(np.uint16).reshape(20, 30)
    photo = np.asarray(PIL.Image.effect_mandelbrot((30, 20), (-2, -1.2, 1, 1.2), 50).convert("RGB"))
    exif = PIL.Image.Exif()
    exif[0x0112] = 6
    rotated = tmp_path / "rotated.jpg"
    PIL.Image.fromarray(photo).save(rotated, format="JPEG", exif=exif)
    return {
        "RGBA with transparency": PIL.Image.fromarray(rgba, mode="RGBA"),
        "RGBA PNG bytes": _png_bytes(PIL.Image.fromarray(rgba, mode="RGBA")),
        "LA": PIL.Image.fromarray(la, mode="LA"),
        "P with transparency": palette,
        "P with transparency as PNG dict": {"path": None, "bytes": _png_bytes(palette)},
        "I;16 grayscale PNG": {"path": None, "bytes": _png_bytes(PIL.Image.fromarray(ramp))},
        "I": PIL.Image.fromarray(ramp.astype(np.int32)),
        "CMYK": PIL.Image.fromarray(photo).convert("CMYK"),
        "1-bit": PIL.Image.fromarray(photo).convert("1"),
        "EXIF-rotated JPEG path": str(rotated),
        "EXIF-rotated JPEG dict": {"path": str(rotated), "bytes": None},
        "EXIF-rotated JPEG bytes": rotated.read_bytes(),
        "EXIF-rotated opened JPEG": PIL.Image.open(rotated),
    }


def _processor_input(image):
    return image["bytes"] or image["path"] if isinstance(image, dict) else image


@pytest.mark.parametrize(
    "options", [{}, {"size": (12, 20), "resample": "bicubic"}, {"size": 20, "do_center_crop": True, "crop_size": 14}]
)
def test_transforms_give_exactly_the_processors_pixels(tmp_path, options):
    processor = VisionTransformerImageProcessor(**{"size": SIZE, **options})
    images = _awkward_images(tmp_path)
    eval_transform = make_eval_transform(processor)
    whole_image = make_train_transform(processor, random_resized_crop=False, hflip=False)
    for kind, image in images.items():
        expected = processor(_processor_input(image), return_tensors="pt")["pixel_values"]
        for name, transform in (("eval", eval_transform), ("train without crop and flip", whole_image)):
            actual = transform({"image": [image], "label": [0]})["pixel_values"]
            assert torch.equal(actual, expected), f"{name}: {kind}"  # same uint8 resize: no tolerance needed
    batch = {"image": list(images.values()), "label": [0] * len(images)}  # all at once, mixed modes and sizes
    expected = processor([_processor_input(image) for image in images.values()], return_tensors="pt")
    assert torch.equal(eval_transform(batch)["pixel_values"], expected["pixel_values"])
    assert torch.equal(whole_image(batch)["pixel_values"], expected["pixel_values"])


def test_awkward_images_have_the_expected_pixels(tmp_path):
    processor = VisionTransformerImageProcessor(do_resize=False, do_normalize=False)
    images = _awkward_images(tmp_path)
    transform = make_train_transform(processor, random_resized_crop=False, hflip=False)

    def pixels(kind):
        return transform({"image": [images[kind]]})["pixel_values"][0]

    rgba = pixels("RGBA with transparency")
    assert torch.equal(rgba[:, 10, :15], torch.ones(3, 15))  # fully transparent red is white, not red
    assert torch.equal(rgba[:, 10, 15:], torch.tensor([1.0, 0, 0])[:, None].expand(3, 15))
    assert torch.equal(pixels("RGBA PNG bytes"), rgba)
    as_rgb = np.asarray(decode_rgb(images["RGBA PNG bytes"]))
    assert as_rgb.shape == (20, 30, 3) and as_rgb[10, 0].tolist() == [255, 255, 255]
    grey16 = pixels("I;16 grayscale PNG")
    assert grey16.min() == 0 and grey16.max() == 1 and abs(grey16.mean() - 0.5) < 0.01  # scaled, not clipped
    assert torch.equal(pixels("I"), grey16)
    upright = pixels("EXIF-rotated JPEG path")
    assert upright.shape == (3, 30, 20)  # orientation 6 turns the 30x20 photo upright
    for kind in ("EXIF-rotated JPEG dict", "EXIF-rotated JPEG bytes", "EXIF-rotated opened JPEG"):
        assert torch.equal(pixels(kind), upright), kind


def test_random_crop_is_cut_from_the_processors_pixels(tmp_path):
    processor = VisionTransformerImageProcessor(size=SIZE)
    image = _awkward_images(tmp_path)["RGBA with transparency"]
    out = make_train_transform(processor, hflip=False, seed=3)({"image": [image]})["pixel_values"]
    top, left, height, width = random_resized_crop_box(20, 30, generator=torch.Generator().manual_seed(3))
    rgb = np.asarray(PIL.Image.alpha_composite(PIL.Image.new("RGBA", image.size, "white"), image).convert("RGB"))
    expected = processor(rgb[top : top + height, left : left + width], return_tensors="pt")["pixel_values"]
    assert torch.equal(out, expected)


# ---------------------------------------------------------------------------------------------------------------------
# the JPEG road of the training transform: the same crop, decoded at a reduced scale when it is large enough


def _jpeg_photo(size, exif_orientation=None):
    """A real photograph (scikit-learn's sample) resized to `size` (width, height), as JPEG bytes."""
    from sklearn.datasets import load_sample_images

    photo = PIL.Image.fromarray(load_sample_images().images[0]).resize(size, PIL.Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    exif = PIL.Image.Exif()
    if exif_orientation:
        exif[0x0112] = exif_orientation
    photo.save(buffer, format="JPEG", quality=90, exif=exif)
    return buffer.getvalue()


def _reference_crop(data, box, size):
    """The processor's pixels of `box` (top, left, height, width): full-size decode, crop, uint8 resize."""
    (pixels,) = load_images(data)
    top, left, height, width = box
    return resize_images(pixels[None, :, top : top + height, left : left + width], size)[0]


def test_draft_scale_keeps_the_crop_at_or_above_the_output_size():
    assert draft_scale(427, 640, (224, 224)) == 1  # a 640x427 photo never decodes reduced at 224
    assert draft_scale(448, 448, (224, 224)) == 2 and draft_scale(447, 900, (224, 224)) == 1
    assert draft_scale(1800, 1792, (224, 224)) == 8 and draft_scale(1000, 2000, (224, 224)) == 4


@pytest.mark.parametrize("orientation", [None, 6])
def test_jpeg_road_gives_the_same_crop_as_the_processor(orientation):
    # Same random draws as cropping the processor's full-size pixels; exactly its pixels without a reduction, and
    # within a stated tolerance with one: each crop's mean absolute difference <= 3 grey levels (of 255), <= 1.5 on
    # average, from the DCT-domain downscaling.
    size = (224, 224)
    processor = VisionTransformerImageProcessor(size=224)
    data = _jpeg_photo((1280, 960), orientation)
    (full,) = load_images(data)
    height, width = full.shape[1:]
    generator = torch.Generator().manual_seed(0)
    differences = collections.defaultdict(list)
    for seed in range(24):
        transform = make_train_transform(processor, hflip=False, seed=seed)
        got = transform({"image": [{"path": None, "bytes": data}]})["pixel_values"][0]
        box = random_resized_crop_box(height, width, generator=generator.manual_seed(seed))
        expected = processor.normalize_batch(_reference_crop(data, box, size)[None])[0]
        step = 1 / 255 / torch.tensor(processor.image_std).view(3, 1, 1)  # one grey level, normalised
        levels = ((got - expected) / step).abs()
        factor = draft_scale(box[2], box[3], size)
        if factor == 1:
            assert torch.allclose(got, expected, atol=1e-6), box
        differences[factor].append(levels.mean().item())
    assert set(differences) >= {1, 2, 4}  # every road taken
    reduced = differences[2] + differences[4] + differences[8]
    assert max(reduced) <= 3 and sum(reduced) / len(reduced) <= 1.5, differences


def test_jpeg_road_draws_like_the_processors_road():
    # A JPEG and the same pixels as PNG go different roads but make the same random draws (crop box, then flip).
    processor = VisionTransformerImageProcessor(size=32)
    data = _jpeg_photo((64, 48))
    png = _png_bytes(PIL.Image.open(io.BytesIO(data)))
    outputs = [
        make_train_transform(processor, seed=seed)({"image": [image]})["pixel_values"]
        for image in (data, png, {"path": None, "bytes": data})
        for seed in range(4)
    ]
    for seed in range(4):
        assert torch.equal(outputs[seed], outputs[4 + seed]) and torch.equal(outputs[seed], outputs[8 + seed])
    batch = {"image": [data, png, {"path": None, "bytes": data}], "label": [0, 1, 2]}
    torch.manual_seed(7)
    first = make_train_transform(processor)(batch)["pixel_values"]
    torch.manual_seed(7)
    assert torch.equal(make_train_transform(processor)(batch)["pixel_values"], first)  # global generator


def test_jpeg_road_grey_and_truncated(tmp_path):
    processor = VisionTransformerImageProcessor(size=32)
    grey = PIL.Image.open(io.BytesIO(_jpeg_photo((600, 400)))).convert("L")
    path = tmp_path / "grey.jpg"
    grey.save(path)
    out = make_train_transform(processor, seed=0)({"image": [str(path)]})["pixel_values"]
    assert out.shape == (1, 3, 32, 32) and torch.equal(out[0, 0], out[0, 1])  # grey expanded after resizing
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(_jpeg_photo((600, 400))[:3000])
    with pytest.raises(CorruptImageError, match="truncated.jpg"):
        make_train_transform(processor, seed=0)({"image": [{"path": str(truncated), "bytes": None}]})


# ---------------------------------------------------------------------------------------------------------------------
# streaming order and label edges


def _class_folder(root, per_class=12):
    for label in ("a", "b", "c"):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            PIL.Image.new("L", (4, 4), 10 * i).save(root / label / f"{i:02d}.png")
    return root


def test_a_streamed_image_folder_is_shuffled_and_reshuffled_each_epoch(tmp_path):
    folder = str(_class_folder(tmp_path / "folder"))
    ds = load_image_dataset(folder, streaming=True, validation_fraction=0.25, seed=3, shuffle_buffer_size=64)
    train = ds["train"]
    first = [row["label"] for row in train]
    assert len(first) == 27 and sorted(first) == [0] * 9 + [1] * 9 + [2] * 9
    assert first != sorted(first)  # read from the folder, it came class after class
    assert set(first[:9]) != {0}
    again = [row["label"] for row in ds["train"]]
    assert again == first  # the same seed and epoch: the same order
    train.set_epoch(1)  # what Trainer does at each epoch's start
    second = [row["label"] for row in train]
    assert sorted(second) == sorted(first) and second != first
    unshuffled = load_image_dataset(folder, streaming=True, validation_fraction=0.25, shuffle_buffer_size=0)
    assert [row["label"] for row in unshuffled["train"]] == sorted(first)
    with pytest.raises(ValueError, match="--shuffle_buffer_size"):
        load_image_dataset(folder, streaming=True, shuffle_buffer_size=-1)


def test_in_memory_data_streamed_is_shuffled_with_the_seed(digits):
    ordered = load_image_dataset("digits", streaming=True, shuffle_buffer_size=0)
    shuffled = load_image_dataset("digits", streaming=True, shuffle_buffer_size=100, seed=0)
    take = [row["label"] for row in shuffled["train"].take(50)]
    assert take != [row["label"] for row in ordered["train"].take(50)]
    assert take == [
        row["label"]
        for row in load_image_dataset("digits", streaming=True, seed=0, shuffle_buffer_size=100)["train"].take(50)
    ]


def test_a_negative_class_id_is_refused_not_read_as_the_last_class(tmp_path):
    images = [_colored_image(COLORS["dog"], "L", (5, 5))] * 4
    lists = _saved(tmp_path, {"image": images, "label": [[0], [1, -1], [2], []]}, name="lists")
    with pytest.raises(ValueError, match="negative class id -1"):
        load_image_dataset(lists, validation_fraction=0.25)
    single = _saved(tmp_path, {"image": images, "label": [0, 1, -1, 2]}, name="single")
    with pytest.raises(ValueError, match="negative class id -1"):
        load_image_dataset(single, validation_fraction=0.25)


def test_multi_hot_refuses_class_ids_outside_the_classes():
    from hf_vit.data.datasets import to_multi_hot

    features = datasets.Features({"label": datasets.List(datasets.Value("int64"))})
    ds = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"label": [[0], [2, -1]]}, features=features)})
    with pytest.raises(ValueError, match=r"class id\(s\) \[-1\], outside 0..2"):
        to_multi_hot(ds, 3)
    good = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"label": [[0], [2, 1]]}, features=features)})
    assert to_multi_hot(good, 3)["train"]["label"] == [[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]


@pytest.mark.parametrize("streaming", [False, True])
def test_an_image_folder_of_one_class_is_refused_as_one_class(tmp_path, streaming):
    from hf_vit.tasks.objectives import OBJECTIVES

    (tmp_path / "images" / "cat").mkdir(parents=True)
    for i in range(4):
        PIL.Image.new("RGB", (8, 8), (60 * i, 0, 0)).save(tmp_path / "images" / "cat" / f"{i}.png")
    ds = load_image_dataset(str(tmp_path / "images"), streaming=streaming, cache_dir=str(tmp_path / "cache"))
    assert get_label_names(ds) == ["cat"]
    with pytest.raises(ValueError, match=r"1 class\(es\) \(\['cat'\]\): classification needs at least two"):
        OBJECTIVES["classification"].labels(ds)


class _Draws:
    """A data set whose examples are random draws from the global stream (as an augmentation's are)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(3)


def test_a_seeded_example_reseeds_the_cpu_generator_only(monkeypatch):
    """Each example's augmentation is seeded on the CPU generator, which fork_rng restores; reseeding every
    accelerator's generator too (torch.manual_seed) cost milliseconds an example and, with CUDA up, would reset the
    training stream's dropout at every example."""
    from hf_vit.train.trainer import SeededAugmentation

    def refuse(seed):
        raise AssertionError("an accelerator's generator was reseeded")

    for device in ("cuda", "xpu", "mtia"):
        monkeypatch.setattr(getattr(torch, device), "manual_seed_all", refuse)
    data = SeededAugmentation(_Draws(), seed=0)
    torch.default_generator.manual_seed(7)
    expected = torch.rand(1)
    torch.default_generator.manual_seed(7)
    first, again, other = data[2], data[2], data[1]
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(torch.rand(1), expected)  # the training process's own stream is left where it was
