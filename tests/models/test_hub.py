"""HF-format loading and saving: the registry, every failure mode, atomic writes, both weight formats."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnlab.models import hub
from attnlab.models.bert import BertConfig, BertForMaskedLM, BertModel
from attnlab.models.hub import from_pretrained, register, save_pretrained

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=64)


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = BertModel(BertConfig(**TINY)).eval()
    model.save_pretrained(tmp_path)
    return model, tmp_path


def _same_params(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_round_trip_and_files(saved):
    model, path = saved
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]  # no temp files left
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "bert" and cfg["architectures"] == ["BertModel"]
    names = load_file(path / "model.safetensors").keys()
    assert "encoder.layer.1.attention.self.query.weight" in names and "pooler.dense.bias" in names
    loaded = from_pretrained(path)
    assert type(loaded) is BertModel and _same_params(model, loaded)


def test_pytorch_bin_weights_only(saved):
    model, path = saved
    sd = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    torch.save(sd, path / "pytorch_model.bin")
    assert _same_params(model, from_pretrained(path))


def test_truncated_bin(saved):
    _, path = saved
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    data = (path / "pytorch_model.bin").read_bytes()
    (path / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        from_pretrained(path)


def test_bin_with_arbitrary_objects_is_refused(saved):
    _, path = saved
    (path / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1), "obj": _Custom()}, path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        from_pretrained(path)


class _Custom:
    pass


def test_dtype_and_ignored_keys(saved):
    _, path = saved
    sd = load_file(path / "model.safetensors")
    sd["embeddings.position_ids"] = torch.arange(64)[None]  # a non-persistent buffer old checkpoints hold
    save_file(sd, path / "model.safetensors")
    model = from_pretrained(path, dtype=torch.float64)
    assert model.embeddings.word.weight.dtype == torch.float64
    with pytest.raises(TypeError, match="dtype"):
        from_pretrained(path, dtype="float64")


def test_model_cls_picks_the_class(saved):
    _, path = saved
    with pytest.raises(ValueError, match=r"does not match BertForMaskedLM: missing tensors \['bert\..*\(\d+ more\)\]"):
        BertForMaskedLM.from_pretrained(path)  # names listed up to 10, then how many more
    with pytest.raises(ValueError, match="not registered"):
        from_pretrained(path, model_cls=torch.nn.Linear)


def test_missing_paths(tmp_path, saved):
    with pytest.raises(FileNotFoundError, match="nope"):
        from_pretrained(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(empty)
    _, path = saved
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        from_pretrained(path)


def test_unknown_model_type_lists_supported(saved):
    _, path = saved
    (path / "config.json").write_text(json.dumps({"model_type": "mystery"}))
    with pytest.raises(ValueError, match=r"'mystery'.*supported: \[.*'bert'"):
        from_pretrained(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        from_pretrained(path)


def test_corrupt_and_truncated_weights(saved):
    _, path = saved
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        from_pretrained(path)
    f.write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ValueError, match="model.safetensors"):
        from_pretrained(path)


def test_missing_and_unexpected_names(saved):
    _, path = saved
    sd = load_file(path / "model.safetensors")
    del sd["encoder.layer.0.attention.self.key.bias"]
    sd["encoder.layer.7.mystery.weight"] = torch.zeros(2)
    save_file(sd, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['encoder.layer.0.attention.self.key.bias'\], "
                                         r"unexpected tensors \['encoder.layer.7.mystery.weight'\]"):
        from_pretrained(path)


def test_wrong_shape_names_tensor_and_shapes(saved):
    _, path = saved
    sd = load_file(path / "model.safetensors")
    sd["encoder.layer.1.intermediate.dense.weight"] = torch.zeros(36, 32)
    save_file(sd, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"'encoder.layer.1.intermediate.dense.weight' .*\(36, 32\).*\(37, 32\)"):
        from_pretrained(path)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("as_dtype", [torch.int32, torch.int64, torch.bool])
def test_integer_dtype_for_a_float_weight_is_refused_by_name(saved, fmt, as_dtype):
    _, path = saved
    sd = load_file(path / "model.safetensors")
    name = "encoder.layer.1.intermediate.dense.weight"
    w = sd[name]
    sd[name] = w.view(torch.int32) if as_dtype == torch.int32 else w.to(as_dtype)  # I32: the float's bits as ints
    if fmt == "bin":
        (path / "model.safetensors").unlink()
        torch.save(sd, path / "pytorch_model.bin")
    else:
        save_file(sd, path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"'{name}' .*stored as {as_dtype}.*torch.float32"):
        from_pretrained(path)


def test_failed_save_leaves_previous_files(saved, monkeypatch):
    model, path = saved
    before = (path / "model.safetensors").read_bytes()

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        save_pretrained(model, path)
    assert (path / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]


def test_save_rejects_non_models(tmp_path):
    with pytest.raises(TypeError, match="PreTrainedMixin"):
        save_pretrained(torch.nn.Linear(2, 2), tmp_path)


def test_register_validates_and_registers(monkeypatch):
    monkeypatch.setattr(hub, "MODEL_TYPES", dict(hub.MODEL_TYPES))
    with pytest.raises(ValueError, match="default"):
        register("toy", config_from_hf=dict, architectures={"Toy": BertModel}, default="Other")
    with pytest.raises(TypeError, match="config_from_hf"):
        register("toy", config_from_hf=None, architectures={"Toy": BertModel}, default="Toy")
    with pytest.raises(ValueError, match="architectures"):
        register("toy", config_from_hf=dict, architectures={}, default="Toy")
    register("toy", config_from_hf=dict, architectures={"Toy": BertModel}, default="Toy")
    assert hub.MODEL_TYPES["toy"].architectures == {"Toy": BertModel}


def test_adapt_hf_checkpoint_completes_the_checkpoint_before_the_name_check(saved, monkeypatch):
    model, path = saved
    sd = load_file(path / "model.safetensors")
    del sd["pooler.dense.bias"]
    save_file(sd, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['pooler.dense.bias'\]"):
        from_pretrained(path)

    def fill(cls, config, hf):  # a checkpoint completed from what it holds
        return config, {**hf, "pooler.dense.bias": torch.zeros(32)}

    monkeypatch.setattr(BertModel, "adapt_hf_checkpoint", classmethod(fill))
    loaded = from_pretrained(path).to_hf_state_dict()
    assert loaded["pooler.dense.bias"].abs().max() == 0
    assert torch.equal(loaded["pooler.dense.weight"], model.to_hf_state_dict()["pooler.dense.weight"])


def test_config_sizes_are_checked_before_anything_is_allocated(tmp_path, saved):
    """A 1 KB config.json must not make the loader build 20,000 layers or allocate gigabytes."""
    import json
    import shutil

    _, path = saved
    for change, words in (({"num_hidden_layers": 20000}, "num_hidden_layers=20000 is out of range"),
                          ({"hidden_size": -3}, "hidden_size=-3 is out of range"),
                          ({"vocab_size": "big"}, "vocab_size='big' is out of range"),
                          ({"hidden_size": 8192, "intermediate_size": 32768, "num_hidden_layers": 48},
                           "describes a model of ~|parameters, needs .* of memory")):  # (the config, then the weights)
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(path, bad)
        cfg = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=words):
            from_pretrained(bad)
