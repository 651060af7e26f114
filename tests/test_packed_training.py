"""Training and serving with packed sequences (`--packed_sequence_length`): the collator packs each batch's
native-aspect images as the processor does, a packed step is the padded step, and a run's folder serves packed
batches with the predictions of unpacked ones."""

import json
import re
import sys

import numpy as np
import pytest
import torch
from conftest import tiny_config
from PIL import Image
from test_inference import aspect_image_folder, native_scores
from test_training import QUIET, pretrained_folder
from torch.nn import functional as F
from transformers import TrainerCallback

from hf_vit import VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.commands import evaluate as evaluate_command
from hf_vit.data.augment.train_transform import make_train_transform
from hf_vit.data.transforms import collate_fn, make_eval_transform
from hf_vit.infer.predict import predict_files
from hf_vit.train.arguments import parse_args
from hf_vit.train.training import train

SIZES = [(8, 8), (8, 24), (30, 10), (12, 20), (5, 40), (16, 12), (20, 20)]


def pixels(sizes=SIZES, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for height, width in sizes]


def examples(transform, images, labels):
    """The transform's examples one at a time, as Trainer's data loader fetches them."""
    fetched = []
    for image, label in zip(images, labels):
        batch = transform({"image": [image], "label": [label]})
        fetched.append({name: value[0] for name, value in batch.items()})
    return fetched


def test_the_collator_packs_a_batch_as_the_processor_does():
    processor = VisionTransformerImageProcessor(size=8, max_num_patches=6, patch_size=4, packed_sequence_length=9)
    images = pixels()
    # the evaluation transform gives one image per example (rows are a batch's), the collator packs them
    batch = collate_fn(examples(make_eval_transform(processor), images, range(len(images))), packed_sequence_length=9)
    expected = processor(images, return_tensors="pt")
    assert set(batch) == {*expected, "labels"}
    for name, value in expected.items():
        torch.testing.assert_close(batch[name], value, rtol=0, atol=0)
    assert batch["labels"].tolist() == list(range(len(images)))  # one label per image, in the images' order
    assert next(iter(batch)) == "spatial_shapes"  # Trainer counts a batch's examples by its first tensor
    assert batch["pixel_values"].shape[0] < len(images)  # several images to a row
    with pytest.raises(ValueError, match="packed_sequence_length"):
        collate_fn([{"pixel_values": torch.zeros(3, 8, 8)}], packed_sequence_length=9)


