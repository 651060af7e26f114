"""Images to batches, knowing nothing of Trainer or command-line flags: the data sets and their splits (`datasets`),
the pixel path from an image to model inputs, native-aspect batches and the collator (`transforms`), packed training
batches of a fixed number of rows of patch slots (`packed_batches`), and `augment/` (the training transform,
RandAugment, random erasing, Mixup/CutMix: serving never imports it).

Imports only the core (`hf_vit.model`); every stage above it (tasks, training, serving) builds on it.
"""
