"""Tensor parallelism on the CPU (gloo): k ranks in k processes must compute what one rank does.

The references are independent of the parallel code: a single in-process Worker (k=1) on the
same weights, and the real sharded model's parameter shapes. Starting worker processes costs
seconds on a 2-core machine, so each process group is a module-scoped fixture shared by the
tests that need it, and the tests that break a group come last in its users.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import make_tiny_model_dir
from safetensors.torch import load_file, save_file
from slow_rank import SleepyBackend

from tinyserve import LLM, SamplingParams, presets
from tinyserve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.models.llama import LlamaForCausalLM
from tinyserve.parallel import (
    TensorParallelExecutor,
    WorkerError,
    check_shardable,
    shard_shapes,
    valid_tp_sizes,
    weight_bytes,
    weight_bytes_per_rank,
)
from tinyserve.sequence import SamplingParams as SP
from tinyserve.sequence import Sequence, SequenceGroupMetadata
from tinyserve.worker import Worker

ATOL = 1e-5
BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["Hello, my name is", "The future of AI is", "The life is", "Paged attention keeps"]


def assert_gone(pids: list[int], within_s: float = 10.0) -> None:
    """No process with these pids is left (a zombie would count as left only if never reaped)."""
    deadline = time.monotonic() + within_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if alive:
            time.sleep(0.1)
    assert not alive, f"worker processes left behind: {alive}"
    mine = {c.pid for c in psutil.Process().children(recursive=True)}
    assert not mine & set(pids)
    assert not {c.pid for c in multiprocessing.active_children()} & set(pids)


# -- a tiny MHA model with biases, driven round by round -----------------------------------

@pytest.fixture(scope="module")
def biased_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 heads and 4 KV heads, tied embeddings, q/k/v/o and MLP biases. transformers initializes
    biases to 0 and norms to 1; they are randomized so that adding a row-parallel bias on every
    rank (instead of once) or mis-sharding a norm would show in the logits."""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-biased"), seed=3, num_key_value_heads=4,
                               attention_bias=True, mlp_bias=True, tie_word_embeddings=True)
    state = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    for name, t in state.items():
        if name.endswith("bias") or "norm" in name:
            state[name] = t + 0.2 * torch.randn(t.shape, generator=gen)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def config_for(path: Path) -> ModelConfig:
    return ModelConfig(model=str(path), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def tp_executor(biased_model_dir):
    executor = TensorParallelExecutor(config_for(biased_model_dir), ParallelConfig(tensor_parallel_size=2), "torch")
    executor.init_cache(CacheConfig(block_size=BLOCK, num_gpu_blocks=16, num_cpu_blocks=8))
    yield executor
    executor.shutdown()


def meta(seq: Sequence, table: list[int], prompt: bool) -> SequenceGroupMetadata:
    chunk = seq.get_len() - seq.num_computed_tokens
    return SequenceGroupMetadata(f"r{seq.seq_id}", prompt, {seq.seq_id: seq}, SP(temperature=0.0),
                                 {seq.seq_id: table}, token_chunk_size=chunk)


def test_logits_match_one_rank_through_prefill_decode_swap_and_copy(biased_model_dir, tp_executor):
    single = Worker(config_for(biased_model_dir), "torch")
    single.init_cache(CacheConfig(block_size=BLOCK, num_gpu_blocks=16, num_cpu_blocks=8))
    assert [info["num_heads"] for info in tp_executor.rank_info] == [2, 2]
    s0 = Sequence(0, None, [5, 17, 90, 3, 44, 100, 7], BLOCK)
    s1 = Sequence(1, None, [12, 99, 321, 8, 2], BLOCK)
    tables = {0: [5, 2], 1: [0, 7]}
    worst = 0.0

    def run(seqs, prompt=False, swap_in=None, swap_out=None, copy=None, runner_up=()):
        """One round on both executors; every sequence then takes k=1's greedy token (or its
        runner-up, so a fork's branch differs from its parent's)."""
        nonlocal worst
        groups = [meta(s, list(tables[s.seq_id]), prompt) for s in seqs]
        orders = (swap_in or {}, swap_out or {}, copy or {})
        want = single.execute_model(groups, *orders)
        got = tp_executor.execute_model(groups, *orders)
        assert got.dtype == torch.float32 and got.shape == want.shape == (len(seqs), single.loaded.hf_config.vocab_size)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        worst = max(worst, (got - want).abs().max().item())
        for s, row in zip(seqs, want):
            s.num_computed_tokens = s.get_len()
            s.append_token_id(row.topk(2).indices[1 if s in runner_up else 0].item())

    run([s0, s1], prompt=True)  # packed prefill: 7 + 5 tokens
    run([s0, s1])  # s0 fills its block 2 (positions 4-7)
    run([s1], swap_out={5: 0, 2: 1})  # s0 is preempted: its blocks go to CPU blocks 0 and 1
    tables[0] = [3, 6, 8]  # ... and come back into GPU blocks 3 and 6, with a new block 8
    run([s0], swap_in={0: 3, 1: 6})
    child = s0.fork(2)  # parallel sampling: shares blocks 3 and 6, copies the partial block 8
    tables[2] = [3, 6, 4]
    run([s0, child], copy={8: [4]}, runner_up=(child,))
    run([s0, s1, child])
    run([child, s0])
    print(f"largest |logit difference| k=2 vs k=1: {worst:.2e}")


def test_a_failing_round_raises_and_stops_every_worker(tp_executor):
    pids = tp_executor.worker_pids
    seq = Sequence(0, None, [1, 2, 3], BLOCK)
    bad = [meta(seq, [10_000], True)]  # a block far outside the 16-block cache
    with pytest.raises(WorkerError, match=r"rank \d failed in 'execute_model'(.|\n)*IndexError|index"):
        tp_executor.execute_model(bad, {}, {}, {})
    assert not tp_executor.is_running
    assert_gone(pids)
    with pytest.raises(WorkerError, match="shut down"):
        tp_executor.execute_model([], {}, {}, {})


# -- through LLM, with preemption by swapping ----------------------------------------------

@pytest.fixture(scope="module")
def tp2_llm(tiny_model_dir):
    # 8 blocks of 4 tokens for four sequences that grow to 15-17 tokens: constant swapping.
    llm = LLM(model=str(tiny_model_dir), device="cpu", tensor_parallel_size=2, block_size=BLOCK,
              num_gpu_blocks=8, num_cpu_blocks=32, max_model_len=32, preemption_mode="swap", watermark=0.0,
              record_history=True)
    yield llm
    llm.engine.executor.shutdown()


def test_greedy_tokens_match_one_rank_under_swap_preemption(tiny_model_dir, tp2_llm):
    single = LLM(model=str(tiny_model_dir), device="cpu", num_gpu_blocks=256, num_cpu_blocks=0)
    want = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY)]
    got = [o.outputs[0].token_ids for o in tp2_llm.generate(PROMPTS, GREEDY)]
    assert got == want
    history = tp2_llm.engine.history
    assert any(r.swapped_out for r in history) and any(r.swapped_in for r in history)
    bm = tp2_llm.engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == 8 and bm.get_num_free_cpu_blocks() == 32


