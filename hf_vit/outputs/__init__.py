"""What leaves the machine, in one place:

* `files`: the files this project writes (a model folder, a run's folder, a checkpoint), and the code files a
  checkpoint carries (`remote_code_files`);
* `output_folders`: claiming, checking, replacing and cleaning output folders;
* `cards`: model cards, rendered from `templates/model_card.md`;
* `push`: pushing a folder (or a run's checkpoints) to the Hub, exactly the files planned;
* `plotting`: training curves and analysis figures.
"""
