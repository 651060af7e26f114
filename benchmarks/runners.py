"""The benchmark's sections, run one after another by `run_benchmark` over a shared `Run`: like timm's benchmark
runners, each measures one thing (the list is `run_benchmark`'s) the same way on CPU and CUDA."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from . import timing
from .inputs import PHOTO_SIZES, compare_input_pipelines, compare_processors
from .models import build_models, compare_logits, dense_bf16_peak, step_flops, vit_forward_flops
from .settings import HF_VIT, LOGITS_TOLERANCE, TIMM, TORCHVISION, TRANSFORMERS, BenchmarkSettings
from .timing import MODES, benchmark_models, make_optimizer, median_seconds, profile_training_step


def machine_info(device: torch.device) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "python": platform.python_version()}
    info.update(platform=platform.platform(), torch_threads=torch.get_num_threads(), cpu_count=os.cpu_count())
    with contextlib.suppress(OSError, AttributeError):
        info["load_average_at_start"] = os.getloadavg()
    for name in ("transformers", "timm"):
        with contextlib.suppress(ImportError):
            info[name] = importlib.import_module(name).__version__
    with contextlib.suppress(OSError, StopIteration):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
        info["cuda"] = torch.version.cuda
    return info


def figure(metric, dtype, compiled, unit, higher_is_better, values, samples=None) -> dict:
    """One row of the report: every model's value, hf-vit's ratios, and for timed figures the samples."""
    present = {name: value for name, value in values.items() if value is not None}
    ours, theirs = present.get(HF_VIT), present.get(TRANSFORMERS)
    key = f"{metric}/{dtype}/{'compiled' if compiled else 'eager'}" if dtype else metric
    row = {"key": key, "metric": metric, "dtype": dtype, "compiled": compiled, "unit": unit}
    row.update(higher_is_better=higher_is_better, values=values)
    row["ratio"] = ours / theirs if ours is not None and theirs else None
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


def model_figures(results, dtype, compiled, batch_size, flops, matmul, peak) -> list[dict]:
    """Images/s, the fractions of the measured matmul peak and (where known) of the dense bf16 peak, and peak memory,
    for training and inference."""
    figures = []
    for mode in MODES:
        seconds = {name: result[f"{mode}_seconds"] for name, result in results.items()}
        per_s = {name: batch_size / median_seconds(values) for name, values in seconds.items()}
        figures.append(figure(f"{mode}_images_per_s", dtype, compiled, "images/s", True, per_s, seconds))
        flops_per_image = step_flops(flops["total"], mode)
        fraction = {name: value * flops_per_image / matmul[dtype]["flops_per_s"] for name, value in per_s.items()}
        figures.append(figure(f"{mode}_matmul_fraction", dtype, compiled, "of matmul peak", True, fraction))
        if peak is not None and dtype == "bf16":
            mfu = {name: value * flops_per_image / peak["flops_per_s"] for name, value in per_s.items()}
            figures.append(figure(f"{mode}_mfu", dtype, compiled, "of bf16 dense peak", True, mfu))
        values = {name: result.get(f"{mode}_peak_mem_mb") for name, result in results.items()}
        if any(value is not None for value in values.values()):
            figures.append(figure(f"{mode}_peak_mem_mb", dtype, compiled, "MiB", False, values))
    return figures


class Run:
    """What the sections share: the settings, the models with identical weights, one input batch, the optimisers, the
    report being filled, its figures, and the (results, dtype, compiled) `throughput` timed."""

    def __init__(self, settings: BenchmarkSettings, log: Callable[[str], None]) -> None:
        self.settings, self.log, self.device = settings, log, torch.device(settings.device)
        self.figures, self.timed = [], []
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32
        self.report = {"settings": asdict(settings), "machine": machine_info(self.device)}
        self.models, self.report["skipped_models"] = build_models(settings, self.device)
        self.config = self.models[HF_VIT].config
        self.image_size = self.config.image_hw[0]
        where = f"{settings.model} at {self.image_size}, batch {settings.batch_size}, {self.device}"
        log(f"models: {', '.join(self.models)} ({where})")
        self.pixel_values, self.labels = random_batch(self.config, settings.batch_size, self.device, settings.seed)
        self.optimizers = {
            name: make_optimizer(model, settings.fused_optimizer) for name, model in self.models.items()
        }
        self.report["optimizer"] = {"name": "AdamW", "lr": 1e-4, "fused": bool(settings.fused_optimizer)}


def logits_check(run: Run) -> None:
    """The models must compute the same function before their speed is compared."""
    verification = {"tolerance": LOGITS_TOLERANCE, "max_abs_logits_diff": {}}
    for dtype in run.settings.dtypes:
        verification["max_abs_logits_diff"][dtype] = compare_logits(run.models, run.pixel_values, dtype)
    worst = max(verification["max_abs_logits_diff"].get("fp32", {TRANSFORMERS: 0.0}).values())
    verification["passed"] = worst <= LOGITS_TOLERANCE
    run.report["verification"] = verification
    run.log(f"max |logits difference| against hf-vit: {verification['max_abs_logits_diff']}")
    if not verification["passed"]:
        raise AssertionError(f"The models' fp32 logits differ by {worst:.2e} > {LOGITS_TOLERANCE}; not timing them.")


def matmul_peak(run: Run) -> None:
    """The machine's throughput on one large matmul per dtype, the denominator of the matmul fractions (measured
    again after the models: `throughput_figures`); the analytic FLOPs per image and the dense bf16 peak of the MFU
    rows."""
    report, flops = run.report, vit_forward_flops(run.config)
    report["flops_per_image"] = {"forward": flops, "train_step": step_flops(flops["total"], "train")}
    report["flops_formula"] = (
        "forward FLOPs per image = 2 * multiply-adds of the matrix products (patch embedding, qkv, attention "
        "scores and weighted sum, projection, MLP, head); a training step = 3 * forward; MFU = images/s * "
        "FLOPs per image / dense bf16 peak"
    )
    report["bf16_dense_peak"] = dense_bf16_peak(report["machine"].get("gpu"), run.settings.peak_tflops)
    report["matmul"] = {dtype: _matmul(run, dtype, "") for dtype in run.settings.dtypes}
    report["memory_metrics"] = timing.memory_metric_description(run.device)


def _matmul(run: Run, dtype: str, when: str) -> dict:
    size = run.settings.matmul_size or (8192 if run.device.type == "cuda" else 2048)
    result = timing.matmul_flops_per_s(run.device, dtype, size, run.settings.matmul_repeats)
    run.log(f"matmul {size}^2 {dtype}{when}: {result['flops_per_s'] / 1e12:.3f} TFLOP/s")
    return result


def throughput(run: Run) -> None:
    """Training steps (forward, loss, backward, AdamW) and inference of every model, in every dtype, eager and (with
    --compile) torch.compile'd; the figures are added once the matmul peak has been measured again."""
    settings = run.settings
    run.report["compile"] = {  # first_call_s includes compiling; the first model compiled pays for shared work
        "requested": settings.compile, "mode": settings.compile_mode, "backend": settings.compile_backend,
        "modes": list(MODES), "errors": {}, "first_call_s": {}, "blocks": settings.compile_blocks,
    }  # fmt: skip
    for compiled in ([False] if settings.eager else []) + ([True] if settings.compile else []):
        models, undo = compile_models(run.models, settings) if compiled else (run.models, lambda: None)
        try:
            for dtype in settings.dtypes:
                _time_models(run, models, dtype, compiled)
        finally:
            undo()  # the sections after this one (profile, sweep) see the eager models
        del models


