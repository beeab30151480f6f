"""`nanocore generate` / `run_generate.py`: load a checkpoint on one device and continue a prompt.

The checkpoint's model is built by nanocore/checkpoint/model.py, the text by nanocore/generation.py.
"""

from __future__ import annotations

import argparse
import logging
import sys

from nanocore.errors import NanocoreError
from nanocore.plugins import add_plugin_argument

log = logging.getLogger("nanocore")
HELP = "continue a prompt with a checkpoint's model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ckpt-path", required=True, help="a checkpoints folder (follows latest.txt) or one step folder"
    )
    parser.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="generate at most this many tokens")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (always the most likely token)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens only")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set reaching P")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same text)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    add_plugin_argument(parser)


def run(args: argparse.Namespace) -> int:
    """The `generate` command: print the prompt followed by the generated text."""
    # Imported here rather than at the top so that `nanocore --help` does not wait for torch.
    from nanocore.checkpoint.model import load_checkpoint_model
    from nanocore.generation import generate
    from nanocore.log_setup import setup_logging

    setup_logging()
    if args.max_new_tokens < 0:
        raise NanocoreError(f"--max-new-tokens must be 0 or more, got {args.max_new_tokens}")
    loaded = load_checkpoint_model(args.ckpt_path, args.plugin, args.device)
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise NanocoreError(
            f"checkpoint {loaded.folder} was trained without a tokenizer (tokenizer_name_or_path: null): "
            "there is no way to turn text into its token ids"
        )
    prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:  # a new document starts after a separator token
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if start is None:
            raise NanocoreError("--prompt is empty and the tokenizer has no BOS or EOS token to start from")
        prompt_ids = [start]
    log.info("step %d of %s: generating up to %d tokens", loaded.step, loaded.folder, args.max_new_tokens)
    new_ids = generate(
        loaded.model,
        prompt_ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_token_id=tokenizer.eos_token_id,
        seed=args.seed,
    )
    sys.stdout.write(args.prompt + tokenizer.decode(new_ids) + "\n")
    sys.stdout.flush()
    return 0
