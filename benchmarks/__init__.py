"""The side-by-side benchmark of hf-vit against transformers' and timm's ViT: not part of the installed package.

`benchmarks/benchmark.py` is the CPU command line and `gpu.py` the GPU one; `measure.run_benchmark` runs the
sections of `runners.py` (built from `models`, `timing`, `memory`, `inputs`, `onnx_runtime` and `profiling`), and
`report.py` makes the tables. README.md describes the files and how to run the GPU benchmark.
"""
