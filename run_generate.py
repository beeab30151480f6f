"""Continue a prompt with a trained checkpoint:
`python run_generate.py --ckpt-path checkpoints/tiny_llama --prompt "def " --max-new-tokens 200 --temperature 0`."""

from nanocore.generate_cmd import main

if __name__ == "__main__":
    main()
