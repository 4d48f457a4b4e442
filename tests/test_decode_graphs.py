"""Compiled decode steps (issue 38): capture sizes and padding against vLLM v0.4.0's own rule,
which batches take a graph, the engine with ``enforce_eager=False`` against the same engine run
eagerly, padding rows that never reach the KV cache, CUDA graphs' static buffers driven on the
CPU through a capture that replays eagerly, oneDNN-packed linears against ``F.linear`` and exact
arithmetic, and the settings refused up front.

The references are independent of the code under test: v0.4.0's ``_get_graph_batch_size`` and
``_BATCH_SIZES_TO_CAPTURE`` read from its installed ``model_runner.py`` (parsed with ``ast``,
never imported: the module needs CUDA), the eager model and engine, the reference attention
(``attention/reference.py``), and float64 matmuls.
"""

from __future__ import annotations

import ast
import multiprocessing
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tinyserve.attention import reference
from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.attention.opaque import step_context
from tinyserve.config import ModelConfig
from tinyserve.graphs.cuda import CudaGraphs
from tinyserve.graphs.sizes import capture_sizes, graph_size, padded_size
from tinyserve.llm import LLM
from tinyserve.model_runner import ModelInput
from tinyserve.models.loader import random_model
from tinyserve.models.packed_linear import pack, pack_linears, packed_linear, packing_supported
from tinyserve.models.tiny import make_tiny_tokenizer, tiny_config, tiny_model
from tinyserve.sampling_params import SamplingParams
from tinyserve.worker import check_graph_settings, uses_graphs

MAX_NUM_SEQS = 8  # capture sizes 1, 2, 4, 8: four compiles for the whole module
PROMPTS = ["Hello, my name is", "The future of AI is", "The life is", "List three colors:",
           "In a small village by the sea, an old fisherman"]
TOL = 1e-4  # compiled vs eager float32: inductor reorders sums, nothing more (observed ~2e-6)


# ---------------------------------------------------------------------------------------------
# The oracle: v0.4.0's capture list and padding rule, read from its installed model_runner.py.

@pytest.fixture(scope="module")
def v04() -> SimpleNamespace:
    from v04_oracle import locate  # OracleMissing, saying to run `make venv`, when it is not installed

    path = next(p for p in (Path(f) / "worker" / "model_runner.py" for f in locate()) if p.exists())
    wanted = {"_BATCH_SIZE_ALIGNMENT", "_BATCH_SIZES_TO_CAPTURE", "_get_graph_batch_size"}

    def defines(node: ast.stmt) -> set[str]:
        if isinstance(node, ast.Assign):
            return {t.id for t in node.targets if isinstance(t, ast.Name)} & wanted
        return {node.name} & wanted if isinstance(node, ast.FunctionDef) else set()

    nodes = [n for n in ast.parse(path.read_text()).body if defines(n)]
    assert set().union(*map(defines, nodes)) == wanted, f"v0.4.0's {path} no longer defines {wanted}"
    namespace: dict = {}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)
    sizes, graph_batch_size = namespace["_BATCH_SIZES_TO_CAPTURE"], namespace["_get_graph_batch_size"]
    return SimpleNamespace(
        # ModelRunner.capture_model: the list filtered to the padded max_num_seqs.
        capture_list=lambda max_num_seqs: [bs for bs in sizes if bs <= graph_batch_size(max_num_seqs)],
        # ModelRunner._prepare_decode: a graph only up to the largest captured size.
        pad=lambda n: graph_batch_size(n) if n <= sizes[-1] else None,
    )


def test_capture_sizes_and_padding_follow_v040(v04):
    for m in range(1, 301):
        sizes = capture_sizes(m)
        assert sizes == v04.capture_list(m), m
        assert [padded_size(n, sizes) for n in range(1, m + 1)] == [v04.pad(n) for n in range(1, m + 1)], m
    assert max(capture_sizes(300)) == 256 and padded_size(257, capture_sizes(300)) is None
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_num_seqs"):
            capture_sizes(bad)


# ---------------------------------------------------------------------------------------------
# Batches built by hand: which take a graph.

