"""Data-parallel training under ``torchrun``: process group, DDP wrap, rank-0 output, metric all-reduce.

``torchrun`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (and the rendezvous address); a
plain ``python`` run has none of them and is rank 0 of 1. The backend is ``nccl`` for CUDA
devices and ``gloo`` on CPU. Every rank builds the same model from the same seed; DDP also
broadcasts rank 0's parameters at wrap time and averages gradients in backward, so with each rank
holding ``1/W`` of the global batch the update equals the single-process one up to float
summation order.

One machine, two processes: ``torchrun --standalone --nproc_per_node=2 -m attnlab train ...``.
Several machines (here two, two processes each, the first reachable at 10.0.0.1), the same
command on every machine::

    torchrun --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=10.0.0.1:29500 \
        --rdzv_id=char1 -m attnlab train shakespeare-char --out /shared/runs/char

``--out`` should be on storage every machine sees: rank 0 writes it and every rank reads the
checkpoint on ``--resume``.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Union

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DistInfo", "dist_info_from_env", "resolve_device", "distributed", "wrap_ddp", "all_reduce_sum",
           "broadcast_object", "gather_objects"]


@dataclass(frozen=True)
class DistInfo:
    """This process's place: ``rank`` of ``world_size``, ``local_rank`` on its machine."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes files and logs."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an int, got {raw!r}") from None


def dist_info_from_env() -> DistInfo:
    """``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` from the environment (torchrun), default rank 0 of 1.

    Raises:
        ValueError: a variable is not an int or ``0 <= RANK < WORLD_SIZE`` fails.
    """
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local = _env_int("LOCAL_RANK", rank)
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ValueError(f"invalid torchrun environment: RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local}")
    return DistInfo(rank, world, local)


def resolve_device(device: str, info: DistInfo) -> torch.device:
    """``"cuda"`` becomes ``cuda:<LOCAL_RANK>`` under torchrun; ``"auto"`` = CUDA if available, else CPU.

    Raises:
        ValueError: CUDA requested but not available.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available (use device=cpu)")
        if dev.index is None:
            dev = torch.device("cuda", info.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    return dev


@contextmanager
def distributed(device: Union[str, torch.device] = "cpu") -> Iterator[DistInfo]:
    """Initialise the process group when ``WORLD_SIZE > 1`` (and it is not already), tear it down on exit.

    The backend is ``nccl`` for a CUDA ``device`` (``"auto"``: when CUDA is available), else ``gloo``.

    Yields:
        :class:`DistInfo` of this process (rank 0 of 1 without torchrun; nothing is initialised then).
    """
    info = dist_info_from_env()
    owner = info.enabled and not dist.is_initialized()
    if owner:
        cuda = torch.cuda.is_available() if device == "auto" else torch.device(device).type == "cuda"
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend=backend, rank=info.rank, world_size=info.world_size)
    try:
        yield info
    finally:
        if owner and dist.is_initialized():
            dist.destroy_process_group()


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """``DistributedDataParallel(model)`` when a process group of more than one rank is up, else ``model``."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return model
    ids = [device] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` over all ranks (a copy; the input is unchanged). Identity without a group."""
    if not (dist.is_available() and dist.is_initialized()):
        return values.clone()
    out = values.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s picklable ``obj`` on every rank (identity without a group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj) -> list:
    """``[obj of rank 0, obj of rank 1, …]`` on every rank (``[obj]`` without a group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
