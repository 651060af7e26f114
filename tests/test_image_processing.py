"""Tests of VisionTransformerImageProcessor: parity with transformers' PIL processor, input kinds, options, errors."""

import ast
import importlib.util
import io
import json
import logging
import pathlib
import sys

import numpy as np
import PIL.Image
import pytest
import torch
from sklearn.datasets import load_sample_images
from transformers import BatchFeature, ViTConfig, ViTForImageClassification, ViTImageProcessorPil, pipeline
from transformers.image_utils import PILImageResampling

from hf_vit.model import image_geometry, image_processing_vit
from hf_vit.model.image_processing_vit import (
    VisionTransformerImageProcessor,
    center_crop_images,
    rescale_and_normalize,
    resize_images,
)

MODULE_PATH = pathlib.Path(image_processing_vit.__file__)
GEOMETRY_PATH = MODULE_PATH.with_name("image_geometry.py")
LAYOUT_PATH = MODULE_PATH.with_name("layout.py")


@pytest.fixture(scope="module")
def photos() -> list[np.ndarray]:
    """The two 427x640 sklearn sample photos and crops of them at other sizes and aspect ratios."""
    china, flower = load_sample_images().images
    crops = [
        china,
        flower,
        china[50:250, 100:500],  # 200x400, wide
        flower[:427, 200:427],  # 427x227, tall
        china[100:340, 300:540],  # 240x240, barely downscaled
        flower[150:230, 250:310],  # 80x60, upscaled
    ]
    return [crop.copy() for crop in crops]  # sklearn's arrays are read-only


@pytest.fixture(scope="module")
def photo(photos) -> np.ndarray:
    return photos[2]


def pixel_mad(ours: np.ndarray | torch.Tensor, theirs: np.ndarray | torch.Tensor, scale: float = 1.0):
    """Mean and max absolute difference, divided by `scale` to express them in [0, 1] pixel units."""
    diff = np.abs(np.asarray(ours, dtype=np.float64) - np.asarray(theirs, dtype=np.float64)) / scale
    return diff.mean(), diff.max()


def process(images, **kwargs) -> np.ndarray:
    return VisionTransformerImageProcessor()(images, return_tensors="np", **kwargs)["pixel_values"]


@pytest.mark.parametrize("do_normalize", [True, False], ids=["normalized", "unnormalized"])
@pytest.mark.parametrize(
    "resample", [PILImageResampling.BILINEAR, PILImageResampling.BICUBIC], ids=["bilinear", "bicubic"]
)
def test_parity_with_transformers_pil_processor(photos, resample, do_normalize):
    ours = VisionTransformerImageProcessor(resample=resample, do_normalize=do_normalize)
    theirs = ViTImageProcessorPil(resample=resample, do_normalize=do_normalize)
    # With mean = std = 0.5 a normalised difference is twice the difference in [0, 1] pixel units.
    scale = 2.0 if do_normalize else 1.0
    for array in photos:
        image = PIL.Image.fromarray(array)
        expected = theirs(image, return_tensors="pt")["pixel_values"]
        actual = ours(image, return_tensors="pt")["pixel_values"]
        assert actual.shape == expected.shape == (1, 3, 224, 224)
        mad, max_diff = pixel_mad(actual, expected, scale)
        print(
            f"{resample.name} normalize={do_normalize} {array.shape[:2]}: "
            f"MAD={mad * 255:.4f}/255 max={max_diff * 255:.2f}/255"
        )
        assert mad <= 1 / 255
        assert max_diff <= (1.01 if resample == PILImageResampling.BILINEAR else 8) / 255


