"""The Trainer of a run (one subclass, `VisionTransformerTrainer`), the training split it augments reproducibly, its
callbacks and its errors when a checkpoint cannot be written."""

from __future__ import annotations

import errno
import logging
import math
import os
import random
import re
import shutil
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import HubStrategy, seed_worker

from ..data.augment.mixing import Mixing, mix_batch, mixing_seed, soft_target_cross_entropy
from ..data.packed_batches import PackedBatchSampler
from ..data.seeding import seeded_int
from ..data.transforms import PACKED_ROW
from ..model.loading import give_weights_the_umask_mode
from ..outputs.files import CARD_FILE
from ..outputs.push import HubPushError, commit_plan, create_repo, plan_checkpoint_upload, plan_upload
from ..outputs.run_record import RunRecord
from .ema import EmaCallback
from .flexible import PatchSizeDraw, SeqLenBatchSampler, at_patch_size
from .recipes import describe_param_groups, layer_decay_param_groups

logger = logging.getLogger(__name__)


class SeededAugmentation(torch.utils.data.Dataset):
    """A training split whose random augmentation of example `i` in epoch `e` is drawn from a generator seeded by
    `(seed, e, i)`, not from the global stream when the example is fetched: the data loader fetches ahead, so only
    then do an interrupted and an uninterrupted run augment alike. The epoch lives in shared memory so that persistent
    workers see it change. An `(index, max_num_patches[, row])` key (the samplers') fetches example `index` at that
    number of patches, marked with its planned row in a packed batch (`PACKED_ROW`)."""

    def __init__(self, data, seed: int, transform: Callable | None = None) -> None:
        self.data = data
        self.transform = transform
        self.seed = seed
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int | tuple[int, int] | tuple[int, int, int]):
        index, max_num_patches, *row = index if isinstance(index, tuple) else (index, None)
        with torch.random.fork_rng(devices=[]):
            # The CPU generator only, as fork_rng restores: `torch.manual_seed` would also queue (or, where CUDA is
            # up, do) a reseeding of every accelerator's generator per example, each call formatting a stack.
            torch.default_generator.manual_seed(seeded_int(self.seed, int(self.epoch), index))
            example = self.data[index]
            if self.transform is not None:
                sizes = {} if max_num_patches is None else {"max_num_patches": max_num_patches}
                batch = self.transform({name: [value] for name, value in example.items()}, **sizes)
                example = {name: values[0] for name, values in batch.items()}
        return {**example, PACKED_ROW: row[0]} if row else example


class EpochToDataset(TrainerCallback):
    """Tells a `SeededAugmentation` which epoch starts (accelerate forwards it only to samplers)."""

    def __init__(self, dataset: SeededAugmentation) -> None:
        self.dataset = dataset

    def on_epoch_begin(self, args: TrainingArguments, state, control, **kwargs: Any) -> None:
        # At an epoch's start `state.epoch` is the number of epochs done, fractional when resuming mid-epoch.
        self.dataset.set_epoch(math.floor(state.epoch + 1e-6))


