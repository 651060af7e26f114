"""timm's NaFlexViT checkpoints (`timm/naflexvit_*`, `models/naflexvit.py`) -> hf-vit.

The weights differ from timm's `VisionTransformer` (`TIMM_LAYOUT`) in the embedding only: `embeds.proj.weight`, a
linear map of flattened patches (`patchify_channels_last` order) or a conv kernel; `embeds.pos_embed`, a `(1, h, w,
D)` grid for the patches only (the class token gets a zero position); `embeds.cls_token`, `embeds.reg_token`. The
config records timm's antialiased resampling (`interpolation_mode`, `interpolation_antialias=True`). Settings the
weights do not show come from `NAFLEX_ARCHITECTURES`, overridden by `config.json`'s `global_pool` and `model_args`;
those for which hf-vit computes another function are refused by name (`_REQUIRED`, `_naflex_problems`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..model.configuration_vit import VisionTransformerConfig
from .common import ConversionError, Layout, build_config, image_size_field, resample_positions
from .timm_layout import TIMM_LAYOUT, _timm_problems, timm_block_fields

# What `models/naflexvit.py`'s registered architectures set beyond `NaFlexVitCfg`'s defaults and the weights do not
# show. Architectures not listed are refused unless `model_args` in config.json gives `num_heads` and `global_pool`.
NAFLEX_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "naflexvit_base_patch16_gap": {"num_heads": 12, "global_pool": "avg", "init_values": 1e-5},
    "naflexvit_base_patch16_par_gap": {
        "num_heads": 12, "global_pool": "avg", "init_values": 1e-5, "pos_embed_ar_preserving": True,
    },
    "naflexvit_base_patch16_parfac_gap": {
        "num_heads": 12, "global_pool": "avg", "init_values": 1e-5, "pos_embed_ar_preserving": True,
        "pos_embed": "factorized",
    },
    "naflexvit_base_patch16_map": {"num_heads": 12, "global_pool": "map", "init_values": 1e-5},
    "naflexvit_so150m2_patch16_reg1_gap": {"num_heads": 13, "global_pool": "avg", "init_values": 1e-5},
    "naflexvit_so150m2_patch16_reg1_map": {"num_heads": 13, "global_pool": "map", "init_values": 1e-5},
    "naflexvit_base_patch16_siglip": {"num_heads": 12, "global_pool": "map", "act_layer": "gelu_tanh"},
    "naflexvit_so400m_patch16_siglip": {"num_heads": 16, "global_pool": "map", "act_layer": "gelu_tanh"},
}  # fmt: skip
# timm's activation names -> transformers' (ACT2FN) for the same function.
_ACTIVATIONS = {None: "gelu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "quick_gelu": "quick_gelu"}
_POOLS = {"map": "map", "avg": "gap", "token": "token"}  # NaFlexVitCfg's default first
# What these settings must be for hf-vit to compute timm's function, and why not otherwise.
_REQUIRED = (
    ("pos_embed", "learned", "hf-vit has one learned position table (no factorized, rotary or missing positions)"),
    ("pos_embed_ar_preserving", False,
     "timm resamples the grid to a square of the longer side and crops it; hf-vit resamples to the grid itself"),
    ("pos_embed_use_grid_sample", False,
     "timm samples positions with grid_sample (no antialiasing); hf-vit resizes the grid with interpolate"),
    ("rope_type", ("", "none"), "rotary position embeddings"),
    ("attn_type", "standard", "EVA attention blocks"),
    ("swiglu_mlp", False, "a SwiGLU MLP"),
    ("attn_gated", False, "gated attention"),
    ("qkv_fused", True, "separate query, key and value projections of EVA blocks"),
    ("scale_mlp_norm", False, "a norm inside the MLP"),
    ("scale_attn_inner_norm", False, "a norm inside attention"),
    ("norm_layer", (None, "layernorm"), "a norm other than LayerNorm"),
    ("block_fn", None, "another block implementation"),
    ("mlp_layer", None, "another MLP implementation"),
    ("attn_layer", None, "another attention implementation"),
    ("final_norm", True, "no final LayerNorm (hf-vit always has one, on the tokens or after the pooling)"),
    ("pos_embed_interp_mode", ("bicubic", "bilinear"), "hf-vit resamples positions bicubic or bilinear"),
    ("act_layer", tuple(_ACTIVATIONS), f"hf-vit knows {sorted(map(str, _ACTIVATIONS))}"),
    ("global_pool", tuple(_POOLS), "hf-vit pools with the class token ('token'), the average of the patch tokens "
     "('avg') or attention pooling ('map')"),
)  # fmt: skip
# `NaFlexVitCfg`'s defaults for the settings read here: those of `_REQUIRED` are its allowed (first) values.
NAFLEX_DEFAULTS: dict[str, Any] = {
    **{name: allowed[0] if isinstance(allowed, tuple) else allowed for name, allowed, _ in _REQUIRED},
    "pool_include_prefix": False, "patchify_channels_last": True, "attn_pool_num_heads": None,
    "attn_pool_mlp_ratio": None,
}  # fmt: skip


def naflex_settings(timm_config: Mapping) -> dict[str, Any]:
    """NaFlexVitCfg's defaults, the architecture's, `config.json`'s `global_pool` and `model_args`."""
    architecture = str(timm_config.get("architecture"))
    model_args = dict(timm_config.get("model_args") or {})
    if architecture not in NAFLEX_ARCHITECTURES and not {"num_heads", "global_pool"} <= set(model_args):
        raise ConversionError(
            f"config.json names the NaFlexViT architecture {architecture!r}, which hf-vit does not know "
            f"({', '.join(sorted(NAFLEX_ARCHITECTURES))}): its heads and pooling are not in the weights; give "
            "`num_heads` and `global_pool` in config.json's `model_args`."
        )
    settings = {**NAFLEX_DEFAULTS, **NAFLEX_ARCHITECTURES.get(architecture, {})}
    if isinstance(timm_config.get("global_pool"), str) and timm_config["global_pool"]:
        settings["global_pool"] = timm_config["global_pool"]
    settings.update(model_args)
    return settings


