"""Batching with exact resume and rank sharding.

- :class:`LMBatches` — nanoGPT-style random contiguous blocks for language modelling.
- :func:`lm_eval_batches` — a fixed, deterministic set of such blocks for evaluation.
- :class:`TokenBucketBatches` — length-bucketed batches of example indices under a padded-token budget
  (translation), with :func:`pad_batch` to collate them.

Every sampler draws from its own ``torch.Generator`` (never the global RNG), so a run's batches
depend only on the seed and the step; ``state_dict()``/``load_state_dict()`` resume them exactly.
Under data parallelism each rank draws the *global* batch identically and keeps its own slice, so
``world_size`` processes see exactly the rows of the single-process batch.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import Tensor

from attnlab._checks import int_at_least, integer, tensor

__all__ = ["LMBatches", "lm_eval_batches", "TokenBucketBatches", "pad_batch"]


def _check_int(name: str, value, minimum: int) -> int:
    """Return ``value`` after checking it is an int (else ``TypeError``) ``>= minimum`` (else ``ValueError``)."""
    integer(name, value)
    int_at_least(name, value, minimum)
    return value


def _check_rank(rank: int, world_size: int) -> None:
    _check_int("world_size", world_size, 1)
    _check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size={world_size}, got {rank}")


def _check_shard(batch_size: int, rank: int, world_size: int) -> int:
    """Validate ``rank``/``world_size``; return the per-rank batch ``batch_size // world_size``."""
    _check_rank(rank, world_size)
    if batch_size % world_size:
        raise ValueError(f"batch_size ({batch_size}) must be divisible by world_size ({world_size})")
    return batch_size // world_size


def _check_data(data: Tensor, block_size: int) -> Tensor:
    tensor("data", data, shape="(N,) of token ids")
    if data.dim() != 1 or data.dtype.is_floating_point or data.dtype.is_complex or data.dtype == torch.bool:
        raise ValueError(f"data must be a 1-D integer tensor (N,), got shape {tuple(data.shape)} dtype {data.dtype}")
    if data.numel() <= block_size:
        raise ValueError(f"data has {data.numel()} tokens, need more than block_size={block_size}")
    return data


