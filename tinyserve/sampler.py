"""Turn the last position's logits into next tokens: greedy, temperature, top-k, top-p.

Rows that want the same treatment are handled as one batch (an all-greedy batch is a single
argmax). A request with a ``seed`` draws from its own generator, so its tokens do not depend on
what else shares the batch.

Before any of that, the logit adjustments, on the rows that ask for them: the constraints of
chapter 12 (``logit_bias``, ``allowed_token_ids``, ``bad_words``, a grammar: ``constraints.py``),
then vLLM v0.4's (chapter 9's sampling features): ``min_tokens`` masks EOS and the stop token ids;
the presence, frequency and repetition penalties look at the sequence's tokens; ``min_p`` drops
what is far less likely than the top token, after temperature, top-k and top-p. A row left with
no token to draw fails alone, with a message saying so.
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from dataclasses import dataclass

import torch

from tinyserve.constraints import UNSATISFIABLE, RowConstraints, apply_constraints
from tinyserve.sequence import SamplingParams


@dataclass
class SampleRequest:
    """One row of logits to sample from, and how many tokens to draw (best_of > 1 at a prompt).

    The token ids and EOS are what the penalties and ``min_tokens`` need (the engine fills them)."""

    params: SamplingParams
    num_samples: int = 1
    generator: torch.Generator | None = None
    prompt_token_ids: Tokens[int] = ()
    output_token_ids: Tokens[int] = ()
    eos_token_id: int | None = None
    constraints: RowConstraints | None = None  # the row's bad words and grammar (chapter 12)


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


def apply_penalties(logits: torch.Tensor, prompt_tokens: list[Tokens[int]], output_tokens: list[Tokens[int]],
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Penalize, in place, each row's tokens already seen, as OpenAI and vLLM v0.4 define it.

    ``repetition`` (CTRL's penalty) applies to every token of the prompt or the output: a
    positive logit is divided by it, a negative one multiplied, so a penalty above 1 always
    makes the token less likely. ``frequency`` is subtracted once per occurrence in the output,
    ``presence`` once for any occurrence; the prompt does not count for either."""
    rows, vocab = logits.shape
    counts = torch.zeros(rows, vocab, dtype=logits.dtype, device=logits.device)
    seen = torch.zeros(rows, vocab, dtype=torch.bool, device=logits.device)
    for i, (prompt, output) in enumerate(zip(prompt_tokens, output_tokens)):
        out = torch.tensor(list(output), dtype=torch.long, device=logits.device)
        counts[i].index_add_(0, out, torch.ones(len(out), dtype=logits.dtype, device=logits.device))
        seen[i, torch.tensor(list(prompt), dtype=torch.long, device=logits.device)] = True
    in_output = counts > 0
    seen |= in_output
    factor = torch.where(seen, repetition.unsqueeze(1), torch.ones_like(logits))
    logits.copy_(torch.where(logits > 0, logits / factor, logits * factor))
    logits -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * in_output
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask every token whose probability is below ``min_p`` times its row's highest."""
    probs = logits.softmax(dim=-1)
    floor = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))


def banned_until_min_tokens(request: SampleRequest) -> list[int]:
    """The tokens a row may not draw yet: EOS and the stop token ids, before ``min_tokens``
    (as in v0.4, EOS is banned even with ``ignore_eos``, where it would not stop anything)."""
    params = request.params
    if len(request.output_token_ids) >= params.min_tokens:
        return []
    eos = [] if request.eos_token_id is None else [request.eos_token_id]
    return sorted(set(params.stop_token_ids + eos))


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
        # >>> fold: validation: one row per request
        if len(requests) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(requests)} sample requests")
        # <<<
        logits = self._adjust(logits, requests)
        results: list[list[int] | Exception | None] = [None] * len(requests)
        if any(r.constraints is not None for r in requests):
            # A mask may leave nothing (a complete grammar allows only EOS, which min_tokens bans):
            # argmax would still return a token, so such a row fails here, by name.
            # (amax, not isfinite().any(): a hundred times cheaper on a CPU, and a mask makes -inf only.)
            for i in (logits.amax(dim=-1) == float("-inf")).nonzero().flatten().tolist():
                results[i] = ValueError(f"no token may be drawn: {UNSATISFIABLE} (grammar, allowed_token_ids, "
                                        "bad_words, min_tokens) exclude every token")
            for i, r in enumerate(requests):
                if r.constraints is not None and r.constraints.error:
                    results[i] = ValueError(r.constraints.error)
        for i, r in enumerate(requests):
            if r.params.use_beam_search and results[i] is None:
                # A beam proposes its likeliest tokens; the engine's beam step picks among all
                # beams' proposals (beam_search.py).
                results[i] = logits[i].topk(min(r.num_samples, logits.shape[-1])).indices.tolist()
        greedy = [i for i, r in enumerate(requests)
                  if r.params.greedy and not r.params.use_beam_search and results[i] is None]
        if greedy:
            # An all-greedy batch (the common case) takes the argmax in place: gathering the
            # rows first would copy every logit (50 MB at batch 256) for nothing.
            rows = logits if len(greedy) == len(requests) else logits[greedy]
            ids = rows.argmax(dim=-1).tolist()
            for i, t in zip(greedy, ids):
                results[i] = [t] * requests[i].num_samples
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy and results[i] is None]
        if random_rows:
            probs = self._probs(logits[random_rows], [requests[i].params for i in random_rows]).cpu()
            finite = torch.isfinite(probs).all(dim=-1).tolist()
            for row, i in enumerate(random_rows):
                results[i] = self._draw(probs[row], requests[i]) if finite[row] else ValueError(
                    "the next-token probabilities are not finite (NaN or inf in the logits)")
        return results  # type: ignore[return-value]

    @staticmethod
    def _adjust(logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
        """The constraints, ``min_tokens`` and the penalties, on a copy and only for rows that ask:
        the caller's logits stay as the model made them (the engine reads its logprobs from them)."""
        banned = [banned_until_min_tokens(r) for r in requests]
        penalized = [i for i, r in enumerate(requests) if r.params.has_penalties]
        constrained = any(r.constraints is not None for r in requests)
        if not penalized and not any(banned) and not constrained:
            return logits
        logits = logits.clone()
        if constrained:
            apply_constraints(logits, [r.params for r in requests], [r.constraints for r in requests],
                              [r.output_token_ids for r in requests])
        for i, tokens in enumerate(banned):
            if tokens:
                logits[i, tokens] = float("-inf")
        if penalized:
            params = [requests[i].params for i in penalized]

            def column(name: str) -> torch.Tensor:
                return torch.tensor([getattr(p, name) for p in params], dtype=logits.dtype, device=logits.device)

            logits[penalized] = apply_penalties(logits[penalized], [requests[i].prompt_token_ids for i in penalized],
                                                [requests[i].output_token_ids for i in penalized],
                                                column("presence_penalty"), column("frequency_penalty"),
                                                column("repetition_penalty"))
        return logits

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
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype))
        return logits.softmax(dim=-1)
