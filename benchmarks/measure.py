"""Speed and memory of hf-vit against transformers' ViT (and timm's, where it is installed) with identical weights.

Everything runs in one process: the models share the input batch, the settings (attention implementation "sdpa",
dtype, train/eval mode, dropout 0) and the optimiser; their logits are checked to agree before anything is timed, and
their order alternates between rounds so that neither profits from running second (warm caches) or suffers from a
neighbour's job starting half-way. Figures are medians over the rounds.

`benchmarks/benchmark.py` is the command line over `run_benchmark`; `benchmarks/report.py` turns its report into
tables and the generated blocks of docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import platform
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from hf_vit import VisionTransformerConfig, VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.convert.timm_vit import TIMM_DEFAULTS, hf_vit_to_timm_state_dict
from hf_vit.convert.transformers_vit import hf_vit_to_transformers_module_state_dict

HF_VIT = "hf_vit"
TRANSFORMERS = "transformers"
TIMM = "timm"
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
LOGITS_TOLERANCE = 1e-4


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _help(text: str, **extra) -> dict:
    return {"help": text, **extra}


@dataclass
class BenchmarkSettings:
    """What to measure; every field is a flag of `benchmarks/benchmark.py`. The defaults: ViT-S/16, 224, batch 16."""

    model: str = field(default="vit-small-patch16-224", metadata=_help("hf-vit preset name"))
    image_size: int | None = field(default=None, metadata=_help("default: the preset's resolution"))
    batch_size: int = 16
    num_labels: int = 1000
    num_hidden_layers: int | None = field(default=None, metadata=_help("override the preset's depth"))
    device: str = field(default_factory=_default_device)
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16"], metadata=_help("", choices=list(DTYPES)))
    steps: int | None = field(default=None, metadata=_help("timed steps per round (default 3 CPU, 20 GPU)"))
    warmup: int | None = field(
        default=None, metadata=_help("untimed steps per model (default 1 CPU, 5 GPU; compiled models at least 2)")
    )
    repeats: int = field(default=3, metadata=_help("undisturbed rounds per model; figures are their medians"))
    compile: bool = field(
        default=False, metadata=_help("also time torch.compile'd models (on 2 CPU cores this adds many minutes)")
    )
    compile_mode: str | None = field(default=None, metadata=_help("torch.compile mode for every model"))
    compile_modes: list[str] = field(
        default_factory=lambda: ["train", "infer"],
        metadata=_help(
            "which rows to compile (on CPU compiling the backward takes minutes)", choices=["train", "infer"]
        ),
    )
    memory: bool = field(default=True, metadata=_help("measure peak memory"))
    matmul_size: int | None = field(default=None, metadata=_help("default 2048 on CPU, 8192 on GPU"))
    processor: bool = field(default=True, metadata=_help("compare the image processors on real photos"))
    processor_images: int = 32
    processor_repeats: int = 5
    pipeline: bool = field(
        default=True, metadata=_help("compare the training input pipelines (hf-vit, torchvision, timm) per core")
    )
    pipeline_images: int = 48
    pipeline_repeats: int = 5
    onnx: bool = field(default=True, metadata=_help("time onnxruntime (CPU) against eager fp32 inference"))
    onnx_batch_sizes: list[int] = field(default_factory=lambda: [1, 16])
    profile: bool = field(
        default=False, metadata=_help("profile one training step of each model, and the hf-vit input pipeline")
    )
    sizes: list[int] = field(default_factory=list, metadata=_help("image sizes of a throughput sweep"))
    sweep_batch_size: int | None = field(default=None, metadata=_help("default: --batch_size"))
    sweep_steps: int | None = field(default=None, metadata=_help("default: --steps"))
    sweep_repeats: int | None = field(default=None, metadata=_help("default: --repeats"))
    sweep_dtypes: list[str] | None = field(default=None, metadata=_help("default: --dtypes", choices=list(DTYPES)))
    sweep_only: bool = field(default=False, metadata=_help("only the size sweep (with --sizes)"))
    profile_only: bool = field(default=False, metadata=_help("only the training-step profile, e.g. to redo one"))
    timm: bool = field(default=True, metadata=_help("add timm's ViT where timm is installed"))
    threads: int | None = field(default=None, metadata=_help("torch.set_num_threads"))
    seed: int = 0

    def __post_init__(self) -> None:
        on_gpu = self.device.startswith("cuda")
        if self.steps is None:
            self.steps = 20 if on_gpu else 3
        if self.warmup is None:
            self.warmup = 5 if on_gpu else 1
        unknown = sorted((set(self.dtypes) | set(self.sweep_dtypes or ())) - set(DTYPES))
        if unknown:
            raise ValueError(f"Unknown dtype(s) {unknown}; use {sorted(DTYPES)}.")
        try:
            VisionTransformerConfig.from_preset(self.model)
        except ValueError as error:
            raise ValueError(f"unknown --model {self.model!r}: {error}") from None
        if self.sweep_only and self.profile_only:
            raise ValueError("--sweep_only and --profile_only exclude each other")
        if self.sweep_only and not self.sizes:
            raise ValueError("--sweep_only needs --sizes")
        if self.profile_only and self.sizes:
            raise ValueError("--profile_only measures no size sweep: drop --sizes, or use --sweep_only for the sweep")

    @property
    def main_rows(self) -> bool:
        """Whether the main table (and the image processors) is measured, not only a sweep or a profile."""
        return not (self.sweep_only or self.profile_only)


# ---------------------------------------------------------------------------------------------------------- models


def hf_vit_config(settings: BenchmarkSettings, image_size: int | None = None) -> VisionTransformerConfig:
    """The preset's config with dropout off and a non-zero head (a zero head would make the logits check trivial)."""
    fields = dict(
        num_labels=settings.num_labels,
        zero_init_head=False,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    )
    if settings.num_hidden_layers is not None:
        fields["num_hidden_layers"] = settings.num_hidden_layers
    if image_size or settings.image_size:
        fields["image_size"] = image_size or settings.image_size
    return VisionTransformerConfig.from_preset(settings.model, **fields)


