"""A saved model at work without training: hf-vit-predict, hf-vit-evaluate and `--do_train False`, on hf-vit
folders, Hub ids of transformers' checkpoints and LoRA run folders; each checked against a forward computed here."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_sources import hub_repo
from test_training import QUIET, pretrained_folder, split_image_folder
from torch.nn import functional as F
from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

from hf_vit import VisionTransformerConfig, VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.commands import evaluate as evaluate_command
from hf_vit.commands import predict as predict_command
from hf_vit.train.arguments import parse_args
from hf_vit.train.training import train

CLASSES = {0: "cat", 1: "dog"}


def classifier_folder(path, id2label=CLASSES, seed=0):
    """A tiny hf-vit classifier of `id2label` at 8x8 with a non-zero head, and its processor."""
    config = VisionTransformerConfig(
        image_size=8, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, id2label=id2label, label2id={v: k for k, v in id2label.items()}, zero_init_head=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    VisionTransformerForImageClassification(config).save_pretrained(path)
    VisionTransformerImageProcessor(size=8).save_pretrained(path)
    return path


def direct_scores(model, processor, files):
    """Softmax scores of a forward of the files' images, computed here."""
    images = [Image.open(path).convert("RGB") for path in files]
    with torch.no_grad():
        return model(pixel_values=processor(images, return_tensors="pt")["pixel_values"]).logits.softmax(-1)


def predicted(capsys, argv):
    assert predict_command.main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def check_rows(rows, files, expected, id2label, top_k):
    assert [row["image"] for row in rows] == [str(path) for path in files]
    for row, scores in zip(rows, expected):
        best = scores.topk(top_k)
        assert [item["label"] for item in row["predictions"]] == [id2label[int(i)] for i in best.indices]
        np.testing.assert_allclose([item["score"] for item in row["predictions"]], best.values.numpy(), atol=1e-5)


def test_predict_gives_each_images_top_classes_as_a_forward_does(tmp_path, capsys):
    model = classifier_folder(tmp_path / "model", {0: "a", 1: "b", 2: "c"})
    data = split_image_folder(tmp_path / "data")
    files = sorted((data / "test").rglob("*.png"))
    rows = predicted(capsys, ["--model", str(model), str(data / "test"), "--top_k", "2"])
    expected = direct_scores(
        VisionTransformerForImageClassification.from_pretrained(model).eval(),
        VisionTransformerImageProcessor.from_pretrained(model),
        files,
    )
    check_rows(rows, files, expected, {0: "a", 1: "b", 2: "c"}, 2)
    # a CSV file: one row per image and rank
    assert predict_command.main(["--model", str(model), str(files[0]), "--output", str(tmp_path / "p.csv")]) == 0
    lines = (tmp_path / "p.csv").read_text().splitlines()
    assert lines[0] == "image,rank,label,score" and len(lines) == 1 + 3  # top_k 5 is cut to the 3 classes
    assert predict_command.main(["--model", str(model), str(files[0]), "--output", str(tmp_path / "p.csv")]) == 2


def test_predict_loads_a_transformers_checkpoint_by_hub_id(hub_cache, tmp_path, capsys):
    torch.manual_seed(0)
    id2label = {0: "x", 1: "y", 2: "z"}
    source = ViTForImageClassification(
        ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64, id2label=id2label, label2id={v: k for k, v in id2label.items()})
    ).eval()  # fmt: skip
    torch.nn.init.normal_(source.classifier.weight, std=0.5)
    snapshot = hub_repo(hub_cache, "google/vit-tiny-test")
    source.save_pretrained(snapshot)
    transformers_processor = ViTImageProcessor(size={"height": 32, "width": 32})
    transformers_processor.save_pretrained(snapshot)
    images = []  # at the model's size: the two processors' resampling differs by a few 1e-4
    for i in range(3):
        images.append(tmp_path / f"{i}.png")
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(images[-1])
    rows = predicted(capsys, ["--model", "google/vit-tiny-test", *map(str, images), "--top_k", "3"])
    check_rows(rows, images, direct_scores(source, transformers_processor, images), id2label, 3)


def expected_metrics(model_folder, data, split="test"):
    """Accuracy and loss of the model on the split's files, computed here from the folder's files."""
    model = VisionTransformerForImageClassification.from_pretrained(model_folder).eval()
    processor = VisionTransformerImageProcessor.from_pretrained(model_folder)
    files = sorted((data / split).rglob("*.png"))
    labels = torch.tensor([model.config.label2id[path.parent.name] for path in files])
    images = [Image.open(path).convert("RGB") for path in files]
    with torch.no_grad():
        logits = model(pixel_values=processor(images, return_tensors="pt")["pixel_values"]).logits
    return float((logits.argmax(-1) == labels).float().mean()), float(F.cross_entropy(logits, labels)), len(files)


