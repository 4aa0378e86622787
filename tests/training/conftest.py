"""Fixtures of the training tests: a tiny GPT on a synthetic token stream (the real corpus: tests/conftest.py)."""
from __future__ import annotations

import functools

import pytest
import torch

from attnlab.data.batching import LMBatches, lm_eval_batches
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
from attnlab.training.losses import causal_lm_loss
from attnlab.training.recipes.shakespeare import evaluate_lm
from attnlab.training.trainer import TrainConfig, Trainer

VOCAB, BLOCK = 17, 16


def _tiny_gpt(*, dropout: float = 0.1, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=16, n_layer=2, n_head=2,
                                      embd_pdrop=dropout, resid_pdrop=dropout, attn_pdrop=dropout,
                                      bos_token_id=None, eos_token_id=None))


def token_stream(n: int = 3000) -> torch.Tensor:
    # a learnable stream: a noisy cyclic pattern
    g = torch.Generator().manual_seed(1)
    base = torch.arange(n) % 7
    noise = torch.randint(0, VOCAB, (n,), generator=g)
    keep = torch.rand(n, generator=g) < 0.8
    return torch.where(keep, base, noise)


@pytest.fixture
def tiny_gpt():
    """``tiny_gpt(*, dropout=0.1, seed=0)``: a 2-layer, 16-wide GPT over a 17-token vocabulary, block 16."""
    return _tiny_gpt


@pytest.fixture
def make_trainer():
    """``make_trainer(out_dir, *, loss_fn=None, dropout=0.1, init_seed=0, batch_size=4, **config)``."""
    data = token_stream()
    val = lm_eval_batches(data, block_size=BLOCK, batch_size=8, num_batches=2, seed=5)

    def make(out_dir, *, loss_fn=None, dropout=0.1, init_seed=0, batch_size=4, evaluate=True, **overrides):
        cfg = dict(max_steps=12, lr=1e-2, min_lr=1e-3, warmup_steps=2, weight_decay=0.1, log_every=1,
                   progress=False, seed=0)
        cfg.update(overrides)
        batches = LMBatches(data, block_size=BLOCK, batch_size=batch_size, seed=3)
        ev = functools.partial(evaluate_lm, batches=val) if evaluate else None
        return Trainer(_tiny_gpt(dropout=dropout, seed=init_seed), TrainConfig(**cfg), train_batches=batches,
                       loss_fn=loss_fn or causal_lm_loss, evaluate=ev, out_dir=out_dir)
    return make
