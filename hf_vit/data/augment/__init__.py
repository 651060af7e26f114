"""Training's augmentation, which serving never imports: `train_transform` (the eval pixel path with random resized
crop, flip and the recipes' augmentations on top) and the recipes' augmentations, each small and separate, with timm's
flag meanings: `rand_augment` (RandAugment on uint8 images), `random_erasing` (on normalised images) and `mixing`
(Mixup and CutMix of a batch and its targets)."""
