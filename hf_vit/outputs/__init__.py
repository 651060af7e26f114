"""What leaves the machine: the files the project writes (`files`), output folders (`output_folders`), model cards
(`cards`), Hub pushes (`push`) and figures (`plotting`)."""
