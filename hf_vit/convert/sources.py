"""The checkpoints users already have, loaded as they are: transformers' ViT and timm's ViT, as Hub ids or folders,
and the authors' `.npz` files. `from_pretrained` of the hf-vit classes converts them on load with the same tables
the folder converters use.

A source is recognised by its `config.json`: `model_type` "hf_vit" (nothing to convert), "vit" (transformers'
layout), or timm's Hub layout (`architecture` with `pretrained_cfg` or `num_classes`); a path ending in `.npz` is the
authors' layout. Hub ids resolve through huggingface_hub's cache, so `HF_HUB_OFFLINE=1` works on cached repositories.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .common import ConversionError

logger = logging.getLogger(__name__)

# from_pretrained's arguments that say where and how to fetch files from the Hub
HUB_ARGUMENTS = ("cache_dir", "revision", "token", "local_files_only", "force_download")


def layout_of(config: dict) -> str | None:
    """ "hf_vit", "transformers" or "timm" for a `config.json`'s contents; None when it is none of them."""
    model_type = config.get("model_type")
    if model_type == "hf_vit":
        return "hf_vit"
    if model_type == "vit":
        return "transformers"
    if model_type is None and "architecture" in config and ("pretrained_cfg" in config or "num_classes" in config):
        return "timm"
    return None


def _fetch(source: str, filename: str, hub: dict[str, Any], required: bool = True) -> Path | None:
    """`filename` of the folder or Hub repository `source`, downloaded into (or found in) the Hub cache."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        path = folder / filename
        if path.is_file() or not required:
            return path if path.is_file() else None
        raise ConversionError(f"{folder} has no {filename}.")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    options = {k: v for k, v in hub.items() if v is not None}
    try:
        return Path(hf_hub_download(source, filename, **options))
    except (EntryNotFoundError, LocalEntryNotFoundError):
        if not required:
            return None
        raise


def source_layout(source: str | os.PathLike, **hub: Any) -> str | None:
    """The layout of `source` (see `layout_of`; "jax" for an `.npz` path), or None when it cannot be told (no
    readable config.json): from_pretrained then reports the problem itself."""
    text = os.fspath(source)
    if text.endswith(".npz"):
        return "jax"
    try:
        path = _fetch(text, "config.json", hub)
        return layout_of(json.loads(path.read_text()))
    except Exception:  # noqa: BLE001 - any failure to read means: not ours to convert, let from_pretrained say why
        return None


def read_foreign(
    source: str | os.PathLike,
    layout: str,
    hidden_act: str | None = None,
    num_attention_heads: int | None = None,
    **hub: Any,
):
    """`(config, state_dict, processor)` of a foreign checkpoint, converted with the converters' tables."""
    from .jax_npz import read_jax_checkpoint
    from .timm_vit import read_timm_checkpoint
    from .transformers_vit import read_transformers_checkpoint

    text = os.fspath(source)
    if layout == "jax":
        return read_jax_checkpoint(text, hidden_act=hidden_act or "gelu_pytorch_tanh")
    folder = _fetch(text, "config.json", hub).parent
    if layout == "transformers":
        _fetch(text, "preprocessor_config.json", hub, required=False)
        if _fetch(text, "model.safetensors", hub, required=False) is None:
            index = _fetch(text, "model.safetensors.index.json", hub, required=False)
            if index is None:
                raise ConversionError(f"{text} has no safetensors weights; hf-vit reads only safetensors.")
            for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
                _fetch(text, shard, hub)
        converted = read_transformers_checkpoint(folder)
    else:
        _fetch(text, "model.safetensors", hub)
        converted = read_timm_checkpoint(folder, num_attention_heads=num_attention_heads)
    if hidden_act is not None:
        converted[0].hidden_act = hidden_act
    return converted


def foreign_processor(source: Any, kwargs: dict[str, Any]):
    """The image processor of a foreign checkpoint (its size, mean/std, resampling), or None for an hf-vit one (or a
    source that cannot be read): read without building or writing the converted model."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    hub = {name: kwargs[name] for name in HUB_ARGUMENTS if name in kwargs}
    layout = source_layout(source, **hub)
    if layout in (None, "hf_vit"):
        return None
    return read_foreign(source, layout, kwargs.get("hidden_act"), kwargs.get("num_attention_heads"), **hub)[2]


DESCRIPTIONS = {
    "jax": "the authors' .npz layout",
    "transformers": "transformers' ViT layout",
    "timm": "timm's ViT layout",
}


class ConvertedSource:
    """A temporary hf-vit folder holding `source` converted, for transformers' own `from_pretrained` to load (so that
    its dtype, device and attention arguments work as for any folder); removed on exit.

    `source` is returned unchanged (nothing written) when it is already an hf-vit checkpoint or cannot be read.
    """

    def __init__(self, source: Any, kwargs: dict[str, Any]) -> None:
        self.source = source
        self.hub = {name: kwargs[name] for name in HUB_ARGUMENTS if name in kwargs}
        self.hidden_act = kwargs.get("hidden_act")
        # timm's weights do not say how many heads a non-standard width has: from_pretrained(..., num_attention_heads=)
        self.num_attention_heads = kwargs.get("num_attention_heads")
        self.folder: str | None = None

    def __enter__(self) -> Any:
        if not isinstance(self.source, (str, os.PathLike)):
            return self.source
        layout = source_layout(self.source, **self.hub)
        if layout in (None, "hf_vit"):
            return self.source
        config, state_dict, processor = read_foreign(
            self.source, layout, self.hidden_act, self.num_attention_heads, **self.hub
        )
        from ..modeling_vit import VisionTransformerForImageClassification
        from .common import check_state_dict

        check_state_dict(state_dict, config)
        model = VisionTransformerForImageClassification(config)
        model.load_state_dict(state_dict, strict=True)
        self.folder = tempfile.mkdtemp(prefix="hf-vit-converted-")
        model.save_pretrained(self.folder)
        processor.save_pretrained(self.folder)
        logger.warning(
            "Converted %s from %s to hf-vit on load (%s, %d layers, width %d, %s at %dx%d). save_pretrained writes "
            "an hf-vit folder.",
            os.fspath(self.source), DESCRIPTIONS[layout], type(model).__name__, config.num_hidden_layers,
            config.hidden_size, config.hidden_act, *config.image_hw,
        )  # fmt: skip
        return self.folder

    def __exit__(self, *exc: Any) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
