"""The Vision Transformer of "An Image is Worth 16x16 Words" (Dosovitskiy et al., 2020) in PyTorch.

`forward` follows the paper's four equations:

    z0  = [x_class; x_p^1 E; ...; x_p^N E] + E_pos      (1)  VisionTransformerEmbeddings
    z'l = MSA(LN(z_{l-1})) + z_{l-1}                     (2)  VisionTransformerBlock
    zl  = MLP(LN(z'l)) + z'l                             (3)  VisionTransformerBlock
    y   = LN(zL^0)                                       (4)  VisionTransformerModel

The hybrid architecture (section 3.1) takes the patches x_p from the feature map of a ResNet stem (`hybrid.py`)
instead of the image; masked patch prediction (section 4.6) corrupts some of the x_p^i E before the positions are added
and predicts their mean colours (`VisionTransformerForMaskedPatchPrediction`).

This file is also saved next to checkpoints as remote code (`trust_remote_code=True`), so it imports only torch,
transformers and the code files beside it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.backbone_utils import BackboneMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BackboneOutput, BaseModelOutputWithPooling, ImageClassifierOutput
from transformers.utils import ModelOutput

from .attention import ALL_ATTENTION_FUNCTIONS, eager_attention_forward
from .configuration_vit import VisionTransformerConfig, image_size_field
from .foreign import open_foreign
from .hybrid import ResNetStem, ResNetUnit, StdConv2d
from .resolution import grid_for, resample_position_embeddings

__all__ = [
    "PATCH_CLEAN",
    "PATCH_KEPT",
    "PATCH_MASKED",
    "PATCH_RANDOM",
    "MaskedPatchPredictionOutput",
    "VisionTransformerBackbone",
    "VisionTransformerForImageClassification",
    "VisionTransformerForMaskedPatchPrediction",
    "VisionTransformerIntermediates",
    "VisionTransformerModel",
    "VisionTransformerPreTrainedModel",
    "check_pixel_values",
    "corrupt_patches",
    "draw_patch_corruption",
]

# What masked patch prediction does to each patch embedding (a `patch_corruption` tensor holds these codes): left
# alone, replaced by the [mask] embedding, replaced by another patch's embedding, or kept but predicted all the same.
PATCH_CLEAN, PATCH_MASKED, PATCH_RANDOM, PATCH_KEPT = 0, 1, 2, 3


def check_pixel_values(
    pixel_values: torch.Tensor, config: VisionTransformerConfig, interpolate_pos_encoding: bool
) -> None:
    """Reject inputs the model cannot embed, with a message that says how to fix them."""
    if not isinstance(pixel_values, torch.Tensor):
        raise TypeError(f"`pixel_values` must be a torch.Tensor, got {type(pixel_values).__name__}.")
    if pixel_values.ndim != 4:
        raise ValueError(
            "`pixel_values` must have 4 dimensions (batch, channels, height, width), got shape "
            f"{tuple(pixel_values.shape)}. Add a batch dimension with `pixel_values[None]` for one image."
        )
    batch, channels, height, width = pixel_values.shape
    if batch == 0:
        raise ValueError("`pixel_values` is an empty batch (batch size 0); pass at least one image.")
    if not pixel_values.is_floating_point():
        raise TypeError(
            f"`pixel_values` must be a floating point tensor, got {pixel_values.dtype}. Run the image processor, "
            "or convert integer pixels with `.float() / 255` and normalise them."
        )
    if channels != config.num_channels:
        hint = (
            " The image processor converts images to RGB by default: build it with `do_convert_rgb=False` to keep "
            f"{config.num_channels} channels (e.g. RGB + infrared)."
            if channels == 3
            else ""
        )
        raise ValueError(
            f"`pixel_values` has {channels} channels but the model expects {config.num_channels} "
            f"(shape {tuple(pixel_values.shape)}; the layout is channels first: batch, channels, height, width).{hint}"
        )
    if height % config.patch_size or width % config.patch_size:
        raise ValueError(
            f"Image size {height}x{width} is not divisible by the patch size {config.patch_size}; "
            "resize or crop the images to a multiple of it."
        )
    if not interpolate_pos_encoding and (height, width) != config.image_hw:
        raise ValueError(
            f"Image size {height}x{width} differs from the model's {config.image_hw[0]}x{config.image_hw[1]}. Pass "
            "`interpolate_pos_encoding=True` to interpolate the position embeddings to the new size, or resize "
            "the images (the image processor does it)."
        )


def draw_patch_corruption(
    batch_size: int,
    num_patches: int,
    config: VisionTransformerConfig,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Masked patch prediction's corruption of `batch_size` images of `num_patches` patches, as B.1.2 of the paper
    describes it: `config.mpp_corrupt_ratio` of each image's patches (rounded half up) are corrupted, each of them
    replaced by the [mask] embedding with probability `mpp_mask_ratio`, by another patch's embedding with probability
    `mpp_random_ratio`, and kept otherwise. Returns `(batch_size, num_patches)` int64 codes (`PATCH_CLEAN`,
    `PATCH_MASKED`, `PATCH_RANDOM`, `PATCH_KEPT`)."""
    count = int(config.mpp_corrupt_ratio * num_patches + 0.5)
    # The ranks of uniform draws are a uniform random permutation: the `count` lowest are corrupted.
    ranks = torch.rand(batch_size, num_patches, generator=generator, device=device).argsort(dim=1).argsort(dim=1)
    kind = torch.rand(batch_size, num_patches, generator=generator, device=device)
    codes = torch.where(
        kind < config.mpp_mask_ratio,
        PATCH_MASKED,
        torch.where(kind < config.mpp_mask_ratio + config.mpp_random_ratio, PATCH_RANDOM, PATCH_KEPT),
    )
    return torch.where(ranks < count, codes, PATCH_CLEAN)


