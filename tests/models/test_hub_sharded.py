"""Sharded safetensors (``model.safetensors.index.json`` + shards, as transformers' ``save_pretrained(max_shard_size=
...)`` writes them) load into the same model, with the same outputs, as the unsharded checkpoint; an index naming a
shard outside the folder, a missing shard, or a shard that disagrees with its index is refused by name."""
import json
import shutil

import pytest
import torch

from attnlab.models.hub import SAFETENSORS_INDEX_NAME, from_pretrained, load_weights

transformers = pytest.importorskip("transformers")


def _tiny(family):
    torch.manual_seed(0)
    if family == "bert":
        cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=32)
        return transformers.BertModel(cfg).eval()
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_sharded_loads_equal_to_unsharded(tmp_path, family):
    hf = _tiny(family)
    hf.save_pretrained(tmp_path / "whole")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / SAFETENSORS_INDEX_NAME).is_file()
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    whole, sharded = load_weights(tmp_path / "whole"), load_weights(tmp_path / "sharded")
    assert whole.keys() == sharded.keys() and all(torch.equal(whole[k], sharded[k]) for k in whole)
    a, b = from_pretrained(tmp_path / "whole"), from_pretrained(tmp_path / "sharded")
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    with torch.no_grad():
        out_a, out_b = a(ids), b(ids)
    key = "last_hidden_state" if family == "bert" else "logits"
    assert torch.equal(getattr(out_a, key), getattr(out_b, key))
    with torch.no_grad():  # and the same as transformers' own forward of the model that wrote them
        ref = getattr(hf(ids), key)
    tol = 8 * torch.finfo(torch.float32).eps * float(ref.abs().max())
    assert (getattr(out_b, key) - ref).abs().max() <= tol


def _sharded(tmp_path):
    folder = tmp_path / "m"
    _tiny("bert").save_pretrained(folder, max_shard_size="20KB")
    return folder, json.loads((folder / SAFETENSORS_INDEX_NAME).read_text())


def _write(folder, index):
    (folder / SAFETENSORS_INDEX_NAME).write_text(json.dumps(index))


@pytest.mark.parametrize("escape", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/x.safetensors"])
def test_shard_outside_the_folder_is_refused(tmp_path, escape):
    folder, index = _sharded(tmp_path)
    first = next(iter(index["weight_map"].values()))
    shutil.copy(folder / first, tmp_path / "outside.safetensors")
    index["weight_map"] = {k: (escape if v == first else v) for k, v in index["weight_map"].items()}
    _write(folder, index)
    with pytest.raises(ValueError, match=f"names the shard '{escape}', which is not a file directly in"):
        load_weights(folder)


def test_missing_or_mismatched_shard_is_named(tmp_path):
    folder, index = _sharded(tmp_path)
    names = sorted(set(index["weight_map"].values()))
    (folder / names[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=f"names the shard '{names[-1]}', which is missing"):
        load_weights(folder)
    folder, index = _sharded(tmp_path / "b")
    moved = next(k for k, v in index["weight_map"].items() if v == names[0])
    index["weight_map"][moved] = names[1]
    _write(folder, index)
    with pytest.raises(ValueError, match=f"shard '({names[0]}|{names[1]})' does not match.*{moved}"):
        load_weights(folder)
    _write(folder, {"weight_map": []})
    with pytest.raises(ValueError, match="weight_map must be a non-empty object"):
        load_weights(folder)
