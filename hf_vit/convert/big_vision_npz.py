"""big_vision's `.npz` checkpoints (`models/vit.py`, and FlexiViT's `models/proj/flexi/vit.py`) -> hf-vit.

big_vision numbers its modules per type within each parent (`MultiHeadDotProductAttention_0`, `LayerNorm_1`,
`MlpBlock_0`), keeps `pos_embedding` at the top level, added BEFORE the class token is prepended (a zero class
position is prepended here), and may pool with `MAPHead_0` ("map"), the class token `cls` ("tok") or the mean ("gap").
A `params/` prefix is accepted. `BIG_VISION_LAYOUT` is the table; `is_big_vision` recognises these names.
FlexiViT resamples its 7x7 position grid with antialiased `jax.image.resize(..., "linear")`: the config records
`interpolation_mode="bilinear"` and `interpolation_antialias=True`, and GELU is Flax's tanh approximation. Sin-cos
position embeddings and stacked blocks (`scan=True`) are refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from .common import Layout
from .flax_layout import CONV, DENSE, attention_rows, mlp_rows, norm_rows

_B, _H = "Transformer/encoderblock_{i}/", "vit.layers.{i}."
_MAP, _HMAP = "MAPHead_0/", "vit.attention_pool."


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


def is_big_vision(arrays: Mapping[str, np.ndarray]) -> bool:
    """Whether an `.npz` checkpoint's arrays carry big_vision's names (see the module docstring)."""
    return any(_BIG_VISION_KEY.match(key.removeprefix("params/")) for key in arrays)