def corrupt_patches(
    tokens: torch.Tensor, patch_corruption: torch.Tensor, mask_token: torch.Tensor | None
) -> torch.Tensor:
    """Apply `patch_corruption` codes `(B, N)` to patch embeddings `(B, N, D)`. A `PATCH_RANDOM` patch takes the
    embedding of another patch drawn uniformly from the whole batch (as BERT's random token is drawn from the
    vocabulary rather than from its own sentence)."""
    batch, count, dim = tokens.shape
    if tuple(patch_corruption.shape) != (batch, count):
        raise ValueError(
            f"`patch_corruption` has shape {tuple(patch_corruption.shape)} but the images have {count} patches each "
            f"(expected ({batch}, {count}))."
        )
    if mask_token is None:
        raise ValueError(
            "This model has no [mask] embedding: corrupt patches with VisionTransformerForMaskedPatchPrediction (or "
            "a VisionTransformerModel built with use_mask_token=True)."
        )
    total = batch * count
    flat = tokens.reshape(total, dim)
    # Draw among the total - 1 other patches: values at or above a patch's own index move up by one.
    source = torch.randint(0, max(total - 1, 1), (total,), device=tokens.device)
    source = source + (source >= torch.arange(total, device=tokens.device)).long() if total > 1 else source
    others = flat[source].view(batch, count, dim)
    tokens = torch.where((patch_corruption == PATCH_RANDOM)[..., None], others, tokens)
    return torch.where((patch_corruption == PATCH_MASKED)[..., None], mask_token.to(tokens.dtype), tokens)


class VisionTransformerEmbeddings(nn.Module):
    """Equation (1): linear patch embedding `E`, the class token, and learned 1D position embeddings `E_pos`.

    In a hybrid the patches come from the ResNet stem's feature map; with `use_mask_token` the embeddings can be
    corrupted for masked patch prediction (`patch_corruption`)."""

    def __init__(self, config: VisionTransformerConfig, use_mask_token: bool = False) -> None:
        super().__init__()
        self.config = config
        self.stem = ResNetStem(config) if config.resnet_layers is not None else None
        # A stride-P convolution is the linear map E applied to every flattened P x P patch (of the stem's feature
        # map in a hybrid, where P is `embedding_patch_size`, e.g. 1).
        patch = config.embedding_patch_size
        self.patch_embedding = nn.Conv2d(config.stem_channels, config.hidden_size, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size)) if config.classifier == "token" else None
        self.mask_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size)) if use_mask_token else None
        num_positions = config.num_patches + config.num_prefix_tokens
        self.position_embedding = nn.Parameter(torch.zeros(1, num_positions, config.hidden_size))
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, pixel_values: torch.Tensor, patch_corruption: torch.Tensor | None = None) -> torch.Tensor:
        pixel_values = pixel_values.to(self.patch_embedding.weight.dtype)
        # x_p are the image's patches, or the hybrid's patches of the ResNet feature map (section 3.1)
        features = pixel_values if self.stem is None else self.stem(pixel_values)
        patches = self.patch_embedding(features)  # (B, D, H/P, W/P)
        tokens = patches.flatten(2).transpose(1, 2)  # (B, N, D): x_p^i E
        if patch_corruption is not None:  # masked patch prediction: before the positions, as BERT's [MASK]
            tokens = corrupt_patches(tokens, patch_corruption, self.mask_token)
        if self.cls_token is not None:
            tokens = torch.cat([self.cls_token.expand(tokens.shape[0], -1, -1), tokens], dim=1)
        # E_pos, resampled in 2D when the grid is not the one the model was trained on
        position_embedding = resample_position_embeddings(
            self.position_embedding, self.config.grid_size, patches.shape[2:], self.config.num_prefix_tokens
        )
        return self.dropout(tokens + position_embedding)


