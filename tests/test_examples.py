"""The calls transformers' example scripts make, on a tiny hf-vit folder: `run_image_classification.py` (Trainer),
`run_image_classification_no_trainer.py` (a plain accelerate loop) and `run_mim.py` (SimMIM). Their transforms, mask
generator and collators are written here after reading the scripts (torchvision's crop, flip and normalisation as
PIL and numpy steps); the Auto classes are called as the scripts call them, with `trust_remote_code=True`."""

import math

import numpy as np
import pytest
import torch
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForImageClassification,
    AutoModelForMaskedImageModeling,
    Trainer,
    TrainingArguments,
)

from hf_vit import VisionTransformerConfig, VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.data.datasets import load_digits_dataset

SIZE, PATCH = 32, 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A saved hf-vit classifier of 3 classes (the scripts replace its head) with its processor."""
    path = tmp_path_factory.mktemp("examples") / "tiny"
    config = VisionTransformerConfig(
        image_size=SIZE, patch_size=PATCH, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=3, zero_init_head=False,
    )  # fmt: skip
    torch.manual_seed(0)
    VisionTransformerForImageClassification(config).save_pretrained(path)
    VisionTransformerImageProcessor(size={"height": SIZE, "width": SIZE}).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def digits():
    data = load_digits_dataset()
    return {split: data[split].select(range(48 if split == "train" else 24)) for split in ("train", "validation")}


def example_transform(processor, train: bool, rng: np.random.Generator):
    """The scripts' torchvision pipeline: RGB, a random resized crop and flip (training) or a resize (evaluation),
    to a tensor in [0, 1], normalised with the processor's mean and std."""
    mean, std = np.asarray(processor.image_mean)[:, None, None], np.asarray(processor.image_std)[:, None, None]

    def transform(image):
        image = image.convert("RGB")
        if train:
            width, height = image.size
            side = int(min(width, height) * math.sqrt(rng.uniform(0.67, 1.0)))
            left, top = rng.integers(0, width - side + 1), rng.integers(0, height - side + 1)
            image = image.crop((left, top, left + side, top + side))
            if rng.random() < 0.5:
                image = image.transpose(0)  # FLIP_LEFT_RIGHT
        pixels = np.asarray(image.resize((SIZE, SIZE)), dtype=np.float32).transpose(2, 0, 1) / 255
        return torch.from_numpy(((pixels - mean) / std).astype(np.float32))

    return transform


def classification_splits(folder, digits):
    """`run_image_classification.py`'s loading: the config with the data set's labels, the model with a new head
    (`ignore_mismatched_sizes`), the processor, the transforms set on the splits, and its collator."""
    names = digits["train"].features["label"].names
    label2id = {name: str(index) for index, name in enumerate(names)}
    id2label = {str(index): name for index, name in enumerate(names)}
    config = AutoConfig.from_pretrained(
        folder, num_labels=len(names), label2id=label2id, id2label=id2label, finetuning_task="image-classification",
        trust_remote_code=True,
    )  # fmt: skip
    model = AutoModelForImageClassification.from_pretrained(
        folder, config=config, ignore_mismatched_sizes=True, trust_remote_code=True
    )
    processor = AutoImageProcessor.from_pretrained(folder, trust_remote_code=True)
    rng = np.random.default_rng(0)
    splits = {}
    for split, train in (("train", True), ("validation", False)):
        transform = example_transform(processor, train, rng)

        def apply(batch, transform=transform):
            batch["pixel_values"] = [transform(image) for image in batch["image"]]
            return batch

        splits[split] = digits[split].with_transform(apply)
    return model, processor, splits


def classification_collate(examples):
    return {
        "pixel_values": torch.stack([example["pixel_values"] for example in examples]),
        "labels": torch.tensor([example["label"] for example in examples]),
    }


def accuracy_of(model, split):
    """The accuracy on `split`, one example at a time, in eval mode: the independent count the scripts' metric must
    equal."""
    model.eval()
    with torch.no_grad():
        right = [int(model(example["pixel_values"][None]).logits.argmax(-1)) == example["label"] for example in split]
    return sum(right) / len(right)


def test_run_image_classification_calls_with_trainer(folder, digits, tmp_path):
    model, processor, splits = classification_splits(folder, digits)
    assert model.config.num_labels == 10 and model.classifier.out_features == 10

    def compute_metrics(prediction):
        return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), remove_unused_columns=False, max_steps=6, per_device_train_batch_size=8,
        learning_rate=3e-3, report_to="none", use_cpu=True, save_strategy="no", seed=0,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=splits["train"], eval_dataset=splits["validation"],
        compute_metrics=compute_metrics, processing_class=processor, data_collator=classification_collate,
    )  # fmt: skip
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_accuracy"] == pytest.approx(accuracy_of(model, splits["validation"]))
    trainer.save_model()
    reloaded = AutoModelForImageClassification.from_pretrained(tmp_path / "out", trust_remote_code=True)
    assert reloaded.config.id2label[3] == "3"
    assert accuracy_of(reloaded, splits["validation"]) == pytest.approx(metrics["eval_accuracy"])


