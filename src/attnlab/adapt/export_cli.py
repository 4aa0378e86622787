"""``attnlab export``: write a model folder (or Hub id) as an ONNX file, by :func:`attnlab.adapt.export.export_onnx`.

BERT encoders get ``input_ids``, ``attention_mask``, ``token_type_ids``; decoder-only language models (GPT-2,
Llama) get Hugging Face Optimum's decoder layout with an explicit KV cache (``past_key_values.{i}.key`` /
``.value`` in, ``logits`` and ``present.{i}.key`` / ``.value`` out). The graph is float32 and traced on the CPU.
"""
from __future__ import annotations

import argparse

EPILOG = """examples:
  attnlab export --model path/to/gpt2-dir --out gpt2.onnx
  attnlab export --model sentence-transformers/all-MiniLM-L6-v2 --out minilm.onnx --opset 18
--model is an HF-format folder or a Hub id holding a BERT encoder, a decoder-only language model (GPT-2, Llama), a
ViT, T5 or BART (teacher-forced logits), or a task head on any of them (its logits). Decode the decoder file with attnlab.adapt.export.OnnxDecoder
(or any runtime that feeds Optimum's inputs); quantise it with onnxruntime.quantization.quantize_dynamic."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``attnlab export`` (the common flags are added by :mod:`attnlab.cli`)."""
    p.add_argument("--model", required=True, help="HF-format model folder or Hub id (BERT, GPT-2, Llama, ViT, T5, BART, a task head)")
    p.add_argument("--out", required=True, help="the .onnx file to write (its folder is created)")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default 17, at least 14)")


def _summary(names: tuple[str, ...]) -> str:
    """Graph names with the per-layer cache tensors folded: ``…, past_key_values.{0..L-1}.key/.value``."""
    cache = [n for n in names if n.startswith(("past_key_values.", "present."))]
    shown = [n for n in names if n not in cache]
    if cache:
        shown.append(f"{cache[0].split('.')[0]}.{{0..{len(cache) // 2 - 1}}}.key/.value")
    return ", ".join(shown)


def main(args: argparse.Namespace) -> int:
    import torch

    from attnlab._io import check_output_file
    from attnlab._runtime import cpu_float32_only
    from attnlab.adapt.export import SUPPORTED, export_onnx, input_names, output_names
    from attnlab.models.hub import from_pretrained, resolve_pretrained

    cpu_float32_only(args)
    folder = resolve_pretrained(args.model)
    check_output_file("--out", args.out, inputs=[("--model", folder)], parents=True)  # never over what it reads
    model = from_pretrained(folder, dtype=torch.float32)
    try:
        outputs = output_names(model)
    except TypeError:
        raise ValueError(f"--model {args.model} holds a {type(model).__name__}; export writes {SUPPORTED}") from None
    path = export_onnx(model, args.out, opset=args.opset)
    print(f"wrote {path} ({type(model).__name__}): inputs {_summary(input_names(model))}; "
          f"outputs {_summary(outputs)}")
    return 0
