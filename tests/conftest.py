import os

import pytest
import torch

# The tests never reach the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))


def tiny_config(**overrides):
    from hf_vit import VisionTransformerConfig

    fields = dict(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=5,
    )
    fields.update(overrides)
    return VisionTransformerConfig(**fields)


@pytest.fixture
def config():
    return tiny_config()
