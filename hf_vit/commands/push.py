"""Push an hf-vit folder to the Hugging Face Hub: exactly the files the project writes at its top level (safetensors
weights, config.json, preprocessor_config.json, the code files, the README.md card, training curves, *_results.json),
plus the files named with --include. Symlinks and files naming local paths are refused; --dry_run lists the files.

hf-vit-push --model outputs/main --hub_model_id my-org/vit-digits-24 --dry_run
hf-vit-push --model outputs/main --hub_model_id my-org/vit-digits-24
"""

from __future__ import annotations

import logging

from hf_vit.commands import CommandParser
from hf_vit.flags import error_status
from hf_vit.outputs.push import plan_upload, push_folder_to_hub


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser("hf-vit-push", __doc__)
    parser.add_argument("--model", required=True, help="the hf-vit folder to push")
    parser.add_argument("--hub_model_id", help="<user or org>/<name> of the Hub repository")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--hub_token", help="token (default: the one `hf auth login` stored)")
    parser.add_argument("--commit_message", default="Upload hf-vit model")
    parser.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="FILE",
        help="also upload FILE (a path inside --model; repeatable). Nothing else beyond the project's files is sent.",
    )
    parser.add_argument("--dry_run", action="store_true", help="print what would be uploaded, touching no network")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.INFO)
    try:
        if args.dry_run:
            plan = plan_upload(args.model, args.hub_model_id, args.include)
            target = args.hub_model_id or "the Hub"
            print(f"would upload {len(plan)} files of {args.model} to {target}:")
            for item in plan:
                print(f"  {item.path_in_repo}{' (copy naming the repository pushed to)' if item.content else ''}")
            return 0
        url = push_folder_to_hub(
            args.model,
            args.hub_model_id,
            private=args.private,
            token=args.hub_token,
            commit_message=args.commit_message,
            extra_files=args.include,
        )
    except (ValueError, OSError) as error:  # OSError: missing files, and a Hub that cannot be reached
        return error_status(error)
    print(f"pushed {args.model} to {args.hub_model_id}: {url}")
    return 0