def test_a_worker_that_dies_is_a_clear_error_not_a_hang(tp2_llm):
    executor = tp2_llm.engine.executor
    pids = executor.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) died"):
        tp2_llm.generate(PROMPTS[:1], GREEDY)
    assert time.monotonic() - start < 30
    assert_gone(pids)


# -- a worker that stops answering: stopped (no heartbeat) or stuck (past the round deadline) --

def test_the_default_limits_on_a_silent_worker_are_well_under_a_minute():
    config = ParallelConfig(tensor_parallel_size=2)
    assert config.heartbeat_timeout_s < 60 and config.step_timeout_s < 60
    for bad in (dict(heartbeat_timeout_s=0), dict(step_timeout_s=-1.0), dict(heartbeat_timeout_s="5")):
        with pytest.raises(ValueError, match="positive number of seconds or None"):
            ParallelConfig(**bad)
    with pytest.raises(ValueError, match="step_timeout_factor must be a number >= 1"):
        ParallelConfig(step_timeout_factor=0.5)
    ParallelConfig(heartbeat_timeout_s=None, step_timeout_s=None)  # both checks off: allowed


def test_a_stopped_worker_fails_the_step_within_seconds_and_is_killed(tiny_model_dir):
    engine = LLMEngine(ModelConfig(model=str(tiny_model_dir), device="cpu"),
                       CacheConfig(block_size=BLOCK, num_gpu_blocks=16, num_cpu_blocks=0),
                       SchedulerConfig(max_model_len=32, max_num_batched_tokens=32, max_num_seqs=4),
                       ParallelConfig(tensor_parallel_size=2, heartbeat_timeout_s=2.0))
    pids = engine.executor.worker_pids
    try:
        engine.add_request("r", PROMPTS[0], GREEDY)
        engine.step()  # one round that works: both ranks are up and beating
        os.kill(pids[1], signal.SIGSTOP)  # rank 0 will wait for it in the first all-reduce
        start = time.monotonic()
        with pytest.raises(WorkerError, match=rf"rank 1 \(pid {pids[1]}\) stopped answering during 'execute_model': "
                                              r"no heartbeat for [\d.]+ s(.|\n)*stopped by a signal"):
            engine.step()
        took = time.monotonic() - start
    finally:
        engine.executor.shutdown()  # a no-op after the failure; if the test failed, no stopped process is left
    assert 2.0 <= took < 15, took  # the heartbeat timeout, the SIGKILL and the shutdown of rank 0
    assert_gone(pids, within_s=2.0)  # already gone when the error was raised


