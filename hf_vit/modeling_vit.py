"""The Vision Transformer of "An Image is Worth 16x16 Words" (Dosovitskiy et al., 2020) in PyTorch.

`forward` follows the paper's four equations:

    z0  = [x_class; x_p^1 E; ...; x_p^N E] + E_pos      (1)  VisionTransformerEmbeddings
    z'l = MSA(LN(z_{l-1})) + z_{l-1}                     (2)  VisionTransformerBlock
    zl  = MLP(LN(z'l)) + z'l                             (3)  VisionTransformerBlock
    y   = LN(zL^0)                                       (4)  VisionTransformerModel

This file is also saved next to checkpoints as remote code (`trust_remote_code=True`), so it imports only torch,
transformers and the configuration file beside it.
"""

from __future__ import annotations

import math
import os

import torch
from safetensors import SafetensorError
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_vit import VisionTransformerConfig

__all__ = [
    "VisionTransformerForImageClassification",
    "VisionTransformerModel",
    "VisionTransformerPreTrainedModel",
    "resample_patch_position_embeddings",
]


def resample_patch_position_embeddings(
    patch_pos: torch.Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int], mode: str = "bicubic"
) -> torch.Tensor:
    """Resample patch position embeddings `(1, old_h * old_w, D)` to a `new_grid` in 2D (the paper's section 3.2).

    Interpolation runs in float32 so that bf16/fp16 models resample as accurately as fp32 ones.
    """
    if tuple(old_grid) == tuple(new_grid):
        return patch_pos
    dim = patch_pos.shape[-1]
    grid = patch_pos.reshape(1, old_grid[0], old_grid[1], dim).permute(0, 3, 1, 2).float()
    grid = F.interpolate(grid, size=tuple(new_grid), mode=mode, align_corners=False)
    return grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(patch_pos.dtype)


class VisionTransformerEmbeddings(nn.Module):
    """Equation (1): linear patch embedding `E`, the class token, and learned 1D position embeddings `E_pos`."""

    def __init__(self, config: VisionTransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_size = config.patch_size
        self.grid_size = config.grid_size
        # A stride-P convolution is the linear map E applied to every flattened P x P patch.
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size)) if config.classifier == "token" else None
        num_positions = config.num_patches + config.num_prefix_tokens
        self.position_embedding = nn.Parameter(torch.zeros(1, num_positions, config.hidden_size))
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def check_pixel_values(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool) -> None:
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
        if channels != self.config.num_channels:
            raise ValueError(
                f"`pixel_values` has {channels} channels but the model expects {self.config.num_channels} "
                f"(shape {tuple(pixel_values.shape)}; the layout is channels first: batch, channels, height, width)."
            )
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(
                f"Image size {height}x{width} is not divisible by the patch size {self.patch_size}; "
                "resize or crop the images to a multiple of it."
            )
        expected = self.config.image_hw
        if (height, width) != tuple(expected) and not interpolate_pos_encoding:
            raise ValueError(
                f"Image size {height}x{width} differs from the model's {expected[0]}x{expected[1]}. Pass "
                "`interpolate_pos_encoding=True` to interpolate the position embeddings to the new size, or resize "
                "the images (the image processor does it)."
            )

    def position_embeddings_for(self, grid: tuple[int, int]) -> torch.Tensor:
        """`E_pos` for a `grid` of patches, resampled in 2D when it is not the grid the model was trained on."""
        if tuple(grid) == tuple(self.grid_size):
            return self.position_embedding
        prefix = self.config.num_prefix_tokens
        patch_pos = resample_patch_position_embeddings(self.position_embedding[:, prefix:], self.grid_size, grid)
        return torch.cat([self.position_embedding[:, :prefix], patch_pos], dim=1)

    def forward(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False) -> torch.Tensor:
        self.check_pixel_values(pixel_values, interpolate_pos_encoding)
        pixel_values = pixel_values.to(self.patch_embedding.weight.dtype)
        patches = self.patch_embedding(pixel_values)  # (B, D, H/P, W/P)
        grid = (patches.shape[2], patches.shape[3])
        tokens = patches.flatten(2).transpose(1, 2)  # (B, N, D): x_p^i E
        if self.cls_token is not None:
            tokens = torch.cat([self.cls_token.expand(tokens.shape[0], -1, -1), tokens], dim=1)
        return self.dropout(tokens + self.position_embeddings_for(grid))


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d_h)) v and the probabilities. Inputs `(B, heads, N, d_h)`, output `(B, N, heads, d_h)`."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    output = torch.matmul(F.dropout(probs, p=dropout, training=module.training), value)
    return output.transpose(1, 2), probs