def make_batch(contexts: list[int], tables: list[list[int]], block_size: int, query_lens: list[int] | None = None,
               seed: int = 0, vocab: int = 100) -> ModelInput:
    """A packed batch: sequence i brings its last ``query_lens[i]`` positions (default 1: a decode)
    of a context of ``contexts[i]`` tokens stored through ``tables[i]``."""
    query_lens = query_lens or [1] * len(contexts)
    positions = [p for c, q in zip(contexts, query_lens) for p in range(c - q, c)]
    owners = [i for i, q in enumerate(query_lens) for _ in range(q)]
    slots = [tables[i][p // block_size] * block_size + p % block_size for i, p in zip(owners, positions)]
    ids = torch.randint(1, vocab, (len(positions),), generator=torch.Generator().manual_seed(seed))
    ends = torch.tensor(query_lens).cumsum(0) - 1
    return ModelInput(ids, torch.tensor(positions), AttentionMetadata.build(query_lens, contexts, tables, slots),
                      sample_indices=ends, sample_seqs=[])


def fresh(inputs: ModelInput) -> ModelInput:
    """The same batch with new metadata (a backend keeps per-batch plans on its metadata)."""
    m = inputs.attn_metadata
    meta = AttentionMetadata(m.slot_mapping.clone(), m.block_tables.clone(), m.context_lens.clone(),
                             m.query_start_loc.clone(), list(m.query_lens), list(m.context_lens_list))
    return ModelInput(inputs.input_ids.clone(), inputs.positions.clone(), meta, inputs.sample_indices.clone(),
                      [], inputs.logit_indices)


def test_graph_size_only_for_pure_decode_batches(v04):
    sizes = capture_sizes(MAX_NUM_SEQS)
    for n in range(1, MAX_NUM_SEQS + 1):
        batch = make_batch([5 + i for i in range(n)], [[i] for i in range(n)], 16)
        assert graph_size(batch, sizes) == v04.pad(n)
    assert graph_size(make_batch([3] * 9, [[i] for i in range(9)], 16), sizes) is None  # past the largest
    prefill = make_batch([6], [[0]], 16, query_lens=[6])
    assert graph_size(prefill, sizes) is None
    mixed = make_batch([7, 6], [[0], [1]], 16, query_lens=[1, 6])
    assert graph_size(mixed, sizes) is None
    chunk = make_batch([10], [[0]], 16, query_lens=[2])  # a prefill chunk over a cached prefix
    assert graph_size(chunk, sizes) is None
    decode = make_batch([5, 6, 7], [[0], [1], [2]], 16)
    assert graph_size(decode, sizes) == 4
    decode.logit_indices = torch.tensor([0, 1, 2, 0])  # a request asked for prompt logprobs
    assert graph_size(decode, sizes) is None


# ---------------------------------------------------------------------------------------------
# The engine: compiled decode steps against the same engine run eagerly.

@pytest.fixture(scope="module")
def llms(tiny_model_dir):
    """(compiled, eager): the tiny model with and without graphs. Compiles happen lazily, one per
    padded size, and the test of a shrinking batch runs first so that it sees all four."""
    kwargs = dict(model=str(tiny_model_dir), device="cpu", dtype="float32", max_num_seqs=MAX_NUM_SEQS,
                  num_gpu_blocks=64, num_cpu_blocks=16)
    return LLM(enforce_eager=False, **kwargs), LLM(enforce_eager=True, **kwargs)


@contextmanager
def graph_calls(llm: LLM):
    """Record (real rows, rows the compiled graph received) for every step run through a graph."""
    graphs = llm.engine.executor.decode_graphs
    calls: list[tuple[int, int]] = []
    run, graph = graphs.run, graphs._graph
    received: list[int] = []

    def spy_graph(input_ids, positions):
        received.append(input_ids.shape[0])
        return graph(input_ids, positions)

    def spy_run(inputs):
        received.clear()
        hidden = run(inputs)
        if hidden is not None:
            assert len(received) == 1 and hidden.shape[0] == inputs.attn_metadata.num_seqs
            calls.append((inputs.attn_metadata.num_seqs, received[0]))
        return hidden

    graphs.run, graphs._graph = spy_run, spy_graph
    try:
        yield calls
    finally:
        graphs.run, graphs._graph = run, graph


def test_sizes_compiled_ahead_serve_every_step_without_recompiling(tiny_model_dir):
    """compile_all (what a server runs before it answers) must build the graphs the steps use:
    compiled outside inference mode they would each be compiled again on first use, a second
    compile per size in the middle of serving."""
    llm = LLM(model=str(tiny_model_dir), device="cpu", dtype="float32", max_num_seqs=2, num_gpu_blocks=32,
              num_cpu_blocks=0, enforce_eager=False)
    llm.engine.executor.warm_up_graphs()
    assert sorted(llm.engine.executor.decode_graphs.compile_seconds) == [1, 2]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 6)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        outs = llm.generate(["Hello, my name is", "The life is"], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 6]


def assert_same_outputs(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert len(g.outputs) == len(w.outputs)
        for a, b in zip(g.outputs, w.outputs):
            assert a.token_ids == b.token_ids, g.request_id
            assert a.logprobs is not None and len(a.logprobs) == len(a.token_ids)
            for la, lb in zip(a.logprobs, b.logprobs):
                assert la.keys() == lb.keys()
                assert all(abs(la[t] - lb[t]) <= TOL for t in la), (la, lb)
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=TOL * len(a.token_ids))


def test_shrinking_batch_runs_on_every_padded_size(llms, v04):
    compiled, eager = llms
    assert compiled.engine.executor.use_graphs and eager.engine.executor.decode_graphs is None
    graphs = compiled.engine.executor.decode_graphs
    before = set(graphs.compile_seconds)
    max_tokens = [2, 2, 4, 5, 8]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=1) for m in max_tokens]
    with graph_calls(compiled) as calls:
        got = compiled.generate(PROMPTS, params)
    want = eager.generate(PROMPTS, params)
    assert_same_outputs(got, want)
    # One prefill round samples every first token; decode step j then runs the sequences that
    # want more than j tokens.
    real = [sum(m > j for m in max_tokens) for j in range(1, max(max_tokens))]
    assert real == [5, 3, 3, 2, 1, 1, 1]
    assert calls == [(n, v04.pad(n)) for n in real]
    assert set(graphs.compile_seconds) == before | {v04.pad(n) for n in real} == {1, 2, 4, 8}
    assert all(s > 0 for s in graphs.compile_seconds.values())


