"""How the hf-vit classes load: strictly, and with the readers of foreign checkpoints plugged in.

The config, model and processor classes ask `open_foreign(source, kwargs)` whether `source` is a checkpoint of
another layout (transformers' or timm's ViT, the authors' `.npz`). Nothing here knows those layouts: `hf_vit.convert`
registers its reader with `register_foreign_reader` when `hf_vit` is imported, as timm hands a `checkpoint_filter_fn`
to its model builder. Saved beside checkpoints as remote code with the classes, where no reader is registered: remote
code loads hf-vit checkpoints only.

A reader is called with the source and the caller's keyword arguments and returns None (not a foreign checkpoint, or
one it cannot tell: transformers' own loading then reports the problem) or an object with three methods, each reading
only what it needs:

    config_dict(kwargs) -> dict          the hf-vit config's fields (reads the source's config, not its weights)
    processor() -> image processor       the source's preprocessing (reads its config and processor files)
    load_model(model_class, args, kwargs) -> (model, loading info)   the converted model, in memory
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from transformers.dynamic_module_utils import get_relative_import_files

from .resolution import height_width

_READERS: list[Callable[[str, dict[str, Any]], Any]] = []


def register_foreign_reader(reader: Callable[[str, dict[str, Any]], Any]) -> None:
    """Add `reader` (see the module docstring) to those asked about every source; registering it again is a no-op."""
    if reader not in _READERS:
        _READERS.append(reader)


def open_foreign(source: Any, kwargs: dict[str, Any]) -> Any:
    """The foreign checkpoint at `source`, as the first registered reader that recognises it opens it; None for an
    hf-vit checkpoint, an in-memory object or a source no reader recognises."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    for reader in _READERS:
        found = reader(os.fspath(source), kwargs)
        if found is not None:
            return found
    return None


def load_strictly(model_class: Any, load: Any, source: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """`model_class.from_pretrained(source, *args, **kwargs)` through transformers' `load` (a foreign checkpoint
    converted first), refusing weights that would leave part of the model randomly initialised (only the weights
    `model_class` declares new may be missing) and naming unreadable weights or folders."""
    output_loading_info = kwargs.pop("output_loading_info", False)
    foreign = open_foreign(source, kwargs)
    if foreign is None and isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
        raise OSError(f"{os.fspath(source)!r} is a file: pass the folder that holds it and its config.json.")
    try:
        if foreign is not None:  # transformers' or timm's ViT, or the authors' .npz, converted in memory
            model, info = foreign.load_model(load, args, {**kwargs, "output_loading_info": True})
        else:
            model, info = load(source, *args, output_loading_info=True, **kwargs)
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
    missing = sorted(
        key
        for key in info["missing_keys"]
        if not key.startswith(model_class._new_weight_prefixes) and not key.endswith(model_class._new_weight_suffixes)
    )
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(
            f"The weights in {source} do not fit {model_class.__name__}: {len(missing)} of its weights are not in "
            f"the checkpoint ({shown}) and would stay randomly initialised. Is it a checkpoint of another model?"
        )
    return (model, info) if output_loading_info else model


# The keyword arguments of `from_pretrained` that say where a checkpoint's files are, not what the model is.
_LOCATION_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")


def resize_asked_by_config(source: Any, kwargs: dict[str, Any]) -> list[Any] | None:
    """`[image_size, patch_size]` when `kwargs["config"]` (which `AutoModel.from_pretrained(folder, patch_size=P)`
    writes the sizes onto) asks for another patch size than the checkpoint at `source` was saved with, or (an hf-vit
    checkpoint) another image size, else None; `kwargs["config"]` is then replaced by a copy with the checkpoint's
    own sizes, so that the weights load, and the caller resamples the model to the sizes returned."""
    config = kwargs.get("config")
    if not isinstance(source, (str, os.PathLike)) or not hasattr(config, "patch_size"):
        return None
    location = {name: kwargs[name] for name in _LOCATION_KWARGS if name in kwargs}
    try:
        stored, _ = type(config).get_config_dict(os.fspath(source), **location)
    except (OSError, ValueError):
        return None  # not a readable hf-vit checkpoint: the loading itself reports it
    if stored.get("model_type") != config.model_type:
        return None
    saved_patch = stored.get("patch_size", config.patch_size)
    saved_size = stored.get("image_size", config.image_size)
    other_size = height_width(saved_size) != height_width(config.image_size)
    other_size = other_size and open_foreign(source, dict(location)) is None
    if saved_patch == config.patch_size and not other_size:
        return None
    wanted = [config.image_size, config.patch_size]
    as_saved = copy.deepcopy(config)
    as_saved.patch_size, as_saved.image_size = saved_patch, saved_size
    kwargs["config"] = as_saved
    return wanted


# transformers fetches a remote-code module with the files it imports, which it reads from the module's text with a
# pattern that also matches the lines below. The config's module imports this one, so loading any hf-vit class as
# remote code (from a folder or the Hub) brings every model file into the module cache, and a folder saved from there
# carries them all, as one saved from the package does. (A string, not imports: nothing here depends on the models.)
FETCHED_TOGETHER = """
    from .modeling_mim import VisionTransformerForMaskedImageModeling
    from .modeling_mpp import VisionTransformerForMaskedPatchPrediction
"""


def save_sibling_code(model: Any, folder: str | os.PathLike) -> None:
    """Copy beside the code `save_pretrained` wrote into `folder` (when it wrote code) every code file the config's
    `auto_map` names, with the files they import, from where this file was loaded: the package, or transformers'
    module cache for remote code, which holds them all (`FETCHED_TOGETHER`)."""
    folder, here = Path(folder), Path(__file__).parent
    if not (folder / Path(type(model).__module__.rpartition(".")[2]).with_suffix(".py")).is_file():
        return  # no remote code was written (the class is not registered for an Auto class)
    references = (getattr(model.config, "auto_map", None) or {}).values()
    named = {reference.partition(".")[0] for reference in references if isinstance(reference, str)}
    wanted = [here / f"{name}.py" for name in sorted(named)]
    imported = [Path(found) for path in wanted for found in get_relative_import_files(path)]
    for path in dict.fromkeys([*wanted, *imported]):
        if not (folder / path.name).exists():
            shutil.copyfile(path, folder / path.name)


# The weights files this project's saves write: the model (one file or its shards), a LoRA adapter, the EMA state.
WEIGHTS_WRITTEN = re.compile(r"(model(-\d{5}-of-\d{5})?|adapter_model|ema_state)\.safetensors")


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back: there is no other portable way)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_weights_the_umask_mode(folder: str | os.PathLike) -> None:
    """safetensors writes a weights file as a private temporary file (mode 0600) renamed into place; the other files of
    a saved folder get the modes the user's umask gives, and so do the weights written here (`WEIGHTS_WRITTEN`; any
    other file of the folder is left as it is)."""
    mode = 0o666 & ~current_umask()
    for path in Path(folder).glob("*.safetensors"):
        if WEIGHTS_WRITTEN.fullmatch(path.name) and path.is_file() and not path.is_symlink():
            path.chmod(mode)
