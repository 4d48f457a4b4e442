"""Checkers for chapter 12: prefix caching, chunked prefill, streaming.

- ``check_cached_tokens``: how much of a new prompt the prefix cache spares, compared with the
  real PrefixCachingBlockSpaceManager after the earlier prompts have run.
- ``check_prefill_chunks``: how a long prompt is cut into chunks while other requests decode,
  compared with the real scheduler in the simulator.
- ``check_stream_text``: putting a streamed answer back together from its server-sent events,
  compared with the final texts, on streams written by the server's own ``stream_events``.
- ``check_pack_bitmask``: packing the allowed tokens into a grammar's int32 bitmask, compared with
  the masks llguidance writes for a real grammar and, through ``unpack_bitmask``, with random ones.
"""

from __future__ import annotations

import asyncio
import random
import reprlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.verdict import checker, run_cases
from tinyserve.grammar import GrammarCompiler, allocate_bitmask, unpack_bitmask
from tinyserve.guided_params import GuidedDecodingParams
from tinyserve.outputs import CompletionOutput, RequestOutput
from tinyserve.prefix_cache import PrefixCachingBlockSpaceManager
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from tinyserve.serve.choices import ChoiceFormat
from tinyserve.serve.mailbox import Mailbox
from tinyserve.serve.streaming import stream_events
from tinyserve.sim import Request, simulate

_body_repr = reprlib.Repr()
_body_repr.maxlist = 12
_body_repr.maxstring = 60


# -- prefix caching -----------------------------------------------------------------------------

def cached_tokens_reference(prompt: list[int], earlier: list[list[int]], block_size: int) -> int:
    """What the real prefix-caching block manager answers once every earlier prompt has been prefilled."""
    manager = PrefixCachingBlockSpaceManager(block_size, num_gpu_blocks=256, num_cpu_blocks=0, watermark=0.0)
    for i, ids in enumerate(earlier):
        seq = Sequence(i, None, ids, block_size)
        manager.allocate(SequenceGroup(f"e{i}", [seq], SamplingParams(), 0.0))
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = len(ids)
        manager.mark_computed(seq)
        manager.free(seq)  # finished: its blocks stay in the cache
    return manager.num_cached_tokens(Sequence(len(earlier), None, prompt, block_size))