def test_float_resize_path_rounds_uint8_like_pil(photos, monkeypatch):
    """Without torch's CPU uint8 kernels (e.g. on GPU), uint8 images are resized in float, then rounded like PIL."""
    monkeypatch.setattr(image_geometry, "_has_uint8_kernel", lambda device: False)
    processor = VisionTransformerImageProcessor(do_normalize=False)
    theirs = ViTImageProcessorPil(do_normalize=False)
    for array in photos:
        expected = theirs(PIL.Image.fromarray(array), return_tensors="np")["pixel_values"]
        rounded = processor(array, return_tensors="np")["pixel_values"]
        unrounded = processor(array.astype(np.float32), return_tensors="np")["pixel_values"]
        mad, max_diff = pixel_mad(rounded, expected)
        unrounded_mad, unrounded_max = pixel_mad(unrounded, expected)
        print(
            f"float path {array.shape[:2]}: rounded MAD={mad * 255:.4f}/255 max={max_diff * 255:.2f}/255, "
            f"unrounded MAD={unrounded_mad * 255:.4f}/255 max={unrounded_max * 255:.2f}/255"
        )
        np.testing.assert_allclose(rounded * 255, np.round(rounded * 255), atol=1e-4)  # whole grey levels
        assert mad <= 1 / 255 and max_diff <= 1.01 / 255
        assert mad < unrounded_mad


def test_input_kinds_match_the_pil_path(photo, tmp_path):
    expected = process(PIL.Image.fromarray(photo))
    png = io.BytesIO()
    PIL.Image.fromarray(photo).save(png, format="PNG")
    path = tmp_path / "photo.png"
    path.write_bytes(png.getvalue())
    chw = np.ascontiguousarray(photo.transpose(2, 0, 1))
    exact = {
        "numpy HWC uint8": photo,
        "numpy CHW uint8": chw,
        "numpy CHW strided view": photo.transpose(2, 0, 1),
        "numpy read-only": np.frombuffer(photo.tobytes(), np.uint8).reshape(photo.shape),
        "numpy flipped twice": photo[::-1][::-1],
        "numpy NHWC batch": photo[None],
        "torch CHW uint8": torch.from_numpy(chw),
        "torch HWC uint8": torch.from_numpy(photo),
        "torch NCHW batch": torch.from_numpy(chw)[None],
        "list of one": [photo],
        "bytes": png.getvalue(),
        "path str": str(path),
        "pathlib path": path,
    }
    for kind, image in exact.items():
        np.testing.assert_allclose(process(image), expected, atol=1e-6, err_msg=kind)
    # Float images skip PIL's uint8 rounding, so they differ by less than one grey level.
    for kind, image in {
        "numpy HWC float in [0, 1]": photo.astype(np.float32) / 255,
        "torch CHW float64 in [0, 1]": torch.from_numpy(chw).double() / 255,
        "numpy big-endian float64 in [0, 1]": (photo / 255).astype(">f8"),
    }.items():
        mad, max_diff = pixel_mad(process(image, do_rescale=False), expected, scale=2.0)
        assert mad <= 0.5 / 255 and max_diff <= 1 / 255, kind


def test_mixed_sizes_and_kinds_in_one_list(photos):
    images = [photos[2], PIL.Image.fromarray(photos[3]), torch.from_numpy(photos[4]).permute(2, 0, 1), photos[5]]
    batch = process(images)
    assert batch.shape == (4, 3, 224, 224)
    for image, row in zip(images, batch):
        np.testing.assert_allclose(row, process(image)[0], atol=1e-6)
    nested = process([[photos[2], photos[3]], (photos[4],)])
    np.testing.assert_allclose(nested, batch[:3], atol=1e-6)


@pytest.mark.parametrize("mode", ["L", "P", "CMYK", "1"])
def test_modes_without_transparency_match_pil_convert_rgb(photo, mode):
    image = PIL.Image.fromarray(photo).convert(mode)
    batch = process(image)
    assert batch.shape == (1, 3, 224, 224)
    np.testing.assert_allclose(batch, process(image.convert("RGB")), atol=1e-6)


def test_grayscale_arrays_are_expanded_to_rgb(photo):
    grey = np.array(PIL.Image.fromarray(photo).convert("L"))
    expected = process(PIL.Image.fromarray(grey).convert("RGB"))
    for image in (grey, grey[..., None], grey[None], torch.from_numpy(grey)):
        np.testing.assert_allclose(process(image), expected, atol=1e-6)


