"""Pretraining and fine-tuning with Trainer: recipes, the fine-tuning hand-over, resumption and distribution."""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import free_port, keep_weights
from PIL import Image
from safetensors.torch import load_file

from hf_vit import (
    VisionTransformerConfig,
    VisionTransformerForImageClassification,
    VisionTransformerImageProcessor,
    VisionTransformerModel,
)
from hf_vit.data.transforms import CorruptImageError
from hf_vit.model.resolution import resample_position_embeddings
from hf_vit.tasks.model_setup import load_checkpoint as load_for_finetuning
from hf_vit.train.arguments import parse_args
from hf_vit.train.training import train

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "train_worker.py"
TINY = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64"
QUIET = ["--disable_tqdm", "True", "--report_to", "none", "--dataloader_num_workers", "0"]


def pretrained_folder(path, image_size=8, seed=0):
    config = VisionTransformerConfig(
        image_size=image_size,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        representation_size=32,
        num_labels=10,
        zero_init_head=False,
    )
    torch.manual_seed(seed)
    VisionTransformerForImageClassification(config).save_pretrained(path)
    return path


def test_recipes_are_the_papers_and_overridable(tmp_path):
    _, _, pre = parse_args("pretrain", ["--output_dir", str(tmp_path)])
    assert (pre.optim, pre.adam_beta1, pre.adam_beta2, pre.weight_decay) == ("adamw_torch", 0.9, 0.999, 0.1)
    assert pre.lr_scheduler_type == "linear" and pre.warmup_steps > 0 and pre.max_grad_norm == 1.0
    _, _, fine = parse_args("finetune", ["--output_dir", str(tmp_path), "--learning_rate", "0.03"])
    assert (fine.optim, fine.optim_args, fine.weight_decay) == ("sgd", "momentum=0.9", 0.0)
    assert fine.lr_scheduler_type == "cosine" and fine.max_grad_norm == 1.0 and fine.learning_rate == 0.03
    _, _, other = parse_args(
        "finetune", ["--output_dir", str(tmp_path), "--optim", "adamw_torch", "--weight_decay", "0.05"]
    )
    assert (other.optim, other.weight_decay) == ("adamw_torch", 0.05)


def test_finetuning_model_replaces_the_head_and_resamples_positions(tmp_path, caplog):
    source_path = pretrained_folder(tmp_path / "pre")
    source = VisionTransformerForImageClassification.from_pretrained(source_path)
    id2label = {0: "a", 1: "b", 2: "c"}
    with caplog.at_level("INFO", logger="hf_vit"):
        model = load_for_finetuning(str(source_path), id2label, image_size=16)
    assert "position embeddings resampled (bicubic) from a 2x2 to a 4x4 grid" in caplog.text
    assert "New zero-initialised classifier for 3 classes" in caplog.text
    assert model.config.image_size == 16 and model.config.representation_size is None
    assert model.pre_logits is None and model.config.id2label == id2label
    assert torch.count_nonzero(model.classifier.weight) == 0  # a new zero-initialised head
    expected = resample_position_embeddings(source.vit.embeddings.position_embedding, (2, 2), (4, 4))
    torch.testing.assert_close(model.vit.embeddings.position_embedding, expected)
    torch.testing.assert_close(model.vit.layers[1].mlp.fc2.weight, source.vit.layers[1].mlp.fc2.weight)
    model(torch.randn(1, 3, 16, 16))  # runs at the new size without interpolate_pos_encoding