def _time_models(run: Run, models: dict[str, nn.Module], dtype: str, compiled: bool) -> None:
    settings, report = run.settings, run.report
    run.log(f"timing {dtype} {'compiled' if compiled else 'eager'} ...")
    start = time.perf_counter()
    try:
        with timing.sdpa_backend(settings.sdpa_backend):  # compiled models trace under it too
            warmup = max(settings.warmup, 2) if compiled else settings.warmup
            inputs = (run.pixel_values, run.labels, dtype, settings.steps, warmup, settings.repeats)
            results = benchmark_models(models, *inputs, True, run.optimizers)
    except Exception as error:  # noqa: BLE001 - a failed compile drops its rows, not the whole benchmark
        if not compiled:
            raise
        report["compile"]["errors"][dtype] = f"{type(error).__name__}: {error}"[:2000]
        run.log(f"  compile failed: {report['compile']['errors'][dtype][:300]}")
        return
    run.log(f"  done in {time.perf_counter() - start:.0f} s")
    run.timed.append((results, dtype, compiled))
    variant = "compiled" if compiled else "eager"
    for name, result in results.items():
        for mode in MODES:
            if compiled and f"{mode}_first_call_s" in result:
                first_calls = report["compile"]["first_call_s"].setdefault(f"{mode}/{dtype}", {})
                first_calls[name] = result[f"{mode}_first_call_s"]
            if f"{mode}_peak_rss_growth_mb" in result:
                growth = report.setdefault("rss_growth_lower_bound_mb", {})
                growth.setdefault(f"{mode}/{dtype}/{variant}", {})[name] = result[f"{mode}_peak_rss_growth_mb"]


