"""Timing: alternating rounds and the medians of their undisturbed samples, CUDA-synchronised calls, the machine's
matmul peak, the timed training and inference steps, their peak memory, and where a training step's time goes."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from .settings import DTYPES


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], object], device: torch.device, calls: int = 1) -> float:
    """Seconds of `calls` calls of `fn` between two CUDA synchronisations: the GPU's work, not only its launches."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return time.perf_counter() - start


def profiled(fn: Callable[[], object], device: torch.device, **options) -> torch.profiler.profile:
    """torch.profiler over one call of `fn`: the host's ops, and on CUDA the kernels, until they finish."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    activities += [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
    with torch.profiler.profile(activities=activities, **options) as profile:
        fn()
        synchronize(device)
    return profile


def autocast(device: torch.device, dtype: str):
    """bf16 autocast (fp32 master weights), or nothing for fp32."""
    return torch.autocast(device.type, DTYPES[dtype]) if DTYPES[dtype] else contextlib.nullcontext()


MODES = ("train", "infer")
CPU = torch.device("cpu")
CONTENTION_LIMIT = 0.15  # CPU cores used by other processes during a sample above which it counts as disturbed


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy ticks of the whole machine including steal, ticks of this process), or None off Linux."""
    try:
        with open("/proc/stat") as stat:
            values = [int(v) for v in stat.readline().split()[1:9]]
        with open("/proc/self/stat") as own:
            fields = own.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = values
    return user + nice + system + irq + softirq + steal, int(fields[11]) + int(fields[12])


def other_cpu_load(before: tuple[int, int] | None, after: tuple[int, int] | None, seconds: float) -> float | None:
    """CPU cores that other processes (and the hypervisor, as steal) took between two `_cpu_ticks` readings."""
    if before is None or after is None or seconds < 0.2:  # ticks are 10 ms: too coarse for shorter samples
        return None
    busy, own = after[0] - before[0], after[1] - before[1]
    return max(busy - own, 0) / os.sysconf("SC_CLK_TCK") / seconds


def median_seconds(sample: dict[str, list]) -> float:
    """Median of the undisturbed samples, or of all of them when fewer than half were undisturbed."""
    clean = [seconds for seconds, ok in zip(sample["seconds"], sample["clean"]) if ok]
    return statistics.median(clean if 2 * len(clean) >= len(sample["seconds"]) else sample["seconds"])


def matmul_flops_per_s(device: torch.device, dtype: str, size: int, repeats: int = 5) -> dict:
    """The machine's throughput on one large square `torch.matmul` in `dtype` (median over repeats)."""
    torch_dtype = DTYPES[dtype] or torch.float32
    a = torch.randn(size, size, device=device, dtype=torch_dtype)
    b = torch.randn(size, size, device=device, dtype=torch_dtype)
    out = torch.empty(size, size, device=device, dtype=torch_dtype)
    timed = timed_rounds({"matmul": lambda: torch.matmul(a, b, out=out)}, None, repeats, device, warmup=2)
    sample, seconds = timed["samples"]["matmul"], timed["seconds"]["matmul"]
    result = dict(size=size, dtype=dtype, flops_per_s=2 * size**3 / seconds, seconds=seconds)
    return {**result, "disturbed_samples": len(sample["clean"]) - sum(sample["clean"])}


def sdpa_backend(name: str | None):
    """A context restricting `scaled_dot_product_attention` to one backend (None: torch's own choice)."""
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, "MATH" if name == "math" else f"{name.upper()}_ATTENTION"))


