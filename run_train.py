"""Train a model: `python run_train.py --config-file CONFIG` (one process) or
`torchrun --nproc_per_node=N run_train.py --config-file CONFIG`."""

from nanocore.commands.cli import train_main

if __name__ == "__main__":
    train_main()
