"""``shakespeare-char``: a character-level GPT on tiny-shakespeare (nanoGPT's ``shakespeare_char``).

Data as nanoGPT's ``prepare.py``: one id per distinct character (65), the first 90 % of the text
for training, the last 10 % for validation. Training batches are random contiguous blocks
(:class:`~attnlab.data.batching.LMBatches`); the validation loss is the mean token
cross-entropy over a fixed set of ``eval_batches × eval_batch_size`` random validation blocks,
computed in fp32 (the model's weights are fp32; evaluation runs outside autocast)::

    val_loss = (1/N) Σ_n −log p(y_n | x_{≤n}),    val_ppl = exp(val_loss)

Two architectures (``arch``), both pre-norm with tied embeddings and GPT-2's initialisation
(``N(0, 0.02)``, residual output projections ``N(0, 0.02/√(2·n_layer))``):

- ``gpt2``: attnlab's :class:`~attnlab.models.gpt.GPT2LMHeadModel` (learned positions, LayerNorm,
  GELU MLP 4× wide): nanoGPT's architecture, with GPT-2's biases by default (``bias=False`` is nanoGPT's
  ``bias=False``; on the ``nanogpt-cpu`` preset it trains 7 % faster but ends at val loss 1.901 instead
  of 1.887, so the preset keeps the biases).
- ``llama``: :class:`~attnlab.models.llama.LlamaForCausalLM` (rotary positions, RMSNorm, SwiGLU MLP
  ``ffn_dim`` = 8/3 × wide rounded up to a multiple of 32, so the parameters match ``gpt2``'s; no
  biases; ``dropout`` is GPT-2's on the embeddings and the residual branches, ``LlamaConfig.hidden_dropout``).
  The default preset's architecture: it reaches a lower val loss than ``gpt2`` in the same 10 minutes. The
  default's other choices (Muon, dropout, context 256): :class:`ShakespeareSettings`.

Presets (see :data:`PRESETS`): ``nanogpt-cpu`` is nanoGPT's README CPU run; the default is tuned
for a 10-minute budget on 2 CPU cores; ``tiny`` is a seconds-long smoke run. ``nanogpt-cpu`` runs its linear
layers' products in int8 (``int8_training``, :mod:`attnlab.adapt.int8_training`; ``--set int8_training=false``
for float products): the roundings move the val loss by less than a change of seed does. Its target, our process
in ≤ 0.5× the wall of nanoGPT's own ``train.py`` on the same machine at a val loss ≤ its own on the same blocks
(``benchmarks/train.py --nanogpt-dir``), and the measurements: see docs/performance.md.

Adapting a trained run (each setting names a previous run's output folder; its latest checkpoint is used;
the code: :mod:`attnlab.training.recipes.char_runs`):

- ``init``: start from that run's weights (same shapes; a LoRA run is merged into its base first).
- ``lora``: ``"r=8"`` or ``"r=8,alpha=16,dropout=0.0"`` (``alpha`` defaults to ``r``): after ``init``,
  :func:`~attnlab.adapt.apply_lora` on every attention query and value projection, so only the
  low-rank ``A``, ``B`` train (``ΔW = (α/r) B A``); the checkpoints hold the LoRA model.
- ``teacher``: distil from that run's frozen model (eval mode, no grad, same vocabulary); the loss is
  :func:`~attnlab.training.losses.distillation_loss` with ``distill_temperature`` ``T`` and ``distill_alpha`` ``α``::

      loss = α · T² · KL(softmax(t/T) ‖ softmax(s/T)) + (1 − α) · CE(s, y)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import check_int, check_rate, one_of, positive_number
from attnlab.adapt.lora import parse_lora_spec
from attnlab.data.batching import LMBatches, lm_eval_batches
from attnlab.data.datasets import load_text
from attnlab.data.tokenizers import CharTokenizer
from attnlab.evaluation.metrics import expected_calibration_error, perplexity, reliability_diagram
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
from attnlab.models.llama import LlamaConfig, LlamaForCausalLM
from attnlab.training.config import run_dtype
from attnlab.training.distributed import DistInfo, resolve_device
from attnlab.training.recipes import Built, Recipe, register
from attnlab.training.recipes.char_runs import adapt_run
from attnlab.training.trainer import TrainConfig

__all__ = ["ShakespeareSettings", "PRESETS", "ARCHS", "evaluate_lm", "build", "make_model", "train_dropout",
           "ffn_width"]

LM_METRICS = ("val_loss", "val_ppl", "val_accuracy", "val_ece")
ARCHS = ("gpt2", "llama")
LLAMA_ACTIVATIONS = {None: "silu", "swiglu": "silu", "relu2_glu": "relu2"}  # -> LlamaConfig.hidden_act


@dataclass
class ShakespeareSettings(TrainConfig):
    """The default preset (10-minute budget); every :class:`TrainConfig` field is a setting too.

    Model: ``arch`` (``gpt2`` or ``llama``, see the module docstring), ``n_layer`` × (``n_head`` heads,
    ``n_embd`` wide), context ``block_size``, MLP hidden width ``ffn_dim`` (None: 4 × ``n_embd`` for
    ``gpt2``, 8/3 × rounded up to a multiple of 32 for ``llama``), ``dropout`` on the embeddings and the
    residual branches (None: by the dtype the run computes in, :func:`train_dropout`). ``gpt2`` only:
    ``attn_dropout`` on attention weights (0 keeps the fused attention kernel), ``activation`` (default ``gelu``),
    ``bias=False`` drops the biases of linear layers and LayerNorms (nanoGPT's ``bias``; default True).
    ``batch_size`` rows per optimiser micro-step (the global batch under DDP).
    Training levers (off by default; measured by ``benchmarks/train_levers.py``): ``zero_init`` starts the
    residual output projections (attention ``out_proj``, MLP ``w2``) at zero instead of GPT-2's scaled normal;
    ``llama`` only: ``tie_embeddings=False`` gives the head its own matrix, ``logit_softcap`` = c caps the
    logits at ``c · tanh(logits / c)``, ``qk_norm`` RMS-normalises each head's query and key, ``activation=relu2_glu``
    gates the MLP with ``max(x, 0)²`` instead of SiLU (``LlamaConfig.hidden_act="relu2"``), ``value_embeddings`` adds
    a per-layer token table to the attention's values (see :class:`~attnlab.models.llama.LlamaConfig`).

    The default: ``llama``, ``optimizer="muon"`` for the hidden matrices (a trainer setting; AdamW for the embeddings
    and gains) at ``muon_lr_scale=2`` with ``muon_ns_steps=3``, context 256 × 16 rows (4,096 tokens a step), and
    ``dropout`` None: 0.05 where the run computes in bf16, none in fp32 (:func:`train_dropout`: an fp32 run's
    10 minutes hold too few steps to overfit, and dropout then costs more than it gives). ``int8_training`` None:
    on where the products would be fp32 (about twice fp32's rate), off where bf16 is native (no better model there).
    Chosen because it beats the alternatives both at the full budget and at half of it (a machine half as fast).

    The default plans its length to a 10-minute budget (``time_budget``, see :class:`TrainConfig`), the cosine decay
    ending where the budget does, up to ``max_steps`` = 2,400 (~9.8 passes over the 1.0 M training characters):
    past that the model overfits, so a faster machine stops earlier with the same model; a longer ``time_budget``
    needs a larger ``max_steps`` too. Validation: ``eval_batches`` × ``eval_batch_size`` blocks of the last
    ``val_fraction`` of the text. Its target (best val loss ≤ 1.47, nanoGPT's A100 result, in 600 s) and the
    measurements: see docs/performance.md.
    """

    arch: str = "llama"
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    block_size: int = 256
    batch_size: int = 16
    ffn_dim: Optional[int] = None
    dropout: Optional[float] = None  # None: 0.05 when the run computes in bf16, 0 in fp32 (see train_dropout)
    attn_dropout: float = 0.0
    activation: Optional[str] = None
    bias: Optional[bool] = None
    zero_init: bool = False
    tie_embeddings: bool = True
    logit_softcap: Optional[float] = None
    qk_norm: bool = False
    value_embeddings: bool = False
    eval_batches: int = 8
    eval_batch_size: int = 64
    val_fraction: float = 0.1
    # trainer defaults for this recipe
    lr: float = 2e-3
    min_lr: float = 0.0  # cosine to zero: 1.490 / 1.499 vs 1.502 / 1.505 ending at 2e-4 (same 10 minutes)
    optimizer: str = "muon"  # hidden matrices by Muon at 2× the schedule's lr, 3 Newton–Schulz steps (docstring)
    muon_lr_scale: float = 2.0
    muon_ns_steps: int = 3
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.1
    warmup_steps: int = 100
    clip: float = 1.0
    dtype: str = "auto"  # bf16 where the CPU computes it natively (and faster), else fp32
    int8_training: Optional[bool] = None  # None: int8 products where the run's would be fp32 (TrainConfig)
    eval_every: int = 500  # each evaluation (64 × 8 blocks of 256) costs ~6 s of the 10 minutes
    checkpoint_every: int = 500
    log_every: int = 50
    time_budget: Optional[float] = 575.0  # + data, model and files: the 10-minute target
    max_seconds: Optional[float] = 590.0  # a hard stop if the machine slows down after planning
    max_steps: int = 2_400  # ~9.8 epochs: the default overfits past it (docstring)
    # adapting a previous run (see the module docstring)
    init: Optional[str] = None
    lora: Optional[str] = None
    teacher: Optional[str] = None
    distill_temperature: float = 2.0
    distill_alpha: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        one_of("arch", self.arch, ARCHS)
        if self.bias is not None and not isinstance(self.bias, bool):
            raise ValueError(f"bias must be true or false, got {self.bias!r}")
        for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "eval_batches", "eval_batch_size"):
            check_int(name, getattr(self, name))
        check_int("ffn_dim", self.ffn_dim, optional=True)
        if self.dropout is not None:
            check_rate("dropout", self.dropout)
        check_rate("attn_dropout", self.attn_dropout)
        for name in ("zero_init", "tie_embeddings", "qk_norm", "value_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.logit_softcap is not None:
            positive_number("logit_softcap", self.logit_softcap, finite=True)
        if self.arch == "gpt2" and (not self.tie_embeddings or self.logit_softcap is not None or self.qk_norm
                                    or self.value_embeddings):
            raise ValueError("tie_embeddings=false, logit_softcap, qk_norm and value_embeddings are arch=llama "
                             "settings (attnlab's GPT-2 is GPT-2's architecture)")
        if self.arch == "llama":  # Llama: no attention dropout, no biases, a gated MLP (SwiGLU or ReLU²)
            bad = {k: v for k, v in (("attn_dropout", self.attn_dropout), ("bias", self.bias)) if v}
            bad.update({k: v for k, v in (("activation", self.activation),) if v not in LLAMA_ACTIVATIONS})
            if bad:
                raise ValueError(f"arch=llama has no attention dropout, no biases and a gated MLP (activation "
                                 f"swiglu or relu2_glu); got "
                                 f"{', '.join(f'{k}={v!r}' for k, v in bad.items())} (use arch=gpt2 for these)")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if self.lora is not None:
            parse_lora_spec(self.lora)
        if not (isinstance(self.distill_temperature, (int, float)) and self.distill_temperature > 0):
            raise ValueError(f"distill_temperature must be > 0, got {self.distill_temperature!r}")
        if not (isinstance(self.distill_alpha, (int, float)) and 0.0 <= self.distill_alpha <= 1.0):
            raise ValueError(f"distill_alpha must be in [0, 1], got {self.distill_alpha!r}")


PRESETS = {
    # nanoGPT README: python train.py config/train_shakespeare_char.py --device=cpu --compile=False
    #   --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4
    #   --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0
    # (lr 1e-3 -> 1e-4 cosine, warmup 100, beta2 0.99, weight decay 0.1, clip 1.0)
    "nanogpt-cpu": dict(arch="gpt2", n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, dropout=0.0,
                        max_steps=2000, lr=1e-3, min_lr=1e-4, warmup_steps=100, betas=(0.9, 0.99), weight_decay=0.1,
                        clip=1.0, attn_dropout=0.0, optimizer="adamw", dtype="auto", int8_training=True,
                        eval_every=0, checkpoint_every=0,
                        log_every=100, eval_batches=16, eval_batch_size=64, time_budget=None, max_seconds=None),
    "tiny": dict(arch="gpt2", n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=8, dropout=0.0, max_steps=40,
                 optimizer="adamw", lr=1e-2, min_lr=1e-3, warmup_steps=5, dtype="fp32", eval_every=20,
                 checkpoint_every=10, log_every=10, eval_batches=2, eval_batch_size=16, time_budget=None,
                 max_seconds=None),
}


@torch.no_grad()
def evaluate_lm(model: nn.Module, *, batches: Sequence[tuple[Tensor, Tensor]], max_batches: Optional[int] = None,
                metrics: Optional[Sequence[str]] = None, reliability_png: Optional[str] = None,
                split: str = "val") -> dict:
    """Next-token loss, perplexity, accuracy (and calibration) of ``model`` on ``batches``, in fp32.

    Args:
        batches: ``(x (B, T), y (B, T))`` pairs.
        max_batches: use only the first ``max_batches``.
        metrics: keep only these of ``val_loss, val_ppl, val_accuracy, val_ece`` (default: all but ECE,
            which is added when asked for or when ``reliability_png`` is given).
        reliability_png: also write a reliability diagram (confidence vs accuracy) there.
        split: only ``"val"`` (the split this recipe holds out).

    Raises:
        ValueError: an unknown metric or split, or ``max_batches < 1``.
    """
    if split != "val":
        raise ValueError(f"split must be 'val' for shakespeare-char (the last 10 % of the text), got {split!r}")
    metrics = list(metrics) if metrics is not None else None
    bad = [m for m in metrics or [] if m not in LM_METRICS and f"val_{m}" not in LM_METRICS]
    if bad:
        raise ValueError(f"unknown metric {bad[0]!r}; valid: {', '.join(LM_METRICS)}")
    if max_batches is not None:
        if max_batches < 1:
            raise ValueError(f"max_batches must be >= 1, got {max_batches}")
        batches = batches[:max_batches]
    want_ece = reliability_png is not None or any(m in ("val_ece", "ece") for m in metrics or [])
    device = next(model.parameters()).device
    nll, correct, n = 0.0, 0, 0
    all_logits, all_targets = [], []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        logits = model(x).logits.float()  # (B, T, V)
        nll += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        correct += int((logits.argmax(-1) == y).sum())
        n += y.numel()
        if want_ece:
            all_logits.append(logits.flatten(0, 1).cpu())
            all_targets.append(y.flatten().cpu())
    loss = nll / n
    out = {"val_loss": loss, "val_ppl": perplexity(loss), "val_accuracy": correct / n, "val_tokens": n}
    if want_ece:
        logits, targets = torch.cat(all_logits), torch.cat(all_targets)
        out["val_ece"] = float(expected_calibration_error(logits, targets, from_logits=True))
        if reliability_png is not None:
            reliability_diagram(logits, targets, reliability_png, from_logits=True)
            out["reliability_png"] = str(reliability_png)
    if metrics is not None:
        keep = {m if m in LM_METRICS else f"val_{m}" for m in metrics}
        out = {k: v for k, v in out.items() if k in keep or k in ("val_tokens", "reliability_png")}
    return out


def build(s: ShakespeareSettings, *, out: Path, dist: DistInfo, training: bool) -> Built:
    """Tokenise tiny-shakespeare, split 90/10, build the GPT, the batch iterator and the evaluation."""
    text = load_text("tinyshakespeare")
    tokenizer = CharTokenizer.from_text(text)
    if training and dist.is_main:
        tokenizer.save(Path(out) / "tokenizer.json")
    data = tokenizer.encode_tensor(text, torch.uint8 if tokenizer.vocab_size <= 256 else torch.long)
    n_train = int(len(data) * (1.0 - s.val_fraction))
    train, val = data[:n_train], data[n_train:]  # (N_train,), (N_val,)
    dropout, why = train_dropout(s, resolve_device(s.device, dist)) if training else (0.0, "evaluation")
    model = make_model(s, vocab_size=tokenizer.vocab_size, dropout=dropout)
    loss_fn, info = adapt_run(model, s, out=Path(out), tokenizer=tokenizer, training=training)
    if training:
        info = {"dropout": dropout, "dropout_reason": why, **info}
    batches = LMBatches(train, block_size=s.block_size, batch_size=s.batch_size, seed=s.seed, rank=dist.rank,
                        world_size=dist.world_size) if training else None
    val_batches = lm_eval_batches(val, block_size=s.block_size, batch_size=s.eval_batch_size,
                                  num_batches=s.eval_batches, seed=s.seed + 1)
    evaluate = functools.partial(evaluate_lm, batches=val_batches)
    info = {"parameters": sum(p.numel() for p in model.parameters()), "vocab_size": tokenizer.vocab_size,
            "train_chars": len(train), "val_chars": len(val), "val_eval_tokens": len(val_batches) * s.eval_batch_size
            * s.block_size, **info}
    return Built(model=model, train_batches=batches, loss_fn=loss_fn, evaluate=evaluate, score=evaluate,
                 info=info)


def train_dropout(s: ShakespeareSettings, device: torch.device) -> tuple[float, str]:
    """The dropout rate to train with, and why: ``s.dropout`` when set; else 0.05 where the run computes in bf16
    (``dtype`` resolved on ``device`` as the trainer does: :func:`~attnlab.training.config.run_dtype`) and 0 in fp32.

    Dropout pays once a run is long enough to overfit: on 2 cores of a CPU with native bf16 the 10 minutes hold
    ~2,400 steps, which overfit without it; on a CPU without native bf16 (fp32) they hold about a third as many,
    and dropout then costs more than it gives.
    """
    if s.dropout is not None:
        return s.dropout, "asked for"
    dtype, _ = run_dtype(s.dtype, device, int8_training=s.int8_training)
    if dtype == "fp32":
        return 0.0, "fp32: ~850 steps of the 10-minute default on 2 cores, too few to overfit"
    return 0.05, f"{dtype}: ~2,400 steps of the 10-minute default on 2 cores overfit without it"


def make_model(s: ShakespeareSettings, *, vocab_size: int, dropout: Optional[float] = None) -> nn.Module:
    """The ``arch`` model of settings ``s`` with GPT-2's initialisation (see the module docstring); ``dropout``
    (default: ``s.dropout``, none when that is None) on the embeddings and residual branches."""
    dropout = dropout if dropout is not None else (s.dropout or 0.0)
    if s.arch == "gpt2":
        config = GPT2Config(vocab_size=vocab_size, n_positions=s.block_size, n_embd=s.n_embd, n_layer=s.n_layer,
                            n_head=s.n_head, n_inner=s.ffn_dim, activation=s.activation or "gelu",
                            embd_pdrop=dropout, resid_pdrop=dropout, attn_pdrop=s.attn_dropout,
                            bias=True if s.bias is None else s.bias, bos_token_id=None, eos_token_id=None)
        model = GPT2LMHeadModel(config)  # initialised as GPT-2
    else:
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=s.n_embd, intermediate_size=ffn_width(s),
                             num_hidden_layers=s.n_layer, num_attention_heads=s.n_head,
                             max_position_embeddings=s.block_size, tie_word_embeddings=s.tie_embeddings,
                             rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None,
                             final_logit_softcapping=s.logit_softcap, qk_norm=s.qk_norm,
                             value_embeddings=s.value_embeddings,
                             hidden_act=LLAMA_ACTIVATIONS[s.activation], hidden_dropout=dropout)
        model = LlamaForCausalLM(config)  # N(0, 0.02) everywhere, as HF; then GPT-2's residual scaling
        for layer in model.layers:
            for proj in (layer.self_attn.out_proj, layer.ffn.w2):
                nn.init.normal_(proj.weight, std=0.02 / (2 * s.n_layer) ** 0.5)
    if s.zero_init:
        for layer in model.layers:
            for proj in (layer.self_attn.out_proj, layer.ffn.w2):
                nn.init.zeros_(proj.weight)
    return model


def ffn_width(s: ShakespeareSettings) -> int:
    """The MLP hidden width: ``ffn_dim`` when set, else ``4 · n_embd`` (``gpt2``) or ``8/3 · n_embd`` rounded up
    to a multiple of 32 (``llama``'s SwiGLU, so that its three matrices hold about ``gpt2``'s two)."""
    if s.ffn_dim:
        return s.ffn_dim
    return 4 * s.n_embd if s.arch == "gpt2" else -(-8 * s.n_embd // (3 * 32)) * 32


register(Recipe(
    name="shakespeare-char", settings=ShakespeareSettings, build=build, presets=PRESETS,
    description="character-level GPT on tiny-shakespeare (nanoGPT's shakespeare_char)",
    targets={"nanogpt-cpu": "wall <= 0.5x nanoGPT's own train.py on the same machine, val <= its val on the same "
                            "blocks (benchmarks/train.py --nanogpt-dir)",
             "default": "best val loss <= 1.47 (nanoGPT's A100 result) within 10 minutes on 2 AVX512-BF16 cores, "
                        "and 0.08 below nanoGPT's loop at the same size and time on any CPU",
             "tiny": "a few-second smoke run"},
))
