"""LoRA run folders as models: a peft adapter beside the fine-tuning config, loaded as the merged classifier (its
base a Hub id, or a local folder by its plain name, its path kept in `LOCAL_BASE_FILE`, never pushed; elsewhere pass
`base=`); `read_lora_folder` makes `from_pretrained(folder)` and `pipeline(model=folder)` load it. Imports neither
serving nor training."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .outputs.files import LOCAL_BASE_FILE  # where a local base lives on this machine: never pushed


def base_model_name(model_name_or_path: str) -> str:
    """How an adapter names its base: a Hub id as it is, a local folder by its plain name."""
    path = os.path.expanduser(model_name_or_path)
    if os.path.exists(path) or os.path.isabs(path) or model_name_or_path.startswith((".", "~")):
        return Path(os.path.abspath(path)).name
    return model_name_or_path


def load_lora_model(folder: str | os.PathLike, base: str | os.PathLike | None = None):
    """The fine-tuned model of a LoRA run's `folder` (its base: `base` or the adapter's), merged."""
    from peft import PeftModel

    from .model.configuration_vit import VisionTransformerConfig
    from .model.modeling_vit import VisionTransformerForImageClassification

    folder = Path(folder)
    named = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    base = os.fspath(base) if base is not None else (local_base(folder) or named)
    if not base:
        raise ValueError(f"{folder / 'adapter_config.json'} names no base model: pass base=<its folder or Hub id>.")
    config = VisionTransformerConfig.from_pretrained(folder)
    try:
        model = VisionTransformerForImageClassification.from_pretrained(base)
    except OSError as error:
        raise OSError(
            f"Cannot load the base model {base!r} of the LoRA adapter in {folder} ({error}). A base that was a local "
            "folder is named by its plain name only: pass load_lora_model(folder, base=<that folder>)."
        ) from error
    if tuple(model.config.image_hw) != tuple(config.image_hw):  # resampled as the run did
        model.set_input_size(config.image_size, getattr(config, "position_interpolation", None) or "bicubic")
    model.reset_classifier(config.id2label, config.representation_size)
    model.config.problem_type = config.problem_type
    return PeftModel.from_pretrained(model, folder).merge_and_unload().eval()


def local_base(folder: str | os.PathLike) -> str | None:
    """The local folder of a LoRA run's base as recorded on this machine, or None."""
    path = Path(folder) / LOCAL_BASE_FILE
    if not path.is_file():
        return None
    try:
        recorded = json.loads(path.read_text()).get("base_model_name_or_path")
    except (ValueError, AttributeError):
        return None
    return recorded if isinstance(recorded, str) and os.path.isdir(recorded) else None


def is_lora_folder(folder: str | os.PathLike) -> bool:
    """Whether `folder` is a LoRA run's folder: a peft adapter beside the fine-tuning config, no model weights."""
    folder = Path(folder)
    return (
        (folder / "adapter_config.json").is_file()
        and (folder / "config.json").is_file()
        and not any((folder / name).exists() for name in ("model.safetensors", "model.safetensors.index.json"))
    )


class LoraFolder:
    """A LoRA run's folder as the loading hook sees a foreign checkpoint."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def config_dict(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return json.loads((self.folder / "config.json").read_text())

    def processor(self):
        from .model.image_processing_vit import VisionTransformerImageProcessor

        return VisionTransformerImageProcessor.from_dict(
            json.loads((self.folder / "preprocessor_config.json").read_text())
        )

    def load_model(self, load: Any, args: tuple, kwargs: dict[str, Any]):
        from .model.modeling_vit import VisionTransformerForImageClassification

        model_class = getattr(load, "__self__", None)
        if model_class is not None and not issubclass(VisionTransformerForImageClassification, model_class):
            raise ValueError(
                f"{self.folder} is a LoRA run's image classifier: load it with AutoModelForImageClassification "
                "(or hf_vit.lora.load_lora_model), or write it merged with hf_vit.lora.save_merged_model."
            )
        info = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
        return load_lora_model(self.folder), info


def read_lora_folder(source: str, kwargs: dict[str, Any]) -> LoraFolder | None:
    """The loading hook's reader of LoRA run folders (registered when `hf_vit` is imported)."""
    if kwargs.get("subfolder") or not os.path.isdir(source) or not is_lora_folder(source):
        return None
    return LoraFolder(source)


def save_merged_model(
    folder: str | os.PathLike, output_dir: str | os.PathLike, base: str | os.PathLike | None = None
) -> None:
    """Write the merged model of a LoRA run as a plain hf-vit folder with its processor."""
    from .model.image_processing_vit import VisionTransformerImageProcessor

    model = load_lora_model(folder, base)
    model.name_or_path = ""
    model.save_pretrained(output_dir)
    VisionTransformerImageProcessor.from_pretrained(folder).save_pretrained(output_dir)
