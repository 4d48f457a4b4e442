"""vLLM 0.9.2's V1 scheduler as a test oracle, and one interface over it and tinyserve's ``policy="v1"``.

``make v1-oracle`` builds its own env, ``.venv-v1oracle`` (torch, transformers, the few packages
V1's scheduler modules import, ``vllm==0.9.2`` with ``--no-deps``, and tinyserve), and runs
``tests/test_v1_oracle.py`` there. The project's ``.venv`` has vLLM v0.4.0 (the oracle of
``test_v04_oracle.py``) instead, so there ``load`` raises ``OracleMissing`` and the test skips.

Loading. ``vllm/__init__.py`` imports the whole engine (CUDA kernels among it), so ``load`` never
runs it: it registers an empty ``vllm`` package whose ``__path__`` is the installed folder and
imports only ``vllm.v1.core.sched.scheduler`` and what that needs (``vllm.config``,
``vllm.v1.request``, ``vllm.v1.outputs``, ``vllm.v1.kv_cache_interface``, ``vllm.sampling_params``).
One of them (``vllm/transformers_utils/configs/ovis.py``) registers model types with
transformers' ``AutoConfig`` that the installed transformers already has; during the import
``AutoConfig.register`` is called with ``exist_ok=True``.

Configuration. A real ``VllmConfig`` cannot be built here: its ``ModelConfig`` inspects the
model's architecture. V1's ``Scheduler`` reads only a few of its parts, so ``make_oracle_scheduler``
gives it a stand-in (``types.SimpleNamespace``) holding V1's own ``SchedulerConfig`` and
``CacheConfig`` (real ones, built from the workload) and ``None`` or small stand-ins for the rest:
no LoRA, no KV events, no KV connector, no speculative decoding, a text-only model (no encoder
budget), one pipeline stage, and a structured-output manager that has no grammars. The KV cache
is one group of full attention (``FullAttentionSpec``) with ``num_gpu_blocks + 1`` blocks of
``block_size`` tokens: V1's ``BlockPool`` takes block 0 out of its free queue as the "null
block" (a placeholder for sliding windows that full attention never hands out), so V1 gets one
block more than tinyserve's ``num_gpu_blocks`` and both have exactly that many to allocate
(``free_blocks`` is comparable as it is). Stats are off (``log_stats=False``), the policy is FCFS.

Driving. ``OracleSide`` and ``TinyserveSide`` drive the two schedulers the same way: add a
request, schedule a step and describe what it decided (``Decision``), play the model's part
(``play``: one made-up token, ``ModelStub``, for every request whose computed tokens reach its
length, as V1's ``GPUModelRunner`` discards the sample of a partial prefill), and describe the
state (``state``). V1's side hands its tokens back through ``Scheduler.update_from_output`` with a
``ModelRunnerOutput``; tinyserve's through ``Scheduler.postprocess``. Requests finish at
``max_tokens`` or, where the stub emits EOS, at EOS unless ``ignore_eos``; both schedulers check
that themselves. With prefix caching on, each side also records every prefix-cache lookup that
admission makes while scheduling (``Lookup``: the tokens hit, and what the cache holds under each
block's name) and the names of the blocks it evicts, so that the test can tell a difference that
comes of a named simplification (a same-step hit, an eviction order) from any other. Every
request has one sample (``n=1``): V1 fans ``n > 1`` out into ``n``
requests (``vllm/v1/engine/parallel_sampling.py``), tinyserve keeps one group, so those are not
compared step by step.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import types
from dataclasses import dataclass

from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.prefix_cache import prefix_hashes
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus

VERSION = "0.9.2"
INSTALL_HINT = (f"vLLM {VERSION}, the V1 scheduler oracle, is not installed where this Python looks: run "
                f"`make v1-oracle` (it builds .venv-v1oracle with vllm=={VERSION} and runs this test there)")
EOS = 2  # the stub's end-of-sequence token; its other tokens are never below 10


class OracleMissing(RuntimeError):
    """vllm==0.9.2 is not installed where this Python looks."""


def check_version() -> None:
    """Raise OracleMissing unless vllm 0.9.2 is installed (the project's .venv has 0.4.0)."""
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise OracleMissing(INSTALL_HINT) from None
    if version != VERSION:
        raise OracleMissing(f"vllm {version} is installed, the V1 oracle is {VERSION}. {INSTALL_HINT}")


def locate() -> list[str]:
    """The installed ``vllm`` package's folder, found without importing it."""
    check_version()
    spec = importlib.util.find_spec("vllm")  # a top-level package's spec: nothing is executed
    if spec is None or not spec.submodule_search_locations:
        raise OracleMissing(INSTALL_HINT)
    return list(spec.submodule_search_locations)


@contextlib.contextmanager
def _tolerant_auto_config():
    """``AutoConfig.register`` with ``exist_ok=True`` (see the module docstring)."""
    import transformers

    auto = transformers.AutoConfig
    original = auto.__dict__["register"]
    register = original.__func__

    def tolerant(model_type, config, exist_ok=False):
        return register(model_type, config, exist_ok=True)

    auto.register = staticmethod(tolerant)
    try:
        yield
    finally:
        auto.register = original


_oracle: types.SimpleNamespace | None = None


def load() -> types.SimpleNamespace:
    """V1's scheduler modules, imported once (see the module docstring)."""
    global _oracle
    if _oracle is not None:
        return _oracle
    if "vllm" not in sys.modules:
        pkg = types.ModuleType("vllm")
        pkg.__path__ = locate()
        sys.modules["vllm"] = pkg
    else:  # imported already: its spec cannot be looked up again
        check_version()
    # vLLM logs its platform detection and a missing CUDA runtime at import, on its own handler.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    with _tolerant_auto_config():
        scheduler = importlib.import_module("vllm.v1.core.sched.scheduler")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    _oracle = types.SimpleNamespace(
        scheduler=scheduler,
        config=importlib.import_module("vllm.config"),
        request=importlib.import_module("vllm.v1.request"),
        outputs=importlib.import_module("vllm.v1.outputs"),
        kv_cache_interface=importlib.import_module("vllm.v1.kv_cache_interface"),
        sampling_params=importlib.import_module("vllm.sampling_params"),
        torch=importlib.import_module("torch"),
    )
    return _oracle


# -- the workload -------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadConfig:
    """``num_gpu_blocks`` is what each side can allocate (V1 gets one more: its null block)."""

    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = True
    watermark: float = 0.01  # tinyserve's; v1 has none (V1 has no such setting)


@dataclass(frozen=True)
class Request:
    """One request, id ``r{index:03d}``, added before step ``arrival_step`` (in list order within
    a step). ``stop_at``: the output length at which the model emits EOS (None: never), which
    ends it there unless ``ignore_eos``."""

    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    arrival_step: int = 0
    stop_at: int | None = None
    ignore_eos: bool = False

    @property
    def request_id(self) -> str:
        return f"r{self.index:03d}"


@dataclass(frozen=True)
class ModelStub:
    """The model's part: the token a request samples as its output number ``output_len + 1``,
    a pure function of the request and that length, so both sides see the same."""

    def token(self, req: Request, output_len: int) -> int:
        if req.stop_at is not None and output_len + 1 == req.stop_at:
            return EOS
        return 10 + (req.index * 7919 + output_len * 104_729) % 30_000


# -- one step, as both sides report it ----------------------------------------------------------


@dataclass
class Decision:
    """What one ``schedule()`` decided: ``scheduled`` lists (request id, tokens) in batch order
    (V1: ``SchedulerOutput.num_scheduled_tokens``, running requests first, then those admitted;
    tinyserve: ``scheduled_seq_groups``); ``preempted`` the requests preempted this step, sorted
    (V1 reports none: read off its queues, running before and waiting after); ``ignored`` the
    requests refused (tinyserve only: V1's scheduler refuses nothing)."""

    scheduled: list[tuple[str, int]]
    preempted: list[str]
    ignored: list[str]


@dataclass(frozen=True)
class Lookup:
    """One prefix-cache lookup made while scheduling a step, as admission makes it: the request,
    the tokens it hits (whole blocks, never the last token), and for each full block of the
    request's tokens, by its name, what that side's cache holds under that name at that moment
    (``states``: "cached", a block computed in an earlier step; "fresh", V1 only, a block named
    this step, allocated for tokens this step schedules and has not computed; "pending",
    tinyserve only, a block named but not computed yet; "absent", none) and whether a block of
    that name was evicted before (``evicted``)."""

    request_id: str
    hit: int
    states: tuple[str, ...]
    evicted: tuple[bool, ...]


class OracleSide:
    """vLLM 0.9.2's V1 ``Scheduler`` with its ``KVCacheManager`` and ``BlockPool``. ``lookups``
    records the step's calls of ``KVCacheManager.get_computed_blocks``; ``evicted`` the names of
    the cached blocks ``BlockPool`` has evicted (``_maybe_evict_cached_block``)."""

    name = "V1"

    def __init__(self, cfg: WorkloadConfig) -> None:
        self.o = load()
        self.cfg = cfg
        self.sched = make_oracle_scheduler(cfg)
        self.requests: dict[str, object] = {}  # V1 forgets a request once it finishes
        self.reqs: dict[str, Request] = {}
        self.out = None
        self.lookups: list[Lookup] = []
        self.evicted: list[object] = []  # the names (BlockHash) of the blocks evicted, in order
        self._named: set[tuple[int, object]] = set()  # (block id, name) of each named block, before the step
        manager = self.sched.kv_cache_manager
        pool, computed_blocks = manager.block_pool, manager.get_computed_blocks
        evict = pool._maybe_evict_cached_block

        def recording_evict(block) -> bool:
            name = block.block_hash
            evicted = evict(block)
            if evicted:
                self.evicted.append(name.block_hash)
            return evicted

        def recording_lookup(request):
            blocks, hit = computed_blocks(request)
            cached = {key.block_hash: [(block_id, key) in self._named for block_id in held]
                      for key, held in pool.cached_block_hash_to_block.items()}
            names, evicted = manager.req_to_block_hashes[request.request_id], set(self.evicted)
            states = tuple("absent" if name not in cached else "cached" if any(cached[name]) else "fresh"
                           for name in names)
            self.lookups.append(Lookup(request.request_id, hit, states, tuple(name in evicted for name in names)))
            return blocks, hit

        if cfg.enable_prefix_caching:
            pool._maybe_evict_cached_block = recording_evict
            manager.get_computed_blocks = recording_lookup

    @property
    def evictions(self) -> int:
        return len(self.evicted)

    def add(self, req: Request) -> None:
        params = self.o.sampling_params.SamplingParams(max_tokens=req.max_tokens, ignore_eos=req.ignore_eos,
                                                       temperature=1.0)
        request = self.o.request.Request(req.request_id, list(req.prompt), None, None, None, params, None,
                                         eos_token_id=EOS, arrival_time=float(req.index))
        self.requests[req.request_id] = request
        self.reqs[req.request_id] = req
        self.sched.add_request(request)

    def queues(self) -> dict[str, list[str]]:
        return {"waiting": [r.request_id for r in self.sched.waiting],
                "running": [r.request_id for r in self.sched.running]}

    def unfinished(self) -> bool:
        return self.sched.get_num_unfinished_requests() > 0

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def schedule(self) -> Decision:
        before = self.queues()["running"]
        self.lookups = []
        pool = self.sched.kv_cache_manager.block_pool
        self._named = {(block_id, name) for name, blocks in pool.cached_block_hash_to_block.items()
                       for block_id in blocks}
        self.out = out = self.sched.schedule()
        waiting = self.queues()["waiting"]
        return Decision(scheduled=list(out.num_scheduled_tokens.items()),
                        preempted=sorted(r for r in before if r in waiting), ignored=[])

    def blocks(self) -> dict[str, int]:
        """Blocks each running request holds (V1 allocates only for the tokens scheduled)."""
        manager = self.sched.kv_cache_manager
        return {r.request_id: len(manager.get_block_ids(r.request_id)[0]) for r in self.sched.running}

    def computed(self) -> dict[str, tuple[int, int]]:
        """(computed tokens, tokens) of each unfinished request, after the step has run."""
        return {r.request_id: (r.num_computed_tokens, r.num_tokens)
                for r in [*self.sched.running, *self.sched.waiting]}

    def play(self, stub: ModelStub) -> dict[str, str]:
        """The model ran the step: every scheduled request whose computed tokens reach its length
        samples one token (V1 advanced ``num_computed_tokens`` at schedule time); the others, a
        prefill chunk short of the end, sample none. Returns the requests that finished, with why."""
        scheduled = list(self.out.num_scheduled_tokens)
        sampled = []
        for rid in scheduled:
            request = self.requests[rid]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([stub.token(self.reqs[rid], request.num_output_tokens)] if done else [])
        mro = self.o.outputs.ModelRunnerOutput(
            req_ids=scheduled, req_id_to_index={rid: i for i, rid in enumerate(scheduled)},
            sampled_token_ids=sampled, spec_token_ids=None, logprobs=None, prompt_logprobs_dict={},
            pooler_output=[])
        self.sched.update_from_output(self.out, mro)
        status = self.o.request.RequestStatus
        reasons = {status.FINISHED_STOPPED: "stop", status.FINISHED_LENGTH_CAPPED: "length"}
        return {rid: reasons[self.requests[rid].status] for rid in scheduled if self.requests[rid].is_finished()}


class _NoStructuredOutput:
    """Structured output is off: no grammar, no bitmask."""

    def grammar_bitmask(self, *args):
        return None

    def should_advance(self, request) -> bool:
        return False


def make_oracle_scheduler(cfg: WorkloadConfig):
    """V1's Scheduler on a stand-in VllmConfig and a KV cache of ``num_gpu_blocks + 1`` blocks
    (see the module docstring)."""
    o = load()
    sc = o.config.SchedulerConfig(max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
                                  max_model_len=cfg.max_model_len, enable_chunked_prefill=cfg.enable_chunked_prefill,
                                  long_prefill_token_threshold=cfg.long_prefill_token_threshold)
    cc = o.config.CacheConfig(block_size=cfg.block_size, gpu_memory_utilization=0.9, swap_space=0,
                              cache_dtype="auto", enable_prefix_caching=cfg.enable_prefix_caching)
    cc.num_gpu_blocks, cc.num_cpu_blocks = cfg.num_gpu_blocks + 1, 0  # the engine sets them; + 1: the null block
    vllm_config = types.SimpleNamespace(
        scheduler_config=sc, cache_config=cc, lora_config=None, kv_events_config=None, kv_transfer_config=None,
        speculative_config=None, model_config=types.SimpleNamespace(is_multimodal_model=False),
        parallel_config=types.SimpleNamespace(data_parallel_rank=0, pipeline_parallel_size=1))
    kv = o.kv_cache_interface
    spec = kv.FullAttentionSpec(block_size=cfg.block_size, num_kv_heads=1, head_size=1, dtype=o.torch.float32,
                                use_mla=False)
    kv_cache_config = kv.KVCacheConfig(num_blocks=cfg.num_gpu_blocks + 1, kv_cache_tensors=[],
                                       kv_cache_groups=[kv.KVCacheGroupSpec(["layers.0.attn"], spec)])
    return o.scheduler.Scheduler(vllm_config, kv_cache_config, _NoStructuredOutput(), log_stats=False)


class TinyserveSide:
    """tinyserve's Scheduler under ``policy="v1"``. ``lookups`` records the step's calls of
    ``Scheduler._num_cached_tokens`` (floored to whole blocks, as the v1 round uses them);
    ``evicted`` the names of the blocks its ``CachedBlockAllocator`` has evicted (taken out of
    its evictor for a new block)."""

    name = "tinyserve"

    def __init__(self, cfg: WorkloadConfig) -> None:
        self.cfg = cfg
        self.sched = Scheduler(
            SchedulerConfig(max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
                            max_model_len=cfg.max_model_len, policy="v1",
                            enable_chunked_prefill=cfg.enable_chunked_prefill,
                            long_prefill_token_threshold=cfg.long_prefill_token_threshold),
            CacheConfig(block_size=cfg.block_size, num_gpu_blocks=cfg.num_gpu_blocks, num_cpu_blocks=0,
                        watermark=cfg.watermark, enable_prefix_caching=cfg.enable_prefix_caching))
        self.reqs: dict[str, Request] = {}
        self.out = None
        self.lookups: list[Lookup] = []
        self.evicted: list[int] = []  # the names of the blocks evicted, in order
        num_cached_tokens, manager = self.sched._num_cached_tokens, self.sched.block_manager
        allocator = manager.gpu_allocator

        def recording_lookup(group: SequenceGroup) -> int:
            cached = num_cached_tokens(group)
            names = prefix_hashes(group.get_seqs(SequenceStatus.WAITING)[0].get_token_ids(), cfg.block_size)
            blocks = [allocator.lookup(name) for name in names]
            states = tuple("absent" if b is None else "cached" if b.computed else "pending" for b in blocks)
            evicted = set(self.evicted)
            self.lookups.append(Lookup(group.request_id, cached - cached % cfg.block_size, states,
                                       tuple(name in evicted for name in names)))
            return cached

        if cfg.enable_prefix_caching:
            take = allocator._take_free_block

            def recording_take():  # the blocks that leave the evictor for it
                names = {number: block.block_hash for number, block in allocator.evictor.items()}
                block = take()
                self.evicted.extend(names[number] for number in names if number not in allocator.evictor)
                return block

            allocator._take_free_block = recording_take
            self.sched._num_cached_tokens = recording_lookup

    @property
    def evictions(self) -> int:
        return len(self.evicted)

    def add(self, req: Request) -> None:
        seq = Sequence(req.index, None, list(req.prompt), self.cfg.block_size)
        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=req.ignore_eos, temperature=1.0)
        self.reqs[req.request_id] = req
        self.sched.add_seq_group(SequenceGroup(req.request_id, [seq], params, float(req.index)))

    def queues(self) -> dict[str, list[str]]:
        return {"waiting": [g.request_id for g in self.sched.waiting],
                "running": [g.request_id for g in self.sched.running]}

    def unfinished(self) -> bool:
        return self.sched.has_unfinished_seqs()

    def free_blocks(self) -> int:
        return self.sched.block_manager.get_num_free_gpu_blocks()

    def schedule(self) -> Decision:
        self.lookups = []
        _, out = self.sched.schedule()
        self.out = out
        return Decision(scheduled=[(s.seq_group.request_id, s.token_chunk_size) for s in out.scheduled_seq_groups],
                        preempted=sorted(out.preempted), ignored=sorted(g.request_id for g in out.ignored_seq_groups))

    def blocks(self) -> dict[str, int]:
        tables = self.sched.block_manager.block_tables
        return {g.request_id: len(tables.get(g.get_seqs()[0].seq_id, [])) for g in self.sched.running}

    def computed(self) -> dict[str, tuple[int, int]]:
        return {g.request_id: (g.get_seqs()[0].num_computed_tokens, g.get_seqs()[0].get_len())
                for g in [*self.sched.running, *self.sched.waiting]}

    def play(self, stub: ModelStub) -> dict[str, str]:
        """The same step with tinyserve's bookkeeping (``Scheduler.postprocess``)."""
        groups = [s.seq_group for s in self.out.scheduled_seq_groups]
        self.sched.postprocess(self.out, lambda g, s: stub.token(self.reqs[g.request_id], s.get_output_len()),
                               eos_token_id=EOS)
        reasons = {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH_CAPPED: "length"}
        return {g.request_id: reasons[g.get_seqs()[0].status] for g in groups if g.is_finished()}
