"""The ViTs that followed the paper, as transformers saves them -> hf-vit: one rename table and one reading of its
`config.json` per family, converted in memory while transformers loads them (`sources.py`); what hf-vit lacks is
refused by name (DINOv2's SwiGLU and classification head, the text towers).

* DINOv2: LayerScale, final norm on every token; registers without positions.
* DeiT: class and distillation tokens with positions, one or two heads, the pooler as pre-logits layer.
* CLIP: no patch bias, `pre_layrnorm`, quick GELU, `post_layernorm` on the pooled class token only (`fc_norm`).
* SigLIP: no class token, `post_layernorm` on every token, attention pooling (or averaging without the head).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from ..model.configuration_vit import VisionTransformerConfig
from .common import (
    FUSED_QKV,
    POINTWISE_CONV,
    ConversionError,
    Layout,
    Transform,
    grid_mismatch,
    read_json,
    resample_positions,
    square_side,
)

_H = "vit.layers.{i}."
# CLIP and SigLIP store the class token as (D,) and the positions as an nn.Embedding table (N, D).
TOKEN_VECTOR = Transform(lambda x: x.reshape(1, 1, -1), lambda t, config: (t.reshape(-1).clone(),))
POSITION_TABLE = Transform(lambda x: x.unsqueeze(0), lambda t, config: (t[0].clone(),))


def _vit_block(prefix: str) -> list[tuple]:
    """The rows of transformers' ViT-style attention (ViT's, DeiT's, DINOv2's) under `prefix`."""
    qkv = tuple(f"{prefix}attention.attention.{part}.{{p}}" for part in ("query", "key", "value"))
    return [
        (qkv, _H + "attention.qkv.{p}", FUSED_QKV),
        (prefix + "attention.output.dense.{p}", _H + "attention.proj.{p}"),
    ]


def vit_rows(model: str) -> list[tuple]:
    """The rows of transformers' ViT (`model="vit"`) and of DeiT (`"deit"`), which kept its names under its prefix."""
    block = model + ".encoder.layer.{i}."
    return [
        (model + ".embeddings.cls_token", "vit.embeddings.cls_token"),
        (model + ".embeddings.position_embeddings", "vit.embeddings.position_embedding"),
        (model + ".embeddings.patch_embeddings.projection.{p}", "vit.embeddings.patch_embedding.{p}"),
        (block + "layernorm_before.{p}", _H + "norm1.{p}"),
        *_vit_block(block),
        (block + "layernorm_after.{p}", _H + "norm2.{p}"),
        (block + "intermediate.dense.{p}", _H + "mlp.fc1.{p}"),
        (block + "output.dense.{p}", _H + "mlp.fc2.{p}"),
        (model + ".layernorm.{p}", "vit.norm.{p}"),
        (model + ".pooler.dense.{p}", "pre_logits.{p}"),
        ("classifier.{p}", "classifier.{p}"),  # DeiTForImageClassification's, or the teacher model's cls_classifier
    ]


TRANSFORMERS_LAYOUT = Layout(  # the saved layout
    "transformers ViT checkpoint",
    [
        *vit_rows("vit"),
        # ViTForMaskedImageModeling (SimMIM): the [mask] embedding, and the decoder's 1x1 convolution as a linear map
        ("vit.embeddings.mask_token", "vit.embeddings.mask_token"),
        ("decoder.0.weight", "decoder.weight", POINTWISE_CONV),
        ("decoder.0.bias", "decoder.bias"),
    ],
)
# transformers v5 renames these fragments of the saved names in memory (`ViTForImageClassification.state_dict()`);
# applied in this order, each direction is one pass.
IN_MEMORY_NAMES = (
    ("vit.encoder.layer.", "vit.layers."),
    ("attention.attention.query.", "attention.q_proj."),
    ("attention.attention.key.", "attention.k_proj."),
    ("attention.attention.value.", "attention.v_proj."),
    ("attention.output.dense.", "attention.o_proj."),
    ("intermediate.dense.", "mlp.fc1."),
    ("output.dense.", "mlp.fc2."),
)


