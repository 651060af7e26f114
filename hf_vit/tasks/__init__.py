"""What a run learns, chosen from one table (`objectives.OBJECTIVES`): single- and multi-label classification and
masked patch prediction (`mpp`), each with its labels, model builder (`model_setup`), transforms, collator, metrics
and loss. Builds on `hf_vit.data` and the core; knows nothing of Trainer or command-line flags."""
