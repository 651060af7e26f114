"""A pretraining or fine-tuning run, as stages (data, objective, model, adapters, trainer, training, final evaluation,
outputs), each in its own module; this one unpacks the flags into their settings and puts the stages in order. The
scripts' `main(task)` runs unchanged under `python`, `torchrun` and `accelerate launch` (`Trainer` distributes)."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import torch
import transformers
from transformers import TrainingArguments

from ..data.datasets import DataSource, image_folder_root, load_datasets, recorded_images, split_record
from ..data.packed_batches import PADDING_SAMPLE_IMAGES, PackedBatchSampler, padding_line, training_patches
from ..data.transforms import Augmentation, BatchSizes, check_eval_images, check_image_channels, rows_and_transform
from ..flags import exit_on_error, parse_sizes, warn_idle
from ..infer.compute_dial import compute_dial_after_training
from ..infer.evaluate import evaluate_checkpoint
from ..outputs.cards import write_model_card
from ..outputs.output_folders import (
    check_not_the_base,
    check_outside_data_set,
    claim_output_dir,
    release,
    remove_earlier_checkpoints,
    resumes_in_place,
)
from ..outputs.run_record import RunRecord, remove_earlier_run_files
from ..tasks.model_setup import ModelSettings, processor_for
from ..tasks.objectives import Objective, select_objective
from ..tasks.training_transforms import TRAINING_TRANSFORMS
from .arguments import DataArguments, ModelArguments, VisionTransformerTrainingArguments, flag_values, parse_args
from .checkpoints import resolve_resume, resumable_checkpoint
from .ema import EmaCallback
from .evaluation import final_evaluation
from .flexible import PatchSizeDraw, SeqLenBatchSampler, check_patch_sizes
from .lora import LoraSettings, adapt, check_lora_arguments, lora_summary
from .recipes import (
    RecipeSettings,
    learning_rate_for_images,
    log_recipe,
    mixing_for,
    recipe_card_text,
    refuse_augmentation,
)
from .summary import summarize_run
from .trainer import EpochToDataset, RunSetupCallback, SeededAugmentation, VisionTransformerTrainer

logger = logging.getLogger(__name__)


def gather_the_whole_model(trainer: Any) -> None:
    """Under FSDP with sharded state dicts (the form its checkpoints take, configs/accelerate/fsdp.yaml's),
    `Trainer.save_model` writes no model at all: the final save switches to FULL_STATE_DICT, so that the run's
    model.safetensors is the whole model, gathered on the main process."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return
    plugin = trainer.accelerator.state.fsdp_plugin
    if "FULL_STATE_DICT" not in str(plugin.state_dict_type):
        logger.info("FSDP: the checkpoints are sharded; the final model is gathered whole into model.safetensors.")
        plugin.state_dict_config = plugin.optim_state_dict_config = None  # the full state dict's own defaults
        plugin.set_state_dict_type("FULL_STATE_DICT")


def train(
    task: str,
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: VisionTransformerTrainingArguments,
    callbacks: list | None = None,
) -> dict[str, Any]:
    """Pretrain or fine-tune, save the model (before the final evaluation: an error there loses no training),
    evaluate it (`final_evaluation`), and save the metrics, curves and model card."""
    transformers.set_seed(training_args.seed)
    check_outside_data_set(training_args.output_dir, data_args.dataset_name)
    source = data_args.source()
    if not training_args.do_train:  # --do_train False: measure the checkpoint as it is, write no model
        return evaluate_checkpoint(
            task, model_args.model_name_or_path, source, training_args.output_dir, training_args.do_eval,
            training_args.do_predict, training_args.per_device_eval_batch_size, training_args.seed,
        )  # fmt: skip
    if source.streaming and training_args.max_steps <= 0:
        raise ValueError("--streaming data sets have no length: set --max_steps to say how long to train.")
    run = Run(
        task=task,
        model=model_args.settings(),
        lora=model_args.lora(),
        source=source,
        augmentation=data_args.augmentation(),
        sizes=data_args.sizes(),
        recipe=training_args.recipe_settings(),
        objective=model_args.objective,
        problem_type=model_args.problem_type,
        values=flag_values(model_args, data_args, training_args),
    )
    check_lora_arguments(run.lora, task)  # before anything is written
    check_not_the_base(training_args.output_dir, model_args.model_name_or_path)
    resume = resolve_resume(
        training_args.resume_from_checkpoint, training_args.output_dir, training_args.overwrite_output_dir
    )
    created = not os.path.lexists(training_args.output_dir)
    lock = claim_output_dir(
        training_args.output_dir,
        resume_from=resume,
        overwrite=training_args.overwrite_output_dir,
        main_process=training_args.process_index == 0,
        latest_checkpoint=resumable_checkpoint,
    )
    record = None
    if training_args.process_index == 0:
        splits = split_record(source, training_args.seed)
        in_place = resumes_in_place(training_args.output_dir, resume)
        record = RunRecord(training_args.output_dir, splits, resuming=in_place)
    try:
        return _run(run, training_args, callbacks or [], resume, record)
    finally:
        release(lock)
        if created and training_args.process_index == 0:
            with contextlib.suppress(OSError):  # a start refused before writing anything leaves no empty folder
                os.rmdir(training_args.output_dir)


@dataclass(frozen=True)
class Run:
    """What a run's stages take, unpacked from its flags by `train`."""

    task: str
    model: ModelSettings
    lora: LoraSettings
    source: DataSource
    augmentation: Augmentation
    sizes: BatchSizes
    recipe: RecipeSettings
    objective: str
    problem_type: str | None
    values: dict[str, Any]  # every flag's value, for a named recipe's summary


def shown_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics the run prints: each once. `eval_*` repeats the final split's `<split>_*` (for the card and the
    Hub), so it is left out of the printed table; `all_results.json` keeps both."""
    split = metrics.get("eval_split")
    repeated = {f"eval_{key.removeprefix(f'{split}_')}" for key in metrics if split and key.startswith(f"{split}_")}
    return {k: v for k, v in metrics.items() if not isinstance(v, str) and k not in repeated}


def _run(
    run: Run, training_args: VisionTransformerTrainingArguments, callbacks, resume, record: RunRecord | None
) -> dict[str, Any]:
    task = run.task
    raw = load_datasets(run.source, training_args.seed)
    if record is not None and (root := image_folder_root(run.source.dataset_name)) is not None:
        record.splits["images"] = recorded_images(raw, root)  # the held-out images themselves, found where they go
    objective = select_objective(
        task, raw, run.source.dataset_name, run.objective, run.problem_type, run.source.streaming
    )
    refuse_augmentation(objective.name, objective.augmentable, run.augmentation, run.recipe)
    if idle := sorted(set(objective.idle_flags) & run.recipe.given):
        warn_idle(idle, f"{{flags}}: --objective {objective.name} has no classification head: no effect here.")
    raw, labels = objective.labels(raw)
    if training_args.check_eval_images:
        check_eval_images(raw)
    model = objective.build_model(task, run.model, labels)
    sizes = run.sizes
    processor = processor_for(
        run.model.model_name_or_path, model.config, sizes.max_num_patches, sizes.packed_sequence_length
    )
    channels_from = (
        "--num_channels" if run.model.num_channels else f"--model_name_or_path {run.model.model_name_or_path}"
    )
    check_image_channels(raw, processor, model.config.num_channels, channels_from)
    model = adapt(model, run.lora, training_args.output_dir)
    if objective.check_sizes is not None:
        objective.check_sizes(run.sizes.max_num_patches, run.sizes.seq_lens, run.sizes.patch_sizes)
    ds = TRAINING_TRANSFORMS[objective.name](raw, run.augmentation, processor, model.config)
    trainer = build_trainer(run, objective, model, processor, ds, training_args, callbacks)
    run.values["learning_rate"] = training_args.learning_rate  # packed batches: scaled by their images
    if training_args.process_index == 0:
        log_recipe(run.recipe, run.values)
    in_place = resumes_in_place(training_args.output_dir, resume)  # else a new run, from another run's checkpoint
    if training_args.overwrite_output_dir and not in_place and trainer.is_world_process_zero():
        remove_earlier_checkpoints(training_args.output_dir, keep=run.model.model_name_or_path)
        remove_earlier_run_files(training_args.output_dir)  # the folder holds only what this run writes
    if record is not None:
        record.start()
        trainer.run_record = record

    if resume is not None:
        logger.info("Resuming from %s: its weights, optimizer, schedule and random states.", resume)
    train_result = trainer.train(resume_from_checkpoint=resume)
    # Weights (safetensors), config, processor and code files first, so nothing trained is lost; the push waits for
    # the card and the final metrics.
    gather_the_whole_model(trainer)
    trainer.save_model(_internal_call=True)
    trainer.save_state()
    metrics = {**train_result.metrics, **final_evaluation(trainer, ds, objective.loss), "train_task": task}
    trainer.log_metrics("all", shown_metrics(metrics))
    trainer.save_metrics("all", metrics, combined=False)
    trainer.save_state()
    if trainer.is_world_process_zero():
        write_outputs(trainer, run, training_args, metrics)
        summarize_run(task, training_args.output_dir, metrics, trainer.state.log_history, model.config,
                      training_args.learning_rate, training_args.max_steps, run.source.dataset_name,
                      run.source.validation_fraction)  # fmt: skip
    return metrics


def build_trainer(
    run: Run, objective: Objective, model, processor, ds, training_args: TrainingArguments, callbacks: list
) -> VisionTransformerTrainer:
    sizes, recipe = run.sizes, run.recipe
    callbacks, num_examples = list(callbacks), None
    if not isinstance(ds["train"], datasets.IterableDataset):
        # The split's transform is applied by `SeededAugmentation`, which gives it each batch's own number of
        # patches (drawn per step with --seq_lens).
        rows, transform = rows_and_transform(ds["train"])
        ds["train"] = SeededAugmentation(rows, training_args.seed, transform)
        callbacks.append(EpochToDataset(ds["train"]))
        num_examples = len(ds["train"])
    seq_len_sampler, patch_size_draw = flexible_sizes(ds["train"], model, sizes, training_args)
    collator, packed_sampler = objective.collator, None
    if sizes.packed_sequence_length is not None:  # the batch's images packed into rows (`collate_fn`)
        collator, packed_sampler = packed_batches(collator, ds["train"], processor, run, training_args)
    native = sizes.max_num_patches is not None and sizes.seq_lens is None and sizes.patch_sizes is None
    if native and num_examples is not None and training_args.process_index == 0:
        _log_padding(ds["train"], processor, sizes, run.augmentation.token_drop_rate, packed_sampler, training_args)
    # The average goes into the model at the end of training before the caller's callbacks see it.
    ema = None if recipe.ema_decay is None else EmaCallback(recipe.ema_decay, recipe.ema_warmup)
    setup = RunSetupCallback(num_examples, seq_len_sampler, packed_sampler)
    training_args.label_names = list(objective.label_names)
    return VisionTransformerTrainer(
        model=model,
        args=training_args,
        train_dataset=ds["train"],
        eval_dataset=ds["validation"],
        data_collator=collator,
        compute_metrics=objective.compute_metrics,
        preprocess_logits_for_metrics=objective.preprocess_logits,
        processing_class=processor,
        callbacks=[setup, *([ema] if ema else []), *callbacks],
        layer_decay=recipe.layer_decay,
        mixing=mixing_for(recipe, model.config),
        ema=ema,
        seq_len_sampler=seq_len_sampler,
        patch_size_draw=patch_size_draw,
        packed_sampler=packed_sampler,
    )


def _log_padding(train, processor, sizes: BatchSizes, token_drop_rate: float, packed_sampler, training_args) -> None:
    """Log the share of a native-aspect run's patch slots that padding takes."""
    images, rows = training_args.per_device_train_batch_size, None  # a padded batch's images
    if packed_sampler is not None:  # its images and rows, planned already
        counts, rows = packed_sampler.counts, packed_sampler.num_rows
        images = round(packed_sampler.images_per_batch() or images)
    else:  # a share is a mean: the sizes of a seeded sample of the images tell it, not every file's header
        sample = PADDING_SAMPLE_IMAGES
        counts = training_patches(train, processor, sizes, token_drop_rate, sample, training_args.seed)[1]
    logger.info(padding_line(counts, sizes, max(1, images), training_args.seed, rows))


