"""Synthetic sequence tasks generated on the fly (no download).

Token ids: ``PAD=0, BOS=1, EOS=2``, symbols from ``3``. A target sequence is
``BOS y_1 … y_T EOS`` padded with ``PAD``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

PAD, BOS, EOS = 0, 1, 2
SPECIALS = 3


@dataclass
class ReverseTask:
    """Reverse a random string of ``num_symbols`` symbols, length in ``[min_len, max_len]``.

    Output alignment is the anti-diagonal: target position ``t`` copies source ``L-1-t``.
    ``held_out`` strings are drawn once from their own seed and never appear in training batches.
    """

    num_symbols: int = 10
    min_len: int = 4
    max_len: int = 12
    held_out: int = 1000
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}")
        if self.num_symbols < 2:
            raise ValueError(f"num_symbols must be >= 2, got {self.num_symbols}")
        g = torch.Generator().manual_seed(self.seed + 1_000_003)
        self.test_src = self._strings(self.held_out, g)
        self._test_keys = {tuple(s) for s in self.test_src}

    @property
    def vocab_size(self) -> int:
        return SPECIALS + self.num_symbols

    def _strings(self, n: int, g: torch.Generator) -> list[list[int]]:
        lens = torch.randint(self.min_len, self.max_len + 1, (n,), generator=g).tolist()
        syms = torch.randint(SPECIALS, self.vocab_size, (n, self.max_len), generator=g).tolist()
        return [row[:L] for row, L in zip(syms, lens)]

    def train_batch(self, batch_size: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
        """``(src (B, S), tgt (B, T+2))`` with no string from the held-out set."""
        out: list[list[int]] = []
        while len(out) < batch_size:
            out += [s for s in self._strings(batch_size, g) if tuple(s) not in self._test_keys]
        return self.encode(out[:batch_size])

    def encode(self, strings: list[list[int]]) -> tuple[Tensor, Tensor]:
        S = max(len(s) for s in strings)
        src = torch.full((len(strings), S), PAD, dtype=torch.long)
        tgt = torch.full((len(strings), S + 2), PAD, dtype=torch.long)
        for i, s in enumerate(strings):
            src[i, :len(s)] = torch.tensor(s)
            tgt[i, :len(s) + 2] = torch.tensor([BOS] + s[::-1] + [EOS])
        return src, tgt

    def to_text(self, ids) -> str:
        """Symbols as digits (``3 -> '0'``), stopping at EOS."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if i >= SPECIALS:
                out.append(str(i - SPECIALS) if self.num_symbols <= 10 else f"<{i - SPECIALS}>")
        return "".join(out)
