#!/usr/bin/env python
r"""Benchmark hf-vit's VisionTransformerForImageClassification against transformers' ViTForImageClassification
(and timm's VisionTransformer where timm is installed) with identical weights, in one process.

Measures training-step and inference throughput, peak memory and the fraction of the machine's matmul throughput
achieved, in fp32 and bf16 autocast, eager and torch.compile'd; the image processors' throughput on real photos;
and optionally a sweep of throughput against image size and a profile of one training step.

    python scripts/benchmark.py                                   # ViT-S/16, 224, batch 16, fp32 + bf16
    python scripts/benchmark.py --json docs/benchmarks.json --profile \
        --sizes 224 288 384 448 512 --sweep_batch_size 4 --plot docs/throughput_vs_size.png
    python scripts/benchmark.py --model vit-tiny-patch16-224 --image_size 32 --batch_size 2 --steps 1 \
        --warmup 0 --no_compile                                   # seconds: a smoke test
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from hf_vit.benchmarking import (
    DTYPES,
    BenchmarkSettings,
    fill_markdown,
    format_profile,
    format_table,
    markdown_sections,
    merge_reports,
    plot_sweep,
    run_benchmark,
    write_json,
)
from hf_vit.configuration_vit import VisionTransformerConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit-small-patch16-224", help="hf-vit preset name")
    parser.add_argument("--image_size", type=int, default=None, help="default: the preset's resolution")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--num_labels", type=int, default=1000)
    parser.add_argument("--num_hidden_layers", type=int, default=None, help="override the preset's depth")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    parser.add_argument("--steps", type=int, default=None, help="timed steps per repeat (default 3 CPU, 20 GPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per model (default 1 CPU, 5 GPU)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats; figures are their medians")
    compile_group = parser.add_mutually_exclusive_group()
    compile_group.add_argument(
        "--compile",
        dest="compile",
        action="store_true",
        default=True,
        help="also time torch.compile'd models (default)",
    )
    compile_group.add_argument("--no_compile", dest="compile", action="store_false")
    parser.add_argument("--compile_mode", default=None, help="torch.compile mode for both models")
    parser.add_argument(
        "--compile_modes",
        nargs="+",
        default=["train", "infer"],
        choices=["train", "infer"],
        help="which rows to compile (on CPU compiling the backward takes minutes per graph)",
    )
    parser.add_argument("--no_memory", dest="memory", action="store_false", help="skip the peak memory steps")
    parser.add_argument("--matmul_size", type=int, default=None, help="default 2048 on CPU, 8192 on GPU")
    parser.add_argument("--no_processor", dest="processor", action="store_false")
    parser.add_argument("--processor_images", type=int, default=32)
    parser.add_argument("--profile", action="store_true", help="profile one training step of each model")
    parser.add_argument("--sizes", type=int, nargs="*", default=[], help="image sizes of a throughput sweep")
    parser.add_argument("--sweep_batch_size", type=int, default=None, help="default: --batch_size")
    parser.add_argument("--sweep_steps", type=int, default=None, help="default: --steps")
    parser.add_argument("--sweep_repeats", type=int, default=None, help="default: --repeats")
    parser.add_argument("--sweep_dtypes", nargs="+", default=None, choices=sorted(DTYPES), help="default: --dtypes")
    parser.add_argument("--sweep_only", action="store_true", help="only the size sweep (with --sizes)")
    parser.add_argument(
        "--profile_only", action="store_true", help="only the training-step profile (e.g. to redo one, --merge_json)"
    )
    parser.add_argument("--plot", default=None, help="PNG of the size sweep")
    parser.add_argument("--no_timm", dest="include_timm", action="store_false", help="leave timm out")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every figure and ratio here")
    parser.add_argument(
        "--doc",
        default=None,
        help="markdown file whose <!-- benchmark:NAME --> blocks (machine, table, targets, sweep, profile) are "
        "rewritten from this run's figures (after --merge_json)",
    )
    parser.add_argument(
        "--doc_only", action="store_true", help="measure nothing: rewrite --doc from the figures in --json"
    )
    parser.add_argument(
        "--merge_json",
        action="store_true",
        help="update an existing --json file with this run's figures and sections instead of replacing it",
    )
    args = parser.parse_args(argv)
    if args.model.rpartition("-")[0] + "-224" not in VisionTransformerConfig.preset_names():
        parser.error(f"unknown --model {args.model!r}; presets: {', '.join(VisionTransformerConfig.preset_names())}")
    if (args.plot or args.sweep_only) and not args.sizes:
        parser.error("--plot and --sweep_only need --sizes")
    if args.merge_json and not args.json:
        parser.error("--merge_json needs --json")
    if args.doc_only and not (args.doc and args.json and Path(args.json).is_file()):
        parser.error("--doc_only needs --doc and an existing --json file to take the figures from")
    if args.sweep_only and args.profile_only:
        parser.error("--sweep_only and --profile_only exclude each other")
    if args.profile_only and args.sizes:
        parser.error("--profile_only measures no size sweep: drop --sizes, or use --sweep_only for the sweep")
    if args.doc and (args.sweep_only or args.profile_only) and not args.merge_json:
        parser.error(
            "--doc with --sweep_only/--profile_only would rewrite the page from a partial run: add --merge_json "
            "(and --json) to merge this run into the full figures first"
        )
    return args


def write_doc(report: dict, path: str) -> Path:
    """Rewrite the generated blocks of the markdown file at `path`; the rest of it is left as written."""
    doc = Path(path)
    if not doc.is_file():
        raise FileNotFoundError(f"--doc {path} does not exist; create it with <!-- benchmark:table --> blocks first.")
    doc.write_text(fill_markdown(doc.read_text(), markdown_sections(report)))
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.doc_only:
        print(f"doc: {write_doc(json.loads(Path(args.json).read_text()), args.doc)}")
        return 0
    only = args.sweep_only or args.profile_only
    if args.threads:
        torch.set_num_threads(args.threads)
    on_gpu = args.device.startswith("cuda")
    settings = BenchmarkSettings(
        model=args.model,
        image_size=args.image_size,
        batch_size=args.batch_size,
        num_labels=args.num_labels,
        device=args.device,
        dtypes=args.dtypes,
        steps=args.steps if args.steps is not None else (20 if on_gpu else 3),
        warmup=args.warmup if args.warmup is not None else (5 if on_gpu else 1),
        repeats=args.repeats,
        compile=args.compile,
        compile_mode=args.compile_mode,
        compile_modes=args.compile_modes,
        memory=args.memory,
        matmul_size=args.matmul_size,
        processor=args.processor and not only,
        processor_images=args.processor_images,
        profile=args.profile_only or (args.profile and not args.sweep_only),
        main_rows=not only,
        sizes=[] if args.profile_only else args.sizes,
        sweep_batch_size=args.sweep_batch_size,
        sweep_steps=args.sweep_steps,
        sweep_repeats=args.sweep_repeats,
        sweep_dtypes=args.sweep_dtypes,
        include_timm=args.include_timm,
        seed=args.seed,
        config_overrides={} if args.num_hidden_layers is None else {"num_hidden_layers": args.num_hidden_layers},
    )
    report = run_benchmark(settings, log=lambda message: print(message, file=sys.stderr, flush=True))
    report["command"] = "python scripts/benchmark.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.merge_json and Path(args.json).is_file():
        # Figures, sweep points and sections this run redid replace the file's; the rest stays (and is plotted).
        report = merge_reports(json.loads(Path(args.json).read_text()), report)
    if args.json:  # first: what was measured is kept even if printing or plotting fails
        print(f"json: {write_json(report, args.json)}")
    print(format_table(report))
    if "profile" in report:
        print("\nWhere one training step's time goes (self CPU time):")
        print(format_profile(report))
    if report.get("sweep"):
        print("\nSize sweep (images/s):")
        for row in report["sweep"]:
            print(
                f"  {row['image_size']}px {row['tokens']} tokens {row['dtype']}: "
                + "  ".join(
                    f"{mode} "
                    + " / ".join(f"{name} {value:.2f}" for name, value in row[f"{mode}_images_per_s"].items())
                    + f" (ratio {row[f'{mode}_ratio']:.3f})"
                    for mode in ("train", "infer")
                )
            )
        if args.plot:
            machine = report["machine"].get("gpu") or report["machine"].get("cpu", args.device)
            title = f"{args.model} batch {report['sweep'][0]['batch_size']} on {machine}"
            print(f"plot: {plot_sweep(report['sweep'], args.plot, title)}")
    if args.doc:
        print(f"doc: {write_doc(report, args.doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
