"""The array transforms of the Flax checkpoints (the authors' vit_jax and big_vision): Flax kernels are (in, out)
and split by attention head; hf-vit's are torch's (out, in) with the heads flattened. Both `.npz` tables use them."""

from __future__ import annotations

import numpy as np
import torch

from ..model.configuration_vit import VisionTransformerConfig
from .common import ConversionError, Transform


def _heads(config: VisionTransformerConfig | None) -> int:
    if config is None:
        raise ConversionError("Writing the JAX layout needs the config: its kernels are split by attention head.")
    return config.num_attention_heads


# Flax kernels are (in, out) and split by head; hf-vit's are torch's (out, in), heads flattened.
CONV = Transform(lambda k: k.permute(3, 2, 0, 1), lambda w, config: (w.permute(2, 3, 1, 0),))  # HWIO <-> OIHW
DENSE = Transform(lambda k: k.T, lambda w, config: (w.T,))
QKV_KERNEL = Transform(  # 3 x (D, heads, head_dim) <-> rows [q; k; v] of (3 D, D)
    lambda *kernels: torch.cat([k.flatten(1).T for k in kernels]),
    lambda w, config: tuple(part.T.unflatten(1, (_heads(config), -1)) for part in w.chunk(3)),
)
QKV_BIAS = Transform(  # 3 x (heads, head_dim) <-> (3 D,)
    lambda *biases: torch.cat([b.flatten() for b in biases]),
    lambda b, config: tuple(part.unflatten(0, (_heads(config), -1)) for part in b.chunk(3)),
)
OUT_KERNEL = Transform(  # (heads, head_dim, D) <-> (D, D)
    lambda k: k.flatten(0, 1).T, lambda w, config: (w.T.unflatten(0, (_heads(config), -1)),)
)


def _tensor(value):
    """A float array as a tensor sharing its memory; anything else as it is (the check reports it)."""
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        return torch.from_numpy(value if value.flags.writeable else value.copy())
    return value