def build_hf_vit(config: VisionTransformerConfig, seed: int = 0) -> VisionTransformerForImageClassification:
    torch.manual_seed(seed)
    model = VisionTransformerForImageClassification._from_config(config, attn_implementation="sdpa")
    # Non-trivial values everywhere (biases start at zero, LayerNorm at identity), so the logits check means something.
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def transformers_from_hf_vit(model: VisionTransformerForImageClassification) -> nn.Module:
    """transformers' `ViTForImageClassification` with the same configuration and weights as `model`."""
    from transformers import ViTConfig, ViTForImageClassification

    config = model.config
    height, width = config.image_hw
    if height != width:
        raise ValueError("transformers' ViT benchmark needs a square image size.")
    if config.classifier != "token" or config.representation_size is not None:
        raise ValueError("transformers' ViTForImageClassification has a class-token head and no pre-logits layer.")
    reference_config = ViTConfig(
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        layer_norm_eps=config.layer_norm_eps,
        image_size=height,
        patch_size=config.patch_size,
        num_channels=config.num_channels,
        qkv_bias=config.qkv_bias,
        num_labels=config.num_labels,
    )
    reference = ViTForImageClassification._from_config(reference_config, attn_implementation="sdpa")
    state = hf_vit_to_transformers_module_state_dict(model.state_dict())
    reference.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True)
    return reference.to(next(model.parameters()).device)


def timm_from_hf_vit(model: VisionTransformerForImageClassification) -> nn.Module:
    """timm's `VisionTransformer` with the same configuration and weights; raises ImportError without timm."""
    from timm.models.vision_transformer import VisionTransformer

    config = model.config
    if config.hidden_act != TIMM_DEFAULTS["hidden_act"]:
        raise ValueError(f"timm's ViT uses exact GELU; the model uses {config.hidden_act!r}.")
    kwargs = {}
    if config.layer_norm_eps != TIMM_DEFAULTS["layer_norm_eps"]:
        kwargs["norm_layer"] = functools.partial(nn.LayerNorm, eps=config.layer_norm_eps)
    reference = VisionTransformer(
        img_size=config.image_hw,
        patch_size=config.patch_size,
        in_chans=config.num_channels,
        num_classes=config.num_labels,
        global_pool="token",
        embed_dim=config.hidden_size,
        depth=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        mlp_ratio=config.intermediate_size / config.hidden_size,
        qkv_bias=config.qkv_bias,
        class_token=True,
        **kwargs,
    )
    state = hf_vit_to_timm_state_dict(model.state_dict())
    reference.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True)
    return reference.to(next(model.parameters()).device)


def build_models(
    settings: BenchmarkSettings, device: torch.device, image_size: int | None = None
) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """hf-vit, transformers' ViT and (when asked for and importable) timm's ViT, with identical weights, on `device`.

    Returns the models and, for those left out, why.
    """
    ours = build_hf_vit(hf_vit_config(settings, image_size), settings.seed)
    models = {HF_VIT: ours.to(device), TRANSFORMERS: transformers_from_hf_vit(ours)}
    skipped = {}
    if settings.timm:
        try:
            models[TIMM] = timm_from_hf_vit(ours)
        except Exception as error:  # noqa: BLE001 - timm is optional; any failure only drops its column
            skipped[TIMM] = f"{type(error).__name__}: {error}"
    else:
        skipped[TIMM] = "not requested"
    return models, skipped