@checker(chapter=12, answer="cached_tokens")
def check_cached_tokens(fn: Callable[[list[int], list[list[int]], int], int], num_cases: int = 200,
                        seed: int = 0) -> bool:
    """``fn(prompt, earlier_prompts, block_size)``: how many leading tokens of ``prompt`` need no
    compute because the earlier prompts (all prefilled, their blocks still cached) hold them."""
    rng = random.Random(seed)
    cases = [(([1, 2, 3, 4], [[1, 2, 3, 4]], 2), None),  # all cached: the last token is still computed
             (([1, 2, 3, 4, 5], [[1, 2, 3]], 2), None),  # a partial block is never shared
             (([9, 3, 4], [[1, 2, 3, 4]], 1), None),  # the same block after another prefix is another block
             (([1, 2], [], 4), None)]
    while len(cases) < num_cases:
        vocab = rng.choice([2, 3, 10])
        base = [rng.randrange(vocab) for _ in range(rng.randint(0, 24))]
        earlier = [base[: rng.randint(0, len(base))] + [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
                   for _ in range(rng.randint(0, 3))]
        prompt = base[: rng.randint(0, len(base))] + [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
        cases.append(((prompt, [e for e in earlier if e], rng.choice([1, 2, 4, 8])), None))
    cases = [(args, cached_tokens_reference(*args)) for args, _ in cases]
    return run_cases("cached_tokens", lambda p, e, b: fn(list(p), [list(x) for x in e], b), cases,
                      lambda a: f"prompt={_body_repr.repr(a[0])}, earlier={_body_repr.repr(a[1])}, block_size={a[2]}")


# -- chunked prefill ----------------------------------------------------------------------------

def prefill_chunks_reference(prompt_len: int, decode_left: list[int], budget: int) -> list[int]:
    """The chunks the real scheduler gives a prompt that arrives while others decode.

    Decoder i has produced its first token and will decode ``decode_left[i]`` more, one per
    round, starting in the round the long prompt arrives."""
    requests = [Request(f"d{i}", 1, 1 + left, arrival_round=1) for i, left in enumerate(decode_left)]
    requests.append(Request("long", prompt_len, 1, arrival_round=2))
    sc = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=len(requests), max_model_len=prompt_len + 1,
                         enable_chunked_prefill=True)
    cc = CacheConfig(block_size=16, num_gpu_blocks=1 + (prompt_len + 16) // 16 + len(decode_left) * 8,
                     num_cpu_blocks=0, watermark=0.0)
    return [rec.chunk_sizes["long"] for rec in simulate(requests, sc, cc) if "long" in rec.chunk_sizes]


@checker(chapter=12, answer="prefill_chunks")
def check_prefill_chunks(fn: Callable[[int, list[int], int], list[int]], num_cases: int = 150, seed: int = 0) -> bool:
    """``fn(prompt_len, decode_left, budget)``: the prompt tokens a long prompt brings to each
    round under chunked prefill, from the round it arrives until its prefill is done, while
    decoder i decodes in the first ``decode_left[i]`` of those rounds (decodes go first)."""
    rng = random.Random(seed)
    cases = [(100, [], 32), (100, [50, 50, 50], 32), (10, [3], 16), (64, [1, 2, 3, 4], 8), (31, [0], 31)]
    while len(cases) < num_cases:
        decode_left = [rng.randint(0, 12) for _ in range(rng.randint(0, 5))]
        cases.append((rng.randint(1, 200), decode_left, rng.randint(len(decode_left) + 1, 48)))
    cases = [((p, list(d), b), prefill_chunks_reference(p, d, b)) for p, d, b in cases]
    return run_cases("prefill_chunks", lambda p, d, b: list(fn(p, list(d), b)), cases,
                      lambda a: f"prompt_len={a[0]}, decode_left={a[1]}, budget={a[2]}")


# -- streaming ----------------------------------------------------------------------------------

class _NoLoop:
    def abort(self, request_id: str) -> None:  # a replayed stream always finishes
        pass


def _outputs(rng: random.Random, n: int) -> list[RequestOutput]:
    """A made-up generation: each choice's text grows a piece per step until it finishes."""
    words = ["Paris", " is", " the", " capital", ",", " of", " France", ".", "\n", " é", "🙂", " KV", " blocks"]
    pieces = [[rng.choice(words) for _ in range(rng.randint(1, 8))] for _ in range(n)]
    reasons = [rng.choice(["stop", "length"]) for _ in range(n)]
    steps = max(len(p) for p in pieces)
    return [RequestOutput("r", None, [1, 2, 3],
                          [CompletionOutput(i, "".join(p[:step]), list(range(min(step, len(p)))),
                                            reasons[i] if step >= len(p) else None) for i, p in enumerate(pieces)],
                          finished=step == steps)
            for step in range(1, steps + 1)]


def stream_body(outputs: list[RequestOutput], chat: bool, include_usage: bool, n: int,
                stop: list[str] | None = None) -> str:
    """The text/event-stream body the server sends for this sequence of engine outputs (whole
    outputs so far, as ``output_kind="cumulative"`` gives them; the server streams the deltas)."""
    async def collect() -> str:
        deltas = _deltas(outputs)
        mailbox = Mailbox(delta=True)
        for out in deltas[1:]:
            mailbox.put(out)
        params = SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0, stop=stop)
        events = stream_events(_NoLoop(), "cmpl-1", mailbox, deltas[0], params, 0, ChoiceFormat(chat), "tiny",
                               include_usage)
        return "".join([e async for e in events])

    # A thread of its own, so this works where an event loop is already running (a notebook).
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, collect()).result()


