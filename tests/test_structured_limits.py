"""What a hostile structured-output request may cost (issue 36, item 4): the bounds in ``tinyserve.grammar``.

Each test is a bug class found by attacking the grammar path as a client would, on the tiny
model's tokenizer (the costs below are grammar-bound, not vocabulary-bound: SmolLM2's 49k
vocabulary measured the same order). Measured before the bounds, on 2 shared cores:

- a chain of 1000 ``$ref``s (53k characters of schema), or 3000 Lark rules: llguidance compiles
  rules recursively, overflows an 8 MB thread stack and the whole process dies (SIGSEGV), taking
  every request with it;
- one ``guided_choice`` string of 1M characters: compiled, then its first mask took 2.3 s and
  280 MB (on the engine's thread, stalling every request of the step); 100k choices: compiling did
  not finish in 90 s (quadratic);
- ``a{1000}{1000}``: 9 characters of regex, first mask 1.8 to 4.7 s under llguidance's default
  regex budget;
- a ``$ref`` cycle: compiled, then its matcher's first mask failed, and llguidance's mask in error
  allows EOS alone, so the request ended "stop" with an empty answer, as if complete;
- a schema nested 500 deep: ``RecursionError`` (not a ValueError) from the grammar's cache key.

Each test says whether it was seen to fail without its bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import llguidance
import pytest
from transformers import AutoTokenizer

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.grammar import (
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_SCHEMA_DEPTH,
    GrammarCompiler,
    GrammarState,
    grammar_text,
)
from tinyserve.guided_params import GuidedDecodingParams
from tinyserve.sampling_params import SamplingParams
from tinyserve.serve import ServerThread, create_app
from tinyserve.worker import Worker


def ref_chain(n: int) -> dict:
    """A schema whose definitions refer each to the next, n deep: ``{"a": {"a": ... 7}}``."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"]}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "integer", "minimum": 7, "maximum": 7}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(n: int) -> str:
    """A Lark grammar of n rules, each only the next: the language is the one word "x"."""
    return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(n)), f'r{n}: "x"'])


NESTED_REF_CHAIN = 1000  # crashed at 1000 (not at 700) on an 8 MB stack
LARK_CHAIN = 3000  # crashed at 3000 (not at 2000)
HOSTILE_CYCLE = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)  # the tiny model's (training one takes seconds)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), tokenizer.eos_token_id)