def logits_of(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


@torch.no_grad()
def compare_logits(models: dict[str, nn.Module], pixel_values: torch.Tensor, dtype: str = "fp32") -> dict[str, float]:
    """Max |logits - hf-vit logits| of every other model, in eval mode."""
    logits = {}
    for name, model in models.items():
        model.eval()
        with autocast(pixel_values.device, dtype):
            logits[name] = logits_of(model(pixel_values)).float()
    reference = logits[HF_VIT]
    return {name: (value - reference).abs().max().item() for name, value in logits.items() if name != HF_VIT}


# ----------------------------------------------------------------------------------------------------------- FLOPs


def vit_forward_flops(config: VisionTransformerConfig, image_size: int | None = None) -> dict[str, int]:
    """Forward FLOPs of one image (a multiply-add is 2 FLOPs), counted analytically per part of the model.

    Counts the matrix products only: patch embedding, qkv, attention scores and weighted sum, output projection, MLP
    and head; LayerNorm, GELU, softmax and residual adds are left out (they are a few percent of the total).
    """
    height, width = (image_size, image_size) if image_size else config.image_hw
    patch = config.patch_size
    patches = (height // patch) * (width // patch)
    tokens = patches + config.num_prefix_tokens
    dim, hidden, depth = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    parts = {
        "patch_embedding": 2 * patches * config.num_channels * patch * patch * dim,
        "qkv": depth * 2 * tokens * dim * 3 * dim,
        "attention_scores": depth * 2 * tokens * tokens * dim,
        "attention_weighted_sum": depth * 2 * tokens * tokens * dim,
        "attention_projection": depth * 2 * tokens * dim * dim,
        "mlp": depth * 2 * tokens * dim * hidden * 2,
        "head": 2 * (config.representation_size or dim) * config.num_labels
        + (2 * dim * config.representation_size if config.representation_size else 0),
    }
    parts["total"] = sum(parts.values())
    return parts


# ----------------------------------------------------------------------------------------------------------- timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device, dtype: str):
    """bf16 autocast (fp32 master weights), or nothing for fp32."""
    target = DTYPES[dtype]
    if target is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=target)


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


def time_alternating(
    fns: dict[str, Callable[[], object]], steps: int, repeats: int, device: torch.device, max_rounds: int | None = None
) -> dict[str, dict[str, list]]:
    """Seconds per call of each function, one sample per round; the order of the functions reverses every round.

    A sample during which other processes used more than `CONTENTION_LIMIT` cores (read from /proc/stat) is marked
    disturbed, and rounds go on (up to `max_rounds`, default twice `repeats`) until every function has `repeats`
    undisturbed samples. Returns, per function, "seconds", "other_cpu" (cores, None where unknown) and "clean".
    """
    names = list(fns)
    max_rounds = max(max_rounds or 2 * repeats, repeats)
    samples: dict[str, dict[str, list]] = {name: {"seconds": [], "other_cpu": [], "clean": []} for name in names}
    for round_index in range(max_rounds):
        if round_index >= repeats and all(sum(samples[name]["clean"]) >= repeats for name in names):
            break
        for name in names if round_index % 2 == 0 else names[::-1]:
            synchronize(device)
            ticks = _cpu_ticks()
            start = time.perf_counter()
            for _ in range(steps):
                fns[name]()
            synchronize(device)
            elapsed = time.perf_counter() - start
            other = other_cpu_load(ticks, _cpu_ticks(), elapsed)
            samples[name]["seconds"].append(elapsed / steps)
            samples[name]["other_cpu"].append(other)
            samples[name]["clean"].append(other is None or other <= CONTENTION_LIMIT)
    return samples


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
    torch.matmul(a, b, out=out)  # warm-up (and library initialisation)
    synchronize(device)
    start = time.perf_counter()
    torch.matmul(a, b, out=out)
    synchronize(device)
    single = max(time.perf_counter() - start, 1e-6)
    calls = max(1, math.ceil(0.25 / single))  # at least a quarter second per sample

    def product() -> None:
        for _ in range(calls):
            torch.matmul(a, b, out=out)

    sample = time_alternating({"matmul": product}, 1, repeats, device)["matmul"]
    seconds = median_seconds(sample) / calls
    return {
        "size": size,
        "dtype": dtype,
        "flops_per_s": 2 * size**3 / seconds,
        "seconds": seconds,
        "disturbed_samples": len(sample["clean"]) - sum(sample["clean"]),
    }


def make_train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, pixel_values: torch.Tensor, labels: torch.Tensor, dtype: str
) -> Callable[[], None]:
    """Forward, cross-entropy (in fp32, outside the model, the same for every model), backward, AdamW step."""
    device = pixel_values.device

    def step() -> None:
        with autocast(device, dtype):
            logits = logits_of(model(pixel_values))
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def make_infer_step(model: nn.Module, pixel_values: torch.Tensor, dtype: str) -> Callable[[], None]:
    device = pixel_values.device

    def step() -> None:
        with torch.no_grad(), autocast(device, dtype):
            model(pixel_values)

    return step


# ----------------------------------------------------------------------------------------------------------- memory


def _proc_status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_growth_mb(step: Callable[[], None]) -> float | None:
    """Growth of the process's resident set (VmHWM - VmRSS before) over one call, in MiB; None where unsupported.

    The high-water mark is reset first (`/proc/self/clear_refs`). This counts pages newly taken from the OS only:
    memory that malloc kept from earlier steps and reuses does not show, so it is a lower bound after warm-up.
    """
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
    """Peak of the CPU tensor bytes live during one call above those live before it, in MiB.

    Read from torch.profiler's allocation events: every allocation and free of torch's CPU allocator in order, so it
    is the CPU counterpart of `torch.cuda.max_memory_allocated` (minus what was allocated before the step).
    """
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
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        synchronize(device)
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


# ----------------------------------------------------------------------------------------------------------- models


