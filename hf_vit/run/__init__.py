"""One pretraining or fine-tuning run, as stages (`training` puts them in order):

* `arguments`: the flags (`parse_args`) and the paper's recipes;
* `datasets`: the data set's splits (`load_datasets`); `transforms`: images to model inputs, with augmentation;
* `objectives`: the table of what a run learns (labels, model builder, transforms, collator, metrics);
  `mpp`: masked patch prediction's parts of that table (its model builder, transforms, collator and metrics);
* `model_setup`: the model from a preset or a checkpoint (`load_checkpoint`, head kept or new), and the processor;
* `lora`: the adapter stage (`adapt`), and loading or merging a saved adapter;
* `recipes`: the recipes for mid-sized data (`--recipe`'s table, layer-wise learning-rate decay, and the Trainer's
  part of them), built from `ema` (the weights' moving average), `mixing` (Mixup and CutMix), `rand_augment` and
  `random_erasing`;
* `trainer`: the Trainer, reproducible augmentation and the run's set-up line;
* `checkpoints`: what a run can resume from;
* `evaluation`: the final evaluation, each split on a loader built for it;
* `training`: `train` and the scripts' `main`.

The run writes through `hf_vit.outputs` (folders, cards, pushes, plots) and builds on the core (`hf_vit.model`).
Each module logs under its own name (`logging.getLogger(__name__)`): `hf_vit.run` is the run's logger.
"""
