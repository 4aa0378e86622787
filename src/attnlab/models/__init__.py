"""Models built from attnlab's blocks, configured by dataclasses."""
from attnlab.models.config import TransformerConfig
from attnlab.models.transformer import (Seq2SeqTransformer, Transformer, TransformerDecoder,
                                        TransformerEncoder)

__all__ = ["TransformerConfig", "Seq2SeqTransformer", "Transformer", "TransformerDecoder", "TransformerEncoder"]
from attnlab.models.bert import BertConfig, BertForMaskedLM, BertForPreTraining, BertModel, BertOutput  # noqa: E402
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel  # noqa: E402
from attnlab.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402
from attnlab.models.hub import PreTrainedMixin, from_pretrained, register, save_pretrained  # noqa: E402

__all__ += ["BertConfig", "BertModel", "BertForMaskedLM", "BertForPreTraining", "BertOutput",
            "PreTrainedMixin", "from_pretrained", "register", "save_pretrained", "GPT2Config", "GPT2LMHeadModel",
            "LlamaConfig", "LlamaForCausalLM"]
from attnlab.models.t5 import Seq2SeqLMOutput, T5Config, T5ForConditionalGeneration  # noqa: E402

__all__ += ["T5Config", "T5ForConditionalGeneration", "Seq2SeqLMOutput"]
from attnlab.models.bart import BartConfig, BartForConditionalGeneration  # noqa: E402

__all__ += ["BartConfig", "BartForConditionalGeneration"]
from attnlab.models.vit import ViTConfig, ViTForImageClassification, ViTModel, ViTOutput  # noqa: E402
from attnlab.models.clip import CLIPConfig, CLIPModel, CLIPOutput, CLIPTextConfig, CLIPVisionConfig  # noqa: E402

__all__ += ["ViTConfig", "ViTModel", "ViTForImageClassification", "ViTOutput",
            "CLIPConfig", "CLIPTextConfig", "CLIPVisionConfig", "CLIPModel", "CLIPOutput"]