def benchmark_models(
    models: dict[str, nn.Module],
    pixel_values: torch.Tensor,
    labels: torch.Tensor,
    dtype: str,
    steps: int,
    warmup: int,
    repeats: int,
    memory: bool,
    optimizers: dict[str, torch.optim.Optimizer],
    modes: Sequence[str] = ("train", "infer"),
) -> dict[str, dict]:
    """Training-step and inference seconds (samples per repeat) and optionally peak memory of every model."""
    device = pixel_values.device
    results: dict[str, dict] = {name: {} for name in models}
    for mode in modes:
        steps_fns = {}
        for name, model in models.items():
            if mode == "train":
                model.train()
                steps_fns[name] = make_train_step(model, optimizers[name], pixel_values, labels, dtype)
            else:
                model.eval()
                steps_fns[name] = make_infer_step(model, pixel_values, dtype)
        for name, step in steps_fns.items():
            for index in range(warmup):
                synchronize(device)
                start = time.perf_counter()
                step()
                synchronize(device)
                if index == 0:
                    results[name][f"{mode}_first_call_s"] = time.perf_counter() - start
        samples = time_alternating(steps_fns, steps, repeats, device)
        for name, seconds in samples.items():
            results[name][f"{mode}_seconds"] = seconds
            if memory:
                for key, value in measure_memory(steps_fns[name], device).items():
                    results[name][f"{mode}_{key}"] = value
    return results


# -------------------------------------------------------------------------------------------------------- processor


