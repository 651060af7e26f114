"""timm's `vision_transformer.VisionTransformer` state dicts <-> hf-vit: `TIMM_LAYOUT`, a rename (timm fuses
`qkv` as hf-vit does).

Supported: token, average and attention pooling, `fc_norm`, register tokens, DeiT's distillation token and head,
LayerScale, `norm_pre` and `no_embed_class=True` (the prefix tokens get a zero position). Refused, since hf-vit
computes another function for them: QK-norm, a norm inside attention or after the patch embedding, a hybrid CNN
backbone, a multi-layer head. A state dict records neither `global_pool` (a class token means "token" unless a
`config.json` beside it says otherwise) nor the heads: `num_attention_heads`, `preset`, `config.json`'s
`model_args.num_heads`, else the standard heads of the width.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ..model.configuration_vit import MODEL_SIZES, VisionTransformerConfig
from .common import (
    ConversionError,
    build_config,
    convert_checkpoint,
    image_size_field,
    load_preset,
    preset_mismatches,
    read_json,
    resample_positions,
    set_label_names,
    square_side,
)
from .timm_layout import TIMM_LAYOUT, _timm_problems, timm_block_fields

# timm resamples position grids bicubic and antialiased (`resample_abs_pos_embed`): so does the converted model.
TIMM_DEFAULTS = {
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu",
    "interpolation_mode": "bicubic",
    "interpolation_antialias": True,
}
_STANDARD_HEADS = {dims["hidden_size"]: dims["num_attention_heads"] for dims in MODEL_SIZES.values()}


def _prefix_counts(state_dict: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(class and distillation tokens, register tokens) of a timm state dict."""
    registers = state_dict.get("reg_token")
    positioned = int("cls_token" in state_dict) + int("dist_token" in state_dict)
    return positioned, registers.shape[1] if registers is not None and registers.ndim == 3 else 0


def timm_canonical(state_dict: Mapping[str, torch.Tensor], num_patches: int | None = None) -> dict[str, torch.Tensor]:
    """`state_dict` as `TIMM_LAYOUT` reads it: `fc_norm` as `norm`, a position row per positioned token."""
    out = dict(state_dict)
    if "fc_norm.weight" in out and "norm.weight" not in out:
        for name in ("weight", "bias"):
            if f"fc_norm.{name}" in out:
                out[f"norm.{name}"] = out.pop(f"fc_norm.{name}")
    pos = out.get("pos_embed")
    positioned, registers = _prefix_counts(out)
    if not isinstance(pos, torch.Tensor) or pos.ndim != 3 or not (positioned or registers):
        return out
    rows = pos.shape[1]
    if registers and square_side(rows - positioned - registers):  # registers with positions: fold them in
        start = positioned
        out["reg_token"] = out["reg_token"] + pos[:, start : start + registers].to(out["reg_token"].dtype)
        out["pos_embed"] = torch.cat([pos[:, :start], pos[:, start + registers :]], dim=1)
    elif positioned and _without_token_positions(rows, positioned, num_patches):  # no_embed_class=True
        zeros = pos.new_zeros(1, positioned, pos.shape[2])
        out["pos_embed"] = torch.cat([zeros, pos], dim=1)
    return out


def _without_token_positions(rows: int, positioned: int, num_patches: int | None) -> bool:
    """Whether a position table of `rows` has no rows for its `positioned` tokens."""
    if num_patches in (rows, rows - positioned):
        return rows == num_patches
    return bool(square_side(rows)) and not square_side(rows - positioned)


def _known_num_patches(
    state_dict: Mapping[str, torch.Tensor], image_size: int | Sequence[int] | None, timm_config: Mapping | None
) -> int | None:
    """The patch positions at the image size given, else at timm's `input_size`; None when neither is known."""
    size = image_size_field(image_size) if image_size is not None else _timm_input_size(timm_config)
    weight = state_dict.get("patch_embed.proj.weight")
    if size is None or weight is None or weight.ndim != 4 or not weight.shape[2] or not weight.shape[3]:
        return None
    height, width = (size, size) if isinstance(size, int) else size
    return (height // weight.shape[2]) * (width // weight.shape[3])


def _timm_input_size(timm_config: Mapping | None) -> int | list[int] | None:
    """The image size timm's `config.json` gives (`input_size` as [C, H, W]), or None."""
    if not timm_config:
        return None
    pretrained = timm_config.get("pretrained_cfg") or {}
    size = pretrained.get("input_size") or timm_config.get("input_size")
    if isinstance(size, (list, tuple)) and len(size) == 3 and all(isinstance(v, int) and v > 0 for v in size):
        return image_size_field(list(size[1:]))
    return None


def timm_to_hf_vit_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    config: VisionTransformerConfig | None = None,
    resize_mode: str = "bicubic",
) -> dict[str, torch.Tensor]:
    """A timm ViT state dict under hf-vit names; with `config`, checked and its grid resampled."""
    problems, explained = _timm_problems(state_dict)
    source = {key: value for key, value in state_dict.items() if key not in explained}
    source = timm_canonical(source, config.num_patches if config is not None else None)
    if config is not None:
        source = resample_positions(source, "pos_embed", config, resize_mode, antialias=True)
    return TIMM_LAYOUT.to_hf(source, config, problems)


