import warnings

from hf_vit.outputs.plotting import plot_training_curves


def test_curves_are_written_with_and_without_evaluation(tmp_path):
    history = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an empty panel must not make matplotlib warn about a missing legend
        trained_only = plot_training_curves(history, tmp_path / "a.png", title="no eval")
        evaluated = plot_training_curves(
            history + [{"step": 2, "eval_loss": 1.4, "eval_accuracy": 0.5, "eval_top5_accuracy": 0.9}],
            tmp_path / "b.png",
        )
        empty = plot_training_curves([], tmp_path / "c.png")
    for path in (trained_only, evaluated, empty):
        assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 1000


def test_a_failed_write_leaves_the_old_figure_not_a_truncated_one(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    history = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    path = plot_training_curves(history, tmp_path / "curves.png")
    before = path.read_bytes()

    def disk_full(self, file, **kwargs):
        file.write(b"\x89PNG")  # what a full disk leaves: the first bytes
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full)
    try:
        plot_training_curves(history, path)
    except OSError as error:
        assert error.errno == 28
    else:
        raise AssertionError("the write error was swallowed")
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["curves.png"]
