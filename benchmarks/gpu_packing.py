"""The packing rows of the GPU benchmark (`gpu.py --packing`): the whole classifier at equal patch slots (the batches
of `packing_speed.layouts`), bf16 autocast, eager and compiled, inference and a training step (AdamW):

    square            B square images of K patches each: no padding, no mask
    padded + mask     B native-resolution images, one per row of K slots, the padding masked as keys
                      (`segment_attention_path` patched to "images")
    padded + varlen   the same batch as the model runs it (`varlen_attn` on CUDA in half precision, else a key mask)
    packed            the same images and the next ones, whole, in B * K / L rows of L slots, as the model runs them
    packed + mask     the same packed rows, each image gathered into a row of its own, its padding masked as keys
                      (what `varlen_attn` saves over it)

Checked first: the padded and packed batches' shared images get the same logits (fp32), and each layout's bf16
logits and gradients against fp32 (`accuracy_checks`). Each row records the attention path hf-vit chose, the kernels
a profile of one call shows and how busy the GPU was; `host_sync_check` runs a forward and backward under
`torch.cuda.set_sync_debug_mode("error")` (CUDA only). `--compile_blocks` (and `--quick`) compile each block instead
of the model.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import re
import time
from unittest import mock

import torch

from benchmarks.packing_speed import MODES, QUICK, layout_calls, layouts, small_classifier
from benchmarks.report import _markdown_table, cell
from benchmarks.runners import compile_models
from benchmarks.timing import budget_spent, error_line, profiled, sdpa_backend, timed_rounds
from hf_vit.model import attention

LAYOUTS = ("square", "padded + mask", "padded + varlen", "packed", "packed + mask")
# The full run: ViT-B width, 12 blocks, batch 128, K = 256 patches per image, packed rows of L = 1024.
FULL = dict(max_num_patches=256, packed_sequence_length=1024, batch_size=128, width=768, depth=12, heads=12)
# fp32 logits of the images the padded and packed batches share: equal to this (a GPU's kernels differ with the
# batch's shape more than CPU ones), before anything is timed.
LOGITS_TOLERANCE = {True: 1e-4, False: 1e-3}
PATH_NAMES = {"images": "sdpa, each image in a row of its own", "runs": "sdpa, each image's run alone"}
KERNEL_NAMES = re.compile(r"attention|attn|fmha|flash|cudnn|softmax|bmm", re.IGNORECASE)


def layout_context(layout: str):
    """The masked rows: each image in a row of its own, its padding masked as keys, whatever the device and dtype;
    the others take the model's own path."""
    if layout.endswith("+ mask"):
        return mock.patch.object(attention, "segment_attention_path", lambda *args, **kwargs: "images")
    return contextlib.nullcontext()


