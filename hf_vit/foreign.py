"""Where the readers of foreign checkpoints plug into loading.

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

import os
from collections.abc import Callable
from typing import Any

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
