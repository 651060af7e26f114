"""big_vision's `.npz` checkpoints (`models/vit.py`, and FlexiViT's `models/proj/flexi/vit.py`) -> hf-vit.

big_vision names its parameters after its own modules, numbered per type within each parent (vit_jax numbers them in
order of creation), and keeps the position embedding at the top level:

    embedding/kernel, embedding/bias                          (P, P, C, D), (D,)  FlexiViT's at its base patch size 32
    pos_embedding                                             (1, h * w, D)  added BEFORE the class token is
                                                              prepended: the class token has no position (a zero one
                                                              here, which adds nothing); FlexiViT's grid is 7x7
    cls                                                       (1, 1, D)      only with pooling "tok"
    Transformer/encoderblock_{i}/LayerNorm_0, LayerNorm_1     {scale, bias}
    Transformer/encoderblock_{i}/MultiHeadDotProductAttention_0/{query,key,value,out}/{kernel,bias}
    Transformer/encoderblock_{i}/MlpBlock_0/Dense_0, Dense_1  {kernel, bias}
    Transformer/encoder_norm                                  {scale, bias}
    MAPHead_0/probe                                           (1, 1, D)      attention pooling ("map")
    MAPHead_0/MultiHeadDotProductAttention_0/..., MAPHead_0/LayerNorm_0, MAPHead_0/MlpBlock_0/Dense_{0,1}
    pre_logits/{kernel,bias}, head/{kernel,bias}

A `params/` prefix (and the optimizer state under `opt/` beside it) is accepted. Pooling is "gap" (the average of every
token: there is no class token then), "tok" (the class token) or "map" (attention pooling). `BIG_VISION_LAYOUT` is the
table; a file is recognised as big_vision's by these names (`is_big_vision`), before vit_jax's table is tried.

FlexiViT resamples the position grid in its forward pass with `jax.image.resize(..., "linear")` (antialiased when it
shrinks): the converted config records `interpolation_mode="bilinear"` and `interpolation_antialias=True`, so
`interpolate_pos_encoding`, native-aspect batches and `image_size=` at load resample as it does. Its GELU is Flax's
tanh approximation (`gelu_pytorch_tanh`). Sin-cos position embeddings (`posemb="sincos2d"`, no `pos_embedding`
array) and stacked blocks (`scan=True`) are refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ..model.configuration_vit import VisionTransformerConfig
from ..model.resolution import grid_for, resample_position_embeddings
from .common import (
    ConversionError,
    Layout,
    build_config,
    count_blocks,
    image_size_field,
    load_preset,
    preset_mismatches,
    square_side,
)
from .flax_layout import CONV, DENSE, _tensor, array_shape, attention_rows, mlp_rows, norm_rows

_B, _H = "Transformer/encoderblock_{i}/", "vit.layers.{i}."
_MAP, _HMAP = "MAPHead_0/", "vit.attention_pool."


def _qkv(prefix: str, name: str) -> tuple[str, str, str]:
    return tuple(f"{prefix}MultiHeadDotProductAttention_0/{part}/{name}" for part in ("query", "key", "value"))


BIG_VISION_LAYOUT = Layout(
    "big_vision .npz checkpoint",
    [
        ("embedding/kernel", "vit.embeddings.patch_embedding.weight", CONV),
        ("embedding/bias", "vit.embeddings.patch_embedding.bias"),
        ("cls", "vit.embeddings.cls_token"),
        ("pos_embedding", "vit.embeddings.position_embedding"),
        *norm_rows(_B + "LayerNorm_0/", _H + "norm1."),
        *attention_rows(_B + "MultiHeadDotProductAttention_0/", _H + "attention.qkv.", _H + "attention.proj."),
        *norm_rows(_B + "LayerNorm_1/", _H + "norm2."),
        *mlp_rows(_B + "MlpBlock_0/", _H + "mlp."),
        *norm_rows("Transformer/encoder_norm/", "vit.norm."),
        (_MAP + "probe", _HMAP + "probe"),
        *attention_rows(
            _MAP + "MultiHeadDotProductAttention_0/", _HMAP + "attention.in_proj_", _HMAP + "attention.out_proj."
        ),
        *norm_rows(_MAP + "LayerNorm_0/", _HMAP + "layernorm."),
        *mlp_rows(_MAP + "MlpBlock_0/", _HMAP + "mlp."),
        ("pre_logits/kernel", "pre_logits.weight", DENSE),
        ("pre_logits/bias", "pre_logits.bias"),
        ("head/kernel", "classifier.weight", DENSE),
        ("head/bias", "classifier.bias"),
    ],
)
_BLOCK_KEY = re.compile(r"^Transformer/encoderblock_(\d+)/")
# names only big_vision writes: the top-level position table, the MAP head, the blocks' attention numbered from 0
_BIG_VISION_KEY = re.compile(
    r"^(pos_embedding$|MAPHead_0/|Transformer/encoderblock_\d+/MultiHeadDotProductAttention_0/)"
)
BIG_VISION_DEFAULTS = {
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu_pytorch_tanh",
    "interpolation_mode": "bilinear",
    "interpolation_antialias": True,
}


def _strip(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The parameters without a `params/` prefix; the optimizer state beside them (`opt/`) left out."""
    prefixed = any(key.startswith("params/") for key in arrays)
    return {
        key.removeprefix("params/"): value
        for key, value in arrays.items()
        if not key.startswith("opt/") and (key.startswith("params/") or not prefixed)
    }


