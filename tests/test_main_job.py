"""The main job's script (`make train`), its stages stood in for: what it prints and writes about itself."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    """A clock that moves a minute each time it is read."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 60.0
        return self.now


def test_the_job_prints_one_total_time_that_counts_every_stage(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("main_job_script", ROOT / "scripts" / "main_job.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)

    def train(task, model_args, data_args, training_args):
        Path(training_args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(training_args.output_dir) / "training_curves.png").write_bytes(b"")
        return {"eval_accuracy": 0.5, "eval_samples": 360}

    class Loaded:
        @staticmethod
        def from_pretrained(path):
            return Loaded()

        def eval(self):
            return self

    class Digits:
        def select(self, indices):
            return {"image": [], "label": []}

    monkeypatch.setattr(job, "time", Clock())
    monkeypatch.setattr(job, "train", train)
    monkeypatch.setattr(job, "estimate_minutes", lambda args: 1.0)
    loads = iter([(0.5, 2), (3.4, 2)])  # the load when the estimate is made, and at the end
    monkeypatch.setattr(job, "machine_load", lambda: next(loads))
    monkeypatch.setattr(job, "write_model_card", lambda *args, **kwargs: None)
    monkeypatch.setattr(job, "write_analysis_figures", lambda *args, **kwargs: None)
    monkeypatch.setattr(job, "make_evaluated_variant", lambda *args, **kwargs: {"eval_accuracy": 0.4})
    monkeypatch.setattr(job, "load_digits_dataset", lambda: {"test": Digits()})
    monkeypatch.setattr(job, "VisionTransformerForImageClassification", Loaded)
    monkeypatch.setattr(job, "VisionTransformerImageProcessor", Loaded)
    out = tmp_path / "quick"
    monkeypatch.setattr(sys, "argv", ["main_job.py", "--quick", "--output_dir", str(out),
                                      "--pretrain_dir", str(tmp_path / "pretrain")])  # fmt: skip
    job.main()
    recorded = json.loads((out / "main_job.json").read_text())
    printed = capsys.readouterr().out.strip().splitlines()
    first, last = printed[0], printed[-1]
    assert "about 60 seconds on this machine now" in first and "load 0.5 on 2 cores; measured" in first, first
    assert f"in {recorded['total_minutes']:.1f} minutes (estimated 1.0 at load 0.5 on 2 cores; load 3.4" in last
    assert (recorded["load_at_estimate"], recorded["load_at_end"]) == (0.5, 3.4)
    assert "test accuracy 0.5000 on 360 images" in last and recorded["test_images"] == 360
    assert recorded["total_minutes"] > recorded["pretrain_minutes"] + recorded["finetune_minutes"]  # stage 3 too
