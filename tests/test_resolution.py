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

from hf_vit import VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.model.resolution import grid_for, resample_position_embeddings
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


def test_command_line(folder, tmp_path):
    path, _ = folder
    script = [sys.executable, str(ROOT / "scripts" / "resize_resolution.py"), "--model", str(path)]
    done = subprocess.run(
        script + ["--image_size", "48", "--output", str(tmp_path / "v48")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert VisionTransformerForImageClassification.from_pretrained(tmp_path / "v48").config.image_size == 48
    bad = subprocess.run(
        script + ["--image_size", "50", "--output", str(tmp_path / "v50")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "not divisible" in bad.stderr
    no_id = subprocess.run(
        script + ["--image_size", "48", "--output", str(tmp_path / "v"), "--push_to_hub"],
        capture_output=True,
        text=True,
    )
    assert no_id.returncode == 2 and "--hub_model_id" in no_id.stderr


def test_a_folder_without_a_model_is_named_before_anything_loads(tmp_path):
    with pytest.raises(FileNotFoundError, match="'.*nope' is not an hf-vit model folder"):
        make_resolution_variant(tmp_path / "nope", 48, tmp_path / "out")
    assert not (tmp_path / "out").exists()
