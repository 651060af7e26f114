"""benchmarks/wheel_requirements.py, which gpu_session.sh asks what the wheels brought to a GPU machine require."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed with hf_vit


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
