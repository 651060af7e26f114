"""The benchmark's settings (every field is a flag of `benchmarks/benchmark.py`) and the names its reports use."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hf_vit import VisionTransformerConfig

HF_VIT = "hf_vit"
TRANSFORMERS = "transformers"
TIMM = "timm"
TORCHVISION = "torchvision"
PIL_DECODE = "pil_decode"
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
LOGITS_TOLERANCE = 1e-4


def add_flags(parser: argparse.ArgumentParser, flags: dict) -> None:
    """`--name` for each of `flags` (name: (default, help[, type])), typed as its default; `False`: a switch."""
    for name, (default, text, *kind) in flags.items():
        if default is False:
            parser.add_argument(f"--{name}", action="store_true", help=text)
        else:
            kind = kind[0] if kind else None if default is None else type(default)
            parser.add_argument(f"--{name}", type=kind, default=default, help=text)


# Where benchmark.py's and gpu.py's figures go: name: (default, help), as `add_flags` takes them.
OUTPUT_FLAGS = {
    "json": (None, "write every figure and ratio here"),
    "doc": (None, "markdown file whose <!-- benchmark[-gpu]:NAME --> blocks take the figures (after --merge_json)"),
    "doc_only": (False, "measure nothing: rewrite --doc from the --json figures"),
    "merge_json": (False, "update an existing --json file with this run's figures instead of replacing it"),
}


def check_outputs(parser: argparse.ArgumentParser, args, tag: str) -> None:
    """--merge_json and --doc_only need --json (--doc_only an existing one, and --doc); --doc must exist: refused
    before anything is measured."""
    if args.merge_json and not args.json:
        parser.error("--merge_json needs --json")
    if args.doc_only and not (args.doc and args.json and Path(args.json).is_file()):
        parser.error("--doc_only needs --doc and an existing --json file to take the figures from")
    if args.doc and not Path(args.doc).is_file():
        parser.error(f"--doc {args.doc} does not exist; create it with <!-- {tag}:NAME --> blocks first")


def flag(default, text: str = "", **extra):
    """A dataclass field with its flag's help (a list default is copied for each instance)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": text, **extra})
    return field(default=default, metadata={"help": text, **extra})


@dataclass
class BenchmarkSettings:
    """What to measure; every field is a flag of `benchmarks/benchmark.py`. The defaults: ViT-S/16, 224, batch 16."""

    model: str = flag("vit-small-patch16-224", "hf-vit preset name")
    image_size: int | None = flag(None, "default: the preset's resolution")
    batch_size: int = 16
    num_labels: int = 1000
    num_hidden_layers: int | None = flag(None, "override the preset's depth")
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    dtypes: list[str] = flag(["fp32", "bf16"], choices=list(DTYPES))
    steps: int | None = flag(None, "timed steps per round (default 3 CPU, 20 GPU)")
    warmup: int | None = flag(None, "untimed steps per model (default 1 CPU, 5 GPU; compiled models at least 2)")
    repeats: int = flag(3, "undisturbed rounds per model; figures are their medians")
    compile: bool = flag(False, "also time torch.compile'd models (on 2 CPU cores this adds many minutes)")
    sdpa_backend: str | None = flag(
        None,
        "restrict scaled_dot_product_attention to one backend for every model (default: torch's choice)",
        choices=["flash", "efficient", "cudnn", "math"],
    )
    eager: bool = flag(True, "time the eager models (--no_eager: the compiled rows only)")
    compile_mode: str | None = flag(None, "torch.compile mode for every model")
    compile_blocks: bool = flag(
        False,
        "compile each transformer block (fullgraph=True) instead of the whole model: identical blocks share one "
        "compilation, so compiling takes a fraction of the time",
    )
    compile_backend: str = flag("inductor", "torch.compile backend (aot_eager: traces without generating kernels)")
    matmul_size: int | None = flag(None, "default 2048 on CPU, 8192 on GPU")
    matmul_repeats: int = flag(5, "rounds of at least 0.25 s each for the matmul peak")
    processor: bool = flag(True, "compare the image processors on real photos")
    processor_images: int = 32
    processor_repeats: int = 5
    pipeline: bool = flag(True, "compare the training input pipelines (hf-vit, torchvision, timm) per core")
    pipeline_images: int = 48
    pipeline_repeats: int = 5
    onnx: bool = flag(True, "time onnxruntime (CPU) against eager fp32 inference")
    onnx_batch_sizes: list[int] = flag([1, 16])
    profile: bool = flag(False, "profile one training step of each model, and the hf-vit input pipeline")
    sizes: list[int] = flag([], "image sizes of a throughput sweep")
    sweep_batch_size: int | None = flag(None, "default: --batch_size")
    sweep_only: bool = flag(False, "only the size sweep (with --sizes)")
    profile_only: bool = flag(False, "only the training-step profile, e.g. to redo one")
    timm: bool = flag(True, "add timm's ViT where timm is installed")
    peak_tflops: float | None = flag(
        None,
        "the device's dense bf16 peak in TFLOP/s for the MFU rows (default: looked up by GPU name, e.g. 989 for an "
        "H100 or H200; no MFU rows where unknown, e.g. on CPU)",
    )
    fused_optimizer: bool | None = flag(None, "AdamW's fused implementation (default: on for CUDA, off on CPU)")
    threads: int | None = flag(None, "torch.set_num_threads")
    seed: int = 0

    def __post_init__(self) -> None:
        on_gpu = self.device.startswith("cuda")
        if self.steps is None:
            self.steps = 20 if on_gpu else 3
        if self.warmup is None:
            self.warmup = 5 if on_gpu else 1
        if unknown := sorted(set(self.dtypes) - set(DTYPES)):
            raise ValueError(f"Unknown dtype(s) {unknown}; use {sorted(DTYPES)}.")
        try:
            VisionTransformerConfig.from_preset(self.model)
        except ValueError as error:
            raise ValueError(f"unknown --model {self.model!r}: {error}") from None
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"--peak_tflops must be positive, not {self.peak_tflops}")
        if self.fused_optimizer is None:
            self.fused_optimizer = on_gpu
        if not self.eager and not self.compile:
            raise ValueError("--no_eager leaves nothing to time without --compile")
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
