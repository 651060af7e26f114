"""The combination matrix: tiny training runs over the combinations users make, each checked for the same invariants.

Factors: source (a preset from scratch, an hf-vit folder, transformers' and timm's layouts by Hub id through a cache
the test fills, the authors' .npz) x adaptation (full, LoRA on the fused qkv, LoRA on query,value) x labels (single,
multi-label) x data (in memory, streamed) x processes (1, 2 with torchrun: one launch trains every two-process run, one
after the other in the same two processes). `COMBINATIONS` covers every pair of values of the first four factors (a
preset trains in full only, and multi-label data does not stream: that pair is checked to be refused); three of them
run with two processes, covering two processes with every adaptation, both label kinds and both data kinds, from a
preset, an hf-vit folder and a Hub id converted on load in each process. `FAMILY_ROWS` add one row for each of the
family that followed, by Hub id (DINOv2 with registers, SigLIP's vision tower, DeiT with its distillation head),
together covering every adaptation. Sizes drawn per batch ride on rows as extra flags: `--seq_lens` with two processes,
multi-label and native-aspect batches (each step's length alike on both processes, checked from each one's batches) and
across a kill (exact resumption); `--patch_sizes` with LoRA and with a stream; packed sequences (`--max_num_patches`
with `--packed_sequence_length`) with LoRA, with a stream, and with two processes and multi-label data (in memory, each
batch a fixed number of rows of patch slots holding as many images as fill them; on a stream, a fixed number of
images); native-aspect batches (`--max_num_patches`) with DeiT's recipe (Mixup and CutMix of patches on the images'
grids).

Invariants on every run:
1. the run's folder (for LoRA: the merged model, saved) reloads with the Auto classes and predicts what the trained
   model in memory predicted (with two processes: the model rank 0 held at the end of training);
2. the reported test metrics (`all_results.json`) equal an evaluation of the test split made here;
3. no text file written names a local path (but a LoRA run's record of its local base, never pushed);
4. the push plan (`hf_vit.outputs.push.plan_upload`) lists only the project's files;
5. the logged global batch is per-device batch x processes.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import torchrun_command
from safetensors.torch import load_file
from transformers import AutoImageProcessor, AutoModelForImageClassification, TrainerCallback

from hf_vit import VisionTransformerConfig, VisionTransformerForImageClassification
from hf_vit.data.datasets import load_digits_dataset
from hf_vit.lora import save_merged_model
from hf_vit.metrics import compute_metrics
from hf_vit.outputs.files import LOCAL_BASE_FILE, RESULT_FILES
from hf_vit.outputs.push import plan_upload, upload_file_names
from hf_vit.tasks.model_setup import load_checkpoint as load_for_finetuning
from hf_vit.train.arguments import parse_args
from hf_vit.train.lora import apply_lora
from hf_vit.train.training import train

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "train_worker.py"
TINY = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64"
SIZE, PATCH, BATCH = 32, 8, 8
TRANSFORMERS_ID, TIMM_ID = "google/vit-matrix-test", "timm/vit_tiny_patch8_32.matrix"
# The family's sources, one row each (`FAMILY_ROWS`), by Hub id; the pairs are checked over the other sources.
FAMILY_IDS = {
    "dinov2": "facebook/dinov2-with-registers-small",
    "siglip": "google/siglip-base-patch16-224",
    "deit": "facebook/deit-tiny-distilled-patch16-224",
}
BINARY = (".safetensors", ".bin", ".pt", ".pth", ".png")


@dataclass(frozen=True)
class Combination:
    source: str  # preset, folder, transformers, timm, npz
    adaptation: str  # full, qkv, query_value
    labels: str  # single, multi
    data: str  # memory, stream
    processes: int = 1
    recipe: str | None = None  # --recipe
    flags: tuple[str, ...] = ()  # more flags: sizes drawn per batch (--seq_lens, --patch_sizes)

    def __str__(self) -> str:
        recipe = f"-{self.recipe}" if self.recipe else ""
        more = "".join(f"-{flag.strip('-')}" for flag in self.flags if flag.startswith("--"))
        return f"{self.source}-{self.adaptation}-{self.labels}-{self.data}-{self.processes}p{recipe}{more}"


SEQ_LENS = ("--seq_lens", "4,16")  # native-aspect batches of 32 images at 4 patches or 8 at 16 (the 8 x 16 budget)
PACKED = ("--max_num_patches", "16", "--packed_sequence_length", "40")  # 8 rows of 2 digits (or a stream's 8 in 4)


COMBINATIONS = [
    Combination("preset", "full", "single", "memory"),
    Combination("preset", "full", "multi", "memory", processes=2, flags=SEQ_LENS),
    Combination("preset", "full", "single", "stream", flags=("--patch_sizes", "8,16")),
    Combination("folder", "full", "multi", "memory"),
    Combination("folder", "qkv", "single", "stream", processes=2),
    Combination("folder", "query_value", "single", "memory", flags=("--patch_sizes", "4,8,16")),
    Combination("folder", "qkv", "single", "memory", flags=PACKED),
    Combination("npz", "full", "single", "stream", flags=PACKED),
    Combination("timm", "full", "multi", "memory", processes=2, flags=PACKED),
    Combination("transformers", "full", "single", "stream"),
    Combination("transformers", "qkv", "multi", "memory"),
    Combination("transformers", "query_value", "single", "memory", processes=2),
    Combination("timm", "full", "single", "stream"),
    Combination("timm", "qkv", "single", "memory"),
    Combination("timm", "query_value", "multi", "memory"),
    Combination("npz", "full", "single", "stream"),
    Combination("npz", "qkv", "multi", "memory"),
    Combination("npz", "query_value", "single", "stream"),
    # The recipes composed with the rest: LoRA, multi-label (mixed multi-hot targets) and 2 processes with DeiT's
    # (Mixup/CutMix, RandAugment, label smoothing, EMA); a stream with MAE fine-tuning's (layer-wise lr decay too).
    Combination("transformers", "qkv", "multi", "memory", processes=2, recipe="deit"),
    Combination("timm", "full", "single", "stream", recipe="finetune"),
    # DeiT's Mixup/CutMix on native-aspect batches (CutMix cuts whole patches on each image's grid).
    Combination("folder", "full", "single", "memory", recipe="deit", flags=("--max_num_patches", "16")),
]
FAMILY_ROWS = [
    Combination("dinov2", "full", "single", "memory"),
    Combination("siglip", "qkv", "single", "stream"),
    Combination("deit", "query_value", "multi", "memory"),
]


def test_the_combinations_cover_every_pair():
    factors = ("source", "adaptation", "labels", "data")
    values = {name: {getattr(c, name) for c in COMBINATIONS} for name in factors}
    assert {c.source for c in FAMILY_ROWS} == set(FAMILY_IDS)  # one row per family, every adaptation among them
    assert {c.adaptation for c in FAMILY_ROWS} == values["adaptation"]
    assert values["source"] == {"preset", "folder", "transformers", "timm", "npz"}
    for i, first in enumerate(factors):
        for second in factors[i + 1 :]:
            seen = {(getattr(c, first), getattr(c, second)) for c in COMBINATIONS}
            for a in values[first]:
                for b in values[second]:
                    impossible = {(a, b), (b, a)} & {("preset", "qkv"), ("preset", "query_value"), ("multi", "stream")}
                    assert (a, b) in seen or impossible, f"{first}={a} with {second}={b} is not covered"
    two = [c for c in COMBINATIONS if c.processes == 2]
    for name in ("adaptation", "labels", "data"):
        assert {getattr(c, name) for c in two} == values[name], name


# ---------------------------------------------------------------------------------------------------------------------
# What the runs share: data sets and sources, written once


@dataclass
class World:
    root: Path
    cache: Path
    data: dict[str, Path]
    sources: dict[str, str]


def _digits_subsets(root: Path) -> dict[str, Path]:
    from datasets import Dataset, DatasetDict

    digits = load_digits_dataset()
    single, multi = {}, {}
    for split, size in (("train", 32), ("validation", 8), ("test", 24)):
        rows = digits[split].select(range(size))
        images, labels = list(rows["image"]), rows["label"]
        single[split] = Dataset.from_dict({"image": images, "label": labels}, features=rows.features)
        tags = [["even" if d % 2 == 0 else "odd"] + (["round"] if d in (0, 6, 8, 9) else []) for d in labels]
        multi[split] = Dataset.from_dict({"image": images, "tags": tags})
    DatasetDict(single).save_to_disk(str(root / "single"))
    DatasetDict(multi).save_to_disk(str(root / "multi"))
    return {"single": root / "single", "multi": root / "multi"}


def _write_sources(root: Path, cache: Path) -> dict[str, str]:
    from test_sources import hub_repo, timm_repo
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    from hf_vit.convert import hf_vit_to_npz_arrays

    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(
        VisionTransformerConfig(image_size=SIZE, patch_size=PATCH, num_labels=5, zero_init_head=False, **sizes)
    ).eval()
    model.save_pretrained(root / "hf-vit-base")
    np.savez(root / "ViT-T_8.npz", **hf_vit_to_npz_arrays(model.state_dict(), model.config))
    timm_repo(hub_repo(cache, TIMM_ID), model)
    snapshot = hub_repo(cache, TRANSFORMERS_ID)
    ViTForImageClassification(ViTConfig(image_size=SIZE, patch_size=PATCH, num_labels=5, **sizes)).save_pretrained(
        snapshot
    )
    ViTImageProcessor(size={"height": SIZE, "width": SIZE}).save_pretrained(snapshot)
    _write_family_sources(cache, sizes)
    return {
        "folder": str(root / "hf-vit-base"),
        "npz": str(root / "ViT-T_8.npz"),
        "timm": TIMM_ID,
        "transformers": TRANSFORMERS_ID,
        **FAMILY_IDS,
    }


def _write_family_sources(cache: Path, sizes: dict) -> None:
    """DINOv2 with registers, SigLIP and distilled DeiT, written by transformers' classes under their Hub ids."""
    from test_sources import hub_repo
    from transformers import (
        BitImageProcessor,
        DeiTConfig,
        DeiTForImageClassificationWithTeacher,
        DeiTImageProcessor,
        Dinov2WithRegistersConfig,
        Dinov2WithRegistersModel,
        SiglipConfig,
        SiglipImageProcessor,
        SiglipModel,
    )

    vision = dict(sizes, image_size=SIZE, patch_size=PATCH)
    dino = {k: v for k, v in vision.items() if k != "intermediate_size"}
    sources = {
        "dinov2": (
            Dinov2WithRegistersModel(Dinov2WithRegistersConfig(**dino, mlp_ratio=2, num_register_tokens=4)),
            BitImageProcessor(size={"shortest_edge": SIZE}, crop_size=SIZE),
        ),
        "siglip": (
            SiglipModel(SiglipConfig(vision_config=vision, text_config=dict(sizes, vocab_size=64))),
            SiglipImageProcessor(size={"height": SIZE, "width": SIZE}),
        ),
        "deit": (
            DeiTForImageClassificationWithTeacher(DeiTConfig(**vision, num_labels=5)),
            DeiTImageProcessor(size=SIZE, crop_size=SIZE),
        ),
    }
    for name, (model, processor) in sources.items():
        snapshot = hub_repo(cache, FAMILY_IDS[name])
        model.save_pretrained(snapshot)
        processor.save_pretrained(snapshot)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    import huggingface_hub.constants

    root = tmp_path_factory.mktemp("matrix")
    cache = root / "hub"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
        patch.setenv("HF_HUB_CACHE", str(cache))
        yield World(root, cache, _digits_subsets(root), _write_sources(root, cache))