def throughput_figures(run: Run) -> None:
    """The matmul peak measured again, the better of before and after the models counting (a neighbour's job can only
    slow it down); the throughput rows against it."""
    for dtype in run.settings.dtypes:
        first, again = run.report["matmul"][dtype], _matmul(run, dtype, " after the models")
        best = run.report["matmul"][dtype] = max(first, again, key=lambda entry: entry["flops_per_s"])
        best["samples_flops_per_s"] = [first["flops_per_s"], again["flops_per_s"]]
    flops = run.report["flops_per_image"]["forward"]
    for results, dtype, compiled in run.timed:
        figures = (run.settings.batch_size, flops, run.report["matmul"], run.report["bf16_dense_peak"])
        run.figures.extend(model_figures(results, dtype, compiled, *figures))


# The transformer blocks of hf-vit, transformers' ViT and timm's ViT, by class name (for --compile_blocks).
BLOCK_CLASSES = ("VisionTransformerBlock", "ViTLayer", "Block")


def compile_models(
    models: dict[str, nn.Module], settings: BenchmarkSettings
) -> tuple[dict[str, nn.Module], Callable[[], None]]:
    """The models torch.compile'd as `settings` says (whole, the originals staying eager; or with `compile_blocks` each
    transformer block in place with fullgraph=True, a graph break failing loudly), and a function that undoes it."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    options = dict(mode=settings.compile_mode, backend=settings.compile_backend)
    if not settings.compile_blocks:
        return {name: torch.compile(model, **options) for name, model in models.items()}, lambda: None
    blocks = []
    for name, model in models.items():
        found = [module for module in model.modules() if type(module).__name__ in BLOCK_CLASSES]
        if not found:
            raise ValueError(f"--compile_blocks: no block of {BLOCK_CLASSES} in {name}'s model")
        for block in found:
            block.compile(fullgraph=True, **options)
        blocks += found

    def undo() -> None:
        for block in blocks:
            block._compiled_call_impl = None  # what nn.Module.compile set

    return dict(models), undo


def processors(run: Run) -> None:
    settings = run.settings
    processor = compare_processors(run.image_size, settings.processor_images, settings.processor_repeats)
    run.report["processor"] = processor
    values = (processor["images_per_s"], processor["seconds"])
    run.figures.append(figure("processor_images_per_s", None, False, "images/s", True, *values))


def input_pipelines(run: Run) -> None:
    settings = run.settings
    what = (settings.pipeline_images, settings.pipeline_repeats, settings.profile)  # images, rounds, cProfile too
    pipeline = run.report["input_pipeline"] = compare_input_pipelines(run.image_size, *what)
    run.log(f"  skipped: {pipeline['skipped']}" if pipeline["skipped"] else "  done")
    if TORCHVISION not in pipeline["photo"]["images_per_s"]:  # the transformers column is its example's pipeline
        return
    names = {HF_VIT: HF_VIT, TRANSFORMERS: TORCHVISION, TIMM: TIMM}
    for kind in PHOTO_SIZES:
        per_s, seconds = pipeline[kind]["images_per_s"], pipeline[kind]["seconds"]
        values = [{ours: got[theirs] for ours, theirs in names.items() if theirs in got} for got in (per_s, seconds)]
        metric = f"input_pipeline_{kind}_images_per_s"
        run.figures.append(figure(metric, None, False, "images/s per core", True, *values))


ONNX_TOLERANCE = 1e-3


def onnx_runtime(run: Run) -> None:
    """onnxruntime (CPU, as many threads as torch) on `hf_vit.export`'s ONNX file against eager PyTorch fp32
    inference, the outputs compared first (max |logits difference| <= `ONNX_TOLERANCE`)."""
    try:
        run.report["onnxruntime"] = compare_onnxruntime(run.models[HF_VIT].eval(), run.settings)
    except Exception as error:  # noqa: BLE001 - an export or session failure drops the rows, not the run
        run.report["onnxruntime"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        run.log(f"  onnxruntime failed: {run.report['onnxruntime']['error'][:300]}")


def compare_onnxruntime(model: nn.Module, settings: BenchmarkSettings) -> dict:
    import onnxruntime

    from hf_vit.export import export

    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        path = export(model, Path(folder) / "model.onnx", "onnx")
        export_s = time.perf_counter() - start
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    result: dict = {"onnxruntime": onnxruntime.__version__, "export_s": export_s, "threads": torch.get_num_threads()}
    generator = torch.Generator().manual_seed(settings.seed + 3)
    for batch in settings.onnx_batch_sizes:
        pixel_values = torch.randn(batch, model.config.num_channels, *model.config.image_hw, generator=generator)
        inputs = {"pixel_values": pixel_values.numpy()}
        with torch.no_grad():
            expected = model(pixel_values).logits
        difference = float((torch.from_numpy(session.run(None, inputs)[0]) - expected).abs().max())
        if difference > ONNX_TOLERANCE:
            raise AssertionError(
                f"onnxruntime's logits differ by {difference:.2e} > {ONNX_TOLERANCE} at batch {batch}"
            )
        fns = {HF_VIT: timing.make_infer_step(model, pixel_values, "fp32")}
        fns["onnxruntime"] = functools.partial(session.run, None, inputs)
        timed = timing.timed_rounds(fns, settings.steps, settings.repeats)  # after a warm-up call each
        per_s = {name: batch / seconds for name, seconds in timed["seconds"].items()}
        row = dict(batch_size=batch, max_abs_logits_diff=difference, seconds=timed["samples"], images_per_s=per_s)
        result[f"batch_{batch}"] = {**row, "ratio_onnxruntime_to_eager": per_s["onnxruntime"] / per_s[HF_VIT]}
    return result


def profile(run: Run) -> None:
    run.report["profile"] = {}
    for dtype in run.settings.dtypes:
        for name in (HF_VIT, TRANSFORMERS):
            run.log(f"  {name} {dtype} ...")
            step = (run.models[name], run.optimizers[name], run.pixel_values, run.labels, dtype)
            run.report["profile"].setdefault(dtype, {})[name] = profile_training_step(*step)


def size_sweep(run: Run) -> None:
    """Training and inference throughput of the models (eager) at each of --sizes, fresh models per size."""
    run.optimizers.clear()  # the main models' optimiser state is no longer needed
    settings, device = run.settings, run.device
    batch = settings.sweep_batch_size or settings.batch_size
    run.report["sweep"] = rows = []
    for size in settings.sizes:
        models, _ = build_models(settings, device, size)
        config = models[HF_VIT].config
        pixel_values, labels = random_batch(config, batch, device, settings.seed)
        diffs = compare_logits(models, pixel_values[:2])
        optimizers = {name: make_optimizer(model, settings.fused_optimizer) for name, model in models.items()}
        for dtype in settings.dtypes:
            inputs = (pixel_values, labels, dtype, settings.steps, max(settings.warmup, 1), settings.repeats)
            results = benchmark_models(models, *inputs, False, optimizers)
            tokens = config.num_patches + config.num_prefix_tokens
            row = dict(image_size=size, tokens=tokens, dtype=dtype, batch_size=batch, max_abs_logits_diff=diffs)
            for mode in MODES:
                samples = {name: result[f"{mode}_seconds"] for name, result in results.items()}
                values = row[f"{mode}_images_per_s"] = {n: batch / median_seconds(s) for n, s in samples.items()}
                row[f"{mode}_ratio"] = values[HF_VIT] / values[TRANSFORMERS]
                row[f"{mode}_disturbed_samples"] = {n: len(s["clean"]) - sum(s["clean"]) for n, s in samples.items()}
            rows.append(row)
        del models, optimizers


def random_batch(config, batch: int, device: torch.device, seed: int = 0):
    """`batch` random images of `config`'s size and random labels, on `device` (the same for the same seed)."""
    generator = torch.Generator().manual_seed(seed + 2)
    pixel_values = torch.randn(batch, config.num_channels, *config.image_hw, generator=generator)
    labels = torch.randint(0, config.num_labels, (batch,), generator=generator)
    return pixel_values.to(device), labels.to(device)


