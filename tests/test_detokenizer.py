"""Incremental detokenization against the tokenizer's own full decode, and stop strings.

The reference is ``tokenizer.decode`` of all the output ids at once, as they read after the
prompt: ``decode(prompt + output)[len(decode(prompt)):]``. Fed one token at a time, the
detokenizer's pieces must concatenate to that text whenever it ends on a complete character,
never contain a U+FFFD for a character that is merely incomplete, and never be taken back.
"""

from __future__ import annotations

import random

import pytest
from conftest import make_tiny_tokenizer

from tinyserve.detokenizer import (
    INITIAL_CONTEXT_TOKENS,
    MAX_PENDING_TOKENS,
    REPLACEMENT_CHAR,
    detokenize_incrementally,
    find_stop_string,
)
from tinyserve.sequence import Sequence

MULTILINGUAL = ["日本の首都は東京です。富士山は美しい。", "I ❤️ paging 🚀🔥 and KV caches 👩‍💻!",
                "naïve café — déjà vu, 你好世界, Привет"]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def default_tokenizer():
    from transformers import AutoTokenizer

    from tinyserve.models.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m")), local_files_only=True)


def stream(tokenizer, ids: list[int], prompt: list[int] = (1,)) -> list[str]:
    """Feed ``ids`` one at a time after ``prompt`` (by default one special token, which decodes to
    nothing), as the engine does; return the piece each step emitted."""
    seq = Sequence(0, None, list(prompt), block_size=16)
    pieces = []
    for t in ids:
        seq.append_token_id(t)
        pieces.append(detokenize_incrementally(tokenizer, seq))
    assert seq.output_text == "".join(pieces)
    return pieces