def test_evaluate_measures_the_split_as_a_forward_does_and_draws_the_confusion_matrix(tmp_path, capsys):
    model = classifier_folder(tmp_path / "model")
    data = split_image_folder(tmp_path / "data")
    out = tmp_path / "eval"
    argv = ["--model", str(model), "--dataset_name", str(data), "--output_dir", str(out)]
    assert evaluate_command.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    accuracy, loss, count = expected_metrics(model, data)
    assert printed["split"] == "test" and printed["test_samples"] == count
    assert printed["test_accuracy"] == pytest.approx(accuracy) and printed["test_loss"] == pytest.approx(
        loss, abs=1e-5
    )
    assert json.loads((out / "test_results.json").read_text()) == printed
    with Image.open(out / "test_confusion_matrix.png") as image:
        assert image.size[0] > 100
    assert evaluate_command.main(argv) == 2  # the results are never overwritten
    assert "exists" in capsys.readouterr().err


def test_evaluate_reports_each_classs_precision_recall_f1_and_the_confusion_matrix(tmp_path, capsys):
    from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

    names = {0: "bird", 1: "cat", 2: "dog"}
    rng = np.random.default_rng(1)
    for split in ("train", "test"):
        for label in names.values():
            (tmp_path / "data" / split / label).mkdir(parents=True)
            for i in range(6):
                pixels = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / "data" / split / label / f"{i}.png")
    for seed in range(20):  # a head whose answers are mixed, so every count shows
        model = classifier_folder(tmp_path / f"model{seed}", names, seed=seed)
        files = sorted((tmp_path / "data" / "test").rglob("*.png"))
        classifier = VisionTransformerForImageClassification.from_pretrained(model).eval()
        scores = direct_scores(classifier, VisionTransformerImageProcessor.from_pretrained(model), files)
        predicted = scores.argmax(-1).numpy()
        if len(set(predicted)) == 3:
            break
    truth = np.array([classifier.config.label2id[path.parent.name] for path in files])
    precision, recall, f1, support = precision_recall_fscore_support(
        truth, predicted, labels=[0, 1, 2], zero_division=0
    )
    matrix = confusion_matrix(truth, predicted, labels=[0, 1, 2])  # computed here, by scikit-learn

    argv = ["--model", str(model), "--dataset_name", str(tmp_path / "data"), "--output_dir", str(tmp_path / "e")]
    assert evaluate_command.main(argv) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert printed["test_classes"] == ["bird", "cat", "dog"]
    assert printed["test_confusion_matrix"] == matrix.tolist()
    for index, name in names.items():
        row = printed["test_per_class"][name]
        assert row["support"] == support[index]
        assert [row["precision"], row["recall"], row["f1"]] == pytest.approx(
            [precision[index], recall[index], f1[index]]
        )
    assert json.loads((tmp_path / "e" / "test_results.json").read_text()) == printed
    # the compact table: a row per class, then the matrix's rows
    table = captured.err.splitlines()
    assert any(
        line.split() == ["cat", f"{precision[1]:.4f}", f"{recall[1]:.4f}", f"{f1[1]:.4f}", "6"] for line in table
    )
    assert ["dog", *map(str, matrix[2])] in [line.split() for line in table]


def test_evaluate_without_matplotlib_says_so_and_skips_the_plot(tmp_path, monkeypatch, caplog):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    model = classifier_folder(tmp_path / "model")
    data = split_image_folder(tmp_path / "data")
    assert (
        evaluate_command.main(
            ["--model", str(model), "--dataset_name", str(data), "--output_dir", str(tmp_path / "e")]
        )
        == 0
    )
    assert (tmp_path / "e" / "test_results.json").exists() and not (
        tmp_path / "e" / "test_confusion_matrix.png"
    ).exists()
    assert "matplotlib is not installed" in caplog.text


