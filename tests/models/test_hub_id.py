"""Checkpoints by Hub name, without a network: a Hub-layout cache (``models--org--name/snapshots/<sha>/``,
``refs/main``) built from a small random checkpoint and read with ``HF_HUB_OFFLINE=1``; the errors of a
missing or malformed name; a BERT saved without its pooler."""
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from attnlab.models.bert import BertConfig, BertModel
from attnlab.models.hub import from_pretrained, resolve_pretrained
from _tolerance import tolerance  # tests/_tolerance.py: from the dtype and the magnitude

hub_constants = pytest.importorskip("huggingface_hub.constants")

TINY = dict(vocab_size=20, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
            max_position_embeddings=16)
SHA = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root: Path, model, repo="org/tiny-bert", *, torch_bin=False) -> Path:
    """Lay ``model``'s files out as huggingface_hub's cache does (blobs are plain copies here)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    src = root / "src"
    model.save_pretrained(src)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", "[CLS]", "[SEP]", "the", "cat", "sat"])},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1),
                                                                                               ("[SEP]", 2)])
    tok.save(str(src / "tokenizer.json"))
    if torch_bin:  # an older repository: only a pickled state dict
        from safetensors.torch import load_file

        torch.save(load_file(str(src / "model.safetensors")), src / "pytorch_model.bin")
        (src / "model.safetensors").unlink()
    repo_dir = root / "hub" / ("models--" + repo.replace("/", "--"))
    shutil.copytree(src, repo_dir / "snapshots" / SHA)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(SHA)
    return root / "hub"


@pytest.fixture
def offline(monkeypatch):
    """``HF_HUB_OFFLINE=1`` as a user sets it (the env), and as huggingface_hub, already imported, reads it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return BertModel(BertConfig(**TINY)).eval()


def _same_params(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_hub_id_loads_from_the_cache_offline(tmp_path, tiny, offline):
    cache = _hub_cache(tmp_path, tiny)
    folder = resolve_pretrained("org/tiny-bert", cache_dir=cache)
    assert folder == (cache / "models--org--tiny-bert" / "snapshots" / SHA).resolve()
    assert _same_params(from_pretrained("org/tiny-bert", cache_dir=cache), tiny)
    assert _same_params(BertModel.from_pretrained("org/tiny-bert", cache_dir=cache, revision=SHA), tiny)
    with pytest.raises(FileNotFoundError, match=r"'org/tiny-bert' at revision 'v9'.*HF_HUB_OFFLINE"):
        from_pretrained("org/tiny-bert", cache_dir=cache, revision="v9")


def test_a_pickle_only_snapshot_loads_with_weights_only(tmp_path, tiny, offline, monkeypatch):
    cache = _hub_cache(tmp_path, tiny, torch_bin=True)
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw) or real_load(*a, **kw))
    assert _same_params(from_pretrained("org/tiny-bert", cache_dir=cache), tiny)
    assert [kw.get("weights_only") for kw in calls] == [True]


def test_local_files_only_needs_no_offline_mode(tmp_path, tiny):
    cache = _hub_cache(tmp_path, tiny)
    assert _same_params(from_pretrained("org/tiny-bert", cache_dir=cache, local_files_only=True), tiny)
    with pytest.raises(FileNotFoundError, match=r"'org/other'.*local_files_only=True"):
        from_pretrained("org/other", cache_dir=cache, local_files_only=True)


def test_a_missing_id_offline_is_one_line_naming_it(tmp_path, offline):
    with pytest.raises(FileNotFoundError) as e:
        from_pretrained("org/not-here", cache_dir=tmp_path)
    msg = str(e.value)
    assert "'org/not-here'" in msg and "HF_HUB_OFFLINE" in msg and "\n" not in msg


def test_neither_a_folder_nor_an_id_names_both(tmp_path):
    for bad in (str(tmp_path / "a" / "b"), "a/b/c", "bad id!"):
        with pytest.raises(FileNotFoundError, match="no such model directory.*not a Hugging Face Hub id") as e:
            from_pretrained(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        from_pretrained(Path("org") / "name")  # a Path names a folder, never a Hub id
    with pytest.raises(ValueError, match="revision='main' is for a Hub id"):
        resolve_pretrained(tmp_path, revision="main")
    with pytest.raises(TypeError, match="name_or_path"):
        resolve_pretrained(3)


def test_the_cli_takes_a_hub_id(tmp_path, tiny):
    """``attnlab viz --model org/name`` in a fresh process: the env alone (HF_HUB_OFFLINE, HF_HUB_CACHE) decides."""
    cache = _hub_cache(tmp_path, tiny)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    out = tmp_path / "view.html"
    run = subprocess.run([sys.executable, "-m", "attnlab", "viz", "--model", "org/tiny-bert", "--text", "the cat sat",
                          "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "BertModel: encoder (2, 2, 5, 5)" in run.stdout and out.is_file()
    run = subprocess.run([sys.executable, "-m", "attnlab", "viz", "--model", "org/missing", "--text", "a",
                          "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    err = run.stderr.strip()
    assert run.returncode == 2 and len(err.splitlines()) == 1 and "'org/missing'" in err and "HF_HUB_OFFLINE" in err


def test_bert_without_pooler_loads_with_a_fresh_one_and_one_warning(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    theirs = transformers.BertModel(transformers.BertConfig(**TINY), add_pooling_layer=False).eval()
    theirs.save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = from_pretrained(tmp_path)
    pooler = [w for w in caught if "pooler" in str(w.message)]
    assert len(pooler) == 1 and "\n" not in str(pooler[0].message)
    assert "pooler.dense.weight" in str(pooler[0].message) and "freshly initialised" in str(pooler[0].message)
    ids = torch.tensor([[1, 5, 7, 2, 9]])
    with torch.no_grad():
        expected = theirs(ids).last_hidden_state
        got = ours(ids).last_hidden_state
    assert (got - expected).abs().max() <= tolerance(expected, n=TINY["hidden_size"], depth=TINY["num_hidden_layers"])
    assert ours.pooler.weight.std() > 0 and torch.equal(ours.pooler.bias, torch.zeros(TINY["hidden_size"]))
    # our own BertModel(add_pooling_layer=False) checkpoints load the same way
    BertModel(BertConfig(**TINY), add_pooling_layer=False).save_pretrained(tmp_path / "ours")
    with pytest.warns(UserWarning, match="no pooler"):
        assert from_pretrained(tmp_path / "ours").pooler is not None
