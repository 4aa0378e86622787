"""Losses against direct float64 computations of their formulas."""
import pytest
import torch

from attnlab.training.losses import distillation_loss, token_cross_entropy


def direct_ce(logits, targets, eps, ignore):
    """(1/N) Σ_n [(1−ε)(−log p[y]) + ε/V Σ_c −log p[c]] over kept positions, float64."""
    lp = torch.log_softmax(logits.double().reshape(-1, logits.shape[-1]), -1)
    y = targets.reshape(-1)
    keep = y != ignore
    nll = -lp[keep].gather(1, y[keep, None]).squeeze(1)
    smooth = -lp[keep].mean(-1)
    return ((1 - eps) * nll + eps * smooth).mean()


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_token_cross_entropy_matches_formula(eps):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7) * 3
    targets = torch.randint(0, 7, (3, 5))
    targets[0, :2] = -100
    got = token_cross_entropy(logits, targets, label_smoothing=eps)
    torch.testing.assert_close(got.double(), direct_ce(logits, targets, eps, -100), rtol=1e-6, atol=1e-6)
    # bf16 logits are upcast: same value as the float32 computation on the rounded logits
    lb = logits.bfloat16()
    assert token_cross_entropy(lb, targets).dtype == torch.float32
    torch.testing.assert_close(token_cross_entropy(lb, targets).double(), direct_ce(lb.float(), targets, 0.0, -100),
                               rtol=1e-6, atol=1e-6)


def test_all_ignored_gives_zero_not_nan():
    logits = torch.randn(2, 3, 4, requires_grad=True)
    loss = token_cross_entropy(logits, torch.full((2, 3), -1), ignore_index=-1)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.count_nonzero(logits.grad) == 0


def test_token_cross_entropy_errors():
    with pytest.raises(ValueError, match="targets must have shape"):
        token_cross_entropy(torch.randn(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="label_smoothing"):
        token_cross_entropy(torch.randn(2, 4), torch.zeros(2, dtype=torch.long), label_smoothing=1.0)


@pytest.mark.parametrize("T, alpha", [(1.0, 0.5), (2.0, 0.9), (4.0, 0.0), (3.0, 1.0)])
def test_distillation_matches_hinton_formula(T, alpha):
    torch.manual_seed(0)
    s = torch.randn(2, 6, 9, requires_grad=True)
    t = torch.randn(2, 6, 9) * 2
    y = torch.randint(0, 9, (2, 6))
    y[1, 4:] = -100
    got = distillation_loss(s, t, y, temperature=T, alpha=alpha)
    keep = (y != -100).reshape(-1)
    sd, td = s.double().reshape(-1, 9)[keep], t.double().reshape(-1, 9)[keep]
    p_t = torch.softmax(td / T, -1)
    kl = (p_t * (torch.log(p_t) - torch.log_softmax(sd / T, -1))).sum(-1).mean()  # KL(p_t ‖ p_s) per position
    ce = -torch.log_softmax(sd, -1).gather(1, y.reshape(-1)[keep, None]).mean()
    want = alpha * T * T * kl + (1 - alpha) * ce
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    got.backward()
    assert s.grad is not None and torch.isfinite(s.grad).all()


def test_distillation_teacher_gets_no_gradient_and_errors():
    s = torch.randn(4, 5, requires_grad=True)
    t = torch.randn(4, 5, requires_grad=True)
    distillation_loss(s, t, torch.randint(0, 5, (4,)), temperature=2.0, alpha=0.5).backward()
    assert t.grad is None
    with pytest.raises(ValueError, match="temperature"):
        distillation_loss(s, t, torch.zeros(4, dtype=torch.long), temperature=0.0, alpha=0.5)
    with pytest.raises(ValueError, match="alpha"):
        distillation_loss(s, t, torch.zeros(4, dtype=torch.long), temperature=1.0, alpha=1.5)
    with pytest.raises(ValueError, match="teacher_logits"):
        distillation_loss(s, t[:, :3], torch.zeros(4, dtype=torch.long), temperature=1.0, alpha=0.5)
