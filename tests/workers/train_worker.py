"""Runs `hf_vit.train.training.train` like the scripts do, with test hooks: each rank dumps its weights at the end, and
`--kill_at_step N` makes the process die abruptly (as a killed job would) once step N is reached.

    python tests/workers/train_worker.py finetune [--kill_at_step N] <script flags>
    torchrun --nproc_per_node 2 tests/workers/train_worker.py finetune <script flags>
    torchrun --nproc_per_node 2 tests/workers/train_worker.py --runs runs.json

`--runs`: the runs one after the other in the same processes (one launch, one start of each process), from a JSON list
of `{"task", "flags", "log"}`; each rank writes each run's log to `log` + its rank (`run.log0`, `run.log1`).
"""

import json
import logging
import os
import sys

import torch.distributed as dist
from safetensors.torch import save_file
from transformers import TrainerCallback

from hf_vit.train.arguments import parse_args
from hf_vit.train.trainer import VisionTransformerTrainer
from hf_vit.train.training import train

BATCHES = []  # each training batch this process trained: [images (rows, packed), most patches of one image]
IMAGES = []  # the images of each (one per grid of `spatial_shapes`, packed or not)
_training_step = VisionTransformerTrainer.training_step


def recording_training_step(self, model, inputs, num_items_in_batch=None):
    shapes = inputs.get("spatial_shapes")
    BATCHES.append([len(inputs["pixel_values"]), None if shapes is None else int(shapes.prod(-1).max())])
    IMAGES.append(len(inputs["pixel_values"] if shapes is None else shapes))
    return _training_step(self, model, inputs, num_items_in_batch)


VisionTransformerTrainer.training_step = recording_training_step


class DumpWeights(TrainerCallback):
    def on_train_end(self, args, state, control, model=None, **kwargs):
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        save_file(weights, os.path.join(args.output_dir, f"rank{rank}.safetensors"))
        with open(os.path.join(args.output_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "world_size": world, "args_world_size": args.world_size, "batches": BATCHES,
                       "images": IMAGES}, f)  # fmt: skip


class KillAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            logging.getLogger("train_worker").warning("Killed at step %d", self.step)
            os._exit(17)  # no cleanup, no final save: as if the job was killed


def run(task: str, argv: list[str], log: str | None = None) -> None:
    if dist.is_initialized():  # the ranks start each run together, as a launch's rendezvous starts the first
        dist.barrier()
    BATCHES.clear()
    IMAGES.clear()
    callbacks = [DumpWeights()]
    if "--kill_at_step" in argv:
        i = argv.index("--kill_at_step")
        callbacks.append(KillAt(int(argv[i + 1])))
        argv = argv[:i] + argv[i + 2 :]
    handler = None if log is None else logging.FileHandler(log + os.environ.get("RANK", "0"))
    if handler is not None:
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(handler)
    try:
        train(task, *parse_args(task, argv), callbacks=callbacks)
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()


if __name__ == "__main__":
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.INFO)  # as the scripts log
    if sys.argv[1] == "--runs":
        with open(sys.argv[2]) as f:
            for one in json.load(f):
                run(one["task"], one["flags"], one["log"])
    else:
        run(sys.argv[1], sys.argv[2:])
