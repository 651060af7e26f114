"""The models compared: hf-vit, transformers' ViT and timm's ViT built with identical weights, the check that they
compute the same logits, and their analytic FLOPs (from which the model FLOPs utilisation, MFU, is computed)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from hf_vit import VisionTransformerConfig, VisionTransformerForImageClassification
from hf_vit.convert.timm_vit import TIMM_DEFAULTS, hf_vit_to_timm_state_dict
from hf_vit.convert.transformers_vit import hf_vit_to_transformers_module_state_dict

from .settings import HF_VIT, TIMM, TRANSFORMERS, BenchmarkSettings
from .timing import autocast, logits_of


def hf_vit_config(settings: BenchmarkSettings, image_size: int | None = None) -> VisionTransformerConfig:
    """The preset's config with dropout off and a non-zero head (a zero head would make the logits check trivial)."""
    fields = dict(num_labels=settings.num_labels, zero_init_head=False, hidden_dropout_prob=0.0, drop_path_rate=0.0)
    sizes = dict(num_hidden_layers=settings.num_hidden_layers, image_size=image_size or settings.image_size)
    fields.update({key: value for key, value in sizes.items() if value is not None}, attention_probs_dropout_prob=0.0)
    return VisionTransformerConfig.from_preset(settings.model, **fields)


def build_hf_vit(config: VisionTransformerConfig, seed: int = 0) -> VisionTransformerForImageClassification:
    torch.manual_seed(seed)
    model = VisionTransformerForImageClassification._from_config(config, attn_implementation="sdpa")
    # Non-trivial values everywhere (biases start at zero, LayerNorm at identity), so the logits check means something.
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def transformers_from_hf_vit(model: VisionTransformerForImageClassification) -> nn.Module:
    """transformers' `ViTForImageClassification` with the same configuration and weights as `model`."""
    from transformers import ViTConfig, ViTForImageClassification

    config = model.config
    height, width = config.image_hw
    if height != width:
        raise ValueError("transformers' ViT benchmark needs a square image size.")
    if config.classifier != "token" or config.representation_size is not None:
        raise ValueError("transformers' ViTForImageClassification has a class-token head and no pre-logits layer.")
    same = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act")
    same += ("layer_norm_eps", "patch_size", "num_channels", "qkv_bias", "num_labels")
    fields = {name: getattr(config, name) for name in same}
    fields.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, image_size=height)
    reference = ViTForImageClassification._from_config(ViTConfig(**fields), attn_implementation="sdpa")
    state = hf_vit_to_transformers_module_state_dict(model.state_dict())
    reference.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True)
    return reference.to(next(model.parameters()).device)


def timm_from_hf_vit(model: VisionTransformerForImageClassification) -> nn.Module:
    """timm's `VisionTransformer` with the same configuration and weights; raises ImportError without timm."""
    from timm.models.vision_transformer import VisionTransformer

    config = model.config
    if config.hidden_act != TIMM_DEFAULTS["hidden_act"]:
        raise ValueError(f"timm's ViT uses exact GELU; the model uses {config.hidden_act!r}.")
    kwargs = {}
    if config.layer_norm_eps != TIMM_DEFAULTS["layer_norm_eps"]:
        kwargs["norm_layer"] = functools.partial(nn.LayerNorm, eps=config.layer_norm_eps)
    kwargs.update(img_size=config.image_hw, patch_size=config.patch_size, in_chans=config.num_channels)
    kwargs.update(num_classes=config.num_labels, embed_dim=config.hidden_size, depth=config.num_hidden_layers)
    kwargs.update(num_heads=config.num_attention_heads, mlp_ratio=config.intermediate_size / config.hidden_size)
    reference = VisionTransformer(**kwargs, qkv_bias=config.qkv_bias, global_pool="token", class_token=True)
    state = hf_vit_to_timm_state_dict(model.state_dict())
    reference.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True)
    return reference.to(next(model.parameters()).device)


