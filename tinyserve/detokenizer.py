"""From sampled tokens to text, a step at a time, and where a stop string cuts it.

Decoding a sequence's whole output every step costs time quadratic in its length, and text
decoded from a token that ends in the middle of a character (a Japanese character or an emoji
is 3-4 UTF-8 bytes, often split over several byte-level tokens) ends in U+FFFD, the
replacement character. ``detokenize_incrementally`` decodes only a short window of tokens and
holds back text until its last character is complete, so the pieces it returns never need to
be taken back: appended together they are the sequence's text.
"""

from __future__ import annotations

from tinyserve.sequence import Sequence

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character
# A UTF-8 character has at most 4 bytes and every token carries at least one, so a character that
# is still incomplete began in one of the last 3 tokens. Tokens held back longer than this can
# never complete one: they are invalid bytes, and are emitted as U+FFFD rather than decoded again
# every step (which would cost time quadratic in the length of such an output).
MAX_PENDING_TOKENS = 8
MAX_CHAR_TOKENS = 3
# How many prompt tokens the first window starts on (v0.4's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
INITIAL_CONTEXT_TOKENS = 5


def detokenize_incrementally(tokenizer, seq: Sequence, skip_special_tokens: bool = True) -> str:
    """Append the text of ``seq``'s new output tokens to ``seq.output_text``; return that new text.

    Two offsets into the output tokens carry the state (as in vLLM's ``detokenize_incrementally``):
    tokens before ``read_offset`` have been turned into text, and the few from ``prefix_offset``
    on are decoded again as context, because some tokenizers decode a token differently at the
    start of a text (SentencePiece drops its leading space). The new text is the decode of
    ``[prefix_offset:]`` minus the decode of ``[prefix_offset:read_offset]``. If it ends in
    U+FFFD, a character is still incomplete: nothing is emitted and the offsets stay, so the
    next token is decoded together with the bytes it completes. Bytes that stay incomplete for
    more than ``MAX_PENDING_TOKENS`` tokens are not a character: they are emitted as U+FFFD; tokens
    that decode to nothing (skipped special tokens) stop being decoded again after as many.

    Until the first text is out (``read_offset`` 0) the window starts on the last
    ``INITIAL_CONTEXT_TOKENS`` prompt tokens, as v0.4's starts on the prompt's
    (``convert_prompt_ids_to_tokens``): the first output token is then decoded as it reads after
    the prompt, with the leading space a SentencePiece decoder would drop at the start of a text.
    """
    ids = seq.output_token_ids
    context: list[int] = []
    if seq.read_offset == 0:  # then prefix_offset is 0 too: the window before the new tokens is the context
        context, prefix_text = _prompt_context(tokenizer, seq.prompt_token_ids, skip_special_tokens)
    else:
        prefix_text = (tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip_special_tokens)
                       if seq.read_offset > seq.prefix_offset else "")
    end = len(ids)
    stale = end - seq.read_offset > MAX_PENDING_TOKENS  # held back too long to be a character in the making
    text = tokenizer.decode(context + ids[seq.prefix_offset:end], skip_special_tokens=skip_special_tokens)
    if context and not text.startswith(prefix_text):
        # The output completes a character that the prompt began: that character belongs to
        # neither alone, so the output is decoded on its own.
        context, prefix_text = [], ""
        text = tokenizer.decode(ids[seq.prefix_offset:end], skip_special_tokens=skip_special_tokens)
    if text.endswith(REPLACEMENT_CHAR):
        if not stale:
            return ""
        # Give up on all but the tokens that could still begin a character, so that the window
        # decoded every step stays bounded.
        end -= MAX_CHAR_TOKENS
        text = tokenizer.decode(context + ids[seq.prefix_offset:end], skip_special_tokens=skip_special_tokens)
    new_text = text[len(prefix_text):] if len(text) > len(prefix_text) else ""
    if not new_text and not stale:  # nothing yet (a skipped special token, say): decode it again later
        return ""
    seq.prefix_offset, seq.read_offset = seq.read_offset, end
    seq.output_text += new_text
    return new_text


def _prompt_context(tokenizer, prompt: list[int], skip_special_tokens: bool) -> tuple[list[int], str]:
    """The last ``INITIAL_CONTEXT_TOKENS`` prompt tokens and their text, or up to
    ``MAX_CHAR_TOKENS`` more: a window that begins inside a character decodes to U+FFFD there,
    and a byte-fallback decoder (SentencePiece's <0xXX> tokens) then writes U+FFFD for the whole
    run of bytes, characters that the output would extend included. Empty if no start works."""
    first = len(prompt) - INITIAL_CONTEXT_TOKENS
    for start in range(first, first - MAX_CHAR_TOKENS - 1, -1):
        tail = prompt[max(start, 0):]
        text = tokenizer.decode(tail, skip_special_tokens=skip_special_tokens)
        if start <= 0 or not text.startswith(REPLACEMENT_CHAR):
            return tail, text
    return [], ""


def find_stop_string(text: str, num_new_chars: int, stop: list[str]) -> int:
    """Where the earliest stop string in ``text`` begins, or -1 if there is none.

    Only the last ``num_new_chars`` characters are new; a stop string that is there must end in
    them, so the search starts ``len(longest stop) - 1`` characters before them and not at 0.
    Several stop strings may complete in one step: the one that starts first wins, whatever
    the order of the list, because the text after it was never meant to be produced.
    """
    if not stop or num_new_chars <= 0:
        return -1
    start = max(0, len(text) - num_new_chars - (max(map(len, stop)) - 1))
    found = [i for i in (text.find(s, start) for s in stop) if i != -1]
    return min(found, default=-1)