class VisionTransformerTrainer(Trainer):
    """`Trainer` with the recipes' parts (layer-wise decay, Mixup/CutMix seeded by the run's seed, the step and the
    batch's place in it, the EMA's average), sizes drawn per step and packed batches; evaluation consumes none of the
    training's random numbers; every push sends exactly the upload plan's files (`hf_vit.outputs.push`), and the token
    never reaches the arguments Trainer pickles into checkpoints. Each Trainer method is overridden once, in the order
    a run calls them; private ones only where Trainer has no public hook."""

    def __init__(
        self,
        *args: Any,
        layer_decay: float | None = None,
        mixing: Mixing | None = None,
        ema: EmaCallback | None = None,
        seq_len_sampler: SeqLenBatchSampler | None = None,
        patch_size_draw: PatchSizeDraw | None = None,
        packed_sampler: PackedBatchSampler | None = None,
        **kwargs: Any,
    ) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        self.hub_token = training_args.hub_token if training_args is not None else None
        if training_args is not None:
            training_args.hub_token = None
        self.layer_decay, self.mixing, self.ema = layer_decay, mixing, ema
        self.seq_len_sampler, self.patch_size_draw = seq_len_sampler, patch_size_draw
        self.packed_sampler = packed_sampler
        self.run_record: RunRecord | None = None  # set by the run
        self._mixing_step: tuple[int, int] = (-1, 0)  # (optimisation step, batch within it) of the last mixing
        # Packed batches: (images per process, batches) of the optimisation step's accumulated batches (the images
        # the mean of all processes'), and the images trained.
        self._step_images: tuple[float, int] | None = None
        self._images_trained = 0
        self._saving_checkpoint = False
        super().__init__(*args, **kwargs)

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        if not self.is_world_process_zero():
            return
        name = self.args.hub_model_id or Path(self.args.output_dir).absolute().name
        private = self.args.hub_private_repo if private is None else private
        self.hub_model_id = create_repo(name, token=token or self.hub_token, private=private)
        self.push_in_progress = None

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        # Private: the one place that knows the checkpoint a run resumes before training begins (callbacks are not
        # told), where the EMA's average is read back.
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        if self.ema is not None:
            self.ema.resume_from = resume_from_checkpoint

    def get_train_dataloader(self):
        batch_sampler = self.seq_len_sampler or self.packed_sampler
        if batch_sampler is None:
            return super().get_train_dataloader()
        loader = torch.utils.data.DataLoader(
            self.train_dataset,
            batch_sampler=batch_sampler,
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
        )  # --seq_lens: every batch is full (an epoch's last step is filled from its first examples), so no
        # --dataloader_drop_last; packed batches take it from the arguments (see `build_trainer`).
        # accelerate wraps a batch sampler without a batch size in BatchSamplerShard, which gives process r the r-th
        # batch of every num_processes (the samplers yield a multiple of them), the batches whole; it forwards no
        # epoch to it, which both samplers read from the training split (`EpochToDataset`), also when Trainer resumes
        # mid-epoch through skip_first_batches (a SkipBatchSampler over the same sampler).
        return self.accelerator.prepare(loader)

    def create_optimizer(self, model=None):
        if self.layer_decay is None or self.optimizer is not None:
            return super().create_optimizer(model)
        model = self.model if model is None else model
        optimizer_cls, kwargs = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(self.args, model)
        if {"params", "model", "optimizer_dict"} & set(kwargs) or not isinstance(optimizer_cls, type):
            raise ValueError(
                f"--layer_decay builds the optimiser's parameter groups, which --optim {self.args.optim} builds "
                "itself: use it with adamw_torch, sgd, adafactor or another optimiser of parameter groups."
            )
        kwargs = dict(kwargs)
        learning_rate = kwargs.pop("lr", self.args.learning_rate)
        groups = layer_decay_param_groups(model, learning_rate, self.args.weight_decay, self.layer_decay)
        if self.args.process_index == 0:
            logger.info("Layer-wise learning-rate decay %g: %s.", self.layer_decay, describe_param_groups(groups))
        groups = [{key: value for key, value in g.items() if key != "param_names"} for g in groups]
        self.optimizer = optimizer_cls(groups, lr=learning_rate, **kwargs)
        return self.optimizer

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
        #
        # Packed batches hold a number of images that varies: the step's images are counted here, so that each image
        # weighs the same in the step's gradient whatever its batch holds (`compute_loss`).
        with nullcontext() if self.state.global_step == 0 else torch.random.fork_rng(devices=[]):
            fetched = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.packed_sampler is not None:
            batches, images = fetched[0], sum(_images_in(batch) for batch in fetched[0])
            if self.args.world_size > 1:  # DDP averages the processes' gradients: count every process's images
                images = self.accelerator.reduce(torch.tensor(images, device=device), reduction="sum")
                images = int(images) / self.args.world_size
            self._step_images = (images, len(batches))
        return fetched

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.packed_sampler is not None:
            self._images_trained += _images_in(inputs)
        if self.mixing is not None and "labels" in inputs:
            step = self.state.global_step
            micro = self._mixing_step[1] + 1 if self._mixing_step[0] == step else 0
            self._mixing_step = (step, micro)
            rng = np.random.default_rng(mixing_seed(self.args.seed, step, micro))
            pixel_values, targets, _ = mix_batch(
                inputs["pixel_values"], inputs["labels"], self.mixing, rng, inputs.get("spatial_shapes")
            )
            inputs = {**inputs, "pixel_values": pixel_values, "labels": targets}
        if self.patch_size_draw is None:
            return super().training_step(model, inputs, num_items_in_batch)
        with at_patch_size(self.model, self.patch_size_draw(self.state.global_step)):
            inputs = {**inputs, "interpolate_pos_encoding": True}
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss_and_outputs = self._batch_loss(model, inputs, return_outputs, num_items_in_batch)
        if self._step_images is None or not model.training:
            return loss_and_outputs
        # A packed batch's loss is the mean over its images, and Trainer averages the step's batches (DDP the
        # processes'): weighed by the batch's share of the step's images instead, every image of the step counts the
        # same, on every process.
        images, batches = self._step_images
        weight = _images_in(inputs) * batches / max(images, 1)
        if return_outputs:
            return loss_and_outputs[0] * weight, loss_and_outputs[1]
        return loss_and_outputs * weight

    def _batch_loss(self, model, inputs, return_outputs, num_items_in_batch):
        labels = inputs.get("labels")
        if self.mixing is None or not model.training or labels is None or not labels.is_floating_point():
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = {key: value for key, value in inputs.items() if key != "labels"}
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        by_items = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        if self.mixing.multi_label:  # the model's own multi-label loss (a mean), on the soft multi-hot targets
            loss = F.binary_cross_entropy_with_logits(logits.float(), labels.to(logits.device))
        else:
            loss = soft_target_cross_entropy(logits, labels, num_items_in_batch if by_items else None)
        if self.args.average_tokens_across_devices and by_items:
            loss = loss * self.accelerator.num_processes  # as Trainer scales the model's own loss
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        # Trainer counts a packed run's samples as rows (its batch size) under --max_steps: its speed is said in the
        # images trained (all processes'), in the dict Trainer also returns as the training's metrics.
        if self.packed_sampler is not None and "train_samples_per_second" in logs and logs.get("train_runtime"):
            images = torch.tensor(self._images_trained, device=self.args.device)
            images = int(self.accelerator.reduce(images, reduction="sum")) if self.args.world_size > 1 else int(images)
            logs["train_samples_per_second"] = round(images / logs["train_runtime"], 3)
        super().log(logs, *args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        python_state, numpy_state = random.getstate(), np.random.get_state()
        averaged = self.ema.average.applied() if self.ema is not None and self.ema.averaging else nullcontext()
        with torch.random.fork_rng(devices=[]), averaged:
            try:
                return super().evaluate(*args, **kwargs)
            finally:
                random.setstate(python_state)
                np.random.set_state(numpy_state)

    def _save_checkpoint(self, model, trial) -> None:
        # Private: no public hook runs before a checkpoint's files are written, where the EMA's average must go
        # first (a checkpoint cut before Trainer's state is skipped when resuming) and a failed write be explained.
        self._saving_checkpoint = True  # the checkpoint's model is written by save_model: explained once, here
        try:
            if self.ema is not None and self.ema.average is not None and self.args.should_save:
                folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
                os.makedirs(folder, exist_ok=True)
                self.ema.average.save(folder)
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
        # Private: the one place every save of the model passes (final, checkpoint, push) on the saving process.
        super()._save(output_dir, state_dict)
        folder = output_dir or self.args.output_dir
        if self.args.should_save:  # peft's adapter file too, written as safetensors' private 0600
            give_weights_the_umask_mode(folder)
        if self.args.should_save and hasattr(self.model, "peft_config"):
            # A LoRA checkpoint holds peft's adapter and, as the run's folder does, the fine-tuning model's config
            # (classes, size, head) it applies to: loadable and pushable on its own. peft's template card is no card
            # of this project's (the run writes its own at the end).
            self.model.get_base_model().config.save_pretrained(folder)
            card = os.path.join(folder, CARD_FILE)
            if os.path.isfile(card) and not os.path.islink(card):
                os.remove(card)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # Private: Trainer's checkpoint push (--hub_strategy) has no public hook. Synchronous, so that the bytes sent
        # are the checkpoint's own; a failed push is logged and training goes on.
        strategy = self.args.hub_strategy
        if not self.is_world_process_zero() or strategy == HubStrategy.END:
            return
        step = self.state.global_step
        try:
            plan = plan_upload(checkpoint_folder, card=False)
            if strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
                where = "last-checkpoint" if strategy == HubStrategy.CHECKPOINT else Path(checkpoint_folder).name
                plan += plan_checkpoint_upload(checkpoint_folder, where)
            commit_plan(
                self.hub_model_id,
                plan,
                token=self.hub_token,
                commit_message=f"Training in progress, step {step}",
                revision=self.args.hub_revision,
            )
        except HubPushError as error:
            logger.warning("The push of step %d failed; training goes on. %s", step, error)

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ) -> str | None:
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        return self.push_output_dir(commit_message or "End of training", token=token, revision=revision)

    def push_output_dir(self, commit_message: str, token: str | None = None, revision: str | None = None) -> str:
        """Push the output folder as `plan_upload` lists it (the saved model, its card and results; of a run's
        folder, only the files the run wrote), in one commit; a failed final push is an error."""
        if self.hub_model_id is None:
            self.init_hf_repo(token=token)
        written = self.run_record.written() if self.run_record is not None else None
        return commit_plan(
            self.hub_model_id,
            plan_upload(self.args.output_dir, self.hub_model_id, only=written),
            token=token or self.hub_token,
            commit_message=commit_message,
            revision=revision or self.args.hub_revision,
        )