def _vit_name(key: str) -> str:
    """A transformers ViT weight's name in the saved layout, whichever names it came with."""
    if not key.startswith(("vit.", "classifier.", "decoder.")):
        key = f"vit.{key}"  # a bare ViTModel saves without the prefix
    return functools.reduce(lambda k, names: k.replace(names[1], names[0]), IN_MEMORY_NAMES, key)


_D = "encoder.layer.{i}."
DINOV2_LAYOUT = Layout(
    "transformers DINOv2 checkpoint",
    [
        ("embeddings.cls_token", "vit.embeddings.cls_token"),
        ("embeddings.register_tokens", "vit.embeddings.register_tokens"),
        ("embeddings.position_embeddings", "vit.embeddings.position_embedding"),
        ("embeddings.patch_embeddings.projection.{p}", "vit.embeddings.patch_embedding.{p}"),
        (_D + "norm1.{p}", _H + "norm1.{p}"),
        *_vit_block(_D),
        (_D + "layer_scale1.lambda1", _H + "layer_scale1.gamma"),
        (_D + "norm2.{p}", _H + "norm2.{p}"),
        (_D + "mlp.fc1.{p}", _H + "mlp.fc1.{p}"),
        (_D + "mlp.fc2.{p}", _H + "mlp.fc2.{p}"),
        (_D + "layer_scale2.lambda1", _H + "layer_scale2.gamma"),
        ("layernorm.{p}", "vit.norm.{p}"),
    ],
)
DEIT_LAYOUT = Layout(
    "transformers DeiT checkpoint",
    [
        *vit_rows("deit"),
        ("deit.embeddings.distillation_token", "vit.embeddings.distillation_token"),
        ("distillation_classifier.{p}", "distillation_classifier.{p}"),
    ],
)
_C = "encoder.layers.{i}."
_TOWER_BLOCK = [
    (_C + "layer_norm1.{p}", _H + "norm1.{p}"),
    (tuple(f"{_C}self_attn.{part}_proj.{{p}}" for part in "qkv"), _H + "attention.qkv.{p}", FUSED_QKV),
    (_C + "self_attn.out_proj.{p}", _H + "attention.proj.{p}"),
    (_C + "layer_norm2.{p}", _H + "norm2.{p}"),
    (_C + "mlp.fc1.{p}", _H + "mlp.fc1.{p}"),
    (_C + "mlp.fc2.{p}", _H + "mlp.fc2.{p}"),
]
CLIP_LAYOUT = Layout(
    "CLIP vision tower",
    [
        ("embeddings.class_embedding", "vit.embeddings.cls_token", TOKEN_VECTOR),
        ("embeddings.patch_embedding.weight", "vit.embeddings.patch_embedding.weight"),
        ("embeddings.position_embedding.weight", "vit.embeddings.position_embedding", POSITION_TABLE),
        ("pre_layrnorm.{p}", "vit.pre_norm.{p}"),
        *_TOWER_BLOCK,
        ("post_layernorm.{p}", "vit.norm.{p}"),
    ],
)
SIGLIP_LAYOUT = Layout(
    "SigLIP vision tower",
    [
        ("embeddings.patch_embedding.{p}", "vit.embeddings.patch_embedding.{p}"),
        ("embeddings.position_embedding.weight", "vit.embeddings.position_embedding", POSITION_TABLE),
        *_TOWER_BLOCK,
        ("post_layernorm.{p}", "vit.norm.{p}"),
        ("head.probe", "vit.attention_pool.probe"),
        ("head.attention.in_proj_weight", "vit.attention_pool.attention.in_proj_weight"),
        ("head.attention.in_proj_bias", "vit.attention_pool.attention.in_proj_bias"),
        ("head.attention.out_proj.{p}", "vit.attention_pool.attention.out_proj.{p}"),
        ("head.layernorm.{p}", "vit.attention_pool.layernorm.{p}"),
        ("head.mlp.fc1.{p}", "vit.attention_pool.mlp.fc1.{p}"),
        ("head.mlp.fc2.{p}", "vit.attention_pool.mlp.fc2.{p}"),
    ],
)


def _transformers_config(model_type: str, config: dict) -> Any:
    """transformers' own config class of `model_type` read from `config` (its defaults filled in)."""
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type].from_dict(config)
    except (TypeError, ValueError, KeyError) as error:
        raise ConversionError(
            f"config.json does not describe a {model_type} model transformers can build: {error}"
        ) from error


