"""Images to batches, knowing nothing of Trainer or command-line flags: the data sets and their splits (`datasets`),
the pixel path from an image to model inputs with augmentation, native-aspect batches and the collator
(`transforms`), packed training batches of a fixed number of rows of patch slots (`packed_batches`), and `augment/`
(RandAugment, random erasing, Mixup/CutMix).

Imports only the core (`hf_vit.model`); every stage above it (tasks, training, serving) builds on it.
"""