@pytest.mark.parametrize(
    "command, argv, named",
    [
        (predict_command, ["--model", "{tmp}/missing", "{tmp}/x.png"], "missing"),
        (predict_command, ["--model", "{model}", "{tmp}/no-such.png"], "no-such.png"),
        (evaluate_command, ["--model", "{model}", "--dataset_name", "{data}", "--split", "tset"], "--split tset"),
        (evaluate_command, ["--model", "{tmp}/missing", "--dataset_name", "{data}"], "missing"),
        (evaluate_command, ["--model", "{model}"], "--dataset_name"),
        (predict_command, ["--model", "{model}", "{tmp}/x.png", "--max_num_patches", "0"], "--max_num_patches"),
        (predict_command, ["--model", "{model}", "{tmp}/x.png", "--patch_size", "3"], "--patch_size 3"),
        (predict_command, ["--model", "{hybrid}", "{tmp}/x.png", "--max_num_patches", "4"], "ResNet stem"),
        (
            evaluate_command,
            ["--model", "{model}", "--dataset_name", "{data}", "--max_num_patches", "4,x"],
            "--max_num_patches takes",
        ),
        (evaluate_command, ["--model", "{model}", "--dataset_name", "{data}", "--patch_size", "0"], "--patch_size"),
        (
            evaluate_command,
            ["--model", "{model}", "--dataset_name", "{data}", "--patch_size", "2,3"],
            "--patch_size 3",
        ),
    ],
)
def test_errors_are_one_line_and_exit_status_2(tmp_path, capsys, command, argv, named):
    model = classifier_folder(tmp_path / "model")
    data = split_image_folder(tmp_path / "data")
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    hybrid = tmp_path / "hybrid"  # a model that cannot take native-aspect batches (a ResNet stem)
    VisionTransformerForImageClassification(
        VisionTransformerConfig.from_pretrained(model, resnet_layers=[1], resnet_width=32)
    ).save_pretrained(hybrid)
    VisionTransformerImageProcessor(size=8).save_pretrained(hybrid)
    argv = [word.format(tmp=tmp_path, model=model, data=data, hybrid=hybrid) for word in argv]
    capsys.readouterr()
    try:
        code = command.main(argv)
    except SystemExit as done:  # the flags' own errors
        code = done.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and named in err[0], err


