"""Small random models shared by the adaptation tests (weights widened so differences show)."""
import pytest
import torch

from attnlab.models.bert import BertConfig, BertModel
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
from attnlab.models.llama import LlamaConfig, LlamaForCausalLM

V = 97


def widen(model: torch.nn.Module, std: float = 0.2) -> torch.nn.Module:
    """Re-draw every matrix from N(0, std), norm gains from U(0.5, 1.5) and biases from U(-0.1, 0.1),
    so that small changes are visible."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, std)
            elif name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.uniform_(-0.1, 0.1)
    return model


def tiny_gpt2(seed: int = 0, **kw) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, embd_pdrop=0.0, resid_pdrop=0.0,
               bos_token_id=None, eos_token_id=None,
               attn_pdrop=0.0)
    cfg.update(kw)
    return widen(GPT2LMHeadModel(GPT2Config(**cfg))).eval()


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    return widen(LlamaForCausalLM(cfg)).eval()


def tiny_bert(seed: int = 0) -> BertModel:
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return widen(BertModel(cfg)).eval()


@pytest.fixture
def ids():
    return torch.randint(0, V, (2, 12))


@pytest.fixture(scope="session")  # a factory: module-scoped fixtures may use it
def make_gpt2():
    return tiny_gpt2


@pytest.fixture(scope="session")  # a factory: module-scoped fixtures may use it
def make_llama():
    return tiny_llama


@pytest.fixture(scope="session")  # a factory: module-scoped fixtures may use it
def make_bert():
    return tiny_bert