def test_pretrain_then_finetune_in_process(tmp_path):
    pre_dir, fine_dir = tmp_path / "pre", tmp_path / "fine"
    common = QUIET + ["--per_device_train_batch_size", "32", "--per_device_eval_batch_size", "128"]
    common += ["--eval_strategy", "no", "--save_strategy", "no", "--crop_scale_min", "0.8"]
    pre_args = ["--output_dir", str(pre_dir), "--image_size", "8", "--patch_size", "4", "--config_overrides", TINY]
    metrics = train("pretrain", *parse_args("pretrain", pre_args + common + ["--max_steps", "60"]))
    assert metrics["eval_split"] == "test" and 0 <= metrics["eval_accuracy"] <= 1
    pre = VisionTransformerForImageClassification.from_pretrained(pre_dir)
    assert pre.config.representation_size == 32  # the paper pretrains with a pre-logits layer
    fine_args = ["--output_dir", str(fine_dir), "--model_name_or_path", str(pre_dir), "--image_size", "12"]
    metrics = train(
        "finetune", *parse_args("finetune", fine_args + common + ["--max_steps", "60", "--learning_rate", "0.05"])
    )
    files = {p.name for p in fine_dir.iterdir()}
    assert {"model.safetensors", "config.json", "preprocessor_config.json", "README.md"} <= files
    assert {"all_results.json", "training_curves.png", "modeling_vit.py"} <= files
    assert not any(name.endswith((".bin", ".pt", ".pth")) and name != "training_args.bin" for name in files)
    results = json.loads((fine_dir / "all_results.json").read_text())
    assert results["eval_accuracy"] == pytest.approx(metrics["eval_accuracy"])
    assert results["eval_accuracy"] > 0.3  # well above chance (0.1) after 120 tiny steps
    fine = VisionTransformerForImageClassification.from_pretrained(fine_dir)
    assert fine.config.image_size == 12 and fine.config.id2label[3] == "3"
    card = (fine_dir / "README.md").read_text()
    assert f"{results['eval_accuracy']:.4f}" in card
    # the base model was a local folder: named by its folder name in the text, kept out of the Hub metadata
    assert "base_model:" not in card and "Base model: `pre`" in card and str(tmp_path) not in card
    assert "finetune: optimizer sgd (momentum=0.9)" in card and "cosine schedule" in card  # values, not enum reprs


