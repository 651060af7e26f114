"""Kept for code written against earlier releases: pushing lives in `hf_vit.outputs.push`, cards in
`hf_vit.outputs.cards`."""

from .outputs.push import push_folder_to_hub

__all__ = ["push_folder_to_hub"]
