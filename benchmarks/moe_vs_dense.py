"""Mixture of experts against dense: nanocore's Mixtral beside a dense LLaMA with the same active
parameters per token, and beside a plain transformers `MixtralForCausalLM` training loop.

Four sides, same shape (hidden, layers, heads, vocabulary, sequence, batch), same AdamW (fused
setting, weight decay on matrices only), same clipping (1.0), float32:

- **moe**: nanocore's trainer on `model_type: mixtral` (E experts of width I, top-k, auxiliary
  loss on), the built-in `nd` engine at one process, random tokens (`dataset: null`).
- **moe_loop**: the same, its experts one matmul each (`nanocore.moe_api.USE_GROUPED_MM = False`);
  **moe** takes torch's grouped matmul where it runs (bfloat16, on CUDA and on CPU), so
  `--dtype bfloat16` compares the two expert-GEMM paths (in float32 both sides loop).
- **dense**: nanocore's trainer on `model_type: llama` with `intermediate_size = k x I`: every token
  computes with the same number of weights (attention, k x I of MLP width), so the FLOPs per token
  match and the ratio moe / dense is what routing and E small matmuls cost (or save) over one big one.
- **hf_mixtral**: the loop a user would write with transformers instead: `MixtralForCausalLM` of the
  same size (same E, k, I), `loss.backward()` per micro-batch (language-model loss plus
  `router_aux_loss_coef` x transformers' load-balancing loss, as `output_router_logits=True` gives),
  `clip_grad_norm_`, `optimizer.step()`, `zero_grad(set_to_none=True)`.

Timing: the three sides are built afresh each round and stepped in turn, one optimizer step each
(moe, dense, hf_mixtral, moe, ...), so machine noise hits all alike; a nanocore step is one
`Trainer._train_one_step` (data, LR, engine step, metrics, hooks: what `Trainer.train` runs per
step). The first step of each side per round is a warm-up; each side's figure is its median step
time over all rounds.

    python benchmarks/moe_vs_dense.py                        # ~2-4 minutes on 2 CPU cores
    python benchmarks/moe_vs_dense.py --rounds 5 --json moe.json
    python benchmarks/moe_vs_dense.py --device cuda --dtype bfloat16 --hidden 1024 --seq 1024
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import OPTIMIZER, SEED, adamw, nanocore_config, use_device  # noqa: E402  (the same config and AdamW)

SIDES = ("moe", "moe_loop", "dense", "hf_mixtral")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per side per round (after 1 warm-up)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each side's figure is the median step time")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8, help="query heads (key/value heads = heads / 2)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--experts", type=int, default=8, help="routed experts per layer (E)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (k)")
    p.add_argument("--expert-intermediate", type=int, default=352, help="each expert's width (I); dense: k x I")
    p.add_argument("--aux-coef", type=float, default=0.01, help="router_aux_loss_coef")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available, else cpu")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: shared cores)")
    p.add_argument("--no-fused", action="store_true", help="AdamW without the fused kernel on every side")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


def shared_fields(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "hidden_size": args.hidden,
        "num_attention_heads": args.heads,
        "num_key_value_heads": max(1, args.heads // 2),
        "num_hidden_layers": args.layers,
        "vocab_size": args.vocab,
        "max_position_embeddings": args.seq,
    }


def moe_fields(args: argparse.Namespace) -> dict[str, Any]:
    return {
        **shared_fields(args),
        "intermediate_size": args.expert_intermediate,
        "num_local_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "router_aux_loss_coef": args.aux_coef,
    }


class NanocoreSide:
    """One nanocore trainer, stepped one optimizer step at a time. `grouped=False`: its experts run one
    matmul per expert even where torch's grouped matmul would be taken (`nanocore.moe_api.expert_matmul`)."""

    def __init__(
        self, args: argparse.Namespace, tmp: Path, model_config: dict[str, Any], steps: int, grouped: bool = True
    ):
        from nanocore.config.checks import check_config
        from nanocore.config.converter import structure_config
        from nanocore.config.load import LoadedConfig
        from nanocore.plugins import load_plugins
        from nanocore.trainer import Trainer

        raw = nanocore_config(args, tmp, steps)
        raw["model"]["model_config"] = model_config
        plugins = load_plugins()
        config = structure_config(raw, plugins.registries)
        check_config(config, plugins.registries, 1)
        self.trainer = Trainer(LoadedConfig(config, plugins, None))
        self.losses: list[float] = []
        self.grouped = grouped
        engine = self.trainer.engine
        self.params = sum(t.param.numel() for t in engine.trainables)
        self.flops_per_token = engine.flops_per_token(args.seq)

    def step(self) -> float:
        import nanocore.moe_api as moe_api

        moe_api.USE_GROUPED_MM = self.grouped
        try:
            self.trainer._train_one_step(self.losses, 1)  # what Trainer.train runs per step
        finally:
            moe_api.USE_GROUPED_MM = True
        return self.losses[-1]

    def close(self) -> None:
        self.trainer.close()


