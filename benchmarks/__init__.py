"""The side-by-side benchmark of hf-vit against transformers' and timm's ViT: not part of the installed package.

`benchmarks/benchmark.py` is the command line, `measure.py` does the measuring and `report.py` the tables.
"""
