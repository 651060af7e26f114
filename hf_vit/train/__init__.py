"""A pretraining or fine-tuning run with `transformers.Trainer`: the flags (`arguments`, parsed at the edge into the
settings each stage takes), the recipes (`recipes`), the run's Trainer (`trainer`), the weights' EMA (`ema`), the
sizes drawn per step (`flexible`), checkpoints (`checkpoints`), the LoRA adapter stage (`lora`), the final evaluation
(`evaluation`), the end-of-run summary (`summary`) and the run's order of stages (`training`).

Builds on `hf_vit.tasks`, `hf_vit.data` and the core, and on `hf_vit.infer` for what a run measures of a saved model
(`--do_train False`, the compute dial); serving never imports this package. Each module logs under its own name.
"""