def test_a_slow_rank_is_waited_for_and_a_stuck_one_fails_at_the_round_deadline(biased_model_dir):
    # Rank 1 sleeps (beating) for 3 heartbeat timeouts in a 5-token round, then for 300 s in a
    # 6-token one. The first round sets the deadline of the second: max(6 s, 2 x ~3 s).
    backend = SleepyBackend(rank=1, sleeps={5: 3.0, 6: 300.0})
    config = ParallelConfig(tensor_parallel_size=2, heartbeat_timeout_s=1.0, step_timeout_s=6.0,
                            step_timeout_factor=2.0)
    executor = TensorParallelExecutor(config_for(biased_model_dir), config, backend)
    pids = executor.worker_pids
    try:
        executor.init_cache(CacheConfig(block_size=BLOCK, num_gpu_blocks=16, num_cpu_blocks=0))
        start = time.monotonic()
        logits = executor.execute_model([meta(Sequence(0, None, [1, 2, 3, 4, 5], BLOCK), [0, 1], True)], {}, {}, {})
        assert logits.shape[0] == 1 and executor.is_running
        slow = time.monotonic() - start
        assert 3.0 <= slow < 6.0, slow
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"workers \[0, 1\] \(pids \[\d+, \d+\]\) did not answer 'execute_model' "
                                              r"within [\d.]+ s, though they still beat: alive but stuck"):
            executor.execute_model([meta(Sequence(1, None, [1, 2, 3, 4, 5, 6], BLOCK), [2, 3], True)], {}, {}, {})
        took = time.monotonic() - start
    finally:
        executor.shutdown()
    assert max(6.0, 2 * slow) <= took < max(6.0, 2 * slow) + 6.0, (slow, took)
    assert_gone(pids, within_s=2.0)


# -- sizes that cannot shard ---------------------------------------------------------------

def refuse_process_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def no(*args, **kwargs):
        raise AssertionError("a worker process was started before the size was checked")
    monkeypatch.setattr(torch.multiprocessing, "get_context", no)


def test_sizes_that_cannot_shard_are_refused_before_any_process_starts(tiny_model_dir, monkeypatch):
    refuse_process_start(monkeypatch)
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    # SmolLM2: 9 heads, 3 KV heads.
    with pytest.raises(ValueError, match=r"num_attention_heads=9 is not divisible by tensor_parallel_size=2"
                                         r"(.|\n)*sizes that work: \[1, 3\]"):
        LLM(device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 is larger than the model's 2 KV heads"
                                         r"(.|\n)*does not replicate KV heads"):
        LLM(model=str(tiny_model_dir), device="cpu", tensor_parallel_size=4)  # 4 heads divide, 2 KV heads not
    assert {c.pid for c in psutil.Process().children(recursive=True)} == before


def test_shapes_and_bytes_per_rank_match_the_sharded_model(smollm2_loaded, tiny_model_dir, biased_model_dir):
    from transformers import AutoConfig

    cfg = smollm2_loaded.hf_config
    assert valid_tp_sizes(cfg) == [1, 3]
    with pytest.raises(ValueError, match="larger than the model's 3 KV heads"):
        check_shardable(cfg, 9)
    tiny = AutoConfig.from_pretrained(str(tiny_model_dir))  # GQA 4:2, untied
    biased = AutoConfig.from_pretrained(str(biased_model_dir))  # MHA 4:4, tied, biases
    for config, k in [(cfg, 1), (cfg, 3), (tiny, 2), (tiny, 1), (biased, 2), (biased, 4)]:
        with torch.device("meta"):  # shapes without memory
            model = LlamaForCausalLM(config, tp_rank=k - 1, tp_size=k, all_reduce=lambda t: t)
        params = dict(model.named_parameters())
        names = {"embed_tokens": "embed_tokens", "qkv_proj": "self_attn.qkv_proj.weight",
                 "o_proj": "self_attn.o_proj.weight", "gate_up_proj": "mlp.gate_up_proj.weight",
                 "down_proj": "mlp.down_proj.weight", "input_layernorm": "input_layernorm.weight",
                 "post_attention_layernorm": "post_attention_layernorm.weight"}
        real = {key: tuple(params[name if key == "embed_tokens" else "layers.0." + name].shape)
                for key, name in names.items()}
        assert shard_shapes(config, k) == real
        assert weight_bytes_per_rank(config, k, bytes_per_param=4)["total"] == weight_bytes(model)


