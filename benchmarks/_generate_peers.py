"""The models and peers of ``benchmarks/generate.py``: one random Hugging Face checkpoint per family, read by
attnlab's own loader (:func:`attnlab.from_pretrained`), by ``transformers`` and by CTranslate2's converter.

Families (random weights, each library's N(0, 0.02) init; no EOS, so every run decodes all its tokens):

- ``gpt2``: ``transformers.GPT2Config()`` defaults, GPT-2 small (124M parameters, tied head);
- ``llama``: a ~111M-parameter Llama: hidden 1024, 4 layers, 16 query heads sharing 4 key/value heads
  (GQA, head size 64), SwiGLU width 2816, vocabulary 32000, untied head, RoPE θ = 10000.

``--quick`` uses tiny versions (hidden 128, 2 layers, vocabulary 2048) of both.

The checkpoint is saved with a word-level tokenizer whose token ``i`` is the string ``t{i}`` (the last id is
the end token): CTranslate2 takes prompts as token strings, and this makes string ``i`` mean id ``i``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from torch import nn

import attnlab
from attnlab.generation import generate

END = "<|endoftext|>"


def hf_config(family: str, quick: bool):
    """The random ``transformers`` config of ``family`` (``"gpt2"`` or ``"llama"``), tiny with ``quick``."""
    if family == "gpt2":
        tiny = dict(n_embd=128, n_layer=2, n_head=4, vocab_size=2048)
        return transformers.GPT2Config(**(tiny if quick else {}))
    if family == "llama":
        sizes = (dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=352, vocab_size=2048) if quick else
                 dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                      intermediate_size=2816, vocab_size=32000))
        return transformers.LlamaConfig(**sizes, max_position_embeddings=2048, rope_theta=10000.0,
                                        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                                        pad_token_id=None)
    raise ValueError(f"family must be 'gpt2' or 'llama', got {family!r}")


def describe(config) -> str:
    """One line naming the sizes of a ``hf_config`` result."""
    if config.model_type == "gpt2":
        return f"GPT-2: hidden {config.n_embd}, {config.n_layer} layers, {config.n_head} heads, vocab {config.vocab_size}"
    return (f"Llama: hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_attention_heads} "
            f"heads / {config.num_key_value_heads} kv heads, FFN {config.intermediate_size}, vocab {config.vocab_size}, "
            f"untied head")


@dataclass
class Family:
    """One family's checkpoint and its readers: ``ours`` (attnlab, float32, as loaded), ``theirs``
    (``transformers``, float32) and ``ct2`` (CTranslate2 generators by compute type; empty without it)."""

    name: str
    ours: nn.Module
    theirs: nn.Module
    names: list[str]  # token string of each id (CTranslate2's input)
    ct2: dict = field(default_factory=dict)

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.theirs.parameters())

    def kv_bytes(self, batch: int, positions: float) -> float:
        """Bytes of float32 keys and values a decoding step reads at ``positions`` cached positions:
        ``layers · 2 · batch · positions · kv_width · 4`` with ``kv_width = kv heads · head size``."""
        c = self.theirs.config
        width = c.n_embd if c.model_type == "gpt2" else c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
        return c.num_hidden_layers * 2 * batch * positions * width * 4


def build(family: str, quick: bool, folder: Path, *, threads: int, ct2: bool) -> Family:
    """Save a random ``transformers`` model of ``family`` (seed 0) and its tokenizer to ``folder / "hf"``, load it
    back with :func:`attnlab.from_pretrained`, and (``ct2``) convert the same folder with CTranslate2."""
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(hf_config(family, quick)).eval()
    theirs.generation_config.eos_token_id = None  # decode every requested token
    theirs.generation_config.pad_token_id = None
    n = theirs.config.vocab_size
    names = [f"t{i}" for i in range(n - 1)] + [END]
    hf = folder / "hf"
    theirs.save_pretrained(hf)
    _tokenizer(names).save_pretrained(hf)
    ours = attnlab.from_pretrained(hf)
    return Family(family, ours, theirs, names, ct2_generators(hf, folder, threads) if ct2 else {})


def _tokenizer(names: list[str]):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(names)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token=END)),
                                  bos_token=END, eos_token=END, unk_token=END)


def ct2_generators(hf: Path, folder: Path, threads: int) -> dict:
    """CTranslate2 float32 and int8 generators converted from the checkpoint folder ``hf`` by its
    ``TransformersConverter``, each in a process of its own (:class:`CT2Process`); empty when ctranslate2 is not
    installed."""
    try:
        import ctranslate2
    except ImportError:
        return {}
    out = {}
    for q in ("float32", "int8"):
        ctranslate2.converters.TransformersConverter(str(hf)).convert(str(folder / q), quantization=q, force=True)
        out[q] = CT2Process(folder / q, q, threads)
    return out


class CT2Process:
    """A CTranslate2 ``Generator`` served by a child process, called like one (``generate_ids``).

    CTranslate2 ships its own OpenMP runtime; loaded beside torch's in one process, the two contend for the
    cores: on a 2-core machine our int8 decoding step went from 7.8 to 11 ms, and stayed there, once a
    CTranslate2 generator had run in the same process (and CTranslate2's own speed moved with the order of the
    calls). Each library in a process of its own, as a user would run it, timed round-robin from here.
    """

    def __init__(self, model_dir: Path, compute_type: str, threads: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        isa = torch.backends.cpu.get_cpu_capability()  # CTranslate2 runs as torch does: AVX2 under the emulation
        self.proc = ctx.Process(target=_serve_ct2, args=(child, str(model_dir), compute_type, threads, isa),
                                daemon=True)
        self.proc.start()
        status, detail = self.conn.recv()
        if status != "ready":
            raise RuntimeError(f"CTranslate2 could not load {model_dir}: {detail}")

    def generate_ids(self, start: list[list[str]], new: int) -> list[list[int]]:
        """Greedy decoding of exactly ``new`` tokens after each prompt (token strings): the new ids."""
        self.conn.send((start, new))
        status, out = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"CTranslate2 failed: {out}")
        return out

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(timeout=10)


def _serve_ct2(conn, model_dir: str, compute_type: str, threads: int, isa: str) -> None:
    """The child's loop: load the generator, then answer ``(start, new)`` requests until ``None`` (or the parent
    is gone). Where torch runs AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2`` or an AVX2 CPU) CTranslate2 is held to
    AVX2 too (``CT2_FORCE_CPU_ISA``), so that both sides of a row use the same instruction set."""
    import os

    if isa == "AVX2":
        os.environ.setdefault("CT2_FORCE_CPU_ISA", "AVX2")
    try:
        import ctranslate2

        gen = ctranslate2.Generator(model_dir, device="cpu", compute_type=compute_type, intra_threads=threads,
                                    inter_threads=1)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", repr(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent exited without saying goodbye
            return
        if msg is None:
            return
        start, new = msg
        try:
            r = gen.generate_batch(start, max_length=new, min_length=new, sampling_topk=1, beam_size=1,
                                   include_prompt_in_result=False, end_token=[])
            conn.send(("ok", [x.sequences_ids[0] for x in r]))
        except Exception as e:  # noqa: BLE001
            conn.send(("error", repr(e)))


def run_ours(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    return generate(model, ids, max_new_tokens=new, cache="static")


def run_theirs(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              num_beams=1)


def run_ct2(gen: CT2Process, names: list[str], ids: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy decoding of exactly ``new`` tokens for each of the ``B`` prompts (one ``generate_batch``, in
    CTranslate2's process); the prompts and the new ids as one ``(B, T + new)`` tensor."""
    start = [[names[i] for i in row] for row in ids.tolist()]
    return torch.cat([ids, torch.tensor(gen.generate_ids(start, new))], dim=1)


def top1_agreement(model, seq: torch.Tensor, ref_next: torch.Tensor) -> float:
    """Fraction of positions where ``model``'s argmax on ``seq`` (teacher forced) equals ``ref_next``."""
    with torch.inference_mode():
        logits = model(seq[:, :-1]).logits[:, -ref_next.shape[1]:]
    return float((logits.argmax(-1) == ref_next).float().mean())


def copy_fn(mbytes: int):
    """``dst.copy_(src)`` on ``mbytes`` MB, and the bytes it moves (read + written)."""
    n = mbytes * 10**6 // 4
    src, dst = torch.randn(n), torch.empty(n)
    return (lambda: dst.copy_(src)), 2 * n * 4
