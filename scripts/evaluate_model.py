#!/usr/bin/env python
"""`hf-vit-evaluate` run from a checkout of the repository; installed, the command is on the PATH. See
`hf_vit/commands/evaluate.py`."""

import sys

from hf_vit.commands.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
