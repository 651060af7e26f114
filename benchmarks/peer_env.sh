#!/usr/bin/env bash
# The comparison environment of the benchmark: hf-vit with timm and torchvision beside it, so that benchmarks/benchmark.py
# measures their ViTs in the same process (their columns are absent where `import timm` fails). For measuring only:
# never part of installing hf-vit, of `make setup` or of CI.
#
#   bash benchmarks/peer_env.sh [VENV]     from the repository's root; VENV defaults to ~/.cache/hfvit-peer-env
#   make bench BENCH_PY=VENV/bin/python
#
# A torchvision wheel built for CUDA imports its compiled operators at start-up and fails on a CPU-only torch
# ("operator torchvision::nms does not exist") while registering their fake kernels. Neither timm nor the transforms
# the benchmark uses need those operators, so where that happens this script makes that one registration step
# tolerate the failure in the environment's copy of torchvision.
set -euo pipefail
VENV=${1:-$HOME/.cache/hfvit-peer-env}
[ -f pyproject.toml ] && [ -d hf_vit ] || { echo "run this from the hf-vit repository's root" >&2; exit 2; }
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet -c constraints.txt)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e ".[dev]"
"$VENV/bin/python" -m pip install --quiet --no-deps torchvision==0.28.0 timm==1.0.29
"$VENV/bin/python" -m pip install --quiet pyyaml  # timm's one dependency hf-vit does not already bring
"$VENV/bin/python" - <<'PY'
import importlib.util
from pathlib import Path

init = Path(importlib.util.find_spec("torchvision").origin)
text = init.read_text()
eager = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
tolerant = (
    "try:  # a CUDA build on a CPU-only torch: its compiled operators are absent, and unused here\n"
    "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
    "except RuntimeError:\n"
    "    pass\n"
    "from torchvision import (\n"
)
if eager in text:
    init.write_text(text.replace(eager, tolerant))
PY
"$VENV/bin/python" -c "
import timm, torch, torchvision.transforms, hf_vit
model = timm.create_model('vit_tiny_patch16_224', pretrained=False, img_size=32, patch_size=8)
print('comparison environment ready: timm', timm.__version__, '| logits', tuple(model(torch.randn(1, 3, 32, 32)).shape))"
