#!/usr/bin/env python
"""Fine-tune a pretrained hf-vit model with the paper's recipe (SGD momentum 0.9, cosine decay, clipping at 1,
a new zero-initialised head), optionally at a higher resolution than pretraining.

    python scripts/finetune.py --model_name_or_path out/pretrain --image_size 384 --output_dir out/finetune
    torchrun --nproc_per_node 8 scripts/finetune.py ...      # or: accelerate launch scripts/finetune.py ...

Every `transformers.TrainingArguments` flag works; see `--help`.
"""

from hf_vit.commands.train import finetune

if __name__ == "__main__":
    finetune()
