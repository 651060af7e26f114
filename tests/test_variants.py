"""A trained model's resolution variant, end to end: as interpolated, after a short fine-tune, as uploaded."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from huggingface_hub import ModelCard

from hf_vit import VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.train.arguments import parse_args
from hf_vit.train.training import train
from hf_vit.variants import make_evaluated_variant

TINY = "hidden_size=48,num_hidden_layers=2,num_attention_heads=3,intermediate_size=96"
COMMON = ["--disable_tqdm", "True", "--eval_strategy", "no", "--save_strategy", "no", "--crop_scale_min", "0.8"]
COMMON += ["--per_device_train_batch_size", "32", "--per_device_eval_batch_size", "256", "--seed", "0"]


def test_variant_at_one_and_a_half_times_the_resolution(tmp_path):
    # 200 steps at 16x16 (about 0.38 test accuracy), then 100 at 24x24 from the variant (about 0.41)
    source, variant_dir, tuned_dir = tmp_path / "src", tmp_path / "variant", tmp_path / "tuned"
    pre = ["--output_dir", str(source), "--image_size", "16", "--patch_size", "4", "--config_overrides", TINY]
    source_metrics = train("pretrain", *parse_args("pretrain", pre + COMMON + ["--max_steps", "200"]))

    variant = make_evaluated_variant(source, 24, variant_dir, repo_id="me/tiny-24", base_model="me/tiny-16")
    model = VisionTransformerForImageClassification.from_pretrained(variant_dir)
    assert model.config.image_size == 24
    assert model(torch.randn(2, 3, 24, 24)).logits.shape == (2, 10)  # no interpolate_pos_encoding needed
    card = ModelCard.load(variant_dir / "README.md")
    assert card.data.base_model == "me/tiny-16"
    assert {r.metric_type: r.metric_value for r in card.data.eval_results}["accuracy"] == round(
        variant["eval_accuracy"], 4
    )
    assert "Interpolated from 16x16" in card.text and "not fine-tuned" in card.text
    print(f"source {source_metrics['eval_accuracy']:.4f}, interpolated {variant['eval_accuracy']:.4f}", end=" ")

    short = ["--output_dir", str(tuned_dir), "--model_name_or_path", str(variant_dir), "--keep_head", "True"]
    tuned = train("finetune", *parse_args("finetune", short + COMMON + ["--max_steps", "100"]))
    print(f"after 100 steps at 24x24 {tuned['eval_accuracy']:.4f}")
    assert tuned["eval_accuracy"] >= source_metrics["eval_accuracy"]


def test_uploaded_variant_loads_offline_without_hf_vit(tmp_path):
    torch.manual_seed(0)
    from conftest import tiny_config

    VisionTransformerForImageClassification(tiny_config(num_labels=10, zero_init_head=False)).save_pretrained(
        tmp_path / "src"
    )
    VisionTransformerImageProcessor(size=32).save_pretrained(tmp_path / "src")
    make_evaluated_variant(tmp_path / "src", 48, tmp_path / "up", data_source=None)
    model = VisionTransformerForImageClassification.from_pretrained(tmp_path / "up").eval()
    x = torch.randn(2, 3, 48, 48)
    torch.save(x, tmp_path / "x.pt")
    expected = model(x).logits
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["hf_vit"] = None
        import torch
        from transformers import AutoImageProcessor, AutoModelForImageClassification
        path = {str(tmp_path / "up")!r}
        model = AutoModelForImageClassification.from_pretrained(path, trust_remote_code=True).eval()
        processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=True)
        assert processor.size == {{"height": 48, "width": 48}}, processor.size
        torch.save(model(torch.load({str(tmp_path / "x.pt")!r})).logits, {str(tmp_path / "out.pt")!r})
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home"), "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected)
    assert json.loads((tmp_path / "up" / "all_results.json").read_text())["eval_split"] == "test"


def test_a_variant_is_measured_on_the_validation_split_of_data_without_a_test_split(tmp_path, capsys):
    import numpy as np
    from PIL import Image

    from hf_vit import VisionTransformerConfig
    from hf_vit.commands.resize import main
    from hf_vit.data.datasets import DataSource, load_datasets

    rng = np.random.default_rng(0)
    for name, colour in (("dark", 40), ("light", 210)):
        (tmp_path / "shapes" / name).mkdir(parents=True)
        for i in range(10):
            pixels = np.clip(rng.normal(colour, 30, (10, 10, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(tmp_path / "shapes" / name / f"{i}.png")
    config = VisionTransformerConfig(
        image_size=8,
        patch_size=4,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=2,
        zero_init_head=False,
    )
    torch.manual_seed(0)
    VisionTransformerForImageClassification(config).save_pretrained(tmp_path / "model")
    VisionTransformerImageProcessor(size=8).save_pretrained(tmp_path / "model")
    args = ["--model", str(tmp_path / "model"), "--image_size", "12", "--output", str(tmp_path / "variant")]
    assert main(args + ["--dataset_name", str(tmp_path / "shapes")]) == 0
    results = json.loads((tmp_path / "variant" / "all_results.json").read_text())
    assert results["eval_split"] == "validation"
    assert "validation accuracy on" in capsys.readouterr().out
    # the part of train a run holds out, measured here with the variant and its processor
    validation = load_datasets(DataSource(dataset_name=str(tmp_path / "shapes")), seed=0)["validation"]
    variant = VisionTransformerForImageClassification.from_pretrained(tmp_path / "variant").eval()
    processor = VisionTransformerImageProcessor.from_pretrained(tmp_path / "variant")
    with torch.no_grad():
        logits = variant(processor(list(validation["image"]), return_tensors="pt").pixel_values).logits
    expected = (logits.argmax(-1) == torch.tensor(validation["label"])).float().mean().item()
    assert len(validation) == 2 and results["eval_accuracy"] == expected


def test_a_multi_label_variant_is_measured_as_evaluate_measures_it(tmp_path, capsys):
    """hf-vit-resize --dataset_name on a multi-label model: mean average precision and F1 (it failed on the
    single-label accuracy's shape check), the numbers hf-vit-evaluate gives the written variant."""
    import datasets
    from datasets import Dataset, DatasetDict
    from PIL import Image

    from hf_vit import VisionTransformerConfig
    from hf_vit.commands import evaluate as evaluate_command
    from hf_vit.commands import resize as resize_command

    names = {0: "even", 1: "odd", 2: "round"}
    config = VisionTransformerConfig(
        image_size=8, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        id2label=names, label2id={v: k for k, v in names.items()}, problem_type="multi_label_classification",
        zero_init_head=False,
    )  # fmt: skip
    torch.manual_seed(0)
    VisionTransformerForImageClassification(config).save_pretrained(tmp_path / "model")
    VisionTransformerImageProcessor(size=8).save_pretrained(tmp_path / "model")
    generator = torch.Generator().manual_seed(1)
    splits = {}
    for split, size in (("train", 8), ("test", 12)):
        images = [
            Image.fromarray((torch.rand(8, 8, 3, generator=generator) * 255).byte().numpy()) for _ in range(size)
        ]
        tags = [[i % 2] + ([2] if i % 3 == 0 else []) for i in range(size)]
        splits[split] = Dataset.from_dict({"image": images, "label": tags})
    tagged = DatasetDict(splits).cast_column("label", datasets.List(datasets.ClassLabel(names=list(names.values()))))
    tagged.save_to_disk(str(tmp_path / "tags"))
    argv = ["--model", str(tmp_path / "model"), "--image_size", "12", "--output", str(tmp_path / "v12")]
    assert resize_command.main(argv + ["--dataset_name", str(tmp_path / "tags")]) == 0
    results = json.loads((tmp_path / "v12" / "all_results.json").read_text())
    capsys.readouterr()
    assert evaluate_command.main(["--model", str(tmp_path / "v12"), "--dataset_name", str(tmp_path / "tags")]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert results["eval_split"] == "test" and 0 < results["eval_mean_average_precision"] <= 1
    for name in ("mean_average_precision", "f1_micro", "f1_macro", "loss"):
        assert results[f"eval_{name}"] == pytest.approx(measured[f"test_{name}"], abs=1e-6), name


def test_a_variant_carries_its_runs_splits(tmp_path, capsys):
    """A run that held out 0.2 of an image folder: its variant's card figure and `hf-vit-evaluate --split validation`
    on the variant measure the run's held-out images (listed here), as a forward computed here measures them."""
    from PIL import Image
    from test_inference import _noise_folder, carved_images
    from test_training import QUIET, pretrained_folder
    from torch.nn import functional as F

    from hf_vit.commands import evaluate as evaluate_command
    from hf_vit.commands import resize as resize_command

    data = _noise_folder(tmp_path / "data", {None: 20})
    held_out = carved_images(data, 0.2)
    assert len(held_out) == 8
    out, variant = tmp_path / "run", tmp_path / "variant"
    args = ["--model_name_or_path", str(pretrained_folder(tmp_path / "pre")), "--dataset_name", str(data)]
    args += ["--output_dir", str(out), "--image_size", "8", "--max_steps", "2", "--eval_strategy", "no", *QUIET]
    train("finetune", *parse_args("finetune", args + ["--save_strategy", "no", "--validation_fraction", "0.2"]))
    resized = ["--model", str(out), "--image_size", "12", "--output", str(variant)]
    assert resize_command.main(resized + ["--dataset_name", str(data)]) == 0
    printed = capsys.readouterr()
    model = VisionTransformerForImageClassification.from_pretrained(variant).eval()
    processor = VisionTransformerImageProcessor.from_pretrained(variant)
    labels = torch.tensor([model.config.label2id[name.split("/")[0]] for name in held_out])
    with torch.no_grad():
        images = [Image.open(data / name) for name in held_out]
        logits = model(processor(images, return_tensors="pt").pixel_values).logits
    accuracy, loss = float((logits.argmax(-1) == labels).float().mean()), float(F.cross_entropy(logits, labels))
    results = json.loads((variant / "all_results.json").read_text())
    assert results["eval_split"] == "validation" and results["eval_samples"] == 8
    assert results["eval_accuracy"] == pytest.approx(accuracy)
    assert results["eval_loss"] == pytest.approx(loss, abs=1e-5)
    assert f"| validation | accuracy | {accuracy:.4f} | 8 images |" in (variant / "README.md").read_text()
    assert f"validation accuracy on {data} as interpolated: {accuracy:.4f}, on 8 images" in printed.out
    assert "warning: measured on only 8 images" in printed.err
    assert evaluate_command.main(["--model", str(variant), "--dataset_name", str(data), "--split", "validation"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["validation_samples"] == 8 and measured["validation_loss"] == pytest.approx(loss, abs=1e-5)


def test_a_native_aspect_model_is_resized_by_its_patch_budget(tmp_path, capsys):
    """A native-aspect folder (max_num_patches 16): --image_size would change nothing its images are seen at, so it
    is refused naming --max_num_patches; --max_num_patches 64 serves a 64x64 image as an 8x8 grid, as the source
    model given 64 patches does."""
    from conftest import tiny_config
    from PIL import Image

    from hf_vit.commands import resize as resize_command

    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(tiny_config(num_labels=3, zero_init_head=False)).eval()
    model.save_pretrained(tmp_path / "native")
    patch = model.config.patch_size
    VisionTransformerImageProcessor(max_num_patches=16, patch_size=patch).save_pretrained(tmp_path / "native")
    argv = ["--model", str(tmp_path / "native"), "--output", str(tmp_path / "variant")]
    assert resize_command.main(argv + ["--image_size", "64"]) == 2
    error = capsys.readouterr().err
    assert "--image_size 64" in error and "--max_num_patches N" in error and "max_num_patches is 16" in error
    assert not (tmp_path / "variant").exists()
    assert resize_command.main(argv + ["--max_num_patches", "64"]) == 0
    assert f"at most 64 patches of {patch}x{patch} per image" in capsys.readouterr().out
    processor = VisionTransformerImageProcessor.from_pretrained(tmp_path / "variant")
    image = Image.fromarray((torch.rand(8 * patch, 8 * patch, 3) * 255).byte().numpy())
    batch = processor([image], return_tensors="pt")
    assert processor.max_num_patches == 64 and batch["spatial_shapes"].tolist() == [[8, 8]]
    given = VisionTransformerImageProcessor(max_num_patches=64, patch_size=patch)([image], return_tensors="pt")
    variant = VisionTransformerForImageClassification.from_pretrained(tmp_path / "variant").eval()
    with torch.no_grad():
        expected = model(**{key: given[key] for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes")})
        served = variant(**{key: batch[key] for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes")})
    torch.testing.assert_close(served.logits, expected.logits)
    assert "at most 64 patches" in (tmp_path / "variant" / "README.md").read_text()