def test_sixteen_bit_grey_is_scaled_not_clipped(photo):
    grey = np.array(PIL.Image.fromarray(photo).convert("L"))
    image = PIL.Image.fromarray(grey.astype(np.uint16) * 257)
    assert image.mode.startswith("I;16")
    np.testing.assert_allclose(process(image), process(PIL.Image.fromarray(grey)), atol=1e-6)


def test_transparency_is_composited_onto_white_like_transformers(photo):
    rgba = np.concatenate([photo, np.full(photo.shape[:2] + (1,), 255, np.uint8)], axis=-1)
    opaque = PIL.Image.fromarray(rgba, mode="RGBA")
    np.testing.assert_allclose(process(opaque), process(opaque.convert("RGB")), atol=1e-6)

    rgba[..., 3] = np.linspace(0, 255, photo.shape[1], dtype=np.uint8)  # transparent left, opaque right
    image = PIL.Image.fromarray(rgba, mode="RGBA")
    white = PIL.Image.alpha_composite(PIL.Image.new("RGBA", image.size, (255,) * 4), image).convert("RGB")
    expected = process(white)
    np.testing.assert_allclose(process(image), expected, atol=1e-6)
    theirs = ViTImageProcessorPil(do_convert_rgb=True)(image, return_tensors="np")["pixel_values"]
    mad, _ = pixel_mad(process(image), theirs, 2.0)
    assert mad <= 1 / 255
    # Arrays and tensors are composited in float and rounded, so they may differ from PIL by one grey level.
    for array in (rgba, torch.from_numpy(rgba).permute(2, 0, 1), rgba.astype(np.float32) / 255):
        do_rescale = array.dtype != np.float32
        mad, max_diff = pixel_mad(process(array, do_rescale=do_rescale), expected, 2.0)
        assert mad <= 0.5 / 255 and max_diff <= 2 / 255
    for mode in ("LA", "PA"):
        converted = image.convert(mode)
        assert process(converted).shape == (1, 3, 224, 224)


def test_center_crop_matches_transformers(photos, photo):
    ours = VisionTransformerImageProcessor(size=256, do_center_crop=True, crop_size=224)
    theirs = ViTImageProcessorPil(size={"height": 256, "width": 256}, do_center_crop=True, crop_size=224)
    for array in photos[:3]:
        image = PIL.Image.fromarray(array)
        actual = ours(image, return_tensors="np")["pixel_values"]
        assert actual.shape == (1, 3, 224, 224)
        assert pixel_mad(actual, theirs(image, return_tensors="np")["pixel_values"], 2.0)[0] <= 1 / 255
    # Without resizing, crops larger than the image zero-pad it exactly like transformers (odd margins included).
    small = PIL.Image.fromarray(photo[:61, :90])
    for crop in ({"height": 64, "width": 87}, {"height": 50, "width": 95}, {"height": 70, "width": 101}):
        kwargs = dict(do_resize=False, do_center_crop=True, crop_size=crop)
        expected = ViTImageProcessorPil(**kwargs)(small, return_tensors="np")["pixel_values"]
        np.testing.assert_allclose(process(small, **kwargs), expected, atol=1e-6)


def test_non_square_size_matches_transformers(photos):
    size = {"height": 160, "width": 224}
    theirs = ViTImageProcessorPil(size=size)
    for processor in (VisionTransformerImageProcessor(size=(160, 224)), VisionTransformerImageProcessor(size=size)):
        for array in photos[:3]:
            image = PIL.Image.fromarray(array)
            actual = processor(image, return_tensors="pt")["pixel_values"]
            assert actual.shape == (1, 3, 160, 224)
            assert pixel_mad(actual, theirs(image, return_tensors="pt")["pixel_values"], 2.0)[0] <= 1 / 255