def _side(value: Any, name: str) -> int:
    """A size that transformers allows as N or (N, N), as hf-vit's int; a non-square one is refused by name."""
    if isinstance(value, (list, tuple)):
        if len(value) == 2 and value[0] == value[1]:
            return int(value[0])
        raise ConversionError(f"{name}={list(value)}: hf-vit reads a square {name} from this config")
    return int(value)


def _fields(source: Any, **renamed: str) -> dict[str, Any]:
    """The hf-vit fields of a transformers vision config: the shared ones, and `renamed` (hf-vit name -> source)."""
    fields = {
        name: getattr(source, name)
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "hidden_act", "layer_norm_eps",
                     "num_channels", "initializer_range")
        if getattr(source, name, None) is not None
    }  # fmt: skip
    fields.update({name: getattr(source, other) for name, other in renamed.items()})
    fields["image_size"] = _side(source.image_size, "image_size")
    fields["patch_size"] = _side(source.patch_size, "patch_size")
    return fields


def _dinov2(config: dict, keys: Collection[str]) -> dict[str, Any]:
    source = _transformers_config(config["model_type"], config)
    if getattr(source, "use_swiglu_ffn", False):
        raise ConversionError(
            "use_swiglu_ffn=True: DINOv2's SwiGLU feed-forward network (of the giant models) is a block hf-vit "
            "lacks (its MLP is fc1, the activation, fc2); load it with transformers' Dinov2Model"
        )
    if "classifier.weight" in keys:
        raise ConversionError(
            "Dinov2ForImageClassification's head classifies the class token concatenated with the mean of the "
            "patch tokens, a head hf-vit lacks; load the backbone's Dinov2Model checkpoint and fine-tune a new head"
        )
    fields = _fields(source, hidden_dropout_prob="hidden_dropout_prob", qkv_bias="qkv_bias")
    fields.update(
        intermediate_size=int(source.hidden_size * source.mlp_ratio),
        attention_probs_dropout_prob=source.attention_probs_dropout_prob,
        drop_path_rate=source.drop_path_rate,
        layer_scale_init_value=source.layerscale_value,
        num_register_tokens=getattr(source, "num_register_tokens", 0),
        # transformers' DINOv2 with registers resamples its positions with antialiasing, DINOv2 without
        interpolation_antialias=config["model_type"] == "dinov2_with_registers",
        num_labels=0,
    )
    return fields


def vit_fields(config: dict, keys: Collection[str]) -> dict[str, Any]:
    """The fields of transformers' ViT or DeiT (`config["model_type"]`) whose weights are named `keys`: a classifier's
    labels, else no classes and the pooler (dense + tanh on the class token) as the pre-logits layer; a classifier
    ignores a pooler, as `ViTForImageClassification` does."""
    model = config["model_type"]
    source = _transformers_config(model, config)
    fields = _fields(
        source, intermediate_size="intermediate_size", hidden_dropout_prob="hidden_dropout_prob",
        attention_probs_dropout_prob="attention_probs_dropout_prob", qkv_bias="qkv_bias",
    )  # fmt: skip
    if "classifier.weight" in keys:
        labels = source.id2label or {}
        fields["id2label"] = {int(k): v for k, v in labels.items()}
        fields["label2id"] = {v: int(k) for k, v in labels.items()}
        if source.problem_type is not None:
            fields["problem_type"] = source.problem_type
    else:
        fields["num_labels"] = 0
        if f"{model}.pooler.dense.weight" in keys:
            if source.pooler_act != "tanh":
                name = {"vit": "ViT", "deit": "DeiT"}[model]
                raise ConversionError(
                    f"pooler_act={source.pooler_act!r}: hf-vit's pre-logits layer ({name}'s pooler) is dense + tanh, "
                    f"so this pooler would compute another function; load it with transformers' {name}Model"
                )
            fields["representation_size"] = source.pooler_output_size or source.hidden_size
    return fields


def _deit(config: dict, keys: Collection[str]) -> dict[str, Any]:
    fields = vit_fields(config, keys)
    fields["use_distillation_token"] = True
    if "classifier.weight" in keys:
        fields["distillation_head"] = "distillation_classifier.weight" in keys
    return fields