def observed_paths(calls: dict, log) -> dict[str, str]:
    """Per call ("layout | mode"), the attention path hf-vit's dispatch chose in one eager call of it (a masked row's
    own patch wins: nothing is recorded, its path is "images"): no mask, the padding masked as keys, each image in a
    row of its own, each image's run alone (CPU, eager only), or the runs' kernel
    ("varlen", "flash")."""
    original, seen, paths = attention.segment_attention_path, [], {}

    def record(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    with mock.patch.object(attention, "segment_attention_path", record):
        for key, fn in calls.items():
            seen.clear()
            try:  # a call that fails is reported with its error, and the other rows still run
                fn()
            except Exception as exc:  # noqa: BLE001
                log(f"packing: {key}: {error_line(exc)}")
            path = min(seen, default="images")
            if key.startswith("padded") and path == "images":  # one image per row: its padding as keys
                path = "sdpa, padding mask"
            paths[key] = "sdpa, no mask" if key.startswith("square") else PATH_NAMES.get(path, path)
    return paths


def host_sync_check(model: torch.nn.Module, batches: dict, device: torch.device) -> dict:
    """Per layout ("padded", "packed"): whether a forward and backward (bf16 autocast, the model's own attention path)
    runs under `torch.cuda.set_sync_debug_mode("error")` without synchronising with the host ("ok", or the error
    naming the operation), after one unchecked warm-up call. CUDA only: on another device, the reason it is skipped."""
    if device.type != "cuda":
        return {"skipped": f"{device.type}: no device to synchronise with (set_sync_debug_mode is CUDA's)"}
    result, layouts = {}, ("padded", "packed")
    calls = layout_calls(model, batches, layouts, lambda _: torch.autocast("cuda", torch.bfloat16))
    for layout in layouts:
        step = calls[f"{layout} | training"]  # bf16 autocast, forward, loss, backward, gradients zeroed
        try:
            step()  # warm-up: lazy initialisation (cuBLAS handles, kernels) is not the forward's
            torch.cuda.synchronize(device)
            torch.cuda.set_sync_debug_mode("error")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            result[layout] = "ok"
        except Exception as exc:  # noqa: BLE001  (reported: the synchronising operation is the finding)
            result[layout] = error_line(exc)
            model.zero_grad(set_to_none=True)
    return result


def sdpa_backends(device: torch.device) -> dict:
    """cuDNN's version and which SDPA backends are enabled, on CUDA; None on CPU."""
    if device.type != "cuda":
        return {"cudnn": None}
    names = {"flash": "flash", "mem_efficient": "mem_efficient", "cudnn_sdp": "cudnn", "math": "math"}
    enabled = {key: getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for key, name in names.items()}
    return {"cudnn": torch.backends.cudnn.version(), **enabled}


def profile_call(fn, device: torch.device, seconds: float) -> dict:
    """A profile of one call of `fn`: the attention-related ops and kernels it shows, and on CUDA how busy the GPU
    was (the kernels' time over the call's timed `seconds`: below 1, the GPU waited for the host) and the five longest
    kernels (name, ms)."""
    events = profiled(fn, device).key_averages()
    kernels = [event for event in events if event.device_type == torch.autograd.DeviceType.CUDA]
    longest = sorted(kernels, key=lambda event: -event.self_device_time_total)[:5]
    longest = [(event.key[:90], round(event.self_device_time_total / 1e3, 3)) for event in longest]
    busy = sum(event.self_device_time_total for event in kernels) / 1e6 / seconds if kernels else None
    attention_kernels = sorted({event.key for event in events if KERNEL_NAMES.search(event.key)})[:20]
    return {"attention_kernels": attention_kernels, "gpu_busy": busy, "longest_kernels": longest}


def accuracy_checks(model, batches: dict, shape: argparse.Namespace, device: torch.device) -> tuple[float, dict]:
    """The largest difference of the fp32 (no TF32) logits of the images the padded and packed batches share (raises
    beyond `LOGITS_TOLERANCE`); per layout but square, in bf16 autocast against the padded batch in fp32, the largest
    difference of those logits and the relative difference (L2) of the gradients of a fixed linear loss on them."""
    generator = torch.Generator().manual_seed(shape.seed)
    weights = torch.randn(shape.batch_size, model.config.num_labels, generator=generator).to(device)

    def run(layout: str, precision) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with layout_context(layout), precision:
            logits = model.eval()(**batches[layout.split()[0]]).logits[: shape.batch_size].float()
        (logits * weights).sum().backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        return logits.detach(), grads

    # fp32 means fp32, as in the models' rows (`runners.Run`): no TF32 (cuDNN's convolutions default to it)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    fp32 = {layout: run(layout, contextlib.nullcontext()) for layout in LAYOUTS[1:]}
    logits, grads = fp32["padded + mask"]
    difference = max((value - logits).abs().max().item() for value, _ in fp32.values())
    tolerance = LOGITS_TOLERANCE[device.type == "cpu"]
    if difference > tolerance:
        raise RuntimeError(
            f"The padded and packed batches disagree on the images' logits: {difference:.2e} > {tolerance:g}"
        )
    result = {}
    for layout in LAYOUTS[1:]:
        try:
            low_logits, low_grads = run(layout, torch.autocast(device.type, dtype=torch.bfloat16))
        except Exception as exc:  # noqa: BLE001  (reported; the rows are still measured)
            result[layout] = {"error": error_line(exc)}
            continue
        result[layout] = {
            "logits_max_difference": (low_logits - logits).abs().max().item(),
            "gradients_relative_difference": ((low_grads - grads).norm() / grads.norm()).item(),
        }
    model.zero_grad(set_to_none=True)
    return difference, result


def measure_packing(args: argparse.Namespace, log, start: float, save) -> dict:
    """The packing rows: per layout, mode and variant, images/s and real patches/s, the attention path and kernels.
    No compilation starts once `args.time_budget_s` is spent (counted from `start`); `save` gets the result so far
    after each variant."""
    device = torch.device(args.device)
    shape = argparse.Namespace(**(QUICK if args.quick else FULL), min_share=0.4, seed=0)  # what `layouts` reads
    shapes = layouts(shape)
    names = ("square", "padded", "packed")
    batches = {name: {key: value.to(device) for key, value in shapes[name]["batch"].items()} for name in names}
    model = small_classifier(shape.max_num_patches, shape.width, shape.depth, shape.heads, shape.seed).to(device)
    difference, accuracy = accuracy_checks(model, batches, shape, device)
    for layout, figures in accuracy.items():
        log(f"packing bf16 against fp32: {layout}: {figures}")
    host_sync = host_sync_check(model, batches, device)
    log(f"packing host synchronisation check: {host_sync}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    @contextlib.contextmanager
    def context(layout: str):  # bf16 autocast, the layout's attention path, the SDPA backend asked for
        with (
            torch.autocast(device.type, dtype=torch.bfloat16),
            layout_context(layout),
            sdpa_backend(args.sdpa_backend),
        ):
            yield

    paths = observed_paths(layout_calls(model, batches, LAYOUTS, context, optimizer), log)
    blocks = args.compile_blocks or (args.quick and not args.no_compile)  # --quick: as `gpu_session.sh packing`
    settings = {**vars(shape), "dtype": "bf16 autocast", "device": str(device), "steps": args.steps}
    settings.update(repeats=args.repeats, compile_backend=args.compile_backend, compile_mode=args.compile_mode)
    settings.update(sdpa_backend=args.sdpa_backend, compile_blocks=blocks)
    fields = {"images": "images", "patches": "patches", "padding_share": "padding", "rows_per_batch": "rows"}
    result = {
        "settings": settings, **{field: {name: shapes[name][key] for name in names} for field, key in fields.items()},
        "max_logits_difference": difference, "logits_tolerance": LOGITS_TOLERANCE[device.type == "cpu"],
        "bf16_accuracy": accuracy, "host_sync": host_sync, "sdpa": sdpa_backends(device), "rows": {}, "skipped": {},
    }  # fmt: skip
    for variant in ([] if args.no_eager else ["eager"]) + ([] if args.no_compile else ["compiled"]):
        if variant == "compiled" and budget_spent(args.time_budget_s, start):
            result["skipped"][variant] = budget_spent(args.time_budget_s, start)
            log(f"packing {variant}: skipped, {result['skipped'][variant]}")
            continue
        compiling = argparse.Namespace(**{**vars(args), "compile_blocks": blocks})
        runner = compile_models({"model": model}, compiling)[0]["model"] if variant == "compiled" else model
        calls = layout_calls(runner, batches, LAYOUTS, context, optimizer)
        time_rows(args, variant, calls, result, paths, log, start)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save(result)  # after each variant: a run stopped by a time limit keeps the rows measured
    return result


def time_rows(args, variant: str, calls: dict, result: dict, paths: dict, log, start: float) -> None:
    """Each call warmed up twice (compiled: the compilation, none started once the time budget is spent), timed in
    alternating rounds and profiled once, into `result["rows"]`; a call that fails goes to `result["skipped"]`."""
    device = torch.device(args.device)

    def budget(key: str, _) -> str | None:  # a call that fails is left out too, with its error
        log(f"packing {variant}: {key} ({time.perf_counter() - start:.0f} s)")
        spent = variant == "compiled" and budget_spent(args.time_budget_s, start)
        return spent.split(" (")[0] if spent else None

    timed = timed_rounds(calls, args.steps, args.repeats, device, warmup=2, skip=budget)
    for key, reason in timed["skipped"].items():
        result["skipped"][f"{key} | {variant}"] = reason
        log(f"packing {variant}: {key}: {reason}")
    for key, seconds in timed["seconds"].items():
        layout, mode = key.split(" | ")
        name, path = layout.split()[0], paths[key]
        if variant == "compiled" and path == PATH_NAMES["runs"]:  # eager only: a compiled graph gathers each image
            path = PATH_NAMES["images"]
        row = result["rows"][f"{key} | {variant}"] = {
            "layout": layout, "mode": mode, "variant": variant, "images_per_s": result["images"][name] / seconds,
            "patches_per_s": result["patches"][name] / seconds, "attention_path": path,
            **profile_call(calls[key], device, seconds),
        }  # fmt: skip
        if mode == "training":
            row["attention_kernels"] = None


def format_packing(report: dict) -> str:
    """The packing table: images/s and real patches/s per layout, mode and variant, against the square batch and
    the padded batch with its mask, and the attention path and kernels of each."""
    packing = report.get("packing")
    if not packing:
        return "Not measured (`gpu.py --packing`)."
    rows, table = packing["rows"], []
    for variant, mode, layout in itertools.product(("eager", "compiled"), MODES, LAYOUTS):
        row = rows.get(f"{layout} | {mode} | {variant}")
        if row is None:
            continue
        square, padded = (rows.get(f"{name} | {mode} | {variant}") for name in ("square", "padded + mask"))
        table.append([
            layout, mode, variant, f"{row['images_per_s']:,.1f}", f"{row['patches_per_s']:,.0f}",
            f"{row['patches_per_s'] / square['patches_per_s']:.3f}x" if square else "-",
            f"{row['images_per_s'] / padded['images_per_s']:.3f}x" if padded else "-",
            cell(row.get("gpu_busy"), ".0%"), row["attention_path"],
            ", ".join(f"`{name}`" for name in row["attention_kernels"] or []) or "-",
        ])  # fmt: skip
    header = ["layout", "mode", "variant", "images/s", "real patches/s", "patches/s vs square"]
    header += ["images/s vs padded + mask", "GPU busy", "attention path", "attention kernels (inference)"]
    settings, share, images, sdpa = packing["settings"], packing["padding_share"], packing["images"], packing["sdpa"]
    lines = [
        _markdown_table(header, table),
        "",
        f"Width {settings['width']}, {settings['depth']} blocks, {settings['heads']} heads, {settings['dtype']} on "
        f"{settings['device']}; K = {settings['max_num_patches']} patches per image, {settings['batch_size']} "
        f"images per padded batch ({share['padded']:.0%} padding), {images['packed']} packed into "
        f"{packing['rows_per_batch']['packed']} rows of L = {settings['packed_sequence_length']} "
        f"({share['packed']:.0%} padding); the padded and packed batches' logits agree to "
        f"{packing['max_logits_difference']:.1e} (fp32, eager). cuDNN {sdpa.get('cudnn')}; SDPA backends enabled: "
        + (", ".join(name for name, on in sdpa.items() if name != "cudnn" and on) or "-")
        + ".",
    ]
    if accuracy := packing.get("bf16_accuracy", {}):
        shown = []
        for layout, f in accuracy.items():
            figures = "error" in f or f"{f['logits_max_difference']:.1e}; {f['gradients_relative_difference']:.1e}"
            shown.append(f"{layout}: {f.get('error') or figures}")
        said = "bf16 autocast against fp32, the images the batches share (largest logits difference; relative"
        lines.append(f"{said} difference of the gradients): {'; '.join(shown)}.")
    host_sync = packing.get("host_sync")
    if host_sync and "skipped" in host_sync:
        lines.append(f"Host synchronisation check (forward + backward): skipped, {host_sync['skipped']}.")
    elif host_sync:
        outcomes = "; ".join(f"{layout}: {outcome}" for layout, outcome in host_sync.items())
        said = 'Host synchronisation check (forward + backward, bf16 autocast, `set_sync_debug_mode("error")`)'
        lines.append(f"{said}: {outcomes}.")
    if settings.get("compile_blocks"):
        lines.append("Compiled: each transformer block (fullgraph), the embeddings and heads eager.")
    lines += [f"Not measured: {key} ({reason})." for key, reason in packing.get("skipped", {}).items()]
    return "\n".join(lines)