def test_per_call_overrides(photo):
    processor = VisionTransformerImageProcessor()
    default = processor(photo, return_tensors="pt")["pixel_values"]
    assert processor(photo, size=96, return_tensors="pt")["pixel_values"].shape == (1, 3, 96, 96)
    assert processor(photo, size=(64, 48), return_tensors="pt")["pixel_values"].shape == (1, 3, 64, 48)
    unnormalised = processor(photo, do_normalize=False, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(unnormalised, default * 0.5 + 0.5)
    raw = processor(photo, do_rescale=False, do_normalize=False, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(raw, unnormalised * 255)
    assert torch.equal(raw, raw.round())
    imagenet = processor(photo, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225], return_tensors="pt")
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    torch.testing.assert_close(imagenet["pixel_values"], (unnormalised - mean[:, None, None]) / std[:, None, None])
    bicubic = processor(photo, resample="bicubic", return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(bicubic, processor(photo, resample=3, return_tensors="pt")["pixel_values"])
    assert not torch.equal(bicubic, default)
    nearest = processor(photo, resample=PILImageResampling.NEAREST, do_normalize=False, return_tensors="pt")
    expected = np.asarray(PIL.Image.fromarray(photo).resize((224, 224), PIL.Image.Resampling.NEAREST))
    np.testing.assert_allclose(nearest["pixel_values"][0].permute(1, 2, 0).numpy() * 255, expected, atol=1e-4)
    unresized = processor(photo, do_resize=False, return_tensors="pt")["pixel_values"]
    assert unresized.shape == (1, 3, *photo.shape[:2])
    on_cpu = processor(photo, device="cpu", return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(on_cpu, default)
    # Overrides are per call only.
    torch.testing.assert_close(processor(photo, return_tensors="pt")["pixel_values"], default)


def test_init_overrides(photo):
    processor = VisionTransformerImageProcessor(size=96, do_normalize=False, resample="bicubic")
    assert processor.size == {"height": 96, "width": 96} and processor.resample == PILImageResampling.BICUBIC
    expected = VisionTransformerImageProcessor()(photo, size=96, do_normalize=False, resample=3, return_tensors="pt")
    torch.testing.assert_close(processor(photo, return_tensors="pt")["pixel_values"], expected["pixel_values"])


def test_return_tensors(photos):
    processor = VisionTransformerImageProcessor()
    pt = processor(images=photos[:2], return_tensors="pt")
    assert isinstance(pt, BatchFeature) and list(pt.keys()) == ["pixel_values"]
    assert isinstance(pt["pixel_values"], torch.Tensor) and pt["pixel_values"].dtype == torch.float32
    assert pt["pixel_values"].shape == (2, 3, 224, 224) and pt["pixel_values"].is_contiguous()
    np_batch = processor(photos[:2], return_tensors="np")["pixel_values"]
    assert isinstance(np_batch, np.ndarray) and np_batch.dtype == np.float32
    listed = processor(photos[:2])["pixel_values"]
    assert isinstance(listed, list) and [image.shape for image in listed] == [(3, 224, 224)] * 2
    np.testing.assert_allclose(np.stack(listed), np_batch)
    np.testing.assert_allclose(pt["pixel_values"].numpy(), np_batch)
    # Without resizing, differently sized images still come back as a list.
    unresized = processor(photos[2:4], do_resize=False)["pixel_values"]
    assert [image.shape for image in unresized] == [(3, 200, 400), (3, 427, 227)]


def test_defaults_and_save_load_round_trip(tmp_path, photo):
    processor = VisionTransformerImageProcessor()
    assert processor.model_input_names == ["pixel_values"]
    defaults = {
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"height": 224, "width": 224},
        "resample": 2,
        "do_center_crop": False,
        "crop_size": {"height": 224, "width": 224},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    assert {key: processor.to_dict()[key] for key in defaults} == defaults
    processor.save_pretrained(tmp_path / "default")
    saved = json.loads((tmp_path / "default" / "preprocessor_config.json").read_text())
    assert saved["image_processor_type"] == "VisionTransformerImageProcessor"
    assert {key: saved[key] for key in defaults} == defaults
    assert VisionTransformerImageProcessor.from_pretrained(tmp_path / "default").to_dict() == processor.to_dict()

    custom = VisionTransformerImageProcessor(
        size=(160, 224),
        resample="bicubic",
        do_center_crop=True,
        crop_size=128,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
        do_convert_rgb=False,
    )
    custom.save_pretrained(tmp_path / "custom")
    loaded = VisionTransformerImageProcessor.from_pretrained(tmp_path / "custom")
    assert loaded.to_dict() == custom.to_dict()
    assert loaded.to_json_string() == custom.to_json_string()
    assert loaded.resample == PILImageResampling.BICUBIC
    torch.testing.assert_close(
        loaded(photo, return_tensors="pt")["pixel_values"], custom(photo, return_tensors="pt")["pixel_values"]
    )
    # from_pretrained keyword arguments override saved values, as in transformers.
    assert VisionTransformerImageProcessor.from_pretrained(tmp_path / "custom", size=64).size == {
        "height": 64,
        "width": 64,
    }


def test_module_is_self_contained_remote_code(photo, tmp_path):
    """The file ships beside checkpoints with its siblings `image_geometry.py` and `layout.py` (the packing it
    returns), so they may import only each other, the stdlib, numpy, PIL, torch and transformers; the three alone, in
    a package of their own, process as hf_vit does."""
    allowed = {"numpy", "PIL", "torch", "transformers"} | set(sys.stdlib_module_names)
    for path in (MODULE_PATH, GEOMETRY_PATH, LAYOUT_PATH):
        tree = ast.parse(path.read_text())
        # an import guarded by `except ImportError` is optional: where hf-vit is installed, its converters are used
        optional = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.Try) and any(getattr(h.type, "id", None) == "ImportError" for h in node.handlers)
            for statement in node.body
            for inner in ast.walk(statement)
        }
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and node.module in ("image_geometry", "layout"), (path.name, node.module)
            elif isinstance(node, ast.ImportFrom):
                assert node.module.split(".")[0] in allowed, node.module
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] in allowed, alias.name
    package = tmp_path / "standalone_processor"
    package.mkdir()
    for path in (MODULE_PATH, GEOMETRY_PATH, LAYOUT_PATH):
        (package / path.name).write_text(path.read_text())
    (package / "__init__.py").write_text("")
    sys.path.insert(0, str(tmp_path))
    try:
        standalone = importlib.import_module("standalone_processor.image_processing_vit")
    finally:
        sys.path.remove(str(tmp_path))
    np.testing.assert_array_equal(
        standalone.VisionTransformerImageProcessor()(photo, return_tensors="np")["pixel_values"], process(photo)
    )


