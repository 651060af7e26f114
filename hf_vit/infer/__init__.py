"""A saved folder at work, without training: loading it (`loading`: hf-vit folders, foreign checkpoints, LoRA run
folders), predicting image files' classes (`predict`), evaluating a data set's split (`evaluate`), and the compute
dial (`compute_dial`). Builds on `hf_vit.tasks` and `hf_vit.data`; never imports `hf_vit.train`."""