def build_models(
    settings: BenchmarkSettings, device: torch.device, image_size: int | None = None
) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """hf-vit, transformers' ViT and (when asked for and importable) timm's ViT, with identical weights, on `device`;
    and for those left out, why."""
    ours = build_hf_vit(hf_vit_config(settings, image_size), settings.seed)
    models = {HF_VIT: ours.to(device), TRANSFORMERS: transformers_from_hf_vit(ours)}
    skipped = {} if settings.timm else {TIMM: "not requested"}
    if settings.timm:
        try:
            models[TIMM] = timm_from_hf_vit(ours)
        except Exception as error:  # noqa: BLE001 - timm is optional; any failure only drops its column
            skipped[TIMM] = f"{type(error).__name__}: {error}"
    return models, skipped


@torch.no_grad()
def compare_logits(models: dict[str, nn.Module], pixel_values: torch.Tensor, dtype: str = "fp32") -> dict[str, float]:
    logits = {}
    for name, model in models.items():
        with autocast(pixel_values.device, dtype):
            logits[name] = logits_of(model.eval()(pixel_values)).float()
    reference = logits[HF_VIT]
    return {name: (value - reference).abs().max().item() for name, value in logits.items() if name != HF_VIT}


# ----------------------------------------------------------------------------------------------------------- FLOPs


def vit_forward_flops(config: VisionTransformerConfig, image_size: int | None = None) -> dict[str, int]:
    """Forward FLOPs of one image (a multiply-add is 2 FLOPs) of the matrix products, per part of the model; LayerNorm,
    GELU, softmax and residual adds are left out (a few percent of the total)."""
    height, width = (image_size, image_size) if image_size else config.image_hw
    patch = config.patch_size
    patches = (height // patch) * (width // patch)
    tokens = patches + config.num_prefix_tokens
    dim, hidden, depth = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    parts = {
        "patch_embedding": 2 * patches * config.num_channels * patch * patch * dim,
        "qkv": depth * 2 * tokens * dim * 3 * dim,
        "attention_scores": depth * 2 * tokens * tokens * dim,
        "attention_weighted_sum": depth * 2 * tokens * tokens * dim,
        "attention_projection": depth * 2 * tokens * dim * dim,
        "mlp": depth * 2 * tokens * dim * hidden * 2,
        "head": 2 * (config.representation_size or dim) * config.num_labels
        + (2 * dim * config.representation_size if config.representation_size else 0),
    }
    parts["total"] = sum(parts.values())
    return parts


# A training step costs about 3x the forward (the backward computes the gradients of both the activations and the
# weights, each as much as the forward).
TRAIN_STEP_FORWARD_MULTIPLE = 3
# Dense (not 2:4 sparse) bf16 tensor-core peaks from the vendors' data sheets, in TFLOP/s, by a substring of
# `torch.cuda.get_device_name()`; the first match wins, so the more specific names come first.
BF16_DENSE_PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200": 989.0, "B200": 2250.0}
BF16_DENSE_PEAK_TFLOPS.update({"A100": 312.0, "L40S": 362.0, "A10G": 70.0})  # "H100" alone: the SXM


def step_flops(forward_flops_total: int, mode: str) -> int:
    """FLOPs of one image in a training step ("train", 3x the forward) or an inference step ("infer")."""
    return forward_flops_total * (TRAIN_STEP_FORWARD_MULTIPLE if mode == "train" else 1)


def dense_bf16_peak(device_name: str | None, override_tflops: float | None = None) -> dict | None:
    """{"flops_per_s", "source"}: the override, else the data-sheet peak of the named GPU, else None (e.g. a CPU)."""
    if override_tflops is not None:
        return {"flops_per_s": override_tflops * 1e12, "source": "--peak_tflops"}
    key = next((key for key in BF16_DENSE_PEAK_TFLOPS if key in (device_name or "")), None)
    tflops = BF16_DENSE_PEAK_TFLOPS.get(key)
    return key and {"flops_per_s": tflops * 1e12, "source": f"data sheet: {key} dense bf16 {tflops:g} TFLOP/s"}