def test_parallel_sampling_with_a_seed_matches_eager(llms, v04):
    compiled, eager = llms
    params = [SamplingParams(n=2, best_of=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True, logprobs=1),
              SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=5, max_tokens=4, ignore_eos=True, logprobs=1)]
    with graph_calls(compiled) as calls:
        got = compiled.generate(PROMPTS[:2], params)
    want = eager.generate(PROMPTS[:2], params)
    assert_same_outputs(got, want)
    assert [len(o.outputs) for o in got] == [2, 2]
    assert calls and all(size == v04.pad(n) for n, size in calls)
    assert calls[0] == (5, 8)  # 3 + 2 sequences, padded


def test_prompt_logprobs_prefill_runs_eagerly_and_matches(llms):
    compiled, eager = llms
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)]
    with graph_calls(compiled) as calls:
        got = compiled.generate(PROMPTS[3:5], params)
    want = eager.generate(PROMPTS[3:5], params)
    assert_same_outputs(got, want)
    assert calls == [(2, 2)] * 3  # the prefill (it asks for prompt rows) ran eagerly, the decodes did not
    g, w = got[0].prompt_logprobs, want[0].prompt_logprobs
    assert g[0] is None and w[0] is None and len(g) == len(w) == len(got[0].prompt_token_ids)
    for a, b in zip(g[1:], w[1:]):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= TOL for t in a)


def changed_slots(before: list[tuple[torch.Tensor, torch.Tensor]],
                  after: list[tuple[torch.Tensor, torch.Tensor]]) -> list[set[int]]:
    """Per layer, the flat cache slots whose key or value changed."""
    out = []
    for (k0, v0), (k1, v1) in zip(before, after):
        diff = (k0 != k1).flatten(2).any(-1) | (v0 != v1).flatten(2).any(-1)  # [blocks, block_size]
        out.append(set(diff.flatten().nonzero().flatten().tolist()))
    return out