def test_image_classification_pipeline(photo):
    config = ViTConfig(
        image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    config.id2label = {0: "a", 1: "b", 2: "c"}
    config.label2id = {"a": 0, "b": 1, "c": 2}
    model = ViTForImageClassification(config).eval()
    processor = VisionTransformerImageProcessor(size=32)
    classifier = pipeline("image-classification", model=model, image_processor=processor)
    predictions = classifier(PIL.Image.fromarray(photo))
    assert sorted(p["label"] for p in predictions) == ["a", "b", "c"]
    with torch.no_grad():
        logits = model(**processor(PIL.Image.fromarray(photo), return_tensors="pt")).logits
    assert predictions[0]["score"] == pytest.approx(logits.softmax(-1).max().item(), abs=1e-5)


def test_warns_when_rescaling_images_already_in_unit_range(photo, caplog):
    logging.Logger.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING):
        process(photo.astype(np.float32) / 255)
    assert "already rescaled" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        process(photo.astype(np.float32) / 255, do_rescale=False)
        process(photo)
    assert "already rescaled" not in caplog.text


def test_public_tensor_helpers(photo):
    batch = torch.from_numpy(photo).permute(2, 0, 1)[None].repeat(3, 1, 1, 1)
    resized = resize_images(batch.float(), (112, 96))
    assert resized.shape == (3, 3, 112, 96) and resized.dtype == torch.float32
    torch.testing.assert_close(resized[1:2], resize_images(batch[1:2].float(), (112, 96)))
    resized_uint8 = resize_images(batch, (112, 96), resample="bicubic")
    assert resized_uint8.dtype == torch.uint8 and resized_uint8.shape == (3, 3, 112, 96)
    assert resize_images(batch, batch.shape[-2:]) is batch
    cropped = center_crop_images(batch, (100, 120))
    top, left = (photo.shape[0] - 100) // 2, (photo.shape[1] - 120) // 2
    assert torch.equal(cropped, batch[..., top : top + 100, left : left + 120])
    normalised = rescale_and_normalize(batch, 1 / 255, [0.5, 0.4, 0.3], [0.2, 0.25, 0.5])
    mean, std = torch.tensor([0.5, 0.4, 0.3])[:, None, None], torch.tensor([0.2, 0.25, 0.5])[:, None, None]
    torch.testing.assert_close(normalised, (batch / 255 - mean) / std)
    assert rescale_and_normalize(batch, 1 / 255).max() <= 1.0
    float_batch = batch.float()
    assert rescale_and_normalize(float_batch) is not float_batch  # never modifies its input in place
    processor = VisionTransformerImageProcessor()
    torch.testing.assert_close(
        processor.normalize_batch(batch), processor(batch, do_resize=False, return_tensors="pt")["pixel_values"]
    )


