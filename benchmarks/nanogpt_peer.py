"""A same-machine stand-in for nanoGPT's CPU run of ``shakespeare_char``, in plain PyTorch.

nanoGPT is not on PyPI, and the times ``benchmarks/train.py`` records for it (``NANOGPT``) were
measured on a different CPU; this script is the peer run on *this* machine, in a fresh process as
our rows are. It is our own code, written to do what nanoGPT's ``train.py`` does on a CPU with the
README's command (``--device=cpu --compile=False --eval_iters=20 --block_size=64 --batch_size=12
--n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0``):

- model: token + learned position embeddings, pre-norm blocks (LayerNorm, causal
  ``F.scaled_dot_product_attention``, exact GELU MLP), final LayerNorm, tied head, ``bias=False``,
  N(0, 0.02) init with residual projections at 0.02 / √(2·n_layer);
- training: float32 (nanoGPT uses no autocast on a CPU), AdamW (foreach; fused is CUDA-only there)
  with weight decay on ≥ 2-D parameters, β = (0.9, 0.99), clip 1.0, lr = 1e-3 · (it+1)/(warmup+1)
  for ``it < 100``, then cosine to 1e-4 at ``it = 2000``; random contiguous blocks;
- evaluation: every 250 steps, ``eval_iters`` batches of each split (nanoGPT's ``estimate_loss``).

It prints one JSON line: ``wall_s`` (data to last step), ``tokens_per_s``, ``val_loss`` (nanoGPT's own
estimate at the last evaluation), ``val_loss_fixed`` (the final model on the recipe's fixed
validation blocks, the number our rows report), and the model's shape (``model_args``, ``batch_size``).

Run: ``python benchmarks/nanogpt_peer.py [--threads 2] [--n-layer 4 --n-embd 128 --block-size 64 ...]``
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                   for t in self.c_attn(self.ln_1(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, layers: int, heads: int, d: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--max-iters", type=int, default=2000)
    p.add_argument("--eval-interval", type=int, default=250)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="the recipe's seed (its validation blocks use seed + 1)")
    p.add_argument("--fixed-eval-batches", type=int, default=16, help="the recipe's eval_batches")
    p.add_argument("--fixed-eval-batch-size", type=int, default=64, help="the recipe's eval_batch_size")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1337)
    t0 = time.perf_counter()
    from attnlab.data.batching import lm_eval_batches  # the recipe's fixed validation blocks
    from attnlab.data.datasets import load_text

    text = load_text("tinyshakespeare")
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n = int(0.9 * len(data))
    splits = {"train": data[:n], "val": data[n:]}

    def get_batch(split):
        d = splits[split]
        ix = torch.randint(len(d) - a.block_size, (a.batch_size,))
        return (torch.stack([d[i:i + a.block_size] for i in ix]),
                torch.stack([d[i + 1:i + 1 + a.block_size] for i in ix]))

    model = GPT(len(chars), a.block_size, a.n_layer, a.n_head, a.n_embd)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.99))

    def lr_at(it):
        if it < 100:
            return 1e-3 * (it + 1) / (100 + 1)
        ratio = min(1.0, (it - 100) / (a.max_iters - 100))
        return 1e-4 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1e-3 - 1e-4)

    @torch.no_grad()
    def estimate(split):
        model.eval()
        losses = [model(*get_batch(split)).item() for _ in range(a.eval_iters)]
        model.train()
        return sum(losses) / len(losses)

    val_loss = None
    train_s = 0.0
    for it in range(a.max_iters + 1):
        if it % a.eval_interval == 0 or it == a.max_iters:
            estimate("train")
            val_loss = estimate("val")
        if it == a.max_iters:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(it)
        t = time.perf_counter()
        loss = model(*get_batch("train"))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_s += time.perf_counter() - t
    wall_s = time.perf_counter() - t0
    with torch.no_grad():
        model.eval()
        fixed = lm_eval_batches(splits["val"], block_size=a.block_size, batch_size=a.fixed_eval_batch_size,
                                num_batches=a.fixed_eval_batches, seed=a.seed + 1)
        total = sum(model(x, y).item() * y.numel() for x, y in fixed)
        fixed_loss = total / sum(y.numel() for _, y in fixed)
    print(json.dumps({"wall_s": wall_s, "steps": a.max_iters, "val_loss": val_loss, "val_loss_fixed": fixed_loss,
                      "tokens_per_s": a.max_iters * a.batch_size * a.block_size / train_s, "batch_size": a.batch_size,
                      "model_args": {"n_layer": a.n_layer, "n_embd": a.n_embd, "block_size": a.block_size,
                                     "vocab_size": len(chars)}}))


if __name__ == "__main__":
    main()