def hf_vit_to_timm_state_dict(
    state_dict: Mapping[str, torch.Tensor], config: VisionTransformerConfig | None = None
) -> dict[str, torch.Tensor]:
    """The inverse of `timm_to_hf_vit_state_dict`: hf-vit names to timm's `VisionTransformer` names."""
    return TIMM_LAYOUT.from_hf(state_dict, config)


def _timm_classifier(state_dict: Mapping[str, torch.Tensor], pool: str | None, problems: list[str]) -> str | None:
    """hf-vit's `classifier` for timm's attention pooling weights or its `global_pool` (None: read from the tokens)."""
    has_class_token = "cls_token" in state_dict
    if "attn_pool.latent" in state_dict:
        return "map"
    if pool == "avg" or (pool is None and not has_class_token):
        return "gap"
    if pool in (None, "token") and has_class_token:
        return "token"
    if pool == "":
        problems.append(
            "config.json says global_pool='': timm then pools nothing and its head classifies every token "
            "separately, while hf-vit classifies one image representation (the class token, the average of the "
            "patch tokens or attention pooling); set global_pool to 'token', 'avg' or 'map'"
        )
    else:
        problems.append(
            f"config.json says global_pool={pool!r}: hf-vit pools with the class token ('token'), the average of the "
            "patch tokens ('avg') or attention pooling ('map')"
        )
    return None


def infer_config_from_timm(
    state_dict: Mapping[str, torch.Tensor],
    preset: str | None = None,
    image_size: int | Sequence[int] | None = None,
    num_attention_heads: int | None = None,
    timm_config: Mapping | None = None,
) -> VisionTransformerConfig:
    """The hf-vit config of a timm ViT state dict (meta tensors do) and its `config.json` (`timm_config`: the
    pooling, heads, input size and class names)."""
    timm_problems, _ = _timm_problems(state_dict)
    problems = list(timm_problems)
    fc_norm = "fc_norm.weight" in state_dict and "norm.weight" not in state_dict
    num_patches = _known_num_patches(state_dict, image_size, timm_config)  # the grid, when the size is known
    state_dict = timm_canonical(state_dict, num_patches)
    fields = timm_block_fields(state_dict, "patch_embed.proj.weight", "timm ViT", problems)
    width, patch = fields["hidden_size"], fields["patch_size"]
    model_args = (timm_config or {}).get("model_args") or {}
    fields["use_class_token"] = "cls_token" in state_dict
    fields["use_distillation_token"] = "dist_token" in state_dict
    fields["distillation_head"] = "head_dist.weight" in state_dict or "head.weight" not in state_dict
    fields["num_register_tokens"] = _prefix_counts(state_dict)[1]
    fields["fc_norm"] = fc_norm
    if "blocks.0.ls1.gamma" in state_dict:  # the values are loaded; the initial value matters for a re-initialisation
        fields["layer_scale_init_value"] = model_args.get("init_values") or 1e-5
    pool = model_args.get("global_pool", (timm_config or {}).get("global_pool"))
    fields["classifier"] = _timm_classifier(state_dict, pool, problems)
    pre_logits = state_dict.get("pre_logits.fc.weight")
    fields["representation_size"] = pre_logits.shape[0] if pre_logits is not None else None
    head = state_dict.get("head.weight")
    fields["num_labels"] = head.shape[0] if head is not None else 0

    preset_config = load_preset(preset) if preset is not None else None
    heads = num_attention_heads or model_args.get("num_heads") or getattr(preset_config, "num_attention_heads", None)
    heads = heads or _STANDARD_HEADS.get(width)
    if heads is None:
        problems.append(
            f"the number of heads of a width-{width} model cannot be read from a timm state dict; pass a preset or "
            "num_attention_heads"
        )
    fields["num_attention_heads"] = heads

    if image_size is None:
        pos = state_dict.get("pos_embed")
        prefix = _prefix_counts(state_dict)[0]
        if pos is None or pos.ndim != 3:
            problems.append("pos_embed is missing (or not 3-D); pass image_size")
        elif num_patches is not None and pos.shape[1] - prefix == num_patches:
            fields["image_size"] = _timm_input_size(timm_config)
        elif side := square_side(pos.shape[1] - prefix):
            fields["image_size"] = side * patch
        elif not timm_problems:  # else those problems already say why the grid is not square
            problems.append(
                f"pos_embed {tuple(pos.shape)}: the patch positions are not a square grid; pass image_size"
            )
    else:
        fields["image_size"] = image_size_field(image_size)

    if preset_config is not None:
        problems += preset_mismatches(fields, preset_config, preset)
    config = build_config(TIMM_DEFAULTS, fields, problems, "timm checkpoint")
    set_label_names(config, (timm_config or {}).get("label_names"))
    return config


