"""What the installed commands say about their own flags: every flag `--help` lists has a description, a flag's bad
value is one `error:` line naming it (exit 2) before any model is loaded, and `--help` points to what an installed
package has (console commands, not the repository's scripts)."""

import re

import pytest

from hf_vit.commands import predict, resize


def help_text(command, capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        command.main(["--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("value", ["-1", "0"])
def test_predict_refuses_a_batch_size_below_one_by_name(value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        predict.main(["--model", str(tmp_path / "no-model"), str(tmp_path / "no-image.png"), "--batch_size", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --batch_size must be at least 1, got ") and err.count("\n") == 1, err


def test_predicts_batch_size_has_help(capsys):
    text = help_text(predict, capsys)
    options = text[text.index("\noptions:") :]
    flag = options[options.index("--batch_size BATCH_SIZE") :].split("\n  --")[0]
    assert "images per forward pass" in " ".join(flag.split()), flag


def test_resizes_help_names_the_console_command_not_a_script(capsys):
    text = help_text(resize, capsys)
    assert "scripts/" not in text and ".py" not in text
    assert "hf-vit-convert --help" in text and "--overwrite replaces only a folder hf-vit wrote" in text


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--num_train_epochs", "-1"], "--num_train_epochs -1 trains nothing: give a positive number of epochs"),
        (["--max_steps", "-5", "--num_train_epochs", "0"], "--num_train_epochs 0 trains nothing"),
        (["--learning_rate", "-0.1"], "--learning_rate -0.1: must be at least 0."),
        (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0: must be at least 1."),
        (["--image_size", "64", "-32"], "--image_size -32: must be at least 1."),
    ],
)
def test_a_value_below_its_flags_least_or_nothing_to_train_is_refused_by_the_command_too(argv, said, tmp_path):
    # what the console commands tell before torch loads (tests/test_help.py), the command checks again
    from hf_vit.train.arguments import parse_args

    with pytest.raises(ValueError, match=re.escape(said)):
        parse_args("pretrain", argv + ["--output_dir", str(tmp_path / "out")])
    for fine in (["--num_train_epochs", "0", "--max_steps", "3"], ["--do_train", "False", "--num_train_epochs", "0"]):
        parse_args("pretrain", fine + ["--output_dir", str(tmp_path / "out")])
