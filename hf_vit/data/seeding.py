"""Random numbers fixed by a run's seed and a key (an epoch, a step, an example), reading or advancing no random
stream: what makes a run's shuffles, draws and augmentations reproducible and resumable, in every process alike."""

from __future__ import annotations

import hashlib

import torch


def seeded_int(*key: object) -> int:
    """A 64-bit number fixed by the parts of `key` (joined by ":", as text)."""
    text = ":".join(str(part) for part in key)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def seeded_generator(*key: object) -> torch.Generator:
    """A CPU generator seeded by `seeded_int(*key)`."""
    return torch.Generator().manual_seed(seeded_int(*key) % 2**63)