def test_cuda_without_cuda_is_refused(tiny_model_dir, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    refuse_process_start(monkeypatch)
    with pytest.raises(ValueError, match="no CUDA device"):
        TensorParallelExecutor(ModelConfig(model=str(tiny_model_dir), device="cuda"),
                               ParallelConfig(tensor_parallel_size=2))


# -- Ctrl-C in a terminal ------------------------------------------------------------------

DRIVER = textwrap.dedent("""
    import sys
    from tinyserve.config import CacheConfig, ModelConfig, ParallelConfig
    from tinyserve.parallel import TensorParallelExecutor
    from tinyserve.sequence import SamplingParams, Sequence, SequenceGroupMetadata

    ex = TensorParallelExecutor(ModelConfig(model=sys.argv[1], device="cpu"), ParallelConfig(tensor_parallel_size=2))
    ex.init_cache(CacheConfig(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0))
    print(*ex.worker_pids, flush=True)
    seq = Sequence(0, None, list(range(1, 30)), 4)
    group = SequenceGroupMetadata("r", True, {0: seq}, SamplingParams(), {0: list(range(8))}, token_chunk_size=29)
    while True:  # prefill the same prompt again and again until interrupted
        ex.execute_model([group], {}, {}, {})
""")


def test_ctrl_c_in_a_terminal_leaves_no_worker_behind(tiny_model_dir, tmp_path):
    script = tmp_path / "driver.py"  # a script without a __main__ guard, as people write them
    script.write_text(DRIVER)
    # A session of its own, so the SIGINT goes to the driver and its workers, like a terminal's Ctrl-C.
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_model_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, proc.stderr.read()
        time.sleep(0.5)  # let it get into its loop of rounds
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "KeyboardInterrupt" in err
    assert_gone(pids)


# -- the real default model ----------------------------------------------------------------

@pytest.mark.slow
def test_default_model_on_three_ranks_matches_one_rank(smollm2_loaded):
    prompts = list(presets.SEED_PROMPTS.values())
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    def engine(executor):
        return LLMEngine(ModelConfig(device="cpu"), CacheConfig(block_size=16, num_gpu_blocks=8, num_cpu_blocks=0),
                         SchedulerConfig(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8),
                         executor=executor)

    def run(eng):
        for i, p in enumerate(prompts):
            eng.add_request(f"s{i}", p, params)
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return [done[f"s{i}"] for i in range(len(prompts))]

    want = run(engine(Worker(ModelConfig(device="cpu"), loaded=smollm2_loaded)))
    with TensorParallelExecutor(ModelConfig(device="cpu"), ParallelConfig(tensor_parallel_size=3)) as executor:
        assert [info["num_kv_heads"] for info in executor.rank_info] == [1, 1, 1]
        got = run(engine(executor))
        pids = executor.worker_pids
    assert got == want and all(len(t) == 8 for t in got)
    assert_gone(pids)


def test_memory_figure_draws_the_bytes_per_rank():
    import matplotlib

    matplotlib.use("Agg")
    from tinyserve.lab.tp_memory import SHAPES
    from tinyserve.viz.parallel import draw_memory_per_rank

    fig = draw_memory_per_rank(bytes_per_param=2)
    smol = fig.axes[0]
    assert smol.get_title() == "SmolLM2-135M"
    bars = smol.patches  # replicated bars (k=1, k=3), then sharded bars stacked on them
    want = [weight_bytes_per_rank(SHAPES["SmolLM2-135M"], k, 2) for k in (1, 3)]
    assert [round(b.get_height() * 1e9) for b in bars[:2]] == [w["replicated"] for w in want]
    assert [round((b.get_y() + b.get_height()) * 1e9) for b in bars[2:4]] == [w["total"] for w in want]
