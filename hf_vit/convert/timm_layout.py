"""timm's `VisionTransformer` names against hf-vit's (one table, both ways), and the timm features hf-vit does not
have, by the arrays that reveal them: shared by the converters of timm's ViTs and of its NaFlexViTs."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from .common import ConversionError, Layout, Transform, count_blocks

_B, _H = "blocks.{i}.", "vit.layers.{i}."
# timm's attention pooling projects the latent (q) and the tokens (kv: rows [k; v]) apart; torch's
# MultiheadAttention, which hf-vit's pooling uses, holds them as one [q; k; v].
_Q_KV = Transform(
    lambda q, kv: torch.cat([q, kv]),
    lambda qkv, config: (qkv[: qkv.shape[0] // 3].clone(), qkv[qkv.shape[0] // 3 :].clone()),
    True,
)
TIMM_LAYOUT = Layout(
    "timm checkpoint",
    [
        ("patch_embed.proj.{p}", "vit.embeddings.patch_embedding.{p}"),
        ("cls_token", "vit.embeddings.cls_token"),
        ("dist_token", "vit.embeddings.distillation_token"),
        ("reg_token", "vit.embeddings.register_tokens"),
        ("pos_embed", "vit.embeddings.position_embedding"),
        ("norm_pre.{p}", "vit.pre_norm.{p}"),
        (_B + "norm1.{p}", _H + "norm1.{p}"),
        (_B + "attn.qkv.{p}", _H + "attention.qkv.{p}"),
        (_B + "attn.proj.{p}", _H + "attention.proj.{p}"),
        (_B + "ls1.gamma", _H + "layer_scale1.gamma"),
        (_B + "ls2.gamma", _H + "layer_scale2.gamma"),
        (_B + "norm2.{p}", _H + "norm2.{p}"),
        (_B + "mlp.fc1.{p}", _H + "mlp.fc1.{p}"),
        (_B + "mlp.fc2.{p}", _H + "mlp.fc2.{p}"),
        ("norm.{p}", "vit.norm.{p}"),  # timm's fc_norm is renamed to norm first: hf-vit's fc_norm uses `norm`
        ("attn_pool.latent", "vit.attention_pool.probe"),
        (("attn_pool.q.{p}", "attn_pool.kv.{p}"), "vit.attention_pool.attention.in_proj_{p}", _Q_KV),
        ("attn_pool.proj.{p}", "vit.attention_pool.attention.out_proj.{p}"),
        ("attn_pool.norm.{p}", "vit.attention_pool.layernorm.{p}"),
        ("attn_pool.mlp.fc1.{p}", "vit.attention_pool.mlp.fc1.{p}"),
        ("attn_pool.mlp.fc2.{p}", "vit.attention_pool.mlp.fc2.{p}"),
        ("pre_logits.fc.{p}", "pre_logits.{p}"),
        ("head.{p}", "classifier.{p}"),
        ("head_dist.{p}", "distillation_classifier.{p}"),
    ],
)
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")
# timm features hf-vit does not have, by the arrays that reveal them.
_UNSUPPORTED = (
    (r"\.attn\.(q_norm|k_norm)\.", "QK-norm"),
    (r"\.attn\.norm\.", "a norm inside attention"),
    (r"^attn_pool\.(q_norm|k_norm)\.", "QK-norm in the attention pooling"),
    (r"^patch_embed\.norm\.", "a LayerNorm after the patch embedding"),
    (r"^patch_embed\.backbone\.", "a hybrid CNN backbone"),
    (r"^head\.fc\.|^head\.norm\.", "a multi-layer head"),
)


def _timm_problems(state_dict: Mapping[str, torch.Tensor]) -> tuple[list[str], set[str]]:
    """What makes the timm model compute something hf-vit cannot, whatever the config, and the keys that explains."""
    problems, explained = [], set()
    if "fc_norm.weight" in state_dict and "norm.weight" in state_dict:
        problems.append(
            "the model has both norm and fc_norm: hf-vit has one final LayerNorm, on every token or after the pooling"
        )
        explained = {key for key in state_dict if key.startswith("fc_norm.")}
    latent = state_dict.get("attn_pool.latent")
    if latent is not None and latent.ndim == 3 and latent.shape[1] != 1:
        problems.append(f"attn_pool.latent {tuple(latent.shape)}: hf-vit's attention pooling has one latent (probe)")
    found, keys = [], [key for key in state_dict if key not in explained]
    for pattern, what in _UNSUPPORTED:
        hits = sorted(key for key in keys if re.search(pattern, key))
        if hits:
            found.append(f"{what}: {hits[:4]}{' ...' if len(hits) > 4 else ''}")
            explained.update(hits)
    if found:
        problems.append("timm features hf-vit does not have: " + "; ".join(found))
    return problems, explained


def timm_block_fields(arrays: Mapping[str, torch.Tensor], embedding: str, what: str, problems: list[str]) -> dict:
    """The sizes a timm-style state dict's patch embedding and blocks give (`what`: for errors)."""
    weight = arrays.get(embedding)
    if weight is None or weight.ndim != 4:
        raise ConversionError(
            f"This is not a {what} state dict: it has no 4-D '{embedding}'. First keys: {sorted(arrays)[:6]}"
        )
    width, channels, patch, patch_w = weight.shape
    if patch != patch_w:
        problems.append(f"{embedding} {tuple(weight.shape)}: non-square patches are not supported")
    fields = dict(hidden_size=width, num_channels=channels, patch_size=patch)
    fields["num_hidden_layers"] = count_blocks(arrays, _BLOCK_KEY, problems)
    if not fields["num_hidden_layers"]:
        raise ConversionError(f"This {what} state dict has no Transformer blocks ('blocks.<i>.*').")
    fc1 = arrays.get("blocks.0.mlp.fc1.weight")
    if fc1 is None:
        problems.append("blocks.0.mlp.fc1.weight is missing")
    else:
        fields["intermediate_size"] = fc1.shape[0]
    fields["qkv_bias"] = "blocks.0.attn.qkv.bias" in arrays
    fields["pre_norm"] = "norm_pre.weight" in arrays
    return fields