def test_a_packed_training_step_is_the_padded_step():
    # the classifier's own loss on per-image logits, and its gradients: packing moves tokens, nothing else
    config = tiny_config(image_size=8, patch_size=4, num_labels=3, zero_init_head=False)
    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(config)
    processor = VisionTransformerImageProcessor(size=8, max_num_patches=6, patch_size=4)
    transform = make_train_transform(processor, scale=(0.5, 1.0), seed=0)
    fetched = examples(transform, pixels(), [0, 1, 2, 0, 1, 2, 0])
    losses, grads = [], []
    for length in (None, 6, 13):
        model.zero_grad()
        loss = model(**collate_fn(fetched, packed_sequence_length=length)).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    for loss, grad in zip(losses[1:], grads[1:]):
        torch.testing.assert_close(loss, losses[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(grad, grads[0], rtol=1e-4, atol=1e-5)


def test_token_dropping_keeps_a_share_of_each_images_patches_and_packs_only_those():
    processor = VisionTransformerImageProcessor(size=8, max_num_patches=12, patch_size=4)
    transform = make_train_transform(processor, scale=(0.5, 1.0), seed=0, token_drop_rate=0.5)
    fetched = examples(transform, pixels(), [0, 1, 2, 0, 1, 2, 0])
    for example in fetched:
        rows, cols = example["spatial_shapes"].tolist()
        kept = example["patch_positions"][example["patch_positions"] >= 0]
        assert len(kept) == rows * cols - (rows * cols) // 2 and torch.equal(kept, kept.sort().values)
        assert example["pixel_attention_mask"].sum() == len(kept)
    batch = collate_fn(fetched, packed_sequence_length=12)
    held = batch["image_slot_index"] >= 0
    assert int(held.sum()) == sum(int((e["patch_positions"] >= 0).sum()) for e in fetched)
    for index, example in enumerate(fetched):  # each image's kept patches, at their places
        places = example["patch_positions"][example["patch_positions"] >= 0]
        assert torch.equal(held[index].nonzero().squeeze(1), places)
        slots = batch["image_slot_index"][index, places]
        flat = batch["pixel_values"].flatten(0, 1)
        torch.testing.assert_close(flat[slots], example["pixel_values"][: len(places)], rtol=0, atol=0)
    model = VisionTransformerForImageClassification(tiny_config(image_size=8, patch_size=4, num_labels=3))
    assert torch.isfinite(model(**batch).loss)
    with pytest.raises(ValueError, match="packed_sequence_length"):
        collate_fn(fetched)  # dropped patches are packed, never padded
    with pytest.raises(ValueError, match="token_drop_rate"):
        make_train_transform(VisionTransformerImageProcessor(size=8), token_drop_rate=0.5)


def run_flags(source, data, out, *more):
    flags = ["--model_name_or_path", str(source), "--dataset_name", str(data), "--output_dir", str(out)]
    flags += ["--max_num_patches", "6", "--max_steps", "3", "--learning_rate", "0.05", "--eval_strategy", "no"]
    flags += ["--save_strategy", "no", "--per_device_train_batch_size", "4", "--check_eval_images", "False"]
    return [*flags, *QUIET, *more]


def recorded_batches(monkeypatch):
    """The shapes of the training batches a run trains on, as they reach `training_step`: (rows, slots, images)."""
    from hf_vit.train.trainer import VisionTransformerTrainer

    batches, step = [], VisionTransformerTrainer.training_step

    def recording(self, model, inputs, num_items_in_batch=None):
        batches.append((*inputs["pixel_values"].shape[:2], len(inputs["spatial_shapes"])))
        return step(self, model, inputs, num_items_in_batch)

    monkeypatch.setattr(VisionTransformerTrainer, "training_step", recording)
    return batches


@pytest.mark.parametrize("drop", ["0", "0.5"])  # with NaViT's token dropping in training (evaluation keeps all)
def test_a_packed_run_trains_reloads_and_serves_packed_batches(tmp_path, capsys, caplog, monkeypatch, drop):
    data = aspect_image_folder(tmp_path / "data")
    source, out = pretrained_folder(tmp_path / "pre"), tmp_path / "run"
    flags = run_flags(source, data, out, "--packed_sequence_length", "9", "--token_drop_rate", drop)
    flags[flags.index("--per_device_train_batch_size") + 1] = "2"  # rows of 9 slots
    batches = recorded_batches(monkeypatch)
    with caplog.at_level("INFO", logger="hf_vit"):
        metrics = train("finetune", *parse_args("finetune", flags))
    assert caplog.text.count("Packed sequences: each batch is 2 rows of 9 patch slots per device") == 1
    assert "global batch 2 rows" in caplog.text
    assert np.isfinite(metrics["train_loss"]) and np.isfinite(metrics["eval_loss"])
    # the tokens are fixed, the images vary: every batch is 2 rows of 9, holding the epoch's 7 images between them
    per_epoch = int(re.search(r"(\d+) batch\(es\) per epoch", caplog.text).group(1))
    assert per_epoch == (1 if drop == "0.5" else 2)  # the kept patches take fewer rows
    assert len(batches) == 3 and {(rows, slots) for rows, slots, _ in batches} == {(2, 9)}
    assert sum(images for _, _, images in batches[:per_epoch]) == 7
    assert max(images for _, _, images in batches) > 2 * (9 // 6)  # more images than rows of the largest fit
    before = VisionTransformerForImageClassification.from_pretrained(source).vit.state_dict()
    model = VisionTransformerForImageClassification.from_pretrained(out).eval()
    moved = [name for name, value in model.vit.state_dict().items() if not torch.equal(value, before[name])]
    assert len(moved) > len(before) // 2  # the backbone trained (the head is new)
    card = (out / "README.md").read_text()
    assert "NaViT sequence packing: each batch 2 rows of 9 patch slots per device, filled with as many whole" in card
    assert ("NaViT token dropping: each training image kept a random 0.5 of its patches" in card) == (drop == "0.5")
    saved = VisionTransformerImageProcessor.from_pretrained(out)
    assert (saved.max_num_patches, saved.packed_sequence_length, saved.patch_size) == (6, 9, 4)
    # predictions on packed batches (the saved processor's) are those of unpacked native-aspect batches
    files = sorted((data / "test").rglob("*.png"))
    served = saved([Image.open(path).convert("RGB") for path in files], return_tensors="pt")
    assert served["pixel_values"].shape[0] < len(files)  # several images to a row
    expected, _ = native_scores(model, files, 6)
    rows = predict_files(out, [data / "test"], top_k=2, batch_size=5)
    assert [row["image"] for row in rows] == [str(path) for path in files]
    for row, scores in zip(rows, expected):
        best = scores.topk(2)
        names = [model.config.id2label[int(index)] for index in best.indices]
        assert [item["label"] for item in row["predictions"]] == names
        np.testing.assert_allclose([item["score"] for item in row["predictions"]], best.values, atol=1e-4)
    from transformers import pipeline

    classify = pipeline("image-classification", model=str(out), trust_remote_code=False)
    for path, scores in zip(files, expected):
        (best,) = classify(str(path), top_k=1)
        assert best["label"] == model.config.id2label[int(scores.argmax())]
        assert best["score"] == pytest.approx(float(scores.max()), abs=1e-4)
    # evaluating the folder (packed batches) measures what the unpacked scores here give, and what the run reported
    capsys.readouterr()
    assert evaluate_command.main(["--model", str(out), "--dataset_name", str(data)]) == 0
    printed = json.loads(capsys.readouterr().out)
    labels = torch.tensor([model.config.label2id[path.parent.name] for path in files])
    assert printed["test_accuracy"] == pytest.approx(float((expected.argmax(-1) == labels).float().mean()))
    assert printed["test_loss"] == pytest.approx(float(F.nll_loss(expected.log(), labels)), abs=1e-4)
    assert printed["test_loss"] == pytest.approx(metrics["test_loss"], abs=1e-4)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--packed_sequence_length", "9"], "--max_num_patches"),
        (["--max_num_patches", "6", "--packed_sequence_length", "4"], "below --max_num_patches"),
        (["--max_num_patches", "6", "--packed_sequence_length", "0"], "--packed_sequence_length 0: must be at least"),
        (["--seq_lens", "4,6", "--packed_sequence_length", "9"], "--seq_lens"),
        (["--patch_sizes", "2,4", "--packed_sequence_length", "9"], "--patch_sizes"),
        (["--max_num_patches", "6", "--packed_sequence_length", "9", "--mixup_alpha", "0.8"], "--mixup_alpha"),
        (["--max_num_patches", "6", "--packed_sequence_length", "9", "--cutmix_minmax", "0.2", "0.8"], "minmax"),
        (["--max_num_patches", "6", "--packed_sequence_length", "9", "--objective", "mpp"], "--objective mpp"),
        (["--max_num_patches", "6", "--packed_sequence_length", "9", "--recipe", "deit"], "set by --recipe deit"),
        (["--max_num_patches", "6", "--token_drop_rate", "0.5"], "--token_drop_rate drops patches of packed"),
        (["--max_num_patches", "6", "--packed_sequence_length", "9", "--token_drop_rate", "1"], r"in \[0, 1\)"),
    ],
)
def test_packing_is_refused_by_name_where_it_cannot_train(tmp_path, flags, named):
    with pytest.raises(ValueError, match=named):
        parse_args("pretrain", ["--output_dir", str(tmp_path / "run"), *flags])


def test_a_stream_on_several_processes_is_refused(tmp_path, monkeypatch):
    # accelerate deals a stream's batches out cut along their first dimension, which a packed batch's rows are not
    from transformers import TrainingArguments

    flags = ["--output_dir", str(tmp_path / "run"), "--max_num_patches", "6", "--packed_sequence_length", "9"]
    flags += ["--streaming", "True", "--max_steps", "2"]
    parse_args("pretrain", flags)  # one process: each batch packed where it is made
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="--streaming on several processes"):
        parse_args("pretrain", flags)


