"""Continue a prompt with a trained checkpoint:
`python run_generate.py --ckpt-path checkpoints/tiny_llama --prompt "def " --max-new-tokens 200 --temperature 0`."""

from nanocore.commands.cli import generate_main

if __name__ == "__main__":
    generate_main()