def _tower(config: dict, family: str) -> tuple[Any, dict[str, Any]]:
    """The vision tower's config and fields, of a two-tower checkpoint or a vision-only one (not a text tower)."""
    model_type = config["model_type"]
    if model_type.endswith("_text_model"):
        raise ConversionError(
            f"model_type {model_type!r} is {family}'s text tower alone: it has no vision tower to load (pass the full "
            f"{family} checkpoint or its vision model)"
        )
    source = _transformers_config(model_type, config)
    source = source.vision_config if hasattr(source, "vision_config") else source
    return source, _fields(
        source, intermediate_size="intermediate_size", attention_probs_dropout_prob="attention_dropout"
    )


def _clip(config: dict, keys: Collection[str]) -> dict[str, Any]:
    fields = _tower(config, "CLIP")[1]
    return {**fields, "pre_norm": True, "fc_norm": True, "patch_embedding_bias": False, "num_labels": 0}


def _siglip(config: dict, keys: Collection[str]) -> dict[str, Any]:
    source, fields = _tower(config, "SigLIP")
    pool = "map" if getattr(source, "vision_use_head", True) else "gap"
    return {**fields, "classifier": pool, "use_class_token": False, "num_labels": 0}


def _strip(prefix: str) -> Callable[[str], str]:
    return lambda key: key[len(prefix) :] if key.startswith(prefix) else key


def _deit_name(key: str) -> str:
    if key.startswith("cls_classifier."):
        return "classifier." + key[len("cls_classifier.") :]
    if not key.startswith(("deit.", "classifier.", "distillation_classifier.")):
        return f"deit.{key}"  # DeiTModel saves without the prefix
    return key


@dataclasses.dataclass(frozen=True)
class Family:
    """One family: its table, key renaming (`dropped`: not the vision encoder), config reading, position key."""

    name: str
    layout: Layout
    config_fields: Callable[[dict, Collection[str]], dict[str, Any]]
    rename: Callable[[str], str]
    dropped: str
    positions: str
    # How the family's processor reads a `size` saved as one number: a square, or (DINOv2's BitImageProcessor,
    # CLIP's) the shorter side.
    square_size: bool = True

    def names(self, arrays: Mapping[str, Any]) -> dict[str, Any]:
        """`arrays` under the table's names, without the arrays that are not part of the vision encoder."""
        renamed = {self.rename(key): value for key, value in arrays.items()}
        return {key: value for key, value in renamed.items() if not re.match(self.dropped, key)}


_DINOV2 = Family(
    "transformers' DINOv2 layout", DINOV2_LAYOUT, _dinov2, _strip("dinov2."), r"embeddings\.mask_token$",
    "embeddings.position_embeddings", square_size=False,
)  # fmt: skip
_CLIP_DROPPED = r"text_model\.|text_projection\.|visual_projection\.|logit_scale$|logit_bias$"
_CLIP = Family(
    "CLIP's layout", CLIP_LAYOUT, _clip, _strip("vision_model."), _CLIP_DROPPED,
    "embeddings.position_embedding.weight", square_size=False,
)  # fmt: skip
_SIGLIP = Family(
    "SigLIP's layout", SIGLIP_LAYOUT, _siglip, _strip("vision_model."), _CLIP_DROPPED,
    "embeddings.position_embedding.weight",
)  # fmt: skip
FAMILIES: dict[str, Family] = {
    "vit": Family(
        "transformers' ViT layout",
        TRANSFORMERS_LAYOUT,
        vit_fields,
        _vit_name,
        r"$^",
        "vit.embeddings.position_embeddings",
    ),
    "dinov2": _DINOV2,
    "dinov2_with_registers": _DINOV2,
    "deit": Family(
        "transformers' DeiT layout", DEIT_LAYOUT, _deit, _deit_name, r"$^", "deit.embeddings.position_embeddings"
    ),
    **dict.fromkeys(("clip", "clip_vision_model", "clip_text_model"), _CLIP),
    **dict.fromkeys(("siglip", "siglip_vision_model", "siglip_text_model"), _SIGLIP),
}