@pytest.mark.parametrize(
    ("images", "error", "match"),
    [
        ([], ValueError, "empty"),
        ((), ValueError, "empty"),
        (torch.zeros(0, 3, 8, 8), ValueError, "empty"),
        (b"definitely not an image", ValueError, r"given bytes \(23 bytes\) are not a valid image"),
        (np.zeros(10, np.uint8), ValueError, r"dimensions.*shape \(10,\)"),
        (np.zeros((1, 1, 3, 8, 8), np.uint8), ValueError, r"dimensions.*shape \(1, 1, 3, 8, 8\)"),
        (np.zeros((8, 8, 2), np.uint8), ValueError, r"1, 3 or 4 channels.*shape \(8, 8, 2\)"),
        (torch.zeros(5, 8, 9), ValueError, r"1, 3 or 4 channels.*shape \(5, 8, 9\)"),
        ({"image": 1}, TypeError, "Unsupported image type dict"),
        (None, TypeError, "Unsupported image type NoneType"),
        ([np.zeros((8, 8, 3), np.uint8), 3.0], TypeError, "Unsupported image type float"),
        (np.zeros((8, 8, 3), bool), TypeError, "dtype bool"),
        ("https://example.com/cat.jpg", ValueError, "URLs are not supported"),
    ],
)
def test_invalid_images_raise_clear_errors(images, error, match):
    with pytest.raises(error, match=match):
        VisionTransformerImageProcessor()(images, return_tensors="pt")


