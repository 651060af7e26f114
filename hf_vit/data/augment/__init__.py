"""The recipes' augmentations, each small and separate, with timm's flag meanings: `rand_augment` (RandAugment on
uint8 images), `random_erasing` (on normalised images) and `mixing` (Mixup and CutMix of a batch and its targets)."""
