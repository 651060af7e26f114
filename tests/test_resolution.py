"""Resolution changes: the one resampling function, the model methods that change size and head in place, and the
variants saved so they run at their new size."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from transformers import AutoModel, AutoModelForImageClassification

from hf_vit import VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.model.resolution import grid_for, resample_patch_embedding, resample_position_embeddings
from hf_vit.variants import make_resolution_variant

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def folder(tmp_path):
    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(tiny_config(zero_init_head=False)).eval()
    model.save_pretrained(tmp_path / "src")
    VisionTransformerImageProcessor(size=32).save_pretrained(tmp_path / "src")
    return tmp_path / "src", model


@pytest.mark.parametrize("mode", ["bicubic", "bilinear"])
def test_resampling_keeps_the_class_token_and_interpolates_the_grid(mode):
    pos = torch.randn(1, 1 + 4 * 6, 8)
    out = resample_position_embeddings(pos, (4, 6), (6, 9), num_prefix_tokens=1, mode=mode)
    assert out.shape == (1, 1 + 54, 8) and torch.equal(out[:, 0], pos[:, 0])
    grid = pos[0, 1:].reshape(4, 6, 8).permute(2, 0, 1)[None]
    expected = F.interpolate(grid, size=(6, 9), mode=mode, align_corners=False)[0].permute(1, 2, 0).reshape(54, 8)
    torch.testing.assert_close(out[0, 1:], expected)
    assert torch.equal(resample_position_embeddings(pos, (4, 6), (4, 6)), pos)  # same grid: unchanged


def test_variant_equals_interpolating_at_forward(folder, tmp_path):
    path, model = folder
    variant, processor = make_resolution_variant(path, (48, 40), tmp_path / "variant")
    assert variant.config.image_hw == (48, 40) and processor.size == {"height": 48, "width": 40}
    saved = json.loads((tmp_path / "variant" / "config.json").read_text())
    assert saved["image_size"] == [48, 40]
    assert json.loads((tmp_path / "variant" / "preprocessor_config.json").read_text())["size"] == {
        "height": 48,
        "width": 40,
    }
    reloaded = VisionTransformerForImageClassification.from_pretrained(tmp_path / "variant").eval()
    x = torch.randn(2, 3, 48, 40)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, model(x, interpolate_pos_encoding=True).logits)
    with pytest.raises(ValueError, match="interpolate_pos_encoding"):
        reloaded(torch.randn(1, 3, 32, 32))  # its native size is the new one


def test_set_input_size_changes_the_model_in_place(folder):
    _, model = folder
    x = torch.randn(2, 3, 64, 48)
    with torch.no_grad():
        interpolated = model(x, interpolate_pos_encoding=True).logits
        model.set_input_size((64, 48))
        assert model.config.image_size == [64, 48] and model.config.grid_size == (8, 6)
        assert model.vit.embeddings.position_embedding.shape == (1, 1 + 48, 32)
        torch.testing.assert_close(model(x).logits, interpolated)  # no interpolate_pos_encoding needed any more
        model.set_input_size(64)
        assert model.config.image_size == 64  # square sizes are stored as one int
    with pytest.raises(ValueError, match="not divisible by the patch size 8"):
        model.set_input_size(60)
    with pytest.raises(ValueError, match="at most 65536 patch positions"):
        grid_for(100000, 16)


def resize_patches(images, old, new, mode="bicubic"):
    """Each old x old patch of `images` resized on its own to new x new (F.interpolate, antialiased), reassembled."""
    batch, channels, height, width = images.shape
    rows, cols = height // old, width // old
    patches = images.reshape(batch, channels, rows, old, cols, old).permute(0, 2, 4, 1, 3, 5)
    patches = patches.reshape(-1, channels, old, old).double()
    resized = F.interpolate(patches, size=(new, new), mode=mode, antialias=True, align_corners=False)
    resized = resized.reshape(batch, rows, cols, channels, new, new).permute(0, 3, 1, 4, 2, 5)
    return resized.reshape(batch, channels, rows * new, cols * new).to(images.dtype)


@pytest.mark.parametrize(("old", "new", "mode"), [(4, 8, "bicubic"), (3, 7, "bilinear"), (8, 12, "bicubic")])
def test_resampled_patch_embedding_is_the_pseudo_inverse_of_the_resize(old, new, mode):
    # <x, w> = <resize(x), resample(w)> for every patch x and kernel w when the patch grows (FlexiViT's property)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 3, old, old, generator=generator, dtype=torch.float64)
    patches = torch.randn(10, 3, old, old, generator=generator, dtype=torch.float64)
    resampled = resample_patch_embedding(weight, new, interpolation=mode)
    assert resampled.shape == (6, 3, new, new) and resampled.dtype == weight.dtype
    resized = resize_patches(patches, old, new, mode)
    before = torch.einsum("nchw,dchw->nd", patches, weight)
    after = torch.einsum("nchw,dchw->nd", resized, resampled)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=0)
    assert before.abs().max() > 1
    # in float32 too, and the same size is the weight itself
    single = resample_patch_embedding(weight.float(), new, interpolation=mode)
    assert single.dtype == torch.float32
    torch.testing.assert_close(single.double(), resampled, atol=1e-4, rtol=0)
    assert resample_patch_embedding(weight, old) is weight


def test_a_shrunk_patch_embedding_is_the_least_squares_fit():
    # Shrinking cannot keep every product; the pseudo-inverse gives the kernel whose products with resized patches are
    # closest to the original ones over all patches: any other kernel does worse.
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(2, 1, 6, 6, generator=generator, dtype=torch.float64)
    resampled = resample_patch_embedding(weight, 4)
    basis = torch.eye(36, dtype=torch.float64).reshape(36, 1, 6, 6)
    resized = F.interpolate(basis, size=(4, 4), mode="bicubic", antialias=True, align_corners=False).reshape(36, 16)
    solution = torch.linalg.lstsq(resized, weight.reshape(2, 36).T).solution.T  # min ||R^T w' - w||
    torch.testing.assert_close(resampled.reshape(2, 16), solution, atol=1e-8, rtol=0)
    with pytest.raises(ValueError, match="interpolation"):
        resample_patch_embedding(weight, 4, interpolation="nearest")


def test_set_input_size_changes_the_patch_size(folder, tmp_path):
    path, model = folder
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model(x).logits
        # patch 8 -> 16 at twice the size: the same 4x4 grid, each patch resized up: the same logits
        model.set_input_size(64, patch_size=16)
        assert model.config.patch_size == 16 and model.config.image_size == 64 and model.config.grid_size == (4, 4)
        assert model.vit.embeddings.patch_embedding.weight.shape == (32, 3, 16, 16)
        assert model.vit.embeddings.patch_embedding.stride == (16, 16)
        torch.testing.assert_close(model(resize_patches(x, 8, 16)).logits, before, atol=1e-4, rtol=0)
        # the patch size alone: the image size stays, the grid follows
        model.set_input_size(patch_size=8)
        assert model.config.image_size == 64 and model.config.grid_size == (8, 8)
        assert model(torch.randn(1, 3, 64, 64)).logits.shape == (1, 5)
        model.save_pretrained(tmp_path / "patch8")
        reloaded = VisionTransformerForImageClassification.from_pretrained(tmp_path / "patch8").eval()
        assert reloaded.config.patch_size == 8 and reloaded.config.grid_size == (8, 8)
        y = torch.randn(2, 3, 64, 64)
        torch.testing.assert_close(reloaded(y).logits, model(y).logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match="not divisible by the patch size 12"):
        model.set_input_size(patch_size=12)
    assert model.config.patch_size == 8 and model.vit.embeddings.patch_embedding.weight.shape[-1] == 8  # unchanged
    with pytest.raises(ValueError, match="patch_size"):
        model.set_input_size(patch_size=0)


def test_from_pretrained_at_another_patch_size(folder):
    path, model = folder
    loaded = VisionTransformerForImageClassification.from_pretrained(path, patch_size=16, image_size=64).eval()
    assert loaded.config.patch_size == 16 and loaded.config.grid_size == (4, 4)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(resize_patches(x, 8, 16)).logits, model(x).logits, atol=1e-4, rtol=0)
    only_patch = VisionTransformerForImageClassification.from_pretrained(path, patch_size=4).eval()
    assert only_patch.config.image_size == 32 and only_patch.config.grid_size == (8, 8)
    assert only_patch.vit.embeddings.patch_embedding.weight.shape == (32, 3, 4, 4)
    # The Auto classes write patch_size onto the config before the weights load: the same model as the class's path
    auto = AutoModelForImageClassification.from_pretrained(path, patch_size=4).eval()
    assert type(auto) is VisionTransformerForImageClassification and auto.config.patch_size == 4
    base = AutoModel.from_pretrained(path, patch_size=16, image_size=64).eval()
    with torch.no_grad():
        torch.testing.assert_close(auto(x).logits, only_patch(x).logits, atol=0, rtol=0)
        assert base.config.grid_size == (4, 4)
        upsampled = resize_patches(x, 8, 16)
        torch.testing.assert_close(
            base(upsampled).last_hidden_state, loaded.vit(upsampled).last_hidden_state, atol=0, rtol=0
        )
    assert json.loads((path / "config.json").read_text())["patch_size"] == 8  # the folder is left as it was


def test_from_pretrained_at_another_image_size_resamples_the_positions(folder, tmp_path):
    # as the patch_size= path and the foreign layouts: the positions resampled, never a size-mismatch error or random
    # positions
    path, model = folder
    expected = VisionTransformerForImageClassification.from_pretrained(path).eval()
    expected.set_input_size(48)
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        reference = expected(x).logits
        torch.testing.assert_close(reference, model(x, interpolate_pos_encoding=True).logits)
        for loaded in (
            VisionTransformerForImageClassification.from_pretrained(path, image_size=48),
            AutoModelForImageClassification.from_pretrained(path, image_size=48),
            AutoModelForImageClassification.from_pretrained(path, image_size=[48, 48], ignore_mismatched_sizes=True),
        ):
            assert loaded.config.image_size == 48 and loaded.config.grid_size == (6, 6)
            assert torch.equal(loaded.eval()(x).logits, reference)
        encoder = AutoModel.from_pretrained(path, image_size=(48, 40)).eval()
        assert encoder.config.image_hw == (48, 40)
        wide = torch.randn(1, 3, 48, 40)
        torch.testing.assert_close(
            encoder(wide).pooler_output, model.vit(wide, interpolate_pos_encoding=True).pooler_output
        )
    assert json.loads((path / "config.json").read_text())["image_size"] == 32  # the folder is left as it was


def test_reset_classifier_gives_the_papers_fine_tuning_head(folder):
    _, model = folder
    model.reset_classifier({0: "cat", 1: "dog"})
    assert model.config.num_labels == 2 and model.config.label2id == {"cat": 0, "dog": 1}
    assert model.pre_logits is None and model.config.representation_size is None
    assert model.classifier.weight.shape == (2, 32) and torch.count_nonzero(model.classifier.weight) == 0
    model.reset_classifier({0: "a", 1: "b", 2: "c"}, representation_size=16)
    assert model.pre_logits.weight.shape == (16, 32) and model.classifier.weight.shape == (3, 16)
    assert model(torch.randn(1, 3, 32, 32)).logits.shape == (1, 3)


@pytest.mark.parametrize(
    "size, match",
    [(36, "not divisible by the patch size 8"), ((32, 44), "not divisible"), (4, "smaller than one 8x8 patch")],
)
def test_bad_target_sizes(folder, tmp_path, size, match):
    path, _ = folder
    with pytest.raises(ValueError, match=match):
        make_resolution_variant(path, size, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_positions_that_do_not_match_the_config(folder, tmp_path):
    path, _ = folder
    config = json.loads((path / "config.json").read_text())
    config["image_size"] = 64  # the weights are for 32
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="position embeddings .* have shape"):
        make_resolution_variant(path, 48, tmp_path / "out")
    with pytest.raises(ValueError, match="do not match a 8x8 grid"):
        resample_position_embeddings(torch.zeros(1, 17, 32), (8, 8), (6, 6))


def test_command_line(folder, tmp_path, capsys):
    """The script as users run it; its refusals through the same command's function in this process (each script
    start imports torch and transformers anew)."""
    from hf_vit.commands.resize import main

    def exit_status(argv):
        try:
            return main(argv)
        except SystemExit as exit:  # argparse's refusals
            return exit.code

    path, _ = folder
    script = [sys.executable, str(ROOT / "scripts" / "resize_resolution.py"), "--model", str(path)]
    done = subprocess.run(
        script + ["--image_size", "48", "--output", str(tmp_path / "v48")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert VisionTransformerForImageClassification.from_pretrained(tmp_path / "v48").config.image_size == 48
    capsys.readouterr()
    flags = ["--model", str(path)]
    assert exit_status(flags + ["--image_size", "50", "--output", str(tmp_path / "v50")]) == 2
    assert "not divisible" in capsys.readouterr().err and not (tmp_path / "v50").exists()
    assert exit_status(flags + ["--image_size", "48", "--output", str(tmp_path / "v"), "--push_to_hub"]) == 2
    assert "--hub_model_id" in capsys.readouterr().err and not (tmp_path / "v").exists()


def test_a_folder_without_a_model_is_named_before_anything_loads(tmp_path):
    with pytest.raises(FileNotFoundError, match="'.*nope' is not an hf-vit model folder"):
        make_resolution_variant(tmp_path / "nope", 48, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_patch_size_variant_on_the_command_line(folder, tmp_path, capsys):
    from hf_vit.commands.resize import main

    path, model = folder
    assert (
        main(["--model", str(path), "--patch_size", "16", "--image_size", "64", "--output", str(tmp_path / "p16")])
        == 0
    )
    variant = VisionTransformerForImageClassification.from_pretrained(tmp_path / "p16").eval()
    assert variant.config.patch_size == 16 and variant.config.image_size == 64
    expected = VisionTransformerForImageClassification.from_pretrained(path, patch_size=16, image_size=64).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(variant(x).logits, expected(x).logits, atol=0, rtol=0)
    card = (tmp_path / "p16" / "README.md").read_text()
    assert "patch embedding resampled from 8x8 to 16x16" in card and "pseudo-inverse" in card
    assert VisionTransformerImageProcessor.from_pretrained(tmp_path / "p16").size == {"height": 64, "width": 64}
    # the patch size alone keeps the image size; a patch that does not tile it is refused, naming the sizes
    assert main(["--model", str(path), "--patch_size", "4", "--output", str(tmp_path / "p4")]) == 0
    assert VisionTransformerForImageClassification.from_pretrained(tmp_path / "p4").config.grid_size == (8, 8)
    assert main(["--model", str(path), "--patch_size", "12", "--output", str(tmp_path / "p12")]) == 2
    assert "not divisible by the patch size 12" in capsys.readouterr().err and not (tmp_path / "p12").exists()
    with pytest.raises(SystemExit):
        main(["--model", str(path), "--output", str(tmp_path / "none")])
    assert "--image_size, --patch_size or --max_num_patches" in capsys.readouterr().err
