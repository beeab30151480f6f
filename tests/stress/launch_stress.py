"""Launch a short multi-rank training run N times with torchrun and count the launches that fail.

    python tests/stress/launch_stress.py --launches 50                    # dp2, the local-plugins config
    python tests/stress/launch_stress.py --launches 20 --layout dp2tp2pp2 # 8 ranks

The config is the one that aborted at random before the process-group shutdown fix ("terminate
called without an active exception"): a tiny LLaMA on a JSONL corpus read by the example local
dataset plugin, logged by the example CSV logger, both loaded as local plugins. Every launch starts
from empty folders, must exit 0 and must have logged every step. Failures are counted, never
retried; the output of each failed launch is kept in the work folder and its tail printed.
Not collected by pytest (it takes minutes); `tests/e2e/test_exit_paths.py` runs a few launches in CI.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
LOCAL = REPO / "examples" / "local_plugins"
LAYOUTS = {
    "dp2": {"dp": 2},
    "dp2tp2pp2": {"dp": 2, "tp": 2, "pp": 2, "tp_mode": "REDUCE_SCATTER"},
}


def write_config(folder: Path, layout: str, steps: int) -> Path:
    corpus = folder / "letters.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "body": "a" * 60}) + "\n" for i in range(40)))
    config = {
        "general": {"project": "stress", "run": "stress", "seed": 3},
        "parallelism": LAYOUTS[layout],
        "model": {
            "dtype": "float32",
            "model_config": {
                "model_type": "llama",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 2 if layout == "dp2" else 4,
                "vocab_size": 257,
                "max_position_embeddings": 64,
            },
        },
        "tokenizer": {"tokenizer_name_or_path": "byte"},
        "tokens": {
            "sequence_length": 32,
            "train_steps": steps,
            "micro_batch_size": 2,
            "batch_accumulation_per_replica": 2,
        },
        "optimizer": {
            "zero_stage": 1,
            "learning_rate_scheduler": {"learning_rate": 0.01, "lr_warmup_steps": 0, "lr_decay_style": "constant"},
            "optimizer_factory": {"name": "adam_w", "torch_adam_is_fused": False},
        },
        "data_stages": [
            {
                "name": "letters",
                "data": {"dataset": {"format": "jsonl_documents", "path": str(corpus), "text_key": "body"}},
            }
        ],
        "checkpoints": {"checkpoints_path": str(folder / "checkpoints"), "checkpoint_interval": 2},
        "logging": {"log_dir": str(folder / "logs"), "loggers": ["csv"]},
    }
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def launch(config: Path, nproc: int, steps: int, timeout: float) -> tuple[bool, str, float]:
    """One launch from empty run folders; (ok, output, seconds)."""
    for sub in ("checkpoints", "logs"):
        shutil.rmtree(config.parent / sub, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NANOCORE_PLUGINS": str(LOCAL / "csv_logger.py")}
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", str(REPO / "run_train.py"),
           "--config-file", str(config), "--plugin", str(LOCAL / "jsonl_dataset.py")]  # fmt: skip
    start = time.monotonic()
    try:
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return False, f"timed out after {timeout:.0f}s\n{exc.stdout or ''}{exc.stderr or ''}", timeout
    seconds = time.monotonic() - start
    output = result.stdout + result.stderr
    if result.returncode != 0:
        return False, f"exit code {result.returncode}\n{output}", seconds
    rows = list(csv.DictReader((config.parent / "logs" / "metrics.csv").read_text().splitlines()))
    if [int(r["step"]) for r in rows] != list(range(1, steps + 1)):
        return False, f"metrics.csv has steps {[r['step'] for r in rows]}\n{output}", seconds
    return True, output, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=50)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="dp2")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one launch may take")
    parser.add_argument("--work", type=Path, default=None, help="work folder (default: a new temporary one)")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="nanocore-stress-"))
    work.mkdir(parents=True, exist_ok=True)
    config = write_config(work, args.layout, args.steps)
    nproc = {"dp2": 2, "dp2tp2pp2": 8}[args.layout]
    failures, times = 0, []
    for i in range(1, args.launches + 1):
        ok, output, seconds = launch(config, nproc, args.steps, args.timeout)
        times.append(seconds)
        if not ok:
            failures += 1
            (work / f"failed-launch-{i}.txt").write_text(output)
            print(f"launch {i}: FAILED ({output.splitlines()[0]}); tail:\n" + "\n".join(output.splitlines()[-15:]))
        print(f"launch {i}/{args.launches}: {'ok' if ok else 'FAILED'} in {seconds:.1f}s", flush=True)
    print(f"{args.layout}: {failures} failure(s) in {args.launches} consecutive launches "
          f"(median {sorted(times)[len(times) // 2]:.1f}s per launch; work folder {work})")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