def load_timm_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """timm weights from a `.safetensors` or torch file (`weights_only=True`) or their folder."""
    path = Path(path)
    if path.is_dir():
        names = ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin")
        found = next((path / name for name in names if (path / name).is_file()), None)
        if found is None:
            raise ConversionError(f"{path} holds neither model.safetensors nor pytorch_model.bin.")
        path = found
    if not path.is_file():
        raise ConversionError(f"{path} is not a file; pass timm weights (.safetensors, .pth, .bin) or their folder.")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except SafetensorError as error:
            raise ConversionError(f"Could not read {path} as safetensors: {error}") from error
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - torch raises many kinds for unreadable or unsafe files
        raise ConversionError(
            f"Could not read {path} with torch.load(weights_only=True): {error}. Only plain tensors are read; "
            "files that need unpickling arbitrary objects are refused."
        ) from error
    for wrapper in ("state_dict", "model"):
        if isinstance(loaded, dict) and isinstance(loaded.get(wrapper), dict):
            loaded = loaded[wrapper]
            break
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ConversionError(f"{path} does not hold a state dict of tensors.")
    return dict(loaded)


def timm_processor(
    config: VisionTransformerConfig,
    timm_config: Mapping | None,
    image_mean: Sequence[float] | None = None,
    image_std: Sequence[float] | None = None,
):
    """The processor of a timm checkpoint (see `read_timm_checkpoint`)."""
    from ..model.image_processing_vit import VisionTransformerImageProcessor

    pretrained_cfg = (timm_config or {}).get("pretrained_cfg") or {}

    def pick(given, name):
        value = given if given is not None else (timm_config or {}).get(name, pretrained_cfg.get(name))
        return [0.5] * config.num_channels if value is None else [float(v) for v in value]

    height, width = config.image_hw
    resample = {"bilinear": "bilinear", "bicubic": "bicubic", "nearest": "nearest"}.get(
        pretrained_cfg.get("interpolation"), "bilinear"
    )
    return VisionTransformerImageProcessor(
        size={"height": height, "width": width},
        image_mean=pick(image_mean, "mean"),
        image_std=pick(image_std, "std"),
        resample=resample,
    )


def read_timm_config(folder: Path) -> dict | None:
    """timm's `config.json` in `folder`, or None without one."""
    path = folder / "config.json"
    return read_json(path) if path.is_file() else None


def read_timm_checkpoint(
    input_path: str | os.PathLike,
    preset: str | None = None,
    image_size: int | Sequence[int] | None = None,
    image_mean: Sequence[float] | None = None,
    image_std: Sequence[float] | None = None,
    num_attention_heads: int | None = None,
    resize_mode: str = "bicubic",
):
    """`(config, state_dict, processor)` of timm ViT weights (a file or folder), without writing; for a NaFlexViT a
    preset or another resampling mode is refused."""
    input_path = Path(input_path)
    state_dict = load_timm_state_dict(input_path)
    settings = read_timm_config(input_path if input_path.is_dir() else input_path.parent)
    if settings is None or not str(settings.get("architecture", "")).startswith("naflexvit"):
        config = infer_config_from_timm(state_dict, preset, image_size, num_attention_heads, settings)
        converted = timm_to_hf_vit_state_dict(state_dict, config, resize_mode=resize_mode)
        return config, converted, timm_processor(config, settings, image_mean, image_std)
    from .timm_naflex import naflex_config, naflex_to_hf_vit_state_dict

    if preset is not None:
        raise ConversionError(
            f"preset {preset!r} given for a timm NaFlexViT, whose config.json names its architecture "
            f"{settings.get('architecture')!r}: leave the preset out."
        )
    config = naflex_config(state_dict, settings, image_size, num_attention_heads)
    if image_size is not None and resize_mode != config.interpolation_mode:
        raise ConversionError(
            f"resize_mode {resize_mode!r} given for a timm NaFlexViT, which resamples its position grid "
            f"{config.interpolation_mode} (antialiased, as timm does in its forward pass): leave resize_mode out or "
            f"pass {config.interpolation_mode!r}."
        )
    set_label_names(config, settings.get("label_names"))
    converted = naflex_to_hf_vit_state_dict(state_dict, settings, config)
    return config, converted, timm_processor(config, settings, image_mean, image_std)


def convert_timm_checkpoint(
    input_path: str | os.PathLike, output_dir: str | os.PathLike, overwrite: bool = False, base_model=None, **options
):
    """Convert timm ViT weights into a complete hf-vit folder (`options`: `read_timm_checkpoint`'s); returns the
    model."""
    read = read_timm_checkpoint
    return convert_checkpoint(read, input_path, output_dir, overwrite, "timm's layout", base_model, options)
