#!/usr/bin/env python
"""`hf-vit-export` run from a checkout of the repository; installed, the command is on the PATH. See
`hf_vit/commands/export.py`."""

import sys

from hf_vit.commands.export import main

if __name__ == "__main__":
    sys.exit(main())
