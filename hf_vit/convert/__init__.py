"""Foreign checkpoint layouts <-> hf-vit: one rename table per layout (`Layout`), read in both directions by one
engine, one check against the model (`check_state_dict`), and the folder converters built on them. The layouts of
big_vision, the transformers families and timm's NaFlexViT live in their modules."""

from ..model.loading import register_foreign_reader
from .big_vision_npz import is_big_vision
from .common import FUSED_QKV, ConversionError, Layout, Transform, check_state_dict
from .jax_npz import (
    JAX_LAYOUT,
    convert_jax_checkpoint,
    hf_vit_to_npz_arrays,
    infer_config_from_npz,
    load_npz,
    npz_to_hf_vit_state_dict,
)
from .sources import read_source
from .timm_naflex import naflex_config, naflex_to_hf_vit_state_dict
from .timm_vit import (
    TIMM_LAYOUT,
    convert_timm_checkpoint,
    hf_vit_to_timm_state_dict,
    infer_config_from_timm,
    load_timm_state_dict,
    timm_to_hf_vit_state_dict,
)
from .transformers_vit import (
    TRANSFORMERS_LAYOUT,
    convert_transformers_checkpoint,
    hf_vit_to_transformers_module_state_dict,
    hf_vit_to_transformers_state_dict,
    transformers_to_hf_vit_state_dict,
)

__all__ = [
    "FUSED_QKV", "JAX_LAYOUT", "TIMM_LAYOUT", "TRANSFORMERS_LAYOUT", "ConversionError", "Layout", "Transform",
    "check_state_dict", "convert_jax_checkpoint", "convert_timm_checkpoint", "convert_transformers_checkpoint",
    "hf_vit_to_npz_arrays", "hf_vit_to_timm_state_dict", "hf_vit_to_transformers_module_state_dict",
    "hf_vit_to_transformers_state_dict", "infer_config_from_npz", "infer_config_from_timm", "is_big_vision",
    "load_npz",
    "load_timm_state_dict", "naflex_config", "naflex_to_hf_vit_state_dict", "npz_to_hf_vit_state_dict",
    "timm_to_hf_vit_state_dict", "transformers_to_hf_vit_state_dict",
]  # fmt: skip

# from_pretrained of the hf-vit classes converts these checkpoints on load (see `sources`).
register_foreign_reader(read_source)
