"""``attnlab generate``: continue a prompt with a decoder-only model, or answer a source text with an
encoder–decoder, from an HF-format folder or a Hub id.

The model is loaded in float32 and given its inference layout (:meth:`optimize_for_inference`, decoder-only
models) in ``--dtype`` — by default ``auto``: bfloat16 weights where this CPU computes bf16 natively and
faster, float32 elsewhere (``attnlab env`` shows the choice; an emulated bf16 would be many times slower).
Decoding is :func:`attnlab.generation.generate`: greedy by default, ``--do-sample`` with the common ``--seed``,
``--num-beams`` for beam search. Each prompt is decoded on its own (batch 1), so no padding changes a result.
"""
from __future__ import annotations

import argparse

EPILOG = """examples:
  attnlab generate --model path/to/gpt2-dir --prompt "Once upon a time" --max-new-tokens 40
  attnlab generate --model org/name --prompt "ROMEO:" --do-sample --temperature 0.8 --top-k 50 --seed 1
  attnlab generate --model t5-dir --prompt "translate English to German: Hello" --num-beams 4
  attnlab generate --model gpt2-dir --prompt "a" --prompt "b" --dtype float32      # one line per prompt
--model is an HF-format folder (config.json, safetensors, tokenizer.json) or a Hub id (org/name)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``attnlab generate`` (the common flags are added by :mod:`attnlab.cli`)."""
    p.add_argument("--model", required=True, help="HF-format model folder or Hub id (GPT-2, Llama, T5, BART)")
    p.add_argument("--prompt", action="append", required=True,
                   help="text to continue (decoder-only) or the source text (encoder-decoder); repeatable")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one with --model)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to add at most (default 32)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of taking the most likely token")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample within the smallest set of mass >= p")
    p.add_argument("--num-beams", type=int, default=1, help="beam search with this many beams (default 1)")
    p.add_argument("--window", type=int, default=None,
                   help="decoder-only: sliding-window self-attention of this width, its KV cache a ring buffer "
                        "(O(window) memory however many tokens)")


def main(args: argparse.Namespace) -> int:
    import torch

    from attnlab._runtime import resolve_dtype, torch_dtype
    from attnlab.data.tokenizers import load_tokenizer
    from attnlab.models.hub import from_pretrained, resolve_pretrained

    prompts = [t for t in args.prompt if t.strip()]
    if len(prompts) != len(args.prompt):
        raise ValueError("--prompt must not be empty")
    folder = resolve_pretrained(args.model)  # a folder, or a Hub id's snapshot
    tok = load_tokenizer(args.tokenizer or folder)
    device = args.device or "cpu"
    name, reason = resolve_dtype(args.dtype or "auto", device, name="--dtype")
    model = from_pretrained(folder, dtype=torch.float32).to(device).eval()
    encoder_decoder = bool(getattr(model, "is_encoder_decoder", False))
    if not encoder_decoder and not hasattr(model, "new_cache"):
        raise ValueError(f"--model {args.model} holds a {type(model).__name__}, which cannot generate: give a "
                         "decoder-only (GPT-2, Llama) or encoder-decoder (T5, BART) model")
    if args.window is not None:
        if encoder_decoder:
            raise ValueError("--window is for decoder-only models (GPT-2, Llama)")
        from attnlab.adapt.deploy import set_window
        set_window(model, args.window)
    if hasattr(model, "optimize_for_inference"):
        model.optimize_for_inference(dtype=torch_dtype(name))  # weight-only bf16, or fp32's packed layout
    else:
        model.to(torch_dtype(name))
    print(f"{type(model).__name__}, dtype {name} ({reason})")
    generator = torch.Generator(device=device).manual_seed(args.seed or 0) if args.do_sample else None
    # a decoder-only model stops at its tokenizer's end token, when it has one (encoder-decoders: the model's)
    stop = {} if encoder_decoder or tok.eos_id is None else {"eos_token_id": tok.eos_id}
    for text in prompts:
        ids = torch.tensor([tok.encode(text)], device=device)
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             num_beams=args.num_beams, generator=generator,
                             cache="dynamic" if args.window is None else "window", **stop)
        new = out[0, 1:] if encoder_decoder else out[0, ids.shape[1]:]  # after the start token / the prompt
        print(tok.decode(new.tolist()) if encoder_decoder else text + tok.decode(new.tolist()))
    return 0
