"""nanoGPT's sampling: past the position limit each next token is predicted from the last ``block`` tokens
(``generate(cache="crop")``, sample.py's loop), ``attnlab generate --start/--num-samples``, nanoGPT's setting
names in ``--set``."""
import pytest
import torch

from attnlab.cli import main
from attnlab.data.tokenizers import load_tokenizer
from attnlab.generation import filter_logits, generate
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel

BLOCK = 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=11, n_positions=BLOCK, n_embd=16, n_layer=2, n_head=2)).eval()


def _sample_py(model, ids, n, *, generator=None, top_k=None, temperature=1.0):
    """nanoGPT's ``GPT.generate``: crop to the block, run the whole context, take the last logits."""
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids[:, -BLOCK:]).logits[:, -1].float()
            if generator is None:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = filter_logits(logits, temperature=temperature, top_k=top_k).softmax(-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.mark.parametrize("prompt_len", [1, BLOCK - 1, BLOCK, BLOCK + 5])
def test_crop_decodes_past_the_block_as_sample_py(model, prompt_len):
    ids = torch.randint(0, 11, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    ours = generate(model, ids, max_new_tokens=3 * BLOCK, cache="crop")
    assert torch.equal(ours, _sample_py(model, ids, 3 * BLOCK))


def test_crop_samples_as_sample_py_with_the_same_generator(model):
    ids = torch.tensor([[1, 2, 3]])
    ours = generate(model, ids, max_new_tokens=30, cache="crop", do_sample=True, top_k=5, temperature=0.8,
                    generator=torch.Generator().manual_seed(4))
    theirs = _sample_py(model, ids, 30, generator=torch.Generator().manual_seed(4), top_k=5, temperature=0.8)
    assert torch.equal(ours, theirs)


def test_without_crop_the_limit_is_one_clear_error(model):
    with pytest.raises(ValueError, match="n_positions=8: at most 5 new tokens"):
        generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=6)


def test_crop_refuses_what_it_cannot_do(model):
    with pytest.raises(ValueError, match="num_beams must be 1"):
        generate(model, torch.tensor([[1, 2]]), max_new_tokens=20, cache="crop", num_beams=2)
    with pytest.raises(ValueError, match="unpadded"):
        generate(model, torch.tensor([[1, 2]]), max_new_tokens=20, cache="crop",
                 attention_mask=torch.tensor([[0, 1]]))


def _folder(tmp_path, model):
    from tests.test_generate_cli import _save_word_tokenizer

    folder = tmp_path / "gpt"
    folder.mkdir()
    _save_word_tokenizer(folder, ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "away"],
                         specials=["<unk>"])
    model.save_pretrained(folder)
    return folder


def test_generate_goes_past_the_block_with_start_from_a_file(tmp_path, model, capsys):
    folder = _folder(tmp_path, model)
    (tmp_path / "start.txt").write_text("the cat sat", encoding="utf-8")
    assert main(["generate", "--model", str(folder), "--start", f"FILE:{tmp_path / 'start.txt'}",
                 "--max-new-tokens", "20", "--dtype", "fp32"]) == 0
    out, err = capsys.readouterr()
    tok = load_tokenizer(folder)
    ids = torch.tensor([tok.encode("the cat sat")])
    want = _sample_py(model, ids, 20)[0, ids.shape[1]:]
    assert out.splitlines()[1] == "the cat sat" + tok.decode(want.tolist())
    assert "last 8 tokens" in err and "20 tokens in" in err


def test_num_samples_decodes_each_prompt_that_many_times(tmp_path, model, capsys):
    folder = _folder(tmp_path, model)
    assert main(["generate", "--model", str(folder), "--start", "the", "--num-samples", "3", "--do-sample",
                 "--seed", "1", "--max-new-tokens", "12", "--dtype", "fp32"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert lines.count("---------------") == 2 and len(lines) == 5
    samples = [line for line in lines if line != "---------------"]
    assert all(s.startswith("the") for s in samples) and len(set(samples)) > 1  # one generator, three draws


@pytest.mark.parametrize("argv, message", [
    (["--num-samples", "0"], "--num-samples must be in [1, 1000], got 0"),
    (["--max-new-tokens", "10000000000"], "--max-new-tokens must be in [1, 1,048,576], got 10000000000"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be in [1, 1,048,576], got 0"),
    (["--start", "FILE:/no/such/file"], "--start: no such file"),
    (["--start", "a", "--prompt", "b"], "--start and --prompt"),
    (["--start", "the", "--num-beams", "2", "--max-new-tokens", "20"], "--num-beams 2: beam search stays within"),
])
def test_bad_sampling_flags_are_one_line(tmp_path, model, capsys, argv, message):
    folder = _folder(tmp_path, model)
    assert main(["generate", "--model", str(folder), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_start_file_that_is_not_text_is_refused(tmp_path, model, capsys):
    folder = _folder(tmp_path, model)
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    assert main(["generate", "--model", str(folder), "--start", f"FILE:{tmp_path / 'bin'}"]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err


def test_nanogpt_setting_names_are_ours_and_a_typo_gets_a_suggestion():
    from attnlab.training.recipes import get_recipe, resolve_settings

    recipe = get_recipe("shakespeare-char")
    s = resolve_settings(recipe, preset="tiny", overrides={"max_iters": "7", "learning_rate": "0.01",
                                                           "eval_interval": "3", "block_size": "16",
                                                           "n_layer": "1", "grad_clip": "0.5"})
    assert (s.max_steps, s.lr, s.eval_every, s.block_size, s.n_layer, s.clip) == (7, 0.01, 3, 16, 1, 0.5)
    with pytest.raises(ValueError, match="did you mean 'max_steps'"):
        resolve_settings(recipe, overrides={"max_step": "3"})
    with pytest.raises(ValueError, match="max_iters and --set max_steps are the same setting"):
        resolve_settings(recipe, overrides={"max_iters": "3", "max_steps": "4"})