class VisionTransformerAttention(nn.Module):
    """Multi-head self-attention (MSA) with one fused projection for queries, keys and values."""

    def __init__(self, config: VisionTransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.dropout = config.attention_probs_dropout_prob
        self.is_causal = False
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.qkv_bias)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self, hidden_states: torch.Tensor, output_attentions: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, tokens, width = hidden_states.shape
        # (B, N, 3D) -> three (B, heads, N, d_h) views of one buffer: no copies before attention. Unbinding before
        # transposing lets the backward stack the three gradients straight into the (B, N, 3, heads, d_h) layout of
        # the qkv output, whose view back to (B, N, 3D) is then free (one copy, not two).
        qkv = self.qkv(hidden_states).view(batch, tokens, 3, self.num_heads, self.head_dim)
        query, key, value = (part.transpose(1, 2) for part in qkv.unbind(2))
        # Only the eager function returns the probabilities.
        implementation = "eager" if output_attentions else self.config._attn_implementation
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        output, probs = attention(
            self, query, key, value, None, scaling=self.scaling, dropout=self.dropout if self.training else 0.0
        )
        return self.proj(output.reshape(batch, tokens, width)), probs


class VisionTransformerMLP(nn.Module):
    """The two-layer MLP with a GELU non-linearity (the paper's MLP block)."""

    def __init__(self, config: VisionTransformerConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.dropout(self.act(self.fc1(hidden_states)))))


class DropPath(nn.Module):
    """Stochastic depth: drop a residual branch for a random subset of the samples while training."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate

    def forward(self, branch: torch.Tensor) -> torch.Tensor:
        if self.rate == 0.0 or not self.training:
            return branch
        keep = 1.0 - self.rate
        mask = branch.new_empty((branch.shape[0],) + (1,) * (branch.ndim - 1)).bernoulli_(keep)
        return branch * mask / keep

    def extra_repr(self) -> str:
        return f"rate={self.rate}"


class VisionTransformerBlock(GradientCheckpointingLayer):
    """One pre-norm Transformer encoder block: equations (2) and (3)."""

    def __init__(self, config: VisionTransformerConfig, drop_path_rate: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = VisionTransformerAttention(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionTransformerMLP(config)
        self.drop_path = DropPath(drop_path_rate)

    def forward(
        self, hidden_states: torch.Tensor, output_attentions: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attended, probs = self.attention(self.norm1(hidden_states), output_attentions)
        hidden_states = hidden_states + self.drop_path(self.dropout(attended))  # (2)
        hidden_states = hidden_states + self.drop_path(self.mlp(self.norm2(hidden_states)))  # (3)
        return hidden_states, probs


def _lecun_normal_(tensor: torch.Tensor) -> None:
    """Flax's lecun_normal: a normal of variance 1/fan_in truncated at two standard deviations."""
    fan_in = tensor[0].numel()  # (out, in, ...) layouts: everything but the first dimension feeds one output
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # rescaled so the truncated values have variance 1/fan_in
    init.trunc_normal_(tensor, mean=0.0, std=std, a=-2 * std, b=2 * std)


