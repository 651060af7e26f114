"""The benchmark (benchmarks/, outside the package) on a tiny model: every figure and ratio lands in the JSON, and
the models agreed.

No timing assertions: this machine's speed says nothing about the code.
"""

import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ is not installed with hf_vit

from benchmarks import benchmark, gpu, gpu_packing  # noqa: E402
from benchmarks.models import (  # noqa: E402
    build_hf_vit,
    build_models,
    compare_logits,
    dense_bf16_peak,
    hf_vit_config,
    vit_forward_flops,
)
from benchmarks.report import fill_markdown, markdown_sections, merge_reports  # noqa: E402
from benchmarks.settings import HF_VIT, TRANSFORMERS, BenchmarkSettings  # noqa: E402
from benchmarks.timing import PROFILE_CATEGORIES  # noqa: E402
from hf_vit.convert.timm_vit import hf_vit_to_timm_state_dict  # noqa: E402
from hf_vit.model.configuration_vit import VisionTransformerConfig  # noqa: E402

# ViT-Ti/16 cut to 2 blocks, at 32x32 (5 tokens), batch 2: the whole run takes seconds.
TINY = ["--model", "vit-tiny-patch16-224", "--num_hidden_layers", "2", "--image_size", "32", "--batch_size", "2"]
TINY += ["--steps", "1", "--warmup", "0"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One run of the command line (in this process, to skip a second interpreter start) on a tiny config."""
    folder = tmp_path_factory.mktemp("benchmark")
    argv = TINY + [
        "--repeats", "2",
        "--pipeline_images", "4",
        "--pipeline_repeats", "1",
        "--onnx_batch_sizes", "1", "2",
        "--matmul_size", "128",
        "--processor_images", "8",
        "--profile",
        "--sizes", "32", "48",
        "--sweep_batch_size", "1",
        "--plot", str(folder / "sweep.png"),
        "--json", str(folder / "bench.json"),
    ]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        # One thread: with two, OpenMP's barriers stall for whole time slices whenever another job shares the cores,
        # and the many tiny ops of this config slow down 30-fold.
        assert benchmark.main(argv + ["--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads((folder / "bench.json").read_text()), folder


def figure_keys(dtypes, compiled_variants):
    keys = {"processor_images_per_s"}
    for dtype in dtypes:
        for variant in compiled_variants:
            for mode in ("train", "infer"):
                for metric in ("images_per_s", "matmul_fraction", "peak_mem_mb"):
                    keys.add(f"{mode}_{metric}/{dtype}/{variant}")
    return keys


def test_json_has_every_figure_and_ratio(report):
    data, _ = report
    figures = {row["key"]: row for row in data["figures"]}
    assert figure_keys(("fp32", "bf16"), ("eager",)) <= set(figures)
    for key, row in figures.items():
        assert set(row["values"]) >= {HF_VIT, TRANSFORMERS}, key
        for name in (HF_VIT, TRANSFORMERS):
            assert row["values"][name] is not None and row["values"][name] > 0, (key, name)
        ratio = row["values"][HF_VIT] / row["values"][TRANSFORMERS]
        assert math.isclose(row["ratio"], ratio, rel_tol=1e-9), key
        assert isinstance(row["higher_is_better"], bool)
    assert figures["train_images_per_s/fp32/eager"]["higher_is_better"]
    assert not figures["train_peak_mem_mb/fp32/eager"]["higher_is_better"]
    timing = figures["train_images_per_s/fp32/eager"]["seconds_per_call"][HF_VIT]
    assert len(timing["seconds"]) >= 2 and len(timing["clean"]) == len(timing["seconds"])  # one per round
    assert set(data["memory_metrics"]) >= {"peak_mem_mb"}
    assert data["compile"]["requested"] is False  # compiled rows only with --compile
    assert "command" in data and "--pipeline_images" in data["command"]
    assert {"cpu_count", "torch", "transformers"} <= set(data["machine"])


def test_models_agreed_before_timing(report):
    data, _ = report
    verification = data["verification"]
    assert verification["passed"] and verification["tolerance"] == 1e-4
    assert verification["max_abs_logits_diff"]["fp32"][TRANSFORMERS] <= 1e-4
    assert TRANSFORMERS in verification["max_abs_logits_diff"]["bf16"]
    for row in data["sweep"]:
        assert row["max_abs_logits_diff"][TRANSFORMERS] <= 1e-4


def test_matmul_flops_processor_and_profile(report):
    data, _ = report
    for dtype in ("fp32", "bf16"):
        assert data["matmul"][dtype]["flops_per_s"] > 0 and data["matmul"][dtype]["size"] == 128
    config = VisionTransformerConfig.from_preset(
        "vit-tiny-patch16-224", image_size=32, num_labels=1000, num_hidden_layers=2
    )
    assert data["flops_per_image"]["forward"]["total"] == vit_forward_flops(config)["total"]
    assert data["flops_per_image"]["train_step"] == 3 * vit_forward_flops(config)["total"]
    processor = data["processor"]
    assert processor["shapes_match"] and processor["images"] == 8
    assert 0 <= processor["mean_abs_diff_01"] < 0.01  # both resize like PIL: far below one grey level (1/255)
    for dtype in ("fp32", "bf16"):
        for name in (HF_VIT, TRANSFORMERS):
            profile = data["profile"][dtype][name]
            assert set(profile["categories_pct"]) == set(PROFILE_CATEGORIES)
            assert math.isclose(sum(profile["categories_pct"].values()), 100.0, rel_tol=1e-6)
            assert profile["top_ops"]


def test_size_sweep_and_plot(report):
    data, folder = report
    rows = data["sweep"]
    assert [(row["image_size"], row["dtype"]) for row in rows] == [
        (32, "fp32"), (32, "bf16"), (48, "fp32"), (48, "bf16")
    ]  # fmt: skip
    assert [row["tokens"] for row in rows[::2]] == [5, 10]
    for row in rows:
        for mode in ("train", "infer"):
            values = row[f"{mode}_images_per_s"]
            assert math.isclose(row[f"{mode}_ratio"], values[HF_VIT] / values[TRANSFORMERS])
    assert (folder / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_flop_count_of_vit_b16():
    # ViT-B/16 at 224 is the well-known "17.6 GFLOPs" per image, which counts multiply-adds: 35.1e9 FLOPs here.
    config = VisionTransformerConfig.from_preset("vit-base-patch16-224", num_labels=1000)
    parts = vit_forward_flops(config)
    assert parts["total"] == sum(value for key, value in parts.items() if key != "total")
    assert 2 * 17.5e9 < parts["total"] < 2 * 17.6e9
    # Attention scores and the weighted sum grow with the square of the tokens; the rest linearly.
    bigger = vit_forward_flops(config, image_size=448)
    assert bigger["attention_scores"] / parts["attention_scores"] == pytest.approx((785 / 197) ** 2)
    assert bigger["mlp"] / parts["mlp"] == pytest.approx(785 / 197)


def test_identical_weights_give_identical_logits_at_another_size():
    settings = BenchmarkSettings(model="vit-tiny-patch16-224", num_labels=10, num_hidden_layers=2, timm=False)
    models, skipped = build_models(settings, torch.device("cpu"), image_size=48)
    assert set(models) == {HF_VIT, TRANSFORMERS} and skipped == {"timm": "not requested"}
    pixel_values = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(0))
    assert compare_logits(models, pixel_values)[TRANSFORMERS] < 1e-4
    assert models[TRANSFORMERS].config._attn_implementation == "sdpa"
    assert models[HF_VIT].config._attn_implementation == "sdpa"


def test_command_line_rejects_unknown_preset(capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--model", "vit-enormous-patch16-224"])
    assert "unknown --model" in capsys.readouterr().err


def test_merge_replaces_redone_figures_and_keeps_the_rest():
    def figure(key, value):
        return {"key": key, "values": {HF_VIT: value, TRANSFORMERS: 1.0}, "ratio": value}

    old = {
        "command": "first",
        "settings": {},
        "machine": {},
        "figures": [figure("a/fp32/eager", 1.0), figure("a/bf16/eager", 2.0)],
        "matmul": {"fp32": 1, "bf16": 2},
        "sweep": [{"image_size": 224}],
        "verification": {"passed": True, "max_abs_logits_diff": {"fp32": {TRANSFORMERS: 0.0}}},
    }
    new = {
        "command": "second",
        "settings": {},
        "machine": {},
        "figures": [figure("a/bf16/eager", 3.0)],
        "matmul": {"bf16": 5},
        "verification": {"passed": True, "max_abs_logits_diff": {"bf16": {TRANSFORMERS: 0.0}}},
    }
    merged = merge_reports(old, new)
    assert {row["key"]: row["ratio"] for row in merged["figures"]} == {"a/fp32/eager": 1.0, "a/bf16/eager": 3.0}
    assert merged["matmul"] == {"fp32": 1, "bf16": 5} and merged["sweep"] == [{"image_size": 224}]
    assert set(merged["verification"]["max_abs_logits_diff"]) == {"fp32", "bf16"}
    assert [run["command"] for run in merged["runs"]] == ["first", "second"]


def test_doc_blocks_are_rewritten_from_the_figures(report, tmp_path):
    figures, folder = report
    doc = tmp_path / "bench.md"
    doc.write_text("# Bench\n\nkept\n\n<!-- benchmark:targets -->\nstale\n<!-- /benchmark:targets -->\n\nkept too\n")
    assert benchmark.main(["--doc_only", "--doc", str(doc), "--json", str(folder / "bench.json")]) == 0
    text = doc.read_text()
    assert "stale" not in text and text.startswith("# Bench\n\nkept\n") and text.endswith("\n\nkept too\n")
    targets = text.split("<!-- benchmark:targets -->\n")[1].split("<!-- /benchmark:targets -->")[0]
    train_fp32 = next(row for row in figures["figures"] if row["key"] == "train_images_per_s/fp32/eager")
    line = next(line for line in targets.splitlines() if line.startswith("| train_images_per_s | fp32 | eager |"))
    assert f"| 1.10 | {train_fp32['ratio']:.3f} |" in line
    assert line.endswith("| **met** |") == (train_fp32["ratio"] >= 1.10)
    sections = markdown_sections(figures)
    assert set(sections) == {"machine", "table", "targets", "sweep", "profile", "pipeline", "onnxruntime"}
    assert fill_markdown(text, sections) == text  # idempotent
    with pytest.raises(ValueError, match="nosuch"):
        fill_markdown("<!-- benchmark:nosuch -->\n<!-- /benchmark:nosuch -->\n", sections)
    with pytest.raises(ValueError, match=r"\['table'\].*closing marker"):
        fill_markdown("<!-- benchmark:table -->\nold\n<!-- /benchmark:tabel -->\n", sections)


def test_partial_runs_cannot_rewrite_the_doc_alone(capsys):
    for partial in (["--sweep_only", "--sizes", "32"], ["--profile_only"]):
        with pytest.raises(SystemExit):
            benchmark.parse_args(partial + ["--doc", "docs/benchmarks.md"])
        assert "--merge_json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--profile_only", "--sizes", "32"])
    assert "--profile_only measures no size sweep" in capsys.readouterr().err


def test_profile_counts_hf_vit_matmul_attention_as_attention(report):
    figures, _ = report
    attention = PROFILE_CATEGORIES[1]
    bf16 = figures["profile"]["bf16"]["hf_vit"]
    assert attention.startswith("attention") and bf16["categories_pct"][attention] > 0
    # hf-vit's CPU bf16 training runs attention as bmm + softmax: those ops are attention, not the linear layers
    ops = {op["op"] for op in bf16["top_ops"]}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" not in ops


def test_committed_doc_shows_the_committed_figures():
    # docs/benchmarks.md's generated blocks must be what docs/benchmarks.json renders to (no hand-edited figures).
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "<!-- benchmark:table -->" in doc and "<!-- benchmark:targets -->" in doc
    figures = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
    assert fill_markdown(doc, markdown_sections(figures)) == doc


def test_merge_of_a_partial_sweep_replaces_only_its_points_and_keeps_the_matmul_peak():
    def point(size, dtype, value):
        return {"image_size": size, "dtype": dtype, "train_ratio": value}

    old = {
        "command": "full",
        "settings": {},
        "machine": {},
        "figures": [],
        "matmul": {"bf16": 7},
        "sweep": [point(224, "fp32", 1.0), point(224, "bf16", 1.1), point(512, "bf16", 1.2)],
    }
    new = {
        "command": "sweep",
        "settings": {"sweep_only": True},
        "machine": {},
        "figures": [],
        "matmul": {"bf16": 3},
        "sweep": [point(512, "bf16", 0.9), point(512, "fp32", 1.0)],
    }
    merged = merge_reports(old, new)
    assert [(p["image_size"], p["dtype"], p["train_ratio"]) for p in merged["sweep"]] == [
        (224, "fp32", 1.0),
        (224, "bf16", 1.1),
        (512, "fp32", 1.0),
        (512, "bf16", 0.9),
    ]
    assert merged["matmul"] == {"bf16": 7}  # the peak the main figures were measured against


def test_timm_weights_use_the_converters_mapping():
    settings = BenchmarkSettings(model="vit-tiny-patch16-224", num_hidden_layers=2, image_size=32, timm=False)
    model = build_hf_vit(hf_vit_config(settings))
    state = hf_vit_to_timm_state_dict(model.state_dict())
    expected = {"cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.1.attn.qkv.weight", "norm.bias"}
    assert expected | {"blocks.1.mlp.fc2.bias", "head.weight"} <= set(state)
    assert len(state) == len(model.state_dict())


def test_benchmarks_are_not_packaged():
    from setuptools import find_packages

    # the include list of [tool.setuptools.packages.find], read without tomllib (Python 3.10 has none)
    include = re.search(r"^include = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)[1]
    packages = find_packages(str(ROOT), include=[name.strip().strip('"') for name in include.split(",")])
    assert "hf_vit" in packages and not any(name.split(".")[0] == "benchmarks" for name in packages)


def test_input_pipelines_and_onnxruntime(report):
    data, _ = report
    pipeline = data["input_pipeline"]
    assert pipeline["threads"] == 1
    for kind in ("photo", "large_photo"):
        values = pipeline[kind]["images_per_s"]
        assert values[HF_VIT] > 0 and values["pil_decode"] > 0
        assert set(values) | set(pipeline["skipped"]) == {HF_VIT, "torchvision", "timm", "pil_decode"}
    assert pipeline["photo"]["image_sizes"] == ["640x427", "500x375"]
    assert pipeline["profile"]["top_functions"] and pipeline["profile"]["total_ms_per_image"] > 0
    rows = {row["key"] for row in data["figures"]}
    assert ("input_pipeline_photo_images_per_s" in rows) == ("torchvision" in pipeline["photo"]["images_per_s"])
    onnx = data["onnxruntime"]
    assert "error" not in onnx, onnx.get("error")
    for batch in (1, 2):
        row = onnx[f"batch_{batch}"]
        assert row["max_abs_logits_diff"] <= 1e-3 and row["images_per_s"]["onnxruntime"] > 0
        assert row["ratio_onnxruntime_to_eager"] == row["images_per_s"]["onnxruntime"] / row["images_per_s"][HF_VIT]
    sections = markdown_sections(data)
    assert "onnxruntime / eager" in sections["onnxruntime"] and "make_train_transform" in sections["pipeline"]
    without = markdown_sections({key: value for key, value in data.items() if key not in ("input_pipeline", "sweep")})
    assert without["pipeline"].startswith("Not measured") and without["sweep"].startswith("Not measured")


def test_default_run_is_bounded():
    # compiled rows and the size sweep are behind flags; the pipelines and onnxruntime are in the default run
    settings, _ = benchmark.parse_args([])
    assert not settings.compile and not settings.sizes and settings.pipeline and settings.onnx
    assert benchmark.parse_args(["--compile"])[0].compile


# --------------------------------------------------------------------------------------------- the GPU benchmark


@pytest.fixture(scope="module")
def gpu_quick(tmp_path_factory):
    """benchmarks/gpu.py --quick on CPU: the GPU path (bf16, train and infer, eager and compiled, MFU, the JSON and
    the doc blocks) on a tiny model, one timed call per row; aot_eager compiles through dynamo and AOTAutograd without
    generating kernels (the models whole, the packing rows per block, as `gpu_session.sh packing` compiles them)."""
    folder = tmp_path_factory.mktemp("gpu")
    doc = folder / "gpu.md"
    doc.write_text("# GPU\n\n<!-- benchmark-gpu:summary -->\nstale\n<!-- /benchmark-gpu:summary -->\n\n"
                   "<!-- benchmark-gpu:targets -->\n<!-- /benchmark-gpu:targets -->\n<!-- benchmark:table -->\nCPU\n"
                   "<!-- /benchmark:table -->\n<!-- benchmark-gpu:packing -->\n<!-- /benchmark-gpu:packing -->\n"
                   )  # fmt: skip
    argv = ["--quick", "--device", "cpu", "--peak_tflops", "0.5", "--compile_backend", "aot_eager", "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        # eager rows first, then the compiled ones merged in (as a GPU session splits the work between commands)
        assert gpu.main(argv + ["--no_compile", "--json", str(folder / "gpu.json")]) == 0
        # the compiled rows with SDPA restricted to its math backend (a lever to measure on the GPU)
        second = ["--no_eager", "--sdpa_backend", "math", "--merge_json", "--json", str(folder / "gpu.json")]
        assert gpu.main(argv + second + ["--doc", str(doc)]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads((folder / "gpu.json").read_text()), doc.read_text()


def test_gpu_benchmark_quick_run_has_every_row_with_mfu(gpu_quick):
    data, _ = gpu_quick
    assert data["machine"]["device"] == "cpu" and data["bf16_dense_peak"]["flops_per_s"] == 0.5e12
    run = data["models"]["vit-tiny-patch16-224"]
    assert run["settings"]["dtypes"] == ["bf16"] and run["verification"]["passed"]
    assert run["compile"]["errors"] == {} and run["optimizer"]["fused"] is False  # fused AdamW is for CUDA
    assert [(row["mode"], row["variant"]) for row in data["summary"]] == [
        ("train", "eager"), ("infer", "eager"), ("train", "compiled"), ("infer", "compiled")
    ]  # fmt: skip
    forward = run["flops_per_image"]["forward"]["total"]
    assert run["flops_per_image"]["train_step"] == 3 * forward
    for row in data["summary"]:
        for name in (HF_VIT, TRANSFORMERS):
            per_s = row["images_per_s"][name]
            flops = forward * (3 if row["mode"] == "train" else 1)
            assert row["mfu"][name] == pytest.approx(per_s * flops / 0.5e12, rel=1e-9)
            assert row["peak_mem_mb"][name] > 0
        assert row["ratio"][TRANSFORMERS] == pytest.approx(
            row["images_per_s"][HF_VIT] / row["images_per_s"][TRANSFORMERS]
        )
    assert "2 * multiply-adds" in data["flops_formula"] and "3 * forward" in data["flops_formula"]
    assert len(data["runs"]) == 2 and "--no_eager" in data["runs"][1] and "--no_eager" not in data["runs"][0]
    assert [entry["settings"]["sdpa_backend"] for entry in run["runs"]] == [None, "math"]


def test_gpu_benchmark_quick_run_has_the_packing_rows(gpu_quick):
    # square, padded with a mask, padded through variable-length attention, packed: eager (first run) and compiled
    # (merged in), inference and a training step, each with images/s and the attention path hf-vit chose
    data, text = gpu_quick
    packing = data["packing"]
    layouts = ("square", "padded + mask", "padded + varlen", "packed", "packed + mask")
    assert gpu_packing.LAYOUTS == layouts
    assert set(packing["rows"]) == {
        f"{layout} | {mode} | {variant}"
        for layout in layouts for mode in ("inference", "training") for variant in ("eager", "compiled")
    }  # fmt: skip
    for row in packing["rows"].values():
        assert row["images_per_s"] > 0 and row["patches_per_s"] > 0 and row["attention_path"]
        assert (row["attention_kernels"] is None) == (row["mode"] == "training")
        assert row["gpu_busy"] is None and row["longest_kernels"] == []  # CPU: no device kernels to count
        if row["mode"] == "inference":  # what the profile shows: SDPA's CPU kernel, or (math backend) its matmuls
            assert row["attention_kernels"], row
            if row["variant"] == "eager":
                assert any("scaled_dot_product" in name for name in row["attention_kernels"]), row
    paths = {key: row["attention_path"] for key, row in packing["rows"].items()}
    assert paths["square | training | eager"] == "sdpa, no mask"
    assert paths["padded + mask | inference | compiled"] == "sdpa, padding mask"
    # CPU: the model's own path (varlen_attn is CUDA's): the padding masked as keys, each packed image's run alone
    # (eager) or gathered into a row of its own (compiled); the masked rows force the gather
    assert paths["padded + varlen | training | eager"] == paths["padded + varlen | inference | compiled"]
    assert paths["padded + varlen | training | eager"] == "sdpa, padding mask"
    assert paths["packed | inference | eager"] == "sdpa, each image's run alone"
    assert paths["packed | training | compiled"] == "sdpa, each image in a row of its own"
    assert paths["packed + mask | inference | eager"] == "sdpa, each image in a row of its own"
    # bf16 against fp32 on the images the batches share: every layout as close as the masked padded batch
    accuracy = packing["bf16_accuracy"]
    assert set(accuracy) == set(layouts[1:])
    for figures in accuracy.values():
        assert 0 < figures["logits_max_difference"] < 0.1 and 0 < figures["gradients_relative_difference"] < 0.1
    assert "bf16 autocast against fp32" in text
    # the padded and packed batches gave the images they share the same logits before anything was timed
    assert packing["max_logits_difference"] <= 1e-4 and packing["skipped"] == {}
    assert packing["padding_share"]["padded"] > 0 and packing["images"]["packed"] >= packing["images"]["padded"]
    assert packing["sdpa"] == {"cudnn": None} and packing["settings"]["dtype"] == "bf16 autocast"
    settings = packing["settings"]
    assert settings["compile_blocks"] and settings["steps"] == settings["repeats"] == 1  # --quick: one call per row
    assert "Compiled: each transformer block (fullgraph), the embeddings and heads eager." in text
    # the host synchronisation check is CUDA's: skipped on CPU, and said so
    assert set(packing["host_sync"]) == {"skipped"} and "cpu" in packing["host_sync"]["skipped"]
    assert "Host synchronisation check (forward + backward): skipped, cpu" in text
    section = text.split("<!-- benchmark-gpu:packing -->\n")[1].split("<!-- /benchmark-gpu:packing -->")[0]
    assert "| packed | training | compiled |" in section and "| padded + varlen | inference | eager |" in section


def test_gpu_benchmark_packing_only_merges_into_an_earlier_run(gpu_quick, tmp_path):
    data, _ = gpu_quick
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(data))
    argv = ["--quick", "--device", "cpu", "--packing_only", "--no_compile", "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert gpu.main(argv + ["--merge_json", "--json", str(path)]) == 0
    finally:
        torch.set_num_threads(threads)
    merged = json.loads(path.read_text())
    assert merged["models"] == data["models"] and merged["summary"] == data["summary"]
    assert set(merged["packing"]["rows"]) == set(data["packing"]["rows"]) and "--packing_only" in merged["runs"][-1]


def test_gpu_benchmark_fills_only_its_own_doc_blocks(gpu_quick, tmp_path):
    data, text = gpu_quick
    assert "stale" not in text and "| vit-tiny-patch16-224 | 2 | train | compiled |" in text
    assert "<!-- benchmark:table -->\nCPU\n" in text  # the CPU benchmark's blocks are not touched
    targets = text.split("<!-- benchmark-gpu:targets -->\n")[1].split("<!-- /benchmark-gpu:targets -->")[0]
    assert "| hf-vit / transformers | 1.05 |" in targets
    # --doc_only renders the same blocks from the JSON alone (no GPU needed to rewrite the page)
    (tmp_path / "gpu.json").write_text(json.dumps(data))
    doc = tmp_path / "gpu.md"
    doc.write_text("<!-- benchmark-gpu:summary -->\n<!-- /benchmark-gpu:summary -->\n")
    assert gpu.main(["--doc_only", "--doc", str(doc), "--json", str(tmp_path / "gpu.json")]) == 0
    summary = text.split("<!-- benchmark-gpu:summary -->\n")[1].split("<!-- /benchmark-gpu:summary -->")[0]
    assert doc.read_text() == "<!-- benchmark-gpu:summary -->\n" + summary + "<!-- /benchmark-gpu:summary -->\n"


def test_gpu_presets_batch_sizes_and_peaks():
    args = gpu.parse_args(["--device", "cuda"])
    settings = gpu.settings_for(args)
    assert [(s.model, s.batch_size) for s in settings] == [
        ("vit-small-patch16-224", 256), ("vit-base-patch16-224", 256), ("vit-large-patch16-224", 128)
    ]  # fmt: skip
    assert all(s.fused_optimizer and s.compile and s.dtypes == ["bf16"] and not s.onnx for s in settings)
    assert BenchmarkSettings(device="cpu").fused_optimizer is False
    assert dense_bf16_peak("NVIDIA H100 80GB HBM3")["flops_per_s"] == 989e12
    assert dense_bf16_peak("NVIDIA H100 PCIe")["flops_per_s"] == 756e12
    assert dense_bf16_peak("NVIDIA H200")["flops_per_s"] == 989e12
    assert dense_bf16_peak(None) is None and dense_bf16_peak("NVIDIA H200", 100.0)["flops_per_s"] == 100e12


def test_gpu_benchmark_time_budget_and_bad_flags(tmp_path, capsys):
    assert gpu.main(["--quick", "--device", "cpu", "--time_budget_s", "0", "--json", str(tmp_path / "x.json")]) == 1
    assert "no model was measured" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
    with pytest.raises(SystemExit):
        gpu.parse_args(["--models", "vit-base-patch16-224", "--batch_sizes", "1", "2"])
    assert "one batch size per model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu.parse_args(["--no_eager", "--no_compile"])
    assert "leaves nothing to time" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu.parse_args(["--doc", str(tmp_path / "missing.md")])
    assert "does not exist" in capsys.readouterr().err


def test_end_to_end_jpeg_folder_is_imagenet_sized_and_never_overwrites(tmp_path):
    import PIL.Image

    from benchmarks.end_to_end import IMAGENET_SIZES, finetune_command, generate_jpeg_folder

    folder = tmp_path / "jpegs"
    data = generate_jpeg_folder(folder, images=8, classes=2)
    train = sorted((folder / "images" / "train").rglob("*.jpg"), key=lambda path: path.name)
    assert len(train) == 8 and len(list((folder / "images" / "validation").rglob("*.jpg"))) == 2
    assert {path.parent.name for path in train} == {"class_00", "class_01"}
    assert [PIL.Image.open(path).size for path in train] == IMAGENET_SIZES[:8]
    assert len({path.read_bytes() for path in train}) == 8 and data["mean_jpeg_kib"] > 10
    assert generate_jpeg_folder(folder, images=8, classes=2) == data  # reused, not rewritten
    with pytest.raises(FileExistsError, match="other settings"):
        generate_jpeg_folder(folder, images=9, classes=2)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "holiday.jpg").write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="did not write"):
        generate_jpeg_folder(tmp_path / "mine", images=8)
    assert (tmp_path / "mine" / "holiday.jpg").read_bytes() == b"precious"
    command = finetune_command("m", data["dataset"], "out", 32, 12, ["--bf16"])
    assert command[command.index("--max_steps") + 1] == "12" and command[-1] == "--bf16"


def test_compiling_per_block_keeps_the_logits_and_is_undone():
    from benchmarks.runners import BLOCK_CLASSES, compile_models

    settings = BenchmarkSettings(
        model="vit-tiny-patch16-224", num_hidden_layers=2, image_size=32, timm=False, device="cpu",
        compile=True, compile_blocks=True, compile_backend="aot_eager",
    )  # fmt: skip
    models, _ = build_models(settings, torch.device("cpu"))
    pixel_values = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    eager = {name: model.eval()(pixel_values).logits.detach() for name, model in models.items()}
    compiled, undo = compile_models(models, settings)
    blocks = [m for model in models.values() for m in model.modules() if type(m).__name__ in BLOCK_CLASSES]
    assert len(blocks) == 4 and all(block._compiled_call_impl is not None for block in blocks)  # 2 per model
    torch._dynamo.reset()
    for name, model in compiled.items():
        torch.testing.assert_close(model(pixel_values).logits, eager[name], rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # the blocks did run compiled
    undo()
    assert all(block._compiled_call_impl is None for block in blocks)


def test_load_cost_loads_a_snapshot_both_ways_in_fresh_processes(tmp_path):
    """benchmarks/load_cost.py's worker on a tiny ViT in transformers' layout: both loaders load it from the offline
    cache, and each reports its time, the time of from_pretrained alone and its memory."""
    import os
    import subprocess

    from benchmarks import load_cost

    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    load_cost.write_snapshot(tmp_path, "google/vit-tiny-load-cost", sizes)
    dinov2 = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2)
    load_cost.write_snapshot(tmp_path, "facebook/dinov2-tiny-load-cost", dinov2)  # DINOv2's layout
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    # Each loader once, each on one of the layouts (a fresh process costs the imports of torch and transformers).
    theirs, ours = load_cost.LOADERS
    runs = [
        ("google/vit-tiny-load-cost", theirs, "transformers/models/vit/modeling_vit.py"),
        ("facebook/dinov2-tiny-load-cost", ours, "hf_vit/model/modeling_vit.py"),
    ]
    for repo_id, loader, code in runs:
        done = subprocess.run(
            [sys.executable, load_cost.__file__, "--worker", loader, repo_id],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        assert figures["code"].endswith(code)
        assert 0 < figures["load_seconds"] < figures["seconds"] and figures["peak_mb"] >= 0


def test_naflex_rows_fill_their_doc_block(tmp_path, capsys):
    from benchmarks import naflex_speed

    doc = tmp_path / "benchmarks.md"
    doc.write_text("before\n<!-- naflex:table -->\nold\n<!-- /naflex:table -->\nafter\n")
    tiny = ["--max_num_patches", "4", "--batch_size", "2", "--width", "32", "--depth", "1", "--heads", "2"]
    assert naflex_speed.main([*tiny, "--steps", "1", "--repeats", "1", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("before\n<!-- naflex:table -->\n| attention |") and text.endswith("after\n")
    rows = [line for line in text.splitlines() if line.startswith(("| eager", "| sdpa"))]
    assert len(rows) == 2 and "old" not in text and "load average" in text
    timm_present = "timm absent" not in text  # its column is there only where timm imports
    assert all(row.endswith("- | - |") != timm_present for row in rows)
    with pytest.raises(SystemExit):
        naflex_speed.main(["--max_num_patches", "5"])  # not a square: refused by name
    assert "--max_num_patches must be a square number" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a --doc without the block: refused before anything is measured
        naflex_speed.main(["--doc", str(tmp_path / "missing.md")])
    assert "missing.md is not a markdown file with a <!-- naflex:table --> block" in capsys.readouterr().err


def test_simmim_rows_time_both_models_with_the_same_weights(tmp_path, capsys):
    from benchmarks import simmim_speed

    doc = tmp_path / "benchmarks.md"
    doc.write_text("before\n<!-- simmim:table -->\nold\n<!-- /simmim:table -->\nafter\n")
    tiny = ["--image_size", "32", "--patch_size", "8", "--batch_size", "2", "--width", "32", "--depth", "1"]
    assert simmim_speed.main([*tiny, "--heads", "2", "--steps", "1", "--repeats", "1", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("before\n<!-- simmim:table -->\n| attention |") and text.endswith("after\n")
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith(("| eager", "| sdpa"))]
    assert len(rows) == 2 and all(float(row[3].removesuffix("x |")) > 0 for row in rows) and "old" not in text
    assert "max |difference| loss 0.0e+00, reconstruction 0.0e+00" in text  # the same weights, the same function
    with pytest.raises(SystemExit):
        simmim_speed.main(["--image_size", "30"])
    assert "--image_size 30 must be a multiple of --patch_size 16" in capsys.readouterr().err


def test_packing_rows_quick_mode_prints_every_row_and_ratio(capsys):
    from benchmarks import packing_speed

    assert packing_speed.main(["--quick"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| padded", "| packed"))]
    assert [row.split(" | ")[0] for row in rows] == ["| padded + mask", "| packed + mask"]
    assert all(len(re.findall(r"\d+\.\d\dx", row)) == 2 for row in rows)
    assert "padding" in out and "have the same outputs" in out
    # the model rows: square, padded and packed, eager and compiled (quick: Dynamo's eager backend), each with its
    # padding share, images/s, real patches/s and the ratio against padded + mask, for inference and training
    model_rows = [line for line in out.splitlines() if line.startswith("| model:")]
    assert [row.split(" | ")[0] for row in model_rows] == [
        "| model: square (eager)", "| model: padded + mask (eager)", "| model: packed + mask (eager)",
        "| model: square (compiled)", "| model: padded + mask (compiled)", "| model: packed + mask (compiled)",
    ]  # fmt: skip
    assert all(len(re.findall(r"\d+\.\d\dx", row)) == 2 for row in model_rows)
    assert [row.split(" | ")[2] for row in model_rows][:2] == ["0%", "19%"]  # the square batch has no padding
    # on CPU the model masks the padding as keys; each packed image's run attends alone (compiled: a row of its own)
    assert "padding masked as keys" in model_rows[1] and "each image's run alone" in model_rows[-1]
    assert "torch.compile(backend='eager'), logits within" in out and "Compiled / eager speed:" in out
    assert re.search(r"Recompiles: .* batch 2 \(\d+ images, rows of \d+ tokens\): \d+ frames recompiled", out)
    with pytest.raises(SystemExit):
        packing_speed.main(["--max_num_patches", "64", "--packed_sequence_length", "32"])
    assert "--packed_sequence_length (32) must be at least --max_num_patches (64)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        packing_speed.main(["--max_num_patches", "12", "--packed_sequence_length", "24"])
    assert "--max_num_patches (12) must be a square number" in capsys.readouterr().err


def test_packing_accuracy_quick_mode_trains_both_layouts_on_the_same_slots(tmp_path, capsys):
    """benchmarks/packing_accuracy.py --quick: padded and packed runs from the same weights on the same patch slots
    per step, the packed steps holding more images; the accuracy is of the held-out digits only."""
    from benchmarks import packing_accuracy

    path = tmp_path / "accuracy.json"
    assert packing_accuracy.main(["--quick", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    result = json.loads(path.read_text())
    assert [point["step"] for point in result["curve"]] == [0, 3, 6]
    start = result["curve"][0]
    assert start["padded"]["accuracy"] == start["packed"]["accuracy"]  # the same initial weights
    totals = result["totals"]
    assert totals["padded"]["images"] == 6 * 8 and totals["packed"]["images"] > totals["padded"]["images"]
    assert totals["padded"]["slots"] == 6 * 8 * 16 and totals["packed"]["slots"] <= 6 * 8 * 16
    assert result["train_images"] + result["test_images"] == 1797 and result["test_images"] == 100
    assert all(0 <= point[name]["accuracy"] <= 1 for point in result["curve"] for name in ("padded", "packed"))
    assert "| step | padded: training s |" in out and "| training time |" in out and "images seen per second" in out
    assert re.search(r"Packed / padded: images seen per second \d+\.\d\dx", out)


def test_packing_accuracy_holds_out_its_test_digits_and_counts_them():
    from benchmarks import packing_accuracy

    split = packing_accuracy.load_digits_split(360, seed=0)
    assert not set(split["train"][2]) & set(split["test"][2]) and len(split["test"][2]) == 360
    args = argparse.Namespace(
        max_num_patches=64, packed_sequence_length=256, batch_size=32, patch_size=4, min_share=0.3, max_aspect=3.0,
        seed=0,
    )  # fmt: skip
    image = packing_accuracy.mixed_aspect_image(split["test"][0][0], np.random.default_rng(0), args)
    rows, cols = image.shape[0] // 4, image.shape[1] // 4
    assert image.shape[0] % 4 == image.shape[1] % 4 == 0 and 20 <= rows * cols <= 64 and image.shape[2] == 3

    class Constant(torch.nn.Module):  # predicts digit 3 for every image
        def forward(self, pixel_values, **kwargs):
            logits = torch.zeros(len(kwargs["spatial_shapes"]), 10)
            logits[:, 3] = 1
            return type("Output", (), {"logits": logits})

    labels = torch.tensor(split["test"][1])
    batches = [{"inputs": {"pixel_values": None, "spatial_shapes": labels[i : i + 100]}, "labels": labels[i : i + 100]}
               for i in range(0, 360, 100)]  # fmt: skip
    assert packing_accuracy.evaluate(Constant(), batches) == pytest.approx(float((labels == 3).float().mean()))
    # a packed step holds whole images in at most B x K / L rows, the next image waiting when it does not fit
    processor = packing_accuracy.VisionTransformerImageProcessor(max_num_patches=64, patch_size=4, do_resize=False)
    stream = packing_accuracy.Stream(split["train"][0], split["train"][1], args)
    packed = packing_accuracy.next_batch(stream, "packed", processor, args)
    assert len(packed["inputs"]["pixel_values"]) <= 8 and packed["images"] > 32
    assert packed["patches"] == int((packed["inputs"]["image_slot_index"] >= 0).sum())
    waiting = stream.peek()[2]
    sizes = packed["inputs"]["spatial_shapes"].prod(1).tolist()
    assert len(packing_accuracy.best_fit_decreasing([*sizes, waiting], 256)) > 8
