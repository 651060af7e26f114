"""The Vision Transformer of "An Image is Worth 16x16 Words" (Dosovitskiy et al., 2020) in PyTorch.

`forward` follows the paper's four equations:

    z0  = [x_class; x_p^1 E; ...; x_p^N E] + E_pos      (1)  VisionTransformerEmbeddings
    z'l = MSA(LN(z_{l-1})) + z_{l-1}                     (2)  VisionTransformerBlock
    zl  = MLP(LN(z'l)) + z'l                             (3)  VisionTransformerBlock
    y   = LN(zL^0)                                       (4)  VisionTransformerModel

The blocks of the family that followed the paper are config fields, off by default, each a term of one of these
steps: a distillation token beside x_class and register tokens after them (1), a LayerNorm after (1) (`pre_norm`),
LayerScale on the residual branches of (2) and (3) (`layer_scale.py`), and in (4) the average of the patch tokens or
attention pooling (`pooling.py`) instead of the class token, with the LayerNorm after the pooling (`fc_norm`).

The hybrid architecture (section 3.1) takes the patches x_p from the feature map of a ResNet stem (`hybrid.py`);
masked patch prediction (section 4.6, `modeling_mpp.py`) corrupts some of the x_p^i E before the positions are added.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.backbone_utils import BackboneMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BackboneOutput, BaseModelOutputWithPooling, ImageClassifierOutput
from transformers.utils import ModelOutput, can_return_tuple
from transformers.utils.output_capturing import capture_outputs

from .attention import ALL_ATTENTION_FUNCTIONS, eager_attention_forward
from .configuration_vit import VisionTransformerConfig
from .embeddings import VisionTransformerEmbeddings
from .hybrid import ResNetUnit, StdConv2d
from .layer_scale import LayerScale
from .layout import (
    AttentionSegments,
    BatchLayout,
    batch_fields,
    check_native_batch,
    patch_grid_maps,
)
from .loading import (
    give_weights_the_umask_mode,
    load_strictly,
    open_foreign,
    resize_asked_by_config,
    save_sibling_code,
)
from .pooling import MultiheadAttentionPooling
from .resolution import (
    check_pixel_values,
    grid_for,
    image_size_field,
    resample_patch_embedding_layer,
    resample_position_embeddings,
)
from .weight_init import (
    init_attention,
    init_attention_pooling,
    init_classification_head,
    init_embeddings,
    init_layer_scale,
    init_mlp,
    init_norm,
    init_resnet_unit,
    init_std_conv,
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
        self, hidden_states: torch.Tensor, output_attentions: bool = False, attention_mask: torch.Tensor | None = None
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
        dropout = self.dropout if self.training else 0.0
        output, probs = attention(self, query, key, value, attention_mask, scaling=self.scaling, dropout=dropout)
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

    def forward(self, branch: torch.Tensor, segments: AttentionSegments | None = None) -> torch.Tensor:
        """`branch` `(B, N, D)`, one draw per image: per row, or per image of a packed batch's tokens (`segments`)."""
        if self.rate == 0.0 or not self.training:
            return branch
        keep = 1.0 - self.rate
        images = None if segments is None else segments.token_images()
        if images is None:
            mask = branch.new_empty((branch.shape[0],) + (1,) * (branch.ndim - 1)).bernoulli_(keep)
        else:
            mask = branch.new_empty(segments.token_mask.shape[0] + 1).bernoulli_(keep)[images].view(1, -1, 1)
        return branch * mask / keep

    def extra_repr(self) -> str:
        return f"rate={self.rate}"


