"""The core: exactly the code a checkpoint carries.

`save_pretrained` of the model and of the image processor copies every module of this folder (this `__init__.py`
aside) beside the weights, and `from_pretrained(..., trust_remote_code=True)` executes them where hf_vit is not
installed, so the folder is the decision of what ships: `hf_vit.outputs.files.remote_code_files()` lists it, and a
test holds each module to importing only its siblings (relatively), torch, transformers and the standard library,
public APIs only. A new module of the model (e.g. another pooling) goes here and ships with every checkpoint;
anything a checkpoint does not need at load time belongs elsewhere.
"""