def image_folder(root, corrupt=False):
    rng = np.random.default_rng(0)
    for label, colour in (("cat", 40), ("dog", 200)):
        (root / label).mkdir(parents=True)
        for i, (size, mode) in enumerate([((10, 14), "RGB"), ((9, 9), "L"), ((16, 12), "RGBA"), ((12, 12), "P")] * 3):
            pixels = np.clip(rng.normal(colour, 20, (*size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).convert(mode).save(root / label / f"{i}.png")
    if corrupt:
        (root / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    return root


def test_string_labels_and_mixed_images_train_and_name_their_classes(tmp_path):
    data = image_folder(tmp_path / "data")
    args = ["--output_dir", str(tmp_path / "out"), "--dataset_name", str(data), "--image_size", "8"]
    args += ["--patch_size", "4", "--config_overrides", TINY, "--max_steps", "4", "--per_device_train_batch_size", "8"]
    train("pretrain", *parse_args("pretrain", args + QUIET + ["--eval_strategy", "no", "--save_strategy", "no"]))
    config = VisionTransformerConfig.from_pretrained(tmp_path / "out")
    assert config.id2label == {0: "cat", 1: "dog"} and config.label2id == {"cat": 0, "dog": 1}


def test_corrupt_image_fails_naming_the_file(tmp_path):
    data = image_folder(tmp_path / "data", corrupt=True)
    args = ["--output_dir", str(tmp_path / "out"), "--dataset_name", str(data), "--image_size", "8"]
    args += [
        "--patch_size",
        "4",
        "--config_overrides",
        TINY,
        "--max_steps",
        "30",
        "--per_device_train_batch_size",
        "32",
    ]
    with pytest.raises(CorruptImageError, match="broken.png"):
        train("pretrain", *parse_args("pretrain", args + QUIET + ["--eval_strategy", "no", "--save_strategy", "no"]))


@pytest.mark.parametrize(
    "flags, error, match",
    [
        (["--dataset_name", "no/such-dataset-anywhere"], Exception, "no/such-dataset-anywhere"),
        (["--label_column_name", "category"], ValueError, "category"),
        (["--streaming", "True"], ValueError, "max_steps"),
        (["--image_size", "10", "--patch_size", "4"], ValueError, "image_size"),
    ],
)
def test_bad_training_input_gets_clear_errors(tmp_path, flags, error, match):
    args = ["--output_dir", str(tmp_path), "--config_overrides", TINY, "--image_size", "8", "--patch_size", "4"]
    with pytest.raises(error, match=match):
        train("pretrain", *parse_args("pretrain", args + QUIET + flags))


def test_finetuning_needs_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="model_name_or_path"):
        train("finetune", *parse_args("finetune", ["--output_dir", str(tmp_path)] + QUIET))


def run(cmd, env_extra=None, expect=0):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == expect, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def deterministic_finetune_args(source, output_dir, per_device_batch, max_steps=8, extra=()):
    # No augmentation, no dropout, and 16 training images: with a global batch of 16 every step sees all of them, so
    # one process and two (8 each) must compute the same mean gradient whatever order the samplers draw in.
    return [
        "finetune",
        "--max_train_samples", "16",
        "--model_name_or_path", str(source),
        "--output_dir", str(output_dir),
        "--image_size", "8",
        "--random_resized_crop", "False",
        "--per_device_train_batch_size", str(per_device_batch),
        "--max_steps", str(max_steps),
        "--eval_strategy", "no",
        "--learning_rate", "0.05",
        "--seed", "3",
        *QUIET,
        *extra,
    ]  # fmt: skip


def train_in_one_thread(args, caplog=None):
    """`train` in this process on one torch thread, as a worker process trains; returns the weights it ended with."""
    keep, threads = keep_weights(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with caplog.at_level("WARNING", logger="hf_vit") if caplog else contextlib.nullcontext():
            train(args[0], *parse_args(args[0], args[1:]), callbacks=[keep])
    finally:
        torch.set_num_threads(threads)
    return keep.weights


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """An uninterrupted run with augmentation, dropout, a patch size per step and per-epoch evaluation, and the flags
    that made it: 32 images in batches of 8 (4 steps an epoch), a checkpoint every 2 steps (mid-epoch, and at epoch
    ends right before the epoch's evaluation)."""
    root = tmp_path_factory.mktemp("resume")
    source = pretrained_folder(root / "pre")
    extra = ["--save_strategy", "steps", "--save_steps", "2", "--eval_strategy", "epoch"]
    extra += ["--random_resized_crop", "True", "--crop_scale_min", "0.5", "--hidden_dropout_prob", "0.1"]
    extra += ["--patch_sizes", "2,4,8"]  # FlexiViT: a patch size drawn per step, the same after resuming

    def flags(output_dir, *more):
        args = deterministic_finetune_args(source, output_dir, 8, max_steps=10, extra=extra + list(more))
        i = args.index("--max_train_samples")
        return args[: i + 1] + ["32"] + args[i + 2 :]

    return root, flags, train_in_one_thread(flags(root / "straight"))


@pytest.mark.parametrize("kill_at, resumed_from", [(7, "checkpoint-6"), (5, "checkpoint-4")])
def test_killed_run_resumes_to_the_same_weights(resume_runs, kill_at, resumed_from, caplog):
    # checkpoint-6 is mid-epoch (the first batch after resuming was drawn before the random state was restored);
    # checkpoint-4 ends an epoch right before its evaluation (which used to consume the training's random numbers).
    # The killed run dies in its own process; the uninterrupted and the resumed runs train in this one.
    root, flags, straight = resume_runs
    killed = root / f"killed-{kill_at}"
    run([sys.executable, str(WORKER)] + flags(killed, "--kill_at_step", str(kill_at)), expect=17)
    assert (killed / resumed_from).is_dir() and not (killed / "rank0.safetensors").exists()
    # What a kill during a save leaves behind: a newer checkpoint without its trainer state.
    shutil.copytree(killed / resumed_from, killed / "checkpoint-99")
    (killed / "checkpoint-99" / "trainer_state.json").unlink()
    again = train_in_one_thread(flags(killed, "--resume_from_checkpoint", "True"), caplog)
    assert "checkpoint-99" in caplog.text  # named as skipped
    assert all(torch.equal(straight[k], again[k]) for k in straight), max(
        (straight[k] - again[k]).abs().max().item() for k in straight
    )


def test_resuming_mid_epoch_keeps_dropout_as_the_uninterrupted_run(tmp_path):
    """Resumed from a mid-epoch checkpoint, a run with dropout (drawn from torch's global generator) ends bit for bit
    as the uninterrupted run, through the next epoch, on Trainer's own data loader with persistent workers (its first
    pass draws their seed from that generator, and a resumed run makes its first pass an epoch later). Both runs
    train in this process, one torch thread."""
    source = pretrained_folder(tmp_path / "pre")
    extra = ["--save_strategy", "steps", "--save_steps", "3", "--save_total_limit", "5"]
    extra += ["--hidden_dropout_prob", "0.1", "--dataloader_num_workers", "1"]  # persistent workers, as by default

    def train_here(output_dir, *more):  # 16 images in batches of 4: 4 steps an epoch; checkpoint-3 is mid-epoch
        train_in_one_thread(deterministic_finetune_args(source, output_dir, 4, max_steps=8, extra=extra + list(more)))

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_here(straight)
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-3", resumed / "checkpoint-3")
    train_here(resumed, "--resume_from_checkpoint", "True")
    first, again = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(first[k], again[k]) for k in first), max(
        (first[k] - again[k]).abs().max().item() for k in first
    )


def test_accelerate_launch_with_the_shipped_cpu_config(tmp_path):
    out = tmp_path / "out"
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    accelerate += [str(ROOT / "configs" / "accelerate" / "cpu.yaml"), "--main_process_port", str(free_port())]
    args = ["pretrain", "--output_dir", str(out), "--image_size", "8", "--patch_size", "4", "--config_overrides", TINY]
    args += [
        "--max_steps",
        "2",
        "--eval_strategy",
        "no",
        "--save_strategy",
        "no",
        "--per_device_train_batch_size",
        "8",
    ]
    run(accelerate + [str(WORKER)] + args + QUIET)
    info = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(i["rank"], i["world_size"], i["args_world_size"]) for i in info] == [(0, 2, 2), (1, 2, 2)]


# --- Tiny runs and data sets (the edges' tests in test_training_edges.py, and other files, use them too) ---------

TINY_RUN = ["--image_size", "8", "--patch_size", "4", "--config_overrides", TINY, "--per_device_train_batch_size", "8"]


def tiny_pretrain(output_dir, *flags):
    args = ["--output_dir", str(output_dir), *TINY_RUN, "--max_steps", "2", "--eval_strategy", "no"]
    return parse_args("pretrain", args + ["--save_strategy", "no", "--max_train_samples", "16", *QUIET, *flags])


def split_image_folder(root, broken_split=None):
    for split in ("train", "test"):
        for label in ("cat", "dog"):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (8, 8), (40 * i, 200 if label == "dog" else 0, 0)).save(folder / f"{i}.png")
    if broken_split:
        (root / broken_split / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    return root


def labelled_dataset(path, names, splits):
    from datasets import ClassLabel, Dataset, DatasetDict, Features
    from datasets import Image as ImageFeature

    features = Features({"image": ImageFeature(), "label": ClassLabel(names=names)})
    image = Image.new("RGB", (8, 8), (10, 20, 30))
    DatasetDict(
        {
            split: Dataset.from_dict({"image": [image] * len(labels), "label": labels}, features=features)
            for split, labels in splits.items()
        }
    ).save_to_disk(str(path))
    return path


def multi_label_dataset(path):
    """Digits with a list of classes each: its parity, and "round" for 0, 6, 8, 9 (some images have both)."""
    from datasets import Dataset, DatasetDict

    from hf_vit.data.datasets import load_digits_dataset

    digits = load_digits_dataset()
    splits = {}
    for split, size in (("train", 96), ("validation", 32), ("test", 48)):
        rows = digits[split].select(range(size))
        labels = [["even" if d % 2 == 0 else "odd"] + (["round"] if d in (0, 6, 8, 9) else []) for d in rows["label"]]
        splits[split] = Dataset.from_dict({"image": list(rows["image"]), "tags": labels})
    DatasetDict(splits).save_to_disk(str(path))
    return path


# --- Combined features: what each run reports and what it saves ------------------------------------------------------


def test_the_test_metrics_are_the_test_splits_with_persistent_workers(tmp_path):
    """With the scripts' default persistent data-loader workers, Trainer caches the validation loader and handed it
    back for the test split: the reported test metrics were the validation's."""
    from hf_vit.data.datasets import load_digits_dataset
    from hf_vit.metrics import compute_metrics

    out = tmp_path / "out"
    args = ["--output_dir", str(out), *TINY_RUN, "--max_steps", "4", "--eval_strategy", "steps", "--eval_steps", "2"]
    args += ["--save_strategy", "no", "--max_train_samples", "64", "--learning_rate", "0.01"]
    args += ["--disable_tqdm", "True", "--dataloader_num_workers", "1", "--dataloader_persistent_workers", "True"]
    metrics = train("pretrain", *parse_args("pretrain", args))
    assert metrics["eval_split"] == "test"
    model = VisionTransformerForImageClassification.from_pretrained(out).eval()
    processor = VisionTransformerImageProcessor.from_pretrained(out)
    test = load_digits_dataset()["test"]
    pixels = processor(list(test["image"]), return_tensors="pt").pixel_values
    labels = torch.tensor(test["label"])
    with torch.no_grad():
        logits = model(pixels).logits
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    assert metrics["test_loss"] == pytest.approx(loss, abs=1e-4)
    assert metrics["eval_accuracy"] == compute_metrics((logits.numpy(), labels.numpy()))["accuracy"]
    last_validation = [
        entry["eval_loss"]
        for entry in json.loads((out / "trainer_state.json").read_text())["log_history"]
        if "eval_loss" in entry
    ]
    assert metrics["test_loss"] != last_validation[-1]


def test_a_streamed_run_says_what_it_knows_in_its_set_up_line(tmp_path, caplog):
    with caplog.at_level("INFO", logger="hf_vit"):
        train("pretrain", *tiny_pretrain(tmp_path / "out", "--streaming", "True"))
    line = next(line for line in caplog.text.splitlines() if "Run set-up" in line)
    assert "unknown (streamed) training examples, unknown (streamed) epochs" in line and "e+18" not in line
    assert "global batch 8, 2 optimisation steps" in line


@pytest.mark.parametrize("channels", [1, 4])
def test_one_and_four_channel_models_train_from_the_command_line(tmp_path, channels):
    if channels == 1:
        data = "digits"  # grey images
    else:
        data = tmp_path / "rgba"
        rng = np.random.default_rng(0)
        for label in ("a", "b"):
            (data / label).mkdir(parents=True)
            for i in range(8):
                Image.fromarray(rng.integers(0, 255, (8, 8, 4), dtype=np.uint8), "RGBA").save(
                    data / label / f"{i}.png"
                )
    out = tmp_path / "out"
    train("pretrain", *tiny_pretrain(out, "--dataset_name", str(data), "--num_channels", str(channels)))
    model = VisionTransformerForImageClassification.from_pretrained(out)
    processor = VisionTransformerImageProcessor.from_pretrained(out)
    assert model.config.num_channels == channels and processor.do_convert_rgb is False
    assert len(processor.image_mean) == channels
    image = Image.new("L" if channels == 1 else "RGBA", (8, 8))
    assert processor(image, return_tensors="pt").pixel_values.shape == (1, channels, 8, 8)
    # fine-tuning goes on with the checkpoint's channels
    fine = ["--output_dir", str(tmp_path / "fine"), "--model_name_or_path", str(out), "--dataset_name", str(data)]
    fine += ["--max_steps", "2", "--eval_strategy", "no", "--save_strategy", "no", "--max_train_samples", "16", *QUIET]
    train("finetune", *parse_args("finetune", fine))
    assert VisionTransformerForImageClassification.from_pretrained(tmp_path / "fine").config.num_channels == channels


def test_fine_tuning_at_another_patch_size_resamples_the_checkpoint(tmp_path):
    source = pretrained_folder(tmp_path / "pre")
    args = ["--output_dir", str(tmp_path / "out"), "--model_name_or_path", str(source), "--learning_rate", "0"]
    args += ["--max_steps", "1", "--eval_strategy", "no", "--save_strategy", "no", "--max_train_samples", "8"]
    with pytest.raises(ValueError, match="--model_name_or_path .* not divisible by the patch size 3"):
        train("finetune", *parse_args("finetune", args + ["--patch_size", "3", *QUIET]))
    with pytest.raises(ValueError, match=r"cannot take num_hidden_layers=3 \(the checkpoint has 2\)"):
        train("finetune", *parse_args("finetune", args + ["--config_overrides", "num_hidden_layers=3", *QUIET]))
    train("finetune", *parse_args("finetune", args + ["--patch_size", "2", *QUIET]))
    tuned = VisionTransformerModel.from_pretrained(tmp_path / "out").eval()
    expected = VisionTransformerModel.from_pretrained(source, patch_size=2).eval()  # learning rate 0: as resampled
    assert tuned.config.patch_size == 2 and tuned.config.grid_size == (4, 4)
    assert VisionTransformerImageProcessor.from_pretrained(tmp_path / "out").size == {"height": 8, "width": 8}
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(tuned(x).last_hidden_state, expected(x).last_hidden_state, atol=1e-6, rtol=0)


def test_a_validation_split_without_positive_labels_does_not_stop_a_multi_label_run(tmp_path):
    from datasets import Dataset, DatasetDict

    from hf_vit.data.datasets import load_digits_dataset

    digits = load_digits_dataset()
    splits = {}
    for split, size in (("train", 32), ("validation", 8), ("test", 8)):
        rows = digits[split].select(range(size))
        tags = [["odd"] if d % 2 else [] for d in rows["label"]] if split == "train" else [[] for _ in range(size)]
        if split == "train":
            tags[0] = ["odd", "even"]
        splits[split] = Dataset.from_dict({"image": list(rows["image"]), "tags": tags})
    DatasetDict(splits).save_to_disk(str(tmp_path / "tags"))
    args = ["--output_dir", str(tmp_path / "out"), *TINY_RUN, "--dataset_name", str(tmp_path / "tags")]
    args += ["--label_column_name", "tags", "--num_train_epochs", "2", "--save_strategy", "no", *QUIET]
    metrics = train("pretrain", *parse_args("pretrain", args))
    assert np.isnan(metrics["eval_mean_average_precision"]) and "eval_f1_micro" in metrics
    assert (tmp_path / "out" / "model.safetensors").exists()


# --- The run's structure ---------------------------------------------------------------------------------------------

RUN_MODULES = (
    "train/training", "train/arguments", "tasks/objectives", "tasks/model_setup", "train/lora", "train/trainer",
    "train/checkpoints", "train/evaluation", "tasks/mpp", "data/datasets", "data/transforms",
)  # fmt: skip


def _relative_imports(module: str) -> list[tuple[str, list[str], bool]]:
    """(imported module, names, at module level) for each relative import of `hf_vit/<module>` that names another
    module of hf_vit's stage packages (data, tasks, train, infer), as `<package>/<module>`."""
    import ast

    path = ROOT / "hf_vit" / f"{module}.py"
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    found = []
    package = module.split("/")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level in (1, 2) and node.module:
            parts = node.module.split(".")
            target = f"{package}/{parts[0]}" if node.level == 1 else "/".join(parts[:2])
            found.append((target, [alias.name for alias in node.names], id(node) in top))
    return found


def test_the_runs_modules_form_no_import_cycle_and_share_no_private_names():
    graph = {module: set() for module in RUN_MODULES}
    for module in RUN_MODULES:
        for imported, names, _ in _relative_imports(module):
            private = [name for name in names if name.startswith("_")]
            assert not private, f"hf_vit/{module} imports the private {private} of hf_vit/{imported}"
            if imported in graph:
                graph[module].add(imported)  # deferred imports count too: a cycle is a cycle
    visiting, done = set(), set()

    def visit(module, path):
        assert module not in visiting, "import cycle: " + " -> ".join([*path, module])
        if module in done:
            return
        visiting.add(module)
        for imported in sorted(graph[module]):
            visit(imported, [*path, module])
        visiting.discard(module)
        done.add(module)

    for module in RUN_MODULES:
        visit(module, [])
    training_lines = len((ROOT / "hf_vit" / "train" / "training.py").read_text().splitlines())
    assert training_lines <= 450
    # no branch on the objective outside the table
    for module in RUN_MODULES:
        if module != "tasks/objectives":
            source = (ROOT / "hf_vit" / f"{module}.py").read_text()
            assert ".objective ==" not in source and '"mpp" if' not in source, module


def test_a_run_keeps_only_its_last_checkpoint_unless_asked(tmp_path):
    """A checkpoint per epoch on a tiny data set filled a disk (three times the model each, optimiser included): by
    default a run keeps its last one, enough to resume."""
    out = tmp_path / "out"
    train("pretrain", *tiny_pretrain(out, "--save_strategy", "steps", "--save_steps", "1", "--max_steps", "3"))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--lora_alpha", "16"], ["--lora_alpha"]),
        (["--lora_dropout", "0.1", "--lora_target_modules", "fc1"], ["--lora_dropout", "--lora_target_modules"]),
        (["--shuffle_buffer_size", "10"], ["--shuffle_buffer_size"]),
        (["--no_random_resized_crop", "--crop_scale_min", "0.5"], ["--crop_scale_min"]),
    ],
)
def test_flags_without_effect_get_one_warning_line_naming_them(tmp_path, caplog, flags, named):
    args = ["--output_dir", str(tmp_path / "out"), "--model_name_or_path", str(tmp_path / "pre"), *flags, *QUIET]
    with caplog.at_level("WARNING", logger="hf_vit"):
        parse_args("finetune", args)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "\n" not in warned[0] and "no effect" in warned[0], warned
    assert all(flag in warned[0] for flag in named)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--keep_head", "True", "--representation_size", "16"], "--representation_size asks for a new one"),
        (["--preset", "vit-base-patch16-224"], "--preset vit-base-patch16-224 names an architecture to pretrain"),
    ],
)
def test_finetuning_refuses_model_flags_it_cannot_honour(tmp_path, flags, message):
    args = ["--output_dir", str(tmp_path / "out"), "--model_name_or_path", str(tmp_path / "pre"), *flags, *QUIET]
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_args("finetune", args)