def family_config(
    config_json: dict,
    keys: Collection[str],
    image_size: Any = None,
    where: str | None = None,
) -> VisionTransformerConfig:
    """The hf-vit config of a family checkpoint (`where`: its config.json's path, for errors)."""
    family = FAMILIES[config_json["model_type"]]
    names = family.names(dict.fromkeys(keys))
    fields = family.config_fields(config_json, names)
    if image_size is not None:
        fields["image_size"] = image_size
    dtype = config_json.get("dtype", config_json.get("torch_dtype"))
    if dtype is not None:
        fields["dtype"] = dtype
    try:
        config = VisionTransformerConfig(zero_init_head=False, **fields)
    except ValueError as error:
        raise ConversionError(
            f"{where or 'config.json'} does not describe a model hf-vit can build: {error}"
        ) from error
    return config


def positions_problems(source: dict, shapes: dict | None, key: str, config: VisionTransformerConfig, resample: bool):
    """Resample the position table `source[key]` (`(1, N, D)` or `(N, D)`, of a square grid) to `config`'s grid in
    place when `resample`; the problem of a grid that is not `config`'s otherwise (`shapes`: `source` as meta tensors,
    read lazily)."""
    positions, prefix = (shapes if shapes is not None else source).get(key), config.num_position_prefix_tokens
    if positions is None or positions.ndim not in (2, 3):
        return []
    found = positions.shape[-2] - prefix
    side = square_side(found)
    if not (resample and side and found != config.num_patches):
        return grid_mismatch(found, config)
    array = source[key] if isinstance(source[key], torch.Tensor) else source[key][...]  # one small array, read now
    resampling = config.interpolation_mode, config.interpolation_antialias
    resampled = resample_positions({key: array if array.ndim == 3 else array[None]}, key, config, *resampling)[key]
    source[key] = resampled if array.ndim == 3 else resampled[0]
    if shapes is not None:
        shapes[key] = source[key].to("meta")
    return []


def family_state_dict(
    model_type: str,
    source: Mapping[str, Any],
    config: VisionTransformerConfig,
    shapes: Mapping[str, torch.Tensor] | None = None,
    resample: bool = False,
):
    """A family checkpoint's weights for `config`; with `shapes` (meta tensors) lazily as loading reads them
    (`Layout.to_hf_lazy`). `resample`: another grid resampled, else refused (as transformers refuses it)."""
    family = FAMILIES[model_type]
    source, shapes = family.names(source), family.names(shapes) if shapes is not None else None
    if config.representation_size is None:  # a classifier ignores a pooler, as ViTForImageClassification does
        source = {k: v for k, v in source.items() if ".pooler." not in k}
        shapes = {k: v for k, v in shapes.items() if ".pooler." not in k} if shapes is not None else None
    problems = positions_problems(source, shapes, family.positions, config, resample)
    if shapes is None:
        return family.layout.to_hf(source, config, problems)
    return family.layout.to_hf_lazy(source, shapes, config, problems)


def transformers_processor(folder: Path, image_size: tuple[int, int], default_to_square: bool = True):
    """The hf-vit processor of a folder's `preprocessor_config.json` (the model's size without one): its resize,
    centre crop, rescaling and normalisation; other settings are refused by name. `default_to_square`: whether a
    `size` saved as one number is a square or the shorter side (DINOv2's, CLIP's)."""
    from ..model.image_processing_vit import VisionTransformerImageProcessor

    path = folder / "preprocessor_config.json"
    settings = read_json(path) if path.is_file() else {}
    keep = (
        "do_resize", "size", "resample", "do_center_crop", "crop_size", "do_rescale", "rescale_factor",
        "do_normalize", "image_mean", "image_std", "do_convert_rgb",
    )  # fmt: skip
    kwargs = {k: settings[k] for k in keep if settings.get(k) is not None}
    kwargs.setdefault("size", {"height": image_size[0], "width": image_size[1]})
    if not default_to_square and isinstance(kwargs["size"], int) and not isinstance(kwargs["size"], bool):
        kwargs["size"] = {"shortest_edge": kwargs["size"]}
    try:
        return VisionTransformerImageProcessor(**kwargs)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{path} has settings hf-vit cannot use: {error}") from error
