"""Pure state-dict mappings from other checkpoint layouts to hf-vit's, and the folder converters built on them."""

from .common import ConversionError, write_converted_folder
from .transformers_vit import (
    convert_transformers_checkpoint,
    hf_vit_to_transformers_state_dict,
    transformers_config_to_hf_vit,
    transformers_to_hf_vit_state_dict,
)

__all__ = [
    "ConversionError",
    "convert_transformers_checkpoint",
    "hf_vit_to_transformers_state_dict",
    "transformers_config_to_hf_vit",
    "transformers_to_hf_vit_state_dict",
    "write_converted_folder",
]
