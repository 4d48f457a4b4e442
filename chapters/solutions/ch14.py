"""Solution to chapter 14's exercise: the beam step's selection, which of a step's candidates go on,
which finished beams are kept, which are dropped, and whether the search stops."""

from tinyserve.beam_search import Selection, beam_score, should_stop


def beam_select(children, finished, width, length_penalty, early_stopping, eos_token_id, max_len):
    def score(seq):
        return beam_score(seq, length_penalty, eos_token_id)

    # Rule 1: the finished ones, new and old, ranked together; the best W stay.
    new_finished = [s for s in children if s.is_finished()]
    ranked = sorted(finished + new_finished, key=score, reverse=True)
    best, rest = ranked[:width], ranked[width:]
    keep = [s for s in best if s in new_finished]
    drop = [s for s in rest if s in new_finished]
    drop_finished = [s for s in rest if s in finished]
    running = sorted((s for s in children if not s.is_finished()), key=score, reverse=True)
    if not running:  # rule 2
        stop = True
    elif len(best) < width:  # rule 3
        stop = False
    else:  # rule 4: can the best running beam still beat the worst kept one?
        stop = should_stop(early_stopping, length_penalty, running[0], best[-1], eos_token_id, max_len)
    # Rule 5: the best W running ones go on, unless the search stops.
    if stop:
        drop += running
    else:
        keep += running[:width]
        drop += running[width:]
    return Selection(keep, drop, drop_finished, stop)
