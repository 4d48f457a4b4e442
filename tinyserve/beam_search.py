"""Beam search as vLLM v0.4 runs it: the candidates of a step, and which beams go on.

A beam search of width W is one ``SequenceGroup``: its running sequences are the beams. Each step
(chapter 14):

1. **Candidates** (v0.4's ``model_executor/layers/sampler.py: _beam_search_sample``): over every
   beam and every token, the 2W continuations with the highest cumulative log-probability (the
   beam's so far plus the token's). At the prompt there is one parent, and its 2W likeliest tokens.
   Twice the width, so that W remain even if some of them finish.
2. **Children**: a parent with k candidates continues with the last of them and forks k - 1
   children for the others; a parent with none drops out (its blocks are freed).
3. **Selection** (``LLMEngine._process_sequence_group_outputs``): the finished ones (old and new)
   are ranked by beam score, the best W kept; the running ones too, and the best W of those go on,
   unless the search stops (``should_stop``); the others are dropped.

The score is v0.4's (``Sequence.get_beam_search_score``): the cumulative log-probability over the
sequence's length, prompt included and a final EOS not counted, to the power ``length_penalty``.
This module decides; the engine (``LLMEngine.beam_step``) forks, frees and finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyserve.sequence import Sequence


def beam_score(seq: Sequence, length_penalty: float, eos_token_id: int | None, seq_len: int | None = None) -> float:
    """v0.4's ``get_beam_search_score``: cumulative logprob / length ** length_penalty."""
    if seq_len is None:
        seq_len = seq.get_len()
        if eos_token_id is not None and seq.get_output_len() and seq.get_last_token_id() == eos_token_id:
            seq_len -= 1  # as transformers' beam hypotheses, which never hold the EOS
    return seq.cumulative_logprob / (seq_len ** length_penalty)


@dataclass(frozen=True)
class Candidate:
    """One continuation: the parent's position among the beams, the token and its logprob."""

    parent: int
    token: int
    logprob: float


def candidates(cumulative: list[float], tokens: list[list[int]], logprobs: list[list[float]],
               width: int) -> list[Candidate]:
    """The 2 × ``width`` best continuations over all beams, best first (v0.4's
    ``_beam_search_sample``). Beam i proposes ``tokens[i]`` with their ``logprobs[i]``: its own
    2W likeliest are enough, since no token outside them can be among the best 2W overall."""
    pool = [Candidate(i, t, lp) for i, (ts, lps) in enumerate(zip(tokens, logprobs)) for t, lp in zip(ts, lps)]
    pool.sort(key=lambda c: cumulative[c.parent] + c.logprob, reverse=True)
    return pool[:2 * width]


@dataclass
class Selection:
    """What a step of beam search decides: the children that go on or are kept finished, the
    ones dropped, the old finished ones pushed out of the best W, and whether the search ends."""

    keep: list[Sequence]
    drop: list[Sequence]
    drop_finished: list[Sequence]
    stop: bool


def select(children: list[Sequence], finished: list[Sequence], width: int, length_penalty: float,
           early_stopping: bool | str, eos_token_id: int | None, max_len: int) -> Selection:
    """Which of this step's ``children`` (each a beam with its new token, finished or not) and of
    the ``finished`` kept so far survive. ``max_len``: the longest a beam can grow (for
    ``early_stopping="never"``)."""
    def score(seq: Sequence) -> float:
        return beam_score(seq, length_penalty, eos_token_id)

    new_finished = [s for s in children if s.is_finished()]
    ranked = sorted([(s, False) for s in finished] + [(s, True) for s in new_finished],
                    key=lambda x: score(x[0]), reverse=True)
    keep = [s for s, new in ranked[:width] if new]
    drop = [s for s, new in ranked[width:] if new]
    drop_finished = [s for s, new in ranked[width:] if not new]
    running = sorted((s for s in children if not s.is_finished()), key=score, reverse=True)
    if not running:
        stop = True
    elif len(ranked) < width:
        stop = False
    else:
        stop = should_stop(early_stopping, length_penalty, running[0], ranked[width - 1][0], eos_token_id, max_len)
    if stop:
        drop += running
    else:
        keep += running[:width]
        drop += running[width:]
    return Selection(keep, drop, drop_finished, stop)


def should_stop(early_stopping: bool | str, length_penalty: float, best_running: Sequence, worst_finished: Sequence,
                eos_token_id: int | None, max_len: int) -> bool:
    """v0.4's ``_check_beam_search_early_stopping``: ``True`` stops as soon as W beams are
    finished; ``False`` when the best running beam, scored as it is now, cannot beat the worst
    kept; ``"never"`` when it could not even at its best possible length (the longest, when a
    positive ``length_penalty`` favours length)."""
    if early_stopping is True:
        return True
    worst = beam_score(worst_finished, length_penalty, eos_token_id)
    if early_stopping == "never" and length_penalty > 0.0:
        best = beam_score(best_running, length_penalty, eos_token_id, seq_len=max_len)
    else:
        best = beam_score(best_running, length_penalty, eos_token_id)
    return worst >= best
