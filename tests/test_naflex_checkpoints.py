"""Checkpoints made for any resolution, aspect ratio and patch size, loaded as they are: timm's NaFlexViT by Hub id and
by folder (against timm's own logits, recorded by benchmarks/peer_checks.py), and big_vision's FlexiViT .npz files."""

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_sources import hub_repo

from hf_vit import VisionTransformerConfig, VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.convert import (
    ConversionError,
    convert_timm_checkpoint,
    hf_vit_to_npz_arrays,
    is_big_vision,
    naflex_config,
    naflex_to_hf_vit_state_dict,
)
from hf_vit.convert.big_vision_npz import BIG_VISION_LAYOUT
from hf_vit.convert.common import check_state_dict
from hf_vit.convert.timm_naflex import NAFLEX_LAYOUT

FIXTURES = Path(__file__).parent / "data" / "timm_naflex"


def hf_vit_to_naflex_state_dict(
    state_dict: Mapping[str, torch.Tensor], config: VisionTransformerConfig
) -> dict[str, torch.Tensor]:
    """hf-vit weights under timm NaFlexViT's names (the inverse of `naflex_to_hf_vit_state_dict`): the kernel as the
    linear map on (row, column, channel) patches, the table as the grid. The class token's position must be zero, as
    NaFlexViT's class token has none."""
    out = NAFLEX_LAYOUT.from_hf(state_dict, config)
    table, prefix = out["embeds.pos_embed"], config.num_position_prefix_tokens
    if bool(table[:, :prefix].detach().ne(0).any()):
        raise ConversionError("NaFlexViT's class token has no position: the class token's position must be zero.")
    out["embeds.pos_embed"] = table[:, prefix:].reshape(1, *config.grid_size, table.shape[-1]).clone()
    out["embeds.proj.weight"] = out["embeds.proj.weight"].permute(0, 2, 3, 1).flatten(1).contiguous()
    if config.fc_norm:
        for name in ("weight", "bias"):
            out[f"fc_norm.{name}"] = out.pop(f"norm.{name}")
    return out


def hf_vit_to_big_vision_arrays(
    state_dict: Mapping[str, torch.Tensor], config: VisionTransformerConfig
) -> dict[str, np.ndarray]:
    """The inverse: an hf-vit classification state dict as big_vision's arrays (save them with `np.savez`). The class
    token's position must be zero, as big_vision's class token has none."""
    check_state_dict(state_dict, config)
    arrays = BIG_VISION_LAYOUT.from_hf({k: v.detach().cpu().float() for k, v in state_dict.items()}, config)
    prefix = config.num_position_prefix_tokens
    if prefix:
        if bool(arrays["pos_embedding"][:, :prefix].ne(0).any()):
            raise ConversionError("big_vision's class token has no position: the class token's position must be zero.")
        arrays["pos_embedding"] = arrays["pos_embedding"][:, prefix:]
    return {k: v.contiguous().numpy() for k, v in arrays.items()}


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
    header_only = VisionTransformerConfig.from_pretrained(repo_id).to_dict()  # read from the safetensors header
    assert all(header_only[k] == v for k, v in model.config.to_dict().items() if k not in ("dtype", "_name_or_path"))
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
    # the table read backwards gives timm's arrays again, bit for bit
    timm_arrays = load_file(folder / "model.safetensors")
    settings = json.loads((folder / "config.json").read_text())
    config = naflex_config(timm_arrays, settings)
    back = hf_vit_to_naflex_state_dict(naflex_to_hf_vit_state_dict(timm_arrays, settings, config), config)
    assert back.keys() == timm_arrays.keys() and all(torch.equal(back[k], timm_arrays[k]) for k in back)
    # the converted model saves as an hf-vit folder and reloads to the same logits
    model.save_pretrained(tmp_path / "saved")
    reloaded = VisionTransformerForImageClassification.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(recorded["images_1"]).logits, logits, atol=0, rtol=0)


def test_timm_naflexvit_converts_to_an_hf_vit_folder(tmp_path):
    recorded = load_file(FIXTURES / "gap" / "outputs.safetensors")
    model = convert_timm_checkpoint(FIXTURES / "gap", tmp_path / "out")
    reloaded = VisionTransformerForImageClassification.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        for converted in (model, reloaded):
            logits = converted(recorded["images_1"], interpolate_pos_encoding=True).logits
            torch.testing.assert_close(logits, recorded["logits_1"], atol=1e-5, rtol=0)
    with pytest.raises(ConversionError, match="leave the preset out"):
        convert_timm_checkpoint(FIXTURES / "gap", tmp_path / "preset", preset="vit-base-patch16-224")
    with pytest.raises(ConversionError, match="resize_mode 'bilinear'"):
        convert_timm_checkpoint(FIXTURES / "gap", tmp_path / "mode", image_size=24, resize_mode="bilinear")
    assert not (tmp_path / "preset").exists() and not (tmp_path / "mode").exists()


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


# --- big_vision's FlexiViT .npz files ---


def _flexivit(classifier: str):
    """A tiny random hf-vit classifier as FlexiViT is configured (bilinear, antialiased positions; Flax's GELU); its
    class token without a position, as big_vision's has none."""
    torch.manual_seed(0)
    config = VisionTransformerConfig(
        image_size=24, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        classifier=classifier, num_labels=3, zero_init_head=False, hidden_act="gelu_pytorch_tanh",
        interpolation_mode="bilinear", interpolation_antialias=True,
    )  # fmt: skip
    model = VisionTransformerForImageClassification(config).eval()
    with torch.no_grad():
        model.vit.embeddings.position_embedding[:, : config.num_position_prefix_tokens] = 0
        for parameter in model.parameters():  # nothing at its initial value, so every weight shows
            parameter.add_(0.05 * torch.randn_like(parameter))
        model.vit.embeddings.position_embedding[:, : config.num_position_prefix_tokens] = 0
    return model


