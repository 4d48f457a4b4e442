"""Turn the last position's logits into next tokens: greedy, temperature, top-k, top-p.

Rows that want the same treatment are handled as one batch (an all-greedy batch is a single
argmax). A request with a ``seed`` draws from its own generator, so its tokens do not depend on
what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.sequence import SamplingParams


@dataclass
class SampleRequest:
    """One row of logits to sample from, and how many tokens to draw (n > 1 at a prompt)."""

    params: SamplingParams
    num_samples: int = 1
    generator: torch.Generator | None = None


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) every token outside each row's top-k and top-p nucleus.

    ``top_k`` holds, per row, k (vocab size when disabled); ``top_p`` the nucleus mass. The token
    with the highest probability always survives, so a row never ends up empty.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    drop = ranks >= top_k.unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    # Mass strictly before each token: keep a token while the nucleus is not yet full.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        # Unseeded requests share one generator seeded by the engine: runs are reproducible
        # as a whole, while seeded requests are reproducible one by one.
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[list[int] | Exception]:
        """``logits``: [num_rows, vocab] float32. Returns, per row, its sampled token ids.

        A row that cannot be sampled (its probabilities are NaN or inf, say) comes back as the
        exception instead, so that only its own request fails; the other rows are unaffected.
        """
        if len(requests) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(requests)} sample requests")
        results: list[list[int] | Exception | None] = [None] * len(requests)
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        if greedy:
            # An all-greedy batch (the common case) takes the argmax in place: gathering the
            # rows first would copy every logit (50 MB at batch 256) for nothing.
            rows = logits if len(greedy) == len(requests) else logits[greedy]
            ids = rows.argmax(dim=-1).tolist()
            for i, t in zip(greedy, ids):
                results[i] = [t] * requests[i].num_samples
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if random_rows:
            probs = self._probs(logits[random_rows], [requests[i].params for i in random_rows]).cpu()
            finite = torch.isfinite(probs).all(dim=-1).tolist()
            for row, i in enumerate(random_rows):
                results[i] = self._draw(probs[row], requests[i]) if finite[row] else ValueError(
                    "the next-token probabilities are not finite (NaN or inf in the logits)")
        return results  # type: ignore[return-value]

    def _draw(self, probs: torch.Tensor, request: SampleRequest) -> list[int] | Exception:
        try:
            drawn = torch.multinomial(probs, request.num_samples, replacement=True,
                                      generator=request.generator or self.generator)
        except RuntimeError as e:  # torch's own check of the distribution
            return e
        return drawn.tolist()

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
        logits = logits / temps.unsqueeze(1)
        vocab = logits.shape[-1]
        if any(p.top_k != -1 or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([min(p.top_k, vocab) if p.top_k != -1 else vocab for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
            logits = apply_top_k_top_p(logits, top_k, top_p)
        return logits.softmax(dim=-1)