def sample_photos(count: int = 32) -> list:
    """`count` crops of scikit-learn's two sample photos (427x640), in four sizes: real photographs, offline."""
    import PIL.Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    sizes = [(427, 640), (384, 576), (320, 480), (256, 384)]
    images = []
    index = 0
    while len(images) < count:
        photo = photos[index % len(photos)]
        crop_h, crop_w = sizes[(index // len(photos)) % len(sizes)]
        shift = index // (len(photos) * len(sizes))
        top = (shift * 37) % (photo.shape[0] - crop_h + 1)
        left = (shift * 53) % (photo.shape[1] - crop_w + 1)
        images.append(PIL.Image.fromarray(photo[top : top + crop_h, left : left + crop_w]))
        index += 1
    return images


def compare_processors(image_size: int, count: int = 32, repeats: int = 5) -> dict:
    """Images/s of hf-vit's processor and transformers' `ViTImageProcessorPil` on real photos, and how far apart
    their outputs are in [0, 1] pixel units."""
    from transformers import ViTImageProcessorPil

    images = sample_photos(count)
    processors = {
        HF_VIT: VisionTransformerImageProcessor(size=image_size),
        TRANSFORMERS: ViTImageProcessorPil(size={"height": image_size, "width": image_size}),
    }
    fns = {name: functools.partial(processor, images, return_tensors="pt") for name, processor in processors.items()}
    outputs = {name: fn()["pixel_values"] for name, fn in fns.items()}  # warm-up and the outputs to compare
    samples = time_alternating(fns, 1, repeats, torch.device("cpu"))
    std = torch.tensor(processors[TRANSFORMERS].image_std, dtype=torch.float32).view(1, -1, 1, 1)
    # pixel_values = (x - mean) / std, so a difference in pixel_values times std is a difference of x in [0, 1].
    difference = (outputs[HF_VIT].float() - outputs[TRANSFORMERS].float()).abs() * std
    return {
        "images": count,
        "image_sizes": sorted({f"{image.height}x{image.width}" for image in images}),
        "output_size": image_size,
        "seconds": samples,
        "images_per_s": {name: count / median_seconds(sample) for name, sample in samples.items()},
        "mean_abs_diff_01": difference.mean().item(),
        "max_abs_diff_01": difference.max().item(),
        "shapes_match": tuple(outputs[HF_VIT].shape) == tuple(outputs[TRANSFORMERS].shape),
    }


# --------------------------------------------------------------------------------------------------- input pipeline

TORCHVISION = "torchvision"
PIL_DECODE = "pil_decode"
PIPELINE_NAMES = {
    HF_VIT: "hf-vit make_train_transform",
    TORCHVISION: "torchvision, as transformers' run_image_classification.py",
    TIMM: "timm create_transform(is_training=True, color_jitter=None)",
    PIL_DECODE: "PIL decoding alone (open, RGB)",
}
PHOTO_SIZES = {"photo": [(640, 427), (500, 375)], "large_photo": [(2048, 1365), (1600, 1200)]}


def jpeg_photos(count: int, sizes: Sequence[tuple[int, int]], quality: int = 90) -> list[bytes]:
    """`count` JPEG files of scikit-learn's two sample photos (640x427) resized to `sizes` (width, height) in turn."""
    import io

    import PIL.Image
    from sklearn.datasets import load_sample_images

    photos = [PIL.Image.fromarray(photo) for photo in load_sample_images().images]
    files = []
    for index in range(count):
        photo, size = photos[index % len(photos)], sizes[(index // len(photos)) % len(sizes)]
        photo = photo if photo.size == size else photo.resize(size, PIL.Image.Resampling.BICUBIC)
        buffer = io.BytesIO()
        photo.save(buffer, format="JPEG", quality=quality)
        files.append(buffer.getvalue())
    return files


def input_pipelines(output_size: int) -> tuple[dict[str, Callable[[list[bytes]], object]], dict[str, str]]:
    """Training input pipelines from JPEG bytes to a normalised float batch (crop, flip), and why any is missing.

    hf-vit's training transform; torchvision's pipeline of transformers' image classification example
    (RandomResizedCrop, RandomHorizontalFlip, ToTensor, Normalize on the decoded image converted to RGB, then
    stacked like its collate function); timm's `create_transform(is_training=True)` without colour jitter; and PIL's
    decoding alone as the floor. All normalise with the same mean and std.
    """
    import io

    import PIL.Image

    from hf_vit.data import make_train_transform

    processor = VisionTransformerImageProcessor(size=output_size)
    mean, std = list(processor.image_mean), list(processor.image_std)
    hf_vit_transform = make_train_transform(processor)

    def decode(data: bytes) -> PIL.Image.Image:
        return PIL.Image.open(io.BytesIO(data)).convert("RGB")

    pipelines: dict[str, Callable[[list[bytes]], object]] = {
        HF_VIT: lambda files: hf_vit_transform({"image": [{"path": None, "bytes": data} for data in files]}),
    }
    skipped = {}
    try:
        from torchvision import transforms

        example = transforms.Compose(
            [
                transforms.RandomResizedCrop(output_size),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize(mean, std),
            ]
        )
        pipelines[TORCHVISION] = lambda files: torch.stack([example(decode(data)) for data in files])
    except Exception as error:  # noqa: BLE001 - torchvision is optional (the peer environment has it)
        skipped[TORCHVISION] = f"{type(error).__name__}: {error}"
    try:
        from timm.data import create_transform

        timm_transform = create_transform(output_size, is_training=True, color_jitter=None, mean=mean, std=std)
        pipelines[TIMM] = lambda files: torch.stack([timm_transform(decode(data)) for data in files])
    except Exception as error:  # noqa: BLE001 - timm is optional
        skipped[TIMM] = f"{type(error).__name__}: {error}"
    pipelines[PIL_DECODE] = lambda files: [decode(data) for data in files]
    return pipelines, skipped


def compare_input_pipelines(output_size: int, count: int = 48, repeats: int = 5) -> dict:
    """Images/s per core of the training input pipelines on JPEG photos of the sizes in `PHOTO_SIZES`.

    One torch thread (as in a DataLoader worker), the pipelines alternating round by round like the models.
    """
    pipelines, skipped = input_pipelines(output_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    result: dict = {"names": PIPELINE_NAMES, "skipped": skipped, "output_size": output_size, "threads": 1}
    try:
        for kind, sizes in PHOTO_SIZES.items():
            files = jpeg_photos(count if kind == "photo" else max(count // 4, 4), sizes)
            fns = {name: functools.partial(pipeline, files) for name, pipeline in pipelines.items()}
            durations = []
            for name, fn in fns.items():  # warm-up, and every pipeline must give the same kind of batch
                start = time.perf_counter()
                output = fn()
                durations.append(time.perf_counter() - start)
                if name != PIL_DECODE:
                    pixels = output["pixel_values"] if isinstance(output, dict) else output
                    expected = (len(files), 3, output_size, output_size)
                    if tuple(pixels.shape) != expected or pixels.dtype != torch.float32:
                        raise AssertionError(f"{name} gave {tuple(pixels.shape)} {pixels.dtype}, not {expected}")
            # At least a quarter second per sample, so that other processes' CPU use during it can be read.
            steps = max(1, math.ceil(0.25 / max(min(durations), 1e-3)))
            samples = time_alternating(fns, steps, repeats, torch.device("cpu"))
            result[kind] = {
                "images": len(files),
                "image_sizes": [f"{width}x{height}" for width, height in sizes],
                "jpeg_kib": sum(len(data) for data in files) / len(files) / 1024,
                "seconds": samples,
                "images_per_s": {name: len(files) / median_seconds(sample) for name, sample in samples.items()},
            }
    finally:
        torch.set_num_threads(threads)
    return result


def profile_input_pipeline(output_size: int, count: int = 48, top: int = 12) -> dict:
    """Where hf-vit's training transform spends its time on the photos, by Python function (cProfile, one thread)."""
    import cProfile
    import pstats

    pipelines, _ = input_pipelines(output_size)
    files = jpeg_photos(count, PHOTO_SIZES["photo"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipelines[HF_VIT](files)
        profiler = cProfile.Profile()
        profiler.enable()
        pipelines[HF_VIT](files)
        profiler.disable()
    finally:
        torch.set_num_threads(threads)
    stats = pstats.Stats(profiler)
    total = stats.total_tt
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]  # by own (self) time
    return {
        "images": count,
        "total_ms_per_image": 1e3 * total / count,
        "top_functions": [
            {
                "function": f"{Path(filename).name}:{line}({name})" if filename != "~" else name,
                "self_ms_per_image": 1e3 * own / count,
                "pct": 100 * own / total,
            }
            for (filename, line, name), (_, _, own, _, _) in rows
        ],
    }


# ------------------------------------------------------------------------------------------------------ onnxruntime

ONNX_TOLERANCE = 1e-3


def compare_onnxruntime(
    model: VisionTransformerForImageClassification, batch_sizes: Sequence[int], steps: int, repeats: int, seed: int
) -> dict:
    """onnxruntime (CPU) on `hf_vit.export`'s ONNX file against eager PyTorch fp32 inference, same weights.

    The outputs are compared first (max |logits difference| <= `ONNX_TOLERANCE`); onnxruntime gets as many
    intra-op threads as torch uses.
    """
    import tempfile

    import onnxruntime

    from hf_vit.export import export

    model = model.eval()
    config = model.config
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        path = export(model, Path(folder) / "model.onnx", "onnx")
        export_s = time.perf_counter() - start
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    result: dict = {"onnxruntime": onnxruntime.__version__, "export_s": export_s, "threads": torch.get_num_threads()}
    generator = torch.Generator().manual_seed(seed + 3)
    for batch in batch_sizes:
        pixel_values = torch.randn(batch, config.num_channels, *config.image_hw, generator=generator)
        array = pixel_values.numpy()
        with torch.no_grad():
            expected = model(pixel_values).logits
        got = session.run(None, {"pixel_values": array})[0]
        difference = float((torch.from_numpy(got) - expected).abs().max())
        if difference > ONNX_TOLERANCE:
            raise AssertionError(
                f"onnxruntime's logits differ by {difference:.2e} > {ONNX_TOLERANCE} at batch {batch}"
            )
        fns = {
            HF_VIT: make_infer_step(model, pixel_values, "fp32"),
            "onnxruntime": functools.partial(session.run, None, {"pixel_values": array}),
        }
        samples = time_alternating(fns, steps, repeats, torch.device("cpu"))
        per_s = {name: batch / median_seconds(sample) for name, sample in samples.items()}
        result[f"batch_{batch}"] = {
            "batch_size": batch,
            "max_abs_logits_diff": difference,
            "seconds": samples,
            "images_per_s": per_s,
            "ratio_onnxruntime_to_eager": per_s["onnxruntime"] / per_s[HF_VIT],
        }
    return result


# -------------------------------------------------------------------------------------------------------- profiling

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


def profile_training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    pixel_values: torch.Tensor,
    labels: torch.Tensor,
    dtype: str,
    top: int = 12,
) -> dict:
    """Where one training step's CPU time goes, by category (self CPU time of every op) and the top ops."""
    from torch.profiler import ProfilerActivity, profile

    model.train()
    step = make_train_step(model, optimizer, pixel_values, labels, dtype)
    step()  # warm-up: optimiser state, allocator, kernels
    activities = [ProfilerActivity.CPU]
    if pixel_values.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
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
    for event in prof.events():
        if event.name == "[memory]":
            continue
        self_us = event.self_cpu_time_total
        totals[_categorise(event)] += self_us
        per_op[event.name] += self_us
        calls[event.name] += 1
    total = sum(totals.values())
    return {
        "other_cpu": other,
        "total_ms": total / 1e3,
        "categories_ms": {name: totals.get(name, 0.0) / 1e3 for name in PROFILE_CATEGORIES},
        "categories_pct": {name: 100 * totals.get(name, 0.0) / total for name in PROFILE_CATEGORIES},
        "top_ops": [
            {"op": name, "self_ms": us / 1e3, "pct": 100 * us / total, "calls": calls[name]}
            for name, us in sorted(per_op.items(), key=lambda item: -item[1])[:top]
        ],
    }


# ------------------------------------------------------------------------------------------------------------ sweep


def size_sweep(settings: BenchmarkSettings, device: torch.device) -> list[dict]:
    """Training and inference throughput of the models at each of `settings.sizes` (eager)."""
    batch = settings.sweep_batch_size or settings.batch_size
    steps = settings.sweep_steps or settings.steps
    repeats = settings.sweep_repeats or settings.repeats
    rows = []
    for size in settings.sizes:
        models, _ = build_models(settings, device, size)
        config = models[HF_VIT].config
        generator = torch.Generator().manual_seed(settings.seed + 2)
        pixel_values = torch.randn(batch, config.num_channels, size, size, generator=generator).to(device)
        labels = torch.randint(0, settings.num_labels, (batch,), generator=generator).to(device)
        diffs = compare_logits(models, pixel_values[:2])
        optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in models.items()}
        for dtype in settings.sweep_dtypes or settings.dtypes:
            results = benchmark_models(
                models, pixel_values, labels, dtype, steps, max(settings.warmup, 1), repeats, False, optimizers
            )
            row = {
                "image_size": size,
                "tokens": config.num_patches + config.num_prefix_tokens,
                "dtype": dtype,
                "batch_size": batch,
                "max_abs_logits_diff": diffs,
            }
            for mode in ("train", "infer"):
                row[f"{mode}_images_per_s"] = {
                    name: batch / median_seconds(result[f"{mode}_seconds"]) for name, result in results.items()
                }
                values = row[f"{mode}_images_per_s"]
                row[f"{mode}_ratio"] = values[HF_VIT] / values[TRANSFORMERS]
                row[f"{mode}_disturbed_samples"] = {
                    name: len(result[f"{mode}_seconds"]["clean"]) - sum(result[f"{mode}_seconds"]["clean"])
                    for name, result in results.items()
                }
            rows.append(row)
        del models, optimizers
    return rows


# ------------------------------------------------------------------------------------------------------------- main


def machine_info(device: torch.device) -> dict:
    info = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    with contextlib.suppress(OSError, AttributeError):
        info["load_average_at_start"] = os.getloadavg()
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    with contextlib.suppress(ImportError):
        import timm

        info["timm"] = timm.__version__
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _figure(metric, dtype, compiled, unit, higher_is_better, values, samples=None) -> dict:
    """One row of the report: every model's value, hf-vit's ratios, and for timed figures the samples."""
    present = {name: value for name, value in values.items() if value is not None}
    ours, theirs = present.get(HF_VIT), present.get(TRANSFORMERS)
    row = {
        "key": f"{metric}/{dtype}/{'compiled' if compiled else 'eager'}" if dtype else metric,
        "metric": metric,
        "dtype": dtype,
        "compiled": compiled,
        "unit": unit,
        "higher_is_better": higher_is_better,
        "values": values,
        "ratio": ours / theirs if ours is not None and theirs else None,
    }
    if TIMM in present and ours is not None and present[TIMM]:
        row["ratio_timm"] = ours / present[TIMM]
    if samples is None or HF_VIT not in samples or TRANSFORMERS not in samples:
        return row
    row["seconds_per_call"] = samples  # one sample per round, with the other processes' CPU use during it
    row["disturbed_samples"] = {name: len(s["clean"]) - sum(s["clean"]) for name, s in samples.items()}
    # Interference only ever adds time, so the fastest rounds give a second, less noise-sensitive ratio.
    best = {name: min(s["seconds"]) for name, s in samples.items()}
    row["ratio_best"] = best[TRANSFORMERS] / best[HF_VIT]  # time ratio inverted: higher means hf-vit faster
    if TIMM in best:
        row["ratio_best_timm"] = best[TIMM] / best[HF_VIT]
    return row


def run_benchmark(settings: BenchmarkSettings, log: Callable[[str], None] = print) -> dict:
    """Measure everything `settings` asks for and return it as one JSON-able dict (see `report.format_table`)."""
    device = torch.device(settings.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for both models and the matmul peak
        torch.backends.cudnn.allow_tf32 = False
    report: dict = {"settings": asdict(settings), "machine": machine_info(device)}
    models, skipped = build_models(settings, device)
    report["skipped_models"] = skipped
    config = models[HF_VIT].config
    image_size = config.image_hw[0]
    log(f"models: {', '.join(models)} ({settings.model} at {image_size}, batch {settings.batch_size}, {device})")
    generator = torch.Generator().manual_seed(settings.seed + 2)
    pixel_values = torch.randn(settings.batch_size, config.num_channels, *config.image_hw, generator=generator)
    labels = torch.randint(0, settings.num_labels, (settings.batch_size,), generator=generator)
    pixel_values, labels = pixel_values.to(device), labels.to(device)

    # The models must compute the same function before their speed is compared.
    verification = {"tolerance": LOGITS_TOLERANCE, "max_abs_logits_diff": {}}
    for dtype in settings.dtypes:
        verification["max_abs_logits_diff"][dtype] = compare_logits(models, pixel_values, dtype)
    worst = max(verification["max_abs_logits_diff"].get("fp32", {TRANSFORMERS: 0.0}).values())
    verification["passed"] = worst <= LOGITS_TOLERANCE
    report["verification"] = verification
    log(f"max |logits difference| against hf-vit: {verification['max_abs_logits_diff']}")
    if not verification["passed"]:
        raise AssertionError(f"The models' fp32 logits differ by {worst:.2e} > {LOGITS_TOLERANCE}; not timing them.")

    flops = vit_forward_flops(config)
    report["flops_per_image"] = {"forward": flops, "train_step": 3 * flops["total"]}
    matmul_size = settings.matmul_size or (8192 if device.type == "cuda" else 2048)
    # Measured before and after the models; the better of the two is the machine's figure (a neighbour's job can
    # only slow it down).
    report["matmul"] = {}
    for dtype in settings.dtypes:
        report["matmul"][dtype] = matmul_flops_per_s(device, dtype, matmul_size)
        log(f"matmul {matmul_size}^2 {dtype}: {report['matmul'][dtype]['flops_per_s'] / 1e12:.3f} TFLOP/s")
    report["memory_metrics"] = memory_metric_description(device)

    figures: list[dict] = []
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in models.items()}
    variants = ([False] + ([True] if settings.compile else [])) if settings.main_rows else []
    report["compile"] = {
        "requested": settings.compile,
        "mode": settings.compile_mode,
        "modes": list(settings.compile_modes),
        "errors": {},
    }
    report["compile"]["first_call_s"] = {}  # includes compiling; the first model compiled pays for shared work
    compiled_models: dict[str, nn.Module] = {}
    model_results = []
    for compiled in variants:
        if compiled:
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
            compiled_models = {
                name: torch.compile(model, mode=settings.compile_mode) for name, model in models.items()
            }
        for dtype in settings.dtypes:
            label = f"{dtype} {'compiled' if compiled else 'eager'}"
            log(f"timing {label} ...")
            start = time.perf_counter()
            try:
                results = benchmark_models(
                    compiled_models if compiled else models,
                    pixel_values,
                    labels,
                    dtype,
                    settings.steps,
                    max(settings.warmup, 2) if compiled else settings.warmup,
                    settings.repeats,
                    settings.memory,
                    optimizers,
                    settings.compile_modes if compiled else ("train", "infer"),
                )
            except Exception as error:  # noqa: BLE001 - a failed compile drops its rows, not the whole benchmark
                if not compiled:
                    raise
                report["compile"]["errors"][dtype] = f"{type(error).__name__}: {error}"[:2000]
                log(f"  compile failed: {report['compile']['errors'][dtype][:300]}")
                continue
            log(f"  done in {time.perf_counter() - start:.0f} s")
            model_results.append((results, dtype, compiled))
            for name, result in results.items():
                for mode in ("train", "infer"):
                    if compiled and f"{mode}_first_call_s" in result:
                        first_calls = report["compile"]["first_call_s"].setdefault(f"{mode}/{dtype}", {})
                        first_calls[name] = result[f"{mode}_first_call_s"]
                    if f"{mode}_peak_rss_growth_mb" in result:
                        key = f"{mode}/{dtype}/{'compiled' if compiled else 'eager'}"
                        report.setdefault("rss_growth_lower_bound_mb", {}).setdefault(key, {})[name] = result[
                            f"{mode}_peak_rss_growth_mb"
                        ]

    for dtype in settings.dtypes:
        again = matmul_flops_per_s(device, dtype, matmul_size)
        first = report["matmul"][dtype]
        log(f"matmul {matmul_size}^2 {dtype} after the models: {again['flops_per_s'] / 1e12:.3f} TFLOP/s")
        report["matmul"][dtype] = max(first, again, key=lambda entry: entry["flops_per_s"])
        report["matmul"][dtype]["samples_flops_per_s"] = [first["flops_per_s"], again["flops_per_s"]]
    for results, dtype, compiled in model_results:
        figures.extend(_model_figures(results, dtype, compiled, settings.batch_size, flops, report["matmul"]))

    if settings.processor and settings.main_rows:
        log("image processors ...")
        processor = compare_processors(image_size, settings.processor_images, settings.processor_repeats)
        report["processor"] = processor
        figures.append(
            _figure(
                "processor_images_per_s",
                None,
                False,
                "images/s",
                True,
                processor["images_per_s"],
                processor["seconds"],
            )
        )

    if settings.pipeline and settings.main_rows:
        log("input pipelines (one thread) ...")
        pipeline = compare_input_pipelines(image_size, settings.pipeline_images, settings.pipeline_repeats)
        if settings.profile:
            pipeline["profile"] = profile_input_pipeline(image_size, settings.pipeline_images)
        report["input_pipeline"] = pipeline
        log(f"  skipped: {pipeline['skipped']}" if pipeline["skipped"] else "  done")
        if TORCHVISION in pipeline["photo"]["images_per_s"]:  # the transformers column is its example's pipeline
            for kind in PHOTO_SIZES:
                per_s, seconds = pipeline[kind]["images_per_s"], pipeline[kind]["seconds"]
                names = {HF_VIT: HF_VIT, TRANSFORMERS: TORCHVISION, TIMM: TIMM}
                figures.append(
                    _figure(
                        f"input_pipeline_{kind}_images_per_s",
                        None,
                        False,
                        "images/s per core",
                        True,
                        {ours: per_s[theirs] for ours, theirs in names.items() if theirs in per_s},
                        {ours: seconds[theirs] for ours, theirs in names.items() if theirs in seconds},
                    )
                )

    if settings.onnx and settings.main_rows and device.type == "cpu":
        log("onnxruntime ...")
        try:
            report["onnxruntime"] = compare_onnxruntime(
                models[HF_VIT], settings.onnx_batch_sizes, settings.steps, settings.repeats, settings.seed
            )
        except Exception as error:  # noqa: BLE001 - an export or session failure drops the rows, not the run
            report["onnxruntime"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            log(f"  onnxruntime failed: {report['onnxruntime']['error'][:300]}")

    if settings.profile_only or (settings.profile and not settings.sweep_only):
        report["profile"] = {}
        for dtype in settings.dtypes:
            for name in (HF_VIT, TRANSFORMERS):
                log(f"profiling one training step of {name} {dtype} ...")
                report["profile"].setdefault(dtype, {})[name] = profile_training_step(
                    models[name], optimizers[name], pixel_values, labels, dtype
                )

    del compiled_models, optimizers
    if settings.sizes:
        log(f"size sweep {list(settings.sizes)} ...")
        report["sweep"] = size_sweep(settings, device)
    report["figures"] = figures
    with contextlib.suppress(OSError, AttributeError):
        report["machine"]["load_average_at_end"] = os.getloadavg()
    return report


def _model_figures(results, dtype, compiled, batch_size, flops, matmul) -> list[dict]:
    figures = []
    for mode in ("train", "infer"):
        if not any(f"{mode}_seconds" in result for result in results.values()):
            continue
        seconds = {name: result[f"{mode}_seconds"] for name, result in results.items()}
        per_s = {name: batch_size / median_seconds(values) for name, values in seconds.items()}
        figures.append(_figure(f"{mode}_images_per_s", dtype, compiled, "images/s", True, per_s, seconds))
        step_flops = flops["total"] * (3 if mode == "train" else 1)
        peak = matmul[dtype]["flops_per_s"]
        fraction = {name: value * step_flops / peak for name, value in per_s.items()}
        figures.append(_figure(f"{mode}_matmul_fraction", dtype, compiled, "of matmul peak", True, fraction))
        values = {name: result.get(f"{mode}_peak_mem_mb") for name, result in results.items()}
        if any(value is not None for value in values.values()):
            figures.append(_figure(f"{mode}_peak_mem_mb", dtype, compiled, "MiB", False, values))
    return figures
