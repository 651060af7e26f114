"""Speed and memory of hf-vit against transformers' ViT (and timm's, where it is installed) with identical weights.

Everything runs in one process: the models share the input batch, the settings (attention implementation "sdpa",
dtype, train/eval mode, dropout 0) and the optimiser; their logits are checked to agree before anything is timed, and
their order alternates between rounds so that neither profits from running second (warm caches) or suffers from a
neighbour's job starting half-way. Figures are medians over the rounds. CPU and CUDA go through the same code; the
device is `--device` (default: CUDA where available).

The parts live in their own modules: `settings` (the flags), `models` (building the models, the logits check, the
analytic FLOPs), `timing`, `memory`, `inputs` (image processors and input pipelines), `onnx_runtime`, `profiling`,
and `runners` (the sections of a run). `run_benchmark` runs the sections in order; `benchmarks/benchmark.py` is its
command line and `benchmarks/report.py` turns the report into tables and the generated blocks of docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Callable

from .inputs import PHOTO_SIZES, PIPELINE_NAMES, compare_input_pipelines, compare_processors, jpeg_photos
from .models import (
    BF16_DENSE_PEAK_TFLOPS,
    build_hf_vit,
    build_models,
    compare_logits,
    dense_bf16_peak,
    hf_vit_config,
    step_flops,
    timm_from_hf_vit,
    transformers_from_hf_vit,
    vit_forward_flops,
)
from .profiling import PROFILE_CATEGORIES, profile_training_step
from .runners import Run, Section, machine_info, sections, size_sweep
from .settings import (
    DTYPES,
    HF_VIT,
    LOGITS_TOLERANCE,
    PIL_DECODE,
    TIMM,
    TORCHVISION,
    TRANSFORMERS,
    BenchmarkSettings,
)
from .timing import benchmark_models, make_infer_step, make_optimizer, make_train_step, time_alternating

__all__ = [
    "BF16_DENSE_PEAK_TFLOPS",
    "DTYPES",
    "HF_VIT",
    "LOGITS_TOLERANCE",
    "PHOTO_SIZES",
    "PIL_DECODE",
    "PIPELINE_NAMES",
    "PROFILE_CATEGORIES",
    "TIMM",
    "TORCHVISION",
    "TRANSFORMERS",
    "BenchmarkSettings",
    "Run",
    "Section",
    "benchmark_models",
    "build_hf_vit",
    "build_models",
    "compare_input_pipelines",
    "compare_logits",
    "compare_processors",
    "dense_bf16_peak",
    "hf_vit_config",
    "jpeg_photos",
    "machine_info",
    "make_infer_step",
    "make_optimizer",
    "make_train_step",
    "profile_training_step",
    "run_benchmark",
    "size_sweep",
    "step_flops",
    "time_alternating",
    "timm_from_hf_vit",
    "transformers_from_hf_vit",
    "vit_forward_flops",
]


def run_benchmark(settings: BenchmarkSettings, log: Callable[[str], None] = print) -> dict:
    """Measure everything `settings` asks for and return it as one JSON-able dict (see `report.format_table`)."""
    run = Run(settings, log)
    for section in sections(settings):
        if section.wanted(run):
            if section.name:
                log(f"{section.name} ...")
            section.run(run)
    return run.finish()
