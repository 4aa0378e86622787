"""``attnlab generate``: the same tokens as :func:`attnlab.generation.generate` on the same model, for a
decoder-only and an encoder-decoder folder; one-line errors; ``--dtype auto`` resolved and printed."""
import torch

from attnlab.cli import main
from attnlab.data.tokenizers import load_tokenizer
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran"]


def _gpt_folder(tmp_path, word_tokenizer):
    folder = tmp_path / "gpt"
    folder.mkdir()
    vocab = word_tokenizer(folder, WORDS, specials=["<unk>"])
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(vocab), n_positions=64, n_embd=16, n_layer=2, n_head=2)).save_pretrained(folder)
    return folder


def _save_word_tokenizer(directory, words, *, specials=()):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate([*specials, *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[0] if specials else words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    return vocab


def test_greedy_continuation_equals_the_api(tmp_path, capsys):
    folder = _gpt_folder(tmp_path, _save_word_tokenizer)
    assert main(["generate", "--model", str(folder), "--prompt", "the cat", "--prompt", "a dog ran",
                 "--max-new-tokens", "5", "--dtype", "float32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("GPT2LMHeadModel, dtype fp32")
    tok = load_tokenizer(folder)
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    for text, line in zip(["the cat", "a dog ran"], lines[1:]):
        ids = torch.tensor([tok.encode(text)])
        new = model.generate(ids, max_new_tokens=5)[0, ids.shape[1]:]
        assert line == text + tok.decode(new.tolist())
    assert len(lines) == 3


def test_sampling_is_reproducible_with_the_seed_and_auto_dtype_is_reported(tmp_path, capsys):
    folder = _gpt_folder(tmp_path, _save_word_tokenizer)
    runs = []
    for _ in range(2):
        assert main(["generate", "--model", str(folder), "--prompt", "the", "--do-sample", "--top-k", "4",
                     "--seed", "3", "--max-new-tokens", "6"]) == 0
        runs.append(capsys.readouterr().out.splitlines())
    assert runs[0] == runs[1]
    from attnlab._runtime import resolve_dtype

    name, reason = resolve_dtype("auto", "cpu")
    assert runs[0][0] == f"GPT2LMHeadModel, dtype {name} ({reason})"  # the default is auto


def test_encoder_decoder_answers_the_source(tmp_path, capsys):
    from attnlab.models.t5 import T5Config, T5ForConditionalGeneration

    folder = tmp_path / "t5"
    folder.mkdir()
    vocab = _save_word_tokenizer(folder, WORDS, specials=["<pad>", "</s>", "<unk>"])
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=len(vocab), d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                num_decoder_layers=1, num_heads=2)).eval()
    model.save_pretrained(folder)
    assert main(["generate", "--model", str(folder), "--prompt", "the cat sat", "--num-beams", "2",
                 "--max-new-tokens", "4", "--dtype", "float32"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    tok = load_tokenizer(folder)
    out = model.generate(torch.tensor([tok.encode("the cat sat")]), max_new_tokens=4, num_beams=2)
    assert line == tok.decode(out[0, 1:].tolist())


def test_errors_are_one_line(tmp_path, capsys):
    folder = _gpt_folder(tmp_path, _save_word_tokenizer)
    cases = [(["--model", str(tmp_path / "none"), "--prompt", "x"], "none"),
             (["--model", str(folder), "--prompt", "  "], "--prompt must not be empty"),
             (["--model", str(folder), "--prompt", "the", "--temperature", "0"], "temperature"),
             (["--model", str(folder), "--prompt", "the", "--max-new-tokens", "0"], "--max-new-tokens must be in [1,")]
    for argv, needle in cases:
        assert main(["generate", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err


def test_window_generates_as_the_windowed_model_does(tmp_path, capsys):
    from attnlab.adapt.deploy import sliding_window

    folder = _gpt_folder(tmp_path, _save_word_tokenizer)
    assert main(["generate", "--model", str(folder), "--prompt", "the cat sat", "--max-new-tokens", "30",
                 "--window", "4", "--dtype", "float32"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    tok = load_tokenizer(folder)
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    ids = torch.tensor([tok.encode("the cat sat")])
    with sliding_window(model, 4):
        new = model.generate(ids, max_new_tokens=30, cache="dynamic")[0, ids.shape[1]:]
    assert line == "the cat sat" + tok.decode(new.tolist())
    assert main(["generate", "--model", str(folder), "--prompt", "a", "--window", "0"]) == 2
    assert "--window must be an int in [1, " in capsys.readouterr().err


def test_int4_generates_as_the_quantised_model_does_and_checks_its_flags(tmp_path, capsys):
    """``--int4`` decodes with :func:`attnlab.adapt.quantize` ``"int4"``'s model (the same tokens); ``--group-size``
    is validated before the model loads and only with ``--int4``; ``--int4`` and ``--int8`` exclude each other."""
    import pytest

    from attnlab.adapt.quantize import quantize

    folder = tmp_path / "gpt"
    folder.mkdir()
    vocab = _save_word_tokenizer(folder, WORDS, specials=["<unk>"])
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(vocab), n_positions=64, n_embd=64, n_layer=2, n_head=2)).save_pretrained(
        folder)
    assert main(["generate", "--model", str(folder), "--prompt", "the cat", "--max-new-tokens", "6", "--int4",
                 "--group-size", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "GPT2LMHeadModel, dtype int4 (weights in groups of 32)"
    tok = load_tokenizer(folder)
    model = quantize(GPT2LMHeadModel.from_pretrained(folder).eval(), "int4", group_size=32)
    ids = torch.tensor([tok.encode("the cat")])
    assert lines[1] == "the cat" + tok.decode(model.generate(ids, max_new_tokens=6, cache="dynamic")[0, 2:].tolist())
    for argv, needle in [(["--int4", "--group-size", "48"], "--group-size must be a positive multiple of 32"),
                         (["--group-size", "32"], "--group-size is --int4's"),
                         (["--int4", "--dtype", "float32"], "--int4 runs on the CPU in place of --dtype")]:
        assert main(["generate", "--model", str(folder), "--prompt", "the", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(folder), "--prompt", "the", "--int4", "--int8"])
    assert "not allowed with argument" in capsys.readouterr().err
