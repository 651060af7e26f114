"""Configuration of the Vision Transformer of "An Image is Worth 16x16 Words" (Dosovitskiy et al., 2020)."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from typing import Any

from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.backbone_utils import BackboneConfigMixin

from .loading import open_foreign
from .resolution import MODES as INTERPOLATION_MODES  # how position embeddings are resampled to another grid
from .resolution import grid_for, height_width

# Width, depth, MLP size and heads of the paper's Table 1 (Base, Large, Huge) and of the DeiT/AugReg Tiny and Small.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 192, "num_hidden_layers": 12, "intermediate_size": 768, "num_attention_heads": 3},
    "small": {"hidden_size": 384, "num_hidden_layers": 12, "intermediate_size": 1536, "num_attention_heads": 6},
    "base": {"hidden_size": 768, "num_hidden_layers": 12, "intermediate_size": 3072, "num_attention_heads": 12},
    "large": {"hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 4096, "num_attention_heads": 16},
    "huge": {"hidden_size": 1280, "num_hidden_layers": 32, "intermediate_size": 5120, "num_attention_heads": 16},
}
PATCH_SIZES = (8, 14, 16, 32)
CLASSIFIERS = ("token", "gap", "map")
# Stage depths of the hybrids' ResNet stems (section 3.1), by stem and effective patch size, as the authors' code
# defines them: R50 with stage 4 removed and its units moved to stage 3 (stride 16), the full R50 (stride 32), and the
# R26 of their later releases (four stages of two units, stride 32).
RESNET_STAGES: dict[tuple[str, int], list[int]] = {
    ("r50", 16): [3, 4, 9],
    ("r50", 32): [3, 4, 6, 3],
    ("r26", 32): [2, 2, 2, 2],
}
# The hybrids of the paper's Table 5 and of the authors' releases; any size of MODEL_SIZES parses the same way.
HYBRID_PRESET_NAMES = (
    "r50-vit-base-patch16-224",
    "r50-vit-large-patch16-224",
    "r50-vit-large-patch32-224",
    "r26-vit-small-patch32-224",
    "r26-vit-base-patch32-224",
)
RESNET_GROUPS = 32  # GroupNorm groups of every stem layer (the authors' flax.linen.GroupNorm default)
# The fields that are True or False. A string spelling one ("True", "false", "1", "0": what a command line gives) is
# read as it; anything else is refused by name, rather than counted as true.
BOOLEAN_FIELDS = (
    "qkv_bias", "zero_init_head", "use_class_token", "use_distillation_token", "distillation_head", "pre_norm",
    "fc_norm", "patch_embedding_bias", "interpolation_antialias",
)  # fmt: skip
_BOOLEAN_WORDS = {"true": True, "1": True, "false": False, "0": False}
# Masked patch prediction's shares of corrupted patches, fields of the config before they became the run's
# (`modeling_mpp.PatchCorruption`): saved configs that have them load without them.
RUN_FIELDS = ("mpp_corrupt_ratio", "mpp_mask_ratio", "mpp_random_ratio")
AUTO_MAP = {
    "AutoConfig": "configuration_vit.VisionTransformerConfig",
    "AutoModel": "modeling_vit.VisionTransformerModel",
    "AutoModelForImageClassification": "modeling_vit.VisionTransformerForImageClassification",
    "AutoBackbone": "modeling_vit.VisionTransformerBackbone",
    "AutoModelForPreTraining": "modeling_mpp.VisionTransformerForMaskedPatchPrediction",
    "AutoModelForMaskedImageModeling": "modeling_mim.VisionTransformerForMaskedImageModeling",
}
MASKED_IMAGE_MODELING = ("simmim", "mpp")


def _preset_fields(name: str) -> dict[str, Any] | None:
    """The architecture fields a preset name spells, or None when it is not one."""
    match = _PRESET_NAME.fullmatch(name)
    if match is None:
        return None
    patch = int(match["patch"])
    fields = {**MODEL_SIZES[match["size"]], "patch_size": patch, "image_size": int(match["resolution"])}
    if match["resnet"]:
        layers = RESNET_STAGES.get((match["resnet"], patch))
        if layers is None:
            return None
        fields["resnet_layers"] = list(layers)
    elif patch not in PATCH_SIZES:
        return None
    return fields


_PRESET_NAME = re.compile(
    rf"(?:(?P<resnet>r26|r50)-)?vit-(?P<size>{'|'.join(MODEL_SIZES)})-patch(?P<patch>\d+)-(?P<resolution>\d+)"
)
# Every size at every patch size at 224, which each patch size tiles (the paper's H/14 runs at 224).
PRESETS: dict[str, dict[str, Any]] = {
    name: _preset_fields(name) for name in (f"vit-{s}-patch{p}-224" for s in MODEL_SIZES for p in PATCH_SIZES)
}
# The keyword arguments `from_preset` takes besides the fields.
_PRESET_EXTRA_KWARGS = ("num_labels", "attn_implementation", "auto_map", "out_features", "out_indices")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any, least: int = 1, most: float = float("inf")) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= most


def _positive(value: Any) -> bool:
    return _is_number(value) and value > 0


_SIZE_FIELDS = (
    "image_size", "patch_size", "num_channels", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "intermediate_size",
)  # fmt: skip
# What each field must be, in the order checked: its test, and the words of the error naming it (`resnet_width` is
# checked only with a stem).
FIELD_RULES: dict[str, tuple[Any, str]] = {
    **dict.fromkeys(_SIZE_FIELDS, (_is_int, "a positive int")),
    "resnet_layers": (
        lambda v: v is None or (isinstance(v, list) and all(map(_is_int, v))),
        "None or a list of positive ints",
    ),
    "resnet_width": (
        lambda v: _is_int(v) and v % RESNET_GROUPS == 0,
        f"a positive multiple of {RESNET_GROUPS} (the stem's GroupNorm groups)",
    ),
    "classifier": (lambda v: v in CLASSIFIERS, f"one of {CLASSIFIERS}"),
    **dict.fromkeys(BOOLEAN_FIELDS, (lambda v: isinstance(v, bool), "True or False")),
    "num_register_tokens": (lambda v: _is_int(v, 0), "an int >= 0"),
    "layer_scale_init_value": (lambda v: v is None or _positive(v), "a positive number or None"),
    "interpolation_mode": (lambda v: v in INTERPOLATION_MODES, f"one of {INTERPOLATION_MODES}"),
    "representation_size": (lambda v: v is None or _is_int(v), "a positive int or None"),
    **dict.fromkeys(
        ("hidden_dropout_prob", "attention_probs_dropout_prob", "drop_path_rate"),
        (lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    ),
    **dict.fromkeys(("layer_norm_eps", "initializer_range"), (_positive, "a positive number")),
    "mpp_color_bits": (lambda v: _is_int(v, 1, 8), "an int in 1..8"),
    "encoder_stride": (lambda v: v is None or _is_int(v), "a positive int or None (the patch size)"),
    "masked_image_modeling": (lambda v: v in MASKED_IMAGE_MODELING, f"one of {MASKED_IMAGE_MODELING}"),
}


def resnet_stride(resnet_layers: list[int] | None) -> int:
    """Downsampling of a ResNet stem of these stage depths: 4 for the root, 2 per later stage; 1 without a stem."""
    if resnet_layers is None:
        return 1
    return 4 * 2 ** max(len(resnet_layers) - 1, 0)


class VisionTransformerConfig(BackboneConfigMixin, PretrainedConfig):
    r"""Configuration of a Vision Transformer (ViT).

    Args:
        image_size: input resolution, an int or a `(height, width)` pair.
        patch_size: side of the square patches the image is cut into (`P` in the paper).
        num_channels: channels of the input image.
        hidden_size: width `D` of every token.
        num_hidden_layers: number of Transformer blocks `L`.
        num_attention_heads: heads of multi-head self-attention; must divide `hidden_size`.
        intermediate_size: hidden size of the MLP (4 `D` in the paper).
        hidden_act: activation of the MLP, a name of transformers' `ACT2FN` (the paper uses GELU; CLIP "quick_gelu",
            SigLIP "gelu_pytorch_tanh").
        hidden_dropout_prob: dropout after the position embeddings, in the MLP and after attention.
        attention_probs_dropout_prob: dropout on the attention probabilities.
        layer_norm_eps: epsilon of every LayerNorm.
        qkv_bias: whether the query, key and value projections have a bias.
        classifier: how `y` of equation (4) is pooled: `"token"` (the class token), `"gap"` (the average of the patch
            tokens) or `"map"` (multi-head attention pooling, SigLIP's head: `pooling.py`).
        representation_size: size of the pre-logits layer (a tanh dense layer used in pretraining); `None` for none.
        drop_path_rate: stochastic depth rate of the last block, growing linearly from 0 at the first block.
        initializer_range: standard deviation of the position embeddings at initialisation.
        zero_init_head: initialise the classifier's weights and bias to zero, as the paper does.
        resnet_layers: stage depths of the hybrid's ResNet stem (section 3.1, `hybrid.py`), e.g. `[3, 4, 9]` for the
            paper's R50 hybrid (`resnet_stride`); `None` (the default) for the plain ViT, `[]` for the root alone.
        resnet_width: channels of the stem's root (64 times the authors' width factor); stage `i` (from 0) has
            bottlenecks of `resnet_width * 2**i` channels and outputs four times that.
        mpp_color_bits: masked patch prediction (section 4.6): bits per channel of the mean colour the model
            predicts (3: 512 classes for RGB). How patches are corrupted is the run's (`modeling_mpp.PatchCorruption`).
        mpp_pixel_mean, mpp_pixel_std: the normalisation (a number, or one per channel) the model undoes to compute
            masked patch prediction's mean-colour targets from `pixel_values` given without `labels`.
        encoder_stride: masked image modeling (SimMIM): the side of the pixel block each patch token reconstructs;
            `None` (the default) means `patch_size`, the only value that reconstructs the whole image.
        masked_image_modeling: which model `AutoModelForMaskedImageModeling` builds: `"simmim"` (SimMIM's
            reconstruction of the masked pixels) or `"mpp"` (masked patch prediction).

    The blocks of the family that followed the paper, each off by default (the paper's model):

        use_class_token: whether the sequence starts with the class token; `None` (the default) means "when
            `classifier` is `"token"`", the paper's two models. `False` with `"map"` is SigLIP's tower; `True` with
            `"gap"` averages the patch tokens beside a class token (timm's `global_pool="avg"`).
        use_distillation_token: DeiT's distillation token after the class token (with a position embedding).
        distillation_head: with `use_distillation_token`, whether the classification model has a second head on it
            (DeiT's distilled models: `logits` average the two heads, fine-tuning trains both against the labels) or
            classifies from the class token alone (transformers' `DeiTForImageClassification`).
        num_register_tokens: register tokens after the prefix tokens (DINOv2 with registers, timm's `reg_tokens`):
            learned, without a position embedding, dropped from every output that maps tokens to patches.
        layer_scale_init_value: LayerScale on both residual branches of every block (a learned per-channel scale,
            initialised to this value; CaiT, DINOv2); `None` for none.
        pre_norm: a LayerNorm between the embeddings and the first block (CLIP's `pre_layrnorm`, timm's
            `norm_pre`).
        fc_norm: apply the final LayerNorm to the pooled representation instead of to every token (timm's
            `fc_norm`, CLIP's `post_layernorm`): `last_hidden_state` is then the last block's output.
        patch_embedding_bias: whether the patch embedding has a bias (CLIP's has none).
        interpolation_mode, interpolation_antialias: how position embeddings are resampled to another grid:
            `"bicubic"` or `"bilinear"`, with or without antialiasing, as the checkpoint's own code resamples them.

    `patch_size` is always in input pixels: the side of the image region one token covers (16 for R50+ViT-B/16, whose
    embedding takes 1x1 patches of the stem's stride-16 feature map), so `grid_size` is `image_size / patch_size` for
    plain and hybrid models alike; `stem_stride` and `embedding_patch_size` give the two factors.
    """

    model_type = "hf_vit"

    image_size: int | tuple[int, int] | list[int] = 224
    patch_size: int = 16
    num_channels: int = 3
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    layer_norm_eps: float = 1e-6
    qkv_bias: bool = True
    classifier: str = "token"
    representation_size: int | None = None
    drop_path_rate: float = 0.0
    initializer_range: float = 0.02
    zero_init_head: bool = True
    resnet_layers: list[int] | None = None
    resnet_width: int = 64
    mpp_color_bits: int = 3
    mpp_pixel_mean: float | list[float] = 0.5
    mpp_pixel_std: float | list[float] = 0.5
    encoder_stride: int | None = None
    masked_image_modeling: str = "simmim"
    use_class_token: bool | None = None
    use_distillation_token: bool = False
    distillation_head: bool = True
    num_register_tokens: int = 0
    layer_scale_init_value: float | None = None
    pre_norm: bool = False
    fc_norm: bool = False
    patch_embedding_bias: bool = True
    interpolation_mode: str = "bicubic"
    interpolation_antialias: bool = False
    # As a backbone (`VisionTransformerBackbone`): which stages' outputs are the feature maps. The stages are "stem"
    # (the embeddings, equation 1) and "stage1".."stageL" (the blocks' outputs); default: the last block.
    _out_features: list[str] | None = None
    _out_indices: list[int] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        for name in RUN_FIELDS:  # settings of a run that older configs held: they shape no weight
            kwargs.pop(name, None)
        for name in BOOLEAN_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str) and value.strip().lower() in _BOOLEAN_WORDS:
                setattr(self, name, _BOOLEAN_WORDS[value.strip().lower()])
        labels = kwargs.get("num_labels")
        if labels is not None and (isinstance(labels, bool) or not isinstance(labels, int) or labels < 0):
            raise ValueError(
                f"`num_labels` must be an int >= 0 (0: no classification head, the features are the output), got "
                f"{labels!r}."
            )
        if isinstance(self.image_size, (tuple, list)):
            self.image_size = list(height_width(self.image_size, "image_size"))
        if isinstance(self.resnet_layers, tuple):
            self.resnet_layers = list(self.resnet_layers)
        if self.use_class_token is None:
            self.use_class_token = self.classifier == "token"
        self.stage_names = ["stem"] + [f"stage{index}" for index in range(1, self.num_hidden_layers + 1)]
        self.set_output_features_output_indices(
            out_features=kwargs.pop("out_features", None), out_indices=kwargs.pop("out_indices", None)
        )
        super().__post_init__(**kwargs)
        # Saved folders name the classes to load with `trust_remote_code=True` where hf_vit is not installed (configs
        # saved before a class was added name it too).
        self.auto_map = {**AUTO_MAP, **(getattr(self, "auto_map", None) or {})}
        self.validate_architecture()

    def validate_architecture(self) -> None:
        """Raise a `ValueError` naming the first field whose value cannot build a model (`FIELD_RULES`, then the
        fields' agreement with each other); transformers' own `validate()` runs on `save_pretrained`."""
        height, width = height_width(self.image_size, "image_size")
        for name, (valid, wanted) in FIELD_RULES.items():
            value = min(height, width) if name == "image_size" else getattr(self, name)
            if not valid(value) and (name != "resnet_width" or self.resnet_layers is not None):
                raise ValueError(f"`{name}` must be {wanted}, got {value!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                f"({self.num_attention_heads})."
            )
        if self.resnet_layers is not None and self.patch_size % self.stem_stride:
            raise ValueError(
                f"`patch_size` ({self.patch_size}, in input pixels) must be a multiple of the ResNet stem's "
                f"stride ({self.stem_stride} for {len(self.resnet_layers)} stage(s)): the embedding cuts the stem's "
                "feature map into patch_size / stride patches."
            )
        try:  # a whole grid of patches, of at most MAX_PATCH_POSITIONS (100,000 took minutes to run out of memory)
            grid_for(self.image_size, self.patch_size)
        except ValueError as error:
            raise ValueError("`image_size`" + str(error).removeprefix("image_size")) from None
        if self.classifier == "token" and not self.use_class_token:
            raise ValueError(
                "`use_class_token` is False but `classifier` is 'token', which pools the class token: choose "
                "classifier='gap' or 'map', or keep the class token."
            )
        if self.use_distillation_token and not self.use_class_token:
            raise ValueError("`use_distillation_token` needs the class token (`use_class_token=True`), as DeiT has.")
        if not isinstance(self.hidden_act, str) or self.hidden_act not in ACT2FN:
            close = difflib.get_close_matches(str(self.hidden_act), list(ACT2FN), n=3)
            raise ValueError(
                f"`hidden_act` must name one of transformers' activations (ACT2FN), got {self.hidden_act!r}"
                + (f"; did you mean {' or '.join(map(repr, close))}?" if close else ".")
            )
        for name, kind in (("mpp_pixel_mean", "number"), ("mpp_pixel_std", "positive number")):
            value = getattr(self, name)
            values = value if isinstance(value, list) else [value]
            if (isinstance(value, list) and len(value) != self.num_channels) or not all(
                _is_number(number) and (kind == "number" or number > 0) for number in values
            ):
                raise ValueError(
                    f"`{name}` must be a {kind} or a list of {self.num_channels} (one per channel), got {value!r}."
                )

    def to_dict(self) -> dict[str, Any]:
        """transformers' dict of the config (config.json), less `distillation_head` where there is no distillation
        token for it to act on (read back, the field takes its default)."""
        output = super().to_dict()
        if not self.use_distillation_token:
            output.pop("distillation_head", None)
        return output

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """transformers' reading of `config.json`, foreign checkpoints converted on the way (`loading.open_foreign`),
        refusing a folder without one (transformers would use the defaults) and the config of another model type."""
        source = pretrained_model_name_or_path
        foreign = open_foreign(source, kwargs)
        if foreign is not None:
            return foreign.config_dict(kwargs), kwargs
        config_dict, kwargs = super().get_config_dict(source, **kwargs)
        if not config_dict:  # transformers returns {} for a folder without config.json
            raise OSError(
                f"{os.fspath(source)} has no config.json. Pass the folder that `save_pretrained` or a training run "
                "wrote (it holds config.json beside the weights)."
            )
        model_type = config_dict.get("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise ValueError(
                f"{os.fspath(source)} holds a {model_type!r} checkpoint, not an hf-vit one (model_type "
                f"{cls.model_type!r}), and not one hf-vit converts on load (transformers' or timm's ViT, DINOv2, "
                "DeiT, the vision towers of CLIP and SigLIP, the authors' .npz): its weights would not load into this "
                "model."
            )
        return config_dict, kwargs

    @property
    def image_hw(self) -> tuple[int, int]:
        """The input resolution as `(height, width)`."""
        return height_width(self.image_size, "image_size")

    @property
    def grid_size(self) -> tuple[int, int]:
        """Number of patches along height and width."""
        height, width = self.image_hw
        return (height // self.patch_size, width // self.patch_size)

    @property
    def stem_stride(self) -> int:
        """Downsampling of the hybrid's ResNet stem (16 for the R50 of `[3, 4, 9]`); 1 without a stem."""
        return resnet_stride(self.resnet_layers)

    @property
    def stem_channels(self) -> int:
        """Channels of what the patch embedding reads: the image's, or the stem's (its stride times its width)."""
        if self.resnet_layers is None:
            return self.num_channels
        return self.resnet_width * (self.stem_stride if self.resnet_layers else 1)

    @property
    def embedding_patch_size(self) -> int:
        """Side of the patches the embedding `E` cuts, in the pixels it reads (the stem's feature map in a hybrid)."""
        return self.patch_size // self.stem_stride

    @property
    def reconstruction_stride(self) -> int:
        """The side of the pixel block each patch token reconstructs (SimMIM): `encoder_stride`, or the patch size."""
        return self.patch_size if self.encoder_stride is None else self.encoder_stride

    @property
    def mpp_num_classes(self) -> int:
        """Classes of masked patch prediction: every mean colour at `mpp_color_bits` per channel (512 for RGB)."""
        return 2 ** (self.mpp_color_bits * self.num_channels)

    @property
    def num_patches(self) -> int:
        rows, cols = self.grid_size
        return rows * cols

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens in front of the patch tokens: the class token, the distillation token and the register tokens."""
        return self.num_position_prefix_tokens + self.num_register_tokens

    @property
    def num_position_prefix_tokens(self) -> int:
        """Prefix tokens with a position embedding (at the front of the table): the class and distillation tokens."""
        return int(bool(self.use_class_token)) + int(bool(self.use_distillation_token))

    @classmethod
    def preset_names(cls) -> list[str]:
        return sorted(PRESETS) + sorted(HYBRID_PRESET_NAMES)

    @classmethod
    def from_preset(cls, name: str, **kwargs: Any) -> VisionTransformerConfig:
        """Build the config of a named model, e.g. `"vit-base-patch16-224"`; keyword arguments override fields.

        The name is parsed as `vit-<size>-patch<P>-<resolution>`: `"vit-base-patch16-384"` is ViT-B/16 at 384. A
        hybrid is named by its stem in front, `r50-vit-base-patch16-224` (R50+ViT-B/16) or
        `r26-vit-small-patch32-224` (R26+ViT-S/32); its stages are those of `RESNET_STAGES`.
        """
        preset = _preset_fields(name)
        if preset is None:
            stems = ", ".join(f"{stem}-...-patch{patch}" for stem, patch in RESNET_STAGES)
            raise ValueError(
                f"Unknown preset {name!r}. Presets are vit-<size>-patch<P>-<resolution> with size in "
                f"{list(MODEL_SIZES)} and P in {list(PATCH_SIZES)}, e.g. 'vit-base-patch16-224', and the hybrids "
                f"{stems}, e.g. 'r50-vit-base-patch16-224'."
            )
        own = [name for name in cls.__annotations__ if not name.startswith("_") and name != "model_type"]
        known = {field.name for field in dataclasses.fields(cls)} | set(_PRESET_EXTRA_KWARGS)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            hints = [
                f"{key!r}" + "".join(f" (did you mean {c!r}?)" for c in difflib.get_close_matches(key, own, 1, 0.5))
                for key in unknown
            ]
            raise ValueError(
                f"Unknown config field(s) {', '.join(hints)} for preset {name!r}. The model's fields: "
                f"{', '.join(own)}; also num_labels, id2label, label2id, problem_type."
            )
        return cls(**{**preset, **kwargs})
