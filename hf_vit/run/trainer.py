"""The Trainer of a run and its callbacks: reproducible augmentation across resumption, evaluation that leaves the
training's random numbers alone, clear errors when a checkpoint cannot be written, and the run's set-up line."""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import os
import random
import re
import shutil
from functools import partial
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import seed_worker

from ..model.loading import give_weights_the_umask_mode
from ..outputs.files import CARD_FILE
from ..outputs.push import PlannedHubPushes
from .flexible import PatchSizeDraw, SeqLenBatchSampler, at_patch_size
from .recipes import RecipeTrainerMixin
from .transforms import batch_max_num_patches

logger = logging.getLogger(__name__)


class SeededAugmentation(torch.utils.data.Dataset):
    """A training split whose random augmentation of example `i` in epoch `e` is drawn from a generator seeded by
    `(seed, e, i)`, not from the global random stream at the moment the example is fetched.

    This is what makes resuming exact: the data loader fetches batches ahead (accelerate one batch, workers
    several), so with the global stream an interrupted and an uninterrupted run augment the batches after the
    checkpoint with different numbers. The epoch lives in shared memory so that persistent workers see it change.
    An `(index, max_num_patches)` key (from `flexible.SeqLenBatchSampler`) fetches example `index` at that number of
    patches.
    """

    def __init__(self, data, seed: int) -> None:
        self.data = data
        self.seed = seed
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int | tuple[int, int]):
        index, max_num_patches = index if isinstance(index, tuple) else (index, None)
        key = hashlib.blake2b(f"{self.seed}:{int(self.epoch)}:{index}".encode(), digest_size=8).digest()
        with torch.random.fork_rng(devices=[]), batch_max_num_patches(max_num_patches):
            # The CPU generator only, as fork_rng restores: `torch.manual_seed` would also queue (or, where CUDA is
            # up, do) a reseeding of every accelerator's generator per example, each call formatting a stack.
            torch.default_generator.manual_seed(int.from_bytes(key, "little"))
            return self.data[index]


class EpochToDataset(TrainerCallback):
    """Tells a `SeededAugmentation` which epoch starts (accelerate forwards it only to samplers)."""

    def __init__(self, dataset: SeededAugmentation) -> None:
        self.dataset = dataset

    def on_epoch_begin(self, args: TrainingArguments, state, control, **kwargs: Any) -> None:
        # At an epoch's start `state.epoch` is the number of epochs done, fractional when resuming mid-epoch.
        self.dataset.set_epoch(math.floor(state.epoch + 1e-6))


class VisionTransformerTrainer(RecipeTrainerMixin, PlannedHubPushes, Trainer):
    """`Trainer` with the guarantees the scripts promise, and the recipes' parts (`recipes.RecipeTrainerMixin`:
    layer-wise learning-rate decay, Mixup/CutMix, the weights' EMA).

    - Every push sends exactly the files the project's upload plan lists, and the token never reaches disk
      (`hf_vit.outputs.push.PlannedHubPushes`).

    - Evaluation does not consume the training's random numbers (its data loader draws a seed), so a checkpoint saved
      right before an evaluation resumes to the same weights (with `SeededAugmentation` for the training split).
    - A checkpoint that cannot be written (a full disk) stops the run with the folder and the free space named.
    - Sizes drawn per batch (`flexible.py`): with `seq_len_sampler` the training batches come from it (a length and a
      batch size per step); with `patch_size_draw` each optimisation step trains at the patch size it draws.
    """

    seq_len_sampler: SeqLenBatchSampler | None = None
    patch_size_draw: PatchSizeDraw | None = None

    def get_train_dataloader(self):
        if self.seq_len_sampler is None:
            return super().get_train_dataloader()
        loader = torch.utils.data.DataLoader(
            self.train_dataset,
            batch_sampler=self.seq_len_sampler,
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers,
            prefetch_factor=self.args.dataloader_prefetch_factor,
            multiprocessing_context=self.args.dataloader_multiprocessing_context,
            in_order=self.args.dataloader_in_order,
            worker_init_fn=partial(
                seed_worker, num_workers=self.args.dataloader_num_workers, rank=self.args.process_index
            ),
        )  # every batch is full (an epoch's last step is filled from its first examples): no --dataloader_drop_last
        # accelerate wraps a batch sampler without a batch size in BatchSamplerShard, which gives process r the r-th
        # batch of every num_processes: the sampler yields those together, at one length.
        return self.accelerator.prepare(loader)

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
                             trial):  # fmt: skip
        # Private, because no public hook runs between restoring a checkpoint's state and the first step. Trainer
        # resumes a checkpoint of the run's last step that ends mid-epoch by finishing that epoch's loop: it trains
        # one step past --max_steps (and moves the EMA once more), so a finished run resumed, or re-run with
        # --resume_from_checkpoint True, saved another model. A finished state has no epoch left to run.
        epochs_trained, steps_trained = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if resume_from_checkpoint is not None and self.state.global_step >= max_steps:
            return num_train_epochs, 0
        return epochs_trained, steps_trained

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # A data loader's first pass draws from torch's global generator (accelerate's loader, for its workers'
        # seed), which dropout and stochastic depth draw from too. An uninterrupted run makes that pass at step 0; a
        # resumed one makes it an epoch later (its resumed epoch skips batches on a copy of the loader), where the
        # draw would shift every later dropout mask. So every fetch after step 0 leaves the generator as it was:
        # the uninterrupted run's stream is unchanged, and a resumed run's equals it. (Augmentation is seeded per
        # example; the sampler's order per epoch.)
        if self.state.global_step == 0:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        with torch.random.fork_rng(devices=[]):
            return super().get_batch_samples(epoch_iterator, num_batches, device)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.patch_size_draw is None:
            return super().training_step(model, inputs, num_items_in_batch)
        with at_patch_size(self.model, self.patch_size_draw(self.state.global_step)):
            inputs = {**inputs, "interpolate_pos_encoding": True}
            return super().training_step(model, inputs, num_items_in_batch)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        python_state, numpy_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            try:
                return super().evaluate(*args, **kwargs)
            finally:
                random.setstate(python_state)
                np.random.set_state(numpy_state)

    _saving_checkpoint = False

    def _save_checkpoint(self, model, trial) -> None:
        self._saving_checkpoint = True  # the checkpoint's model is written by save_model: explained once, here
        try:
            super()._save_checkpoint(model, trial)
        except (OSError, RuntimeError) as error:
            raise _save_error(self.args.output_dir, f"checkpoint {self.state.global_step}", error) from error
        finally:
            self._saving_checkpoint = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        try:
            super().save_model(output_dir, _internal_call)
        except (OSError, RuntimeError) as error:
            if self._saving_checkpoint:
                raise
            raise _save_error(output_dir or self.args.output_dir, "model", error) from error

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        super()._save(output_dir, state_dict)
        if self.args.should_save:  # peft's adapter file too, written as safetensors' private 0600
            give_weights_the_umask_mode(output_dir or self.args.output_dir)
        if self.args.should_save and hasattr(self.model, "peft_config"):
            # A LoRA checkpoint holds peft's adapter and, as the run's folder does, the fine-tuning model's config
            # (classes, size, head) it applies to: loadable and pushable on its own. peft's template card is no card
            # of this project's (the run writes its own at the end).
            folder = output_dir or self.args.output_dir
            self.model.get_base_model().config.save_pretrained(folder)
            card = os.path.join(folder, CARD_FILE)
            if os.path.isfile(card) and not os.path.islink(card):
                os.remove(card)