def test_invalid_files_raise_clear_errors(photo, tmp_path):
    processor = VisionTransformerImageProcessor()
    not_an_image = tmp_path / "notes.jpg"
    not_an_image.write_text("hello")
    with pytest.raises(ValueError, match=r"notes\.jpg' is not a valid image"):
        processor(str(not_an_image))
    png = io.BytesIO()
    PIL.Image.fromarray(photo).save(png, format="PNG")
    with pytest.raises(ValueError, match="bytes.*not a valid image"):
        processor(png.getvalue()[: len(png.getvalue()) // 2])
    with pytest.raises(FileNotFoundError):
        processor(tmp_path / "missing.png")


def test_invalid_options_raise_clear_errors(photo):
    processor = VisionTransformerImageProcessor()
    with pytest.raises(ValueError, match="Unsupported resample"):
        processor(photo, resample=PILImageResampling.LANCZOS)
    with pytest.raises(ValueError, match="Unsupported resample"):
        VisionTransformerImageProcessor(resample="area")
    with pytest.raises(ValueError, match="`size` must be .*shortest_edge"):
        processor(photo, size={"longest_edge": 224})
    with pytest.raises(ValueError, match="`crop_size` must be"):
        VisionTransformerImageProcessor(crop_size={"shortest_edge": 224})
    with pytest.raises(ValueError, match="return_tensors"):
        processor(photo, return_tensors="mlx")
    with pytest.raises(TypeError, match="unsupported argument"):
        processor(photo, do_pad=True)
    with pytest.raises(ValueError, match="3 values but the images have 4 channels"):
        processor(np.zeros((8, 8, 4), np.uint8), do_convert_rgb=False)
    with pytest.raises(ValueError, match="different shapes"):
        processor([photo, photo[:100]], do_resize=False, return_tensors="pt")
    with pytest.raises(ValueError, match=r"\[N, C, H, W\]"):
        resize_images(torch.zeros(3, 8, 8), (4, 4))


def _exif_rotated_jpeg(photo: np.ndarray, orientation: int = 6) -> bytes:
    exif = PIL.Image.Exif()
    exif[0x0112] = orientation
    jpeg = io.BytesIO()
    PIL.Image.fromarray(photo).save(jpeg, format="JPEG", exif=exif, quality=95)
    return jpeg.getvalue()


def test_exif_orientation_is_applied_to_opened_pil_images_too(photo, tmp_path):
    path = tmp_path / "rotated.jpg"
    path.write_bytes(_exif_rotated_jpeg(photo))
    opened = PIL.Image.open(path)
    upright = PIL.ImageOps.exif_transpose(PIL.Image.open(path))
    assert upright.size == opened.size[::-1]  # orientation 6: the stored pixels are turned a quarter
    expected = process(upright, do_resize=False)
    assert expected.shape == (1, 3, photo.shape[1], photo.shape[0])
    for kind, image in {"path": path, "bytes": path.read_bytes(), "opened PIL image": opened}.items():
        np.testing.assert_array_equal(process(image, do_resize=False), expected, err_msg=kind)
    assert opened.getexif().get(0x0112) == 6  # the caller's image is left as it was


def test_sixteen_bit_images_and_uint16_arrays_share_one_scaling_rule(photo):
    ramp = np.linspace(0, 65535, 64 * 48).round().astype(np.uint16).reshape(48, 64)
    png = io.BytesIO()
    PIL.Image.fromarray(ramp).save(png, format="PNG")
    from_png = process(png.getvalue(), do_normalize=False, do_resize=False)
    # Full-range 16-bit data maps onto the full 0..1 range, as its 8-bit version would.
    assert from_png.min() == 0.0 and from_png.max() == 1.0 and from_png.mean() == pytest.approx(0.5, abs=0.01)
    eight_bit = np.round(ramp / 257).astype(np.uint8)
    np.testing.assert_array_equal(from_png, process(eight_bit, do_normalize=False, do_resize=False))
    for kind, image in {
        "uint16 array": ramp,
        "uint16 HWC array": np.repeat(ramp[..., None], 3, axis=-1),
        "uint16 tensor": torch.from_numpy(ramp.astype(np.int32)).to(torch.uint16),
        "PIL mode I": PIL.Image.fromarray(ramp.astype(np.int32)),
    }.items():
        np.testing.assert_array_equal(process(image, do_normalize=False, do_resize=False), from_png, err_msg=kind)
        grey_only = process(image, do_normalize=False, do_resize=False, do_convert_rgb=False)
        np.testing.assert_array_equal(
            grey_only, from_png[:, :1] if grey_only.shape[1] == 1 else from_png, err_msg=kind
        )
    # An 8-bit image stored in 16 bits (value * 257) gives back exactly the 8-bit image.
    grey = np.array(PIL.Image.fromarray(photo).convert("L"))
    np.testing.assert_array_equal(process(grey.astype(np.uint16) * 257), process(grey))
    with pytest.raises(ValueError, match=r"Image 0 is a PIL image in mode 'I' with values in \[-5, 70000\]"):
        process(PIL.Image.fromarray(np.array([[-5, 70000]], np.int32)))
    with pytest.raises(ValueError, match=r"Image 1 is a torch.int32 array with values in \[467, 467\].*uint16"):
        process([photo, np.full((8, 8), 467, np.int32)])


@pytest.mark.parametrize(
    "options", [{}, {"max_num_patches": 16}, {"max_num_patches": 16, "packed_sequence_length": 32}]
)
def test_an_image_without_pixels_is_refused_naming_it(options):
    """Where torch's resize error (and a grid error with `max_num_patches`) named neither the image nor the cause."""
    processor = VisionTransformerImageProcessor(patch_size=4, **options)
    whole = PIL.Image.new("RGB", (8, 8))
    for empty in (PIL.Image.new("RGB", (0, 10)), np.zeros((10, 0, 3), np.uint8), torch.zeros(3, 0, 0)):
        with pytest.raises(ValueError, match=r"^Image 1 is empty \(0x\d+ pixels, 3 channels\): remove it\.$"):
            processor([whole, empty, whole], return_tensors="pt")


def test_non_finite_pixels_are_refused_naming_the_image(photo):
    good = photo.astype(np.float32)
    for bad_value in (np.nan, np.inf, -np.inf):
        bad = good.copy()
        bad[3, 4, 1] = bad_value
        with pytest.raises(ValueError, match="Image 2 contains NaN or infinite values"):
            process([good, good, bad])
        with pytest.raises(ValueError, match="Image 1 contains NaN or infinite values"):
            process(torch.from_numpy(np.stack([good, bad])))  # a batch: images are numbered inside it
    with pytest.raises(ValueError, match="Image 0 contains NaN"):
        process(PIL.Image.fromarray(np.full((4, 4), np.nan, np.float32)))  # PIL mode F


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("image_std", 0),
        ("image_std", [0.5, 0.0, 0.5]),
        ("image_std", -1.0),
        ("image_std", float("inf")),
        ("image_mean", [0.5, float("nan"), 0.5]),
        ("image_mean", []),
        ("rescale_factor", 0),
        ("rescale_factor", float("nan")),
        ("size", 0),
        ("size", (-1, 32)),
        ("size", {"height": 32, "width": 0}),
        ("crop_size", 0),
        ("crop_size", (32, -3)),
    ],
)
def test_invalid_numeric_options_are_refused_naming_the_argument(photo, option, value):
    with pytest.raises(ValueError, match=f"`{option}` must"):
        VisionTransformerImageProcessor(**{option: value})
    processor = VisionTransformerImageProcessor()
    with pytest.raises(ValueError, match=f"`{option}` must"):
        processor(photo, **{option: value})
    with pytest.raises(ValueError, match=f"`{option}` must"):  # also where the option is switched off
        processor(photo, do_center_crop=False, do_normalize=False, do_rescale=False, **{option: value})


