"""The checkpoints users already have, loaded as they are: transformers' and timm's ViTs (Hub ids or folders), the
families of `transformers_families.py` and the authors' `.npz` files. Registered with the core's `loading` on
`import hf_vit`, so `from_pretrained` of the hf-vit classes converts them on load, with the converters' tables.

A source is recognised by its `config.json` (`layout_of`) or an `.npz` suffix. Conversion happens in memory: the
config becomes an hf-vit config, the weights (memory-mapped) are renamed and fused and handed to transformers'
`from_pretrained(None, config=..., state_dict=...)`, so `dtype`, `device_map` and attention arguments work as for
any folder; nothing is initialised at random or written."""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
from pathlib import Path
from typing import Any

import torch

from ..hub_access import HubLookupError, hub_file
from ..model.configuration_vit import VisionTransformerConfig
from .common import SAFETENSORS_DTYPES, ConversionError, image_size_field, read_json, read_safetensors
from .transformers_families import FAMILIES, family_config, family_state_dict, transformers_processor

logger = logging.getLogger(__name__)

# from_pretrained's arguments that say where and how to fetch files from the Hub
HUB_ARGUMENTS = ("cache_dir", "revision", "token", "local_files_only", "force_download")
# from_pretrained's arguments the conversion itself reads: the size to resample the positions to, the activation (the
# authors' .npz use tanh-approximated GELU), and the heads a timm state dict does not record.
CONVERSION_ARGUMENTS = ("image_size", "hidden_act", "num_attention_heads")
DESCRIPTIONS = {
    "jax": "the authors' .npz layout",
    "timm": "timm's ViT layout",
    "timm_naflex": "timm's NaFlexViT layout",
    **{model_type: family.name for model_type, family in FAMILIES.items()},
}


def layout_of(config: dict) -> str | None:
    """The layout a `config.json`'s contents name (see `DESCRIPTIONS`), "hf_vit", or None."""
    model_type = config.get("model_type")
    if model_type == "hf_vit":
        return "hf_vit"
    if model_type in FAMILIES:
        return model_type
    if model_type is None and "architecture" in config and ("pretrained_cfg" in config or "num_classes" in config):
        return "timm_naflex" if str(config["architecture"]).startswith("naflexvit") else "timm"
    return None


def _fetch(source: str, filename: str, hub: dict[str, Any], required: bool = True) -> Path | None:
    """`filename` of the folder or Hub repository `source` (a Hub that cannot be reached fails at once)."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        path = folder / filename
        if path.is_file() or not required:
            return path if path.is_file() else None
        raise ConversionError(f"{folder} has no {filename}.")
    try:
        found = hub_file(source, filename, hub)
    except HubLookupError:
        if required:
            raise
        # A file the cache lacks offline may be one the repository lacks: the caller looks for the alternatives.
        return None
    if found is None and required:
        raise ConversionError(f"The Hub repository {source} has no {filename}.")
    return found


def safetensors_files(source: str, hub: dict[str, Any]) -> list[Path] | None:
    """The safetensors files of `source` (one, or the shards of an index), fetched; None when it has none."""
    single = _fetch(source, "model.safetensors", hub, required=False)
    if single is not None:
        return [single]
    index = _fetch(source, "model.safetensors.index.json", hub, required=False)
    if index is None:
        return None
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [_fetch(source, shard, hub) for shard in shards]


def _data_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Where each array's bytes lie in a safetensors file: `(start, end)` from the file's beginning."""
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
    return {
        key: (8 + size + entry["data_offsets"][0], 8 + size + entry["data_offsets"][1])
        for key, entry in header.items()
        if key != "__metadata__"
    }


