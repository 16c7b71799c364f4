"""Data parallelism under torchrun: one code path from 1 to N processes.

`torchrun --nproc-per-node N -m pact.pipelines.train ...` (or `pact-train` under torchrun) sets
RANK / WORLD_SIZE / LOCAL_RANK; every rank memory-maps the same artifact and holds the frozen
weights on its own GPU (cuda:LOCAL_RANK; gloo on the CPU). The global micro-batch is the one a
single process with batch size B x N would take, split in N contiguous parts; each rank's loss
is divided by the global target count, and after the micro-batches the LoRA gradients are summed
by one flat all-reduce per step, so every rank applies the same update a single process would
(up to summation order). Only rank 0 writes the run folder.

A rank that fails does not leave the others waiting: each step (and the setup) ends with an
all-reduce of an error flag, and every rank stops with the failing rank's message.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from pact.formats import PactError


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def share(self, n: int) -> slice:
        """This rank's contiguous part of a global batch of ``n`` (sizes differ by at most one)."""
        return slice(self.rank * n // self.world, (self.rank + 1) * n // self.world)

    def sum(self, values: list[float], device) -> list[float]:
        """Element-wise sum over ranks (fp64)."""
        if not self.active:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t)
        return t.tolist()

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Every parameter's gradient summed over ranks, one flat all-reduce (fp32)."""
        if not self.active:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        torch.distributed.all_reduce(flat)
        off = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[off : off + n].view_as(g).to(p.dtype)
            off += n

    def check(self, error: BaseException | None, device) -> None:
        """Raise on every rank when any rank failed: the failing rank re-raises its own error, the
        others a PactError naming it (nobody waits in a collective for a rank that is gone)."""
        if not self.active:
            if error is not None:
                raise error
            return
        flag = torch.tensor([self.rank + 1 if error is not None else 0], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if error is not None:
            raise error
        if int(flag):
            raise PactError(f"rank {int(flag) - 1} of {self.world} failed (its error is in its output): "
                            "this rank stopped with it")

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()


def env_rank() -> int:
    """This process's rank as torchrun sets it (0 outside torchrun), read without joining anything."""
    return int(os.environ.get("RANK", "0"))


def env_world() -> int:
    """How many processes torchrun started (1 outside torchrun), read without joining anything."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def from_env(device: str | None) -> tuple[Dist, str | None]:
    """The process group torchrun describes (WORLD_SIZE > 1), joined here, and the device this rank
    uses: cuda:LOCAL_RANK when ``device`` is None or "cuda", else ``device`` (cpu: gloo)."""
    world = env_world()
    if world <= 1:
        return Dist(), device
    rank, local = env_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device in (None, "cuda") and torch.cuda.is_available()
    if device not in (None, "cuda", "cpu"):
        raise PactError(f"--device {device}: under torchrun each rank takes cuda:LOCAL_RANK; pass --device cuda "
                        "or cpu (or leave it out)")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                             timeout=datetime.timedelta(minutes=10),
                                             **({"device_id": torch.device("cuda", local)} if use_cuda else {}))
    if use_cuda:
        torch.cuda.set_device(local)
    return Dist(rank, world, local), f"cuda:{local}" if use_cuda else "cpu"


def leave(dist: Dist) -> None:
    if dist.active and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
