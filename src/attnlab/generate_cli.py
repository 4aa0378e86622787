"""``attnlab generate``: continue a prompt with a decoder-only model, or answer a source text with an
encoder–decoder, from an HF-format folder, a Hub id or an ``attnlab train`` run folder.

The model is loaded in float32 and given its inference layout (:meth:`optimize_for_inference`, decoder-only
models) in ``--dtype`` — by default ``auto``: bfloat16 weights where this CPU computes bf16 natively and
faster, float32 elsewhere (``attnlab env`` shows the choice; an emulated bf16 would be many times slower) —
or int8 weights with ``--int8`` (:func:`attnlab.adapt.quantize`, dynamic int8 products), or int4 weights in groups
of ``--group-size`` columns with ``--int4`` (weight-only; 0.56 bytes a weight at the default 64).
Decoding is :func:`attnlab.generation.generate`: greedy by default, ``--do-sample`` with the common ``--seed``,
``--num-beams`` for beam search. Each prompt is decoded on its own (batch 1), so no padding changes a result.

The text is printed as the tokens come (beam search: at the end). On standard error each prompt ends with
its speed: new tokens per second, and for a decoder-only model the share of this machine's bandwidth bound,
``t_min = weight bytes read per token / copy bandwidth`` (:func:`attnlab.nn.inference.decode_weight_bytes`,
the bandwidth measured by :func:`attnlab._runtime.probe`).

A run folder: a ``shakespeare-char`` run samples text as nanoGPT's ``sample.py`` does (``--prompt`` defaults to
a new line; try ``--do-sample --temperature 0.8 --top-k 200``); a ``multi30k-de-en`` run translates the German
text given.

As ``sample.py``, a decoder-only model with a position limit (a run's ``block_size``, GPT-2's ``n_positions``)
samples any number of new tokens: past the limit each next token is predicted from the last ``block_size`` tokens
(``generate(cache="crop")``); ``--start`` is sample.py's start (a text, or ``FILE:path`` for a file's text) and
``--num-samples`` decodes each prompt that many times.
"""
from __future__ import annotations

import argparse
import sys
import time

EPILOG = """examples:
  attnlab generate --model path/to/gpt2-dir --prompt "Once upon a time" --max-new-tokens 40
  attnlab generate --model org/name --prompt "ROMEO:" --do-sample --temperature 0.8 --top-k 50 --seed 1
  attnlab generate --model t5-dir --prompt "translate English to German: Hello" --num-beams 4
  attnlab generate --model gpt2-dir --prompt "a" --prompt "b" --dtype float32      # one line per prompt
  attnlab generate --model runs/shakespeare-char --do-sample --temperature 0.8 --top-k 200 --max-new-tokens 200
  attnlab generate --model runs/nanogpt --do-sample --num-samples 3 --max-new-tokens 500 --start FILE:prompt.txt
  attnlab generate --model runs/multi30k-de-en --prompt "Ein Hund läuft durch den Schnee." --num-beams 4
  attnlab generate --model gpt2-dir --prompt "x" --window 256 --max-new-tokens 100000   # O(256) cache memory
  attnlab generate --model gpt2-dir --prompt "Once upon a time" --int4                  # 4-bit weights
--model is an HF-format folder (config.json, safetensors, tokenizer.json), a Hub id (org/name) or a run folder
of `attnlab train shakespeare-char` / `multi30k-de-en`."""


MAX_SAMPLES = 1000  # --num-samples at most
MAX_NEW_TOKENS = 1 << 20  # --max-new-tokens at most (the output holds them: 8 bytes a token, however cropped)


