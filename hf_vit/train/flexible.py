"""Training with a size drawn per batch: a sequence length for native-aspect batches (`--seq_lens`, as timm's NaFlex
loader: `SeqLenBatchSampler`) or a patch size (`--patch_sizes`, as FlexiViT trains: `PatchSizeDraw`, `at_patch_size`).
Every draw is a function of the run's seed and the batch's place in the run, never of a random stream: every process
draws the same size for the same step, and a resumed run draws the sizes the uninterrupted run would have.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..data.seeding import seeded_generator, seeded_int
from ..model.resolution import grid_for, resample_patch_embedding


class SeqLenBatchSampler:
    """Batches of `(index, seq_len)` keys for a `SeededAugmentation` split (see the module docstring).

    `dataset`: the training split (its shared `epoch`, set by `EpochToDataset` as each epoch begins, chooses the
    epoch's order); `max_tokens_per_batch`: the patches one process's batch may hold (at least the longest length, as
    the flags check), its batch size at length `s` being `max_tokens_per_batch // s`; `num_processes`: the processes
    the batches are dealt to. An epoch's last step fills its batches from the epoch's first examples, so every
    process's batch is full."""

    batch_size = None  # varies per batch: accelerate deals such batches out whole, one per process
    drop_last = True  # every batch is full: nothing is left over for accelerate to cycle in

    def __init__(
        self, dataset: Any, seq_lens: Sequence[int], max_tokens_per_batch: int, seed: int, num_processes: int = 1
    ) -> None:
        self.dataset, self.seq_lens = dataset, list(seq_lens)
        self.max_tokens_per_batch, self.seed, self.num_processes = max_tokens_per_batch, seed, num_processes
        self.num_examples = len(dataset)
        self.schedule = self._schedule()

    def batch_size_for(self, seq_len: int) -> int:
        return max(1, self.max_tokens_per_batch // seq_len)

    def _schedule(self) -> list[int]:
        """One epoch's sequence lengths, drawn from the seed: steps until every example is in a batch."""
        lengths, covered = [], 0
        while covered < self.num_examples:
            length = self.seq_lens[seeded_int(self.seed, "seq_len", len(lengths)) % len(self.seq_lens)]
            lengths.append(length)
            covered += self.batch_size_for(length) * self.num_processes
        return lengths

    def seq_lens_of_epoch(self, epoch: int) -> list[int]:
        """The sequence length of each step of `epoch`: the schedule permuted by `(seed, epoch)`."""
        order = torch.randperm(len(self.schedule), generator=seeded_generator(self.seed, "schedule", epoch))
        return [self.schedule[i] for i in order.tolist()]

    def __len__(self) -> int:
        return len(self.schedule) * self.num_processes

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = int(getattr(self.dataset, "epoch", 0))
        order = torch.randperm(self.num_examples, generator=seeded_generator(self.seed, "order", epoch)).tolist()
        position = 0
        for seq_len in self.seq_lens_of_epoch(epoch):
            for _ in range(self.num_processes):  # process r trains the r-th of these (BatchSamplerShard)
                size = self.batch_size_for(seq_len)
                indices = [order[(position + i) % self.num_examples] for i in range(size)]
                position += size
                yield [(index, seq_len) for index in indices]


class PatchSizeDraw:
    """The patch size of each optimisation step: one of `patch_sizes` (with `probabilities`, else uniform) drawn from
    `(seed, step)`."""

    def __init__(self, patch_sizes: Sequence[int], probabilities: Sequence[float] | None, seed: int) -> None:
        # `--patch_size_probs` is checked with the flags (`arguments.check_flexible_flags`)
        self.patch_sizes, self.seed = list(patch_sizes), seed
        weights = torch.tensor(probabilities or [1.0] * len(patch_sizes), dtype=torch.float64)
        self.cumulative = (weights / weights.sum()).cumsum(0).tolist()

    def __call__(self, step: int) -> int:
        uniform = (seeded_int(self.seed, "patch_size", step) >> 11) / 2**53  # in [0, 1)
        index = next((i for i, edge in enumerate(self.cumulative) if uniform < edge), len(self.patch_sizes) - 1)
        return self.patch_sizes[index]


class _ResampledPatchEmbedding(nn.Module):
    """The stored patch embedding applied to `patch_size` patches: its kernel resampled on every call."""

    def __init__(self, stored: nn.Conv2d, patch_size: int) -> None:
        super().__init__()
        self.stored, self.patch_size = stored, patch_size
        self.stride, self.kernel_size = (patch_size, patch_size), (patch_size, patch_size)

    @property
    def weight(self) -> torch.Tensor:  # read by the native-aspect path as the linear map E
        return resample_patch_embedding(self.stored.weight, self.patch_size)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.stored.bias

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return F.conv2d(pixels, self.weight, self.bias, stride=self.patch_size)


@contextlib.contextmanager
def at_patch_size(model: nn.Module, patch_size: int) -> Iterator[None]:
    """Inside the block, `model` (an hf-vit model, or a LoRA adapter of one) runs on `patch_size` patches: its config
    says that patch size and an image size whose grid at it is the stored position grid, so that a forward with
    `interpolate_pos_encoding=True` resamples the stored positions to each image's grid, and the patch embedding is
    the stored kernel resampled by `resample_patch_embedding` on every call. Everything is restored on leaving; the
    stored parameters are the ones trained."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a LoRA adapter's model
    config = inner.config
    if patch_size == config.patch_size:
        yield
        return
    if config.resnet_layers is not None:
        raise ValueError("--patch_sizes resamples a linear patch embedding: a hybrid's (ResNet stem) is not one.")
    embeddings = inner.base_model.embeddings
    stored, saved = embeddings.patch_embedding, (config.patch_size, config.image_size)
    rows, cols = config.grid_size
    embeddings.patch_embedding = _ResampledPatchEmbedding(stored, patch_size)
    config.patch_size, config.image_size = patch_size, [rows * patch_size, cols * patch_size]
    try:
        yield
    finally:
        embeddings.patch_embedding = stored
        config.patch_size, config.image_size = saved


def check_patch_sizes(patch_sizes: Sequence[int], image_size: Any) -> None:
    """Refuse patch sizes that do not tile the training images, naming the flag."""
    for patch in patch_sizes:
        try:
            grid_for(image_size, patch)
        except ValueError as error:
            raise ValueError(f"--patch_sizes {','.join(map(str, patch_sizes))}: {error}") from error
