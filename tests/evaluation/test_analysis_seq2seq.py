"""``analyze`` on T5 and BART (the LMs and every task head ``from_pretrained`` loads): the encoder's
self-attention, against transformers (random tiny checkpoints, eager attention). The per-head entropy equals the
one of transformers' ``encoder_attentions``; a pruned head's loss change equals transformers' run with the same
head's slice zeroed before its output projection (a pre-hook on BART's ``out_proj`` / T5's ``o``): the
reconstruction cross-entropy for an LM, the KL divergence of the outputs for a task head."""
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import attnlab  # noqa: E402
from attnlab.evaluation.analysis import Batch, analyze  # noqa: E402
from attnlab.evaluation.head_metrics import head_entropy  # noqa: E402
from tests._seq2seq import NAMES, padded_rows, save_hf  # noqa: E402
from tests._tolerance import tolerance  # noqa: E402

LAYER, HEAD = 1, 2  # the pruned head compared with transformers


def _hf_output(hf, name, ids, mask):
    """transformers' forward as ``analyze`` runs ours: an LM fed the text shifted right; a head as it is."""
    if not name.endswith("ConditionalGeneration"):
        return hf(input_ids=ids, attention_mask=mask)
    start = hf.config.decoder_start_token_id
    shifted = torch.cat([torch.full((ids.shape[0], 1), start), ids[:, :-1]], 1)
    return hf(input_ids=ids, attention_mask=mask, decoder_input_ids=shifted)


def _hf_loss(hf, name, ids, mask, ref):
    out = _hf_output(hf, name, ids, mask)
    if name.endswith("ConditionalGeneration"):
        target = ids.masked_fill(mask == 0, -100)
        return F.cross_entropy(out.logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100).item(), None
    logits = [out.logits] if "QuestionAnswering" not in name else [out.start_logits, out.end_logits]
    lps = [F.log_softmax(x.double(), -1) for x in logits]
    if ref is None:
        return 0.0, lps
    return sum(F.kl_div(lp, r, log_target=True, reduction="batchmean").item() for lp, r in zip(lps, ref)), None


def _hf_out_projections(hf):
    """transformers' encoder self-attention output projections, in layer order."""
    suffix = ("SelfAttention.o", "self_attn.out_proj")
    return [m for n, m in hf.named_modules() if "encoder" in n and "decoder" not in n and n.endswith(suffix)]


@pytest.mark.parametrize("name", NAMES)
def test_analysis_of_t5_and_bart_equals_transformers(tmp_path, name):
    hf = save_hf(name, tmp_path / "model")
    ours = attnlab.from_pretrained(tmp_path / "model")
    ids, mask = padded_rows(name)
    result = analyze(ours, Batch(ids, mask, torch.zeros_like(ids, dtype=torch.bool)))
    layers, heads = len(_hf_out_projections(hf)), hf.config.num_attention_heads
    assert result.shape == (layers, heads) == (2, 4)
    with torch.no_grad():
        enc = hf.transformer.encoder if hasattr(hf, "transformer") else hf.get_encoder()
        maps = enc(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        want = torch.stack([head_entropy(a.double(), mask.bool()) for a in maps])
    assert float((result.entropy - want).abs().max()) <= tolerance(want, n=ids.shape[1], depth=layers)

    with torch.no_grad():
        base, ref = _hf_loss(hf, name, ids, mask, None)
        dh = hf.config.d_model // heads if name.startswith("Bart") else hf.config.d_kv
        keep = torch.ones(heads * dh)
        keep[HEAD * dh:(HEAD + 1) * dh] = 0
        handle = _hf_out_projections(hf)[LAYER].register_forward_pre_hook(lambda m, a: (a[0] * keep,))
        try:
            pruned, _ = _hf_loss(hf, name, ids, mask, ref)
        finally:
            handle.remove()
    want = pruned - base
    assert result.base_loss == pytest.approx(base, abs=tolerance(torch.tensor(base), n=ids.shape[1], depth=4))
    assert abs(float(result.prune_delta[LAYER, HEAD]) - want) <= tolerance(torch.tensor(base), n=ids.shape[1],
                                                                          depth=4)
    assert want != 0 and bool(torch.isfinite(result.prune_delta).all())
    if name.endswith("ConditionalGeneration"):
        assert result.loss_name.startswith("cross-entropy of reproducing the text")
    else:
        assert result.loss_name.startswith("KL(unpruned") and result.base_loss == 0.0
        assert float(result.prune_delta.min()) >= 0


def test_cli_analyzes_a_bart_head_folder(tmp_path, capsys):
    from attnlab.cli import main
    from tests.viz.conftest import save_word_tokenizer

    save_hf("BartForSequenceClassification", tmp_path / "model")
    save_word_tokenizer(tmp_path / "model", "the cat sat on mat".split(), template="<s> $A </s>",
                        specials=("<s>", "<pad>", "</s>", "<unk>"))
    assert main(["analyze", "--model", str(tmp_path / "model"), "--text", "the cat sat", "--text",
                 "the cat sat on the mat", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "BartForSequenceClassification" in out and "encoder self-attention" in out and "KL(unpruned" in out
    assert (tmp_path / "out" / "analysis.json").exists() and (tmp_path / "out" / "analysis.png").exists()