class FilePart:
    """One array of a safetensors file: mapped by `part[...]`, copied by `read_into(out)` and `read()`."""

    def __init__(self, path: Path, part: Any, start: int, end: int) -> None:
        self.path, self.part, self.start, self.end = path, part, start, end

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.part[index]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.part.get_shape())

    @property
    def dtype(self) -> torch.dtype:
        return SAFETENSORS_DTYPES[self.part.get_dtype()]

    def read_into(self, out: torch.Tensor) -> None:
        """Copy the array's bytes into `out` from a short-lived mapping (faster: docs/benchmarks.md)."""
        if tuple(out.shape) != self.shape or out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(f"{self.path}: cannot read an array of {self.shape} {self.dtype} into {tuple(out.shape)}")
        if self.end == self.start:
            return
        first = self.start - self.start % mmap.ALLOCATIONGRANULARITY  # mappings start on a page
        with open(self.path, "rb") as handle:
            if os.fstat(handle.fileno()).st_size < self.end:
                raise ConversionError(f"{self.path} is truncated; download or save it again.")
            # A private mapping: writable for torch (nothing is written), never written back to the file.
            with mmap.mmap(handle.fileno(), self.end - first, offset=first, access=mmap.ACCESS_COPY) as mapped:
                size, offset = self.end - self.start, self.start - first
                source = torch.frombuffer(mapped, dtype=torch.uint8, count=size, offset=offset)
                out.view(-1).view(torch.uint8).copy_(source)
                del source  # no tensor may view the mapping once it is closed

    def read(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.read_into(out)
        return out


@dataclasses.dataclass
class ForeignCheckpoint:
    """A foreign checkpoint at `source` (what the user passed) in `layout` (a key of `DESCRIPTIONS`)."""

    source: str
    layout: str
    hub: dict[str, Any]
    folder: Path | None = None  # the local folder (or Hub snapshot) holding config.json; None for an .npz
    _open: list = dataclasses.field(default_factory=list)  # safetensors files open while a model loads

    def _fail(self, error: Exception) -> ConversionError:
        return ConversionError(f"Cannot load {self.source} ({DESCRIPTIONS[self.layout]}): {error}")

    def _weight_files(self) -> list[Path]:
        files = safetensors_files(self.source, self.hub)
        if files is not None:
            return files
        if self.layout in ("timm", "timm_naflex"):  # older timm repositories hold a torch file only
            found = _fetch(self.source, "pytorch_model.bin", self.hub, required=False)
            if found is not None:
                return [found]
            raise ConversionError("it has no model.safetensors, sharded index or pytorch_model.bin")
        raise ConversionError(
            "it has no model.safetensors (nor a sharded index); hf-vit reads transformers' checkpoints from "
            "safetensors only: save the model with transformers' save_pretrained (safetensors by default)"
        )

    def _slices(self, files: list[Path]) -> dict[str, Any]:
        """The arrays of safetensors `files` as slices, memory-mapped only when loading indexes them."""
        from safetensors import safe_open

        out = {}
        for path in files:
            handle = safe_open(path, framework="pt")
            self._open.append(handle)
            offsets = _data_offsets(path)
            out.update((key, FilePart(path, handle.get_slice(key), *offsets[key])) for key in handle.keys())
        return out

    def _timm_arrays(self, header_only: bool) -> dict[str, torch.Tensor]:
        from .timm_vit import load_timm_state_dict

        files = self._weight_files()
        if files[0].suffix == ".safetensors":
            return read_safetensors(files, header_only)
        return load_timm_state_dict(files[0])

    def convert(self, options: dict[str, Any], weights: bool = True):
        """`(config, state_dict or None, processor or None)` in hf-vit's terms; errors name the source."""
        image_size, hidden_act = options.get("image_size"), options.get("hidden_act")
        try:
            if self.layout == "jax":
                from .jax_npz import read_jax_checkpoint

                return read_jax_checkpoint(
                    self.source, image_size=image_size, hidden_act=hidden_act or "gelu_pytorch_tanh"
                )
            if self.layout not in ("timm", "timm_naflex"):  # transformers' ViT or one of the families
                config_json = read_json(self.folder / "config.json")
                FAMILIES[self.layout].config_fields(config_json, ())  # a text tower is refused before any weights
                files = self._weight_files()
                shapes = read_safetensors(files)
                size = image_size_field(image_size) if image_size is not None else None
                config = family_config(config_json, shapes, size)
                state_dict = None
                if weights:
                    state_dict = family_state_dict(self.layout, self._slices(files), config, shapes, size is not None)
            else:  # timm's ViT or NaFlexViT
                from .timm_naflex import naflex_config, naflex_to_hf_vit_state_dict
                from .timm_vit import infer_config_from_timm, read_timm_config, timm_to_hf_vit_state_dict

                settings, heads = read_timm_config(self.folder) or {}, options.get("num_attention_heads")
                arrays = self._timm_arrays(header_only=not weights)
                if self.layout == "timm_naflex":
                    config = naflex_config(arrays, settings, image_size, heads)
                    state_dict = naflex_to_hf_vit_state_dict(arrays, settings, config) if weights else None
                else:
                    config = infer_config_from_timm(arrays, None, image_size, heads, settings)
                    state_dict = timm_to_hf_vit_state_dict(arrays, config) if weights else None
        except ConversionError as error:
            raise self._fail(error) from error
        if hidden_act is not None:
            config.hidden_act = hidden_act
        return config, state_dict, None

    def config_dict(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The hf-vit config's fields, reading the source's config (and, for timm, its safetensors header)."""
        options = {name: kwargs[name] for name in CONVERSION_ARGUMENTS if kwargs.get(name) is not None}
        config, _, _ = self.convert(options, weights=self.layout == "jax")
        return config.to_dict()

    def processor(self):
        """The source's image processor: its size, crop, mean/std and resampling."""
        if self.layout == "jax":
            return self.convert({})[2]
        if self.layout in ("timm", "timm_naflex"):
            from .timm_vit import read_timm_config, timm_processor

            # The processor takes the image size and normalisation only: the heads, which a timm state dict does not
            # record (and the model loading asks for), play no part in it.
            config = self.convert({"num_attention_heads": 1}, weights=False)[0]
            return timm_processor(config, read_timm_config(self.folder) or {})
        try:
            keys = () if self.layout == "vit" else read_safetensors(self._weight_files())  # ViT's size: its config
            config = family_config(read_json(self.folder / "config.json"), keys)
            square = FAMILIES[self.layout].square_size
            return transformers_processor(self.folder, config.image_hw, default_to_square=square)
        except ConversionError as error:
            raise self._fail(error) from error

    def _verify(self, state_dict: Any) -> None:
        """Raise the report of what does not fit the model, for weights read lazily (`LazyStateDict.verify`)."""
        try:
            getattr(state_dict, "verify", lambda: None)()
        except ConversionError as error:
            raise self._fail(error) from error

    def load_model(self, load: Any, args: tuple, kwargs: dict[str, Any]):
        """The converted model, built by transformers' `load(None, ..., config=..., state_dict=...)`."""
        kwargs = dict(kwargs)
        options = {name: kwargs.pop(name) for name in CONVERSION_ARGUMENTS if name in kwargs}
        for name in HUB_ARGUMENTS:
            kwargs.pop(name, None)
        config, state_dict, _ = self.convert({k: v for k, v in options.items() if v is not None})
        given = kwargs.pop("config", None)
        if isinstance(given, VisionTransformerConfig):
            config = given
        # The caller's other config fields (e.g. drop_path_rate=0.1, id2label=...) apply as they do for a folder.
        fields = {field.name for field in dataclasses.fields(VisionTransformerConfig)}
        fields |= {"num_labels", "id2label", "label2id", "problem_type", "output_attentions", "output_hidden_states"}
        fields -= {"dtype", "torch_dtype"}  # from_pretrained's own arguments
        for name in [name for name in kwargs if name in fields]:
            setattr(config, name, kwargs.pop(name))
        try:
            result = load(None, *args, config=config, state_dict=state_dict, **kwargs)
        except Exception:
            self._verify(state_dict)  # a problem of the checkpoint is reported in its own names
            raise
        finally:
            self._open.clear()
        info = result[1] if isinstance(result, tuple) else {}
        if any(info.get(name) for name in ("missing_keys", "unexpected_keys", "mismatched_keys")):
            self._verify(state_dict)
        logger.info(
            "Converted %s from %s to hf-vit on load (%d layers, width %d, %s at %dx%d); save_pretrained writes an "
            "hf-vit folder.",
            self.source, DESCRIPTIONS[self.layout], config.num_hidden_layers, config.hidden_size, config.hidden_act,
            *config.image_hw,
        )  # fmt: skip
        return result


def read_source(source: str, kwargs: dict[str, Any]) -> ForeignCheckpoint | None:
    """The core's loading hook: a `ForeignCheckpoint` for a foreign source, None for anything else."""
    hub = {name: kwargs[name] for name in HUB_ARGUMENTS if name in kwargs}
    if os.fspath(source).lower().endswith(".npz"):
        return ForeignCheckpoint(source, "jax", hub)
    if os.path.isfile(source):
        return None  # a local file that is no checkpoint: from_pretrained names it, no Hub id is looked up
    try:
        path = _fetch(source, "config.json", hub)
        layout = layout_of(json.loads(path.read_text()))
    except HubLookupError:  # transformers' loading would only try again, retrying the network for as long
        raise
    except Exception:  # noqa: BLE001 - any failure to read means: not ours to convert, let from_pretrained say why
        return None
    if layout in (None, "hf_vit"):
        return None
    return ForeignCheckpoint(source, layout, hub, path.parent)