def accepts(state: GrammarState, tokenizer, text: str) -> bool:
    """Whether the matcher takes ``text``'s tokens and then EOS (the reference: the text we built
    the grammar to describe)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    state.sync(ids)
    return bool(state.allowed()[tokenizer.eos_token_id])


# -- the process survives a deep grammar ----------------------------------------------------------


def test_a_deep_rule_chain_compiles_instead_of_killing_the_process(tiny_model_dir):
    # Verified to fail without the bound (on_grammar_stack): the child died of SIGSEGV (rc -11).
    # A child process, so that a crash fails this test instead of ending the test run.
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, "tests")
        from test_structured_limits import accepts, lark_chain, ref_chain
        from tinyserve.grammar import GrammarCompiler
        from tinyserve.guided_params import GuidedDecodingParams
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained({str(tiny_model_dir)!r})
        compiler = GrammarCompiler(tok, len(tok), tok.eos_token_id)
        schema = GuidedDecodingParams(json=ref_chain({NESTED_REF_CHAIN}))
        lark = GuidedDecodingParams(grammar=lark_chain({LARK_CHAIN}))
        expected = '{{"a": ' * {NESTED_REF_CHAIN} + "7" + "}}" * {NESTED_REF_CHAIN}
        print(json.dumps([accepts(compiler.matcher(schema), tok, expected),
                          accepts(compiler.matcher(lark), tok, "x")]))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, True]


# -- compile-time bombs are refused by name, quickly -----------------------------------------------


def test_a_grammar_over_the_size_cap_is_refused_naming_its_size(compiler):
    # Verified to fail without the bound: compiled (then its first mask took 1.4 s per sequence).
    text = "ab" * 100_000
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"guided choice: the grammar is {len(text) + 9} characters long, "
                                         rf"more than this server compiles \({MAX_GRAMMAR_CHARS}\)"):
        compiler.compile(GuidedDecodingParams(choice=[text]))
    assert time.perf_counter() - start < 2


def test_too_many_choices_are_refused_naming_the_count(compiler):
    # Verified to fail without the bound: 5000 choices compiled (in about 0.8 s; 100k never finished).
    with pytest.raises(ValueError, match=rf"guided choice: 5000 choices, more than this server compiles "
                                         rf"\({MAX_CHOICES}\)"):
        compiler.compile(GuidedDecodingParams(choice=[f"c{i}" for i in range(5000)]))


@pytest.mark.parametrize("depth", [150, 1200])
def test_a_schema_nested_too_deeply_is_refused_naming_its_depth(compiler, depth):
    # Verified to fail without the bound: at 1200, RecursionError (not a ValueError: a 500 from the
    # server); at 150, llguidance's "recursion limit exceeded at line 1 column 3026".
    schema = nested_arrays(depth)
    with pytest.raises(ValueError, match=rf"guided json: the schema is nested {depth} deep, more than this server "
                                         rf"compiles \({MAX_SCHEMA_DEPTH}\)"):
        compiler.compile(GuidedDecodingParams(json=schema))


def test_a_schema_at_the_depth_cap_still_compiles(compiler):
    # The cap is within llguidance's own (so it refuses nothing that worked): this one validates.
    schema: dict = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH - 1):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    compiler.compile(GuidedDecodingParams(json=schema))


def test_a_ref_cycle_is_refused_at_compile_not_mid_answer(compiler):
    # Verified to fail without the bound: compile returned, and the matcher failed on its first mask.
    with pytest.raises(ValueError, match="guided json: no output can satisfy it"):
        compiler.compile(GuidedDecodingParams(json=HOSTILE_CYCLE))


def test_a_regex_over_llguidances_budget_costs_its_first_mask_little(compiler, tokenizer):
    # Verified to fail without the bound (llguidance's default regex budget): 1.8 to 4.7 s for the mask.
    # The time is the property itself; the bounded mask measured 0.17 to 0.5 s on 2 loaded cores.
    params = GuidedDecodingParams(regex="a{1000}{1000}")
    compiler.compile(params)
    state = compiler.matcher(params)
    start = time.perf_counter()
    state.allowed()
    assert time.perf_counter() - start < 1.5


def test_a_matcher_in_error_allows_no_token_rather_than_eos(compiler, tokenizer):
    # Verified to fail without the bound: llguidance's mask in error allows EOS alone, which
    # ends the answer as if it were complete; with no token the sampler fails the row by name.
    matcher = llguidance.LLMatcher(compiler.ll_tokenizer, grammar_text(GuidedDecodingParams(json=HOSTILE_CYCLE)))
    state = GrammarState(matcher, len(tokenizer))
    assert not state.allowed().any()
    assert state.error == "NoExtensionBias"


# -- mid-answer: the request that hits a limit fails alone -------------------------------------------


def make_engine(loaded) -> LLMEngine:
    mc = ModelConfig(model=str(loaded.path), device="cpu", dtype="float32")
    return LLMEngine(mc, CacheConfig(block_size=8, num_gpu_blocks=96, num_cpu_blocks=16),
                     SchedulerConfig(max_num_seqs=8, max_model_len=128),
                     executor=Worker(mc, attention_backend="torch", loaded=loaded))


def run(engine: LLMEngine, requests: dict) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        done |= {o.request_id: o for o in engine.step() if o.finished}
    return done


def test_a_limit_hit_mid_answer_fails_that_request_alone(tiny_loaded):
    # Verified to fail without the bound (GrammarState.fill_bitmask clearing the mask of a matcher in
    # error): the hostile request finished "stop", error None, text "", as if its answer were complete.
    # The regex's mask exceeds llguidance's regex budget; its neighbour in the same steps is untouched.
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = run(make_engine(tiny_loaded), {"plain": ("Hello, my name is", plain)})["plain"]
    done = run(make_engine(tiny_loaded), {
        "hostile": ("Hello, my name is", SamplingParams(temperature=0, max_tokens=8,
                                                         guided_decoding=GuidedDecodingParams(regex="a{1000}{1000}"))),
        "plain": ("Hello, my name is", plain),
    })
    error = done["hostile"].error or ""
    # The sampler's "no token may be drawn" today; llguidance's own reason once constraints.py copies
    # the matcher's error into RowConstraints.error after the mask (see the report).
    assert "too many expressions" in error, error  # llguidance's reason, named
    assert done["hostile"].outputs[0].finish_reason == "abort"
    assert done["plain"].error is None
    assert done["plain"].outputs[0].token_ids == alone.outputs[0].token_ids


# -- over HTTP: a 400 naming the field, quickly, while others are served ----------------------------

def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


HOSTILE_FIELDS = [
    ("guided_json", nested_arrays(300), "nested 300 deep"),
    ("guided_json", ref_chain(NESTED_REF_CHAIN), None),  # compiles now: what matters is the server lives
    ("guided_json", HOSTILE_CYCLE, "no output can satisfy it"),
    ("guided_choice", ["ab" * MAX_GRAMMAR_CHARS], "characters long"),
    ("guided_choice", [f"c{i}" for i in range(5000)], "5000 choices"),
    ("guided_grammar", lark_chain(LARK_CHAIN), None),
    ("response_format", {"type": "json_schema",
                         "json_schema": {"name": "x", "schema": {"enum": list(range(MAX_GRAMMAR_CHARS // 4))}}},
     "characters long"),
]


@pytest.fixture(scope="module")
def served(tiny_loaded):
    server = ServerThread(create_app(make_engine(tiny_loaded), model_name="tiny")).start()
    try:
        yield server
    finally:
        server.stop()


def test_hostile_structured_requests_get_a_400_naming_the_field_while_others_are_served(served):
    # Without the bounds: the $ref chain kills the server (and this test run: SIGSEGV, as the child
    # above shows); the choices and the enum compile (no 400); the nested schema's 400 says only
    # "recursion limit exceeded at line 1 column N".
    plain = {"model": "tiny", "prompt": "Hello, my name is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=served.url, timeout=60) as client:
        reference = client.post("/v1/completions", json=plain).json()["choices"][0]["text"]
        served_meanwhile: list[str] = []
        health: list[float] = []
        stop = threading.Event()

        def neighbour() -> None:
            with httpx.Client(base_url=served.url, timeout=60) as other:
                while not stop.is_set():
                    start = time.perf_counter()
                    assert other.get("/health").status_code == 200
                    health.append(time.perf_counter() - start)
                    served_meanwhile.append(other.post("/v1/completions", json=plain).json()["choices"][0]["text"])

        thread = threading.Thread(target=neighbour)
        thread.start()
        try:
            for field, value, message in HOSTILE_FIELDS:
                start = time.perf_counter()
                hostile = {"model": "tiny", "prompt": "Hello, my name is", "max_tokens": 4, field: value}
                r = client.post("/v1/completions", json=hostile)
                took = time.perf_counter() - start
                if message is None:
                    assert r.status_code == 200, r.text
                    continue
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["param"] == field and message in error["message"], error
                assert took < 3, (field, took)
        finally:
            stop.set()
            thread.join()
    assert served_meanwhile and set(served_meanwhile) == {reference}
    assert max(health) < 1, health
