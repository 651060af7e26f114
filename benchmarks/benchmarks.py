"""What `import benchmarks` finds when a script of this folder runs as a file (`python benchmarks/gpu.py`), the folder
being first on the path: this puts the repository's root there instead (from then on the folder's modules shadow no
others) and hands over the package in its place, so that the scripts' `benchmarks.*` imports work either way."""

import sys
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
sys.path[:] = [str(FOLDER.parent) if Path(entry or ".").resolve() == FOLDER else entry for entry in sys.path]
del sys.modules[__name__]
import benchmarks  # noqa: E402, F401  (the package, found first now: the import that found this module returns it)
