"""An exponential moving average (EMA) of the weights a run trains, with timm's meanings (`ModelEmaV3`), moved after
every optimiser step (with LoRA: the adapters and the new head). The averaged weights are what a run evaluates and
saves as its model; every checkpoint keeps them (`EMA_FILE`) beside its own, so a resumed run continues the same
average bit for bit."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import TrainerCallback

from ..model.loading import give_weights_the_umask_mode

EMA_FILE = "ema_state.safetensors"
"""The averaged weights in a `checkpoint-N` folder (safetensors, keyed by parameter name)."""

WARMUP_POWER = 2 / 3
WARMUP_GAMMA = 1.0


def ema_decay_at(step: int, decay: float, warmup: bool = False) -> float:
    """The decay of the update after optimiser step `step` (1-based): 0 at the first (the average starts as the
    weights), then `decay`, or with `warmup` `min(decay, 1 - (1 + (step - 1) / gamma) ** -power)`."""
    step = max(0, step - 1)
    if step <= 0:
        return 0.0
    if warmup:
        return min(decay, 1 - (1 + step / WARMUP_GAMMA) ** -WARMUP_POWER)
    return decay


def check_ema_decay(decay: float | None, warmup: bool = False) -> None:
    """Refuse an `--ema_decay` outside [0, 1) (and `--ema_warmup` without one) by name."""
    if decay is None:
        if warmup:
            raise ValueError("--ema_warmup shapes the decay of --ema_decay: pass --ema_decay too (e.g. 0.9998).")
        return
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"--ema_decay must be in [0, 1) (e.g. 0.9998), got {decay}.")


class WeightAverage:
    """The moving average of `model`'s trained parameters (those with `requires_grad`), on their device."""

    def __init__(self, model: nn.Module, decay: float, warmup: bool = False) -> None:
        check_ema_decay(decay, warmup)
        self.decay, self.warmup = decay, warmup
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("--ema_decay: the model has no trained parameters to average.")
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.averages = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> float:
        """Move the average after optimiser step `step` (1-based, Trainer's `global_step`); returns the decay used."""
        decay = ema_decay_at(step, self.decay, self.warmup)
        torch._foreach_lerp_(self.averages, [p.detach() for p in self.params], 1.0 - decay)
        return decay

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self) -> Iterator[None]:
        """The model holds the averaged weights inside the block, its own weights again after it."""
        own = [p.detach().clone() for p in self.params]
        torch._foreach_copy_([p.detach() for p in self.params], self.averages)
        try:
            yield
        finally:
            torch._foreach_copy_([p.detach() for p in self.params], own)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Put the averaged weights into the model for good (the end of a run: what it evaluates and saves)."""
        torch._foreach_copy_([p.detach() for p in self.params], self.averages)

    def save(self, folder: str | os.PathLike) -> None:
        state = {name: average.detach().cpu().contiguous() for name, average in zip(self.names, self.averages)}
        save_file(state, os.path.join(folder, EMA_FILE))
        give_weights_the_umask_mode(folder)

    @torch.no_grad()
    def load(self, folder: str | os.PathLike) -> None:
        path = os.path.join(folder, EMA_FILE)
        if not os.path.isfile(path):
            raise ValueError(
                f"{folder} holds no {EMA_FILE}: it was saved by a run without --ema_decay, so the average cannot be "
                "resumed. Resume without --ema_decay, or start a new run."
            )
        try:
            state = load_file(path, device=str(self.averages[0].device))
        except (OSError, SafetensorError) as error:
            raise ValueError(f"{path} is truncated or corrupted ({error}).") from error
        if sorted(state) != sorted(self.names):
            missing = sorted(set(self.names) - set(state))[:3]
            extra = sorted(set(state) - set(self.names))[:3]
            raise ValueError(
                f"{path} does not average this model's trained parameters (missing {missing}, unknown {extra}): "
                "it was written by a run of another model or adapter set-up. Resume with the flags of the run that "
                "wrote it."
            )
        for name, average in zip(self.names, self.averages):
            if state[name].shape != average.shape:
                raise ValueError(f"{path}: {name} has shape {tuple(state[name].shape)}, the model {average.shape}.")
            average.copy_(state[name])


class EmaCallback(TrainerCallback):
    """Keeps a run's `WeightAverage` (loaded from `resume_from`, the checkpoint a run resumes), put into the model
    when training ends, before the other callbacks, the final save and the final evaluation see it."""

    def __init__(self, decay: float, warmup: bool = False) -> None:
        self.decay, self.warmup = decay, warmup  # checked by `WeightAverage`
        self.average: WeightAverage | None = None
        self.resume_from: str | None = None
        self.finished = False

    def on_train_begin(self, args, state, control, model=None, **kwargs) -> None:
        self.average = WeightAverage(model, self.decay, self.warmup)
        self.finished = False
        if self.resume_from is not None:
            self.average.load(self.resume_from)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.average.update(state.global_step)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self.average.copy_to_model()
        self.finished = True

    @property
    def averaging(self) -> bool:
        """Whether the model's own weights differ from the average (during training)."""
        return self.average is not None and not self.finished