def _images_in(batch: dict[str, Any]) -> int:
    """The images of a batch: its labels' first dimension (one label, or one multi-hot row, per image)."""
    labels = batch.get("labels")
    return int(labels.shape[0]) if labels is not None else 0


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

    def __init__(
        self,
        num_examples: int | None,
        seq_len_sampler: SeqLenBatchSampler | None = None,
        packed_sampler: PackedBatchSampler | None = None,
    ) -> None:
        self.num_examples = num_examples
        self.seq_len_sampler = seq_len_sampler  # batches sized per drawn length (--seq_lens)
        self.packed_sampler = packed_sampler  # batches of fixed rows of patch slots (--packed_sequence_length)

    def on_train_begin(self, args: TrainingArguments, state, control, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        per_device, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
        scale = args.world_size * accumulation
        epochs, batch = f"{state.num_train_epochs:g} epochs", f"batch {per_device} per device"
        total: int | str | None = per_device * scale  # the global batch, said where it is one
        sampler, packed = self.seq_len_sampler, self.packed_sampler
        if sampler is not None:
            epochs += f" of {len(sampler.schedule)} steps"
            sizes = ", ".join(f"{sampler.batch_size_for(s)} at {s} patches" for s in sampler.seq_lens)
            batch = f"a sequence length drawn per step: batches of {sizes} per device "
            batch += f"({sampler.max_tokens_per_batch} patches each)"
            total = None
        elif packed is not None:
            epochs += f" of {-(-len(packed) // args.world_size // accumulation)} steps"
            mean = packed.images_per_batch()
            images = "a varying number of images" if mean is None else f"{mean:.1f} images on average"
            batch = f"batch {per_device} rows of {packed.packed_sequence_length} patch slots per device ({images})"
            total = f"{total} rows ({'images that vary' if mean is None else f'{mean * scale:.1f} images'})"
        elif self.num_examples is None:  # Trainer counts a stream's epochs as sys.maxsize, and stops at --max_steps
            epochs = "unknown (streamed) epochs"
        logger.info(
            "Run set-up: %s training examples, %s, %s x %d process(es) x %d accumulation step(s)%s, %d optimisation "
            "steps.",
            "unknown (streamed)" if self.num_examples is None else self.num_examples, epochs, batch, args.world_size,
            accumulation, "" if total is None else f" = global batch {total}", state.max_steps,
        )  # fmt: skip