class VisionTransformerBlock(GradientCheckpointingLayer):
    """One pre-norm Transformer encoder block: equations (2) and (3), each branch scaled by LayerScale when the
    config has `layer_scale_init_value`."""

    def __init__(self, config: VisionTransformerConfig, drop_path_rate: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = VisionTransformerAttention(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionTransformerMLP(config)
        self.drop_path = DropPath(drop_path_rate)
        scale, width = config.layer_scale_init_value, config.hidden_size
        self.layer_scale1 = LayerScale(width, scale) if scale is not None else nn.Identity()
        self.layer_scale2 = LayerScale(width, scale) if scale is not None else nn.Identity()

    def forward(
        self, hidden_states: torch.Tensor, output_attentions: bool = False, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attended, probs = self.attention(self.norm1(hidden_states), output_attentions, attention_mask)
        segments = attention_mask if isinstance(attention_mask, AttentionSegments) else None
        hidden_states = hidden_states + self.drop_path(self.layer_scale1(self.dropout(attended)), segments)  # (2)
        branch = self.layer_scale2(self.mlp(self.norm2(hidden_states)))
        hidden_states = hidden_states + self.drop_path(branch, segments)  # (3)
        return hidden_states, probs


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
    # transformers' `capture_outputs` records `hidden_states` (the embeddings and every block's output) and
    # `attentions` (the probabilities each attention returns with the eager implementation) from these modules.
    _can_record_outputs = {"hidden_states": VisionTransformerBlock, "attentions": VisionTransformerAttention}
    # The loss is a mean over the batch. Telling Trainer so keeps it from expecting a sum over `num_items_in_batch`
    # and multiplying the loss by the number of processes.
    accepts_loss_kwargs = False
    # Weights a checkpoint may lack, because they are new by construction (a new head; the [mask] embedding of a model
    # built with use_mask_token=True): loading starts them from `_init_weights`.
    _new_weight_prefixes: tuple[str, ...] = ("classifier.", "pre_logits.", "distillation_classifier.")
    _new_weight_suffixes: tuple[str, ...] = ("embeddings.mask_token",)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' `from_pretrained`, also for foreign checkpoints (converted in memory), and strict: see
        `loading.py`. `patch_size=P` or `image_size=N` (of an hf-vit checkpoint; foreign ones are resampled as their
        conversion reads them) loads the checkpoint as it is, then resamples it with `set_input_size`, also when the
        Auto classes pass the sizes written onto the config."""
        source = pretrained_model_name_or_path
        resize = None
        if "patch_size" in kwargs or ("image_size" in kwargs and open_foreign(source, dict(kwargs)) is None):
            resize = [kwargs.pop("image_size", None), kwargs.pop("patch_size", None)]
        resize = resize or resize_asked_by_config(source, kwargs)  # the Auto classes' way
        loaded = load_strictly(cls, super().from_pretrained, pretrained_model_name_or_path, args, kwargs)
        if resize is not None:
            (loaded[0] if isinstance(loaded, tuple) else loaded).set_input_size(resize[0], patch_size=resize[1])
        return loaded

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """transformers' `save_pretrained`, with every code file the config's `auto_map` names, and the weights with
        the user's umask mode (as the folder's other files)."""
        super().save_pretrained(save_directory, *args, **kwargs)
        save_sibling_code(self, save_directory)
        give_weights_the_umask_mode(save_directory)

    @torch.no_grad()
    def set_input_size(
        self,
        image_size: int | tuple[int, int] | list[int] | None = None,
        mode: str | None = None,
        patch_size: int | None = None,
    ) -> None:
        """Change the model's resolution in place (the paper's fine-tuning at higher resolution): the position
        embeddings resampled to the new grid (`mode`, by default the config's), the config saying the new size;
        `patch_size` resamples the patch embedding too (FlexiViT, `resample_patch_embedding`)."""
        config = self.config
        image_size = config.image_hw if image_size is None else image_size
        patch_size = config.patch_size if patch_size is None else patch_size
        embeddings = self.base_model.embeddings
        patch_embedding = embeddings.patch_embedding
        if patch_size != config.patch_size:  # checked before anything changes
            patch_embedding = resample_patch_embedding_layer(patch_embedding, patch_size, config.stem_stride)
        old_grid, new_grid = config.grid_size, grid_for(image_size, patch_size)
        embeddings.patch_embedding, config.patch_size = patch_embedding, patch_size
        resampled = resample_position_embeddings(
            embeddings.position_embedding, old_grid, new_grid, config.num_position_prefix_tokens,
            mode or config.interpolation_mode, config.interpolation_antialias,
        )  # fmt: skip
        embeddings.position_embedding = nn.Parameter(
            resampled.contiguous(), requires_grad=embeddings.position_embedding.requires_grad
        )
        self.config.image_size = image_size_field(image_size)

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        # transformers skips parameter-less containers for custom code, but `INITIALISERS` needs them; each leaves
        # parameters loaded from a checkpoint untouched.
        super()._initialize_weights(module, is_custom_code=False)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The initialisation of the authors' code (vit_jax), one function per kind of module (`INITIALISERS`)."""
        for kind in type(module).__mro__:  # the most specific kind that has an initialiser
            if kind in INITIALISERS:
                INITIALISERS[kind](module, self.config)
                return


class VisionTransformerModel(VisionTransformerPreTrainedModel):
    """The ViT encoder: returns every token's final representation and the pooled image representation `y`."""

    def __init__(self, config: VisionTransformerConfig, use_mask_token: bool = False) -> None:
        super().__init__(config)
        self.embeddings = VisionTransformerEmbeddings(config, use_mask_token)
        depth = config.num_hidden_layers
        rates = [config.drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.layers = nn.ModuleList(VisionTransformerBlock(config, rate) for rate in rates)
        width, eps = config.hidden_size, config.layer_norm_eps
        self.pre_norm = nn.LayerNorm(width, eps=eps) if config.pre_norm else nn.Identity()
        self.norm = nn.LayerNorm(width, eps=eps)
        self.attention_pool = None
        if config.classifier == "map":
            mlp = VisionTransformerMLP(config)
            self.attention_pool = MultiheadAttentionPooling(width, config.num_attention_heads, eps, mlp)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.patch_embedding

    @capture_outputs(tie_last_hidden_states=False)  # hidden states and attentions recorded from the blocks
    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        output_attentions: bool | None = None,
        bool_masked_pos: torch.Tensor | None = None,
        patch_sources: torch.Tensor | None = None,
        layout: BatchLayout | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPooling:
        """`bool_masked_pos` and `patch_sources` `(B, N)`: masked patch prediction's corruption
        (`VisionTransformerEmbeddings.corrupt`). The batch's layout fields come in `kwargs` as the image processor
        returns them (`layout.BATCH_FIELDS`, see `layout.py`): the outputs of a packed batch are per image, as for the
        native-aspect batch of the same images (the layout the corruption is given in); its `hidden_states` are of
        the blocks' tokens (`BatchLayout.unpack` gives them per image), its `attentions` per image. `layout`: the
        batch's layout (`batch_layout`), where a head has already made it."""
        if pixel_values is None:
            raise ValueError("`pixel_values` is required: a float tensor (batch, channels, height, width).")
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        fields = batch_fields(kwargs)
        if layout is None:
            layout = self.batch_layout(pixel_values, interpolate_pos_encoding, **fields)
        # (1): each patch embedded where it lies (packed: the slots, each image's prefix tokens before its patches)
        hidden_states = self.pre_norm(self.embeddings(pixel_values, bool_masked_pos, layout, patch_sources))
        segments = None if layout is None else layout.segments  # each image's tokens attend only to each other
        for block in self.layers:
            hidden_states, _ = block(hidden_states, output_attentions, segments)  # (2), (3)
        token_mask = None
        if layout is not None:
            # one image per row; the tokens token dropping left out are pooled by none
            hidden_states, token_mask = layout.unpack(hidden_states), layout.token_mask
        # (4): LN of the class token's final state (or of the patch tokens' average, or of attention pooling); with
        # fc_norm the LayerNorm follows the pooling, and the tokens are returned as the last block left them.
        fc_norm = self.config.fc_norm
        sequence_output = hidden_states if fc_norm else self.norm(hidden_states)
        pooled_output = self.pool(sequence_output, token_mask)
        pooled_output = self.norm(pooled_output) if fc_norm else pooled_output
        return BaseModelOutputWithPooling(last_hidden_state=sequence_output, pooler_output=pooled_output)

    def batch_layout(
        self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool | None = None, **fields: torch.Tensor
    ) -> BatchLayout | None:
        """The layout of a native-aspect batch, padded or packed (`image_slot_index`), for this model's prefix
        tokens, its inputs' shapes checked: `fields` are the batch's (`layout.BATCH_FIELDS`, `spatial_shapes` among
        them; see `layout.py`). None for a batch of whole images, refused when the model cannot embed it or when
        `fields` come without `spatial_shapes`."""
        if "spatial_shapes" not in fields:
            for name in fields:
                raise ValueError(
                    f"`{name}` was given without `spatial_shapes`: a native-aspect batch (the image processor's "
                    "`max_num_patches`) needs both, as the processor returns them."
                )
            check_pixel_values(pixel_values, self.config, bool(interpolate_pos_encoding))
            return None
        spatial_shapes, slots = fields.get("spatial_shapes"), fields.get("image_slot_index")
        # the images, by `.shape` (never `len`: a compiled batch's size stays symbolic)
        counted = pixel_values if slots is None else spatial_shapes
        counted = counted if isinstance(counted, torch.Tensor) and counted.ndim else slots
        images = counted.shape[0] if isinstance(counted, torch.Tensor) and counted.ndim else 0
        check_native_batch(pixel_values, spatial_shapes, self.config, images, slots)
        return BatchLayout.of(pixel_values, prefix=self.config.num_prefix_tokens, **fields)

    def pool(self, tokens: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The image representation of equation (4) from the final tokens, by `config.classifier`: the class token,
        the average of the patch tokens (prefix tokens left out; of the valid ones in a native-aspect batch, whose
        `token_mask` marks them), or attention pooling over every (valid) token."""
        if self.config.classifier == "token":
            return tokens[:, 0]
        if self.config.classifier == "map":
            return self.attention_pool(tokens, token_mask)
        prefix = self.config.num_prefix_tokens
        if token_mask is None:
            return tokens[:, prefix:].mean(dim=1)
        weights = token_mask[:, prefix:].to(tokens.dtype)[..., None]
        return (tokens[:, prefix:] * weights).sum(dim=1) / weights.sum(dim=1)

    def forward_intermediates(
        self,
        pixel_values: torch.Tensor,
        indices: int | Sequence[int] = 1,
        *,
        norm: bool = False,
        output_fmt: str = "NCHW",
        interpolate_pos_encoding: bool = False,
        pixel_attention_mask: torch.Tensor | None = None,
        spatial_shapes: torch.Tensor | None = None,
    ) -> VisionTransformerIntermediates:
        """The outputs of chosen blocks, for dense prediction and feature extraction.

        `indices` is the last n blocks (an int) or block indices (0-based, negative from the end); the forward stops
        after the last block asked for. `norm` applies the final LayerNorm to each output. `output_fmt` is "NCHW"
        (maps on the patch grid, any patch-divisible size, non-square included) or "NLC" (patch tokens); the prefix
        (class) tokens come apart, in `prefix_tokens`. A native-aspect batch (`spatial_shapes`, with
        `pixel_attention_mask`; see `layout.py`) gives "NLC" tokens padded as its patches are, or "NCHW" maps on its
        largest grid, each image's at the top left and zero beyond its own grid.
        """
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}.")
        depth = len(self.layers)
        wanted = list(range(depth - indices, depth)) if isinstance(indices, int) else list(indices)
        if not wanted or any(not -depth <= index < depth for index in wanted):
            raise ValueError(f"indices must name blocks 0..{depth - 1} (or -{depth}..-1), got {indices!r}.")
        wanted = [index % depth for index in wanted]
        fields = batch_fields(dict(spatial_shapes=spatial_shapes, pixel_attention_mask=pixel_attention_mask))
        layout = self.batch_layout(pixel_values, interpolate_pos_encoding, **fields)
        attention_mask = None if layout is None else layout.segments
        prefix = self.config.num_prefix_tokens
        hidden_states = self.pre_norm(self.embeddings(pixel_values, layout=layout))
        outputs = {}
        for index, block in enumerate(self.layers[: max(wanted) + 1]):
            hidden_states, _ = block(hidden_states, False, attention_mask)
            if index in wanted:
                outputs[index] = self.norm(hidden_states) if norm else hidden_states
        features, prefix_tokens = [], []
        for index in wanted:
            tokens = outputs[index]
            prefix_tokens.append(tokens[:, :prefix])
            patches = tokens[:, prefix:]
            if output_fmt == "NCHW" and spatial_shapes is not None:
                patches = patch_grid_maps(patches, spatial_shapes)
            elif output_fmt == "NCHW":
                rows, cols = grid_for(tuple(pixel_values.shape[-2:]), self.config.patch_size)
                patches = patches.reshape(patches.shape[0], rows, cols, -1).permute(0, 3, 1, 2).contiguous()
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

    @can_return_tuple
    def forward(
        self,
        pixel_values: torch.Tensor,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        interpolate_pos_encoding: bool = True,
        **kwargs,
    ) -> BackboneOutput:
        """A native-aspect batch (`spatial_shapes`, see `layout.py`) gives maps on its largest grid, each image's at
        the top left and zero beyond its own grid; so does a packed batch (`image_slot_index`), one map per image,
        whose `hidden_states` are then one image per row too."""
        fields = batch_fields(kwargs)
        spatial_shapes = fields.get("spatial_shapes")
        layout = self.batch_layout(pixel_values, interpolate_pos_encoding, **fields)
        # dense prediction runs at any patch-divisible size: the position embeddings follow it
        outputs = VisionTransformerModel.forward(  # not super(): BackboneMixin defines a forward of its own
            self, pixel_values, interpolate_pos_encoding=interpolate_pos_encoding,
            output_attentions=output_attentions, output_hidden_states=True, layout=layout, **fields,
        )  # fmt: skip
        states = outputs.hidden_states
        if layout is not None:  # the blocks' outputs are of the blocks' tokens (packed: the slots)
            states = tuple(layout.unpack(state) for state in states)
        if spatial_shapes is None:
            grid = grid_for(tuple(pixel_values.shape[-2:]), self.config.patch_size)
            spatial_shapes = torch.tensor([grid] * pixel_values.shape[0])
        feature_maps = tuple(
            patch_grid_maps(self.norm(state)[:, self.config.num_prefix_tokens :], spatial_shapes)
            for stage, state in zip(self.stage_names, states)
            if stage in self.out_features
        )
        hidden_states = states if output_hidden_states else None
        return BackboneOutput(feature_maps=feature_maps, hidden_states=hidden_states, attentions=outputs.attentions)


class VisionTransformerForImageClassification(VisionTransformerPreTrainedModel):
    """ViT with a linear classifier on `y`, optionally after the pre-logits layer (dense + tanh) of pretraining, and
    with DeiT's distillation token a second one on that token (`distillation_head` in the config)."""

    def __init__(self, config: VisionTransformerConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.vit = VisionTransformerModel(config)
        self._build_head()
        self.post_init()

    def _build_head(self) -> None:
        config, width = self.config, self.config.hidden_size
        self.pre_logits = None
        if config.representation_size is not None:
            self.pre_logits = nn.Linear(width, config.representation_size)
            width = config.representation_size
        self.classifier = nn.Linear(width, config.num_labels) if config.num_labels > 0 else nn.Identity()
        self.distillation_classifier = None  # DeiT's second head; without classes the features are the output
        if config.use_distillation_token and config.distillation_head and config.num_labels > 0:
            self.distillation_classifier = nn.Linear(config.hidden_size, config.num_labels)

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
        for layer in (self.pre_logits, self.classifier, self.distillation_classifier):
            if layer is not None:
                layer.to(reference)
        self._init_weights(self)

    @can_return_tuple
    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        **kwargs,
    ) -> ImageClassifierOutput:
        outputs = self.vit(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding, **kwargs)
        features = outputs.pooler_output
        if self.pre_logits is not None:
            features = torch.tanh(self.pre_logits(features))
        logits = self.classifier(features)
        loss = self.loss_function(labels, logits, self.config) if labels is not None else None
        if self.distillation_classifier is not None:  # DeiT: the distillation token's head, averaged with the first
            token = outputs.last_hidden_state[:, 1]
            distilled = self.distillation_classifier(self.vit.norm(token) if self.config.fc_norm else token)
            if labels is not None:
                loss = (loss + self.loss_function(labels, distilled, self.config)) / 2
            logits = (logits + distilled) / 2
        return ImageClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


# The initialiser of each kind of module (`VisionTransformerPreTrainedModel._init_weights`), containers included: the
# roles of their layers are known there.
INITIALISERS: dict[type[nn.Module], Callable[[nn.Module, VisionTransformerConfig], None]] = {
    VisionTransformerEmbeddings: init_embeddings,
    StdConv2d: init_std_conv,
    nn.GroupNorm: init_norm,
    ResNetUnit: init_resnet_unit,
    VisionTransformerAttention: init_attention,
    LayerScale: init_layer_scale,
    MultiheadAttentionPooling: init_attention_pooling,
    VisionTransformerMLP: init_mlp,
    nn.LayerNorm: init_norm,
    VisionTransformerForImageClassification: init_classification_head,
}
