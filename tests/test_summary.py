"""What a user meets at both ends of a run: a mistyped or guessed flag answered with the flag meant, and a run that
ends by saying where its model is, what it measured on which split, what to run next, and when it learned nothing."""

import logging
import math
import subprocess
import sys

import pytest
from test_training import QUIET, ROOT, TINY_RUN, split_image_folder

from hf_vit import VisionTransformerConfig
from hf_vit.train.arguments import parse_args
from hf_vit.train.summary import chance_warning
from hf_vit.train.training import train


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--train_dir", "shapes"], "--train_dir: the data set is --dataset_name"),
        (["--data", "shapes"], "--data: the data set is --dataset_name"),  # not taken as --data_seed
        (["--dataset", "shapes"], "--dataset: the data set is --dataset_name"),  # not taken as --dataset_name
        (["--learning_rat", "0.1"], "--learning_rat: did you mean --learning_rate?"),
        (["--num_train_epoch", "3"], "--num_train_epoch: did you mean --num_train_epochs?"),
    ],
)
def test_unknown_flags_are_answered_with_the_flag_meant(tmp_path, flags, named):
    with pytest.raises(ValueError) as error:
        parse_args("finetune", ["--output_dir", str(tmp_path), *flags])
    assert named in str(error.value) and "HfArgumentParser" not in str(error.value)


def test_a_guessed_flag_is_one_error_line_with_exit_status_2(tmp_path, monkeypatch, capsys):
    """The script as users run it (all its process prints is the line); a flag's bad value through the same command's
    function in this process (each script start imports torch and transformers anew)."""
    from hf_vit.commands.train import finetune

    script = [sys.executable, str(ROOT / "scripts" / "finetune.py"), "--output_dir", str(tmp_path / "out")]
    done = subprocess.run(script + ["--train_dir", "shapes"], capture_output=True, text=True)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error:") and "--dataset_name" in lines[0]
    argv = ["finetune.py", "--output_dir", str(tmp_path / "out"), "--num_train_epochs", "many"]
    monkeypatch.setattr(sys, "argv", argv)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        finetune()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(lines) == 1 and "--num_train_epochs" in lines[0], lines
    assert lines[0].startswith("error:") and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["convert", "evaluate", "export", "predict", "push", "resize"])
