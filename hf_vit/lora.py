"""Kept for code written against earlier releases: the adapter stage lives in `hf_vit.train.lora`."""

from .train.lora import load_lora_model, save_merged_model

__all__ = ["load_lora_model", "save_merged_model"]
