r"""Whether the packages brought as wheels (installed with `--no-deps`) find what they require, in the Python that
runs this: one line per unmet requirement (`datasets requires pyarrow>=24.0.0; found 23.0.1`), exit status 1 if any.

    python benchmarks/wheel_requirements.py .whl                       # check the wheels of .whl/
    python benchmarks/wheel_requirements.py .whl --fallback .whl/fallback   # also: print the fallback wheels that
                                                                            # meet an unmet requirement, one a line

`gpu_session.sh` installs those fallback wheels too (a large one, e.g. pyarrow, travels there so that it replaces the
machine's own only where that is too old). Requirements with extras or markers that do not apply are left out.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename


def wheel_requirements(wheel: Path) -> tuple[str, list[Requirement]]:
    """The distribution name of `wheel` and its requirements that apply here (no extras, markers evaluated)."""
    name = parse_wheel_filename(wheel.name)[0]
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    requirements = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return name, [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def unmet(wheels: list[Path]) -> list[tuple[str, Requirement, str | None]]:
    """(wheel's package, requirement, version found or None) for each requirement the environment does not meet."""
    missing = []
    for wheel in wheels:
        name, requirements = wheel_requirements(wheel)
        for requirement in requirements:
            try:
                found = importlib.metadata.version(requirement.name)
            except importlib.metadata.PackageNotFoundError:
                found = None
            if found is None or not requirement.specifier.contains(found, prereleases=True):
                missing.append((str(name), requirement, found))
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the folder of wheels that were installed")
    parser.add_argument("--fallback", type=Path, default=None, help="a folder of wheels to offer for unmet ones")
    args = parser.parse_args(argv)
    wheels = sorted(args.folder.glob("*.whl"))
    if not wheels:
        parser.error(f"{args.folder} holds no .whl file")
    missing = unmet(wheels)
    fallbacks = sorted(args.fallback.glob("*.whl")) if args.fallback and args.fallback.is_dir() else []
    offered = []
    for package, requirement, found in missing:
        print(f"{package} requires {requirement}; found {found or 'nothing'}", file=sys.stderr)
        for wheel in fallbacks:
            name, version = parse_wheel_filename(wheel.name)[:2]
            if name == canonicalize_name(requirement.name) and requirement.specifier.contains(version):
                offered.append(str(wheel))
    print("\n".join(dict.fromkeys(offered)))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