def logits_of(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def make_optimizer(model: nn.Module, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW, lr 1e-4; `fused` takes the single-kernel implementation (CUDA), otherwise torch's default (foreach)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if fused else None)


def make_train_step(model: nn.Module, optimizer, inputs, labels, dtype: str, clip=None) -> Callable[[], None]:
    """Forward (of `inputs`: pixel values, or a processor's batch), cross-entropy (fp32, outside the model), backward,
    the gradients' norm clipped at `clip` (if any), the optimiser's step (if any); nothing read back to the host, so
    on a GPU the steps queue up and the timer synchronises once per sample."""

    def step() -> None:
        with autocast(labels.device, dtype):
            logits = logits_of(model(**inputs) if isinstance(inputs, dict) else model(inputs))
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        if optimizer is not None:
            optimizer.step()
        (optimizer or model).zero_grad(set_to_none=True)

    return step


def make_infer_step(model: nn.Module, pixel_values: torch.Tensor, dtype: str) -> Callable[[], None]:
    def step() -> None:
        with torch.no_grad(), autocast(pixel_values.device, dtype):
            model(pixel_values)

    return step


def benchmark_models(
    models: dict, pixel_values, labels, dtype: str, steps: int, warmup: int, repeats: int, memory: bool, optimizers
) -> dict[str, dict]:
    """Training-step and inference seconds (samples per repeat) and optionally peak memory of every model."""
    device = pixel_values.device
    results: dict[str, dict] = {name: {} for name in models}
    for mode in MODES:
        steps_fns = {
            name: make_train_step(model.train(), optimizers[name], pixel_values, labels, dtype)
            if mode == "train"
            else make_infer_step(model.eval(), pixel_values, dtype)
            for name, model in models.items()
        }
        timed = timed_rounds(steps_fns, steps, repeats, device, warmup)  # a first call's seconds include compiling
        for name, seconds in timed["first_call_s"].items():
            results[name][f"{mode}_first_call_s"] = seconds
        for name, seconds in timed["samples"].items():
            results[name][f"{mode}_seconds"] = seconds
            if memory:
                for key, value in measure_memory(steps_fns[name], device).items():
                    results[name][f"{mode}_{key}"] = value
    return results


def timed_rounds(fns: dict[str, Callable[[], object]], steps: int, repeats: int, device=CPU, warmup=1, skip=None):
    """Seconds per call of each function, one sample (of `steps` calls; None: as many as a quarter second takes) per
    round, the order of the functions reversed every round, after `warmup` calls of each (the first timed: a compiled
    function's compilation); with `skip`, one that `skip(name, first calls so far)` gives a reason for, or that
    raises, is left out ("skipped").

    A sample during which other processes used more than `CONTENTION_LIMIT` cores (read from /proc/stat) is marked
    disturbed, and rounds go on (up to twice `repeats`) until every function has `repeats` undisturbed samples.
    Returns, per function, its "samples" ("seconds", "other_cpu": cores, None where unknown, "clean"), the median
    "seconds" per call (`median_seconds`) and "first_call_s"; and the 1-minute "load_average" before and after.
    """
    first_call, fastest, skipped = {}, {}, {}
    for name, fn in fns.items():
        if skip is not None and (reason := skip(name, first_call)):
            skipped[name] = reason
            continue
        try:
            for _ in range(warmup):
                elapsed = timed_call(fn, device)
                first_call.setdefault(name, elapsed)
                fastest[name] = min(elapsed, fastest.get(name, elapsed))
        except Exception as exc:  # noqa: BLE001  (with `skip`: one failing function leaves the others measured)
            if skip is None:
                raise
            skipped[name] = error_line(exc)
    if steps is None:  # so that other processes' CPU use during a sample can be read (`other_cpu_load`)
        steps = max(1, math.ceil(0.25 / max(min(fastest.values()), 1e-6)))
    names = [name for name in fns if name not in skipped]
    before = os.getloadavg()[0]
    samples: dict[str, dict[str, list]] = {name: {"seconds": [], "other_cpu": [], "clean": []} for name in names}
    for round_index in range(2 * repeats):
        if round_index >= repeats and all(sum(samples[name]["clean"]) >= repeats for name in names):
            break
        for name in names if round_index % 2 == 0 else names[::-1]:
            ticks = _cpu_ticks()
            elapsed = timed_call(fns[name], device, steps)
            other = other_cpu_load(ticks, _cpu_ticks(), elapsed)
            samples[name]["seconds"].append(elapsed / steps)
            samples[name]["other_cpu"].append(other)
            samples[name]["clean"].append(other is None or other <= CONTENTION_LIMIT)
    load = [before, os.getloadavg()[0]]
    seconds = {name: median_seconds(sample) for name, sample in samples.items()}
    return dict(seconds=seconds, samples=samples, first_call_s=first_call, skipped=skipped, load_average=load)


def error_line(exc: Exception) -> str:
    """An exception as one short line of a report."""
    return f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def budget_spent(budget_s: float | None, start: float) -> str | None:
    """Why nothing more starts (`budget_s` seconds since `start` spent), or None."""
    elapsed = time.perf_counter() - start
    spent = budget_s is not None and elapsed > budget_s
    return f"time budget of {budget_s:.0f} s spent ({elapsed:.0f} s)" if spent else None


def _proc_status_kib(field_name: str) -> int | None:
    with contextlib.suppress(OSError), open("/proc/self/status") as status:
        return next((int(line.split()[1]) for line in status if line.startswith(field_name + ":")), None)
    return None


def peak_rss_growth_mb(step: Callable[[], None]) -> float | None:
    """Growth of the resident set (VmHWM, reset first via /proc/self/clear_refs, - VmRSS before) over one call, in MiB,
    None where unsupported: pages newly taken from the OS only, so a lower bound after warm-up."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return None
    before = _proc_status_kib("VmRSS")
    step()
    peak = _proc_status_kib("VmHWM")
    return None if before is None or peak is None else max(peak - before, 0) / 1024


def peak_tensor_memory_cpu_mb(step: Callable[[], None]) -> float | None:
    """Peak of the CPU tensor bytes live during one call above those live before it, in MiB, from torch.profiler's
    allocation events: the CPU counterpart of `torch.cuda.max_memory_allocated` (less what was live before)."""
    prof = profiled(step, CPU, profile_memory=True)
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:
        return None
    cpu = [event for event in events if event.name() == "[memory]" and str(event.device_type()).endswith("CPU")]
    changes = [event.nbytes() for event in sorted(cpu, key=lambda event: (event.start_ns(), event.nbytes()))]
    return max([0, *itertools.accumulate(changes)]) / 2**20


def measure_memory(step: Callable[[], None], device: torch.device) -> dict[str, float | None]:
    """Peak memory of one call of `step` (which has run before, so optimiser state exists)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return {"peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20}
    return {"peak_mem_mb": peak_tensor_memory_cpu_mb(step), "peak_rss_growth_mb": peak_rss_growth_mb(step)}


def memory_metric_description(device: torch.device) -> dict[str, str]:
    if device.type == "cuda":
        return {
            "peak_mem_mb": "torch.cuda.max_memory_allocated over one step after reset_peak_memory_stats (MiB): "
            "weights, gradients, optimiser state and activations",
        }
    return {
        "peak_mem_mb": "peak CPU tensor memory allocated during one step above what was live before it (MiB), from "
        "torch.profiler's allocation events (the CPU counterpart of max_memory_allocated less weights and "
        "optimiser state)",
        "rss_growth_lower_bound_mb": "(not compared) growth of the process's peak resident set (VmHWM after "
        "resetting it via /proc/self/clear_refs) over one step after warm-up (MiB); malloc reuses memory it kept "
        "from earlier steps, so this is a lower bound and often near zero",
    }


# ------------------------------------------------------------------- where one training step's time goes

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
OP_PATTERNS = {0: r"^aten::(mm|addmm|matmul|linear|mv)$", 2: "convolution", 3: "gelu", 4: "layer_norm"}  # by category


def _categorise(event) -> str:
    name, ancestors = event.name, []
    parent = event.cpu_parent
    while parent is not None:
        ancestors, parent = ancestors + [parent.name], parent.cpu_parent
    if any(a.startswith(("Optimizer.step", "Optimizer.zero_grad")) for a in ancestors):
        return PROFILE_CATEGORIES[7]
    # the kernels, the helpers they call (zeros, empty, ...), and batched products and softmax (in these models only
    # attention has them: hf-vit's matmul attention for CPU half-precision training, or an eager attention)
    if (
        re.search(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention", name)
        or any(re.search(r"scaled_dot_product|flash_attention", a) for a in ancestors)
        or name in ("aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::_softmax_backward_data")
    ):
        return PROFILE_CATEGORIES[1]
    for index, pattern in OP_PATTERNS.items():
        if re.search(pattern, name):
            return PROFILE_CATEGORIES[index]
    if name in ("aten::copy_", "aten::_to_copy", "aten::to", "aten::empty_strided"):
        # A copy made for a `.to(dtype)` is a cast; one made for `.contiguous()`, `clone`, `cat`... is a layout copy.
        return PROFILE_CATEGORIES[6 if name != "aten::copy_" or "aten::_to_copy" in ancestors[:2] else 5]
    if name in ("aten::clone", "aten::contiguous", "aten::cat", "aten::stack", "aten::_unsafe_view", "aten::reshape"):
        return PROFILE_CATEGORIES[5]
    return PROFILE_CATEGORIES[8]


def profile_training_step(model: nn.Module, optimizer, pixel_values: torch.Tensor, labels, dtype: str, top: int = 12):
    """Where one training step's time goes, by category (self CPU time of every op; on a GPU, self device time) and
    the top ops."""
    model.train()
    step = make_train_step(model, optimizer, pixel_values, labels, dtype)
    step()  # warm-up: optimiser state, allocator, kernels
    # On a GPU the time that matters is the kernels' (the host only queues them): each op's own device time.
    on_gpu = pixel_values.device.type == "cuda"
    for _attempt in range(3):  # profile again when another process took CPU time during the step
        ticks, start = _cpu_ticks(), time.perf_counter()
        prof = profiled(step, pixel_values.device)
        other = other_cpu_load(ticks, _cpu_ticks(), time.perf_counter() - start)
        if other is None or other <= CONTENTION_LIMIT:
            break
    totals, per_op, calls = defaultdict(float), defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.name == "[memory]":
            continue
        self_us = event.self_device_time_total if on_gpu else event.self_cpu_time_total
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
