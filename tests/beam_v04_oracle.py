"""vLLM v0.4.0's own beam search as a test oracle, driven beside tinyserve's engine step by step.

``load`` imports v0.4.0's ``vllm.sequence``, ``vllm.sampling_params``, ``vllm.outputs``,
``vllm.model_executor.layers.sampler`` and ``vllm.engine.llm_engine`` from the wheel, without
``vllm/__init__.py`` (``v04_oracle.load`` registers the empty package). ``llm_engine`` imports two
modules at its top that need what the venv has not (``model_loader``: the CUDA kernels;
``usage.usage_lib``: ``cpuinfo``) and that none of the functions used here calls, so they are
stood in for by empty modules while it is imported, then taken out of ``sys.modules`` again.

``V04Beam`` is one request on v0.4's side: v0.4 ``Sequence``/``SequenceGroup`` objects and
``SamplingParams(use_beam_search=True, ...)``. A step runs v0.4's sampler from the
log-probabilities of the group's running beams on: ``_beam_search_sample`` (tokens, parents),
``_get_logprobs`` (each sample's ``{token: Logprob}``) and ``_build_sampler_output`` (the
``SequenceGroupOutput`` of ``SequenceOutput``s), given a metadata object holding the fields those
three read; then ``LLMEngine._process_sequence_group_outputs``, called on ``EngineStub``, whose
methods are the engine's own ``_process_sequence_group_outputs``, ``_check_stop``
and ``_check_beam_search_early_stopping``, with a scheduler that records ``fork_seq``/``free_seq``,
a detokenizer that does nothing (no stop strings: only EOS and ``max_tokens`` stop a beam) and
v0.4's ``Counter`` for sequence ids.

``TinyserveBeam`` runs the same request through a real ``LLMEngine``: the model runs (so the
cache orders of forks and copy-on-write are carried out), and its logits are then replaced by
the case's (``logits_row``), a function of the beam's tokens, so both sides see the same
log-probabilities whatever their sequence ids. v0.4 is given each row's log-probabilities as the
engine computes them (``logits - logsumexp``, float32), or, if asked, computes its own
(``torch.log_softmax`` as v0.4's ``Sampler.forward`` does; the two can differ in the last bit).

After every step each side is described by a ``BeamState``: the running beams and the finished
ones the group keeps (tokens, cumulative logprob, finish reason), the forks that hold blocks
after the step (parent's tokens, child's tokens), the parents whose blocks were freed, and
whether the search is over.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import logging
import random
import sys
import types
from dataclasses import dataclass, field

import torch
from v04_oracle import load as load_v04

VOCAB_ACTIVE = 30  # tokens that carry the mass of a row; the other ~370 get almost none


@dataclass(frozen=True)
class Case:
    seed: int
    prompt: tuple[int, ...]
    width: int
    n: int
    max_tokens: int
    length_penalty: float
    early_stopping: bool | str
    p_eos: float  # the chance that EOS is made likely at a given beam and step
    active: tuple[int, ...]  # the tokens that carry the mass

    def params(self) -> dict:
        return dict(n=self.n, best_of=self.width, use_beam_search=True, temperature=0.0,
                    max_tokens=self.max_tokens, length_penalty=self.length_penalty,
                    early_stopping=self.early_stopping)


def random_case(seed: int, vocab: int, eos: int) -> Case:
    rng = random.Random(seed)
    width = rng.randint(2, 8)
    ordinary = [t for t in range(3, vocab) if t != eos]
    return Case(seed, tuple(rng.choice(ordinary) for _ in range(rng.randint(2, 20))), width,
                rng.randint(1, width), rng.randint(3, 15), rng.choice([0.0, 0.5, 1.0, 2.0, -1.0]),
                rng.choice([True, False, "never"]), rng.choice([0.0, 0.05, 0.15, 0.3, 0.5]),
                tuple(rng.sample(ordinary, VOCAB_ACTIVE)))


def logits_row(case: Case, tokens: tuple[int, ...], vocab: int, eos: int) -> torch.Tensor:
    """The 'model' of a case: the logits after ``tokens``, drawn from a generator seeded by the
    case and the tokens. Continuous draws, so no two candidates tie (see the test's docstring)."""
    digest = hashlib.blake2b(repr((case.seed, tokens)).encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    row = torch.randn(vocab, generator=g) - 14.0
    active = torch.tensor(case.active)
    row[active] = torch.randn(len(case.active), generator=g) * 1.5
    if torch.rand(1, generator=g).item() < case.p_eos:  # EOS likely here: near the top
        row[eos] = row[active].max() + torch.randn(1, generator=g).item() * 0.7
    else:
        row[eos] = -5.0 + torch.randn(1, generator=g).item()
    return row


@dataclass
class BeamState:
    running: list  # sorted (tokens, cumulative logprob)
    finished: list  # sorted (tokens, cumulative logprob, finish reason)
    forked: set  # (parent's tokens, child's tokens) of the children that hold blocks now
    freed: set  # the tokens of the parents whose blocks were freed (at the free)
    stopped: bool


# -- v0.4.0 -------------------------------------------------------------------------------------

_loaded: types.SimpleNamespace | None = None


def load() -> types.SimpleNamespace:
    """v0.4.0's beam search: its sampler function, engine methods, sequences and outputs."""
    global _loaded
    if _loaded is not None:
        return _loaded
    load_v04()
    vlog = importlib.import_module("vllm.logger")
    stand_ins = {}
    for name, attrs in (("vllm.model_executor.model_loader", {"get_architecture_class_name": None}),
                        ("vllm.usage.usage_lib", {"UsageContext": types.SimpleNamespace(ENGINE_CONTEXT=None),
                                                  "is_usage_stats_enabled": lambda: False,
                                                  "usage_message": None})):
        if name not in sys.modules:
            stand_ins[name] = sys.modules[name] = types.ModuleType(name)
            vars(stand_ins[name]).update(attrs)
    level = vlog._default_handler.level
    vlog._default_handler.setLevel(logging.ERROR)  # "Failed to import Ray" at import time
    try:
        engine = importlib.import_module("vllm.engine.llm_engine")
    finally:
        vlog._default_handler.setLevel(level)
        for name, module in stand_ins.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
    seq = importlib.import_module("vllm.sequence")
    sampler = importlib.import_module("vllm.model_executor.layers.sampler")
    _loaded = types.SimpleNamespace(
        seq=seq,
        SamplingParams=importlib.import_module("vllm.sampling_params").SamplingParams,
        sampler=types.SimpleNamespace(beam_search_sample=sampler._beam_search_sample,
                                      get_logprobs=sampler._get_logprobs,
                                      build_sampler_output=sampler._build_sampler_output),
        LLMEngine=engine.LLMEngine,
        RequestOutput=importlib.import_module("vllm.outputs").RequestOutput,
        Counter=importlib.import_module("vllm.utils").Counter,
    )
    return _loaded


class RecordingScheduler:
    def __init__(self) -> None:
        self.forks: list = []
        self.frees: list = []

    def fork_seq(self, parent, child) -> None:
        self.forks.append(child)

    def free_seq(self, seq) -> None:
        self.frees.append(tuple(seq.get_output_token_ids()))


class NoDetokenizer:
    def decode_sequence_inplace(self, seq, params) -> None:
        pass


def engine_stub_class():
    """A class whose methods are v0.4.0's own ``LLMEngine`` functions (unbound, unchanged)."""
    v = load()
    return type("EngineStub", (), {
        "_process_sequence_group_outputs": v.LLMEngine._process_sequence_group_outputs,
        "_check_stop": v.LLMEngine._check_stop,
        "_check_beam_search_early_stopping": v.LLMEngine._check_beam_search_early_stopping,
    })


class V04Beam:
    """One beam search request on v0.4.0's side."""

    def __init__(self, case: Case, eos: int, max_model_len: int, block_size: int) -> None:
        v = self.v = load()
        self.params = v.SamplingParams(**case.params())
        first = v.seq.Sequence(0, None, list(case.prompt), block_size, eos_token_id=eos)
        first.status = v.seq.SequenceStatus.RUNNING  # as the scheduler leaves it
        self.group = v.seq.SequenceGroup("r", [first], self.params, arrival_time=0.0)
        self.engine = engine_stub_class()()
        self.engine.scheduler = RecordingScheduler()
        self.engine.detokenizer = NoDetokenizer()
        self.engine.seq_counter = v.Counter(1)
        self.engine.scheduler_config = types.SimpleNamespace(max_model_len=max_model_len)

    def running(self) -> list:
        return self.group.get_seqs(status=self.v.seq.SequenceStatus.RUNNING)

    def step(self, logprobs: torch.Tensor) -> BeamState:
        """One step with ``logprobs``: one row per running beam, in ``running()``'s order."""
        v = self.v
        parents = self.running()
        is_prompt = len(parents) == 1 and parents[0].get_output_len() == 0
        seq_ids = [s.seq_id for s in parents]
        # v0.4's sampler from its log-probabilities on: the beam search, the sampled tokens'
        # logprobs, the SamplerOutput; the metadata holds what those three read of it.
        meta = types.SimpleNamespace(seq_groups=[(seq_ids, self.params)], seq_data={s.seq_id: s.data for s in parents},
                                     num_prompts=int(is_prompt), prompt_lens=[len(parents[0].get_prompt_token_ids())])
        results = v.sampler.beam_search_sample(meta.seq_groups, [is_prompt], meta.seq_data, logprobs)
        prompt_logprobs, sample_logprobs = v.sampler.get_logprobs(logprobs, meta, results)
        [outputs] = v.sampler.build_sampler_output(results, meta, prompt_logprobs, sample_logprobs).outputs
        sched = self.engine.scheduler
        sched.forks.clear()
        sched.frees.clear()
        self.engine._process_sequence_group_outputs(self.group, outputs)
        return self.state({(tuple(c.get_output_token_ids()[:-1]), tuple(c.get_output_token_ids()))
                           for c in sched.forks}, set(sched.frees))

    def state(self, forked: set, freed: set) -> BeamState:
        seqs = self.group.get_seqs()
        reason = self.v.seq.SequenceStatus.get_finished_reason
        return BeamState(sorted((tuple(s.get_output_token_ids()), s.get_cumulative_logprob())
                                for s in seqs if not s.is_finished()),
                         sorted((tuple(s.get_output_token_ids()), s.get_cumulative_logprob(), reason(s.status))
                                for s in seqs if s.is_finished()),
                         forked, freed, self.group.is_finished())

    def outputs(self) -> list:
        """v0.4.0's ``RequestOutput.from_seq_group``: (tokens, cumulative logprob, finish reason)."""
        out = self.v.RequestOutput.from_seq_group(self.group)
        return [(tuple(c.token_ids), c.cumulative_logprob, c.finish_reason) for c in out.outputs]


# -- tinyserve ----------------------------------------------------------------------------------

class TinyserveBeam:
    """The same request through tinyserve's ``LLMEngine``, its logits replaced by the case's."""

    def __init__(self, engine, case: Case, request_id: str) -> None:
        from tinyserve import SamplingParams

        self.engine, self.case, self.request_id = engine, case, request_id
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}  # this step's logits, by beam tokens
        self.forks: list = []
        self.frees: list = []
        self.final = None
        engine.add_request(request_id, None, SamplingParams(**case.params()), prompt_token_ids=list(case.prompt))
        self.group = engine._groups[request_id]

    def execute(self, original, metas, *args):
        logits = original(metas, *args)  # the model runs: the cache orders are carried out
        rows = []
        for meta in metas:
            if meta.do_sample:
                for seq in meta.seq_data.values():
                    tokens = tuple(seq.output_token_ids)
                    self.rows[tokens] = logits_row(self.case, tokens, logits.shape[-1], self.engine.eos_token_id)
                    rows.append(self.rows[tokens])
        assert len(rows) == logits.shape[0]
        return torch.stack(rows) if rows else logits  # a prefill chunk that samples nothing

    def step(self) -> BeamState:
        """One engine step; the state of the request after it."""
        engine = self.engine
        parents = {s.seq_id for s in self.group.get_unfinished_seqs()}
        self.rows.clear()
        self.forks.clear()
        self.frees.clear()
        sched, executor = engine.scheduler, engine.executor
        fork, free, original = sched.fork_seq, sched.free_seq, executor.execute_model

        def record_fork(parent, child):
            self.forks.append(child)
            fork(parent, child)

        def record_free(seq):
            self.frees.append((seq.seq_id, tuple(seq.output_token_ids)))
            free(seq)

        sched.fork_seq, sched.free_seq = record_fork, record_free
        executor.execute_model = lambda metas, *a: self.execute(original, metas, *a)
        try:
            outputs = engine.step()
        finally:
            del sched.fork_seq, sched.free_seq, executor.execute_model  # the class's methods again
        for out in outputs:
            if out.request_id == self.request_id and out.finished:
                self.final = [(tuple(c.token_ids), c.cumulative_logprob, c.finish_reason) for c in out.outputs]
        tables = engine.scheduler.block_manager.block_tables
        seqs = self.group.get_seqs()
        # The engine's own invariant: a forked child that is not running now was freed, and the
        # running beams, and they alone, hold blocks.
        freed_ids = {i for i, _ in self.frees}
        assert all(c.seq_id in freed_ids for c in self.forks if c.is_finished() or c.seq_id not in self.group.seqs_dict)
        assert {s.seq_id for s in seqs if not s.is_finished()} == {s.seq_id for s in seqs if s.seq_id in tables}
        forked = {(tuple(c.output_token_ids[:-1]), tuple(c.output_token_ids)) for c in self.forks
                  if c.seq_id in tables}
        return BeamState(sorted((tuple(s.output_token_ids), s.cumulative_logprob) for s in seqs if not s.is_finished()),
                         sorted((tuple(s.output_token_ids), s.cumulative_logprob, s.status.finish_reason)
                                for s in seqs if s.is_finished()),
                         forked, {tokens for i, tokens in self.frees if i in parents}, self.group.is_finished())


def v04_logprobs(rows: list[torch.Tensor], own: bool) -> torch.Tensor:
    """The log-probabilities v0.4 is given: those the engine computes from these logits
    (``logprobs.token_logprobs``: logits - logsumexp), or with ``own`` those v0.4's sampler
    computes (``log_softmax``; they can differ from the engine's in the last bit)."""
    logits = torch.stack(rows)
    if own:
        return torch.log_softmax(logits, dim=-1, dtype=torch.float)
    return logits - logits.logsumexp(dim=-1, keepdim=True)


@dataclass
class CaseResult:
    steps: int = 0
    stopped_at: int | None = None
    v04_outputs: list = field(default_factory=list)
    tinyserve_outputs: list = field(default_factory=list)
    v04_group: object = None  # v0.4's SequenceGroup at the end


def run_case(engine, case: Case, request_id: str, on_step, v04_log_softmax: bool = False) -> CaseResult:
    """Run ``case`` on both sides, comparing after every step (``on_step(step, tiny, v04)``
    asserts); ``v04_log_softmax``: v0.4 computes its own log-probabilities (``v04_logprobs``).
    Returns what was compared."""
    eos = engine.eos_token_id
    v04 = V04Beam(case, eos, engine.scheduler_config.max_model_len, engine.cache_config.block_size)
    tiny = TinyserveBeam(engine, case, request_id)
    result = CaseResult()
    for step in itertools.count():
        ts = tiny.step()
        if not tiny.rows:  # a round that sampled nothing for it (not expected here)
            continue
        running = v04.running()
        missing = [tuple(s.get_output_token_ids()) for s in running
                   if tuple(s.get_output_token_ids()) not in tiny.rows]
        assert not missing, f"case {case.seed} step {step}: v0.4 runs beams tinyserve did not: {missing}"
        vs = v04.step(v04_logprobs([tiny.rows[tuple(s.get_output_token_ids())] for s in running], v04_log_softmax))
        on_step(step, ts, vs)
        result.steps += 1
        if vs.stopped or ts.stopped:
            result.stopped_at = step
            break
    result.v04_outputs = v04.outputs()
    result.v04_group = v04.group
    result.tinyserve_outputs = tiny.final
    return result