class VisionTransformerPreTrainedModel(PreTrainedModel):
    """Weight initialisation and the conventions shared by the hf-vit models."""

    config_class = VisionTransformerConfig
    config: VisionTransformerConfig
    base_model_prefix = "vit"
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    supports_gradient_checkpointing = True
    _no_split_modules = ["VisionTransformerEmbeddings", "VisionTransformerBlock"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    # The loss is a mean over the batch. Telling Trainer so keeps it from expecting a sum over `num_items_in_batch`
    # and multiplying the loss by the number of processes.
    accepts_loss_kwargs = False
    # Weights a checkpoint may lack, because they belong to a new head: loading starts them from `_init_weights`.
    _new_weight_prefixes: tuple[str, ...] = ("classifier.", "pre_logits.")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' `from_pretrained`, taking also the checkpoints users have (transformers' and timm's ViT as Hub
        ids or folders, the authors' `.npz` files; converted in memory by the reader `hf_vit.convert` registers), and
        strict: weights that leave part of the encoder randomly initialised are an error (only a classification head
        may be new), and unreadable weights or folders are named."""
        output_loading_info = kwargs.pop("output_loading_info", False)
        source = pretrained_model_name_or_path
        foreign = open_foreign(source, kwargs)
        if foreign is None and isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
            raise OSError(f"{os.fspath(source)!r} is a file: pass the folder that holds it and its config.json.")
        try:
            if foreign is not None:  # transformers' or timm's ViT, or the authors' .npz, converted in memory
                model, info = foreign.load_model(
                    super().from_pretrained, args, {**kwargs, "output_loading_info": True}
                )
            else:
                model, info = super().from_pretrained(source, *args, output_loading_info=True, **kwargs)
        except SafetensorError as error:
            raise OSError(
                f"Could not read the weights in {source}: the safetensors file is corrupted or truncated ({error}). "
                "Save or download the checkpoint again."
            ) from error
        except OSError as error:
            if isinstance(source, (str, os.PathLike)) and not os.path.exists(source):
                raise OSError(
                    f"{os.fspath(source)!r} is not a local folder, and loading it as a Hugging Face Hub model id "
                    f"failed: {error}"
                ) from error
            raise
        missing = sorted(key for key in info["missing_keys"] if not key.startswith(cls._new_weight_prefixes))
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(
                f"The weights in {source} do not fit {cls.__name__}: {len(missing)} of its weights are not in the "
                f"checkpoint ({shown}) and would stay randomly initialised. Is it a checkpoint of another model?"
            )
        return (model, info) if output_loading_info else model

    @torch.no_grad()
    def set_input_size(self, image_size: int | tuple[int, int] | list[int], mode: str = "bicubic") -> None:
        """Change the model's resolution in place (the paper's fine-tuning at higher resolution): the position
        embeddings are resampled in 2D to the new patch grid, and the config says the new size, so the model runs
        there without `interpolate_pos_encoding`."""
        old_grid, new_grid = self.config.grid_size, grid_for(image_size, self.config.patch_size)
        embeddings = self.base_model.embeddings
        resampled = resample_position_embeddings(
            embeddings.position_embedding, old_grid, new_grid, self.config.num_prefix_tokens, mode
        )
        embeddings.position_embedding = nn.Parameter(
            resampled.contiguous(), requires_grad=embeddings.position_embedding.requires_grad
        )
        self.config.image_size = image_size_field(image_size)

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        # transformers skips parameter-less containers (attention, MLP, the classifier model) for custom code, but
        # those are where the roles of their linear layers are known. Every initialiser below leaves parameters loaded
        # from a checkpoint untouched, so the shortcut is not needed.
        super()._initialize_weights(module, is_custom_code=False)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The initialisation of the authors' code (vit_jax): Xavier-uniform kernels, near-zero MLP biases,
        LeCun-normal patch embedding, normal(0.02) positions, zero class token and zero classifier."""
        std = self.config.initializer_range
        if isinstance(module, VisionTransformerEmbeddings):
            _lecun_normal_(module.patch_embedding.weight)
            init.zeros_(module.patch_embedding.bias)
            init.normal_(module.position_embedding, std=std)
            if module.cls_token is not None:
                init.zeros_(module.cls_token)
            if module.mask_token is not None:
                init.normal_(module.mask_token, std=std)
        elif isinstance(module, StdConv2d):  # flax.linen.Conv's default kernel initialiser
            _lecun_normal_(module.weight)
        elif isinstance(module, nn.GroupNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, ResNetUnit):
            # The last GroupNorm of a unit starts at zero scale (applied after its children's initialisation), so
            # that each unit starts as its shortcut.
            init.zeros_(module.gn3.weight)
        elif isinstance(module, VisionTransformerAttention):
            # Query, key and value are three D x D maps, each Xavier-uniform: one draw with a D x D matrix's bound.
            bound = math.sqrt(6.0 / (2 * module.qkv.in_features))
            init.uniform_(module.qkv.weight, -bound, bound)
            init.xavier_uniform_(module.proj.weight)
            if module.qkv.bias is not None:
                init.zeros_(module.qkv.bias)
            init.zeros_(module.proj.bias)
        elif isinstance(module, VisionTransformerMLP):
            for layer in (module.fc1, module.fc2):
                init.xavier_uniform_(layer.weight)
                init.normal_(layer.bias, std=1e-6)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, VisionTransformerForImageClassification):
            if module.pre_logits is not None:
                _lecun_normal_(module.pre_logits.weight)
                init.zeros_(module.pre_logits.bias)
            if isinstance(module.classifier, nn.Linear):
                if self.config.zero_init_head:
                    init.zeros_(module.classifier.weight)
                else:
                    _lecun_normal_(module.classifier.weight)
                init.zeros_(module.classifier.bias)
        elif isinstance(module, VisionTransformerForMaskedPatchPrediction):
            _lecun_normal_(module.mpp_head.weight)
            init.zeros_(module.mpp_head.bias)


