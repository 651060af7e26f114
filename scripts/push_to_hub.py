#!/usr/bin/env python
"""Push an hf-vit folder (safetensors weights, configs, code files, model card) to the Hugging Face Hub.

python scripts/push_to_hub.py --model outputs/main --hub_model_id my-org/vit-digits-24
"""

from __future__ import annotations

import argparse
import sys

from hf_vit.hub import push_folder_to_hub


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the hf-vit folder to push")
    parser.add_argument("--hub_model_id", help="<user or org>/<name> of the Hub repository")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--hub_token", default=None, help="token (default: the one `hf auth login` stored)")
    parser.add_argument("--commit_message", default="Upload hf-vit model")
    args = parser.parse_args(argv)
    try:
        url = push_folder_to_hub(
            args.model,
            args.hub_model_id,
            private=args.private,
            token=args.hub_token,
            commit_message=args.commit_message,
        )
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"pushed {args.model} to {args.hub_model_id}: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