def after_prompt(tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The text of ``ids`` as it reads after ``prompt``: what a one-shot decode of both shows."""
    before = tokenizer.decode(prompt, skip_special_tokens=True)
    full = tokenizer.decode(list(prompt) + ids, skip_special_tokens=True)
    assert full.startswith(before)
    return full[len(before):]


def check_against_full_decode(tokenizer, ids: list[int], prompt: list[int] = (1,)) -> None:
    pieces = stream(tokenizer, ids, prompt)
    text = "".join(pieces)
    full = after_prompt(tokenizer, prompt, ids)
    if not full.endswith(REPLACEMENT_CHAR):
        assert text == full
    else:  # the last character is incomplete (or the bytes are not UTF-8): it is held back
        assert full.startswith(text)
    # Nothing emitted is ever taken back: each prefix of the stream is a prefix of every later
    # full decode, in particular of the decode of the whole.
    for k in range(1, len(ids) + 1):
        so_far = "".join(pieces[:k])
        assert full.startswith(so_far), (k, so_far, full)


def test_random_token_sequences_match_a_full_decode(tiny_tokenizer):
    rng = random.Random(0)
    vocab = len(tiny_tokenizer)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        check_against_full_decode(tiny_tokenizer, ids)


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_multibyte_characters_split_over_byte_tokens(tiny_tokenizer, text):
    # The tiny tokenizer was trained on English only: every non-ASCII character is split into
    # byte tokens, so most steps end in the middle of a character.
    ids = tiny_tokenizer.encode(text)
    assert len(ids) > len(text) / 2
    pieces = stream(tiny_tokenizer, ids)
    assert "".join(pieces) == text == tiny_tokenizer.decode(ids)
    assert not any(REPLACEMENT_CHAR in p for p in pieces)
    # Cut off after every token: what was emitted is the text up to the last complete character.
    for k in range(1, len(ids) + 1):
        emitted = "".join(stream(tiny_tokenizer, ids[:k]))
        assert text.startswith(emitted) and REPLACEMENT_CHAR not in emitted


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_the_default_models_tokenizer_on_japanese_and_emoji(default_tokenizer, text):
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(default_tokenizer, ids)
    assert "".join(pieces) == text
    assert not any(REPLACEMENT_CHAR in p for p in pieces)
    for k in range(1, len(ids) + 1):  # a completion cut off mid-character ends without U+FFFD
        emitted = "".join(stream(default_tokenizer, ids[:k]))
        assert text.startswith(emitted) and REPLACEMENT_CHAR not in emitted


def test_the_default_models_tokenizer_on_random_sequences(default_tokenizer):
    rng = random.Random(1)
    for _ in range(50):
        check_against_full_decode(default_tokenizer, [rng.randrange(len(default_tokenizer)) for _ in range(30)])


def test_each_step_decodes_a_short_window_not_the_whole_output(tiny_tokenizer):
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens=False):
            calls.append(len(ids))
            return tiny_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tiny_tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)
    assert "".join(stream(Counting(), ids)) == tiny_tokenizer.decode(ids)
    assert max(calls) <= 4  # a window of a few tokens, however long the output grows


# -- the first tokens, read after the prompt (v0.4's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET) --

def make_sentencepiece_style_tokenizer():
    """A Llama-2-style tokenizer trained on two sentences: "▁" marks a word's leading space, the
    decoder strips the space at the start of a text (so a lone "▁Paris" decodes to "Paris"), and
    characters it never saw fall back to byte tokens <0xXX>."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    words = Tokenizer(models.BPE(unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    words.train_from_iterator(["The capital of France is Paris.", "Hello world, hello there."] * 4,
                              trainer=trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    trained = json.loads(words.to_str())["model"]
    vocab = dict(trained["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = words.pre_tokenizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def sp_tokenizer():
    return make_sentencepiece_style_tokenizer()


def split(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """BOS and the prompt's ids, and the ids the completion adds to them."""
    prompt_ids = [tokenizer.bos_token_id] + tokenizer.encode(prompt, add_special_tokens=False)
    all_ids = [tokenizer.bos_token_id] + tokenizer.encode(prompt + completion, add_special_tokens=False)
    assert all_ids[:len(prompt_ids)] == prompt_ids
    return prompt_ids, all_ids[len(prompt_ids):]


@pytest.mark.parametrize("prompt, completion", [("The capital of France is", " Paris. Hello world"),
                                                ("Hello", " 🚀 there, 日本"), ("日本", "語 is Paris")])
def test_the_first_token_keeps_the_space_it_has_after_the_prompt(sp_tokenizer, prompt, completion):
    prompt_ids, ids = split(sp_tokenizer, prompt, completion)
    assert completion.startswith(" ") == sp_tokenizer.convert_ids_to_tokens(ids[:1])[0].startswith("▁")
    # The case this is about: decoded on its own, the completion loses its leading space.
    assert sp_tokenizer.decode(ids) == completion.lstrip(" ")
    pieces = stream(sp_tokenizer, ids, prompt_ids)
    assert "".join(pieces) == completion == after_prompt(sp_tokenizer, prompt_ids, ids)
    for k in range(1, len(ids) + 1):  # and nothing is taken back on the way
        assert completion.startswith("".join(stream(sp_tokenizer, ids[:k], prompt_ids)))


def test_random_outputs_after_a_prompt_read_as_a_full_decode(sp_tokenizer, tiny_tokenizer):
    rng = random.Random(2)
    texts = ["The capital of France is", "Hello world, hello", "日本の首都は", "x", "🚀"]
    # A byte-fallback decoder turns a whole run of byte tokens into U+FFFDs once one byte in it is
    # invalid, even bytes that had made characters: random byte tokens are no test of the window
    # there, so the SentencePiece-style outputs draw from its other tokens.
    sp_words = [i for t, i in sp_tokenizer.get_vocab().items() if not t.startswith("<0x")]
    for tokenizer, vocab in ((sp_tokenizer, sp_words), (tiny_tokenizer, range(len(tiny_tokenizer)))):
        for _ in range(150):
            prompt_ids = [tokenizer.bos_token_id] + tokenizer.encode(rng.choice(texts), add_special_tokens=False)
            ids = [rng.choice(vocab) for _ in range(rng.randint(1, 30))]
            check_against_full_decode(tokenizer, ids, prompt_ids)


def test_only_the_first_window_reaches_into_the_prompt(sp_tokenizer):
    calls: list[int] = []
    prompt_ids, ids = split(sp_tokenizer, "The capital of France is the capital of France", " Paris. " * 30)
    assert len(prompt_ids) > INITIAL_CONTEXT_TOKENS
    assert "".join(stream(counting(sp_tokenizer, calls), ids, prompt_ids)) == " Paris. " * 30
    assert max(calls) <= INITIAL_CONTEXT_TOKENS + 1  # the prompt's last tokens and the first output token
    assert max(calls[2:]) <= 4  # then a few output tokens, however long the prompt and the output


def test_an_output_that_completes_a_character_of_the_prompt_stands_alone(tiny_tokenizer):
    """The prompt's last bytes begin a character that the output completes: that character belongs
    to neither alone, so the output is decoded on its own, as before there was a context."""
    ids = tiny_tokenizer.encode("日本 ok")
    assert tiny_tokenizer.decode(ids[:1]).endswith(REPLACEMENT_CHAR)
    assert "".join(stream(tiny_tokenizer, ids[1:], [1] + ids[:1])) == tiny_tokenizer.decode(ids[1:])


def test_byte_level_text_does_not_depend_on_the_prompt(default_tokenizer):
    """The default model's tokenizer decodes byte-level BPE: a token's text is the same after any
    prompt, so the context changes nothing there (the engine's outputs stay as they were)."""
    rng = random.Random(3)
    prompt_ids = default_tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                       add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    for _ in range(30):
        ids = [rng.randrange(len(default_tokenizer)) for _ in range(20)]
        alone = "".join(stream(default_tokenizer, ids))
        assert "".join(stream(default_tokenizer, ids, prompt_ids)) == alone
        check_against_full_decode(default_tokenizer, ids, prompt_ids)


# -- stop strings -------------------------------------------------------------------------------

def test_the_earliest_stop_string_in_the_text_wins_whatever_the_list_order():
    text = " Paris.\n\nThe"  # "\nT" and "he" complete in the same step
    assert find_stop_string(text, 3, ["he", "\nT"]) == text.index("\nT")
    assert find_stop_string(text, 3, ["\nT", "he"]) == text.index("\nT")
    assert find_stop_string(text, 3, ["zz"]) == -1


def test_only_the_new_text_and_an_overlap_are_searched():
    text = "abc stop here, and stop again"
    new = len(" again")
    # "stop" ends before the last len("stop") - 1 + new characters: it was seen in an earlier step.
    assert find_stop_string(text, new, ["stop"]) == -1
    # A stop string that straddles the old text and the new one is found.
    assert find_stop_string(text, new, ["p again"]) == text.index("p again")
    assert find_stop_string(text, new, ["stop a"]) == text.index("stop a")
    assert find_stop_string(text, 0, ["again"]) == -1  # nothing new, nothing to find


# -- outputs that never complete a character (issue 21: quadratic detokenizing) -----------------

def counting(tokenizer, calls: list[int]):
    """The tokenizer, counting the ids each decode call is given."""
    class Counting:
        def decode(self, ids, skip_special_tokens=False):
            calls.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return Counting()


def test_bytes_that_never_complete_a_character_cost_linear_time(tiny_tokenizer):
    """A lone continuation byte, 2,000 times: no character ever completes. Each step once decoded
    every token since the last complete character (8,000 such tokens took 10 s)."""
    byte = next(i for i in range(len(tiny_tokenizer)) if tiny_tokenizer.decode([i, i]) == REPLACEMENT_CHAR * 2)
    calls: list[int] = []
    pieces = stream(counting(tiny_tokenizer, calls), [byte] * 2000)
    assert max(calls) <= 2 * MAX_PENDING_TOKENS + 2  # the window stays short
    text = "".join(pieces)
    assert set(text) == {REPLACEMENT_CHAR} and len(text) >= 2000 - MAX_PENDING_TOKENS  # emitted as it goes
    # Bytes that do complete characters still come out whole, right after such garbage.
    calls.clear()
    pieces = stream(tiny_tokenizer, [byte] * 30 + tiny_tokenizer.encode("日本 ok"))
    assert "".join(pieces).endswith("日本 ok") and not "".join(pieces).strip(REPLACEMENT_CHAR).count(REPLACEMENT_CHAR)


def test_tokens_that_decode_to_nothing_stop_being_decoded_again(tiny_tokenizer):
    """Special tokens skipped in the text (an EOS, repeated under ignore_eos) emit nothing; they
    must not stay in the window for ever either."""
    calls: list[int] = []
    ids = [tiny_tokenizer.eos_token_id] * 2000 + tiny_tokenizer.encode(" the end")
    pieces = stream(counting(tiny_tokenizer, calls), ids)
    assert max(calls) <= 2 * MAX_PENDING_TOKENS + 2
    assert "".join(pieces) == tiny_tokenizer.decode(ids, skip_special_tokens=True)
