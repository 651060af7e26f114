"""Where one training step's time goes, by category of op (torch.profiler; CUDA kernel time where on a GPU).

(Named profiling, not profile: a module called profile beside benchmark.py would shadow the standard library's,
which cProfile imports.)"""

from __future__ import annotations

import re
import time
from collections import defaultdict

import torch
from torch import nn

from .timing import CONTENTION_LIMIT, _cpu_ticks, make_train_step, other_cpu_load, synchronize

PROFILE_CATEGORIES = (
    "matmul (linear layers)",
    "attention (SDPA kernel, or bmm + softmax)",
    "patch embedding (conv)",
    "GELU",
    "LayerNorm",
    "copies/layout (clone, contiguous, cat, stack)",
    "dtype casts (autocast)",
    "optimizer (AdamW step, zero_grad)",
    "other (elementwise, reductions, loss, framework)",
)


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _categorise(event) -> str:
    name = event.name
    ancestors = list(_ancestors(event))
    if any(a.name.startswith(("Optimizer.step", "Optimizer.zero_grad")) for a in ancestors):
        return PROFILE_CATEGORIES[7]
    if re.search(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention", name):
        return PROFILE_CATEGORIES[1]
    if any(re.search(r"scaled_dot_product|flash_attention", a.name) for a in ancestors):
        return PROFILE_CATEGORIES[1]  # helpers the attention kernel calls (zeros, empty, ...)
    if name in ("aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::_softmax_backward_data"):
        # In these models only attention multiplies batched matrices or takes a softmax (hf-vit's matmul attention
        # for CPU half-precision training, or an eager attention).
        return PROFILE_CATEGORIES[1]
    if name in ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::mv"):
        return PROFILE_CATEGORIES[0]
    if "convolution" in name:
        return PROFILE_CATEGORIES[2]
    if "gelu" in name:
        return PROFILE_CATEGORIES[3]
    if "layer_norm" in name:
        return PROFILE_CATEGORIES[4]
    if name in ("aten::copy_", "aten::_to_copy", "aten::to", "aten::empty_strided"):
        # A copy made for a `.to(dtype)` is a cast; one made for `.contiguous()`, `clone`, `cat`... is a layout copy.
        if name != "aten::copy_" or any(a.name == "aten::_to_copy" for a in ancestors[:2]):
            return PROFILE_CATEGORIES[6]
        return PROFILE_CATEGORIES[5]
    if name in ("aten::clone", "aten::contiguous", "aten::cat", "aten::stack", "aten::_unsafe_view", "aten::reshape"):
        return PROFILE_CATEGORIES[5]
    return PROFILE_CATEGORIES[8]


def profile_training_step(model: nn.Module, optimizer, pixel_values: torch.Tensor, labels, dtype: str, top: int = 12):
    """Where one training step's time goes, by category (self CPU time of every op; on a GPU, self device time) and
    the top ops."""
    from torch.profiler import ProfilerActivity, profile

    model.train()
    step = make_train_step(model, optimizer, pixel_values, labels, dtype)
    step()  # warm-up: optimiser state, allocator, kernels
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if pixel_values.device.type == "cuda" else [])
    for _attempt in range(3):  # profile again when another process took CPU time during the step
        ticks, start = _cpu_ticks(), time.perf_counter()
        with profile(activities=activities) as prof:
            step()
            synchronize(pixel_values.device)
        other = other_cpu_load(ticks, _cpu_ticks(), time.perf_counter() - start)
        if other is None or other <= CONTENTION_LIMIT:
            break
    totals: dict[str, float] = defaultdict(float)
    per_op: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    # On a GPU the time that matters is the kernels' (the host only queues them): each op's own device time.
    on_gpu = pixel_values.device.type == "cuda"
    for event in prof.events():
        if event.name == "[memory]":
            continue
        device_us = getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0))
        self_us = device_us if on_gpu else event.self_cpu_time_total
        totals[_categorise(event)] += self_us
        per_op[event.name] += self_us
        calls[event.name] += 1
    total = sum(totals.values())
    return {
        "time": "self device (kernel) time" if on_gpu else "self CPU time",
        "other_cpu": other,
        "total_ms": total / 1e3,
        "categories_ms": {name: totals.get(name, 0.0) / 1e3 for name in PROFILE_CATEGORIES},
        "categories_pct": {name: 100 * totals.get(name, 0.0) / total for name in PROFILE_CATEGORIES},
        "top_ops": [
            {"op": name, "self_ms": us / 1e3, "pct": 100 * us / total, "calls": calls[name]}
            for name, us in sorted(per_op.items(), key=lambda item: -item[1])[:top]
        ],
    }
