"""Adapt and ship: parameter-efficient fine-tuning (LoRA, bottleneck adapters, prompt and prefix
tuning), int8 and int4 quantisation, ONNX export (encoders; decoders with their KV cache), retrieval-augmented generation
and sliding-window deployment.

One module per piece: :mod:`~attnlab.adapt.lora`, :mod:`~attnlab.adapt.adapters`,
:mod:`~attnlab.adapt.prompt`, :mod:`~attnlab.adapt.io` (adapter save/load), :mod:`~attnlab.adapt.quantize`,
:mod:`~attnlab.adapt.export`, :mod:`~attnlab.adapt.rag`, :mod:`~attnlab.adapt.deploy`.
"""
from attnlab.adapt.adapters import BottleneckAdapter, apply_adapters, remove_adapters
from attnlab.adapt.deploy import set_window, sliding_window
from attnlab.adapt.export import OnnxDecoder, export_onnx
from attnlab.adapt.io import adapter_state_dict, load_adapter, save_adapter, trainable_parameters
from attnlab.adapt.lora import LoRALinear, apply_lora, lora_state_dict, merge_lora, unload_lora, unmerge_lora
from attnlab.adapt.prompt import PrefixTuningLM, PromptTuningLM
from attnlab.adapt.quantize import Int4Embedding, Int4Linear, Int8Embedding, Int8Linear, quantize
from attnlab.adapt.rag import Retriever, SentenceEncoder, rag_generate

__all__ = ["LoRALinear", "apply_lora", "merge_lora", "unmerge_lora", "unload_lora", "lora_state_dict",
           "BottleneckAdapter", "apply_adapters", "remove_adapters", "PromptTuningLM", "PrefixTuningLM",
           "save_adapter", "load_adapter", "adapter_state_dict", "trainable_parameters",
           "quantize", "Int8Linear", "Int8Embedding", "Int4Linear", "Int4Embedding", "export_onnx", "OnnxDecoder",
           "SentenceEncoder", "Retriever", "rag_generate", "set_window", "sliding_window"]