def packed_batches(
    collator, train, processor, run: Run, training_args: TrainingArguments
) -> tuple[partial, PackedBatchSampler | None]:
    """`--packed_sequence_length`'s collator and batch sampler: an in-memory split's batches planned by
    `PackedBatchSampler` from each training image's patches (`training_patches`), a stream's packed as they come (no
    sampler)."""
    sizes, token_drop_rate = run.sizes, run.augmentation.token_drop_rate
    length, rows = sizes.packed_sequence_length, training_args.per_device_train_batch_size
    if isinstance(train, datasets.IterableDataset):
        sampler, collator = None, partial(collator, packed_sequence_length=length)
        message = (
            "Packed sequences on a stream (whose images' sizes are not known ahead): each batch's %d images (at "
            "most %d patches each) packed whole into rows of %d patch slots; the number of rows varies per batch.",
            rows, sizes.max_num_patches, length,
        )  # fmt: skip
    else:
        budgets, counts = training_patches(train, processor, sizes, token_drop_rate)
        sampler = PackedBatchSampler(
            counts, rows, length, training_args.seed, training_args.world_size, budgets=budgets, dataset=train,
            drop_partial=training_args.dataloader_drop_last,
        )  # fmt: skip
        # A recipe's learning rate scales with a global batch's images (their mean; with --dataloader_drop_last
        # leaving rows out, the mean per row's times the rows)
        per_batch = sampler.images_per_batch() or sampler.num_images_per_row() * rows
        images = per_batch * training_args.world_size * training_args.gradient_accumulation_steps
        training_args.learning_rate = learning_rate_for_images(
            run.recipe, images, training_args.learning_rate, log=training_args.process_index == 0
        )
        collator = partial(collator, packed_sequence_length=length, packed_rows=rows)
        message = (
            "Packed sequences: each batch is %d rows of %d patch slots per device, holding as many whole images "
            "(at most %d patches each%s) as fill them: %s, %d batch(es) per epoch.",
            rows, length, sizes.max_num_patches, ", fewer kept by token dropping" if token_drop_rate else "",
            "a number of images per batch that varies" if (mean := sampler.images_per_batch()) is None
            else f"{mean:.1f} images per batch on average, in every epoch", len(sampler),
        )  # fmt: skip
    if training_args.process_index == 0:
        logger.info(*message)
    return collator, sampler