class VisionTransformerModel(VisionTransformerPreTrainedModel):
    """The ViT encoder: returns every token's final representation and the pooled image representation `y`."""

    def __init__(self, config: VisionTransformerConfig, use_mask_token: bool = False) -> None:
        super().__init__(config)
        self.embeddings = VisionTransformerEmbeddings(config, use_mask_token)
        depth = config.num_hidden_layers
        # Stochastic depth grows linearly with depth, from 0 at the first block to drop_path_rate at the last.
        rates = [config.drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.layers = nn.ModuleList(VisionTransformerBlock(config, rate) for rate in rates)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.patch_embedding

    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        patch_corruption: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPooling | tuple:
        """`patch_corruption`: masked patch prediction's codes `(B, N)` (see `draw_patch_corruption`), applied to the
        patch embeddings; needs a model built with `use_mask_token=True`."""
        if pixel_values is None:
            raise ValueError("`pixel_values` is required: a float tensor (batch, channels, height, width).")
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        return_dict = self.config.return_dict if return_dict is None else return_dict

        check_pixel_values(pixel_values, self.config, bool(interpolate_pos_encoding))
        hidden_states = self.embeddings(pixel_values, patch_corruption)  # (1)
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        for block in self.layers:
            hidden_states, probs = block(hidden_states, output_attentions)  # (2), (3)
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            if output_attentions:
                all_attentions += (probs,)
        sequence_output = self.norm(hidden_states)
        # (4): the class token's final state, or the average of the patch tokens for classifier="gap".
        pooled_output = sequence_output[:, 0] if self.config.classifier == "token" else sequence_output.mean(dim=1)

        if not return_dict:
            return tuple(
                v for v in (sequence_output, pooled_output, all_hidden_states, all_attentions) if v is not None
            )
        return BaseModelOutputWithPooling(
            last_hidden_state=sequence_output,
            pooler_output=pooled_output,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
        )

    def forward_intermediates(
        self,
        pixel_values: torch.Tensor,
        indices: int | Sequence[int] = 1,
        *,
        norm: bool = False,
        output_fmt: str = "NCHW",
        interpolate_pos_encoding: bool = False,
    ) -> VisionTransformerIntermediates:
        """The outputs of chosen blocks, for dense prediction and feature extraction.

        `indices` is the last n blocks (an int) or block indices (0-based, negative from the end); the forward stops
        after the last block asked for. `norm` applies the final LayerNorm to each output. `output_fmt` is "NCHW"
        (maps on the patch grid, any patch-divisible size, non-square included) or "NLC" (patch tokens); the prefix
        (class) tokens come apart, in `prefix_tokens`.
        """
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}.")
        depth = len(self.layers)
        wanted = list(range(depth - indices, depth)) if isinstance(indices, int) else list(indices)
        if not wanted or any(not -depth <= index < depth for index in wanted):
            raise ValueError(f"indices must name blocks 0..{depth - 1} (or -{depth}..-1), got {indices!r}.")
        wanted = [index % depth for index in wanted]
        check_pixel_values(pixel_values, self.config, interpolate_pos_encoding)
        grid = (pixel_values.shape[-2] // self.config.patch_size, pixel_values.shape[-1] // self.config.patch_size)
        prefix = self.config.num_prefix_tokens
        hidden_states = self.embeddings(pixel_values)
        outputs = {}
        for index, block in enumerate(self.layers[: max(wanted) + 1]):
            hidden_states, _ = block(hidden_states)
            if index in wanted:
                outputs[index] = self.norm(hidden_states) if norm else hidden_states
        features, prefix_tokens = [], []
        for index in wanted:
            tokens = outputs[index]
            prefix_tokens.append(tokens[:, :prefix])
            patches = tokens[:, prefix:]
            if output_fmt == "NCHW":
                patches = patches.reshape(patches.shape[0], grid[0], grid[1], -1).permute(0, 3, 1, 2).contiguous()
            features.append(patches)
        return VisionTransformerIntermediates(features=tuple(features), prefix_tokens=tuple(prefix_tokens))


@dataclass
class VisionTransformerIntermediates(ModelOutput):
    """Outputs of chosen blocks: `features` as NCHW maps or NLC patch tokens, `prefix_tokens` (B, prefix, D)."""

    features: tuple[torch.Tensor, ...] | None = None
    prefix_tokens: tuple[torch.Tensor, ...] | None = None


class VisionTransformerBackbone(BackboneMixin, VisionTransformerModel):
    """ViT as transformers' backbone (`AutoBackbone`) for dense prediction models (UperNet, DPT, ...): the stages
    named by `config.out_features` ("stem", "stage1".."stageL") as NCHW feature maps on the patch grid, after the
    final LayerNorm. Loads the encoder of any hf-vit checkpoint."""

    def __init__(self, config: VisionTransformerConfig) -> None:
        super().__init__(config)
        self.num_features = [config.hidden_size] * (config.num_hidden_layers + 1)

    def forward(
        self,
        pixel_values: torch.Tensor,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        interpolate_pos_encoding: bool = True,
        **kwargs,
    ) -> BackboneOutput | tuple:
        return_dict = self.config.return_dict if return_dict is None else return_dict
        # dense prediction runs at any patch-divisible size: the position embeddings follow it
        outputs = VisionTransformerModel.forward(  # not super(): BackboneMixin defines a forward of its own
            self,
            pixel_values,
            interpolate_pos_encoding=interpolate_pos_encoding,
            output_attentions=output_attentions,
            output_hidden_states=True,
            return_dict=True,
        )
        height, width = pixel_values.shape[-2:]
        rows, cols = height // self.config.patch_size, width // self.config.patch_size
        feature_maps = tuple(
            self.norm(state)[:, self.config.num_prefix_tokens :]
            .reshape(state.shape[0], rows, cols, -1)
            .permute(0, 3, 1, 2)
            .contiguous()
            for stage, state in zip(self.stage_names, outputs.hidden_states)
            if stage in self.out_features
        )
        hidden_states = outputs.hidden_states if output_hidden_states else None
        if not return_dict:
            return tuple(v for v in (feature_maps, hidden_states, outputs.attentions) if v is not None)
        return BackboneOutput(feature_maps=feature_maps, hidden_states=hidden_states, attentions=outputs.attentions)


class VisionTransformerForImageClassification(VisionTransformerPreTrainedModel):
    """ViT with a linear classifier on `y`, optionally after the pre-logits layer (dense + tanh) of pretraining."""

    def __init__(self, config: VisionTransformerConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.vit = VisionTransformerModel(config)
        self._build_head()
        self.post_init()

    def _build_head(self) -> None:
        """The pre-logits layer (dense + tanh, when `representation_size` is set) and the linear classifier."""
        config, width = self.config, self.config.hidden_size
        self.pre_logits = None
        if config.representation_size is not None:
            self.pre_logits = nn.Linear(width, config.representation_size)
            width = config.representation_size
        self.classifier = nn.Linear(width, config.num_labels) if config.num_labels > 0 else nn.Identity()

    @torch.no_grad()
    def reset_classifier(self, id2label: dict[int, str], representation_size: int | None = None) -> None:
        """Replace the head for the classes of `id2label`, as the paper fine-tunes: one zero-initialised linear
        layer on `y` (after a new pre-logits layer of `representation_size`, if given)."""
        config = self.config
        config.id2label = dict(id2label)
        config.label2id = {name: index for index, name in config.id2label.items()}
        config.problem_type = None
        config.representation_size = representation_size or None
        config.zero_init_head = True
        self.num_labels = config.num_labels
        self._build_head()
        reference = self.vit.norm.weight
        for layer in (self.pre_logits, self.classifier):
            if layer is not None:
                layer.to(reference)
        self._init_weights(self)

    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> ImageClassifierOutput | tuple:
        return_dict = self.config.return_dict if return_dict is None else return_dict
        outputs = self.vit(
            pixel_values,
            interpolate_pos_encoding=interpolate_pos_encoding,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        features = outputs.pooler_output
        if self.pre_logits is not None:
            features = torch.tanh(self.pre_logits(features))
        logits = self.classifier(features)
        loss = self.loss_function(labels, logits, self.config) if labels is not None else None

        if not return_dict:
            rest = tuple(v for v in (outputs.hidden_states, outputs.attentions) if v is not None)
            return ((loss, logits) if loss is not None else (logits,)) + rest
        return ImageClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


@dataclass
class MaskedPatchPredictionOutput(ModelOutput):
    """Outputs of masked patch prediction: the cross-entropy over the corrupted patches (`loss`), the mean-colour
    logits of every patch `(B, N, classes)`, and the corruption codes used (`patch_corruption`, None if none)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    patch_corruption: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class VisionTransformerForMaskedPatchPrediction(VisionTransformerPreTrainedModel):
    """ViT pretrained by masked patch prediction (section 4.6, appendix B.1.2): a share of the patch embeddings is
    corrupted (see `draw_patch_corruption`) and a linear head predicts, from each corrupted patch's final
    representation, its mean colour at `config.mpp_color_bits` bits per channel (512 classes for RGB at 3 bits).

    The corruption is drawn here while training unless `patch_corruption` is given (the data pipeline of
    `hf_vit.pretraining` draws it per example); outside training, only a given `patch_corruption` corrupts anything.
    `labels` are the colour classes `(B, N)` of the patches (`hf_vit.pretraining.mean_color_classes`), -100 where
    none; the loss is their cross-entropy over the corrupted patches, or over every labelled patch when nothing is
    corrupted. The encoder's weights are a plain ViT's, so a checkpoint fine-tunes with
    `VisionTransformerForImageClassification.from_pretrained` like any other (the [mask] embedding and this head are
    left out).
    """

    _new_weight_prefixes = ("mpp_head.", "vit.embeddings.mask_token")

    def __init__(self, config: VisionTransformerConfig) -> None:
        super().__init__(config)
        self.vit = VisionTransformerModel(config, use_mask_token=True)
        self.mpp_head = nn.Linear(config.hidden_size, config.mpp_num_classes)
        self.post_init()

    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        patch_corruption: torch.Tensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MaskedPatchPredictionOutput | tuple:
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if patch_corruption is None and self.training and isinstance(pixel_values, torch.Tensor):
            check_pixel_values(pixel_values, self.config, bool(interpolate_pos_encoding))
            patch = self.config.patch_size
            count = (pixel_values.shape[-2] // patch) * (pixel_values.shape[-1] // patch)
            patch_corruption = draw_patch_corruption(
                pixel_values.shape[0], count, self.config, device=pixel_values.device
            )
        outputs = self.vit(
            pixel_values,
            interpolate_pos_encoding=interpolate_pos_encoding,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            patch_corruption=patch_corruption,
        )
        logits = self.mpp_head(outputs.last_hidden_state[:, self.config.num_prefix_tokens :])
        loss = None
        if labels is not None:
            targets = labels.to(logits.device)
            if patch_corruption is not None:
                targets = targets.masked_fill(patch_corruption.to(logits.device) == PATCH_CLEAN, -100)
            # A sum over the labelled patches divided by their number (at least 1): no NaN for a batch without any.
            flat_logits, flat_targets = logits.flatten(0, 1).float(), targets.flatten()
            total = F.cross_entropy(flat_logits, flat_targets, ignore_index=-100, reduction="sum")
            loss = total / (flat_targets != -100).sum().clamp(min=1)

        if not return_dict:
            rest = tuple(v for v in (patch_corruption, outputs.hidden_states, outputs.attentions) if v is not None)
            return ((loss, logits) if loss is not None else (logits,)) + rest
        return MaskedPatchPredictionOutput(
            loss=loss,
            logits=logits,
            patch_corruption=patch_corruption,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