def _deltas(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Whole outputs so far, as the deltas ``output_kind="delta"`` would have given."""
    seen: dict[int, CompletionOutput] = {}
    deltas = []
    for out in outputs:
        pieces = []
        for c in out.outputs:
            old = seen.get(c.index, CompletionOutput(c.index, "", [], None))
            pieces.append(CompletionOutput(c.index, c.text[len(old.text):], c.token_ids[len(old.token_ids):],
                                           c.finish_reason))
            seen[c.index] = c
        deltas.append(RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, pieces, out.finished,
                                    out.error))
    return deltas


@checker(chapter=12, answer="stream_text")
def check_stream_text(fn: Callable[[str], dict[int, str]], num_cases: int = 60, seed: int = 0) -> bool:
    """``fn(body)``: from the raw body of a streamed /v1/completions or /v1/chat/completions
    answer (``data: {...}`` lines, blank lines between events, ``data: [DONE]`` at the end),
    return ``{choice index: full text}``."""
    rng = random.Random(seed)
    cases = []
    for k in range(num_cases):
        n = 1 if k < num_cases // 2 else rng.randint(1, 3)
        outputs = _outputs(rng, n)
        body = stream_body(outputs, chat=bool(k % 2), include_usage=rng.random() < 0.3, n=n)
        cases.append(((body,), {c.index: c.text for c in outputs[-1].outputs}))
    return run_cases("stream_text", fn, cases, lambda a: f"body={_body_repr.repr(a[0])}")



# -- structured output --------------------------------------------------------------------------

def packed_reference(allowed: torch.Tensor) -> torch.Tensor:
    """The bitmask of ``allowed`` [rows, vocab] bool, bit by bit: token t sets bit ``t % 32`` of word
    ``t // 32``; a word with bit 31 set is stored as the negative int32 of the same bits."""
    rows, vocab = allowed.shape
    words = [[0] * ((vocab + 31) // 32) for _ in range(rows)]
    for row, token in allowed.nonzero().tolist():
        words[row][token // 32] |= 1 << (token % 32)
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in ws] for ws in words], dtype=torch.int32)


def _grammar_cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(allowed, bitmask) as llguidance wrote them for a JSON object on the tiny model's tokenizer,
    at its start and after a few tokens."""
    from tinyserve.models.tiny import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    state = GrammarCompiler(tok, len(tok), tok.eos_token_id).matcher(GuidedDecodingParams(json_object=True))
    cases = []
    for text in ("", '{"', '{"name": "Ada", "age": 3'):
        state.sync(tok.encode(text, add_special_tokens=False))
        bitmask = allocate_bitmask(1, len(tok))
        state.fill_bitmask(bitmask, 0)
        cases.append((unpack_bitmask(bitmask, len(tok)), bitmask))
    return cases


@checker(chapter=12, answer="pack_bitmask")
def check_pack_bitmask(fn: Callable[[torch.Tensor], torch.Tensor], num_cases: int = 60, seed: int = 0) -> bool:
    """``fn(allowed)``: ``allowed`` [rows, vocab] bool -> the int32 bitmask [rows, (vocab + 31) // 32]
    with bit ``t % 32`` of word ``t // 32`` set exactly when token t is allowed (bits past the
    vocabulary clear), as a grammar's matcher writes it."""
    gen = torch.Generator().manual_seed(seed)
    cases = [((allowed,), bitmask) for allowed, bitmask in _grammar_cases()]
    fixed = [torch.ones(1, 64, dtype=torch.bool), torch.zeros(2, 33, dtype=torch.bool),
             torch.arange(40).remainder(2).eq(0).unsqueeze(0), torch.arange(32).eq(31).unsqueeze(0)]
    cases += [((a,), packed_reference(a)) for a in fixed]
    while len(cases) < num_cases:
        rows, vocab = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 200, (1,), generator=gen))
        allowed = torch.rand(rows, vocab, generator=gen) < float(torch.rand(1, generator=gen))
        expected = packed_reference(allowed)
        assert torch.equal(unpack_bitmask(expected, vocab), allowed)  # the package reads it back
        cases.append(((allowed,), expected))
    return run_cases("pack_bitmask", lambda allowed: fn(allowed.clone()), cases,
                     lambda a: f"allowed of shape {list(a[0].shape)}, allowed tokens "
                               f"{_body_repr.repr(a[0].nonzero().tolist())}",
                     same=lambda got, want: (isinstance(got, torch.Tensor) and got.dtype == torch.int32
                                             and got.shape == want.shape and torch.equal(got, want)))