def _blocks(data: Tensor, starts: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """``x[b] = data[s_b : s_b+T]``, ``y[b] = data[s_b+1 : s_b+T+1]`` as int64."""
    idx = starts[:, None] + torch.arange(block_size + 1)  # (B, T+1)
    chunk = data[idx].long()  # (B, T+1)
    return chunk[:, :-1], chunk[:, 1:]  # (B, T), (B, T)


class GeneratorState:
    """For batch sources whose whole state is ``self.generator`` (a ``torch.Generator``): ``state_dict`` /
    ``load_state_dict`` so a resumed run draws the batches an uninterrupted one would."""

    generator: torch.Generator

    def state_dict(self) -> dict:
        """``{"generator": ByteTensor}``."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s state. Raises ValueError for anything else."""
        if not isinstance(state, dict) or not isinstance(state.get("generator"), Tensor):
            raise ValueError(f"state must be a dict with a 'generator' tensor (from {type(self).__name__}.state_dict)")
        self.generator.set_state(state["generator"].cpu().clone())  # a CPU ByteTensor, whatever map_location


class LMBatches:
    """Endless random contiguous blocks of a token stream: ``next(it) -> (x, y)``, ``y`` = ``x`` shifted by one.

    Each step draws ``batch_size`` start offsets ``s ~ U{0, …, N - block_size - 1}`` from the sampler's
    generator (the global batch, identical on every rank); rank ``r`` returns rows
    ``[r·b, (r+1)·b)`` with ``b = batch_size // world_size``.

    Args:
        data: token ids, shape ``(N,)``, any integer dtype (batches are int64).
        block_size: tokens per row ``T``.
        batch_size: rows in the global batch (over all ranks).
        seed: seeds the sampler's ``torch.Generator``.
        rank, world_size: this process's slice of the global batch.

    Raises:
        TypeError, ValueError: bad arguments (non-integer data, ``N <= block_size``,
            ``batch_size % world_size != 0``, ``rank >= world_size``, ...).
    """

    def __init__(self, data: Tensor, *, block_size: int, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1):
        self.block_size = _check_int("block_size", block_size, 1)
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.seed = _check_int("seed", seed, 0)
        self.local_batch_size = _check_shard(batch_size, rank, world_size)
        self.rank, self.world_size = rank, world_size
        self.data = _check_data(data, block_size)
        self.generator = torch.Generator().manual_seed(seed)
        self.step = 0

    def __iter__(self) -> "LMBatches":
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        starts = torch.randint(self.data.numel() - self.block_size, (self.batch_size,), generator=self.generator)
        self.step += 1
        b = self.local_batch_size
        return _blocks(self.data, starts[self.rank * b:(self.rank + 1) * b], self.block_size)  # (b, T) each

    def state_dict(self) -> dict:
        """``{"generator": ByteTensor, "step": int, "seed": int}`` — enough to draw the same next batches."""
        return {"generator": self.generator.get_state(), "step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`. Raises ValueError if keys are missing or malformed."""
        if not isinstance(state, dict) or not {"generator", "step"} <= state.keys():
            raise ValueError("state must be a dict with keys 'generator' and 'step' (from LMBatches.state_dict)")
        gen = state["generator"]
        if not isinstance(gen, Tensor) or gen.dtype != torch.uint8:
            raise ValueError("state['generator'] must be a torch.uint8 tensor (torch.Generator.get_state())")
        self.generator.set_state(gen.cpu().clone())  # a CPU ByteTensor, whatever map_location
        self.step = _check_int("state['step']", state["step"], 0)

    def __repr__(self) -> str:
        return (f"LMBatches(tokens={self.data.numel()}, block_size={self.block_size}, batch_size={self.batch_size}, "
                f"rank={self.rank}, world_size={self.world_size}, step={self.step})")


def lm_eval_batches(data: Tensor, *, block_size: int, batch_size: int, num_batches: int, seed: int,
                    rank: int = 0, world_size: int = 1) -> list[tuple[Tensor, Tensor]]:
    """A fixed list of ``num_batches`` evaluation batches ``(x, y)``, the same on every call with the same seed.

    Drawn exactly as :class:`LMBatches` with ``seed`` (so the estimate of the eval loss uses the
    same blocks at every evaluation of a run); ``rank``/``world_size`` slice each batch the same way.

    Returns:
        list of ``(x (b, T), y (b, T))`` int64 pairs, ``b = batch_size // world_size``.
    """
    _check_int("num_batches", num_batches, 1)
    it = LMBatches(data, block_size=block_size, batch_size=batch_size, seed=seed, rank=rank, world_size=world_size)
    return [next(it) for _ in range(num_batches)]


class TokenBucketBatches:
    """Endless batches of example indices of similar length, each within a padded-token budget.

    Example ``i`` has size ``s_i = len_i`` (or ``max(src_len_i, tgt_len_i)`` for pairs); a batch ``B`` costs
    ``|B| · max_{i∈B} s_i`` padded tokens (per side), kept ``<= max_tokens`` (and ``|B| <= max_batch_size``).
    Each epoch: indices are ordered by size, ties in a random order, and cut greedily into batches; the
    batch order is shuffled (fairseq's scheme). The randomness of epoch ``e`` comes from
    ``torch.Generator().manual_seed(seed * 1_000_003 + e)`` only, so ``(epoch, position)`` resumes exactly.
    With ``shuffle=False`` batches come in size order, the same every epoch (for evaluation).

    Under data parallelism rank ``r`` takes batches ``r, r + W, r + 2W, …`` of the epoch (disjoint across
    ranks); when the count is not a multiple of ``W`` the first batches are repeated to fill the last round
    (as ``DistributedSampler`` pads), so every rank takes ``len(self)`` steps per epoch.

    Args:
        lengths: per-example token counts, ``[len_i]`` or ``[(src_len_i, tgt_len_i)]``.
        max_tokens: padded-token budget per batch (per side).
        shuffle: random tie order and batch order per epoch.
        seed: seeds each epoch's permutation.
        rank, world_size: this process's share of the batches.
        max_batch_size: optional cap on examples per batch.

    Raises:
        ValueError: empty ``lengths``, a non-positive length, an example longer than ``max_tokens``,
            bad ``rank``/``world_size``.
    """

    def __init__(self, lengths: Sequence[Union[int, tuple[int, int]]], *, max_tokens: int, shuffle: bool = True,
                 seed: int = 0, rank: int = 0, world_size: int = 1, max_batch_size: Union[int, None] = None):
        self.max_tokens = _check_int("max_tokens", max_tokens, 1)
        self.max_batch_size = None if max_batch_size is None else _check_int("max_batch_size", max_batch_size, 1)
        self.seed = _check_int("seed", seed, 0)
        _check_rank(rank, world_size)
        self.rank, self.world_size, self.shuffle = rank, world_size, bool(shuffle)
        self.sizes = self._sizes(lengths)  # (N,)
        too_long = (self.sizes > max_tokens).nonzero().flatten()
        if too_long.numel():
            i = too_long[0].item()
            raise ValueError(f"{too_long.numel()} example(s) are longer than max_tokens={max_tokens} (e.g. index {i}, "
                             f"{self.sizes[i].item()} tokens): filter them out or raise max_tokens")
        self.epoch, self.position = 0, 0
        self._batches = self.epoch_batches(0)

    @staticmethod
    def _sizes(lengths) -> Tensor:
        if isinstance(lengths, Tensor):
            lengths = lengths.tolist()
        lengths = list(lengths)
        if not lengths:
            raise ValueError("lengths must not be empty")
        try:
            sizes = torch.tensor([max(x) if isinstance(x, (tuple, list)) else x for x in lengths], dtype=torch.long)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError("lengths must be a sequence of ints or of (src_len, tgt_len) int pairs") from None
        if (sizes < 1).any():
            raise ValueError(f"every length must be >= 1, got {sizes.min().item()}")
        return sizes

    def _all_batches(self, epoch: int) -> list[list[int]]:
        """Every batch of ``epoch`` (all ranks), in the order they are served."""
        n = self.sizes.numel()
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(n, generator=g) if self.shuffle else torch.arange(n)
        order = order[torch.sort(self.sizes[order], stable=True).indices].tolist()  # by size, ties random
        sizes = self.sizes.tolist()
        batches, cur, longest = [], [], 0
        for i in order:  # sizes ascend, so a batch's longest example is its newest one
            longest = max(longest, sizes[i])
            full = self.max_batch_size is not None and len(cur) == self.max_batch_size
            if cur and ((len(cur) + 1) * longest > self.max_tokens or full):
                batches.append(cur)
                cur, longest = [], sizes[i]
            cur.append(i)
        batches.append(cur)
        if self.shuffle:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
        return batches

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch`` (a fresh list; the sampler's position is untouched)."""
        _check_int("epoch", epoch, 0)
        batches = self._all_batches(epoch)
        W = self.world_size
        batches += batches[:(-len(batches)) % W]  # pad to a multiple of W
        return batches[self.rank::W]

    def __len__(self) -> int:
        """Batches per epoch for this rank (the same every epoch)."""
        return len(self._batches)

    def __iter__(self) -> "TokenBucketBatches":
        return self

    def __next__(self) -> list[int]:
        if self.position == len(self._batches):
            self.epoch, self.position = self.epoch + 1, 0
            self._batches = self.epoch_batches(self.epoch)
        batch = self._batches[self.position]
        self.position += 1
        return list(batch)

    def state_dict(self) -> dict:
        """``{"epoch": int, "position": int, "seed": int}``: batches served so far in the current epoch."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``(epoch, position)`` from :meth:`state_dict`. Raises ValueError on malformed state."""
        if not isinstance(state, dict) or not {"epoch", "position"} <= state.keys():
            raise ValueError("state must be a dict with keys 'epoch' and 'position' "
                             "(from TokenBucketBatches.state_dict)")
        epoch = _check_int("state['epoch']", state["epoch"], 0)
        position = _check_int("state['position']", state["position"], 0)
        batches = self.epoch_batches(epoch)
        if position > len(batches):
            raise ValueError(f"state['position'] must be <= {len(batches)} batches per epoch, got {position}")
        self.epoch, self.position, self._batches = epoch, position, batches

    def __repr__(self) -> str:
        return (f"TokenBucketBatches(examples={self.sizes.numel()}, max_tokens={self.max_tokens}, "
                f"batches_per_epoch={len(self)}, rank={self.rank}, world_size={self.world_size}, "
                f"epoch={self.epoch}, position={self.position})")


def pad_batch(seqs: Sequence[Union[Sequence[int], Tensor]], pad_id: int) -> Tensor:
    """Right-pad token sequences to the longest: ``out[b, t] = seqs[b][t]`` for ``t < len_b``, else ``pad_id``.

    Returns:
        ``(B, L)`` int64 tensor, ``L = max_b len_b``.

    Raises:
        ValueError: empty ``seqs``; TypeError: ``pad_id`` not an int.
    """
    integer("pad_id", pad_id)
    if len(seqs) == 0:
        raise ValueError("seqs must not be empty")
    rows = [torch.as_tensor(s, dtype=torch.long).flatten() for s in seqs]
    out = torch.full((len(rows), max(r.numel() for r in rows)), pad_id, dtype=torch.long)  # (B, L)
    for b, r in enumerate(rows):
        out[b, :r.numel()] = r
    return out