class HFMixtralSide:
    """The hand-written transformers loop."""

    def __init__(self, args: argparse.Namespace):
        import torch
        from transformers import MixtralConfig, MixtralForCausalLM

        self.args = args
        self.device = torch.device(args.device)
        torch.manual_seed(SEED)
        config = MixtralConfig(**moe_fields(args), output_router_logits=True, tie_word_embeddings=False)
        model = MixtralForCausalLM(config).to(device=self.device, dtype=getattr(torch, args.dtype))
        self.model = model.train()
        self.optimizer = adamw(model, fused=None if args.no_fused else True)
        self.generator = torch.Generator().manual_seed(SEED)
        self.params = sum(p.numel() for p in model.parameters())

    def step(self) -> float:
        import torch

        args = self.args
        batch = torch.randint(
            0, args.vocab, (args.accumulation, args.micro_batch_size, args.seq), generator=self.generator
        )
        total = torch.zeros((), device=self.device)
        for micro in batch:
            micro = micro.to(self.device)
            out = self.model(input_ids=micro, labels=micro)  # transformers shifts the labels itself
            loss = out.loss / args.accumulation  # LM loss + router_aux_loss_coef x load-balancing loss
            loss.backward()
            total += loss.detach()
            del out, loss
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), OPTIMIZER["clip_grad"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(total)

    def close(self) -> None:
        pass


def run_round(args: argparse.Namespace, tmp: Path, wall: dict[str, list[float]], info: dict[str, Any]) -> None:
    dense = {**shared_fields(args), "intermediate_size": args.top_k * args.expert_intermediate}
    sides = {
        "moe": NanocoreSide(args, tmp / "moe", {"model_type": "mixtral", **moe_fields(args)}, args.steps + 1),
        "moe_loop": NanocoreSide(
            args, tmp / "moe_loop", {"model_type": "mixtral", **moe_fields(args)}, args.steps + 1, grouped=False
        ),
        "dense": NanocoreSide(args, tmp / "dense", {"model_type": "llama", **dense}, args.steps + 1),
        "hf_mixtral": HFMixtralSide(args),
    }
    try:
        for name, side in sides.items():
            info.setdefault(name, {"parameters": side.params})
            if isinstance(side, NanocoreSide):
                info[name]["flops_per_token"] = side.flops_per_token
        for step in range(args.steps + 1):
            for name, side in sides.items():
                start = time.perf_counter()
                loss = side.step()
                if step > 0:
                    wall[name].append(time.perf_counter() - start)
                info[name]["last_loss"] = loss
    finally:
        for side in sides.values():
            side.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    use_device(args)
    import torch

    tokens_per_step = args.micro_batch_size * args.accumulation * args.seq
    print(
        f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} thread(s), {args.dtype}; hidden "
        f"{args.hidden}, {args.layers} layers, vocab {args.vocab}; MoE {args.experts} experts x "
        f"{args.expert_intermediate} "
        f"top-{args.top_k} vs dense MLP {args.top_k * args.expert_intermediate}; {tokens_per_step} tokens/step; "
        f"{args.rounds} rounds x (1 warm-up + {args.steps} timed steps) per side, sides stepped in turn",
        flush=True,
    )
    wall: dict[str, list[float]] = {side: [] for side in SIDES}
    info: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="nanocore-moe-bench-") as tmp:
        for r in range(args.rounds):
            before = {side: len(wall[side]) for side in SIDES}
            run_round(args, Path(tmp) / f"round{r}", wall, info)
            rates = {s: tokens_per_step / statistics.median(wall[s][before[s] :]) for s in SIDES}
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{s} {rates[s]:7.0f} tok/s" for s in SIDES), flush=True)
            gc.collect()
    median = {side: tokens_per_step / statistics.median(wall[side]) for side in SIDES}
    ratios = {
        "moe_over_dense": median["moe"] / median["dense"],
        "moe_over_hf_mixtral": median["moe"] / median["hf_mixtral"],
        "grouped_over_loop": median["moe"] / median["moe_loop"],
    }
    print()
    for side in SIDES:
        flops = info[side].get("flops_per_token")
        extra = f", {flops / 1e6:.1f} MFLOPs/token (training)" if flops else ""
        print(f"{side:>10}: {median[side]:7.0f} tokens/s, {info[side]['parameters']:,} parameters{extra}")
    print(f"    ratio: moe / dense (same active parameters) = {ratios['moe_over_dense']:.3f}")
    print(f"           moe / transformers Mixtral loop       = {ratios['moe_over_hf_mixtral']:.3f}")
    grouped = "torch._grouped_mm" if args.dtype == "bfloat16" else "none in float32: both sides loop"
    print(f"           grouped / per-expert expert GEMMs     = {ratios['grouped_over_loop']:.3f} ({grouped})")
    results = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "tokens_per_step": tokens_per_step,
        "step_wall_seconds": wall,
        "median_tokens_per_sec": median,
        "ratios": ratios,
        "sides": info,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
