"""Two nodes for real: two torchrun agents meet through a c10d rendezvous, as on a cluster.

Both agents run on this machine, each as one "node" with 2 worker processes (the command of
examples/slurm/train.sbatch, with 127.0.0.1 as the head node). Together they train dp2 x tp2 (4
ranks, TP inside a node, DP across the two) and must reproduce the one-process losses.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
NODES, PROCS_PER_NODE = 2, 2
STEPS = 10
AGENT_TIMEOUT_S = 300  # each agent; a healthy run takes well under a minute on 2 cores


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_env() -> dict[str, str]:
    """This environment without what would make a worker think it is already placed (pytest under torchrun)."""
    placed = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in placed and not k.startswith(("NANOCORE_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop(agent: subprocess.Popen) -> None:
    """End an agent and its workers: SIGTERM (torchrun passes it on), then SIGKILL whatever is left."""
    if agent.poll() is not None:
        return
    workers = descendants(agent.pid)
    agent.terminate()
    try:
        agent.wait(timeout=10)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launch_nodes(config: Path, workdir: Path) -> list[tuple[int | None, str]]:
    """Run the two agents to the end; (return code or None on timeout, stderr) per node."""
    endpoint = f"127.0.0.1:{free_port()}"
    run_id = f"test-{uuid.uuid4().hex[:8]}"
    agents, logs = [], []
    try:
        for node in range(NODES):
            log = (workdir / f"node{node}.log").open("w")
            logs.append(log)
            command = [
                str(TORCHRUN),
                f"--nnodes={NODES}",
                f"--nproc_per_node={PROCS_PER_NODE}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint={endpoint}",
                f"--rdzv_id={run_id}",
                # on a cluster the head node sees its own name in the endpoint and hosts the store;
                # here both agents share one address, so say which one hosts
                f"--rdzv_conf=is_host={int(node == 0)},join_timeout=120",
                "--local_addr=127.0.0.1",
                "--max_restarts=0",
                str(ROOT / "run_train.py"),
                "--config-file",
                str(config),
            ]
            agents.append(
                subprocess.Popen(
                    command, cwd=workdir, env=agent_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        codes: list[int | None] = [None] * NODES
        deadline = time.monotonic() + AGENT_TIMEOUT_S
        while time.monotonic() < deadline and None in codes:
            codes = [agent.poll() for agent in agents]
            if any(code not in (None, 0) for code in codes):
                break  # one node failed: the other would only wait for it
            time.sleep(0.2)
    finally:
        for agent in agents:
            stop(agent)
        for log in logs:
            log.close()
    return [(code, (workdir / f"node{node}.log").read_text()) for node, code in enumerate(codes)]


def test_two_torchrun_agents_as_two_nodes_match_one_process(tmp_path):
    reference = run_training(tiny_config(tmp_path / "reference"), 1)["losses"]
    assert len(reference) == STEPS and max(reference) - min(reference) > 0.01, reference

    raw = tiny_config(
        tmp_path / "nodes",
        parallelism={"dp": 2, "tp": 2, "pp": 1},
        tokens={"train_steps": STEPS, "batch_accumulation_per_replica": 2},  # same global batch as one process
        checkpoints={"save_final_state": True},
        logging={"loggers": ["jsonl"]},
    )
    config = tmp_path / "nodes.yaml"
    config.write_text(yaml.safe_dump(raw))

    results = launch_nodes(config, tmp_path)
    report = "\n".join(f"--- node {n}: exit {code} ---\n{log[-4000:]}" for n, (code, log) in enumerate(results))
    assert [code for code, _ in results] == [0] * NODES, report

    rows = [json.loads(line) for line in (tmp_path / "nodes" / "logs" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["lm_loss"] for row in rows if "lm_loss" in row]
    assert [row["step"] for row in rows if "lm_loss" in row] == list(range(1, STEPS + 1)), report
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True)]
    assert max(diffs) <= 1e-4, f"relative loss differences per step {diffs}\n{report}"

    checkpoints = tmp_path / "nodes" / "checkpoints"
    assert (checkpoints / "latest.txt").read_text().strip() == str(STEPS)
    meta = json.loads((checkpoints / str(STEPS) / "meta.json").read_text())
    assert meta["topology"] == {"dp": 2, "tp": 2, "pp": 1, "cp": 1, "world_size": 4}
