"""The array transforms of the Flax checkpoints (the authors' vit_jax and big_vision): Flax kernels are (in, out)
and split by attention head; hf-vit's are torch's (out, in) with the heads flattened. Both `.npz` tables use them,
and the rows of the norms, attention and MLP blocks they share, and one reading of an array's shape."""

from __future__ import annotations

from collections.abc import Mapping

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


def norm_rows(source: str, target: str) -> list[tuple]:
    """A Flax norm's `scale` and `bias` <-> torch's `weight` and `bias`."""
    return [(source + "scale", target + "weight"), (source + "bias", target + "bias")]


def attention_rows(source: str, qkv: str, out: str) -> list[tuple]:
    """Flax attention's query, key and value (split by head) <-> the fused projection `qkv` (`weight`, `bias`
    appended), and its output projection <-> `out`."""
    parts = [tuple(f"{source}{part}/{name}" for part in ("query", "key", "value")) for name in ("kernel", "bias")]
    return [
        (parts[0], qkv + "weight", QKV_KERNEL),
        (parts[1], qkv + "bias", QKV_BIAS),
        (source + "out/kernel", out + "weight", OUT_KERNEL),
        (source + "out/bias", out + "bias"),
    ]


def mlp_rows(source: str, target: str) -> list[tuple]:
    """A Flax MlpBlock's `Dense_0` and `Dense_1` <-> `fc1` and `fc2`."""
    return [
        row
        for i in (0, 1)
        for row in (
            (f"{source}Dense_{i}/kernel", f"{target}fc{i + 1}.weight", DENSE),
            (f"{source}Dense_{i}/bias", f"{target}fc{i + 1}.bias"),
        )
    ]


def array_shape(source: Mapping[str, np.ndarray], key: str, ndim: int, problems: list[str]) -> tuple[int, ...] | None:
    """The shape of `source[key]` when it is an array of `ndim` dimensions, else None and a problem saying why."""
    value = source.get(key)
    if value is None:
        problems.append(f"{key} is missing")
        return None
    if not isinstance(value, np.ndarray) or value.ndim != ndim:
        got = value.shape if isinstance(value, np.ndarray) else type(value).__name__
        problems.append(f"{key} should have {ndim} dimensions, got {got}")
        return None
    return tuple(value.shape)


def _tensor(value):
    """A float array as a tensor sharing its memory; anything else as it is (the check reports it)."""
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        return torch.from_numpy(value if value.flags.writeable else value.copy())
    return value