def matmul_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """softmax(q k^T / sqrt(d_h)) v with two batched matmuls and the softmax in the inputs' dtype.

    The same function as SDPA, used where it is faster: training on CPU in bf16/fp16, where torch's CPU
    flash-attention backward runs its small matmuls far below the AMX/AVX-512 matmul speed and takes a third of a
    ViT-S step. It is not `eager_attention_forward` with another softmax dtype because it scales the (B, heads, N,
    d_h) queries rather than the larger (N, N) scores: a shared version scaling the scores made a bf16 ViT-S
    training step 2-7% slower. Inputs `(B, heads, N, d_h)`, output `(B, N, heads, d_h)`.
    """
    scores = torch.matmul(query * scaling, key.transpose(-1, -2))
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = F.dropout(scores.softmax(dim=-1), p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2), None


# Above this many tokens the matmul attention is left to SDPA: the probabilities it keeps for the backward grow as
# tokens², and its lead had shrunk to 1.04x at 1025 tokens (ViT-S/16 at 512 px, bf16, batch 4).
MATMUL_ATTENTION_MAX_TOKENS = 1024


def prefers_matmul_attention(query: torch.Tensor, training: bool) -> bool:
    """Whether `matmul_attention_forward` beats SDPA's kernels for `query`: CPU, half precision, training.

    Measured on 2 AVX-512/AMX cores, ViT-S/16 shapes (B=16, 6 heads, 197 tokens), forward + backward per block:
    bf16 SDPA 62-66 ms, matmuls 23-27 ms; fp16 SDPA 90-93 ms, matmuls 41-43 ms; fp32 SDPA 36-43 ms, matmuls
    41-46 ms; without autograd SDPA is faster in fp32 and bf16. GPUs keep SDPA's fused kernels.

    "Training" is the module's mode or autograd being on: reentrant activation checkpointing runs the forward without
    autograd and recomputes it with autograd, and both passes must take the same path.
    """
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.bfloat16, torch.float16)
        and (training or query.requires_grad)
        and query.shape[-2] <= MATMUL_ATTENTION_MAX_TOKENS
    )


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
        implementation = self.config._attn_implementation or "sdpa"
        if output_attentions:
            implementation = "eager"  # only the eager path materialises the probabilities
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        if implementation == "eager":
            attention = eager_attention_forward
        elif implementation == "sdpa" and prefers_matmul_attention(query, self.training):
            attention = matmul_attention_forward
        output, probs = attention(
            self,
            query,
            key,
            value,
            None,
            scaling=self.scaling,
            dropout=self.dropout if self.training else 0.0,
            is_causal=False,
        )
        return self.proj(output.reshape(batch, tokens, width)), probs


# Activations that have an in-place ATen kernel computing exactly what ACT2FN's module computes.
_IN_PLACE_GELU = {"gelu": "none", "gelu_pytorch_tanh": "tanh"}