def _map_head_reference(arrays: dict, tokens: np.ndarray, heads: int) -> np.ndarray:
    """big_vision's MAPHead and head in float64 numpy on the encoder's output `tokens` (B, N, D): a probe attends to
    the tokens (Flax's MultiHeadDotProductAttention, kernels split by head), then LayerNorm, an MLP with a residual."""
    w = {k: np.asarray(v, dtype=np.float64) for k, v in arrays.items()}
    attention = "MAPHead_0/MultiHeadDotProductAttention_0/"
    probe = np.repeat(w["MAPHead_0/probe"], tokens.shape[0], axis=0)

    def project(x, name):
        return np.einsum("bnd,dhk->bnhk", x, w[f"{attention}{name}/kernel"]) + w[f"{attention}{name}/bias"]

    query, key, value = project(probe, "query"), project(tokens, "key"), project(tokens, "value")
    scores = np.einsum("bqhk,bnhk->bhqn", query, key) / np.sqrt(query.shape[-1])
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    pooled = np.einsum("bhqn,bnhk->bqhk", weights, value)
    pooled = np.einsum("bqhk,hkd->bqd", pooled, w[f"{attention}out/kernel"]) + w[f"{attention}out/bias"]
    mean = pooled.mean(-1, keepdims=True)
    normed = (pooled - mean) / np.sqrt(((pooled - mean) ** 2).mean(-1, keepdims=True) + 1e-6)
    normed = normed * w["MAPHead_0/LayerNorm_0/scale"] + w["MAPHead_0/LayerNorm_0/bias"]
    hidden = normed @ w["MAPHead_0/MlpBlock_0/Dense_0/kernel"] + w["MAPHead_0/MlpBlock_0/Dense_0/bias"]
    hidden = 0.5 * hidden * (1 + np.tanh(np.sqrt(2 / np.pi) * (hidden + 0.044715 * hidden**3)))  # Flax's GELU
    pooled = pooled + hidden @ w["MAPHead_0/MlpBlock_0/Dense_1/kernel"] + w["MAPHead_0/MlpBlock_0/Dense_1/bias"]
    return pooled[:, 0] @ w["head/kernel"] + w["head/bias"]


@pytest.mark.parametrize("classifier", ["gap", "token", "map"])
def test_big_vision_flexivit_npz_loads_through_its_own_table(tmp_path, classifier):
    model = _flexivit(classifier)
    config = model.config
    arrays = hf_vit_to_big_vision_arrays(model.state_dict(), config)
    assert "pos_embedding" in arrays and arrays["pos_embedding"].shape == (1, 9, 32)  # the grid only, as big_vision
    assert ("MAPHead_0/probe" in arrays) == (classifier == "map") and ("cls" in arrays) == (classifier == "token")
    path = tmp_path / "flexivit.npz"
    np.savez(path, **{f"params/{key}": value for key, value in arrays.items()}, **{"opt/state/step": np.array(3)})
    assert is_big_vision(dict(np.load(path)))
    loaded = VisionTransformerForImageClassification.from_pretrained(path).eval()
    assert loaded.config.classifier == classifier and loaded.config.hidden_act == "gelu_pytorch_tanh"
    assert (loaded.config.interpolation_mode, loaded.config.interpolation_antialias) == ("bilinear", True)
    images = torch.randn(2, 3, 24, 24, generator=torch.Generator().manual_seed(1))
    other = torch.randn(2, 3, 16, 40, generator=torch.Generator().manual_seed(2))  # a FlexiViT-style other grid
    with torch.no_grad():
        logits = loaded(images).logits
        torch.testing.assert_close(logits, model(images).logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            loaded(other, interpolate_pos_encoding=True).logits,
            model(other, interpolate_pos_encoding=True).logits, atol=1e-5, rtol=0,
        )  # fmt: skip
    assert logits.std() > 0.1
    # An independent reference: the encoder through vit_jax's names and its parity-tested path, and for attention
    # pooling big_vision's MAP head in numpy on that encoder's tokens.
    vit_jax = hf_vit_to_npz_arrays(model.state_dict(), config) if classifier != "map" else None
    if classifier == "map":
        gap = VisionTransformerConfig(**{**config.to_dict(), "classifier": "gap", "use_class_token": False})
        encoder_weights = {k: v for k, v in model.state_dict().items() if "attention_pool" not in k}
        vit_jax = hf_vit_to_npz_arrays(encoder_weights, gap)
    assert not is_big_vision(vit_jax)
    np.savez(tmp_path / "vit_jax.npz", **vit_jax)
    reference = VisionTransformerForImageClassification.from_pretrained(tmp_path / "vit_jax.npz").eval()
    with torch.no_grad():
        if classifier != "map":
            torch.testing.assert_close(reference(images).logits, logits, atol=1e-5, rtol=0)
            return
        tokens = reference.vit(images).last_hidden_state.double().numpy()
    expected = _map_head_reference(arrays, tokens, config.num_attention_heads)
    assert np.abs(logits.double().numpy() - expected).max() < 1e-5