def test_a_processor_with_other_sizes_is_a_new_checked_value_and_no_caller_sets_its_sizes():
    packing = VisionTransformerImageProcessor(patch_size=4, max_num_patches=16, packed_sequence_length=32)
    whole = packing.with_options(max_num_patches=None, packed_sequence_length=None)
    assert (packing.max_num_patches, packing.packed_sequence_length) == (16, 32)  # the original is left as it is
    image = PIL.Image.new("RGB", (12, 8))
    assert whole(image, return_tensors="pt")["pixel_values"].shape == (1, 3, 224, 224)
    assert packing([image, image], return_tensors="pt")["pixel_values"].shape[:2] == (1, 32)
    with pytest.raises(ValueError, match="packed_sequence_length"):
        packing.with_options(packed_sequence_length=8)  # a row shorter than the largest image
    with pytest.raises(TypeError, match=r"no option\(s\) \['max_patches'\]"):
        packing.with_options(max_patches=4)
    # no code of the package changes a processor's sizes in place: it makes a new one
    package = pathlib.Path(image_processing_vit.__file__).parents[1]
    assigned = [
        f"{path.name}:{node.lineno}"
        for path in package.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign | ast.AugAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for element in (target.elts if isinstance(target, ast.Tuple) else [target])
        if isinstance(element, ast.Attribute)
        and element.attr in ("max_num_patches", "packed_sequence_length")
        and not (isinstance(element.value, ast.Name) and element.value.id in ("self", "changed", "data_args"))
    ]
    assert assigned == []
