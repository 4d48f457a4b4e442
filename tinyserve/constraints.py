"""Constraints on the next token: logit_bias, allowed_token_ids, bad_words and guided decoding.

These are the logits processors of vLLM's later versions, on the rows that ask for them, before
the penalties and temperature: a bias is added, and a token outside ``allowed_token_ids``, one
that would complete a bad word, or one that would leave the request's grammar, becomes -inf.

``RequestConstraints`` is the engine's bookkeeping: when a request arrives it checks its token ids,
spells its bad words in tokens and compiles its grammar (so a bad one is refused there, by name);
at each step it hands the sampler what a row needs; when the request is done it forgets it.
``apply_constraints`` is the sampler's half.
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field

import torch

from tinyserve.grammar import GrammarCompiler, GrammarState, allocate_bitmask, apply_bitmask
from tinyserve.sampling_params import SamplingParams
from tinyserve.sequence import check_token_ids

# Every message of a request failed by its own constraints says this (the server answers it as
# the client's error, a 400, rather than the server's).
UNSATISFIABLE = "the request's constraints"


@dataclass
class RowConstraints:
    """What the sampler needs to constrain one row: the request's parameters hold the bias and
    the allowed ids; the bad words come as token ids; the grammar as the sequence's matcher."""

    bad_words: list[list[int]] = field(default_factory=list)
    grammar: GrammarState | None = None
    error: str | None = None  # the grammar refused a token already in the output (the row fails)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word as the tokenizer spells it alone and after a space (vLLM's rule: the spaced
    spelling counts when it differs in its first token and has as many tokens)."""
    spelled: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        spelled.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            spelled.append(spaced)
    return spelled


def banned_by_bad_words(bad_words: list[list[int]], output_token_ids: Tokens[int]) -> list[int]:
    """The tokens that would complete a bad word now: a one-token word always, a longer one's last
    token when the output ends with the rest of it."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or list(output_token_ids[len(output_token_ids) - len(prefix):]) == prefix:
            banned.append(word[-1])
    return banned


class RequestConstraints:
    """The engine's record of what each constrained request needs, by request id and sequence id."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.grammars = GrammarCompiler(tokenizer, vocab_size, eos_token_id)
        self._bad_words: dict[str, list[list[int]]] = {}
        self._states: dict[int, GrammarState] = {}  # by sequence id

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Check a new request's constraints against the model: a ValueError names what is wrong."""
        if params.logit_bias is not None:
            check_token_ids("logit_bias's token ids", list(params.logit_bias), self.vocab_size)
        if params.allowed_token_ids is not None:
            check_token_ids("allowed_token_ids", params.allowed_token_ids, self.vocab_size)
        if params.guided_decoding is not None:
            self.grammars.compile(params.guided_decoding)
        if params.bad_words:
            self._bad_words[request_id] = bad_words_token_ids(self.tokenizer, params.bad_words)

    def row(self, request_id: str, seq_id: int, params: SamplingParams,
            output_token_ids: Tokens[int]) -> RowConstraints:
        """What the sampler needs for this sequence now; its matcher has consumed every output token."""
        grammar, error = None, None
        if params.guided_decoding is not None:
            grammar = self._states.get(seq_id)
            if grammar is None:
                grammar = self._states[seq_id] = self.grammars.matcher(params.guided_decoding)
            try:
                grammar.sync(output_token_ids)
            except ValueError as e:
                grammar, error = None, f"{UNSATISFIABLE} failed: guided decoding: {e}"
        return RowConstraints(self._bad_words.get(request_id, []), grammar, error)

    def forget(self, request_id: str, seq_ids: list[int]) -> None:
        self._bad_words.pop(request_id, None)
        for seq_id in seq_ids:
            self._states.pop(seq_id, None)


def apply_constraints(logits: torch.Tensor, params: list[SamplingParams], rows: list[RowConstraints | None],
                      output_token_ids: list[Tokens[int]]) -> None:
    """Bias and mask, in place, the rows that ask (``rows[i]`` is None for a row with none)."""
    for i, (p, row) in enumerate(zip(params, rows)):
        if row is None:
            continue
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if p.allowed_token_ids is not None:
            keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            keep[p.allowed_token_ids] = True
            logits[i].masked_fill_(~keep, float("-inf"))
        banned = banned_by_bad_words(row.bad_words, output_token_ids[i])
        if banned:
            logits[i, banned] = float("-inf")
    guided = [i for i, row in enumerate(rows) if row is not None and row.grammar is not None]
    if guided:
        bitmask = allocate_bitmask(len(guided), logits.shape[-1])
        for k, i in enumerate(guided):
            rows[i].grammar.fill_bitmask(bitmask, k)
            if rows[i].grammar.error:  # a parser limit hit while computing the mask: the row fails, named
                rows[i].error = f"{UNSATISFIABLE} failed: guided decoding: {rows[i].grammar.error}"
        for k, i in enumerate(guided):
            apply_bitmask(logits[i:i + 1], bitmask[k:k + 1])
