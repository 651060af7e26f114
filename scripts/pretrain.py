#!/usr/bin/env python
"""Pretrain a Vision Transformer with the paper's recipe (Adam, weight decay 0.1, linear warmup and decay, pre-logits).

    python scripts/pretrain.py --output_dir out/pretrain --preset vit-tiny-patch16-224 --dataset_name digits
    torchrun --nproc_per_node 8 scripts/pretrain.py ...      # or: accelerate launch scripts/pretrain.py ...

Every `transformers.TrainingArguments` flag works; see `--help`.
"""

from hf_vit.commands.train import pretrain

if __name__ == "__main__":
    pretrain()
