"""benchmarks/gpu_checks.py on CPU: every check that can run here passes with tiny models, the CUDA-only ones are
printed as skipped with their reason, and a failing check makes the exit status non-zero."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed with hf_vit

from benchmarks import gpu_checks  # noqa: E402

CPU_CHECKS = [
    "attention_implementations",
    "gradient_checkpointing",
    "interpolate_pos_encoding",
    "hybrid",
    "masked_patch_prediction",
    "attention_capture",
    "onnx_export_of_a_trained_model",
    "native_aspect_batches",
]
CUDA_CHECKS = [
    "finetune_bf16_compiled_from_hub_id",
    "resume_after_a_kill",
    "recipe_deit_resumes_bit_for_bit",
    "ema_update_cost",
    "fsdp_through_accelerate",
]


def test_cpu_part_passes_and_names_what_needs_a_gpu(tmp_path, capsys):
    # In this process: the script's own start (`python gpu_checks.py`) is the same `main`, and a fresh process would
    # import torch and transformers once more.
    report = tmp_path / "smoke.json"
    code = gpu_checks.main(["--device", "cpu", "--json", str(report)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout[-3000:]
    lines = [line for line in stdout.splitlines() if line.split(" ", 1)[0] in ("passed", "failed", "skipped")]
    assert [line.split()[1] for line in lines] == CPU_CHECKS + CUDA_CHECKS  # one line per check, in order
    data = json.loads(report.read_text())
    assert data["device"] == "cpu"
    assert {name: data["checks"][name]["status"] for name in CPU_CHECKS} == dict.fromkeys(CPU_CHECKS, "passed")
    for name in CUDA_CHECKS:
        assert data["checks"][name]["status"] == "skipped" and "needs CUDA" in data["checks"][name]["detail"]
    assert stdout.rstrip().endswith(f"{len(CPU_CHECKS)} passed, 0 failed, {len(CUDA_CHECKS)} skipped")
    attention = data["details"]["attention_implementations"]
    assert "sdpa" in attention["relative_difference"] and attention["relative_difference"]["eager"] == 0.0
    assert max(attention["relative_difference"].values()) <= gpu_checks.BF16_RELATIVE_TOLERANCE
    # flash attention needs CUDA (and its package): it is reported as not loading, with the error
    assert "flash_attention_2" in attention["skipped"] and attention["skipped"]["flash_attention_2"]


def test_a_failing_check_makes_the_exit_status_non_zero(monkeypatch, capsys):
    def broken(smoke):
        raise AssertionError("logits differ by 1.0e+00")

    monkeypatch.setitem(gpu_checks.CHECKS, "broken", (broken, None))
    assert gpu_checks.main(["--device", "cpu", "--only", "interpolate_pos_encoding", "broken"]) == 1
    out = capsys.readouterr().out
    assert "passed  interpolate_pos_encoding" in out
    assert "failed  broken" in out and "AssertionError: logits differ by 1.0e+00" in out
    assert out.rstrip().endswith("1 passed, 1 failed, 0 skipped")


def test_unknown_check_and_missing_cuda_are_usage_errors(capsys):
    with pytest.raises(SystemExit):
        gpu_checks.parse_args(["--only", "warp_drive"])
    assert "unknown check(s) ['warp_drive']" in capsys.readouterr().err
    if not gpu_checks.torch.cuda.is_available():
        with pytest.raises(SystemExit):
            gpu_checks.parse_args(["--device", "cuda"])
        assert "CUDA is not available" in capsys.readouterr().err


def test_wheel_requirements_names_what_the_machine_lacks_and_offers_fallbacks(tmp_path, capsys):
    """benchmarks/wheel_requirements.py reads each wheel's Requires-Dist: a requirement this environment meets is
    quiet, one it lacks or has too old is printed with the version found, and a fallback wheel that meets it is
    offered (one that does not, is not)."""
    import zipfile

    import numpy

    from benchmarks import wheel_requirements

    def wheel(folder, name, version, requires=()):
        folder.mkdir(exist_ok=True)
        path = folder / f"{name}-{version}-py3-none-any.whl"
        metadata = [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(metadata) + "\n")
        return path

    requires = [
        "numpy>=1.0",
        "numpy<1.0; python_version < '3'",
        "numpy>=999",
        "no-such-package-q7>=1",
        'pytest; extra == "t"',
    ]
    wheel(tmp_path / "whl", "carried", "1.0", requires)
    fallback = tmp_path / "fallback"
    offered = wheel(fallback, "numpy", "1000.0")
    wheel(fallback, "no_such_package_q7", "0.5")  # too old for >=1: not offered
    assert wheel_requirements.main([str(tmp_path / "whl"), "--fallback", str(fallback)]) == 1
    captured = capsys.readouterr()
    assert captured.out.split() == [str(offered)]
    assert captured.err.splitlines() == [
        f"carried requires numpy>=999; found {numpy.__version__}",
        "carried requires no-such-package-q7>=1; found nothing",
    ]
    wheel(tmp_path / "met", "carried", "1.0", ["numpy>=1.0"])
    assert wheel_requirements.main([str(tmp_path / "met")]) == 0
