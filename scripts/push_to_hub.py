#!/usr/bin/env python
"""`hf-vit-push` run from a checkout of the repository; installed, the command is on the PATH. See
`hf_vit/commands/push.py`."""

import sys

from hf_vit.commands.push import main

if __name__ == "__main__":
    sys.exit(main())