class CheckpointWriteError(OSError):
    """A checkpoint or model could not be written; the message names the folder, the cause and what to do."""


# What an errno says about a failed write, and what to do about it.
_WRITE_CAUSES = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "a file is larger than this file system (or the process's file size limit, ulimit -f) allows",
    errno.EACCES: "permission denied",
    errno.EPERM: "the operation is not permitted",
    errno.EROFS: "the file system is read-only",
    errno.EIO: "an input/output error of the device",
}


def _errno_of(error: BaseException) -> int | None:
    """The errno behind `error`: its own, one of its causes', or one named in a Rust I/O error's text (safetensors)."""
    seen, visited = error, set()
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        if isinstance(seen, OSError) and seen.errno:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    match = re.search(r"\bcode: (\d+)|\[Errno (\d+)\]", str(error))
    return int(match.group(1) or match.group(2)) if match else None


def _save_error(folder: str | os.PathLike, what: str, error: Exception) -> CheckpointWriteError:
    try:
        free = f"{shutil.disk_usage(folder).free / 2**30:.1f} GiB free there"
    except OSError:
        free = "its free space could not be read"
    code = _errno_of(error)
    cause = _WRITE_CAUSES.get(code)
    if code in (errno.ENOSPC, errno.EDQUOT):
        why, fix = f"{cause}: {free}", "Free space (or choose another --output_dir)"
    elif cause:
        why, fix = cause, "Fix that (or choose another --output_dir)"
    else:
        why, fix = free, "Fix the cause (or choose another --output_dir)"
    failure = CheckpointWriteError(
        f"Writing the {what} in {folder} failed: {error} ({why}). {fix} and resume with --resume_from_checkpoint "
        "True: incomplete checkpoints are skipped."
    )
    failure.errno = code
    return failure


class RunSetupCallback(TrainerCallback):
    """Logs the run's set-up once it is known, as transformers' example scripts do: how a user checks a launch."""

    def __init__(self, num_examples: int | None) -> None:
        self.num_examples = num_examples
        self.seq_len_sampler: SeqLenBatchSampler | None = None  # batches sized per drawn length (--seq_lens)

    def on_train_begin(self, args: TrainingArguments, state, control, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        per_device = args.per_device_train_batch_size
        accumulation = args.gradient_accumulation_steps
        sampler = self.seq_len_sampler
        if sampler is not None:
            sizes = ", ".join(f"{sampler.batch_size_for(s)} at {s} patches" for s in sampler.seq_lens)
            logger.info(
                "Run set-up: %d training examples, %g epochs of %d steps, a sequence length drawn per step: batches "
                "of %s per device (%d patches each) x %d process(es) x %d accumulation step(s), %d optimisation "
                "steps.",
                self.num_examples, state.num_train_epochs, len(sampler.schedule), sizes,
                sampler.max_tokens_per_batch, args.world_size, accumulation, state.max_steps,
            )  # fmt: skip
            return
        logger.info(
            "Run set-up: %s training examples, %s epochs, batch %d per device x %d process(es) x %d accumulation "
            "step(s) = global batch %d, %d optimisation steps.",
            "unknown (streamed)" if self.num_examples is None else self.num_examples,
            # A stream has no length: Trainer counts its epochs as sys.maxsize and stops at --max_steps.
            "unknown (streamed)" if self.num_examples is None else f"{state.num_train_epochs:g}",
            per_device,
            args.world_size,
            accumulation,
            per_device * args.world_size * accumulation,
            state.max_steps,
        )