def test_a_killed_packed_run_resumes_mid_epoch_to_the_uninterrupted_runs_weights(tmp_path, monkeypatch):
    # images of several aspect ratios (several grids to plan and pack), random crops, dropout and token dropping; a
    # checkpoint every 2 steps of epochs of 3 batches of 1 row: the run is killed after step 5 and resumes from step 4,
    # in its second epoch. The killed run dies in its own process; the uninterrupted and the resumed runs train in
    # this one.
    from test_training import WORKER, deterministic_finetune_args, run, train_in_one_thread

    source, data = pretrained_folder(tmp_path / "pre"), aspect_image_folder(tmp_path / "data")
    extra = ["--max_num_patches", "6", "--packed_sequence_length", "12", "--save_strategy", "steps"]
    extra += ["--save_steps", "2", "--random_resized_crop", "True", "--crop_scale_min", "0.3"]
    extra += ["--hidden_dropout_prob", "0.1", "--token_drop_rate", "0.3"]  # and the patches each image drops
    extra += ["--dataset_name", str(data)]

    def flags(output_dir, *more):
        return deterministic_finetune_args(source, output_dir, 1, max_steps=7, extra=extra + list(more))

    batches = recorded_batches(monkeypatch)
    straight = train_in_one_thread(flags(tmp_path / "straight"))
    images = [count for _, _, count in batches]
    # one row of 12 slots a batch, whole images of 3 to 5 kept patches in it: 3 batches hold an epoch's 7 images
    assert [(rows, slots) for rows, slots, _ in batches] == [(1, 12)] * 7 and sum(images[:3]) == 7
    assert max(images) > 1  # --per_device_train_batch_size 1 counts rows, not images
    killed = tmp_path / "killed"
    run([sys.executable, str(WORKER)] + flags(killed, "--kill_at_step", "5"), expect=17)
    assert (killed / "checkpoint-4").is_dir() and not (killed / "rank0.safetensors").exists()
    batches.clear()
    resumed = train_in_one_thread(flags(killed, "--resume_from_checkpoint", "True"))
    assert [count for _, _, count in batches] == images[4:]  # the same batches after the checkpoint
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_packed_batches_count_images_in_the_step_the_speed_and_the_learning_rate(tmp_path, caplog, monkeypatch):
    # one optimisation step accumulates the epoch's batches of one row each (their images vary): its update is the
    # update of one padded batch of all 7 images, each image weighing the same
    data = aspect_image_folder(tmp_path / "data")
    source = pretrained_folder(tmp_path / "pre")
    plain = ["--max_steps", "1", "--random_resized_crop", "False", "--hflip", "False", "--max_grad_norm", "0"]
    plain += ["--warmup_steps", "0", "--lr_scheduler_type", "constant"]
    padded = run_flags(source, data, tmp_path / "padded", *plain)
    padded[padded.index("--per_device_train_batch_size") + 1] = "7"
    train("finetune", *parse_args("finetune", padded))
    packed = run_flags(source, data, tmp_path / "packed", *plain, "--packed_sequence_length", "9")
    packed[packed.index("--per_device_train_batch_size") + 1] = "1"
    packed += ["--gradient_accumulation_steps", "8"]  # at least the epoch's batches: one step takes them all
    batches = recorded_batches(monkeypatch)
    metrics = train("finetune", *parse_args("finetune", packed))
    assert sum(images for _, _, images in batches) == 7 and len({images for _, _, images in batches}) > 1
    expected = VisionTransformerForImageClassification.from_pretrained(tmp_path / "padded").state_dict()
    trained = VisionTransformerForImageClassification.from_pretrained(tmp_path / "packed").state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-6, msg=name)
    # the speed counts the 7 images trained, not the 8 rows of the global batch
    assert metrics["train_samples_per_second"] * metrics["train_runtime"] == pytest.approx(7, rel=2e-3)

    # a recipe's learning rate scales with the images of the global batch, not its rows
    class FirstLearningRate(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.value = args.learning_rate

    seen = FirstLearningRate()
    recipe = run_flags(source, data, tmp_path / "recipe", "--packed_sequence_length", "9", "--max_steps", "1")
    recipe += ["--recipe", "finetune", "--mixup_alpha", "0", "--cutmix_alpha", "0"]
    recipe.remove("--learning_rate"), recipe.remove("0.05")
    recipe[recipe.index("--per_device_train_batch_size") + 1] = "1"
    with caplog.at_level("INFO", logger="hf_vit"):
        train("finetune", *parse_args("finetune", recipe), callbacks=[seen])
    per_epoch = int(re.search(r"(\d+) batch\(es\) per epoch", caplog.text).group(1))
    assert seen.value == pytest.approx(5e-4 * (7 / per_epoch) / 256)  # MAE's rule: 5e-4 at a batch of 256 images
    assert f"global batch 1 rows ({7 / per_epoch:.1f} images)" in caplog.text


def test_two_processes_weigh_each_image_of_a_packed_step_as_one_process_accumulating(tmp_path, monkeypatch):
    # one process accumulating the epoch's first 2 batches (of 1 row each) and two processes training one each take
    # the same step over the same images: the same update when each image weighs the same across the processes (the
    # one process is this one)
    from conftest import torchrun_command
    from safetensors.torch import load_file
    from test_training import WORKER, run, train_in_one_thread

    data, source = aspect_image_folder(tmp_path / "data"), pretrained_folder(tmp_path / "pre")
    flags = ["--model_name_or_path", str(source), "--dataset_name", str(data), "--max_num_patches", "6"]
    flags += ["--packed_sequence_length", "9", "--per_device_train_batch_size", "1", "--max_steps", "1"]
    flags += ["--random_resized_crop", "False", "--hflip", "False", "--learning_rate", "0.05", "--seed", "1"]
    flags += ["--warmup_steps", "0", "--lr_scheduler_type", "constant", "--max_grad_norm", "0", "--use_cpu", "True"]
    flags += ["--eval_strategy", "no", "--save_strategy", "no", "--check_eval_images", "False", *QUIET]
    one, two = tmp_path / "one", tmp_path / "two"
    accumulating = ["--output_dir", str(one), "--gradient_accumulation_steps", "2", *flags]
    batches = recorded_batches(monkeypatch)
    expected = train_in_one_thread(["finetune", *accumulating])
    run([*torchrun_command(), str(WORKER), "finetune", "--output_dir", str(two), *flags])
    images = [json.loads((two / f"rank{rank}.json").read_text())["images"] for rank in (0, 1)]
    assert [count for _, _, count in batches] == [images[0][0], images[1][0]]
    assert images[0] != images[1]  # batches of different numbers of images
    trained = load_file(two / "rank0.safetensors")
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-6, msg=name)
