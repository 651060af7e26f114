"""A pretraining or fine-tuning run with `transformers.Trainer`, its order of stages in `training`. Builds on
`hf_vit.tasks`, `hf_vit.data` and the core, and on `hf_vit.infer` for what a run measures of a saved model; serving
never imports this package.
"""