def run_benchmark(settings: BenchmarkSettings, log: Callable[[str], None] = print) -> dict:
    """Measure everything `settings` asks for, section by section, as one JSON-able dict (see `report.format_table`).
    The models share the input batch, settings and optimiser; their logits agree before anything is timed, and their
    order alternates between rounds; figures are medians over the rounds."""
    s, main = settings, settings.main_rows
    sections = [  # (name, wanted, section), in order
        ("logits check", True, logits_check),
        ("matmul peak", True, matmul_peak),
        ("throughput", main, throughput),
        ("matmul peak again, the throughput figures", True, throughput_figures),
        ("image processors", s.processor and main, processors),
        ("input pipelines (one thread)", s.pipeline and main, input_pipelines),
        ("onnxruntime", s.onnx and main and torch.device(s.device).type == "cpu", onnx_runtime),
        ("profile of one training step", s.profile_only or (s.profile and not s.sweep_only), profile),
        ("size sweep", bool(s.sizes), size_sweep),
    ]
    run = Run(settings, log)
    for name, wanted, section in sections:
        if wanted:
            log(f"{name} ...")
            section(run)
    run.report["figures"] = run.figures
    with contextlib.suppress(OSError, AttributeError):
        run.report["machine"]["load_average_at_end"] = os.getloadavg()
    return run.report
