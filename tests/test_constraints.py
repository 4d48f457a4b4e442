"""The constraints on the next token (``logit_bias``, ``allowed_token_ids``, ``bad_words``, a
grammar), piece by piece, each against a reference computed here by hand: the sampler on random
logits against a masked and biased argmax and softmax written out in Python; bad words on a
hand-made vocabulary; the bit-packed mask against a bit-by-bit loop; a ``choice`` grammar's
allowed tokens against every token of the tiny tokenizer decoded and compared with what is left of
each choice. Then the checks that refuse a bad request: by ``SamplingParams`` where it is made, by
the engine where it is taken (a grammar that does not compile, a token id outside the vocabulary),
without disturbing the requests already in the engine."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.constraints import RowConstraints, bad_words_token_ids, banned_by_bad_words
from tinyserve.engine import LLMEngine
from tinyserve.grammar import GrammarCompiler, apply_bitmask, unpack_bitmask
from tinyserve.guided_params import GuidedDecodingParams
from tinyserve.models.tiny import make_tiny_tokenizer
from tinyserve.sampler import Sampler, SampleRequest
from tinyserve.sampling_params import SamplingParams
from tinyserve.worker import Worker

NEG_INF = float("-inf")


def reference_logits(row: list[float], params: SamplingParams, banned: list[int] = ()) -> list[float]:
    """One row's logits as the constraints should leave them, in plain Python: the bias added,
    every token outside ``allowed_token_ids`` or in ``banned`` at -inf."""
    out = list(row)
    for token, bias in (params.logit_bias or {}).items():
        out[token] += bias
    allowed = set(range(len(row))) if params.allowed_token_ids is None else set(params.allowed_token_ids)
    return [x if t in allowed and t not in banned else NEG_INF for t, x in enumerate(out)]


def argmax(row: list[float]) -> int:
    return max(range(len(row)), key=lambda t: row[t])


def softmax(row: list[float], temperature: float) -> list[float]:
    top = max(row)
    weights = [math.exp((x - top) / temperature) if x != NEG_INF else 0.0 for x in row]
    return [w / sum(weights) for w in weights]


def constrained(params: SamplingParams) -> SampleRequest:
    return SampleRequest(params, constraints=RowConstraints())


# -- the sampler on random logits ----------------------------------------------------------


def test_logit_bias_adds_exactly_the_bias_greedy():
    rng = random.Random(0)
    sampler = Sampler(seed=0)
    vocab, changed = 40, 0
    for _ in range(60):
        rows = [[rng.gauss(0, 3) for _ in range(vocab)] for _ in range(4)]
        params = []
        for row in rows:
            # A bias that makes a chosen token win by a small margin, one that makes the top token
            # lose, and a random one: the greedy choice moves only if the bias is added exactly.
            target, top = rng.randrange(vocab), argmax(row)
            bias = {target: min(100.0, max(row) - row[target] + rng.uniform(0.01, 0.5)),
                    rng.randrange(vocab): round(rng.uniform(-100, 100), 3)}
            if top != target:
                bias[top] = -rng.uniform(0.0, 6.0)
            params.append(SamplingParams(temperature=0, logit_bias=bias))
        logits = torch.tensor(rows, dtype=torch.float32)
        before = logits.clone()
        got = sampler(logits, [constrained(p) for p in params])
        want = [[argmax(reference_logits(row, p))] for row, p in zip(rows, params)]
        assert got == want
        changed += sum(w[0] != argmax(row) for w, row in zip(want, rows))
        assert torch.equal(logits, before)  # the caller's logits are left as the model made them
    assert changed > 100  # the biases did move the choice, so the comparison means something


def test_seeded_sampling_draws_from_the_masked_biased_distribution():
    rng = random.Random(1)
    vocab, draws, temperature = 12, 20000, 0.8
    row = [rng.gauss(0, 1.5) for _ in range(vocab)]
    params = SamplingParams(temperature=temperature, seed=3, logit_bias={0: 2.5, 3: -1.0, 7: 1.25},
                            allowed_token_ids=[0, 2, 3, 5, 7, 11])
    request = SampleRequest(params, num_samples=draws, generator=torch.Generator().manual_seed(3),
                            constraints=RowConstraints())
    [tokens] = Sampler(seed=0)(torch.tensor([row]), [request])
    want = softmax(reference_logits(row, params), temperature)
    assert set(tokens) <= set(params.allowed_token_ids)
    freq = [tokens.count(t) / draws for t in range(vocab)]
    # 20000 draws: the standard error of each frequency is at most 0.0036.
    assert max(abs(f - p) for f, p in zip(freq, want)) < 0.02, (freq, want)


def test_allowed_token_ids_greedy_and_sampled_rows_next_to_unconstrained_ones():
    rng = random.Random(2)
    vocab = 50
    for trial in range(20):
        rows = [[rng.gauss(0, 2) for _ in range(vocab)] for _ in range(4)]
        allowed = sorted(rng.sample(range(vocab), rng.randint(1, 6)))
        greedy = SamplingParams(temperature=0, allowed_token_ids=allowed)
        sampled = SamplingParams(temperature=1.3, seed=trial, allowed_token_ids=allowed)
        requests = [constrained(greedy), SampleRequest(SamplingParams(temperature=0)),
                    SampleRequest(sampled, num_samples=50, generator=torch.Generator().manual_seed(trial),
                                  constraints=RowConstraints()),
                    SampleRequest(SamplingParams(temperature=0))]
        got = Sampler(seed=trial)(torch.tensor(rows), requests)
        assert got[0] == [argmax(reference_logits(rows[0], greedy))]
        assert got[1] == [argmax(rows[1])] and got[3] == [argmax(rows[3])]  # untouched neighbours
        assert set(got[2]) <= set(allowed)


def test_bad_words_ban_the_last_token_only_after_the_rest_of_the_word():
    vocab = 10
    row = [0.0] * vocab
    row[7], row[4] = 5.0, 4.0  # 7 is the favourite, 4 the runner-up
    params = SamplingParams(temperature=0, bad_words=["x"])  # the words come as token ids below
    words = [[3, 7], [9]]
    cases = [((1, 3), 4), ((3, 1), 7), ((), 7), ((7,), 7), ((2, 3, 3), 4)]
    for output, want in cases:
        request = SampleRequest(params, output_token_ids=output, constraints=RowConstraints(bad_words=words))
        assert Sampler()(torch.tensor([row]), [request]) == [[want]], output
    # A one-token bad word is banned from the first token on.
    row[9] = 9.0
    request = SampleRequest(params, output_token_ids=(), constraints=RowConstraints(bad_words=words))
    assert Sampler()(torch.tensor([row]), [request]) == [[7]]


# -- bad words: spelling and banning, by hand ---------------------------------------------------


class HandTokenizer:
    """A tokenizer with a vocabulary written out: text -> token ids."""

    SPELLINGS = {"red": [1], " red": [2], "green": [3, 4], " green": [5, 6], "blue": [7], " blue": [8, 9],
                 "is": [10], " is": [10], "dark red": [11, 1], " dark red": [12, 1], "sky": [13, 14], " sky": [13, 15]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.SPELLINGS[text])


@pytest.mark.parametrize("words,want", [
    (["red"], [[1], [2]]),  # the spaced spelling starts differently, same length: both
    (["green"], [[3, 4], [5, 6]]),
    (["blue"], [[7]]),  # " blue" has more tokens: vLLM skips it
    (["is"], [[10]]),  # same first token: one spelling
    ([" red"], [[1], [2]]),  # a leading space is stripped before spelling
    (["dark red", "sky"], [[11, 1], [12, 1], [13, 14]]),  # " sky" starts with the same token
])
def test_bad_words_token_ids_follow_vllms_rule(words, want):
    assert bad_words_token_ids(HandTokenizer(), words) == want


@pytest.mark.parametrize("output,want", [
    ([], [5]),
    ([1, 2], [5, 3]),
    ([2], [5]),
    ([0, 1], [5, 2]),
    ([1, 2, 0], [5]),
    ([9, 1], [5, 2]),
])
def test_banned_by_bad_words_on_hand_made_cases(output, want):
    words = [[5], [1, 2, 3], [1, 2]]
    assert sorted(banned_by_bad_words(words, output)) == sorted(want)
    assert sorted(banned_by_bad_words(words, tuple(output))) == sorted(want)  # a tuple of tokens too


# -- the bit-packed mask ------------------------------------------------------------------------


def test_unpack_bitmask_matches_a_bit_by_bit_loop():
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 33, 150, 400):
        words = (vocab + 31) // 32
        bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
        bitmask[0, 0] = -1  # every bit set, the sign bit too
        want = [[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)] for r in range(3)]
        assert unpack_bitmask(bitmask, vocab).tolist() == want


def test_apply_bitmask_sets_exactly_the_cleared_bits_to_minus_infinity():
    # One row at a time and the tiny model's vocabulary, as the sampler calls it (llguidance's
    # apply is compiled by torch.compile: another shape would compile it again).
    gen = torch.Generator().manual_seed(1)
    vocab = 400
    bitmask = torch.randint(-2**31, 2**31 - 1, (1, 13), dtype=torch.int32, generator=gen)
    logits = torch.randn(1, vocab, generator=gen)
    masked = logits.clone()
    apply_bitmask(masked, bitmask)
    keep = [(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
    assert masked[0].tolist() == [x if k else NEG_INF for x, k in zip(logits[0].tolist(), keep)]


# -- a grammar's allowed tokens -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), tokenizer.eos_token_id)


def prefix_tokens(tokenizer, choices: list[str], consumed: str) -> set[int]:
    """The tokens whose text keeps ``consumed`` a prefix of some choice, and EOS where
    ``consumed`` is a whole choice: every token id decoded on its own."""
    allowed = {t for t in range(len(tokenizer))
               if (text := tokenizer.decode([t])) and any(c.startswith(consumed + text) for c in choices)}
    return allowed | ({tokenizer.eos_token_id} if consumed in choices else set())


def common_prefix(texts: list[str]) -> str:
    first, last = min(texts), max(texts)
    return first[:next((i for i, (a, b) in enumerate(zip(first, last)) if a != b), len(first))]


def test_choice_grammar_allows_exactly_the_prefixes_of_what_is_left(tokenizer, compiler):
    """Where the choices part ways, the allowed tokens are exactly the tokens whose text is a
    prefix of what is left of some choice (EOS where one is complete). Where the rest of the
    text is forced (one choice left), llguidance allows only the first token of the tokenizer's
    own spelling of it, so the model never sees a spelling it was not trained on; where a forced
    stretch is followed by a fork, a non-empty subset of the prefix tokens."""
    choices = ["red", "re", "green", "blue sky", "blue sea", "0123", "The life is"]
    params = GuidedDecodingParams(choice=choices)
    single = {tokenizer.decode([t]): t for t in range(len(tokenizer))}
    seen = {"fork": 0, "forced": 0, "partly forced": 0}
    for choice in choices:
        # Walk each choice as the tokenizer spells it, and character by character (every
        # character here is a token of its own).
        for path in (tokenizer.encode(choice, add_special_tokens=False), [single[ch] for ch in choice]):
            state, ids, consumed = compiler.matcher(params), [], ""
            for token in [*path, None]:
                got = set(state.allowed().nonzero().flatten().tolist())
                want = prefix_tokens(tokenizer, choices, consumed)
                left = [c[len(consumed):] for c in choices if c.startswith(consumed)]
                forced = common_prefix(left)
                if not forced:
                    seen["fork"] += 1
                    assert got == want, (choice, consumed)
                elif len(left) == 1:
                    seen["forced"] += 1
                    assert got == {tokenizer.encode(forced, add_special_tokens=False)[0]}, (choice, consumed)
                    assert got <= want
                else:
                    seen["partly forced"] += 1
                    assert got and got <= want, (choice, consumed)
                if token is not None:
                    ids.append(token)
                    state.sync(ids)  # the sequence's whole output; the state consumes what is new
                    consumed += tokenizer.decode([token])
            assert consumed == choice and state.consumed == len(path)
    assert min(seen.values()) >= 4, seen


def test_a_token_outside_the_grammar_is_refused_by_name(tokenizer, compiler):
    state = compiler.matcher(GuidedDecodingParams(choice=["red", "green"]))
    [blue] = tokenizer.encode("b", add_special_tokens=False)
    with pytest.raises(ValueError, match=f"token {blue} breaks the grammar"):
        state.sync([blue])


def test_grammar_rows_keep_their_own_masks_in_a_mixed_batch(tokenizer, compiler):
    # Rows 0 and 2 follow different grammars, row 1 has no constraint, row 3 a bias only: each
    # grammar row draws from its own grammar's tokens, the others are as without grammars.
    gen = torch.Generator().manual_seed(0)
    a = GuidedDecodingParams(choice=["red", "green"])
    b = GuidedDecodingParams(regex="[0-9]{2}")
    allowed_a = set(compiler.matcher(a).allowed().nonzero().flatten().tolist())
    allowed_b = set(compiler.matcher(b).allowed().nonzero().flatten().tolist())
    assert allowed_a and allowed_b and not allowed_a & allowed_b
    vocab = len(tokenizer)
    for trial in range(10):
        logits = torch.randn(4, vocab, generator=gen) * 4
        rows = logits.tolist()
        sampled = SamplingParams(temperature=1.0, seed=trial, guided_decoding=b)
        requests = [SampleRequest(SamplingParams(temperature=0, guided_decoding=a),
                                  constraints=RowConstraints(grammar=compiler.matcher(a))),
                    SampleRequest(SamplingParams(temperature=0)),
                    SampleRequest(sampled, num_samples=20, generator=torch.Generator().manual_seed(trial),
                                  constraints=RowConstraints(grammar=compiler.matcher(b))),
                    constrained(SamplingParams(temperature=0, logit_bias={5: 50.0}))]
        got = Sampler(seed=trial)(logits, requests)
        assert got[0] == [max(allowed_a, key=lambda t: rows[0][t])]
        assert got[1] == [argmax(rows[1])]
        assert set(got[2]) <= allowed_b
        assert got[3] == [argmax(reference_logits(rows[3], requests[3].params))]


def test_a_row_with_nothing_left_to_draw_fails_alone(tokenizer, compiler):
    # A complete choice allows EOS alone; min_tokens bans EOS: nothing is left for that row.
    [red] = tokenizer.encode("red", add_special_tokens=False)[:1]
    state = compiler.matcher(GuidedDecodingParams(choice=["re"]))
    state.sync(tokenizer.encode("re", add_special_tokens=False))
    params = SamplingParams(temperature=0, min_tokens=5, guided_decoding=GuidedDecodingParams(choice=["re"]))
    requests = [SampleRequest(params, output_token_ids=tokenizer.encode("re", add_special_tokens=False),
                              eos_token_id=tokenizer.eos_token_id, constraints=RowConstraints(grammar=state)),
                SampleRequest(SamplingParams(temperature=0))]
    logits = torch.randn(2, len(tokenizer), generator=torch.Generator().manual_seed(1))
    got = Sampler()(logits, requests)
    assert isinstance(got[0], ValueError) and "constraints" in str(got[0])
    assert got[1] == [int(logits[1].argmax())]


# -- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fields,match", [
    (dict(logit_bias={3: 100.5}), "logit_bias"),
    (dict(logit_bias={3: float("nan")}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias's token id"),
    (dict(logit_bias=[(3, 1.0)]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(bad_words=["ok", "  "]), "bad_words"),
    (dict(bad_words="word"), "bad_words"),
    (dict(ignore_eos=True, guided_decoding=GuidedDecodingParams(regex="a+")), "ignore_eos"),
    (dict(guided_decoding={"regex": "a+"}), "guided_decoding must be a GuidedDecodingParams"),
])
def test_sampling_params_refuse_bad_constraints_by_name(fields, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields)


@pytest.mark.parametrize("fields,match", [
    (dict(json={"type": "string"}, regex="a"), "exactly one of .*got json, regex"),
    (dict(choice=["a"], json_object=True), "exactly one of .*got json_object, choice"),
    (dict(), "exactly one of .*got none"),
    (dict(json='{"type": "object"'), "guided json: the schema is not valid JSON"),
    (dict(json=["not", "a", "schema"]), "guided json must be a JSON schema object"),
    (dict(regex=""), "guided regex must be a non-empty string"),
    (dict(choice=[]), "guided choice must be a non-empty list"),
    (dict(choice=["a", ""]), "guided choice must be a non-empty list"),
    (dict(grammar=3), "guided grammar must be a non-empty string"),
    (dict(json_object="yes"), "guided json_object must be True or False"),
])
def test_guided_decoding_params_refuse_bad_shapes_by_name(fields, match):
    with pytest.raises(ValueError, match=match):
        GuidedDecodingParams(**fields)


def test_a_schema_given_as_text_is_parsed():
    assert GuidedDecodingParams(json='{"type": "integer"}').json == {"type": "integer"}


def make_engine(loaded) -> LLMEngine:
    mc = ModelConfig(model=str(loaded.path), device="cpu", dtype="float32")
    return LLMEngine(mc, CacheConfig(block_size=4, num_gpu_blocks=64, num_cpu_blocks=0),
                     SchedulerConfig(max_num_seqs=8, max_model_len=128),
                     executor=Worker(mc, attention_backend="torch-batched", loaded=loaded))


def finish(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    return done


def test_the_engine_refuses_what_cannot_be_enforced_and_the_others_go_on(tiny_loaded):
    vocab = tiny_loaded.hf_config.vocab_size
    ok = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    guided = SamplingParams(temperature=0, max_tokens=12, guided_decoding=GuidedDecodingParams(regex="[a-z]{3,9}"))
    alone = make_engine(tiny_loaded)
    alone.add_request("ok", "The life is", ok)
    alone.add_request("guided", "Hello, my name is", guided)
    want = finish(alone)

    engine = make_engine(tiny_loaded)
    engine.add_request("ok", "The life is", ok)
    engine.add_request("guided", "Hello, my name is", guided)
    engine.step()  # both running when the bad ones arrive
    bad = {  # each also carries bad words, which must not be kept for a refused request
        "regex": (dict(guided_decoding=GuidedDecodingParams(regex="[a-")), "guided regex: .*unclosed character class"),
        "type": (dict(guided_decoding=GuidedDecodingParams(json={"type": "strnig"})), "guided json: .*strnig"),
        "range": (dict(guided_decoding=GuidedDecodingParams(json={"type": "integer", "minimum": 5, "maximum": 1})),
                  "guided json: .*minimum"),
        "lark": (dict(guided_decoding=GuidedDecodingParams(grammar="start: greeting")), "guided grammar: .*greeting"),
        "lookaround": (dict(guided_decoding=GuidedDecodingParams(regex="(?<=a)b")), "guided regex: .*look-around"),
        "bias": (dict(logit_bias={3: 1.0, vocab: 2.0}), rf"logit_bias's token ids must be in \[0, {vocab}\)"),
        "allowed": (dict(allowed_token_ids=[5, vocab + 7]), rf"allowed_token_ids must be in \[0, {vocab}\)"),
    }
    for rid, (fields, match) in bad.items():
        with pytest.raises(ValueError, match="(?s)" + match):
            engine.add_request(rid, "The life is", SamplingParams(temperature=0, bad_words=["life"], **fields))
    assert set(engine._groups) == {"ok", "guided"}
    assert engine.constraints._bad_words == {}
    got = finish(engine)
    assert set(got) == {"ok", "guided"}
    for rid in got:
        assert got[rid].error is None
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
    assert engine.constraints._states == {}


def test_bad_words_keep_a_word_of_the_greedy_output_out_of_it(tiny_loaded):
    tokenizer = tiny_loaded.tokenizer
    params = dict(temperature=0, max_tokens=16, ignore_eos=True)
    engine = make_engine(tiny_loaded)
    engine.add_request("free", "Hello, my name is", SamplingParams(**params))
    free = finish(engine)["free"].outputs[0].token_ids

    def occurs(spelling, tokens) -> bool:
        return any(list(tokens[i:i + len(spelling)]) == spelling for i in range(len(tokens)))

    # A word of the output whose spelling the output contains.
    words = [w for t in free if (w := tokenizer.decode([t]).strip()).isalpha()
             and any(occurs(s, free) for s in bad_words_token_ids(tokenizer, [w]))]
    assert words
    engine.add_request("banned", "Hello, my name is", SamplingParams(bad_words=words[:2], **params))
    banned = finish(engine)["banned"].outputs[0].token_ids
    assert banned != free and len(banned) == 16
    assert not any(occurs(s, banned) for s in bad_words_token_ids(tokenizer, words[:2]))
    assert engine.constraints._bad_words == {}
