"""Models built from attnlab's blocks, configured by dataclasses.

The order matters: the generic stacks come first, the families (which build on them) next.
"""
from attnlab.models.config import TransformerConfig
from attnlab.models.transformer import Seq2SeqTransformer, Transformer, TransformerDecoder, TransformerEncoder
from attnlab.models.outputs import Seq2SeqLMOutput
from attnlab.models.hub import PreTrainedMixin, from_pretrained, register, save_pretrained
from attnlab.models.bert import BertConfig, BertForMaskedLM, BertForPreTraining, BertModel, BertOutput
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
from attnlab.models.llama import LlamaConfig, LlamaForCausalLM
from attnlab.models.t5 import T5Config, T5ForConditionalGeneration
from attnlab.models.bart import BartConfig, BartForConditionalGeneration
from attnlab.models.vit import ViTConfig, ViTForImageClassification, ViTModel, ViTOutput
from attnlab.models.clip import CLIPConfig, CLIPModel, CLIPOutput, CLIPTextConfig, CLIPVisionConfig
from attnlab.models.heads import (BertForQuestionAnswering, BertForSequenceClassification, BertForTokenClassification,
                                  ClassifierConfig, GPT2ForQuestionAnswering, GPT2ForSequenceClassification,
                                  GPT2ForTokenClassification, LlamaForQuestionAnswering, LlamaForSequenceClassification,
                                  LlamaForTokenClassification, BartForSequenceClassification, BartForQuestionAnswering,
                                  T5ForQuestionAnswering, T5ForSequenceClassification, T5ForTokenClassification)
from attnlab.models.image_heads import CLIPForImageClassification

__all__ = [
    "TransformerConfig", "Seq2SeqTransformer", "Transformer", "TransformerDecoder", "TransformerEncoder",
    "Seq2SeqLMOutput", "PreTrainedMixin", "from_pretrained", "register", "save_pretrained",
    "BertConfig", "BertModel", "BertForMaskedLM", "BertForPreTraining", "BertOutput",
    "GPT2Config", "GPT2LMHeadModel", "LlamaConfig", "LlamaForCausalLM",
    "T5Config", "T5ForConditionalGeneration", "BartConfig", "BartForConditionalGeneration",
    "ViTConfig", "ViTModel", "ViTForImageClassification", "ViTOutput",
    "CLIPConfig", "CLIPTextConfig", "CLIPVisionConfig", "CLIPModel", "CLIPOutput",
    "ClassifierConfig", "BertForSequenceClassification", "BertForTokenClassification", "BertForQuestionAnswering",
    "GPT2ForSequenceClassification", "GPT2ForTokenClassification", "GPT2ForQuestionAnswering",
    "LlamaForSequenceClassification", "LlamaForTokenClassification", "LlamaForQuestionAnswering",
    "BartForSequenceClassification", "BartForQuestionAnswering",
    "T5ForSequenceClassification", "T5ForTokenClassification", "T5ForQuestionAnswering",
    "CLIPForImageClassification",
]
