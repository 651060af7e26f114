"""Pretraining runs from a checkpoint: the flags given with `--model_name_or_path` are applied (dropout rates, the
image size by resampling the position embeddings) or refused in one line that names them, for supervised and masked
patch prediction runs alike."""

import pytest
import torch
from test_training import QUIET, TINY, pretrained_folder

from hf_vit import VisionTransformerForImageClassification, VisionTransformerForMaskedPatchPrediction
from hf_vit.model.resolution import resample_position_embeddings
from hf_vit.train.arguments import parse_args
from hf_vit.train.training import train

SHORT = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--eval_strategy", "no", "--save_strategy", "no"]
SHORT += ["--max_train_samples", "16", *QUIET]


def pretrain(tmp_path, source, *flags, name="out"):
    args = ["--output_dir", str(tmp_path / name), "--model_name_or_path", str(source), *SHORT, *flags]
    return train("pretrain", *parse_args("pretrain", args))


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A supervised checkpoint at 8x8 (patch 4, pre-logits layer) to continue pretraining from."""
    return pretrained_folder(tmp_path_factory.mktemp("pre") / "classifier", image_size=8)


def test_mpp_from_a_classification_checkpoint_trains_at_the_image_size_given(tmp_path, classifier):
    pretrain(tmp_path, classifier, "--objective", "mpp", "--image_size", "16", "--hidden_dropout_prob", "0.1")
    model = VisionTransformerForMaskedPatchPrediction.from_pretrained(tmp_path / "out")
    assert model.config.image_size == 16 and model.config.grid_size == (4, 4)  # it trained at 8 before
    assert model.config.hidden_dropout_prob == 0.1
    assert model.vit.embeddings.position_embedding.shape[1] == 1 + 16


def test_supervised_pretraining_from_a_checkpoint_resamples_to_the_image_size_given(tmp_path, classifier):
    pretrain(tmp_path, classifier, "--image_size", "12", "--drop_path_rate", "0.2", "--learning_rate", "0")
    model = VisionTransformerForImageClassification.from_pretrained(tmp_path / "out")
    assert model.config.image_size == 12 and model.config.drop_path_rate == 0.2
    source = VisionTransformerForImageClassification.from_pretrained(classifier)
    expected = resample_position_embeddings(source.vit.embeddings.position_embedding, (2, 2), (3, 3))
    torch.testing.assert_close(model.vit.embeddings.position_embedding, expected)  # learning rate 0: unchanged


@pytest.mark.parametrize("objective", ["classification", "mpp"])
@pytest.mark.parametrize(
    "flags, named",
    [
        (["--config_overrides", TINY.replace("hidden_size=32", "hidden_size=64")], "hidden_size=64"),
        (["--config_overrides", TINY.replace("num_hidden_layers=2", "num_hidden_layers=3")], "num_hidden_layers=3"),
    ],
)
def test_flags_changing_a_checkpoints_weights_are_refused_naming_them(tmp_path, classifier, objective, flags, named):
    with pytest.raises(ValueError) as info:
        pretrain(tmp_path, classifier, "--objective", objective, *flags)
    message = str(info.value)
    assert named in message and "\n" not in message and "--preset" in message
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_overrides_equal_to_the_checkpoints_fields_are_accepted(tmp_path, classifier):
    pretrain(tmp_path, classifier, "--objective", "mpp", "--patch_size", "4", "--config_overrides", TINY)
    assert VisionTransformerForMaskedPatchPrediction.from_pretrained(tmp_path / "out").config.patch_size == 4


def test_continuing_on_other_classes_gives_a_new_head_and_says_so(tmp_path, classifier, caplog):
    from test_training import labelled_dataset

    data = labelled_dataset(tmp_path / "data", ["ant", "bee", "cow"], {"train": [0, 1, 2] * 4, "validation": [0, 1]})
    with caplog.at_level("INFO", logger="hf_vit"):
        pretrain(tmp_path, classifier, "--dataset_name", str(data), "--learning_rate", "0")  # the digits' 10 before
    assert "whose head has 10 classes, on a data set of 3: its head (pre-logits and classifier) is replaced" in (
        caplog.text
    )
    model = VisionTransformerForImageClassification.from_pretrained(tmp_path / "out").eval()
    source = VisionTransformerForImageClassification.from_pretrained(classifier).eval()
    assert model.config.id2label == {0: "ant", 1: "bee", 2: "cow"} and model.classifier.out_features == 3
    assert model.config.representation_size == source.config.representation_size == 32
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # learning rate 0: the encoder is the checkpoint's
        torch.testing.assert_close(model.vit(x).last_hidden_state, source.vit(x).last_hidden_state)


@pytest.fixture(scope="module")
def named_classifier(tmp_path_factory):
    """A supervised checkpoint of the classes ant, bee, cow (numbered so), its head not zero."""
    from hf_vit import VisionTransformerConfig

    config = VisionTransformerConfig(
        image_size=8, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        representation_size=32, id2label={0: "ant", 1: "bee", 2: "cow"}, zero_init_head=False,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("named") / "classifier"
    VisionTransformerForImageClassification(config).save_pretrained(path)
    return path


def test_continuing_on_the_same_classes_numbered_otherwise_reorders_the_heads_rows(tmp_path, named_classifier, caplog):
    from test_training import labelled_dataset

    names = ["cow", "ant", "bee"]  # the checkpoint's classes, numbered in another order
    data = labelled_dataset(tmp_path / "data", names, {"train": [0, 1, 2] * 4, "validation": [0, 1, 2]})
    with caplog.at_level("INFO", logger="hf_vit"):
        pretrain(tmp_path, named_classifier, "--dataset_name", str(data), "--learning_rate", "0")
    model = VisionTransformerForImageClassification.from_pretrained(tmp_path / "out").eval()
    source = VisionTransformerForImageClassification.from_pretrained(named_classifier).eval()
    assert model.config.id2label == dict(enumerate(names))
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # learning rate 0: each class name's logit is the checkpoint's for that name
        logits, expected = model(x).logits, source(x).logits
    source_ids = {name: index for index, name in source.config.id2label.items()}
    for name in names:
        torch.testing.assert_close(logits[:, model.config.label2id[name]], expected[:, source_ids[name]])
    assert "its head's rows are reordered by class name" in caplog.text


def test_a_kept_head_of_other_classes_is_refused_and_shared_names_get_a_new_head(tmp_path, named_classifier, caplog):
    from test_training import labelled_dataset

    splits = {"train": [0, 1, 2] * 4, "validation": [0, 1, 2]}
    data = labelled_dataset(tmp_path / "data", ["bee", "ant", "dog"], splits)  # two shared names, moved; one new
    with pytest.raises(ValueError, match=r"^--keep_head keeps the head of .*'dog'.*drop --keep_head") as info:
        pretrain(tmp_path, named_classifier, "--dataset_name", str(data), "--keep_head", name="kept")
    assert "\n" not in str(info.value)
    with caplog.at_level("INFO", logger="hf_vit"):
        pretrain(tmp_path, named_classifier, "--dataset_name", str(data), "--learning_rate", "0")
    assert "on a data set of 3 of other classes: its head (pre-logits and classifier) is replaced" in caplog.text
    model = VisionTransformerForImageClassification.from_pretrained(tmp_path / "out")
    source = VisionTransformerForImageClassification.from_pretrained(named_classifier)
    assert model.config.id2label == {0: "bee", 1: "ant", 2: "dog"}
    assert not torch.allclose(model.classifier.weight[:2], source.classifier.weight[[1, 0]])
