"""The command-line programs `pip install hf-vit` puts on the PATH (`[project.scripts]` in pyproject.toml); the files
in the repository's `scripts/` folder are thin wrappers over the same functions.

    hf-vit-pretrain, hf-vit-finetune   training (every TrainingArguments flag; torchrun, accelerate launch)
    hf-vit-convert                     foreign checkpoints (.npz, timm, transformers) to hf-vit folders
    hf-vit-resize                      resolution variants (position embeddings resampled)
    hf-vit-export                      ONNX / torch.export
    hf-vit-visualize                   the section 4.5 figures
    hf-vit-push                        a folder to the Hub, exactly the files the project writes
"""

from __future__ import annotations


def pretrain() -> int:
    """`hf-vit-pretrain`: the paper's pretraining recipe (see `hf_vit.run.training.main`)."""
    from ..run.training import main

    main("pretrain")
    return 0


def finetune() -> int:
    """`hf-vit-finetune`: the paper's fine-tuning recipe (see `hf_vit.run.training.main`)."""
    from ..run.training import main

    main("finetune")
    return 0