def test_run_image_classification_no_trainer_calls_with_accelerate(folder, digits, tmp_path):
    from accelerate import Accelerator

    model, processor, splits = classification_splits(folder, digits)
    accelerator = Accelerator(cpu=True)
    loaders = [
        torch.utils.data.DataLoader(
            splits[name], batch_size=8, shuffle=name == "train", collate_fn=classification_collate
        )
        for name in ("train", "validation")
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, *loaders)
    model.train()
    losses = []
    for batch in train_loader:
        outputs = model(**batch)
        accelerator.backward(outputs.loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(outputs.loss.item())
    assert len(losses) == 6 and all(np.isfinite(losses))
    model.eval()
    right = total = 0
    for batch in eval_loader:
        with torch.no_grad():
            predictions = model(**batch).logits.argmax(dim=-1)
        predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
        right, total = right + int((predictions == references).sum()), total + len(references)
    assert total == 24 and right / total == pytest.approx(accuracy_of(model, splits["validation"]))
    accelerator.unwrap_model(model).save_pretrained(tmp_path / "out", save_function=accelerator.save)
    processor.save_pretrained(tmp_path / "out")
    assert AutoModelForImageClassification.from_pretrained(tmp_path / "out", trust_remote_code=True).config.num_labels


class MaskGenerator:
    """`run_mim.py`'s masks: `mask_ratio` of the image's `mask_patch_size` blocks (rounded up), as model patches."""

    def __init__(self, input_size, mask_patch_size, model_patch_size, mask_ratio, rng):
        self.blocks, self.scale = input_size // mask_patch_size, mask_patch_size // model_patch_size
        self.count, self.rng = math.ceil(self.blocks**2 * mask_ratio), rng

    def __call__(self):
        mask = np.zeros(self.blocks**2, dtype=int)
        mask[self.rng.permutation(self.blocks**2)[: self.count]] = 1
        grid = mask.reshape(self.blocks, self.blocks).repeat(self.scale, axis=0).repeat(self.scale, axis=1)
        return torch.tensor(grid.flatten())


@pytest.mark.parametrize("objective", ["simmim", "mpp"])
def test_run_mim_calls(folder, digits, objective, tmp_path):
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    config.masked_image_modeling = objective  # the field that chooses (a folder saved that way says it)
    config.update({"image_size": SIZE, "patch_size": PATCH, "encoder_stride": config.encoder_stride})
    processor = AutoImageProcessor.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForMaskedImageModeling.from_pretrained(folder, config=config, trust_remote_code=True)
    assert type(model).__name__ == {"simmim": "VisionTransformerForMaskedImageModeling",
                                    "mpp": "VisionTransformerForMaskedPatchPrediction"}[objective]  # fmt: skip
    rng = np.random.default_rng(0)
    transform, masks = example_transform(processor, True, rng), MaskGenerator(SIZE, 16, PATCH, 0.6, rng)

    def preprocess(batch):
        batch["pixel_values"] = [transform(image) for image in batch["image"]]
        batch["mask"] = [masks() for _ in batch["image"]]
        return batch

    def collate(examples):
        return {
            "pixel_values": torch.stack([example["pixel_values"] for example in examples]),
            "bool_masked_pos": torch.stack([example["mask"] for example in examples]),
        }

    splits = {name: digits[name].with_transform(preprocess) for name in ("train", "validation")}
    # the evaluation loss of a model whose loss needs no labels (SimMIM's): Trainer asks for it with no label_names;
    # masked patch prediction's forward takes `labels`, so its evaluation loss is asked for by naming the mask
    label_names = {"simmim": None, "mpp": ["bool_masked_pos"]}[objective]
    args = TrainingArguments(
        output_dir=str(tmp_path / "mim"), remove_unused_columns=False, max_steps=6, per_device_train_batch_size=8,
        learning_rate=3e-3, report_to="none", use_cpu=True, save_strategy="no", seed=0, label_names=label_names,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=splits["train"], eval_dataset=splits["validation"],
        processing_class=processor, data_collator=collate,
    )  # fmt: skip
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert np.isfinite(after) and after != before
    trainer.save_model()
    reloaded = AutoModelForMaskedImageModeling.from_pretrained(tmp_path / "mim", trust_remote_code=True).eval()
    assert type(reloaded) is type(model)
    batch = collate([splits["validation"][index] for index in range(4)])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).loss, model.eval()(**batch).loss)