class VisionTransformerMLP(nn.Module):
    """The two-layer MLP with a GELU non-linearity (the paper's MLP block)."""

    def __init__(self, config: VisionTransformerConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.in_place_gelu = _IN_PLACE_GELU.get(config.hidden_act) if isinstance(config.hidden_act, str) else None
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.fc1(hidden_states)
        if self.in_place_gelu is not None and not hidden_states.requires_grad and not _has_hooks(self.fc1, self.act):
            # Without autograd the activation can overwrite fc1's output: one (B, N, 4D) buffer fewer per block,
            # about 3% of a CPU forward. Not when hooks may hold fc1's output or expect the activation module to run.
            hidden_states = torch.ops.aten.gelu_(hidden_states, approximate=self.in_place_gelu)
        else:
            hidden_states = self.act(hidden_states)
        return self.dropout(self.fc2(self.dropout(hidden_states)))


def _has_hooks(*modules: nn.Module) -> bool:
    """Whether forward hooks are registered globally or on any of `modules` or their submodules (e.g. the base
    layer inside an adapter wrapper)."""
    hooks = nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return True
    return any(part._forward_hooks or part._forward_pre_hooks for module in modules for part in module.modules())


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


def _is_loaded(tensor: torch.Tensor) -> bool:
    # from_pretrained marks parameters it filled from the checkpoint; initialising them again would erase them.
    return getattr(tensor, "_is_hf_initialized", False)


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

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' `from_pretrained`, made strict: weights that leave part of the encoder randomly initialised
        are an error (only a classification head may be new), and unreadable weights or folders are named."""
        output_loading_info = kwargs.pop("output_loading_info", False)
        source = pretrained_model_name_or_path
        if isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
            raise OSError(f"{os.fspath(source)!r} is a file: pass the folder that holds it and its config.json.")
        try:
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
        missing = sorted(key for key in info["missing_keys"] if not key.startswith(("classifier.", "pre_logits.")))
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(
                f"The weights in {source} do not fit {cls.__name__}: {len(missing)} of its weights are not in the "
                f"checkpoint ({shown}) and would stay randomly initialised. Is it a checkpoint of another model?"
            )
        return (model, info) if output_loading_info else model

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
        elif isinstance(module, VisionTransformerAttention):
            # Query, key and value are three D x D maps: initialise each as its own Xavier-uniform matrix.
            if not _is_loaded(module.qkv.weight):
                for block in module.qkv.weight.chunk(3, dim=0):
                    nn.init.xavier_uniform_(block)
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


class VisionTransformerModel(VisionTransformerPreTrainedModel):
    """The ViT encoder: returns every token's final representation and the pooled image representation `y`."""

    def __init__(self, config: VisionTransformerConfig) -> None:
        super().__init__(config)
        self.embeddings = VisionTransformerEmbeddings(config)
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
        **kwargs,
    ) -> BaseModelOutputWithPooling | tuple:
        if pixel_values is None:
            raise ValueError("`pixel_values` is required: a float tensor (batch, channels, height, width).")
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        return_dict = self.config.return_dict if return_dict is None else return_dict

        hidden_states = self.embeddings(pixel_values, bool(interpolate_pos_encoding))  # (1)
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


class VisionTransformerForImageClassification(VisionTransformerPreTrainedModel):
    """ViT with a linear classifier on `y`, optionally after the pre-logits layer (dense + tanh) of pretraining."""

    def __init__(self, config: VisionTransformerConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.vit = VisionTransformerModel(config)
        width = config.hidden_size
        self.pre_logits = None
        if config.representation_size is not None:
            self.pre_logits = nn.Linear(width, config.representation_size)
            width = config.representation_size
        self.classifier = nn.Linear(width, config.num_labels) if config.num_labels > 0 else nn.Identity()
        self.post_init()

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
        loss = self.classification_loss(logits, labels) if labels is not None else None

        if not return_dict:
            rest = tuple(v for v in (outputs.hidden_states, outputs.attentions) if v is not None)
            return ((loss, logits) if loss is not None else (logits,)) + rest
        return ImageClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )

    def classification_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of `config.problem_type`, inferred from the labels on first use as transformers does."""
        labels = labels.to(logits.device)
        if self.config.problem_type is None:
            if self.num_labels == 1:
                self.config.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                self.config.problem_type = "single_label_classification"
            else:
                self.config.problem_type = "multi_label_classification"
        if self.config.problem_type == "regression":
            return F.mse_loss(logits.squeeze(-1).float(), labels.squeeze(-1).float())
        if self.config.problem_type == "single_label_classification":
            labels = labels.view(-1)
            # Checked where it costs no device synchronisation; on GPUs torch's own assertion fires.
            if labels.device.type == "cpu" and labels.numel() and not torch.compiler.is_compiling():
                bad = labels[(labels != -100) & ((labels < 0) | (labels >= self.num_labels))]
                if bad.numel():
                    raise ValueError(
                        f"Label {bad[0].item()} is outside the model's {self.num_labels} classes "
                        f"(0..{self.num_labels - 1}; -100 is ignored). Check the data set's labels, or build the "
                        "model with num_labels/id2label covering them."
                    )
            return F.cross_entropy(logits.view(-1, self.num_labels).float(), labels)
        if self.config.problem_type == "multi_label_classification":
            return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
        raise ValueError(
            f"Unknown `problem_type` {self.config.problem_type!r}; use 'regression', "
            "'single_label_classification' or 'multi_label_classification'."
        )