def flexible_sizes(
    train, model, sizes: BatchSizes, training_args: TrainingArguments
) -> tuple[SeqLenBatchSampler | None, PatchSizeDraw | None]:
    """`--seq_lens`' batch sampler and `--patch_sizes`' draw (`flexible.py`), None for those not asked for."""
    sampler = draw = None
    seq_lens = parse_sizes(sizes.seq_lens, "--seq_lens")
    if seq_lens is not None:
        budget = sizes.max_tokens_per_batch or training_args.per_device_train_batch_size * max(seq_lens)
        sampler = SeqLenBatchSampler(train, seq_lens, budget, training_args.seed, training_args.world_size)
    patch_sizes = parse_sizes(sizes.patch_sizes, "--patch_sizes")
    if patch_sizes is not None:
        config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
        if config.resnet_layers is not None:
            raise ValueError("--patch_sizes resamples a linear patch embedding; a hybrid (ResNet stem) has none.")
        check_patch_sizes(patch_sizes, config.image_hw)
        probs = sizes.patch_size_probs
        draw = PatchSizeDraw(patch_sizes, [float(p) for p in probs.split(",")] if probs else None, training_args.seed)
    return sampler, draw


def write_outputs(trainer, run: Run, training_args: TrainingArguments, metrics: dict[str, Any]) -> None:
    """The main process's last stage: training curves, the compute dial (a run with native-aspect batches or patch
    sizes: `compute_dial.py`), the model card, and the push (`--push_to_hub`)."""
    from ..outputs.plotting import plot_training_curves

    task = run.task
    plot_training_curves(trainer.state.log_history, Path(training_args.output_dir) / "training_curves.png")
    dial = compute_dial_after_training(
        trainer.model, trainer.processing_class, run.source, run.sizes, training_args.output_dir,
        training_args.per_device_eval_batch_size, training_args.seed,
    )  # fmt: skip
    base = run.model.model_name_or_path
    write_model_card(
        training_args.output_dir,
        model=trainer.model,
        metrics=metrics,
        task=task,
        dataset_name=run.source.dataset_name,
        training_args=training_args,
        repo_id=trainer.hub_model_id or training_args.hub_model_id,
        base_model=base if task == "finetune" else None,
        summary=lora_summary(run.lora.rank, run.lora.target_modules, base) if run.lora.rank else None,
        recipe=recipe_card_text(run, training_args),
        compute_dial=dial.name if dial else None,
    )
    if trainer.run_record is not None:
        trainer.run_record.finish()
    if training_args.push_to_hub:
        trainer.push_output_dir(f"hf-vit {task}: final model, card and metrics")


def main(task: str, argv: list[str] | None = None, parsed: tuple | None = None) -> dict[str, Any]:
    """The scripts' entry point: bad input ends in one `error:` line and exit status 2 (set HF_VIT_TRACEBACK=1 for
    the whole traceback). `parsed`: the flags already parsed (`parse_args`), as the commands do before importing
    this module."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    datasets.utils.logging.disable_propagation()  # datasets prints through its own handler: not twice
    torch.set_float32_matmul_precision("high")
    with exit_on_error():
        return train(task, *(parsed or parse_args(task, argv)))
