"""Asynchronous checkpoints (`checkpoints.async_save: true`): write while training goes on.

The step that saves stops only to copy this rank's pieces to host memory (`HostBuffers`: kept
from save to save; pinned memory and one synchronisation on CUDA) and to start a `BackgroundWrite`: a
thread that writes the safetensors files and the RNG state into the step's temporary folder, then
hashes and fsyncs them (`write_part`). The thread does no collective: the ranks agree that every
part is written from the training thread (the trainer asks once per step while a save is in
flight), and only then does rank 0 seal the folder (manifest, rename, `latest.txt`), exactly as a
synchronous save does. So `latest.txt` never names a checkpoint that is not complete, and a process
killed during a background write leaves the previous checkpoint as the latest.

At most one save is in flight: the next save, the end of training and a stop by signal first wait
for it. An error on any rank ends the run (the thread joined) without moving `latest.txt`.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterable
from pathlib import Path

import attrs
import torch

from nanocore.checkpoint.folder import rng_state
from nanocore.checkpoint.manifest import write_part
from nanocore.checkpoint.tensors import ShardedTensor, write_shards


class HostBuffers:
    """Host memory the pieces are copied into, kept from one save to the next: the copy of a later save
    then only writes memory that is already mapped (a fresh allocation of the whole state costs page
    faults that take longer than the copy). Pinned on CUDA, so the copy runs at full bus speed. One
    save is in flight at a time, so a buffer is never written while a writer reads it."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def copy(self, shards: Iterable[ShardedTensor]) -> list[ShardedTensor]:
        """The pieces copied to host memory, so that training may change the originals at once."""
        out = []
        on_cuda = False
        for i, shard in enumerate(shards):
            tensor = shard.tensor.detach()
            if i == len(self.buffers):
                self.buffers.append(torch.empty(0))
            buffer = self.buffers[i]
            if buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = self.buffers[i] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            buffer.copy_(tensor, non_blocking=tensor.is_cuda)
            on_cuda = on_cuda or tensor.is_cuda
            out.append(attrs.evolve(shard, tensor=buffer))
        if on_cuda:
            torch.cuda.synchronize()
        return out


def rng_bytes() -> bytes:
    """This process's RNG states now, serialised as `save_rng` writes them."""
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)
    return buffer.getvalue()


class BackgroundWrite:
    """One rank's part of one checkpoint, written by a thread (see the module docstring)."""

    def __init__(
        self,
        folder: Path,
        step: int,
        rank: int,
        model: list[ShardedTensor],
        optimizer: list[ShardedTensor],
        rng: bytes,
    ):
        self.folder, self.step, self.rank = folder, step, rank
        self.error: BaseException | None = None
        self._work: tuple[list[ShardedTensor], list[ShardedTensor], bytes] | None = (model, optimizer, rng)
        self._thread = threading.Thread(target=self._write, name=f"nanocore-checkpoint-{step}", daemon=False)
        self._thread.start()

    def _write(self) -> None:
        assert self._work is not None
        model, optimizer, rng = self._work
        try:
            rank_file = f"rank-{self.rank:05d}.safetensors"
            write_shards(self.folder / "model" / rank_file, model)
            write_shards(self.folder / "optimizer" / rank_file, optimizer)
            (self.folder / "rng").mkdir(parents=True, exist_ok=True)
            (self.folder / "rng" / f"rank-{self.rank:05d}.pt").write_bytes(rng)
            write_part(self.folder, self.rank)  # hashes and fsyncs this rank's files
        except BaseException as exc:  # handed to the training thread, which tells every rank
            self.error = exc
        finally:
            self._work = None  # the host copies go as soon as they are on disk

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
