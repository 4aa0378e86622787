"""Every task head's attention is its body's: the record of a BERT / GPT-2 / T5 / BART classification or QA head
equals that of the plain model holding the same body weights (T5's token classifier: its encoder alone, from
``text``)."""
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from attnlab.models import decoder_heads as D
from attnlab.models import heads as H
from attnlab.models import seq2seq_heads as S
from attnlab.models.bart import BartConfig, BartForConditionalGeneration
from attnlab.models.bert import BertConfig, BertModel
from attnlab.models.classifier import ClassifierConfig
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
from attnlab.models.t5 import T5Config, T5ForConditionalGeneration
from attnlab.viz.extract import extract_attention

T5 = T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
              pad_token_id=0, eos_token_id=1)
BART = BartConfig(vocab_size=40, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                  decoder_start_token_id=1, pad_token_id=0, eos_token_id=1, bos_token_id=0)
BERT = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=32)
GPT2 = GPT2Config(vocab_size=40, n_positions=32, n_embd=32, n_layer=2, n_head=2)
SEQ = dict(src="a b c", tgt="d a")

CASES = [(S.T5ForSequenceClassification, T5ForConditionalGeneration, T5, SEQ, SEQ),
         (S.T5ForTokenClassification, T5ForConditionalGeneration, T5, dict(text="a b c"), dict(src="a b c", tgt="a b")),
         (S.BartForSequenceClassification, BartForConditionalGeneration, BART, SEQ, SEQ),
         (S.BartForQuestionAnswering, BartForConditionalGeneration, BART, SEQ, SEQ),
         (H.BertForSequenceClassification, BertModel, BERT, dict(text="a b c"), dict(text="a b c")),
         (D.GPT2ForQuestionAnswering, GPT2LMHeadModel, GPT2, dict(text="a b c d"), dict(text="a b c d"))]


@pytest.fixture(scope="module")
def tok():
    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", "a", "b", "c", "d"])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return t


@pytest.mark.parametrize("head, base, cfg, texts, base_texts", CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_task_head_attention_is_its_bodys(tok, head, base, cfg, texts, base_texts):
    torch.manual_seed(0)
    model = head(ClassifierConfig(cfg)).eval()
    plain = base(cfg).eval()
    ours = model.state_dict()
    body = {k.removeprefix("bert."): v for k, v in ours.items()}
    shared = {k: v for k, v in body.items() if k in plain.state_dict()}
    assert all(k in shared for k in body if k.startswith(("encoder.", "layers.", "shared.")))
    plain.load_state_dict(shared, strict=False)
    rec, ref = extract_attention(model, tok, **texts), extract_attention(plain, tok, **base_texts)
    assert rec.kinds and set(rec.kinds) <= set(ref.kinds)
    for k in rec.kinds:
        assert rec.tokens_q[k] == ref.tokens_q[k] and torch.equal(rec.attentions[k], ref.attentions[k])
