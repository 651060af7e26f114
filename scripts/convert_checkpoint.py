#!/usr/bin/env python
"""`hf-vit-convert` run from a checkout of the repository; installed, the command is on the PATH. See
`hf_vit/commands/convert.py`."""

import sys

from hf_vit.commands.convert import main

if __name__ == "__main__":
    sys.exit(main())
