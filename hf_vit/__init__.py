"""hf-vit: the Vision Transformer of "An Image is Worth 16x16 Words" for the Hugging Face stack. Importing it
registers its classes with transformers' Auto classes and `pipeline("image-classification")`."""

from transformers import (
    AutoBackbone,
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForImageClassification,
    AutoModelForMaskedImageModeling,
    AutoModelForPreTraining,
)

# The converters register their reader of foreign checkpoints (transformers' and timm's ViT, the authors' .npz) with
# the core's hook (`loading.py`) as they are imported: the core imports nothing of them.
from . import convert  # noqa: E402, F401
from .lora import read_lora_folder
from .model.configuration_vit import PRESETS, VisionTransformerConfig
from .model.image_processing_vit import VisionTransformerImageProcessor
from .model.loading import register_foreign_reader
from .model.modeling_mim import VisionTransformerForMaskedImageModeling
from .model.modeling_mpp import VisionTransformerForMaskedPatchPrediction
from .model.modeling_vit import (
    VisionTransformerBackbone,
    VisionTransformerForImageClassification,
    VisionTransformerModel,
    VisionTransformerPreTrainedModel,
)

# A LoRA run's folder (adapter + fine-tuning config) loads as its merged classifier.
register_foreign_reader(read_lora_folder)

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "VisionTransformerBackbone",
    "VisionTransformerConfig",
    "VisionTransformerForImageClassification",
    "VisionTransformerForMaskedImageModeling",
    "VisionTransformerForMaskedPatchPrediction",
    "VisionTransformerImageProcessor",
    "VisionTransformerModel",
    "VisionTransformerPreTrainedModel",
]

AutoConfig.register(VisionTransformerConfig.model_type, VisionTransformerConfig, exist_ok=True)
# Saving copies the code files beside the weights and records them in `auto_map`. SimMIM's class answers for masked
# image modeling, or masked patch prediction where the config's `masked_image_modeling` says so (the class chooses).
for _auto, _model in (
    (AutoModel, VisionTransformerModel),
    (AutoModelForImageClassification, VisionTransformerForImageClassification),
    (AutoBackbone, VisionTransformerBackbone),
    (AutoModelForPreTraining, VisionTransformerForMaskedPatchPrediction),
    (AutoModelForMaskedImageModeling, VisionTransformerForMaskedImageModeling),
):
    _auto.register(VisionTransformerConfig, _model, exist_ok=True)
    _model.register_for_auto_class(_auto.__name__)
# One torch implementation serves both of transformers' backend slots, so no "backend unavailable" fallback happens.
AutoImageProcessor.register(
    VisionTransformerConfig,
    image_processor_classes={"torchvision": VisionTransformerImageProcessor, "pil": VisionTransformerImageProcessor},
    exist_ok=True,
)
VisionTransformerConfig.register_for_auto_class()
VisionTransformerImageProcessor.register_for_auto_class("AutoImageProcessor")
del _auto, _model