def test_padding_rows_never_reach_the_cache(llms):
    compiled, _ = llms
    worker = compiled.engine.executor
    assert not compiled.engine.has_unfinished_requests()  # the cache is ours to scribble on
    caches = worker.cache_engine.gpu_cache
    torch.manual_seed(3)
    for k, v in caches:
        k.normal_()
        v.normal_()
    bs = worker.block_size
    batch = make_batch([20, 9, 40], [[3, 4], [7], [10, 11, 12]], bs, vocab=worker.model.config.vocab_size)
    real_slots = set(batch.attn_metadata.slot_mapping.tolist())
    assert 0 not in real_slots and len(real_slots) == 3
    snapshot = [(k.clone(), v.clone()) for k, v in caches]
    eager_caches = [(k.clone(), v.clone()) for k, v in caches]
    with torch.inference_mode(), graph_calls(compiled) as calls:  # inference mode, as the engine's compiles
        hidden = worker.decode_graphs.run(batch)
        want = worker.model(batch.input_ids, batch.positions, eager_caches, fresh(batch).attn_metadata)
    assert calls == [(3, 4)]
    assert changed_slots(snapshot, caches) == [real_slots] * worker.num_layers  # slot 0 and the rest untouched
    for (k, v), (ek, ev) in zip(caches, eager_caches):
        torch.testing.assert_close(k, ek, atol=1e-5, rtol=0)
        torch.testing.assert_close(v, ev, atol=1e-5, rtol=0)
    torch.testing.assert_close(hidden, want, atol=TOL, rtol=0)


def test_opaque_attention_zeroes_padding_rows_and_stores_only_real_ones():
    num_heads, num_kv_heads, head_dim, bs, layers = 4, 2, 8, 4, 2
    g = torch.Generator().manual_seed(0)
    caches = [(torch.randn(16, bs, num_kv_heads, head_dim, generator=g),
               torch.randn(16, bs, num_kv_heads, head_dim, generator=g)) for _ in range(layers)]
    batch = make_batch([6, 3, 9], [[1, 2], [5], [8, 9, 10]], bs)
    meta = batch.attn_metadata
    q = torch.randn(4, num_heads, head_dim, generator=g)  # 3 real rows, 1 padding row
    k, v = torch.randn(4, num_kv_heads, head_dim, generator=g), torch.randn(4, num_kv_heads, head_dim, generator=g)
    snapshot = [(kc.clone(), vc.clone()) for kc, vc in caches]
    with step_context(reference.TorchBackend(), meta, 3, caches):
        out = torch.ops.tinyserve.paged_attention(q, k, v, 1, 0.3)
    assert out.shape == q.shape
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    ref_k, ref_v = snapshot[1][0].clone(), snapshot[1][1].clone()
    reference.store_kv(k[:3], v[:3], ref_k, ref_v, meta.slot_mapping)
    torch.testing.assert_close(out[:3], reference.paged_attention(q[:3], ref_k, ref_v, meta, 0.3))
    assert changed_slots(snapshot, caches) == [set(), set(meta.slot_mapping.tolist())]
    assert torch.equal(caches[1][0], ref_k) and torch.equal(caches[1][1], ref_v)
    with pytest.raises(RuntimeError, match="step_context"):
        torch.ops.tinyserve.paged_attention(q, k, v, 0, 0.3)


# ---------------------------------------------------------------------------------------------
# CUDA graphs on the CPU: a capture that replays the step eagerly over the same static buffers.

class TensorDecodeBackend:
    """The reference attention, taking a decode batch's work from the ``block_tables`` and
    ``context_lens`` tensors alone (``reference.paged_decode_attention``), as the Triton decode
    kernel that CUDA graphs replay does; other batches as ``reference.paged_attention``."""

    name = "reference-tensors"
    graph_safe = True  # reads only tensors in a decode batch, as graphs/cuda.py requires

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping):
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, q, k_cache, v_cache, meta, scale):
        if meta.is_decode:
            return reference.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        return reference.paged_attention(q, k_cache, v_cache, meta, scale)


BS, MAX_CONTEXT = 4, 32  # 8 blocks per static block table


