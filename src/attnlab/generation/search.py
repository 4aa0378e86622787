"""The decoding loops of :func:`attnlab.generation.generate`, one token per step on the KV cache::

    greedy:  y_t = argmax_v p(v | y_<t)
    sample:  y_t ~ softmax(z_t / T), restricted to the top-k logits and then to the smallest set
             of tokens whose probability mass reaches top_p (nucleus, Holtzman et al. 2020)
    beam:    keep the num_beams prefixes of highest Σ log p; a finished hypothesis scores
             Σ log p / len^α (α = length_penalty), len = number of generated tokens

The beam search follows Hugging Face ``transformers`` step for step (2·num_beams candidates per step,
``early_stopping=False`` heuristic), so on the same weights it returns the same tokens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.generation.state import reorder_cache

if TYPE_CHECKING:
    from attnlab.generation import GenerationConfig


def _next_logits(model, ids: Tensor, mask: Optional[Tensor], past) -> Tensor:
    """The logits ``(B, V)`` of the position after ``ids``, continuing the cached prefix ``past`` (updated)."""
    keep = {"logits_to_keep": 1} if getattr(model, "accepts_logits_to_keep", False) else {}
    logits = model(ids, attention_mask=mask, past_key_values=past, use_cache=True, **keep).logits[:, -1]
    if torch.isnan(logits.amax()):  # (amax propagates NaN: one reduction) argmax or sampling would make it a token
        row = int(torch.isnan(logits).any(-1).nonzero()[0])
        raise ValueError(f"the model's next-token logits hold NaN (row {row}): no token can be chosen; check the "
                         "weights and inputs for NaN or overflow")
    return logits


def decode(model, input_ids, mask, past, config: GenerationConfig, generator, streamer=None) -> Tensor:
    """Greedy or sampled decoding, one token per step."""
    B, T0 = input_ids.shape
    max_new_tokens, eos, pad = config.max_new_tokens, config.eos_token_id, config.pad_token_id
    out = input_ids.new_full((B, T0 + max_new_tokens), 0 if pad is None else pad)
    out[:, :T0] = input_ids
    unfinished = torch.ones(B, dtype=torch.bool, device=input_ids.device)
    logits = _next_logits(model, input_ids, mask, past)
    for t in range(T0, T0 + max_new_tokens):
        logits = logits.float()  # (B, V)
        if config.do_sample:
            probs = F.softmax(filter_logits(logits, temperature=config.temperature, top_k=config.top_k,
                                            top_p=config.top_p), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            nxt = logits.argmax(dim=-1)
        if eos is not None:
            nxt = torch.where(unfinished, nxt, pad)
            unfinished &= nxt != eos
        out[:, t] = nxt
        if streamer is not None:
            streamer(nxt)
        if t + 1 == T0 + max_new_tokens or (eos is not None and not bool(unfinished.any())):
            return out[:, :t + 1]
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
        logits = _next_logits(model, out[:, t:t + 1], mask, past)
    return out


def filter_logits(logits: Tensor, *, temperature: float = 1.0, top_k: Optional[int] = None,
                  top_p: Optional[float] = None) -> Tensor:
    """``z / T``, then -inf outside the ``top_k`` largest, then outside the nucleus of mass ``top_p``.

    The nucleus keeps the most probable tokens whose cumulative probability reaches ``top_p``
    (always at least one), as ``transformers``' ``TopPLogitsWarper``.
    """
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p
        drop[..., -1] = False  # keep the most probable token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def beam_search(model, input_ids, mask, past, config: GenerationConfig) -> Tensor:
    """Beam search with ``transformers``' vectorised bookkeeping (finished hypotheses kept per item)."""
    B, T0 = input_ids.shape
    max_new_tokens, nb, length_penalty = config.max_new_tokens, config.num_beams, config.length_penalty
    eos, pad = config.eos_token_id, config.pad_token_id
    dev = input_ids.device
    max_len = T0 + max_new_tokens
    K = 2 * nb  # candidates kept per step: max(2, 1 + #eos) · num_beams, as transformers
    is_top = torch.arange(K, device=dev) < nb  # only the top num_beams candidates may finish
    batch_offset = torch.arange(B, device=dev).unsqueeze(1) * nb  # (B, 1)

    running = input_ids.new_full((B, nb, max_len), pad if pad is not None else 0)
    running[:, :, :T0] = input_ids.unsqueeze(1)
    running_scores = torch.zeros(B, nb, device=dev)
    running_scores[:, 1:] = -1e9  # the beams start identical: expand only the first
    done = running.clone()  # finished hypotheses
    done_scores = torch.full((B, nb), -1e9, device=dev)
    done_lens = torch.zeros(B, nb, dtype=torch.long, device=dev)
    done_flag = torch.zeros(B, nb, dtype=torch.bool, device=dev)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=dev)

    # prefill the B prompts once, then copy each row's cache to its beams
    logits = _next_logits(model, input_ids, mask, past)
    expand = torch.arange(B, device=dev).repeat_interleave(nb)
    reorder_cache(past, expand)
    logits = logits.index_select(0, expand)
    if mask is not None:
        mask = mask.index_select(0, expand)
    cur = T0
    while True:
        V = logits.shape[-1]
        logp = F.log_softmax(logits.float(), dim=-1).view(B, nb, V) + running_scores.unsqueeze(-1)
        top_logp, top_idx = torch.topk(logp.view(B, nb * V), K)  # (B, K)
        src, tok = top_idx // V, top_idx % V
        cand = torch.take_along_dim(running, src.unsqueeze(-1), dim=1)  # (B, K, max_len)
        cand[:, :, cur] = tok
        ends = torch.full_like(tok, cur + 1 >= max_len, dtype=torch.bool)
        if eos is not None:
            ends |= tok == eos
        # the best num_beams unfinished candidates run on
        run_logp = top_logp + ends.float() * -1e9
        keep = torch.topk(run_logp, nb)[1]  # (B, nb)
        running = torch.take_along_dim(cand, keep.unsqueeze(-1), dim=1)
        running_scores = torch.take_along_dim(run_logp, keep, dim=1)
        parent = torch.take_along_dim(src, keep, dim=1)
        # finished candidates among the top num_beams compete with the kept hypotheses
        fin = ends & is_top
        fin_scores = top_logp / ((cur + 1 - T0) ** length_penalty)
        fin_scores = fin_scores + (~improvable).float() * -1e9
        fin_scores = fin_scores + (~fin) * -1e9
        merged = torch.topk(torch.cat([done_scores, fin_scores], dim=1), nb)[1]
        done = torch.take_along_dim(torch.cat([done, cand], dim=1), merged.unsqueeze(-1), dim=1)
        done_scores = torch.take_along_dim(torch.cat([done_scores, fin_scores], dim=1), merged, dim=1)
        done_lens = torch.take_along_dim(torch.cat([done_lens, torch.full_like(tok, cur + 1 - T0)], dim=1),
                                         merged, dim=1)
        done_flag = torch.take_along_dim(torch.cat([done_flag, fin], dim=1), merged, dim=1)
        cur += 1
        # early_stopping=False heuristic: can the best running beam still beat the worst finished one?
        best_running = running_scores[:, :1] / ((cur - T0) ** length_penalty)
        worst_done = torch.where(done_flag, done_scores.min(dim=1, keepdim=True).values, -1e9)
        improvable = improvable & (best_running > worst_done).any(dim=-1, keepdim=True)
        if not bool(improvable.any()) or bool(ends.all()):
            break
        reorder_cache(past, (parent + batch_offset).flatten())
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(B * nb, 1)], dim=1)
        step_ids = running[:, :, cur - 1].reshape(B * nb, 1)
        logits = _next_logits(model, step_ids, mask, past)
    return done[:, 0, :T0 + int(done_lens[:, 0].max())]
