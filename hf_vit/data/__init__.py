"""Images to batches, knowing nothing of Trainer or command-line flags: the data sets and their splits (`datasets`),
the pixel path and the collator (`transforms`), packed training batches (`packed_batches`), and `augment/` (which
serving never imports). Imports only the core (`hf_vit.model`).
"""
