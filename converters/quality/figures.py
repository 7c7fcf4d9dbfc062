"""The end-to-end quality figures of an FP8 model against its source, and their accumulation over tokens."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from converters.errors import Fp8ForgeError

__all__ = ["QualityFigures", "QualityUnavailable", "ReferenceLogits", "TokenScores", "QUALITY_DEFINITION"]


class QualityUnavailable(Fp8ForgeError):
    """The model cannot be scored on next-token prediction (no output head, no tokenizer, not layer-sequential),
    or the texts give nothing to score. A job reports it (quality not measured, and why) and goes on."""

    code = "quality_unavailable"


QUALITY_DEFINITION = ("next-token distributions of the source (reference) and the FP8 model on the same held-out "
                      "tokens; perplexity: exp(mean negative log-likelihood of the next token); kl_mean / kl_max: "
                      "mean and largest per-token KL(reference || fp8) in nats; top1_agreement: share of positions "
                      "whose most likely next token is the same in both")


@dataclass(frozen=True, kw_only=True)
class QualityFigures:
    """How much worse the FP8 model predicts the next token than its source, on ``tokens`` held-out positions."""

    perplexity_reference: float
    perplexity: float
    kl_mean: float  #: nats, per token, KL(reference || fp8)
    kl_max: float
    top1_agreement: float  #: 0..1
    tokens: int  #: positions scored (each predicts the token after it)
    texts: int
    held_out: str  #: "request" (the user's quality_texts) or "built-in held-out part"

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {self.tokens}")
        if not 0.0 <= self.top1_agreement <= 1.0:
            raise ValueError(f"top1_agreement must lie in [0, 1], got {self.top1_agreement}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ReferenceLogits:
    """The reference's ``[positions, vocab]`` logits with what every variant scored against them needs, computed
    once for all of them: log-probabilities, probabilities and the most likely token."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits
        self.log_p = torch.log_softmax(logits.float(), dim=-1)
        self.p = self.log_p.exp()
        self.top1 = logits.argmax(dim=-1)


class TokenScores:
    """Sums over scored positions of one FP8 variant against the reference (float64, CPU)."""

    def __init__(self) -> None:
        self.nll_reference = 0.0
        self.nll = 0.0
        self.kl_sum = 0.0
        self.kl_max = 0.0
        self.agree = 0
        self.tokens = 0

    def add(self, reference: torch.Tensor | ReferenceLogits, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Score ``[positions, vocab]`` logits of both models against the next tokens ``targets`` (``[positions]``);
        ``reference``: the reference's logits, or a :class:`ReferenceLogits` shared by the variants."""
        if not isinstance(reference, ReferenceLogits):
            reference = ReferenceLogits(reference)
        picked = targets.unsqueeze(1)
        top1 = logits.argmax(dim=-1)
        log_q = torch.log_softmax(logits.float(), dim=-1)
        self.nll_reference -= float(reference.log_p.gather(1, picked).double().sum())
        self.nll -= float(log_q.gather(1, picked).double().sum())
        # KL(p || q) = sum p (log p - log q), computed in log_q's memory (a [positions, vocab] tensor less at once);
        # clamp: a rounding may give -1e-9 for identical rows
        kl = log_q.neg_().add_(reference.log_p).mul_(reference.p).sum(dim=-1).clamp(min=0.0)
        self.kl_sum += float(kl.double().sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        self.agree += int((reference.top1 == top1).sum())
        self.tokens += int(targets.numel())

    def figures(self, *, texts: int, held_out: str) -> QualityFigures:
        n = self.tokens
        return QualityFigures(perplexity_reference=math.exp(self.nll_reference / n), perplexity=math.exp(self.nll / n),
                              kl_mean=self.kl_sum / n, kl_max=self.kl_max, top1_agreement=self.agree / n, tokens=n,
                              texts=texts, held_out=held_out)
