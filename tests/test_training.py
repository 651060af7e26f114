"""Pretraining and fine-tuning with Trainer: recipes, the fine-tuning hand-over, resumption and distribution."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from hf_vit import VisionTransformerConfig, VisionTransformerForImageClassification
from hf_vit.data import CorruptImageError
from hf_vit.resolution import resample_position_embeddings
from hf_vit.training import last_complete_checkpoint, load_for_finetuning, parse_args, train

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
    with caplog.at_level("INFO", logger="hf_vit.training"):
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


def test_last_complete_checkpoint_skips_half_written_ones(tmp_path):
    for step, complete in ((5, True), (10, True), (15, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")
    assert last_complete_checkpoint(tmp_path / "missing") is None


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
    assert f"{results['eval_accuracy']:.4f}" in card and "base_model:" in card


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


def test_distributed_two_processes_match_one(tmp_path):
    source = pretrained_folder(tmp_path / "pre")
    two = tmp_path / "two"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533"]
    done = run(torchrun + [str(WORKER)] + deterministic_finetune_args(source, two, 8, extra=["--save_strategy", "no"]))
    assert "find_unused_parameters=True was specified" not in done.stderr  # DDP does not search for unused params
    info = [json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [i["world_size"] for i in info] == [2, 2] and [i["rank"] for i in info] == [0, 1]
    rank0, rank1 = load_file(two / "rank0.safetensors"), load_file(two / "rank1.safetensors")
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)  # DDP keeps the replicas identical

    one = tmp_path / "one"
    run([sys.executable, str(WORKER)] + deterministic_finetune_args(source, one, 16, extra=["--save_strategy", "no"]))
    single = load_file(one / "rank0.safetensors")
    start = load_for_finetuning(str(source), {i: str(i) for i in range(10)}, image_size=8).state_dict()
    moved = max((single[k] - start[k]).abs().max().item() for k in single)
    worst = max((single[k] - rank0[k]).abs().max().item() for k in single)
    print(f"2 processes x 8 vs 1 x 16: max weight difference {worst:.2e} (weights moved up to {moved:.2e})")
    assert moved > 1e-3 and worst < 1e-4


def test_killed_run_resumes_to_the_same_weights(tmp_path):
    source = pretrained_folder(tmp_path / "pre")
    # Augmentation on: resuming must also restore the random state of the crops.
    extra = [
        "--save_strategy",
        "steps",
        "--save_steps",
        "4",
        "--random_resized_crop",
        "True",
        "--crop_scale_min",
        "0.5",
    ]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run([sys.executable, str(WORKER)] + deterministic_finetune_args(source, straight, 16, max_steps=10, extra=extra))
    run(
        [sys.executable, str(WORKER)]
        + deterministic_finetune_args(source, killed, 16, max_steps=10, extra=extra + ["--kill_at_step", "6"]),
        expect=17,
    )
    assert (killed / "checkpoint-4").is_dir() and not (killed / "rank0.safetensors").exists()
    # What a kill during a save leaves behind: a newer checkpoint without its trainer state.
    shutil.copytree(killed / "checkpoint-4", killed / "checkpoint-6")
    (killed / "checkpoint-6" / "trainer_state.json").unlink()
    resumed = run(
        [sys.executable, str(WORKER)]
        + deterministic_finetune_args(
            source, killed, 16, max_steps=10, extra=extra + ["--resume_from_checkpoint", "True"]
        )
    )
    assert "checkpoint-6" in resumed.stderr  # named as skipped
    a, b = load_file(straight / "rank0.safetensors"), load_file(killed / "rank0.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_accelerate_launch_with_the_shipped_cpu_config(tmp_path):
    out = tmp_path / "out"
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    accelerate += [str(ROOT / "configs" / "accelerate" / "cpu.yaml"), "--main_process_port", "29534"]
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