def test_interpolation_without_a_resampling_gets_one_warning_line(tmp_path, caplog):
    source = str(pretrained_folder(tmp_path / "pre"))
    with caplog.at_level("WARNING", logger="hf_vit"):
        load_for_finetuning(source, {0: "a", 1: "b"}, interpolation="bilinear")  # the checkpoint's own size
        load_for_finetuning(source, {0: "a", 1: "b"}, image_size=16, interpolation="bilinear")  # resampled
        load_for_finetuning(source, {0: "a", 1: "b"})  # not given
        parse_args("pretrain", ["--output_dir", str(tmp_path / "out"), "--interpolation", "bilinear", *QUIET])
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and all("--interpolation" in line and "no effect" in line for line in warned), warned
    assert "keeps" in warned[0] and "(8x8, patch 4)" in warned[0] and "from scratch" in warned[1]


def test_a_preset_at_a_resolution_the_paper_does_not_use_gets_one_warning_line(caplog):
    from hf_vit.tasks.model_setup import ModelSettings, config_from_preset

    with caplog.at_level("WARNING", logger="hf_vit"):
        assert config_from_preset(ModelSettings(preset="vit-tiny-patch16-32")).image_size == 32  # a typo of 320?
        config_from_preset(ModelSettings(preset="vit-tiny-patch16-384"))
        config_from_preset(ModelSettings(preset="vit-tiny-patch16-32", image_size=[64]))  # a size given on purpose
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "--preset vit-tiny-patch16-32 builds the model at 32x32, a resolution the paper does not use" in line


