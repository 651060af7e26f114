#!/usr/bin/env python
"""`hf-vit-predict` run from a checkout of the repository; installed, the command is on the PATH. See
`hf_vit/commands/predict.py`."""

import sys

from hf_vit.commands.predict import main

if __name__ == "__main__":
    sys.exit(main())