# ---------------------------------------------------------------------------------------------------------------------
# One run


class KeepModel(TrainerCallback):
    """Keeps the trained model as it is in memory at the end of training."""

    model = None

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.model = model


def run_flags(world: World, combination: Combination, output_dir: Path) -> tuple[str, list[str]]:
    task = "pretrain" if combination.source == "preset" else "finetune"
    flags = ["--output_dir", str(output_dir), "--image_size", str(SIZE), "--seed", "0"]
    if combination.source == "preset":
        flags += ["--patch_size", str(PATCH), "--config_overrides", TINY]
    else:
        flags += ["--model_name_or_path", world.sources[combination.source]]
    if combination.adaptation != "full":
        targets = "qkv" if combination.adaptation == "qkv" else "query,value"
        flags += ["--lora_rank", "2", "--lora_target_modules", targets]
    flags += ["--dataset_name", str(world.data[combination.labels])]
    flags += ["--label_column_name", "tags" if combination.labels == "multi" else "label"]
    if combination.data == "stream":
        flags += ["--streaming", "True", "--shuffle_buffer_size", "16"]
    flags += ["--max_steps", "3", "--per_device_train_batch_size", str(BATCH), "--per_device_eval_batch_size", "8"]
    flags += ["--learning_rate", "0.05", "--save_strategy", "no", "--disable_tqdm", "True", "--report_to", "none"]
    if combination.recipe:
        flags += ["--recipe", combination.recipe]
    flags += combination.flags
    if combination.processes == 1:  # a validation pass during training, through persistent workers
        flags += ["--eval_strategy", "steps", "--eval_steps", "2"]
        flags += ["--dataloader_num_workers", "1", "--dataloader_persistent_workers", "True"]
    else:
        flags += ["--eval_strategy", "no", "--dataloader_num_workers", "0"]
    return task, flags