def test_flags_with_effect_are_not_warned_about(tmp_path, caplog):
    args = ["--output_dir", str(tmp_path / "out"), "--model_name_or_path", str(tmp_path / "pre"), *QUIET]
    with caplog.at_level("WARNING", logger="hf_vit"):
        parse_args("finetune", args + ["--lora_rank", "2", "--lora_alpha", "4", "--crop_scale_min", "0.5"])
        parse_args("finetune", args + ["--streaming", "True", "--max_steps", "2", "--shuffle_buffer_size", "10"])
        parse_args("pretrain", args + ["--keep_head", "--representation_size", "16"])
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--objective", "mpp", "--representation_size", "16", "--problem_type", "multi_label_classification"],
         ["--representation_size", "--problem_type"]),
        (["--objective", "mpp", "--keep_head"], ["--keep_head"]),
        (["--keep_head"], ["--keep_head"]),  # from scratch: no checkpoint's head to keep
    ],
)  # fmt: skip
def test_pretraining_flags_without_effect_get_one_warning_line_naming_them(tmp_path, caplog, flags, named):
    with caplog.at_level("WARNING", logger="hf_vit"):
        train("pretrain", *tiny_pretrain(tmp_path / "out", *flags))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "no effect" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0] and all(flag in warned[0] for flag in named), warned
    if "mpp" in flags:  # saved without a pre-logits layer whatever --representation_size said
        assert json.loads((tmp_path / "out" / "config.json").read_text())["representation_size"] is None