def eager_capture(order: list[int] | None = None):
    """A ``Capture`` that runs ``fn`` once, then again on every replay into the same output."""
    def capture(fn):
        out = fn()
        if order is not None:
            order.append(out.shape[0])
        return (lambda: out.copy_(fn())), out
    return capture


def random_caches(model, num_blocks: int = 128, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BS, model.num_kv_heads, model.head_dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(model.num_layers)]


def decode_batch(n: int, seed: int, vocab: int) -> ModelInput:
    """``n`` decode rows with contexts 1..MAX_CONTEXT and blocks of their own."""
    g = torch.Generator().manual_seed(seed)
    contexts = torch.randint(1, MAX_CONTEXT + 1, (n,), generator=g).tolist()
    blocks = (torch.randperm(127, generator=g) + 1).tolist()  # block 0 is never anyone's
    tables, used = [], 0
    for c in contexts:
        k = -(-c // BS)
        tables.append(blocks[used:used + k])
        used += k
    return make_batch(contexts, tables, BS, seed=seed, vocab=vocab)


@pytest.fixture(scope="module")
def cuda_graphs():
    model = tiny_model().model
    model.set_attention_backend(TensorDecodeBackend())
    order: list[int] = []
    graphs = CudaGraphs(model, random_caches(model), capture_sizes(MAX_NUM_SEQS), BS, MAX_CONTEXT,
                        capture=eager_capture(order))
    graphs.capture_all()
    return graphs, order


@torch.inference_mode()
def test_cuda_graphs_replay_matches_eager(cuda_graphs, v04):
    graphs, order = cuda_graphs
    assert set(graphs.graphs) == set(v04.capture_list(MAX_NUM_SEQS)) and order == [8, 4, 2, 1]  # largest first
    model = graphs.model
    for n, seed in [(1, 0), (2, 1), (3, 2), (5, 3), (8, 4), (4, 5)]:
        batch = decode_batch(n, seed, model.config.vocab_size)
        eager_caches = [(k.clone(), v.clone()) for k, v in graphs.kv_caches]
        hidden = graphs.run(batch)
        want = model(batch.input_ids, batch.positions, eager_caches, fresh(batch).attn_metadata)
        assert hidden.shape == want.shape
        torch.testing.assert_close(hidden, want, atol=1e-5, rtol=0)
        for (k, v), (ek, ev) in zip(graphs.kv_caches, eager_caches):  # the same slots stored, no others
            torch.testing.assert_close(k, ek, atol=1e-5, rtol=0)
            torch.testing.assert_close(v, ev, atol=1e-5, rtol=0)
        assert graphs.graphs[v04.pad(n)][1].shape[0] == v04.pad(n)


@torch.inference_mode()
def test_cuda_graphs_over_the_triton_backend(v04):
    """The backend a GPU records: the package's Triton store and decode kernels (interpreted on a
    CPU), over the static metadata whose host-side bound is max_context_len for every row. The
    replays equal the eager Triton model's, padding rows included in the kernels' grid."""
    from tinyserve.attention.triton_backend import TritonBackend

    model = tiny_model().model
    model.set_attention_backend(TritonBackend())
    graphs = CudaGraphs(model, random_caches(model), capture_sizes(4), BS, MAX_CONTEXT, capture=eager_capture([]))
    graphs.capture_all()
    for n, seed in [(3, 20), (1, 21), (4, 22)]:
        batch = decode_batch(n, seed, model.config.vocab_size)
        eager_caches = [(k.clone(), v.clone()) for k, v in graphs.kv_caches]
        hidden = graphs.run(batch)
        want = model(batch.input_ids, batch.positions, eager_caches, fresh(batch).attn_metadata)
        torch.testing.assert_close(hidden, want, atol=1e-5, rtol=0)
        for (k, v), (ek, ev) in zip(graphs.kv_caches, eager_caches):
            assert torch.equal(k, ek) and torch.equal(v, ev)
        assert graphs.graphs[v04.pad(n)][1].shape[0] == v04.pad(n)
    assert model.backend.route_counts["decode-kernel"] > 0  # the kernel ran, not a fallback


@torch.inference_mode()
def test_cuda_graphs_static_buffers_pad_the_rows_past_the_batch(cuda_graphs):
    graphs, _ = cuda_graphs
    vocab = graphs.model.config.vocab_size
    assert graphs.run(decode_batch(7, 10, vocab)) is not None  # leaves real values in rows 0..6
    batch = decode_batch(5, 11, vocab)
    meta = batch.attn_metadata
    assert graphs.run(batch).shape[0] == 5
    n, width = 5, meta.block_tables.shape[1]
    assert torch.equal(graphs.input_ids[:n], batch.input_ids)
    assert torch.equal(graphs.positions[:n], batch.positions)
    assert torch.equal(graphs.slot_mapping[:n], meta.slot_mapping)
    assert torch.equal(graphs.context_lens[:n], meta.context_lens)
    assert torch.equal(graphs.block_tables[:n, :width], meta.block_tables)
    assert not graphs.block_tables[:n, width:].any()
    assert graphs.input_ids[n:8].eq(0).all() and graphs.positions[n:8].eq(0).all()
    assert graphs.slot_mapping[n:8].eq(-1).all() and graphs.context_lens[n:8].eq(1).all()
    assert not graphs.block_tables[n:8].any()


@torch.inference_mode()
def test_cuda_graphs_leave_other_batches_to_eager(cuda_graphs):
    graphs, _ = cuda_graphs
    vocab = graphs.model.config.vocab_size
    fits = make_batch([MAX_CONTEXT, 3], [list(range(1, 9)), [9]], BS, vocab=vocab)
    assert graphs.run(fits) is not None
    too_long = make_batch([MAX_CONTEXT + 1, 3], [list(range(1, 10)), [10]], BS, vocab=vocab)
    assert graphs.run(too_long) is None
    assert graphs.run(make_batch([5], [[1, 2]], BS, query_lens=[5], vocab=vocab)) is None  # a prefill
    assert graphs.run(make_batch([6, 5], [[1, 2], [3, 4]], BS, query_lens=[1, 5], vocab=vocab)) is None
    assert graphs.run(decode_batch(9, 12, vocab)) is None  # past the largest size


@torch.inference_mode()
def test_cuda_graphs_refuse_or_handle_a_backend_reading_host_context_lengths():
    model = tiny_model(attention_backend="torch").model
    # The "torch" reference plans from the host-side context lengths, which a recorded graph
    # would freeze at max_context_len for every row: refused by name rather than decoded wrongly.
    with pytest.raises(ValueError, match="graph_safe"):
        CudaGraphs(model, random_caches(model), capture_sizes(4), BS, MAX_CONTEXT, capture=eager_capture())


# ---------------------------------------------------------------------------------------------
# Linears on oneDNN-packed bf16 weights.

BF16_SUPPORTED = packing_supported(torch.zeros(1, 1, dtype=torch.bfloat16))
needs_bf16 = pytest.mark.skipif(not BF16_SUPPORTED, reason="this CPU's oneDNN has no bf16 kernels")


@needs_bf16
@pytest.mark.parametrize("shape", [(192, 64), (400, 64), (64, 128)])
def test_packed_linear_equals_f_linear(shape):
    # bf16 inputs, fp32 accumulation, one rounding of the output to bf16 (8 significant bits):
    # against the exact float64 product of the same bf16 values the error is at most half an ulp,
    # 2**-8 of the value, plus the fp32 accumulation's error, far below 2**-16 of sum |x w| for
    # these widths (<= 128 terms of 2**-24 each).
    out_features, in_features = shape
    g = torch.Generator().manual_seed(out_features + in_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    handle = pack(w, b)
    for n in (1, 5, 16, 33):
        x = torch.randn(n, in_features, generator=g).bfloat16()
        got = packed_linear(x, handle)
        assert got.dtype == torch.bfloat16 and got.shape == (n, out_features)
        exact = x.double() @ w.double().T + b.double()
        bound = exact.abs() * 2**-8 + (x.double().abs() @ w.double().abs().T + b.double().abs()) * 2**-16
        assert ((got.double() - exact).abs() <= bound).all(), n
        plain = F.linear(x, w, b).double()
        assert ((got.double() - plain).abs() <= 2 * bound).all(), n  # both within half an ulp of exact
    no_bias = pack(w)
    x = torch.randn(3, in_features, generator=g).bfloat16()
    exact = x.double() @ w.double().T
    bound = exact.abs() * 2**-8 + (x.double().abs() @ w.double().abs().T) * 2**-16
    assert ((packed_linear(x, no_bias).double() - exact).abs() <= bound).all()


def test_float32_models_are_not_packed():
    model = tiny_model().model
    assert not packing_supported(model.head_weight)
    assert pack_linears(model) == 0
    assert model.packed_head is None
    assert all(m.packed is None for m in model.modules() if hasattr(m, "packed"))


@needs_bf16
@torch.inference_mode()
def test_packed_bf16_model_matches_unpacked():
    tokenizer = make_tiny_tokenizer()
    model = random_model(tiny_config(tokenizer), device="cpu", dtype=torch.bfloat16, seed=0, attention_backend="torch")
    vocab = model.config.vocab_size
    caches = [(k.bfloat16(), v.bfloat16()) for k, v in random_caches(model)]
    batch = decode_batch(5, 7, vocab)
    unpacked_caches = [(k.clone(), v.clone()) for k, v in caches]
    h0 = model(batch.input_ids, batch.positions, unpacked_caches, fresh(batch).attn_metadata)
    logits0 = model.compute_logits(h0)
    linears = [m for m in model.modules() if hasattr(m, "packed")]
    expected_bytes = sum(m.weight.numel() for m in linears) * 2 + model.head_weight.numel() * 2
    assert pack_linears(model) == expected_bytes
    assert model.packed_head is not None and all(m.packed is not None for m in linears)
    h1 = model(batch.input_ids, batch.positions, caches, fresh(batch).attn_metadata)
    logits1 = model.compute_logits(h1)
    # Two layers of bf16 matmuls, each output within half an ulp (2**-8 relative) of exact: a
    # difference of a few ulps of the hidden states' scale. The packed and plain kernels agree
    # to the bit on this CPU; the bound leaves room for another blocking's summation order.
    scale = h0.abs().max().item()
    torch.testing.assert_close(h1.float(), h0.float(), atol=4 * 2**-8 * scale, rtol=0)
    torch.testing.assert_close(logits1, logits0, atol=4 * 2**-8 * logits0.abs().max().item(), rtol=0)
    assert logits1.argmax(-1).tolist() == logits0.argmax(-1).tolist()
    for (k, v), (uk, uv) in zip(caches, unpacked_caches):
        torch.testing.assert_close(k.float(), uk.float(), atol=4 * 2**-8 * uk.abs().max().item(), rtol=0)
        torch.testing.assert_close(v.float(), uv.float(), atol=4 * 2**-8 * uv.abs().max().item(), rtol=0)


# ---------------------------------------------------------------------------------------------
# Settings refused before anything loads.

def test_enforce_eager_is_validated_before_loading(tmp_path):
    missing = str(tmp_path / "no-such-model")  # loading anything would fail differently
    with pytest.raises(ValueError, match="enforce_eager"):
        LLM(model=missing, device="cpu", enforce_eager="yes")
    children = set(multiprocessing.active_children())
    start = time.perf_counter()
    with pytest.raises(ValueError, match="enforce_eager=False.*tensor_parallel_size"):
        LLM(model=missing, device="cpu", enforce_eager=False, tensor_parallel_size=2)
    assert time.perf_counter() - start < 1.0
    assert set(multiprocessing.active_children()) == children  # no rank was started


def test_uses_graphs_defaults():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert uses_graphs(None, cpu) is False
    assert uses_graphs(None, cuda) is True
    assert uses_graphs(None, cuda, tp_size=2) is False
    assert uses_graphs(True, cuda) is False and uses_graphs(False, cpu) is True
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        uses_graphs(False, cuda, tp_size=2)


def test_default_on_the_cpu_is_eager(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), device="cpu", dtype="float32", num_gpu_blocks=32, num_cpu_blocks=0)
    assert llm.engine.executor.use_graphs is False and llm.engine.executor.decode_graphs is None


def test_enforce_eager_zero_is_not_a_way_past_the_tensor_parallel_check():
    with pytest.raises(ValueError, match="enforce_eager"):
        ModelConfig(model="m", device="cpu", enforce_eager=0)
        check_graph_settings(0, 2)


# ---------------------------------------------------------------------------------------------
# Compiled steps in the middle of everything: preemption (swap and recompute), prefix caching with
# chunked prefill under v1, beam search. Each must give the eager engine's tokens exactly.

EDGE_CASES = {
    # A cache too small for the batch: requests are preempted and come back.
    "swap": dict(policy="vllm", preemption_mode="swap", num_gpu_blocks=12, num_cpu_blocks=32),
    "recompute": dict(policy="vllm", preemption_mode="recompute", num_gpu_blocks=12, num_cpu_blocks=0),
    "v1": dict(policy="v1", num_gpu_blocks=14, num_cpu_blocks=0, max_num_batched_tokens=16),
}


def _edge_run(tiny_model_dir, enforce_eager: bool, case: str):
    llm = LLM(model=str(tiny_model_dir), device="cpu", dtype="float32", max_num_seqs=4, block_size=4,
              max_model_len=40, enforce_eager=enforce_eager, **EDGE_CASES[case])
    # Under v1 the prompts share a prefix that its prefix cache keeps; elsewhere short prompts with
    # long outputs outgrow the 12 blocks, and running requests are preempted.
    shared = "You are a helpful assistant. " if case == "v1" else ""
    prompts = [shared + p for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=14 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_compiled_steps_under_preemption_and_prefix_caching_equal_eager(tiny_model_dir, case):
    want, eager = _edge_run(tiny_model_dir, True, case)
    got, compiled = _edge_run(tiny_model_dir, False, case)
    assert got == want
    assert compiled.engine.executor.decode_graphs.compile_seconds, "no step ran on a graph"
    if case in ("swap", "recompute"):  # the cache was small enough to preempt, in both engines alike
        assert compiled.engine.num_preemptions_total == eager.engine.num_preemptions_total > 0


def test_compiled_beam_search_equals_eager(tiny_model_dir):
    params = SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0, max_tokens=8)
    results = []
    for enforce_eager in (True, False):
        llm = LLM(model=str(tiny_model_dir), device="cpu", dtype="float32", max_num_seqs=8, num_gpu_blocks=64,
                  num_cpu_blocks=16, enforce_eager=enforce_eager)
        outs = llm.generate(PROMPTS[:2], params)
        results.append([[(c.token_ids, round(c.cumulative_logprob, 4)) for c in o.outputs] for o in outs])
    assert results[0] == results[1]


@pytest.mark.skipif(not BF16_SUPPORTED, reason="this CPU's oneDNN has no bf16 kernels")
def test_bf16_compiled_tokens_part_from_eager_only_at_a_near_tie(tiny_model_dir):
    """In bfloat16 the compiled step is not bit for bit the eager one: inductor keeps a fused
    stretch in float32 where eager rounds after every op, and the packed matmuls block their sums
    differently. The rule, as for bf16 elsewhere in the book: greedy tokens agree until the first
    step where the eager run's two best tokens are within a bf16 rounding of each other
    (``NEAR_TIE`` in log-probability), and up to there every token is the same."""
    near_tie = 0.05  # a few bf16 ulps of a logit of order 1-10
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    runs = []
    for enforce_eager in (True, False):
        llm = LLM(model=str(tiny_model_dir), device="cpu", dtype="bfloat16", max_num_seqs=4, num_gpu_blocks=64,
                  num_cpu_blocks=0, enforce_eager=enforce_eager)
        runs.append(llm.generate(PROMPTS[:4], params))
        if not enforce_eager:
            assert llm.engine.executor.decode_graphs.compile_seconds
            assert any(layer.mlp.gate_up_proj.packed is not None for layer in llm.engine.executor.model.layers)
    agreed = 0
    for eager, compiled in zip(*runs):
        a, b = eager.outputs[0], compiled.outputs[0]
        for pos, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                top = sorted(a.logprobs[pos].values(), reverse=True)
                top = [getattr(t, "logprob", t) for t in top]
                assert top[0] - top[1] < near_tie, (eager.request_id, pos, top)
                break
            agreed += 1
    assert agreed >= 24  # most of the 48 tokens, not a vacuous pass
