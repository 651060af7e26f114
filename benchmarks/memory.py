"""Peak memory of one step: `torch.cuda.max_memory_allocated` on a GPU; on CPU the peak of torch's CPU tensor
allocations (from the profiler's memory events) and, as a lower bound, the growth of the peak resident set."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


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
    if before is None or peak is None:
        return None
    return max(peak - before, 0) / 1024


def peak_tensor_memory_cpu_mb(step: Callable[[], None]) -> float | None:
    """Peak of the CPU tensor bytes live during one call above those live before it, in MiB, from torch.profiler's
    allocation events: the CPU counterpart of `torch.cuda.max_memory_allocated` (less what was live before)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:
        return None
    changes = sorted(
        (event.start_ns(), event.nbytes())
        for event in events
        if event.name() == "[memory]" and str(event.device_type()).endswith("CPU")
    )
    running = peak = 0
    for _, nbytes in changes:
        running += nbytes
        peak = max(peak, running)
    return peak / 2**20


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