def test_every_other_command_answers_a_bad_flag_in_one_error_line(capsys, command):
    import importlib

    main = importlib.import_module(f"hf_vit.commands.{command}").main
    with pytest.raises(SystemExit) as done:
        main(["--modle", "x"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error:") and lines[0].endswith("(--help lists the flags)")


def tiny_run(tmp_path, data, learning_rate, epochs="1"):
    args = ["--output_dir", str(tmp_path / "out"), "--dataset_name", str(data), *TINY_RUN]
    args += ["--learning_rate", learning_rate, "--num_train_epochs", epochs, "--logging_steps", "1"]
    args += ["--eval_strategy", "no", "--save_strategy", "no", *QUIET]
    return train("pretrain", *parse_args("pretrain", args))


def test_a_run_ends_with_its_summary_and_a_run_at_chance_says_so(tmp_path, capsys, caplog):
    data = split_image_folder(tmp_path / "data")
    caplog.set_level(logging.INFO, logger="hf_vit")
    # learning rate 0: the weights never move. The pretraining head starts at zero (as the paper's does), so every
    # image gets 1/2 per class and the loss is ln 2 exactly.
    metrics = tiny_run(tmp_path, data, "0")
    printed = capsys.readouterr().out
    out = (tmp_path / "out").resolve()
    assert f"the model is in {out}" in printed
    assert f"accuracy on the test split: {metrics['eval_accuracy']:.4f} (8 images)" in printed  # 4 cats, 4 dogs
    few = [line for line in printed.splitlines() if "measured on only 8 images" in line]
    assert len(few) == 1 and few[0].startswith("  WARNING: ")
    card = (out / "README.md").read_text()
    assert f"| test | accuracy | {metrics['eval_accuracy']:.4f} | 8 images |" in card
    assert "**Few images:** measured on only 8 images" in card
    assert f"hf-vit-predict --model {out} " in printed
    assert f"hf-vit-evaluate --model {out} --dataset_name {data.resolve()} --split test" in printed
    assert f"hf-vit-export --model {out} --format onnx" in printed and f"hf-vit-push --model {out} " in printed
    warnings = [line for line in printed.splitlines() if "WARNING" in line and "chance" in line]
    assert len(warnings) == 1 and f"ln 2 = {math.log(2):.4f}" in warnings[0] and "--learning_rate" in warnings[0]
    assert "the model is in" not in caplog.text  # printed once: the log keeps it at DEBUG


def test_a_figure_on_50_images_or_more_is_said_without_the_warning(tmp_path, capsys):
    from hf_vit.train.summary import summarize_run

    config = VisionTransformerConfig(id2label={0: "a", 1: "b"})
    for count, warned in ((49, True), (50, False)):
        metrics = {"eval_accuracy": 0.5, "eval_split": "validation", "eval_samples": count}
        lines = summarize_run("finetune", tmp_path, metrics, [], config, 0.1, 10)
        assert f"  accuracy on the validation split: 0.5000 ({count} images)" in lines
        assert any(f"WARNING: measured on only {count} images" in line for line in lines) is warned


def test_the_chance_warning_is_for_losses_within_5_percent_of_ln_c():
    chance = math.log(4)
    single = "single_label_classification"
    assert chance_warning(1.3856, 4, single, 0.1)  # the reported run: 4 classes, 1.3856
    assert chance_warning(chance * 1.049, 4, single, 0.1)
    assert chance_warning(chance * 0.951, 4, single, 0.1)
    assert chance_warning(chance * 1.06, 4, single, 0.1) is None
    assert chance_warning(chance * 0.5, 4, single, 0.1) is None
    assert chance_warning(chance, 4, "multi_label_classification", 0.1) is None  # ln C is not its chance level


def test_the_chance_advice_names_the_flag_that_set_the_runs_length():
    chance = math.log(3)
    by_steps = chance_warning(chance, 3, "single_label_classification", 0.05, max_steps=40, epochs_done=2.5)
    assert "more --max_steps (this run: 40)" in by_steps and "--num_train_epochs" not in by_steps
    by_epochs = chance_warning(chance, 3, "single_label_classification", 0.05, max_steps=-1, epochs_done=2)
    assert "more --num_train_epochs (this run: 2)" in by_epochs and "--learning_rate (this run: 0.05)" in by_epochs


def test_help_says_what_a_no_twin_of_a_flag_on_by_default_does(capsys):
    with pytest.raises(SystemExit):
        parse_args("finetune", ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    twin = text[text.index("--no_check_eval_images, --no-check-eval-images") :][:120]
    assert "Turn --check_eval_images off (it is on by default)." in twin and "default: False" not in twin
    assert not parse_args("finetune", ["--output_dir", "x", "--no_check_eval_images"])[2].check_eval_images
    assert parse_args("finetune", ["--output_dir", "x"])[2].check_eval_images


def test_the_suggested_evaluation_names_the_runs_held_out_share():
    from hf_vit.train.summary import next_commands

    default = next_commands("out", "digits", "finetune", "validation")
    assert any(c.endswith("--split validation") for c in default)
    other = next_commands("out", "digits", "finetune", "validation", validation_fraction=0.25)
    assert any(c.endswith("--split validation --validation_fraction 0.25") for c in other)
    assert not any("--validation_fraction" in c for c in next_commands("out", "d", "finetune", "test", 0.25))


def test_a_run_prints_each_line_once_and_no_noise(tmp_path):
    """The script as users run it: the summary, the warnings and the final metrics appear once each across stdout
    and stderr, and datasets' "couldn't be hashed" warning about the lazy transforms is not shown."""
    data = split_image_folder(tmp_path / "data")
    args = ["--output_dir", str(tmp_path / "out"), "--dataset_name", str(data), *TINY_RUN, "--max_steps", "2"]
    args += ["--learning_rate", "0", "--eval_strategy", "no", "--save_strategy", "no", *QUIET]
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pretrain.py"), *args], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    both = done.stdout + done.stderr
    assert both.count("the model is in") == 1 and both.count("is at chance level") == 1, both
    assert both.count("hf-vit-evaluate --model") == 1
    assert "couldn't be hashed" not in both
    table = both[both.index("***** all metrics *****") :].splitlines()[1:]
    shown = [line.split("=")[0].strip() for line in table if line.startswith("  ") and "=" in line]
    assert "test_accuracy" in shown and "eval_accuracy" not in shown and len(shown) == len(set(shown))