def start_text(value: str) -> str:
    """``--start``'s text: ``value`` itself, or the UTF-8 text of the file ``FILE:path`` names (as nanoGPT's
    ``sample.py``; read as every text input is, :func:`attnlab._io.read_text_arg`).

    Raises:
        FileNotFoundError / ValueError: the file is absent, not a regular file, over the cap, not UTF-8 or empty
            (naming ``--start`` and the file).
    """
    if not value.startswith("FILE:"):
        return value
    from attnlab._io import read_text_arg

    path = value[len("FILE:"):]
    text = read_text_arg("--start", path)
    if not text:
        raise ValueError(f"--start FILE:{path} is empty")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``attnlab generate`` (the common flags are added by :mod:`attnlab.cli`)."""
    p.add_argument("--model", required=True,
                   help="HF-format model folder, Hub id (GPT-2, Llama, T5, BART) or attnlab train run folder")
    p.add_argument("--prompt", action="append", default=None,
                   help="text to continue (decoder-only) or the source text (encoder-decoder); repeatable "
                        "(a shakespeare-char run: default a new line)")
    p.add_argument("--start", default=None, metavar="TEXT|FILE:path",
                   help="nanoGPT's start: the text to continue, or FILE:path for a file's text (instead of --prompt)")
    p.add_argument("--num-samples", type=int, default=1,
                   help=f"decode each prompt this many times (1 to {MAX_SAMPLES}; default 1)")
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
    quantised = p.add_mutually_exclusive_group()
    quantised.add_argument("--int8", action="store_true",
                           help="int8 weights and activations in every linear layer (CPU; instead of --dtype)")
    quantised.add_argument("--int4", action="store_true",
                           help="int4 weights in groups of --group-size columns in every linear layer and embedding "
                                "(CPU; instead of --dtype)")
    p.add_argument("--group-size", type=int, default=None,
                   help="--int4's columns per scale, a multiple of 32 (default 64: smaller is closer to float, "
                        "larger is smaller)")


class _Load:
    """What ``--model`` names, ready to decode: the model, its tokenizer, how a prompt is encoded, the token
    ids ``generate`` needs, and the prompt used when none is given."""

    def __init__(self, args: argparse.Namespace, device: str) -> None:
        from pathlib import Path

        import torch

        from attnlab.data.tokenizers import CharTokenizer, load_tokenizer
        from attnlab.training.run_dir import is_run

        path = Path(args.model)
        self.ids_for_generate, self.default_prompt, self.add_special = {}, None, False
        if path.is_dir() and is_run(path):
            from attnlab.training.recipes import load_run

            run = load_run(path, device=device)
            self.model, self.tok = run.model, load_tokenizer(args.tokenizer or path)
            if getattr(self.model, "is_encoder_decoder", False):  # multi30k-de-en: <s> source </s> -> target
                self.add_special = True
                self.ids_for_generate = dict(decoder_start_token_id=self.tok.bos_id, eos_token_id=self.tok.eos_id)
            elif isinstance(self.tok, CharTokenizer):
                self.default_prompt = "\n"  # nanoGPT's sample.py starts from a new line
        else:
            from attnlab.models.hub import from_pretrained, resolve_pretrained

            folder = resolve_pretrained(args.model)  # a folder, or a Hub id's snapshot
            self.tok = load_tokenizer(args.tokenizer or folder)
            self.model = from_pretrained(folder, dtype=torch.float32).to(device).eval()
        self.encoder_decoder = bool(getattr(self.model, "is_encoder_decoder", False))
        if not self.encoder_decoder and not hasattr(self.model, "new_cache"):
            raise ValueError(f"--model {args.model} holds a {type(self.model).__name__}, which cannot generate: give "
                             "a decoder-only (GPT-2, Llama) or encoder-decoder (T5, BART) model")
        if not self.encoder_decoder and not self.ids_for_generate and getattr(self.tok, "eos_id", None) is not None:
            self.ids_for_generate = {"eos_token_id": self.tok.eos_id}  # stop at the tokenizer's end token

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True) if self.add_special else self.tok.encode(text)


class _Printer:
    """A ``streamer`` for one sequence: prints the text of the new tokens as it grows (waiting while the last
    token ends inside a multi-byte character), then what is left at :meth:`finish`."""

    def __init__(self, tok) -> None:
        self.tok, self.ids, self.shown = tok, [], ""

    def __call__(self, new) -> None:
        self.ids.append(int(new[0]))
        self._show(self.tok.decode(self.ids))

    def _show(self, text: str) -> None:
        if not text.endswith("\ufffd") and text.startswith(self.shown):
            print(text[len(self.shown):], end="", flush=True)
            self.shown = text

    def finish(self, ids: list[int]) -> None:
        text = self.tok.decode(ids)
        self.shown = text[:len(self.shown)] if text.startswith(self.shown) else ""
        print(text[len(self.shown):], flush=True)


def main(args: argparse.Namespace) -> int:
    import torch

    from attnlab._runtime import probe, resolve_dtype, torch_dtype
    from attnlab.nn.inference import decode_weight_bytes

    device = args.device or "cpu"
    flag = "--int8" if args.int8 else "--int4" if args.int4 else None
    if flag and (args.dtype not in (None, "auto") or device != "cpu"):
        raise ValueError(f"{flag} runs on the CPU in place of --dtype: give one of them")
    if args.group_size is not None and not args.int4:
        raise ValueError("--group-size is --int4's: give --int4 too")
    if args.int4:
        from attnlab.adapt.quantize import GROUP_SIZE, check_group_size
        check_group_size(GROUP_SIZE if args.group_size is None else args.group_size,
                         name="--group-size")  # before the model loads
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"--max-new-tokens must be in [1, {MAX_NEW_TOKENS:,}], got {args.max_new_tokens}")
    if not 1 <= args.num_samples <= MAX_SAMPLES:
        raise ValueError(f"--num-samples must be in [1, {MAX_SAMPLES}], got {args.num_samples}")
    from attnlab._limits import SETTING_LIMITS

    beams = SETTING_LIMITS[("num_beams",)]  # each beam is a row of the batch, with its own KV cache
    if not 1 <= args.num_beams <= beams:
        raise ValueError(f"--num-beams must be in [1, {beams:,}], got {args.num_beams}")
    if args.start is not None and args.prompt is not None:
        raise ValueError("--start and --prompt both give the text to continue: give one of them")
    given = None if args.start is None else start_text(args.start)  # before the model loads
    loaded = _Load(args, device)
    prompts = [given] if given is not None else args.prompt if args.prompt is not None else [loaded.default_prompt]
    if prompts == [None]:
        raise ValueError("--prompt is required for this model")
    if any(not t.strip() for t in prompts) and loaded.default_prompt is None:
        raise ValueError("--prompt must not be empty")
    model = loaded.model
    if args.window is not None:
        if loaded.encoder_decoder:
            raise ValueError("--window is for decoder-only models (GPT-2, Llama)")
        from attnlab._limits import SETTING_LIMITS, check_memory
        from attnlab.adapt.deploy import set_window, window_cache_bytes

        limit = SETTING_LIMITS[("block_size", "max_len", "max_tokens", "window")]
        if not 1 <= args.window <= limit:
            raise ValueError(f"--window must be an int in [1, {limit:,}], got {args.window}")
        check_memory(f"--window {args.window}", window_cache_bytes(model, args.window), device=device)
        set_window(model, args.window)
    if args.int8:
        from attnlab.adapt.quantize import quantize
        model, label = quantize(model, "int8", inplace=True), "int8 (dynamic: int8 weights and activations)"
    elif args.int4:
        from attnlab.adapt.quantize import GROUP_SIZE, quantize
        g = GROUP_SIZE if args.group_size is None else args.group_size
        model, label = quantize(model, "int4", group_size=g, inplace=True), f"int4 (weights in groups of {g})"
    else:
        name, reason = resolve_dtype(args.dtype or "auto", device, name="--dtype")
        if hasattr(model, "optimize_for_inference"):
            model.optimize_for_inference(dtype=torch_dtype(name))  # weight-only bf16, or fp32's packed layout
        else:
            model.to(torch_dtype(name))
        label = f"{name} ({reason})"
    print(f"{type(model).__name__}, dtype {label}")
    generator = torch.Generator(device=device).manual_seed(args.seed or 0) if args.do_sample else None
    bound_s = None if loaded.encoder_decoder else decode_weight_bytes(model) / (probe(measure=True).copy_gbps * 1e9)
    block, cropped = getattr(model, "max_positions", None), False
    for text, sample in ((t, i) for t in prompts for i in range(args.num_samples)):
        if sample:
            print("---------------")  # between samples, as nanoGPT's sample.py
        ids = torch.tensor([loaded.encode(text)], device=device)
        cache = "dynamic" if args.window is None else "window"
        if (cache == "dynamic" and not loaded.encoder_decoder and isinstance(block, int)
                and ids.shape[1] + args.max_new_tokens > block):
            if args.num_beams > 1:
                raise ValueError(f"--num-beams {args.num_beams}: beam search stays within the model's {block} "
                                 f"positions, so at most {max(block - ids.shape[1], 0)} new tokens with this prompt; "
                                 "sampling or greedy decoding (--num-beams 1) go past it")
            cache = "crop"
            if not cropped:
                cropped = True
                print(f"past {block} positions each token is predicted from the last {block} tokens "
                      "(the context cropped, as nanoGPT's sample.py)", file=sys.stderr)
        from attnlab._limits import check_memory
        from attnlab.generation import generation_bytes

        check_memory(f"--max-new-tokens {args.max_new_tokens} with --num-beams {args.num_beams}",
                     generation_bytes(model, ids, max_new_tokens=args.max_new_tokens, num_beams=args.num_beams,
                                      cache=cache), device=device)
        printer = _Printer(loaded.tok)
        if not loaded.encoder_decoder:
            print(text, end="", flush=True)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             num_beams=args.num_beams, generator=generator, cache=cache,
                             streamer=printer if args.num_beams == 1 else None, **loaded.ids_for_generate)
        seconds = time.perf_counter() - start
        new = out[0, 1:] if loaded.encoder_decoder else out[0, ids.shape[1]:]  # after the start token / the prompt
        printer.finish(new.tolist())
        rate = len(new) / seconds
        share = "" if bound_s is None else f"; {100 * bound_s * rate:.0f} % of this machine's bandwidth bound"
        print(f"{len(new)} tokens in {seconds:.2f} s: {rate:.1f} tokens/s{share}", file=sys.stderr)
    return 0
