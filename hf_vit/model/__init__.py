"""The core: exactly the code a checkpoint carries.

`save_pretrained` of the model and of the image processor copies every module of this folder (this `__init__.py`
aside) beside the weights, and `from_pretrained(..., trust_remote_code=True)` executes them, so the folder is the
decision of what ships: `hf_vit.outputs.files.remote_code_files()` lists it, and a test holds each module to importing
only its siblings (relatively), torch, transformers and the standard library.

* `configuration_vit`: `VisionTransformerConfig` and the paper's presets;
* `modeling_vit`: the encoder, the classifier, the backbone; `modeling_mpp`: masked patch prediction's model;
  `modeling_mim`: SimMIM's, the one `AutoModelForMaskedImageModeling` builds (or masked patch prediction's, as the
  config says); `pixel_targets`: what those heads predict, from the pixels;
* `embeddings`: equation (1), the patch, prefix and position embeddings; `weight_init`: the authors' initialisation;
* `attention`: the attention implementations; `hybrid`: the ResNet stem of the hybrid models;
* `resolution`: image sizes, patch grids and resampling the position embeddings and the patch embedding;
* `layout`: a variable-shape batch's layout (native-aspect batches, padded or packed several whole images per row as
  NaViT): each image's tokens, the runs attention is restricted to, the moves between packed rows and one image per
  row, made from data without reading values back from the device;
* `layer_scale`, `pooling`: LayerScale and attention pooling, blocks of the family that followed the paper;
* `image_processing_vit`: `VisionTransformerImageProcessor`, the pixels of training and inference, with
  `image_geometry`, its sizes and resizes;
* `loading`: strict loading, the hook through which foreign checkpoints load, and the code copied beside a save.

A new module of the model (e.g. another pooling) goes here and ships with every checkpoint; anything a checkpoint does
not need at load time belongs elsewhere.
"""