def _setting_problems(settings: Mapping[str, Any]) -> list[str]:
    problems = []
    for name, allowed, why in _REQUIRED:
        value = settings.get(name)
        if value not in (allowed if isinstance(allowed, tuple) else (allowed,)):
            problems.append(f"{name}={value!r}: {why}")
    return problems


def _canonical(
    state_dict: Mapping[str, torch.Tensor], settings: Mapping[str, Any], channels: int
) -> tuple[dict[str, torch.Tensor], list[str], tuple[int, int] | None]:
    """`state_dict` as `NAFLEX_LAYOUT` reads it, the problems found and the position grid `(h, w)`."""
    problems, out, grid = [], {}, None
    positioned = int("embeds.cls_token" in state_dict)
    for key, value in state_dict.items():
        if key.startswith("embeds."):
            name = key[len("embeds.") :]
            if name in ("cls_token", "reg_token", "proj.weight", "proj.bias"):
                out[key] = value
            elif name == "pos_embed":
                if value.ndim != 4 or value.shape[0] != 1:
                    problems.append(f"embeds.pos_embed {tuple(value.shape)} is not a (1, h, w, D) grid")
                    continue
                grid = (int(value.shape[1]), int(value.shape[2]))
                rows = value.reshape(1, grid[0] * grid[1], value.shape[3])
                out[key] = torch.cat([rows.new_zeros(1, positioned, rows.shape[2]), rows], dim=1)
            elif name.startswith(("pos_embed_y", "pos_embed_x")):
                problems.append("factorized position embeddings (embeds.pos_embed_y/x): hf-vit has one 2D table")
            elif name.startswith(("norm.", "norm_input.")):
                problems.append(f"a norm in the embedding ({key}): hf-vit embeds patches without one")
            else:
                problems.append(f"{key}: an embedding array hf-vit has no place for")
        elif key.startswith("fc_norm.") and "norm.weight" not in state_dict:
            out["norm." + key[len("fc_norm.") :]] = value
        else:
            out[key] = value
    weight = out.get("embeds.proj.weight")
    if weight is not None and weight.ndim == 2:
        width, flat = weight.shape
        patch = int(round((flat / channels) ** 0.5))
        if patch * patch * channels != flat:
            problems.append(f"embeds.proj.weight {tuple(weight.shape)} is not (D, P * P * {channels})")
        elif settings["patchify_channels_last"]:
            out["embeds.proj.weight"] = weight.reshape(width, patch, patch, channels).permute(0, 3, 1, 2)
        else:
            out["embeds.proj.weight"] = weight.reshape(width, channels, patch, patch)
    if "embeds.pos_embed" not in out and "factorized" not in " ".join(problems):
        problems.append("embeds.pos_embed is missing: hf-vit needs the learned position grid")
    return out, problems, grid


def _naflex_problems(state_dict: Mapping[str, torch.Tensor], settings: Mapping[str, Any]) -> list[str]:
    """The settings hf-vit cannot compute, the prefix tokens' pooling (`pool_include_prefix`) among them."""
    problems = _setting_problems(settings)
    prefix = int("embeds.cls_token" in state_dict)
    reg = state_dict.get("embeds.reg_token")
    prefix += int(reg.shape[1]) if reg is not None and reg.ndim == 3 else 0
    pool, include = settings["global_pool"], bool(settings["pool_include_prefix"])
    if prefix and pool == "avg" and include:
        problems.append(
            "pool_include_prefix=True: timm averages the class and register tokens with the patches; hf-vit averages "
            "the patch tokens only"
        )
    if prefix and pool == "map" and not include:
        problems.append(
            f"pool_include_prefix=False with {prefix} prefix token(s): timm's attention pooling leaves the class and "
            "register tokens out; hf-vit's attends to every token"
        )
    if pool == "map":
        for name, field in (("attn_pool_num_heads", "num_heads"), ("attn_pool_mlp_ratio", None)):
            value = settings.get(name)
            if value is not None and (field is None or value != settings.get(field)):
                problems.append(f"{name}={value!r}: hf-vit's attention pooling has the blocks' heads and MLP")
    return problems


