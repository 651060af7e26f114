"""The initialisation of the authors' code (vit_jax), one function per kind of module, each `(module, config)`:
`modeling_vit.INITIALISERS` says which module each is for (the embeddings, attention, MLP and classifier modules are
`modeling_vit`'s, which imports this file).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import initialization as init

from .configuration_vit import VisionTransformerConfig
from .hybrid import ResNetUnit, StdConv2d
from .layer_scale import LayerScale
from .pooling import MultiheadAttentionPooling


def lecun_normal_(tensor: torch.Tensor) -> None:
    """Flax's lecun_normal: a normal of variance 1/fan_in truncated at two standard deviations."""
    fan_in = tensor[0].numel()  # (out, in, ...) layouts: everything but the first dimension feeds one output
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # rescaled so the truncated values have variance 1/fan_in
    init.trunc_normal_(tensor, mean=0.0, std=std, a=-2 * std, b=2 * std)


def init_embeddings(module: nn.Module, config: VisionTransformerConfig) -> None:
    """Equation (1): a LeCun-normal patch embedding E (as a Flax Conv's default), normal positions, a zero class token
    (the authors' `cls` parameter), normal distillation, register and [mask] embeddings."""
    lecun_normal_(module.patch_embedding.weight)
    if module.patch_embedding.bias is not None:
        init.zeros_(module.patch_embedding.bias)
    init.normal_(module.position_embedding, std=config.initializer_range)
    if module.cls_token is not None:
        init.zeros_(module.cls_token)
    for token in (module.distillation_token, module.register_tokens, module.mask_token):
        if token is not None:
            init.normal_(token, std=config.initializer_range)


def _attention_(qkv: torch.Tensor, qkv_bias: torch.Tensor | None, out: nn.Linear) -> None:
    """Query, key and value are three D x D maps, each Xavier-uniform: one draw with a D x D matrix's bound (not the
    fused D x 3D matrix's); a Xavier-uniform output projection, zero biases."""
    bound = math.sqrt(6.0 / (2 * qkv.shape[1]))
    init.uniform_(qkv, -bound, bound)
    init.xavier_uniform_(out.weight)
    for bias in (qkv_bias, out.bias):
        if bias is not None:
            init.zeros_(bias)


def init_attention(module: nn.Module, config: VisionTransformerConfig) -> None:
    _attention_(module.qkv.weight, module.qkv.bias, module.proj)


def init_mlp(module: nn.Module, config: VisionTransformerConfig) -> None:
    """Xavier-uniform kernels and normal(1e-6) biases, as vit_jax's MlpBlock."""
    for layer in (module.fc1, module.fc2):
        init.xavier_uniform_(layer.weight)
        init.normal_(layer.bias, std=1e-6)


def init_norm(module: nn.LayerNorm | nn.GroupNorm, config: VisionTransformerConfig) -> None:
    init.ones_(module.weight)
    init.zeros_(module.bias)


def init_layer_scale(module: LayerScale, config: VisionTransformerConfig) -> None:
    init.constant_(module.gamma, module.init_value)


def init_attention_pooling(module: MultiheadAttentionPooling, config: VisionTransformerConfig) -> None:
    init.normal_(module.probe, std=config.initializer_range)
    _attention_(module.attention.in_proj_weight, module.attention.in_proj_bias, module.attention.out_proj)


def init_std_conv(module: StdConv2d, config: VisionTransformerConfig) -> None:
    """flax.linen.Conv's default kernel initialiser."""
    lecun_normal_(module.weight)


def init_resnet_unit(module: ResNetUnit, config: VisionTransformerConfig) -> None:
    """The last GroupNorm of a unit starts at zero scale (after its children's initialisation), so that each unit
    starts as its shortcut."""
    init.zeros_(module.gn3.weight)


def init_classification_head(module: nn.Module, config: VisionTransformerConfig) -> None:
    """A LeCun-normal pre-logits layer with a zero bias; the classifiers zero (the paper's fine-tuning,
    `zero_init_head`) or LeCun-normal, with zero biases."""
    if module.pre_logits is not None:
        lecun_normal_(module.pre_logits.weight)
        init.zeros_(module.pre_logits.bias)
    for head in (module.classifier, module.distillation_classifier):
        if isinstance(head, nn.Linear):
            if config.zero_init_head:
                init.zeros_(head.weight)
            else:
                lecun_normal_(head.weight)
            init.zeros_(head.bias)
