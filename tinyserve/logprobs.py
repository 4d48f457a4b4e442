"""Log-probabilities of tokens under the model: for the sampled tokens and for a prompt's.

A request can ask for ``logprobs=k`` (each output token's log-probability and the k likeliest
tokens at that step) and ``prompt_logprobs=k`` (the same for every prompt token after the
first, which no position predicts). Either way a position reports a ``{token_id: logprob}``
dict: the top k plus the token that is actually there, so up to k + 1 entries.

They are the model's own log-probabilities: ``log_softmax`` of the logits as the model made
them, before penalties, temperature or truncation. (vLLM v0.4 reports those of the distribution
after its sampler's adjustments; chapter 9 compares the two.) Every sampled token's
log-probability is computed, whatever the request asks, because ``best_of`` ranks samples by
their sum; that costs one ``logsumexp`` per row, little next to the LM head that made the row.
"""

from __future__ import annotations

import torch

from tinyserve.sampler import SampleRequest

# Prompt positions turned into log-probabilities at once: a long prompt's rows are done in
# slices, so the extra memory is one slice's log_softmax, not the whole prompt's.
PROMPT_ROWS_PER_SLICE = 256


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> list[float]:
    """The log-probability of ``tokens[i]`` at row ``rows[i]`` of ``logits``."""
    if not rows:
        return []
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    picked = logits[index, torch.tensor(tokens, dtype=torch.long, device=logits.device)]
    # logsumexp over the logits as they lie, then picked per row: gathering the rows first
    # would copy every logit of the batch each step (the rows are nearly always all of them).
    return (picked - logits.logsumexp(dim=-1)[index]).tolist()


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Each row's k highest log-probabilities and their token ids (empty lists when k is 0)."""
    if k == 0:
        return [[] for _ in range(logits.shape[0])], [[] for _ in range(logits.shape[0])]
    values, ids = logits.log_softmax(dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
    return values.tolist(), ids.tolist()


def logprob_dict(token: int, logprob: float, top_values: list[float], top_ids: list[int]) -> dict[int, float]:
    """``{token_id: logprob}``: the top entries, and the chosen token whether or not among them."""
    entry = dict(zip(top_ids, top_values))
    entry.setdefault(token, logprob)
    return entry


def prompt_logprob_dicts(logits: torch.Tensor, next_tokens: list[int], k: int) -> list[dict[int, float]]:
    """For rows of prompt positions, the dict of the token that follows each (``next_tokens``)."""
    dicts = []
    for start in range(0, logits.shape[0], PROMPT_ROWS_PER_SLICE):
        piece = logits[start:start + PROMPT_ROWS_PER_SLICE].log_softmax(dim=-1)
        tokens = next_tokens[start:start + PROMPT_ROWS_PER_SLICE]
        chosen = piece.gather(1, torch.tensor(tokens, dtype=torch.long, device=piece.device).unsqueeze(1))
        values, ids = piece.topk(k, dim=-1) if k else (piece[:, :0], piece[:, :0].long())
        for t, c, v, i in zip(tokens, chosen[:, 0].tolist(), values.tolist(), ids.tolist()):
            dicts.append(logprob_dict(t, c, v, i))
    return dicts


def sampled_logprobs(logits: torch.Tensor, requests: list[SampleRequest],
                     samples: list) -> list[list[tuple[float, dict[int, float] | None]] | None]:
    """Per row of ``logits``, per token the sampler drew from it (``samples``): its logprob and,
    if the row's request asks for ``logprobs=k``, its dict. None for a row whose sampling failed."""
    drawn = [(i, t) for i, tokens in enumerate(samples) if not isinstance(tokens, Exception) for t in tokens]
    values = iter(token_logprobs(logits, [i for i, _ in drawn], [t for _, t in drawn]))
    want = [i for i, r in enumerate(requests)
            if r.params.logprobs is not None and not isinstance(samples[i], Exception)]
    k = max((requests[i].params.logprobs for i in want), default=0)
    tops = dict(zip(want, zip(*top_logprobs(logits[want], k)))) if want else {}  # row -> (values, ids)
    result: list[list[tuple[float, dict[int, float] | None]] | None] = []
    for i, tokens in enumerate(samples):
        if isinstance(tokens, Exception):
            result.append(None)
            continue
        row = []
        for t in tokens:
            value = next(values)
            entry = None
            if i in tops:
                k_i = requests[i].params.logprobs
                entry = logprob_dict(t, value, tops[i][0][:k_i], tops[i][1][:k_i])
            row.append((value, entry))
        result.append(row)
    return result
