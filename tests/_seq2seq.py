"""Random tiny T5 and BART checkpoints written by transformers (no download), and padded rows as their
tokenizers write them: what the export and analysis tests of the encoder–decoders compare against."""
import torch

BART = dict(vocab_size=40, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64)
T5 = dict(vocab_size=40, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
          relative_attention_max_distance=20, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
NAMES = ["BartForConditionalGeneration", "BartForSequenceClassification", "BartForQuestionAnswering",
         "T5ForConditionalGeneration", "T5ForSequenceClassification", "T5ForTokenClassification",
         "T5ForQuestionAnswering"]


def save_hf(name, path):
    """A random tiny transformers checkpoint of ``name`` (eager attention) saved at ``path``, biases and norms
    perturbed so a misplaced tensor shows; returns the transformers model (eval mode)."""
    import transformers

    torch.manual_seed(0)
    labels = {0: "start", 1: "end"} if name.endswith("QuestionAnswering") else {0: "neg", 1: "neu", 2: "pos"}
    cfg = (transformers.T5Config(**T5, id2label=labels) if name.startswith("T5")
           else transformers.BartConfig(**BART, id2label=labels))
    cfg._attn_implementation = "eager"
    hf = getattr(transformers, name)(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(path)
    return hf


def padded_rows(name, lengths=(11, 6)):
    """``(input_ids, attention_mask)``, right-padded rows as the tokenizers write them (BART ``<s> x … </s>``,
    T5 ``x … </s>``): one eos each."""
    bos, pad, eos = (None, 0, 1) if name.startswith("T5") else (0, 1, 2)
    g = torch.Generator().manual_seed(1)
    ids = torch.full((len(lengths), max(lengths)), pad)
    for b, n in enumerate(lengths):
        row = torch.randint(3, 40, (n,), generator=g)
        if bos is not None:
            row[0] = bos
        row[-1] = eos
        ids[b, :n] = row
    return ids, (torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]).long()
