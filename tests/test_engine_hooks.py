"""The engine's replaceable parts: ``cache_engine=`` and ``sampler=`` of LLMEngine and LLM reach the
Worker and the sampling step, and a part that cannot work is refused with the field's name."""

from __future__ import annotations

import pytest
import torch

from tinyserve import LLM, SamplingParams
from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.model_runner import prepare_inputs
from tinyserve.sampler import Sampler
from tinyserve.scheduler import Scheduler
from tinyserve.worker import Worker


class CountingCacheEngine(CacheEngine):
    """The package's CacheEngine, counting the blocks it swaps out."""

    swapped_out = 0

    def swap_out(self, src_to_dst):
        CountingCacheEngine.swapped_out += len(src_to_dst)
        super().swap_out(src_to_dst)


class FirstTokenSampler(Sampler):
    """Always token 7: a sampler the engine's outputs cannot hide."""

    def __call__(self, logits, requests):
        return [[7] * r.num_samples for r in requests]


def configs(num_gpu_blocks=64):
    return (CacheConfig(block_size=2, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=16, watermark=0.0),
            SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=18, preemption_mode="swap"))


def test_llm_passes_its_cache_engine_and_sampler_to_the_engine(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", block_size=2, num_gpu_blocks=9, num_cpu_blocks=16, max_model_len=18,
              preemption_mode="swap", watermark=0.0, cache_engine=CountingCacheEngine, sampler=FirstTokenSampler())
    assert isinstance(llm.engine.executor.cache_engine, CountingCacheEngine)
    before = CountingCacheEngine.swapped_out
    outs = llm.generate(["Hello, my name is", "The future of AI is", "The life is"],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert all(set(o.outputs[0].token_ids) == {7} for o in outs)
    assert CountingCacheEngine.swapped_out > before  # the tiny cache preempted by swapping, through the class


def test_a_worker_builds_its_cache_with_the_given_class(tiny_loaded):
    worker = Worker(ModelConfig(device="cpu"), attention_backend="torch", loaded=tiny_loaded,
                    cache_engine=CountingCacheEngine)
    worker.init_cache(CacheConfig(block_size=2, num_gpu_blocks=4, num_cpu_blocks=2))
    assert isinstance(worker.cache_engine, CountingCacheEngine)
    assert worker.cache_engine.gpu_cache[0][0].shape[:2] == (4, 2)


@pytest.mark.parametrize("kwargs,field", [
    (dict(cache_engine=5), "cache_engine"),
    (dict(sampler="top-p"), "sampler"),
    (dict(scheduler="fcfs"), "scheduler"),
    (dict(prepare_inputs=[]), "prepare_inputs"),
])
def test_parts_that_cannot_be_called_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLMEngine(ModelConfig(device="cpu"), *configs(), executor=None, **kwargs)


def test_a_cache_engine_the_engine_cannot_pass_on_is_refused(tiny_loaded):
    worker = Worker(ModelConfig(device="cpu"), attention_backend="torch", loaded=tiny_loaded)
    with pytest.raises(ValueError, match="cache_engine"):
        LLMEngine(ModelConfig(device="cpu"), *configs(), executor=worker, cache_engine=CountingCacheEngine)
    with pytest.raises(ValueError, match="cache_engine.*tensor_parallel_size=1"):
        LLMEngine(ModelConfig(device="cpu"), *configs(), ParallelConfig(tensor_parallel_size=2),
                  cache_engine=CountingCacheEngine)


class CountingScheduler(Scheduler):
    """The package's Scheduler, counting its rounds."""

    rounds = 0

    def schedule(self):
        CountingScheduler.rounds += 1
        return super().schedule()


def test_llm_builds_its_scheduler_with_the_given_class_and_packs_with_the_given_function(tiny_model_dir):
    packed = []

    def counting_prepare_inputs(groups, block_size, device):
        packed.append(sum(m.token_chunk_size * len(m.seq_data) for m in groups))
        return prepare_inputs(groups, block_size, device)

    prompts, params = ["Hello, my name is", "The life is"], SamplingParams(temperature=0.0, max_tokens=6)
    kwargs = dict(device="cpu", block_size=2, num_gpu_blocks=16, num_cpu_blocks=4, max_model_len=18)
    plain = LLM(str(tiny_model_dir), **kwargs).generate(prompts, params)
    llm = LLM(str(tiny_model_dir), scheduler=CountingScheduler, prepare_inputs=counting_prepare_inputs, **kwargs)
    assert type(llm.engine.scheduler) is CountingScheduler
    # Built after the cache was sized: the block manager has the engine's blocks.
    assert llm.engine.scheduler.block_manager.num_total_gpu_blocks == 16
    before = CountingScheduler.rounds
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert CountingScheduler.rounds - before == len(packed) > 0  # one packed batch per round that ran
    assert sum(packed) == sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)


def test_a_prepare_inputs_the_engine_cannot_pass_on_is_refused(tiny_loaded):
    worker = Worker(ModelConfig(device="cpu"), attention_backend="torch", loaded=tiny_loaded)
    with pytest.raises(ValueError, match="prepare_inputs is given to the Worker"):
        LLMEngine(ModelConfig(device="cpu"), *configs(), executor=worker, prepare_inputs=prepare_inputs)


def test_the_default_parts_stay_the_packages(tiny_loaded):
    engine = LLMEngine(ModelConfig(device="cpu"), *configs(),
                       executor=Worker(ModelConfig(device="cpu"), attention_backend="torch", loaded=tiny_loaded))
    assert type(engine.sampler) is Sampler and type(engine.executor.cache_engine) is CacheEngine
    assert torch.equal(engine.sampler.generator.get_state(), torch.Generator().manual_seed(0).get_state())