def naflex_canonical(
    state_dict: Mapping[str, torch.Tensor], timm_config: Mapping
) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[str], tuple[int, int] | None]:
    """`(arrays as NAFLEX_LAYOUT reads them, settings, problems, position grid)` of a NaFlexViT checkpoint."""
    settings = naflex_settings(timm_config)
    channels = int(settings.get("in_chans") or timm_config.get("in_chans") or 3)
    arrays, problems, grid = _canonical(state_dict, settings, channels)
    problems = _naflex_problems(state_dict, settings) + problems
    vit_problems, explained = _timm_problems(arrays)
    return {k: v for k, v in arrays.items() if k not in explained}, settings, problems + vit_problems, grid


def naflex_config(
    state_dict: Mapping[str, torch.Tensor],
    timm_config: Mapping,
    image_size: int | list[int] | tuple[int, int] | None = None,
    num_attention_heads: int | None = None,
) -> VisionTransformerConfig:
    """The hf-vit config of a NaFlexViT checkpoint; the image size the position grid's unless given."""
    arrays, settings, problems, grid = naflex_canonical(state_dict, timm_config)
    fields: dict[str, Any] = timm_block_fields(arrays, "embeds.proj.weight", "timm NaFlexViT", problems)
    patch = fields["patch_size"]
    fields["patch_embedding_bias"] = "embeds.proj.bias" in arrays
    fields["use_class_token"] = "embeds.cls_token" in arrays
    registers = arrays.get("embeds.reg_token")
    fields["num_register_tokens"] = int(registers.shape[1]) if registers is not None and registers.ndim == 3 else 0
    fields["fc_norm"] = "fc_norm.weight" in state_dict and "norm.weight" not in state_dict
    if "blocks.0.ls1.gamma" in arrays:
        fields["layer_scale_init_value"] = settings.get("init_values") or 1e-5
    fields["classifier"] = _POOLS.get(settings["global_pool"], "token")
    if fields["classifier"] == "token" and not fields["use_class_token"]:
        problems.append("global_pool='token' but the checkpoint has no class token")
    fields["hidden_act"] = _ACTIVATIONS.get(settings["act_layer"], "gelu")
    fields["interpolation_mode"] = settings["pos_embed_interp_mode"]
    fields["interpolation_antialias"] = True  # timm's NaFlexEmbeds resample with antialias=True, both paths
    fields["num_attention_heads"] = num_attention_heads or settings.get("num_heads")
    head = arrays.get("head.weight")
    fields["num_labels"] = int(head.shape[0]) if head is not None else 0
    if image_size is not None:
        fields["image_size"] = image_size_field(image_size)
    elif grid is not None:
        fields["image_size"] = image_size_field([grid[0] * patch, grid[1] * patch])
    if not _setting_problems(settings) and "norm.weight" not in arrays:
        problems.append("there is neither norm nor fc_norm: hf-vit has one final LayerNorm")
    return build_config({"layer_norm_eps": 1e-6}, fields, problems, "timm NaFlexViT checkpoint")


def naflex_to_hf_vit_state_dict(
    state_dict: Mapping[str, torch.Tensor], timm_config: Mapping, config: VisionTransformerConfig
) -> dict[str, torch.Tensor]:
    """A NaFlexViT state dict in hf-vit's names, checked against `config`'s model, its grid resampled to `config`'s."""
    arrays, _, problems, grid = naflex_canonical(state_dict, timm_config)
    mode, antialias = config.interpolation_mode, config.interpolation_antialias
    arrays = resample_positions(arrays, "embeds.pos_embed", config, mode, antialias, grid or config.grid_size)
    return NAFLEX_LAYOUT.to_hf(arrays, config, problems)


# NaFlexViT's names, as `_canonical` leaves them (a convolution kernel, a position table with the class token's row),
# <-> hf-vit's: the embedding rows are its own, the others `TIMM_LAYOUT`'s.
NAFLEX_LAYOUT = Layout(
    "timm NaFlexViT checkpoint",
    [
        ("embeds.proj.{p}", "vit.embeddings.patch_embedding.{p}"),
        ("embeds.cls_token", "vit.embeddings.cls_token"),
        ("embeds.reg_token", "vit.embeddings.register_tokens"),
        ("embeds.pos_embed", "vit.embeddings.position_embedding"),
        *[
            (row.sources if len(row.sources) > 1 else row.sources[0], row.target, row.transform)
            for row in TIMM_LAYOUT.rows
            if not row.sources[0].startswith(("patch_embed.", "cls_token", "reg_token", "pos_embed", "dist_token"))
        ],
    ],
)