def is_big_vision(arrays: Mapping[str, np.ndarray]) -> bool:
    """Whether an `.npz` checkpoint's arrays carry big_vision's names (see the module docstring)."""
    return any(_BIG_VISION_KEY.match(key) for key in _strip(arrays))


def big_vision_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`arrays` as `BIG_VISION_LAYOUT` reads them: the prefix stripped, a zero class position prepended to the
    position table where there is a class token (big_vision adds the positions before prepending it)."""
    out = _strip(arrays)
    if "Transformer/pos_embedding" in out and "pos_embedding" not in out:  # its place before 2022
        out["pos_embedding"] = out.pop("Transformer/pos_embedding")
    if any(key.startswith("Transformer/encoderblock/") for key in out):
        raise ConversionError(
            "The Transformer blocks are stacked into one 'Transformer/encoderblock/...' set of arrays (big_vision "
            "with scan=True); this layout is not supported. Unstack them into 'Transformer/encoderblock_<i>/'."
        )
    if "embedding/kernel" in out and "pos_embedding" not in out:
        raise ConversionError(
            "The checkpoint has no 'pos_embedding': big_vision's fixed sin-cos position embeddings "
            "(posemb='sincos2d'), which hf-vit does not have (it learns its position table)."
        )
    pos = out.get("pos_embedding")
    if "cls" in out and isinstance(pos, np.ndarray) and pos.ndim == 3:
        out["pos_embedding"] = np.concatenate([np.zeros_like(pos[:, :1]), pos], axis=1)
    return out


def infer_config_from_big_vision(
    arrays: Mapping[str, np.ndarray],
    preset: str | None = None,
    image_size: int | Sequence[int] | None = None,
    hidden_act: str | None = None,
) -> VisionTransformerConfig:
    """The hf-vit config of a big_vision `.npz` checkpoint, read from its array shapes: width, patch size and
    channels from the embedding kernel, heads from the query kernel, the MLP from `Dense_0`, pooling from `cls`
    ("token"), `MAPHead_0` ("map") or neither ("gap"), the image size from the (square) position grid unless given;
    `preset`'s sizes must match the arrays."""
    source = big_vision_arrays(arrays)
    problems: list[str] = []

    def shape_of(key: str, ndim: int) -> tuple[int, ...] | None:
        return array_shape(source, key, ndim, problems)

    fields: dict = {}
    kernel = shape_of("embedding/kernel", 4)
    if kernel is not None:
        if kernel[0] != kernel[1]:
            problems.append(f"embedding/kernel {kernel}: non-square {kernel[0]}x{kernel[1]} patches are not supported")
        fields.update(patch_size=kernel[0], num_channels=kernel[2], hidden_size=kernel[3])
    fields["num_hidden_layers"] = count_blocks(source, _BLOCK_KEY, problems)
    query = shape_of(_qkv(_B.format(i=0), "kernel")[0], 3)
    if query is not None:
        fields["num_attention_heads"] = query[1]
    dense = shape_of(_B.format(i=0) + "MlpBlock_0/Dense_0/kernel", 2)
    if dense is not None:
        fields["intermediate_size"] = dense[1]
    fields["qkv_bias"] = _qkv(_B.format(i=0), "bias")[0] in source
    fields["classifier"] = "token" if "cls" in source else "map" if _MAP + "probe" in source else "gap"
    if "cls" in source and _MAP + "probe" in source:
        problems.append("the checkpoint has both a class token (cls) and attention pooling (MAPHead_0)")
    pre_logits = source.get("pre_logits/kernel")
    fields["representation_size"] = int(pre_logits.shape[1]) if isinstance(pre_logits, np.ndarray) else None
    head = source.get("head/kernel")
    fields["num_labels"] = int(head.shape[1]) if isinstance(head, np.ndarray) and head.ndim == 2 else 0
    if image_size is not None:
        fields["image_size"] = image_size_field(image_size)
    elif (pos := shape_of("pos_embedding", 3)) is not None and kernel is not None:
        patches = pos[1] - int("cls" in source)
        if side := square_side(patches):
            fields["image_size"] = side * kernel[0]
        else:
            problems.append(f"pos_embedding {pos}: {patches} positions are not a square grid; pass image_size")
    if preset is not None:
        problems += preset_mismatches(fields, load_preset(preset), preset)
    base = dict(BIG_VISION_DEFAULTS, **({"hidden_act": hidden_act} if hidden_act else {}))
    return build_config(base, fields, problems, "big_vision checkpoint")


def big_vision_to_hf_vit_state_dict(
    arrays: Mapping[str, np.ndarray], config: VisionTransformerConfig, resize_mode: str | None = None
) -> dict[str, torch.Tensor]:
    """The arrays of a big_vision `.npz` checkpoint under hf-vit's names, checked against `config`'s model; the
    position grid resampled to `config`'s grid when the checkpoint's square grid differs, with `resize_mode` (default:
    the config's, FlexiViT's bilinear) and the config's antialiasing."""
    source = {key: _tensor(value) for key, value in big_vision_arrays(arrays).items()}
    pos, prefix = source.get("pos_embedding"), config.num_position_prefix_tokens
    if isinstance(pos, torch.Tensor) and pos.ndim == 3 and pos.shape[1] != prefix + config.num_patches:
        side = square_side(pos.shape[1] - prefix)
        if side:
            grid_for(config.image_size, config.patch_size)
            source["pos_embedding"] = resample_position_embeddings(
                pos, (side, side), config.grid_size, prefix,
                resize_mode or config.interpolation_mode, config.interpolation_antialias,
            ).contiguous()  # fmt: skip
    return BIG_VISION_LAYOUT.to_hf(source, config)
