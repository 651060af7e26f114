"""Checkpoints made for any resolution, aspect ratio and patch size, loaded as they are: timm's NaFlexViT by Hub id and
by folder (against timm's own logits, recorded by benchmarks/peer_checks.py), and big_vision's FlexiViT .npz files."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_sources import hub_repo

from hf_vit import VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.convert import ConversionError

FIXTURES = Path(__file__).parent / "data" / "timm_naflex"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert huggingface_hub.constants.HF_HUB_OFFLINE  # conftest: the Hub is never reached
    return cache


def timm_naflex_repo(cache: Path, name: str) -> str:
    """The fixture `name` (timm's Hub layout: config.json, model.safetensors) as a cached Hub repository."""
    repo_id = f"timm/naflexvit_tiny_{name}.test"
    snapshot = hub_repo(cache, repo_id)
    for file in ("config.json", "model.safetensors"):
        shutil.copy(FIXTURES / name / file, snapshot / file)
    return repo_id


@pytest.mark.parametrize("name", ["gap", "token", "map"])
def test_timm_naflexvit_gives_timms_logits_by_hub_id(hub_cache, name):
    """timm's logits were recorded by timm itself, image by image at two sizes and on a NaFlex batch built with timm's
    transforms and collator:

        PYTHONPATH=. $PEER/bin/python benchmarks/peer_checks.py --fixtures tests/data/timm_naflex --resample
    """
    repo_id = timm_naflex_repo(hub_cache, name)
    model = VisionTransformerForImageClassification.from_pretrained(repo_id).eval()
    recorded = load_file(FIXTURES / name / "outputs.safetensors")
    record = json.loads((FIXTURES / name / "outputs.json").read_text())
    config, args = model.config, record["model_args"]
    assert config.interpolation_antialias is True  # as timm's NaFlexEmbeds resample the grid
    assert config.interpolation_mode == args.get("pos_embed_interp_mode", "bicubic")
    assert list(config.grid_size) == args["pos_embed_grid_size"]
    with torch.no_grad():
        for index, size in enumerate(record["image_sizes"]):
            images = recorded[f"images_{index}"]
            assert list(images.shape[-2:]) == size
            logits = model(images, interpolate_pos_encoding=True).logits
            difference = (logits - recorded[f"logits_{index}"]).abs().max().item()
            print(f"{name} {size[0]}x{size[1]}: max |hf-vit - timm| {difference:.1e}")
            assert difference < 1e-5
        valid, grids = recorded["patch_valid"], recorded["spatial_shapes"]
        patches = recorded["patches"]
        native = model(pixel_values=patches, pixel_attention_mask=valid.long(), spatial_shapes=grids).logits
    difference = (native - recorded["naflex_logits"]).abs().max().item()
    print(f"{name} NaFlex batch {record['naflex_grids']}: max |hf-vit - timm| {difference:.1e}")
    assert difference < 1e-4
    assert recorded["naflex_logits"].std() > 0.1  # logits that say something
    # the grids timm's coordinates imply are the ones passed
    coords = recorded["patch_coord"]
    for row, (rows, cols) in enumerate(recorded["spatial_shapes"].tolist()):
        count = int(valid[row].sum())
        assert count == rows * cols and coords[row, count - 1].tolist() == [rows - 1, cols - 1]


def test_timm_naflexvit_by_folder_with_its_processor_and_a_size_given(tmp_path):
    folder = tmp_path / "naflex"
    shutil.copytree(FIXTURES / "token", folder)
    recorded = load_file(folder / "outputs.safetensors")
    processor = VisionTransformerImageProcessor.from_pretrained(folder)
    assert processor.size == {"height": 16, "width": 16} and processor.image_mean == [0.5, 0.5, 0.5]
    # loaded at another size: the grid resampled at load as timm resamples it in the forward pass
    model = VisionTransformerForImageClassification.from_pretrained(folder, image_size=[20, 8]).eval()
    assert model.config.image_size == [20, 8]
    with torch.no_grad():
        logits = model(recorded["images_1"]).logits
    torch.testing.assert_close(logits, recorded["logits_1"], atol=1e-5, rtol=0)
    # the converted model saves as an hf-vit folder and reloads to the same logits
    model.save_pretrained(tmp_path / "saved")
    reloaded = VisionTransformerForImageClassification.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(recorded["images_1"]).logits, logits, atol=0, rtol=0)


def _edit_config(folder: Path, **model_args) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["model_args"].update(model_args)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "fixture, model_args, named",
    [
        ("gap", {"pos_embed_ar_preserving": True}, "pos_embed_ar_preserving=True"),
        ("gap", {"pos_embed_use_grid_sample": True}, "pos_embed_use_grid_sample=True"),
        ("gap", {"pool_include_prefix": True}, "pool_include_prefix=True"),
        ("gap", {"rope_type": "axial"}, "rope_type='axial'"),
        ("map", {"attn_pool_num_heads": 1}, "attn_pool_num_heads=1"),
        ("token", {"act_layer": "silu"}, "act_layer='silu'"),
    ],
)
def test_naflexvit_settings_hf_vit_cannot_compute_are_refused_by_name(tmp_path, fixture, model_args, named):
    folder = tmp_path / fixture
    shutil.copytree(FIXTURES / fixture, folder)
    _edit_config(folder, **model_args)
    with pytest.raises(ConversionError, match=named.replace("(", r"\(").replace("[", r"\[")):
        VisionTransformerForImageClassification.from_pretrained(folder)
