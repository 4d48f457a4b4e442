"""Grammars for structured output: which tokens may come next, for each sequence that follows one.

A request's ``GuidedDecodingParams`` becomes a grammar (llguidance's JSON-schema, regex or Lark
front ends), compiled once per distinct grammar and checked when the request arrives. Each of its
sequences gets a matcher: a parser state that has consumed exactly the sequence's output tokens.
Before the sampler draws, the matcher fills a bitmask of the tokens that keep the output a prefix
of a valid one (EOS only once it is complete); the sampler sets every other logit to -inf.

The matcher's state is a function of the output tokens alone, so nothing is undone on preemption:
swap and recompute keep a sequence's tokens, and its matcher already stands after the last of
them. A fork (``n > 1``) gets a fresh matcher that replays its tokens the first time it is sampled.

Why llguidance: ``benchmarks/grammar_libraries.py`` measures it against xgrammar and outlines-core
(installs, dependencies, compile time, mask time per step); the README gives the numbers.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence as Tokens

import torch

from tinyserve.closed_schema import close_objects
from tinyserve.guided_params import GuidedDecodingParams

COMPILED_KEPT = 256  # grammars kept compiled (each is its text: a few kilobytes at most, as a rule)

# JSON as json.dumps writes it: one space after each separator, no other whitespace. llguidance's
# default lets whitespace go anywhere (so does vLLM's, unless ``disable_any_whitespace``), and a
# small model can spend every token it has on it; a schema's "x-guidance" key may still ask for it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# What one request's grammar may cost (issue 36, item 4; tests/test_structured_limits.py has the
# measurements). A literal's first mask takes time in proportion to its length (0.7 s for 100k
# characters), and a grammar of 100k characters still compiles in well under a second. The cap
# has room for a schema of 100k characters once its objects are closed (closed_schema.py adds
# about a quarter to a schema made of small objects).
MAX_GRAMMAR_CHARS = 150_000
# Lark alternatives compile in time quadratic in their number (10k choices: a second and more).
MAX_CHOICES = 1000
# llguidance's regex budget (its default is 1M): "a{1000}{1000}" spent seconds on its first mask
# under the default, 0.2 s under this; a JSON enum of a few thousand strings still fits.
INITIAL_LEXER_FUEL = 100_000
# llguidance compiles a grammar's rules recursively: a chain of about a thousand $refs, or three
# thousand Lark rules, overflows an 8 MB thread stack, which kills the whole process (SIGSEGV).
# Grammars are built on a thread with this much stack (address space, touched only as used),
# enough for the deepest chain MAX_GRAMMAR_CHARS allows, about 37k rules, twice over.
GRAMMAR_STACK_BYTES = 256 << 20
# Objects and lists within each other in a JSON schema: llguidance's parser stops at 128 (the
# schema's own levels, plus 3 of its wrapping) with "recursion limit exceeded at line 1 column N",
# and Python's json.dumps (the cache key) raises RecursionError near 1000; this says so, by name,
# before either. (50 objects within each other are 101 levels: "properties" is one.)
MAX_SCHEMA_DEPTH = 120
# Built matchers kept, by grammar, to copy for each new sequence: building one from the text takes
# as long as compiling (1.4 s for a chain of 1000 $refs, 0.4 s for an anyOf of 2000 objects), on
# the engine's thread, for every sequence; a copy takes a tenth of a millisecond. Each holds its
# grammar's lexer (up to tens of MB), so fewer are kept than texts.
TEMPLATES_KEPT = 16
_stack_lock = threading.Lock()


def parser_limits():
    """llguidance's limits for every grammar here: a smaller regex budget, and errors without the
    parser's state and the grammar in them (a client's error message has no use for either)."""
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL, verbose_errors=False)


def nesting_depth(value) -> int:
    """How many dicts and lists ``value`` has within each other (iterative: a deep one is the point)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def on_grammar_stack(fn, *args):
    """``fn(*args)`` on a fresh thread with GRAMMAR_STACK_BYTES of stack (see above); its
    exception, if any, is raised here. llguidance lets go of the GIL, so nothing else waits."""
    result: list = []

    def run() -> None:
        try:
            result.append((True, fn(*args)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result.append((False, e))

    with _stack_lock:  # the stack size is process-wide: set it only for this thread
        previous = threading.stack_size(GRAMMAR_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


def grammar_text(params: GuidedDecodingParams) -> str:
    """The llguidance grammar for ``params`` (not yet checked against a tokenizer)."""
    import llguidance

    kind = params.kind
    if kind in ("json", "json_object"):
        # Objects closed as vLLM's default backend closes them (closed_schema.py); json_object stays open.
        schema = close_objects(params.json) if kind == "json" else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        # Lark string literals, written as JSON strings: no character of a choice is special.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return llguidance.LLMatcher.grammar_from_lark(params.grammar)


class GrammarCompiler:
    """Compiles requests' grammars against one tokenizer, and builds matchers from them.

    The tokenizer's llguidance view is built on first use (about half a second on a 49k
    vocabulary): ``warm`` pays it up front. The server calls it on its tokenizer thread when the
    first structured request comes, so the engine's thread never waits for it."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._ll = None
        # Checked grammars by key, the most recently used last: a server that meets many schemas
        # keeps the latest COMPILED_KEPT, not all of them.
        self._compiled: OrderedDict[str, str] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._lock = threading.Lock()  # the server's tokenizer thread and the engine's both come here
        self._warm = False
        self._templates: OrderedDict[str, object] = OrderedDict()  # text -> unused LLMatcher, to copy

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                       eos_token=self.eos_token_id)
            return self._ll

    def warm(self) -> None:
        """Build the tokenizer's view and compute one mask, so no request waits for either."""
        if not self._warm:
            self.matcher(GuidedDecodingParams(json_object=True)).allowed()
            self._warm = True

    def compile(self, params: GuidedDecodingParams) -> str:
        """The checked grammar for ``params``, or a ValueError that names what is wrong with it."""
        if params.kind == "json" and (depth := nesting_depth(params.json)) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"guided json: the schema is nested {depth} deep, more than this server compiles "
                             f"({MAX_SCHEMA_DEPTH})")
        key = params.key()
        with self._cache_lock:
            text = self._compiled.get(key)
            if text is not None:
                self._compiled.move_to_end(key)
                return text
        if params.kind == "choice" and len(params.choice) > MAX_CHOICES:
            raise ValueError(f"guided choice: {len(params.choice)} choices, more than this server compiles "
                             f"({MAX_CHOICES})")
        try:
            text = grammar_text(params)
        except (ValueError, TypeError, RuntimeError, RecursionError) as e:
            raise ValueError(f"guided {params.kind}: {e}") from None
        if len(text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"guided {params.kind}: the grammar is {len(text)} characters long, more than this "
                             f"server compiles ({MAX_GRAMMAR_CHARS})")
        error = on_grammar_stack(self._check, text)
        if error:
            raise ValueError(f"guided {params.kind}: {error.strip()}")
        with self._cache_lock:
            self._compiled[key] = text
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return text

    def _check(self, text: str) -> str:
        """llguidance's complaint about ``text`` (empty when none). Some only show when a matcher
        computes its first mask (a $ref cycle, a regex over its budget): one is computed here, on
        the server's tokenizer thread, so such a grammar is refused by name, not failed mid-answer."""
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(text, self.ll_tokenizer, limits=parser_limits())
        if error:
            return short_error(error)
        template = llguidance.LLMatcher(self.ll_tokenizer, text, limits=parser_limits())
        state = GrammarState(template.deep_copy(), self.vocab_size)
        if not state.allowed().any() and state.error == "NoExtensionBias":
            return "no output can satisfy it (llguidance: NoExtensionBias; a $ref cycle does this)"
        if state.error:
            return state.error
        self._keep_template(text, template)
        return ""

    def _keep_template(self, text: str, template) -> None:
        with self._cache_lock:
            self._templates[text] = template
            while len(self._templates) > TEMPLATES_KEPT:
                self._templates.popitem(last=False)

    def matcher(self, params: GuidedDecodingParams) -> GrammarState:
        import llguidance

        text = self.compile(params)
        with self._cache_lock:
            template = self._templates.get(text)
            if template is not None:
                self._templates.move_to_end(text)
        if template is None:  # evicted since it was compiled: build it again
            template = on_grammar_stack(lambda: llguidance.LLMatcher(self.ll_tokenizer, text, limits=parser_limits()))
            self._keep_template(text, template)
        return GrammarState(template.deep_copy(), self.vocab_size)


class GrammarState:
    """One sequence's place in its grammar: the tokens consumed so far and what may come next."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.consumed = 0

    def sync(self, output_token_ids: Tokens[int]) -> None:
        """Consume the output tokens not yet consumed (the ones sampled since the last step)."""
        for token in output_token_ids[self.consumed:]:
            if not self.matcher.consume_token(token):
                raise ValueError(f"token {token} breaks the grammar: {short_error(self.matcher.get_error())}")
            self.consumed += 1

    @property
    def error(self) -> str | None:
        return short_error(self.matcher.get_error()) or None if self.matcher.is_error() else None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed tokens into ``bitmask[row]`` (int32 words, bit ``t % 32`` of word
        ``t // 32`` set when token t is allowed)."""
        words = bitmask[row]
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not words.is_contiguous():
            raise ValueError("the bitmask must be a contiguous int32 tensor on the CPU")
        # llguidance writes the words itself (and lets go of the GIL while it works).
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        if self.matcher.is_error():
            # A limit hit mid-answer: llguidance leaves EOS allowed, which would end the answer
            # as if complete. No token at all fails the row alone, by name (the sampler's check).
            words.zero_()

    def allowed(self) -> torch.Tensor:
        """The allowed tokens as a bool vector over the vocabulary (for pictures and tests)."""
        bitmask = allocate_bitmask(1, self.vocab_size)
        self.fill_bitmask(bitmask, 0)
        return unpack_bitmask(bitmask, self.vocab_size)[0]


def short_error(error: str) -> str:
    """llguidance's message without the parser-state dump it appends (``<state>...``, or
    ``<non-verbose/>`` under ``verbose_errors=False``)."""
    return error.split("\n<", 1)[0].strip()


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.zeros(rows, (vocab_size + 31) // 32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool: bit ``t % 32`` of word ``t // 32`` is token t."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


_BYTE_TO_BIAS: torch.Tensor | None = None


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set, in place, every logit whose token's bit is clear to -inf (rows of ``logits`` and
    ``bitmask`` correspond).

    The same as ``logits.masked_fill_(~unpack_bitmask(...), -inf)``, faster: each byte of the mask
    looks up its row of eight biases (0 for an allowed token, -inf for the others) in a 256 x 8
    table, and the biases are added. (llguidance's own apply is a ``torch.compile``d kernel whose
    first call compiles for seconds, with a C++ compiler: ``benchmarks/grammar_libraries.py``.)"""
    global _BYTE_TO_BIAS
    if _BYTE_TO_BIAS is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        _BYTE_TO_BIAS = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf"))
    # Little-endian words: byte k of word i holds tokens 32 i + 8 k to 32 i + 8 k + 7, lowest bit first.
    as_bytes = bitmask.contiguous().view(torch.uint8).reshape(-1).long()
    bias = _BYTE_TO_BIAS.index_select(0, as_bytes).view(bitmask.shape[0], -1)
    logits += bias[:, :logits.shape[1]].to(logits.dtype)
