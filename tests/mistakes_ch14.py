"""Deliberately wrong answers for chapter 14's exercise, the beam step's selection
(``check_beam_select``).

Each is the chapter's solution (``beam_select``) with one plausible slip, switched on by a flag;
tests/exercise_mistakes.py merges ``MISTAKES`` with the other chapters'.
"""

from __future__ import annotations

import functools

from tinyserve.beam_search import Selection, beam_score, should_stop


def _select(children, finished, width, length_penalty, early_stopping, eos_token_id, max_len, *,
            by_logprob=False, forget_old=False, no_cap=False, stop_below_width=False, never_early=False,
            keep_on_stop=False, keep_twice=False, best_finished=False, no_eos_rule=False):
    def score(seq):
        if by_logprob:  # ranks by the cumulative log-probability: the length penalty is ignored
            return seq.cumulative_logprob
        if no_eos_rule:  # counts the final EOS in the length
            return seq.cumulative_logprob / (seq.get_len() ** length_penalty)
        return beam_score(seq, length_penalty, eos_token_id)

    new_finished = [s for s in children if s.is_finished()]
    pool = new_finished if forget_old else finished + new_finished  # forget_old: the earlier ones never compete
    ranked = sorted(pool, key=score, reverse=True)
    best, rest = (ranked, []) if no_cap else (ranked[:width], ranked[width:])
    keep = [s for s in best if s in new_finished]
    drop = [s for s in rest if s in new_finished]
    drop_finished = [s for s in rest if s in finished]
    running = sorted((s for s in children if not s.is_finished()), key=score, reverse=True)
    if not running:
        stop = True
    elif len(best) < width and not stop_below_width:
        stop = False
    elif never_early:  # only an empty beam stops the search
        stop = False
    else:
        worst = best[0] if best_finished else best[-1]  # best_finished: compares with the best kept one
        stop = should_stop(early_stopping, length_penalty, running[0], worst, eos_token_id, max_len)
    if stop and not keep_on_stop:
        drop += running
    else:
        n = 2 * width if keep_twice else width  # keep_twice: all 2W candidates go on
        keep += running[:n]
        drop += running[n:]
    return Selection(keep, drop, drop_finished, stop)


MISTAKES = {
    "check_beam_select": [functools.partial(_select, **{flag: True}) for flag in (
        "by_logprob", "forget_old", "no_cap", "stop_below_width", "never_early", "keep_on_stop", "keep_twice",
        "best_finished", "no_eos_rule")] + [
        lambda *args: 1 / 0,  # crashes: every case fails, and the checker still answers
    ],
}