def trained_in_memory(combination, task, flags, caplog, batches):
    """Run the combination in this process; returns the model as training left it, and the run's log. `batches`
    receives each training batch's (rows, patch slots, images) of packed runs."""
    from hf_vit.train.trainer import VisionTransformerTrainer

    keep, step = KeepModel(), VisionTransformerTrainer.training_step

    def recording(self, model, inputs, num_items_in_batch=None):
        if "image_slot_index" in inputs:
            batches.append((*inputs["pixel_values"].shape[:2], len(inputs["spatial_shapes"])))
        return step(self, model, inputs, num_items_in_batch)

    with caplog.at_level("INFO", logger="hf_vit"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(VisionTransformerTrainer, "training_step", recording)
        train(task, *parse_args(task, flags), callbacks=[keep])
    return keep.model.eval(), caplog.text


# ---------------------------------------------------------------------------------------------------------------------
# The two-process runs: one torchrun launch trains them all, one after the other in the same two processes (each
# process started once: its imports are most of a short run's time), and each test checks its own run.


@dataclass
class TwoProcessRun:
    output_dir: Path
    log: str  # both ranks' logs of this run
    weights: dict[str, torch.Tensor] | None = None  # rank 0's at the end of training (None: the run did not end)
    records: list[dict] | None = None  # each rank's world size and training batches
    launch: str = ""  # the end of the launch's output, to say why a run did not end


def resumable_flags(world: World, output_dir: Path, *more: str) -> tuple[str, list[str]]:
    """The killed-and-resumed LoRA row: 6 steps on lengths drawn per step, a checkpoint every 2."""
    task, flags = run_flags(world, Combination("folder", "qkv", "single", "memory", processes=2), output_dir)
    flags[flags.index("--save_strategy") + 1] = "steps"
    flags[flags.index("--max_steps") + 1] = "6"
    flags += ["--save_steps", "2", "--eval_strategy", "no", "--dataloader_num_workers", "0"]
    return task, [*flags, *SEQ_LENS, *more]


def two_process_plan(world: World, root: Path, items) -> dict[str, tuple[str, list[str]]]:
    """The two-process runs of this file's tests selected: each row's, then the killed row's uninterrupted run and its
    killed run (last: it ends the processes)."""
    plan, tests = {}, [item for item in items if item.path == Path(__file__)]
    for item in tests:
        if item.originalname == "test_combination" and item.callspec.params["combination"].processes == 2:
            combination = item.callspec.params["combination"]
            plan[str(combination)] = run_flags(world, combination, root / str(combination) / "run")
    if any(item.originalname == "test_killed_lora_run_resumes_to_the_same_weights" for item in tests):
        plan["straight"] = resumable_flags(world, root / "straight" / "run")
        plan["killed"] = resumable_flags(world, root / "killed" / "run", "--kill_at_step", "5")
    return plan


@pytest.fixture(scope="module")
def two_process_runs(world, request, tmp_path_factory) -> dict[str, TwoProcessRun]:
    root = tmp_path_factory.mktemp("two-processes")
    plan = two_process_plan(world, root, request.session.items)
    runs = [dict(task=task, flags=flags, log=str(root / name / "run.log")) for name, (task, flags) in plan.items()]
    for name in plan:
        (root / name).mkdir()
    (root / "runs.json").write_text(json.dumps(runs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_CACHE": str(world.cache)}
    command = [*torchrun_command(), str(WORKER), "--runs", str(root / "runs.json")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    # the killed run, last, ends the launch with its exit status; any other way of ending fails the test
    assert (done.returncode == 0) == ("killed" not in plan), done.stderr[-4000:]
    results = {}
    for name, (_, flags) in plan.items():
        output_dir = Path(flags[flags.index("--output_dir") + 1])
        logs = [output_dir.parent / f"run.log{rank}" for rank in (0, 1)]
        run = TwoProcessRun(output_dir, "".join(log.read_text() for log in logs if log.is_file()))
        run.launch = done.stderr[-4000:]
        if (output_dir / "rank1.json").is_file():
            run.weights = load_file(output_dir / "rank0.safetensors")
            run.records = [json.loads((output_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
            for rank in (0, 1):  # the test hooks' files, not the run's
                (output_dir / f"rank{rank}.safetensors").unlink()
                (output_dir / f"rank{rank}.json").unlink()
        results[name] = run
    return results


def trained_on_two_processes(world, combination, run: TwoProcessRun, batches):
    """The model rank 0 held at the end of the row's two-process run, and the run's log; `batches` as above (rank
    0's)."""
    assert run.weights is not None, f"the run did not end:\n{run.launch}"
    records, (_, flags) = run.records, run_flags(world, combination, run.output_dir)
    assert [record["world_size"] for record in records] == [2, 2]
    if "--seq_lens" in flags:  # every step drew one length for both processes: the same batch size, within it
        assert len(records[0]["batches"]) == len(records[1]["batches"]) == 3
        for (images, patches), (other_images, other_patches) in zip(*(record["batches"] for record in records)):
            assert images == other_images and max(patches, other_patches) <= BATCH * 16 // images
    if "--packed_sequence_length" in flags:
        slots = int(flags[flags.index("--packed_sequence_length") + 1])
        batches += [(rows, slots, images) for (rows, _), images in zip(records[0]["batches"], records[0]["images"])]
    config = VisionTransformerConfig.from_pretrained(run.output_dir)
    if combination.adaptation == "full":
        model = VisionTransformerForImageClassification(config)
    else:  # the run's fine-tuning model with the same adapters, to take rank 0's weights
        base = load_for_finetuning(world.sources[combination.source], config.id2label, image_size=config.image_size)
        base.config.problem_type = config.problem_type
        targets = ["qkv"] if combination.adaptation == "qkv" else ["query", "value"]
        model = apply_lora(base, 2, target_modules=targets)
    model.load_state_dict(run.weights)
    return model.eval(), run.log


def test_pairs_that_cannot_go_together_are_refused(world, tmp_path):
    task, flags = run_flags(world, Combination("folder", "full", "multi", "stream"), tmp_path / "out")
    with pytest.raises(ValueError, match="Multi-label data sets are supported without --streaming only"):
        train(task, *parse_args(task, flags))
    task, flags = run_flags(world, Combination("preset", "qkv", "single", "memory"), tmp_path / "out2")
    with pytest.raises(ValueError, match="--lora_rank adapts a pretrained model"):
        train(task, *parse_args(task, flags))


@pytest.mark.parametrize("combination", COMBINATIONS + FAMILY_ROWS, ids=str)
def test_combination(world, combination, tmp_path, caplog, request):
    batches = []
    if combination.processes == 1:
        out = tmp_path / "run"
        in_memory, log = trained_in_memory(combination, *run_flags(world, combination, out), caplog, batches)
    else:
        run = request.getfixturevalue("two_process_runs")[str(combination)]
        out = run.output_dir
        in_memory, log = trained_on_two_processes(world, combination, run, batches)

    # 1. the saved run reloads with the Auto classes and predicts what the trained model predicted
    folder = out
    if combination.adaptation != "full":
        folder = tmp_path / "merged"
        save_merged_model(out, folder, base=world.sources[combination.source])
    reloaded = AutoModelForImageClassification.from_pretrained(folder).eval()
    processor = AutoImageProcessor.from_pretrained(folder)
    test = load_digits_dataset()["test"].select(range(24))  # the test split of both data sets
    # native-aspect batches after --seq_lens or --max_num_patches, packed after --packed_sequence_length
    inputs = processor(list(test["image"]), return_tensors="pt")
    assert ("spatial_shapes" in inputs) == bool({"--seq_lens", "--max_num_patches"} & set(combination.flags))
    assert ("image_slot_index" in inputs) == ("--packed_sequence_length" in combination.flags)
    with torch.no_grad():
        logits = reloaded(**inputs).logits
        torch.testing.assert_close(logits, in_memory(**inputs).logits, atol=1e-4, rtol=1e-4)

    # 2. the reported test metrics are the test split's
    results = json.loads((out / "all_results.json").read_text())
    assert results["eval_split"] == "test"
    if combination.labels == "single":
        labels = torch.tensor(test["label"])
        loss = torch.nn.functional.cross_entropy(logits, labels).item()
        assert results["eval_accuracy"] == compute_metrics((logits.numpy(), labels.numpy()))["accuracy"]
    else:
        names = reloaded.config.label2id
        assert reloaded.config.problem_type == "multi_label_classification"
        targets = torch.zeros(len(test), len(names))
        for row, digit in enumerate(test["label"]):
            for tag in ["even" if digit % 2 == 0 else "odd"] + (["round"] if digit in (0, 6, 8, 9) else []):
                targets[row, names[tag]] = 1
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets).item()
        expected = compute_metrics((logits.numpy(), targets.numpy()))["mean_average_precision"]
        assert results["eval_mean_average_precision"] == pytest.approx(expected, abs=1e-6)
    assert results["test_loss"] == pytest.approx(loss, rel=1e-4, abs=1e-5)

    # 3. no local path in any text file written, but the LoRA run's record of its local base, which stays here (4.)
    for folder_written in {out, folder}:
        for path in folder_written.rglob("*"):
            if path.is_file() and not path.name.endswith(BINARY) and path.name != LOCAL_BASE_FILE:
                text = path.read_text(errors="replace")
                for local in (str(world.root), str(tmp_path), str(out.parent)):
                    assert local not in text, f"{path.name} names {local}"

    # 4. the push plan lists only the project's files
    planned = {item.path_in_repo for item in plan_upload(out, repo_id="someone/matrix")}
    weights = {"model.safetensors"} if combination.adaptation == "full" else {"adapter_model.safetensors"}
    allowed = set(upload_file_names()) | {"model.safetensors", "adapter_model.safetensors", "adapter_config.json"}
    assert planned <= allowed and weights <= planned and {"config.json", "README.md"} <= planned
    assert not planned & {"training_args.bin", "trainer_state.json", LOCAL_BASE_FILE} and set(RESULT_FILES) & planned

    # 5. the logged global batch (with --seq_lens, each length's batch within the 8 x 16 patches' budget; packed in
    # memory, rows of patch slots)
    processes = combination.processes
    packed = "--packed_sequence_length" in combination.flags
    if "--seq_lens" in combination.flags:
        words = f"batches of 32 at 4 patches, 8 at 16 patches per device (128 patches each) x {processes} process(es)"
    elif packed and combination.data == "memory":
        words = f"batch {BATCH} rows of 40 patch slots per device (16.0 images on average) x {processes} process(es)"
        words += f" x 1 accumulation step(s) = global batch {BATCH * processes} rows"
    else:
        words = f"batch {BATCH} per device x {processes} process(es) x 1 accumulation step(s) = global batch "
        words += f"{BATCH * processes}"
    assert words in log

    # and what the packed runs trained on: in memory, a fixed number of tokens (8 rows of 40 slots, as many images as
    # fill them: 16 digits of 16 patches, 2 a row); on a stream, a fixed number of images (8, in rows as they need)
    if packed:
        assert len(batches) == 3
        if combination.data == "memory":
            assert set(batches) == {(BATCH, 40, 16)}
        else:
            assert all(rows <= BATCH and slots == 40 and images == BATCH for rows, slots, images in batches)
            assert "Packed sequences on a stream (whose images' sizes are not known ahead)" in log

    # 6. the recipe that ran, in the log and on the card (the learning rate given here overrides the recipe's)
    if combination.recipe:
        assert f"Training with the recipe {combination.recipe} (" in log
        card = (out / "README.md").read_text()
        assert (
            f"Named recipe {combination.recipe} (" in card and "learning_rate=0.05 (given on the command line)" in card
        )
        assert "RandAugment rand-m9-mstd0.5-inc1" in card and "Mixup alpha 0.8" in card


# ---------------------------------------------------------------------------------------------------------------------
# Rows across a kill: a LoRA run on lengths drawn per step (--seq_lens) killed after a checkpoint resumes to the
# uninterrupted run's weights


def test_killed_lora_run_resumes_to_the_same_weights(world, two_process_runs, tmp_path):
    # two processes (the one-process path is the same code, without the ranks); the uninterrupted run and the killed
    # one ran in the shared launch, the killed one last
    straight, killed = two_process_runs["straight"], two_process_runs["killed"]
    assert straight.weights is not None and killed.weights is None, straight.launch
    assert "Killed at step 5" in killed.log
    folder = killed.output_dir
    assert (folder / "checkpoint-4" / "adapter_model.safetensors").is_file() and not (folder / "checkpoint-6").exists()
    task, flags = resumable_flags(world, folder, "--resume_from_checkpoint", "True")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_CACHE": str(world.cache)}
    command = [*torchrun_command(), str(WORKER), task, *flags]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"Resuming from {folder / 'checkpoint-4'}" in done.stderr and "incomplete" not in done.stderr
    resumed = load_file(folder / "rank0.safetensors")
    assert straight.weights.keys() == resumed.keys() and any("lora_" in k for k in resumed)
    assert all(torch.equal(straight.weights[k], resumed[k]) for k in resumed)


# ---------------------------------------------------------------------------------------------------------------------
# A row with pushes: a LoRA run pushing at every checkpoint, recorded at HfApi's write calls (never the network)


@pytest.mark.parametrize("strategy", ["every_save", "checkpoint"])
def test_lora_run_pushes_its_checkpoints_and_final_model(world, strategy, hub, tmp_path):
    from hf_vit.lora import load_lora_model
    from hf_vit.outputs.push import find_local_path

    combination = Combination("folder", "qkv", "single", "memory")
    out = tmp_path / "run"
    task, flags = run_flags(world, combination, out)
    flags[flags.index("--save_strategy") + 1] = "steps"
    flags[flags.index("--max_steps") + 1] = "2"
    flags += ["--save_steps", "1", "--eval_strategy", "no", "--dataloader_num_workers", "0"]
    flags += ["--push_to_hub", "True", "--hub_model_id", "me/lora", "--hub_strategy", strategy]
    train(task, *parse_args(task, flags))

    adapter = {"adapter_model.safetensors", "adapter_config.json"}
    allowed = set(upload_file_names()) | adapter
    assert len(hub.commits) == 3 and "final model" in hub.commits[-1].message  # two checkpoints, then the end
    for commit in hub.commits[:2]:
        root = {name for name in commit.files if "/" not in name}
        assert adapter | {"config.json", "preprocessor_config.json"} <= root <= allowed - {"README.md"}, root
        nested = {name for name in commit.files if "/" in name}
        if strategy == "checkpoint":
            resume = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"}
            assert {name.removeprefix("last-checkpoint/") for name in nested} == root | resume
        else:
            assert not nested
    final = hub.commits[-1].files
    assert adapter | {"config.json", "README.md", "all_results.json"} <= set(final) <= allowed
    for commit in hub.commits:
        for name, data in commit.files.items():
            assert "training_args.bin" not in name
            if not name.endswith(BINARY):
                text = data.decode()
                assert find_local_path(text) is None and str(tmp_path) not in text, name
    # what was pushed of the last checkpoint is a LoRA checkpoint on its own: the run's model, from its base
    pushed = tmp_path / "pushed"
    pushed.mkdir()
    for name, data in hub.commits[1].files.items():
        if "/" not in name:
            (pushed / name).write_bytes(data)
    model = load_lora_model(pushed, base=world.sources["folder"])
    assert model.config.id2label == VisionTransformerConfig.from_pretrained(out).id2label


# ---------------------------------------------------------------------------------------------------------------------
# The self-supervised objectives (--objective mpp, simmim): from a preset and from an hf-vit folder, in memory and on a
# stream; what they cannot train (LoRA, native-aspect and packed batches, colour augmentations) refused by name, and a
# SimMIM run resumed from its checkpoint ending as the uninterrupted run.

SELF_SUPERVISED_ROWS = [
    ("simmim", Combination("preset", "full", "single", "memory")),
    ("simmim", Combination("folder", "full", "single", "stream")),
    ("mpp", Combination("folder", "full", "single", "memory")),
]


def self_supervised_flags(world, objective, combination, output_dir, *more):
    _, flags = run_flags(world, combination, output_dir)
    return [*flags, "--objective", objective, *more]


@pytest.mark.parametrize("objective,combination", SELF_SUPERVISED_ROWS, ids=lambda row: str(row))
def test_self_supervised_objective(world, objective, combination, tmp_path):
    from transformers import AutoModelForMaskedImageModeling

    from hf_vit import VisionTransformerForMaskedImageModeling, VisionTransformerForMaskedPatchPrediction

    out, keep = tmp_path / "run", KeepModel()
    train("pretrain", *parse_args("pretrain", self_supervised_flags(world, objective, combination, out)), [keep])
    # 1. the folder reloads with AutoModelForMaskedImageModeling as this objective's model, computing what training
    # left in memory on the test images with a mask of its own
    reloaded = AutoModelForMaskedImageModeling.from_pretrained(out).eval()
    kind = (
        VisionTransformerForMaskedImageModeling if objective == "simmim" else VisionTransformerForMaskedPatchPrediction
    )
    assert type(reloaded) is kind and type(keep.model) is kind
    test = load_digits_dataset()["test"].select(range(8))
    pixels = AutoImageProcessor.from_pretrained(out)(list(test["image"]), return_tensors="pt")["pixel_values"]
    mask = torch.rand(8, (SIZE // PATCH) ** 2, generator=torch.Generator().manual_seed(0)) < 0.5
    with torch.no_grad():
        expected = keep.model.eval()(pixels, bool_masked_pos=mask).loss
        torch.testing.assert_close(reloaded(pixels, bool_masked_pos=mask).loss, expected)
    # 2. the test split's loss is reported
    results = json.loads((out / "all_results.json").read_text())
    assert results["eval_split"] == "test" and np.isfinite(results["test_loss"]) and results["test_loss"] > 0
    # 3. no local path in a text file written; 4. the push plan holds the project's files only
    for path in out.rglob("*"):
        if path.is_file() and not path.name.endswith(BINARY):
            assert str(tmp_path) not in path.read_text(errors="replace"), path.name
    planned = {item.path_in_repo for item in plan_upload(out, repo_id="someone/matrix")}
    assert planned <= set(upload_file_names()) | {"model.safetensors"} and {"config.json", "README.md"} <= planned
    card = (out / "README.md").read_text()
    assert ("SimMIM" if objective == "simmim" else "masked patch prediction") in card and "Classes:" not in card


@pytest.mark.parametrize(
    "more,refusal",
    [
        (("--lora_rank", "2"), "--lora_rank adapts a pretrained model"),
        (("--max_num_patches", "16"), "--max_num_patches .* trains the classification objectives"),
        (PACKED, "--packed_sequence_length with --objective simmim"),
        (("--mixup_alpha", "0.8"), "--mixup_alpha"),
    ],
)
def test_what_simmim_cannot_train_is_refused_by_name(world, more, refusal, tmp_path):
    flags = self_supervised_flags(world, "simmim", Combination("preset", "full", "single", "memory"), tmp_path, *more)
    with pytest.raises(ValueError, match=refusal):
        train("pretrain", *parse_args("pretrain", flags))


def test_a_simmim_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_run(world, tmp_path):
    import shutil

    extra = ("--save_strategy", "steps", "--save_steps", "2", "--save_total_limit", "5")
    extra += ("--dataloader_num_workers", "0")
    combination = Combination("preset", "full", "single", "memory")

    def train_here(output_dir, *more):
        flags = self_supervised_flags(world, "simmim", combination, output_dir, *extra, *more)
        flags[flags.index("--max_steps") + 1] = "4"
        train("pretrain", *parse_args("pretrain", flags))

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_here(straight)
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    train_here(resumed, "--resume_from_checkpoint", "True")
    first, again = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
