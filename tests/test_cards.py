"""The model card's words for what ran: the optimizer and schedule as a reader spells them, and the resolution of a
model fed native-aspect batches."""

from conftest import tiny_config

from hf_vit import VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.outputs import cards
from hf_vit.train.arguments import parse_args

METRICS = {"eval_accuracy": 0.5, "eval_split": "validation"}


def test_a_deit_runs_recipe_reads_as_written_on_the_command_line(tmp_path):
    _, _, training_args = parse_args("finetune", ["--recipe", "deit", "--output_dir", str(tmp_path / "run")])
    text = cards.training_recipe_text("finetune", training_args)
    assert "Names." not in text and "Type." not in text, text  # no enum reprs (OptimizerNames.ADAMW_TORCH)
    # The fine-tuning default's "momentum=0.9" is SGD's: AdamW never reads it.
    assert "momentum" not in text and "optimizer adamw_torch (betas 0.9, 0.999)" in text, text
    assert "cosine schedule with warmup over the first 1.67% of the steps" in text, text
    assert "0.016666" not in text and "no gradient clipping" in text, text  # DeiT clips nothing


def test_the_paper_recipes_name_the_settings_their_optimizer_reads(tmp_path):
    _, _, finetune = parse_args("finetune", ["--output_dir", str(tmp_path / "fine"), "--warmup_steps", "100"])
    text = cards.training_recipe_text("finetune", finetune)
    assert "optimizer sgd (momentum=0.9)" in text and "warmup over the first 100 steps" in text, text
    assert "gradient clipping at global norm 1," in text and "3 epochs" in text, text
    _, _, pretrain = parse_args("pretrain", ["--output_dir", str(tmp_path / "pre"), "--warmup_steps", "0"])
    text = cards.training_recipe_text("pretrain", pretrain)
    assert "optimizer adamw_torch (betas 0.9, 0.999)" in text and "linear schedule with no warmup" in text, text


def test_card_values():
    from transformers.trainer_utils import SchedulerType
    from transformers.training_args import OptimizerNames

    value = cards.card_value
    assert value(OptimizerNames.ADAMW_TORCH) == "adamw_torch" and value(SchedulerType.COSINE) == "cosine"
    assert value(5 / 300) == "0.01667" and value(3.125e-05) == "3.125e-05" and value(0.1) == "0.1"
    assert value(7.8125e-06) == "7.8125e-06" and value(3.0) == "3" and value(0.0) == "0"
    assert value(3) == "3" and value("momentum=0.9") == "momentum=0.9"


def card_text(folder, model) -> str:
    return cards.write_model_card(folder, model, METRICS, task="finetune", dataset_name="digits").read_text()


def test_the_cards_figures_say_how_many_images_they_were_measured_on(tmp_path):
    model = VisionTransformerForImageClassification(tiny_config())
    for count, warned in ((7, True), (50, False)):
        metrics = {**METRICS, "eval_samples": count}
        card = cards.write_model_card(tmp_path, model, metrics, task="finetune", dataset_name="digits").read_text()
        assert f"| validation | accuracy | 0.5000 | {count} images |" in card
        assert ("**Few images:** measured on only 7 images" in card) is warned


def test_a_native_aspect_models_card_gives_its_patch_budget(tmp_path):
    model = VisionTransformerForImageClassification(tiny_config())
    model.save_pretrained(tmp_path / "native")
    VisionTransformerImageProcessor(max_num_patches=64, patch_size=model.config.patch_size).save_pretrained(
        tmp_path / "native"
    )
    card = card_text(tmp_path / "native", model)
    height, width = model.config.image_hw
    assert f"Resolution: {height}x{width}." not in card
    assert f"Resolution: native aspect ratio, at most 64 patches of {model.config.patch_size}x" in card
    # A square model's card keeps its size.
    model.save_pretrained(tmp_path / "square")
    VisionTransformerImageProcessor(size=height).save_pretrained(tmp_path / "square")
    card = card_text(tmp_path / "square", model)
    assert f"Resolution: {height}x{width}." in card


def test_the_card_gives_the_runs_length_by_the_flag_that_set_it(tmp_path):
    by_steps = cards.training_recipe_text("finetune", flags(tmp_path, "--max_steps", "300", "--num_train_epochs", "3"))
    assert "300 optimisation steps" in by_steps and "epochs" not in by_steps
    by_epochs = cards.training_recipe_text("finetune", flags(tmp_path, "--num_train_epochs", "3"))
    assert "3 epochs" in by_epochs and "max_steps" not in by_epochs


def flags(tmp_path, *more):
    return parse_args("finetune", ["--output_dir", str(tmp_path / "run"), *more])[2]
