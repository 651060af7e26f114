"""The side-by-side benchmark of hf-vit against transformers' and timm's ViT: not part of the installed package.
`benchmark.py` (CPU) and `gpu.py` (GPU) run the sections of `runners.py`; `report.py` makes the tables."""