def test_do_train_false_prints_its_summary_once(tmp_path, capsys, caplog):
    model = classifier_folder(tmp_path / "model")
    data = split_image_folder(tmp_path / "data")
    args = ["--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(tmp_path / "out")]
    with caplog.at_level("INFO"):
        train("finetune", *parse_args("finetune", args + ["--do_train", "False", "--do_eval", *QUIET]))
    said = capsys.readouterr().out + caplog.text
    assert said.count("as it is (no training, no model written)") == 1, said


def test_do_train_false_evaluates_the_checkpoint_as_it_is_and_writes_no_model(tmp_path):
    model = classifier_folder(tmp_path / "model")
    data = split_image_folder(tmp_path / "data")
    out = tmp_path / "out"
    args = ["--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out)]
    metrics = train("finetune", *parse_args("finetune", args + ["--do_train", "False", "--do_predict", *QUIET]))
    accuracy, loss, _ = expected_metrics(model, data)
    assert metrics["test_accuracy"] == pytest.approx(accuracy) and metrics["test_loss"] == pytest.approx(
        loss, abs=1e-5
    )
    assert "validation_accuracy" in metrics  # --do_eval is on with the evaluation strategy
    names = {path.name for path in out.iterdir()}
    assert {"test_results.json", "validation_results.json"} <= names
    assert not names & {"model.safetensors", "config.json", "adapter_model.safetensors"}

    other = classifier_folder(tmp_path / "other", {0: "bird", 1: "fish"})
    args = ["--model_name_or_path", str(other), "--dataset_name", str(data), "--output_dir", str(tmp_path / "o")]
    with pytest.raises(ValueError, match=r"\['bird', 'fish'\] are not those of .*\['cat', 'dog'\]"):
        train("finetune", *parse_args("finetune", args + ["--do_train", "False", *QUIET]))
    for flag, value in (("--image_size", "16"), ("--lora_rank", "2"), ("--config_overrides", "qkv_bias=False")):
        with pytest.raises(ValueError, match=f"--do_train False measures the checkpoint as it is, so {flag} would"):
            parse_args("finetune", args + ["--do_train", "False", flag, value, *QUIET])


def test_do_train_false_warns_once_about_training_flags_and_measures(tmp_path, caplog):
    """A training command re-run with --do_train False evaluates: the flags that shape training only get one warning
    line naming them, not a refusal."""
    model = classifier_folder(tmp_path / "model")
    data = split_image_folder(tmp_path / "data")
    args = ["--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(tmp_path / "out")]
    args += ["--per_device_train_batch_size", "4", "--save_strategy", "epoch", "--learning_rate", "0.1"]
    with caplog.at_level("WARNING", logger="hf_vit"):
        parsed = parse_args(
            "finetune", args + ["--do_train", "False", "--do_predict", "--rand_augment", "rand-m9-n2", *QUIET]
        )
    warned = [r.getMessage() for r in caplog.records if "--do_train False" in r.getMessage()]
    assert len(warned) == 1
    for flag in ("--per_device_train_batch_size", "--save_strategy", "--learning_rate", "--rand_augment"):
        assert flag in warned[0]
    metrics = train("finetune", *parsed)
    assert metrics["test_accuracy"] == pytest.approx(expected_metrics(model, data)[0])


def test_a_lora_runs_folder_predicts_and_loads_without_base(tmp_path, capsys):
    from hf_vit.lora import load_lora_model

    source = pretrained_folder(tmp_path / "pre")
    data = split_image_folder(tmp_path / "data")
    out = tmp_path / "lora"
    args = ["--model_name_or_path", str(source), "--dataset_name", str(data), "--output_dir", str(out)]
    args += ["--image_size", "8", "--max_steps", "4", "--eval_strategy", "no", "--save_strategy", "no"]
    train("finetune", *parse_args("finetune", args + ["--learning_rate", "0.05", "--lora_rank", "2", *QUIET]))
    assert "the model is in" in capsys.readouterr().out  # the run's summary
    files = sorted((data / "test").rglob("*.png"))
    rows = predicted(capsys, ["--model", str(out), str(data / "test"), "--top_k", "2"])
    merged = load_lora_model(out, base=source)
    check_rows(rows, files, direct_scores(merged, VisionTransformerImageProcessor.from_pretrained(out), files),
               CLASSES, 2)  # fmt: skip
    assert evaluate_command.main(["--model", str(out), "--dataset_name", str(data)]) == 0
    accuracy = json.loads(capsys.readouterr().out)["test_accuracy"]
    labels = torch.tensor([0 if path.parent.name == "cat" else 1 for path in files])
    expected = direct_scores(merged, VisionTransformerImageProcessor.from_pretrained(out), files).argmax(-1)
    assert accuracy == pytest.approx(float((expected == labels).float().mean()))


# Images of several aspect ratios (height, width): native-aspect batches put them on different grids.
ASPECTS = [(8, 8), (8, 24), (30, 10), (12, 20), (5, 40), (16, 12)]


def aspect_image_folder(root):
    """A data set of random images of several aspect ratios, a test split of 8 (cat, dog) and a train split."""
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for index, label in enumerate(("cat", "dog") * 4):
            folder = root / split / label
            folder.mkdir(parents=True, exist_ok=True)
            height, width = ASPECTS[index % len(ASPECTS)]
            Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / f"{index}.png")
    return root


def native_scores(model, files, max_patches):
    """Softmax scores of the model on a native-aspect batch of the files' images built here, and its grids."""
    processor = VisionTransformerImageProcessor(
        size=8, max_num_patches=max_patches, patch_size=model.config.patch_size
    )
    inputs = processor([Image.open(path).convert("RGB") for path in files], return_tensors="pt")
    with torch.no_grad():
        return model(**inputs).logits.softmax(-1), inputs["spatial_shapes"]


def test_pipeline_serves_native_batches_from_the_saved_field_or_a_given_processor(tmp_path):
    from transformers import pipeline

    model_folder = classifier_folder(tmp_path / "model", {0: "a", 1: "b", 2: "c"})
    VisionTransformerImageProcessor(size=8, max_num_patches=6, patch_size=4).save_pretrained(model_folder)
    files = sorted(aspect_image_folder(tmp_path / "data").rglob("test/*/*.png"))
    model = VisionTransformerForImageClassification.from_pretrained(model_folder).eval()
    expected, grids = native_scores(model, files, 6)
    assert len({tuple(grid) for grid in grids.tolist()}) >= 4  # the aspect ratios kept: several grids

    def check(results, expected):
        for result, scores in zip(results, expected):
            best = scores.topk(3)
            assert [item["label"] for item in result] == ["abc"[int(i)] for i in best.indices]
            np.testing.assert_allclose([item["score"] for item in result], best.values.numpy(), atol=1e-5)

    classify = pipeline("image-classification", model=str(model_folder), trust_remote_code=False)
    images = [Image.open(path).convert("RGB") for path in files]
    check(classify(images), expected)
    check(classify(images, batch_size=4), expected)  # the pipeline's collation stacks the padded batches
    # a folder without the field: the processor given to the pipeline says how many patches
    plain = classifier_folder(tmp_path / "plain", {0: "a", 1: "b", 2: "c"})
    processor = VisionTransformerImageProcessor.from_pretrained(plain, max_num_patches=12, patch_size=4)
    served = pipeline("image-classification", model=str(plain), image_processor=processor, trust_remote_code=False)
    check(served(images), native_scores(model, files, 12)[0])
    # the pipeline takes no processor options per call: refused by transformers, never ignored
    with pytest.raises(TypeError, match="max_num_patches"):
        classify(images[0], max_num_patches=4)


def test_predict_at_native_aspect_and_another_patch_size_as_a_forward_does(tmp_path, capsys):
    model_folder = classifier_folder(tmp_path / "model", {0: "a", 1: "b", 2: "c"})  # its processor: whole images
    data = aspect_image_folder(tmp_path / "data")
    files = sorted((data / "test").rglob("*.png"))
    names = {0: "a", 1: "b", 2: "c"}
    rows = predicted(capsys, ["--model", str(model_folder), str(data / "test"), "--max_num_patches", "6"])
    model = VisionTransformerForImageClassification.from_pretrained(model_folder).eval()
    check_rows(rows, files, native_scores(model, files, 6)[0], names, 3)
    # at patch size 2, native: the checkpoint's patch embedding resampled (FlexiViT), then the same batches
    rows = predicted(
        capsys, ["--model", str(model_folder), *map(str, files), "--max_num_patches", "9", "--patch_size", "2"]
    )
    model.set_input_size(patch_size=2)
    expected, grids = native_scores(model, files, 9)
    assert int(grids.prod(-1).max()) > 6  # more, smaller patches
    check_rows(rows, files, expected, names, 3)
    # at patch size 2 on whole images of the processor's size (8x8: 16 patches)
    rows = predicted(capsys, ["--model", str(model_folder), *map(str, files), "--patch_size", "2"])
    check_rows(rows, files, direct_scores(model, VisionTransformerImageProcessor(size=8), files), names, 3)


def test_attention_pooling_serves_native_and_packed_batches_each_image_as_alone(tmp_path, capsys):
    config = VisionTransformerConfig.from_pretrained(classifier_folder(tmp_path / "token"), classifier="map")
    torch.manual_seed(1)
    model = VisionTransformerForImageClassification(config).eval()
    model.save_pretrained(tmp_path / "map")
    VisionTransformerImageProcessor(size=8).save_pretrained(tmp_path / "map")
    files = sorted(aspect_image_folder(tmp_path / "data").rglob("test/*/*.png"))
    alone = torch.cat([native_scores(model, [path], 6)[0] for path in files])  # each image in a batch of its own
    rows = predicted(capsys, ["--model", str(tmp_path / "map"), *map(str, files), "--max_num_patches", "6"])
    check_rows(rows, files, alone, CLASSES, 2)
    # a packed run's folder: several images per row, attention and pooling per image
    VisionTransformerImageProcessor(
        size=8, max_num_patches=6, patch_size=4, packed_sequence_length=12
    ).save_pretrained(tmp_path / "map")
    rows = predicted(capsys, ["--model", str(tmp_path / "map"), *map(str, files)])
    check_rows(rows, files, alone, CLASSES, 2)


def expected_native_metrics(model, data, max_patches):
    """Accuracy and loss of the model on the test split's native-aspect batches, computed here."""
    files = sorted((data / "test").rglob("*.png"))
    labels = torch.tensor([model.config.label2id[path.parent.name] for path in files])
    scores, grids = native_scores(model, files, max_patches)
    accuracy = float((scores.argmax(-1) == labels).float().mean())
    return accuracy, float(F.nll_loss(scores.log(), labels)), float(grids.prod(-1).float().mean())


def test_evaluate_at_native_aspect_and_the_compute_dial(tmp_path, capsys):
    model_folder = classifier_folder(tmp_path / "model")
    data = aspect_image_folder(tmp_path / "data")
    model = VisionTransformerForImageClassification.from_pretrained(model_folder).eval()
    argv = ["--model", str(model_folder), "--dataset_name", str(data)]
    assert evaluate_command.main(argv + ["--max_num_patches", "6"]) == 0
    printed = json.loads(capsys.readouterr().out)
    accuracy, loss, tokens = expected_native_metrics(model, data, 6)
    assert (printed["max_num_patches"], printed["patch_size"]) == (6, 4)
    assert printed["test_accuracy"] == pytest.approx(accuracy)
    assert printed["test_loss"] == pytest.approx(loss, abs=1e-5) and printed["test_tokens_per_image"] == tokens
    # a list: one row per number of patches, and the plot
    out = tmp_path / "dial"
    assert evaluate_command.main(argv + ["--max_num_patches", "1,4,12", "--output_dir", str(out)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(row["series"], row["max_num_patches"]) for row in rows] == [("tokens", 1), ("tokens", 4), ("tokens", 12)]
    for row in rows:
        accuracy, loss, tokens = expected_native_metrics(model, data, row["max_num_patches"])
        assert row["accuracy"] == pytest.approx(accuracy) and row["loss"] == pytest.approx(loss, abs=1e-5)
        assert row["tokens_per_image"] == pytest.approx(tokens)
    assert json.loads((out / "compute_dial.json").read_text()) == rows
    with Image.open(out / "compute_dial.png") as image:
        assert image.size[0] > 300
    # patch sizes, on whole images of the processor's size: the checkpoint resampled to each
    assert evaluate_command.main(argv + ["--patch_size", "2,4,8"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(row["patch_size"], row["tokens_per_image"]) for row in rows] == [(2, 16.0), (4, 4.0), (8, 1.0)]
    for row in rows:
        resized = VisionTransformerForImageClassification.from_pretrained(model_folder).eval()
        resized.set_input_size(patch_size=row["patch_size"])
        files = sorted((data / "test").rglob("*.png"))
        labels = torch.tensor([model.config.label2id[path.parent.name] for path in files])
        scores = direct_scores(resized, VisionTransformerImageProcessor(size=8), files)
        assert row["accuracy"] == pytest.approx(float((scores.argmax(-1) == labels).float().mean()))
        assert row["loss"] == pytest.approx(float(F.nll_loss(scores.log(), labels)), abs=1e-5)
    assert evaluate_command.main(argv + ["--max_num_patches", "1,4", "--output_dir", str(out)]) == 2
    assert "exists" in capsys.readouterr().err  # the dial is never overwritten


def test_a_runs_validation_figures_are_those_evaluate_measures_on_its_folder(tmp_path, capsys):
    """A folder without a validation split: the run holds out images whatever its --seed, and `hf-vit-evaluate
    --split validation` (what the run's summary suggests) measures exactly those images."""
    rng = np.random.default_rng(3)
    data = tmp_path / "data"
    for label in ("cat", "dog", "fox"):
        (data / label).mkdir(parents=True)
        for i in range(20):
            pixels = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(data / label / f"{i}.png")
    source, out = pretrained_folder(tmp_path / "pre"), tmp_path / "run"
    args = ["--model_name_or_path", str(source), "--dataset_name", str(data), "--output_dir", str(out)]
    args += ["--image_size", "8", "--max_steps", "3", "--eval_strategy", "no", "--save_strategy", "no"]
    metrics = train("finetune", *parse_args("finetune", args + ["--seed", "42", "--learning_rate", "0.05", *QUIET]))
    assert metrics["eval_split"] == "validation" and metrics["validation_accuracy"] not in (0, 1)
    capsys.readouterr()
    assert evaluate_command.main(["--model", str(out), "--dataset_name", str(data), "--split", "validation"]) == 0
    captured = capsys.readouterr()
    measured = json.loads(captured.out)
    assert "pass --output_dir to write validation_results.json and the confusion matrix" in captured.err
    assert measured["validation_samples"] == 6 and metrics["validation_samples"] == 6  # 0.1 of 20 a class
    figure = f"validation accuracy {measured['validation_accuracy']:.4f} of {data}, on 6 images"
    assert figure in captured.err.splitlines()
    assert len([line for line in captured.err.splitlines() if "measured on only 6 images" in line]) == 1
    assert measured["validation_accuracy"] == metrics["validation_accuracy"]
    assert measured["validation_loss"] == pytest.approx(metrics["validation_loss"], abs=1e-7)


def _noise_folder(root, counts, seed=5):
    """root/<split>/<label>/<i>.png (or root/<label>/<i>.png for the split None) of random pixels: every image its
    own, told apart by its pixels."""
    rng = np.random.default_rng(seed)
    for split, per_label in counts.items():
        for label in ("cat", "dog"):
            folder = root / split / label if split else root / label
            folder.mkdir(parents=True)
            for i in range(per_label):
                Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def _pixels(images):
    return sorted(np.asarray(image.convert("RGB")).tobytes() for image in images)


def _measured_images(out, data):
    """The images hf-vit-evaluate measures as "validation" of the run folder `out` on `data`."""
    from hf_vit.data.datasets import DataSource
    from hf_vit.infer.evaluate import evaluation_split, recorded_source

    config = VisionTransformerConfig.from_pretrained(out)
    prepared = evaluation_split(config, recorded_source(out, DataSource(dataset_name=str(data))), "validation")
    return _pixels(prepared.raw["validation"]["image"])


def test_evaluate_measures_a_named_validation_split_as_the_run_did(tmp_path, capsys):
    """--validation_split val: the run is measured on `val`, and so is `hf-vit-evaluate --split validation` on its
    folder (by the run's record), not on images carved out of train."""
    import datasets

    rng = np.random.default_rng(5)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog"])})
    held_out = []
    splits = {}
    for split, count in (("train", 20), ("val", 6)):
        images = [Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)) for _ in range(count)]
        splits[split] = datasets.Dataset.from_dict({"image": images, "label": [i % 2 for i in range(count)]}, features)
        held_out = _pixels(images)  # the val split's images, computed here
    data = tmp_path / "data"
    datasets.DatasetDict(splits).save_to_disk(data)
    source, out = pretrained_folder(tmp_path / "pre"), tmp_path / "run"
    args = ["--model_name_or_path", str(source), "--dataset_name", str(data), "--output_dir", str(out)]
    args += ["--image_size", "8", "--max_steps", "2", "--eval_strategy", "no", "--save_strategy", "no"]
    metrics = train("finetune", *parse_args("finetune", args + ["--validation_split", "val", *QUIET]))
    assert metrics["eval_split"] == "validation"
    assert str(tmp_path) not in (out / "hf_vit_run.json").read_text()  # the record knows the folder by a digest
    capsys.readouterr()
    assert evaluate_command.main(["--model", str(out), "--dataset_name", str(data), "--split", "validation"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["validation_samples"] == 6
    assert measured["validation_loss"] == pytest.approx(metrics["validation_loss"], abs=1e-6)
    assert _measured_images(out, data) == held_out
    # hf-vit-resize measures its variant (here at the same size: the same model) on the same images
    from hf_vit.data.datasets import DataSource
    from hf_vit.variants import make_resolution_variant

    make_resolution_variant(out, 8, tmp_path / "variant", data_source=DataSource(dataset_name=str(data)))
    variant = json.loads((tmp_path / "variant" / "all_results.json").read_text())
    assert variant["eval_split"] == "validation" and variant["eval_samples"] == 6
    assert variant["eval_loss"] == pytest.approx(metrics["validation_loss"], abs=1e-6)
    flags = ["--model", str(out), "--dataset_name", str(data), "--validation_split", "validation"]
    assert evaluate_command.main(flags) == 2  # contradicts the run's record: refused by name
    assert "--validation_split validation" in capsys.readouterr().err


def test_evaluate_measures_a_streamed_runs_held_out_images(tmp_path, capsys):
    """A --streaming run holds out every 10th image of the stream; evaluate measures those, not a random 10%."""
    import datasets

    data = _noise_folder(tmp_path / "data", {None: 15})
    source, out = pretrained_folder(tmp_path / "pre"), tmp_path / "run"
    args = ["--model_name_or_path", str(source), "--dataset_name", str(data), "--output_dir", str(out)]
    args += ["--image_size", "8", "--max_steps", "2", "--eval_strategy", "no", "--save_strategy", "no"]
    train("finetune", *parse_args("finetune", args + ["--streaming", "True", "--dataloader_num_workers", "0", *QUIET]))
    stream = datasets.load_dataset("imagefolder", data_dir=str(data), streaming=True)["train"]
    rows = [row for index, row in enumerate(stream) if (index + 1) % 10 == 0]  # held out by the run, computed here
    model = VisionTransformerForImageClassification.from_pretrained(out).eval()
    processor = VisionTransformerImageProcessor.from_pretrained(out)
    labels = torch.tensor([model.config.label2id[stream.features["label"].int2str(row["label"])] for row in rows])
    with torch.no_grad():
        logits = model(pixel_values=processor([row["image"] for row in rows], return_tensors="pt").pixel_values).logits
    capsys.readouterr()
    assert evaluate_command.main(["--model", str(out), "--dataset_name", str(data), "--split", "validation"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["validation_samples"] == len(rows) == 3
    assert measured["validation_loss"] == pytest.approx(float(F.cross_entropy(logits, labels)), abs=1e-5)
    assert _measured_images(out, data) == _pixels(row["image"] for row in rows)
    flags = ["--model", str(out), "--dataset_name", str(data), "--validation_fraction", "0.2"]
    assert evaluate_command.main(flags) == 2
    assert "--validation_fraction 0.2" in capsys.readouterr().err


def carved_images(data, fraction):
    """The images a run holds out of the image folder `data` (no validation folder), listed here by the documented
    rule: `fraction` of train, stratified by label, drawn with seed 0; as paths relative to `data`."""
    import datasets

    folder = datasets.load_dataset("imagefolder", data_dir=str(data))["train"]
    carved = folder.train_test_split(test_size=fraction, seed=0, stratify_by_column="label")["test"]
    files = carved.cast_column("image", datasets.Image(decode=False))["image"]
    return sorted(Path(file["path"]).relative_to(data).as_posix() for file in files)


def test_a_moved_and_changed_image_folder_keeps_the_runs_held_out_images(tmp_path, capsys, caplog):
    """The run's record names the images it held out by their paths in the folder (and their bytes): after the folder
    moved and an image was added, evaluate measures exactly those images and names the added one; a held-out image
    removed is named and left out."""
    import shutil

    data = _noise_folder(tmp_path / "data1" / "imgs", {None: 20})
    held_out = carved_images(data, 0.1)
    assert len(held_out) == 4
    source, out = pretrained_folder(tmp_path / "pre"), tmp_path / "run"
    args = ["--model_name_or_path", str(source), "--dataset_name", str(data), "--output_dir", str(out)]
    args += ["--image_size", "8", "--max_steps", "2", "--eval_strategy", "no", "--save_strategy", "no"]
    metrics = train("finetune", *parse_args("finetune", args + ["--learning_rate", "0.05", *QUIET]))
    record = json.loads((out / "hf_vit_run.json").read_text())["splits"]
    assert sorted(record["images"]["validation"]) == held_out and str(tmp_path) not in json.dumps(record)
    moved = tmp_path / "data2" / "imgs"
    shutil.move(data, moved)
    Image.new("RGB", (8, 8), (1, 2, 3)).save(moved / "cat" / "new.png")
    capsys.readouterr()
    flags = ["--model", str(out), "--dataset_name", str(moved), "--split", "validation"]
    assert evaluate_command.main(flags) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["validation_samples"] == 4
    assert measured["validation_loss"] == pytest.approx(metrics["validation_loss"], abs=1e-6)
    assert _measured_images(out, moved) == _pixels(Image.open(moved / name) for name in held_out)
    assert "images the run did not read (added since, or left out by it): cat/new.png" in caplog.text
    caplog.clear()
    (moved / held_out[0]).unlink()
    assert _measured_images(out, moved) == _pixels(Image.open(moved / name) for name in held_out[1:])
    assert f"the run's images no longer there: {held_out[0]}" in caplog.text
    for name in held_out[1:]:
        (moved / name).write_bytes((moved / "cat" / "new.png").read_bytes())  # changed: not the image held out
    caplog.clear()
    assert evaluate_command.main(flags) == 0  # no image the run held out: another data set, and said so
    assert f"{moved} holds none of the images the run that trained {out} held out" in caplog.text


def test_evaluate_maps_the_data_sets_classes_to_the_models_ids_by_name(tmp_path, capsys):
    """A head trained with the classes in another id order (dog 0, cat 1) is measured by class name, as a forward
    computed here from the files' folder names measures it."""
    data = split_image_folder(tmp_path / "data")
    for seed in range(20):  # a head whose two orders give different accuracies, so the mapping shows
        model = classifier_folder(tmp_path / f"model{seed}", {0: "dog", 1: "cat"}, seed=seed)
        accuracy, loss, count = expected_metrics(model, data)
        if accuracy not in (0.5,):
            break
    assert evaluate_command.main(["--model", str(model), "--dataset_name", str(data)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["test_samples"] == count and printed["test_accuracy"] == pytest.approx(accuracy)
    assert printed["test_loss"] == pytest.approx(loss, abs=1e-5)


def test_predict_and_evaluate_refuse_a_model_without_a_classification_head(tmp_path, capsys):
    """An encoder folder (hf-vit's VisionTransformerModel) and a DINOv2 backbone hold no head: predicting with a
    fresh random head, or with the features as logits, would print scores that mean nothing."""
    from transformers import Dinov2Config, Dinov2Model

    from hf_vit import VisionTransformerModel

    encoder = tmp_path / "encoder"
    VisionTransformerModel(VisionTransformerConfig.from_pretrained(classifier_folder(tmp_path / "c"))).save_pretrained(
        encoder
    )
    VisionTransformerImageProcessor(size=8).save_pretrained(encoder)
    dino = tmp_path / "dino"
    Dinov2Model(Dinov2Config(image_size=8, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=64)).save_pretrained(dino)  # fmt: skip
    ViTImageProcessor(size={"height": 8, "width": 8}).save_pretrained(dino)
    data = split_image_folder(tmp_path / "data")
    for folder in (encoder, dino):
        for command, argv in (
            (predict_command, ["--model", str(folder), str(data / "test")]),
            (evaluate_command, ["--model", str(folder), "--dataset_name", str(data)]),
        ):
            capsys.readouterr()
            assert command.main(argv) == 2
            captured = capsys.readouterr()
            err = captured.err.strip().splitlines()
            assert len(err) == 1 and "has no classification head" in err[0], err
            assert captured.out == ""
    # a batch size below 1: the command's flag check answers first; the library refuses it by the flag's name too
    from hf_vit.infer.predict import predict_files

    model = classifier_folder(tmp_path / "model")
    for size in ("0", "-1"):
        with pytest.raises(SystemExit) as refused:
            predict_command.main(["--model", str(model), str(data / "test"), "--batch_size", size])
        assert refused.value.code == 2 and "--batch_size must be at least 1" in capsys.readouterr().err
        with pytest.raises(ValueError, match="--batch_size must be a positive number of images"):
            predict_files(model, [data / "test"], batch_size=int(size))
