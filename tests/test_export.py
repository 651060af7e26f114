"""Export: torch.export and ONNX graphs that take any batch and any patch-divisible size (the position embeddings
resampled inside the graph), checked against eager PyTorch, with onnxruntime for ONNX."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_config

from hf_vit import VisionTransformerForImageClassification, VisionTransformerImageProcessor, VisionTransformerModel
from hf_vit.export import check_onnx, export, export_program

ROOT = Path(__file__).resolve().parents[1]


def classifier(**overrides):
    torch.manual_seed(0)
    return VisionTransformerForImageClassification(tiny_config(zero_init_head=False, **overrides)).eval()


@pytest.mark.parametrize("classifier_type", ["token", "gap"])
def test_torch_export_is_right_at_every_size(classifier_type):
    model = classifier(classifier=classifier_type)
    program = export_program(model).module()
    # the native 32x32 (where eager PyTorch skips the resampling), non-square sizes, batch 1 and 3
    for shape in [(2, 3, 32, 32), (1, 3, 32, 32), (3, 3, 48, 24), (1, 3, 16, 40)]:
        pixels = torch.randn(*shape)
        with torch.no_grad():
            expected = model(pixels, interpolate_pos_encoding=True).logits
        torch.testing.assert_close(program(pixels), expected, atol=1e-5, rtol=1e-5)


def test_onnx_matches_pytorch_at_two_sizes_one_non_square_and_replaces_a_file_only_when_told(tmp_path):
    model = classifier()
    existing = tmp_path / "vit.onnx"
    existing.write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="--overwrite"):
        export(model, existing)
    assert existing.read_bytes() == b"mine"
    with pytest.raises(IsADirectoryError):
        export(model, tmp_path)
    path = export(model, existing, overwrite=True)
    assert existing.read_bytes() != b"mine" and [p.name for p in tmp_path.iterdir()] == ["vit.onnx"]
    differences = check_onnx(path, model, [(32, 32), (48, 24)], batch=3)
    print("onnxruntime vs PyTorch:", differences)
    assert set(differences) == {"32x32", "48x24"} and max(differences.values()) < 1e-4


def test_onnx_of_the_encoder_outputs_tokens_and_pooled(tmp_path):
    import onnxruntime

    torch.manual_seed(0)
    encoder = VisionTransformerModel(tiny_config()).eval()
    path = export(encoder, tmp_path / "encoder.onnx")
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["last_hidden_state", "pooler_output"]
    pixels = torch.randn(1, 3, 40, 24)
    tokens, pooled = session.run(None, {"pixel_values": pixels.numpy()})
    with torch.no_grad():
        expected = encoder(pixels, interpolate_pos_encoding=True)
    assert tokens.shape == (1, 1 + 5 * 3, 32)
    np.testing.assert_allclose(pooled, expected.pooler_output.numpy(), atol=1e-5)


def test_export_script(tmp_path, capsys):
    """The script as users run it writes and checks the ONNX file; the other formats and the refusals through the same
    command's function in this process (each script start imports torch and transformers anew)."""
    from hf_vit.commands.export import main

    model = classifier()
    model.save_pretrained(tmp_path / "model")
    VisionTransformerImageProcessor(size=32).save_pretrained(tmp_path / "model")
    script = [sys.executable, str(ROOT / "scripts" / "export.py"), "--model", str(tmp_path / "model")]
    done = subprocess.run(script + ["--output", str(tmp_path / "vit.onnx")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "onnxruntime vs PyTorch" in done.stdout and "32x32" in done.stdout and "48x24" in done.stdout
    # only the command's own lines: no progress of torch's exporter or the weights' loading, no torchvision warnings
    assert [line.split(" ")[0] for line in done.stdout.splitlines()] == ["wrote", "onnxruntime"], done.stdout
    assert done.stderr == "", done.stderr
    flags = ["--model", str(tmp_path / "model")]
    assert main(flags + ["--format", "torch_export", "--output", str(tmp_path / "vit.pt2")]) == 0
    loaded = torch.export.load(tmp_path / "vit.pt2").module()
    pixels = torch.randn(2, 3, 24, 40)
    with torch.no_grad():
        torch.testing.assert_close(loaded(pixels), model(pixels, interpolate_pos_encoding=True).logits)
    capsys.readouterr()
    assert main(flags + ["--output", str(tmp_path / "vit.onnx")]) == 2
    again = capsys.readouterr().err
    assert "Loading" not in again and again.startswith("error:") and "--overwrite" in again


@pytest.mark.parametrize(
    "output, fmt, named",
    [
        ("{model}/model.safetensors", "onnx", "*.onnx, not *.safetensors"),  # the weights it reads
        ("{model}/vit.onnx", "onnx", "lies inside the input folder"),
        ("{model}", "onnx", "*.onnx"),
        ("{tmp}/vit.pt2", "onnx", "*.onnx, not *.pt2"),
        ("{tmp}/vit.onnx", "torch_export", "*.pt2, not *.onnx"),
        ("{tmp}/vit", "torch_export", "*.pt2, not *(none)"),
    ],
)
def test_export_never_writes_into_its_model_nor_a_file_of_another_format(tmp_path, capsys, output, fmt, named):
    from hf_vit.commands.export import main

    model_dir = tmp_path / "model"
    classifier().save_pretrained(model_dir)
    before = {path.name: path.read_bytes() for path in model_dir.iterdir()}
    argv = ["--model", str(model_dir), "--format", fmt, "--output", output.format(model=model_dir, tmp=tmp_path)]
    capsys.readouterr()
    assert main(argv + ["--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and named in err[0], err
    assert {path.name: path.read_bytes() for path in model_dir.iterdir()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]


def test_export_script_checks_its_sizes_before_writing(tmp_path, capsys):
    from hf_vit.commands.export import main

    classifier().save_pretrained(tmp_path / "model")
    flags = ["--model", str(tmp_path / "model")]
    with pytest.raises(SystemExit) as odd:
        main(flags + ["--output", str(tmp_path / "a.onnx"), "--check_sizes", "32"])
    assert odd.value.code == 2 and "pairs" in capsys.readouterr().err
    assert main(flags + ["--output", str(tmp_path / "b.onnx"), "--check_sizes", "7", "9"]) == 2
    assert "multiples of the patch size 8" in capsys.readouterr().err and not (tmp_path / "b.onnx").exists()


@pytest.mark.parametrize("missing", ["onnxscript", "onnxruntime"])
def test_onnx_export_without_the_extra_is_one_error_line_before_any_work(tmp_path, monkeypatch, capsys, missing):
    from hf_vit.commands.export import main

    classifier().save_pretrained(tmp_path / "model")
    capsys.readouterr()  # saving's progress bar
    monkeypatch.setitem(sys.modules, missing, None)  # as if hf-vit[export] were not installed
    code = main(["--model", str(tmp_path / "model"), "--output", str(tmp_path / "vit.onnx")])
    errors = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(errors) == 1 and errors[0].startswith("error: --format onnx needs")
    assert missing in errors[0] and 'pip install "hf-vit[export]"' in errors[0]
    assert not (tmp_path / "vit.onnx").exists()


def native_batch(model, max_patches, sizes, seed=0):
    """The image processor's native-aspect batch of random images of `sizes` (height, width)."""
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for height, width in sizes]
    processor = VisionTransformerImageProcessor(max_num_patches=max_patches, patch_size=model.config.patch_size)
    return processor(images, return_tensors="pt")


def test_export_command_writes_native_onnx_that_takes_any_number_of_patches_and_grids(tmp_path, capsys):
    import onnxruntime

    from hf_vit.commands.export import main

    model = classifier(classifier="gap", num_register_tokens=1, num_hidden_layers=1)  # a 4x4 position grid
    model.save_pretrained(tmp_path / "model")
    path = tmp_path / "native.onnx"
    assert main(["--model", str(tmp_path / "model"), "--output", str(path), "--max_num_patches", "12"]) == 0
    printed = capsys.readouterr().out
    assert "native-aspect batches" in printed
    # the command's own check: onnxruntime against PyTorch at 12, 4 and 24 patches
    checked = dict(part.split(": ") for part in printed.split("largest absolute difference: ")[1].strip().split(", "))
    assert set(checked) == {"12 patches", "4 patches", "24 patches"} and max(map(float, checked.values())) < 1e-4
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["pixel_values", "pixel_attention_mask", "spatial_shapes"]
    # the processor's batches at two patch counts, images of several aspect ratios (padded rows among them)
    for max_patches, sizes in ((12, [(40, 40), (20, 80), (90, 30)]), (30, [(64, 48), (7, 200)])):
        inputs = native_batch(model, max_patches, sizes)
        assert len({tuple(grid) for grid in inputs["spatial_shapes"].tolist()}) == len(sizes)
        assert not bool(inputs["pixel_attention_mask"].all())
        (logits,) = session.run(None, {name: tensor.numpy() for name, tensor in inputs.items()})
        with torch.no_grad():
            expected = model(**inputs).logits
        assert logits.shape == (len(sizes), model.config.num_labels) and expected.std() > 0.1
        np.testing.assert_allclose(logits, expected.numpy(), atol=1e-4, rtol=0)


def test_torch_export_of_native_batches_and_what_the_command_refuses(tmp_path, capsys):
    from hf_vit.commands.export import main

    model = classifier(interpolation_mode="bilinear", interpolation_antialias=True)
    program = export_program(model, max_num_patches=12).module()
    for max_patches, sizes in ((12, [(40, 40), (20, 80)]), (40, [(90, 30), (64, 48), (16, 16)])):
        inputs = native_batch(model, max_patches, sizes)
        with torch.no_grad():
            expected = model(**inputs).logits
        arguments = [inputs[name] for name in ("pixel_values", "pixel_attention_mask", "spatial_shapes")]
        torch.testing.assert_close(program(*arguments), expected, atol=1e-4, rtol=0)
    # refused by name before anything is written
    model.save_pretrained(tmp_path / "model")
    argv = ["--model", str(tmp_path / "model"), "--format", "torch_export", "--output", str(tmp_path / "one.pt2")]
    with pytest.raises(SystemExit):
        main(argv + ["--max_num_patches", "1"])
    assert "--max_num_patches must be at least 2" in capsys.readouterr().err
    hybrid = tiny_config(resnet_layers=[1, 1], resnet_width=32, patch_size=8)
    VisionTransformerForImageClassification(hybrid).save_pretrained(tmp_path / "hybrid")
    code = main(["--model", str(tmp_path / "hybrid"), "--output", str(tmp_path / "hybrid.pt2"), "--format",
                 "torch_export", "--max_num_patches", "12"])  # fmt: skip
    error = capsys.readouterr().err
    assert code == 2 and "--max_num_patches" in error and "ResNet stem" in error
    assert not (tmp_path / "one.pt2").exists() and not (tmp_path / "hybrid.pt2").exists()


def test_torch_export_of_native_batches_with_attention_pooling(tmp_path, capsys):
    from hf_vit.commands.export import main

    model = classifier(classifier="map", num_hidden_layers=1)
    model.save_pretrained(tmp_path / "map")
    output = tmp_path / "map.pt2"
    argv = ["--model", str(tmp_path / "map"), "--output", str(output), "--format", "torch_export"]
    assert main(argv + ["--max_num_patches", "12"]) == 0
    program = torch.export.load(output).module()
    rng = np.random.default_rng(0)
    images = [
        rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for height, width in ((40, 40), (20, 80), (90, 30))
    ]
    processor = VisionTransformerImageProcessor(max_num_patches=12, patch_size=model.config.patch_size)
    inputs = processor(images, return_tensors="pt")
    assert not bool(inputs["pixel_attention_mask"].all())  # padded rows among them
    arguments = [inputs[name] for name in ("pixel_values", "pixel_attention_mask", "spatial_shapes")]
    with torch.no_grad():  # each image in a batch of its own
        alone = torch.cat([model(**processor([image], return_tensors="pt")).logits for image in images])
    assert alone.std() > 0.1
    torch.testing.assert_close(program(*arguments), alone, atol=1e-4, rtol=0)
