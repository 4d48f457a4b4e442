"""The workspace's components: for each part a reader writes, the module it is saved as, the
name the engine takes from it, the chapter that writes it, where it goes in, the imports its
saved module starts with, its checker and solution, and the package's own implementation of it
(which a check keeps out of reach, and which no chapter lists before the exercise)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Component:
    name: str
    module: str  # file name in the workspace
    object: str  # the fixed name the module must define
    chapter: int  # the chapter that writes it
    hook: str  # where it goes in
    prelude: str  # imports the saved module starts with
    # The checker ``%%workspace`` runs before it saves ("tinyserve.exercises.chNN:check_x"; "" for
    # none) and the name of the chapter's solution (chapters/solutions/chNN.py) that answers it.
    check: str = ""
    answer: str = ""
    # The package's own implementation of this component ("module:qualname", a function or a
    # Class.method): a checker runs the reader's answer with these made unavailable, and no
    # chapter lists them before the component's exercise (tests/test_listing_order.py).
    own: tuple[str, ...] = ()


COMPONENTS: dict[str, Component] = {c.name: c for c in [
    Component("allocator", "allocator.py", "BlockAllocator", 2, "BlockSpaceManager(allocator=)",
              "from collections import deque\n"
              "from tinyserve.block import Device, OutOfBlocksError, PhysicalTokenBlock",
              check="tinyserve.exercises.ch02:check_block_allocator", answer="FreeListAllocator",
              own=(
                  "tinyserve.block:BlockAllocator.allocate",
                  "tinyserve.block:BlockAllocator.free",
                  "tinyserve.block:BlockAllocator.get_num_free_blocks",
              )),
    Component("block_manager", "block_manager.py", "BlockSpaceManager", 3, "Scheduler(block_manager=)",
              "from collections import deque\n"
              "from tinyserve.block import Device, OutOfBlocksError, PhysicalTokenBlock\n"
              # The reader's class subclasses BlockSpaceManager, the package's (the alias at the
              # module's end then rebinds the name to the reader's class).
              "from tinyserve.block_manager import AllocStatus, BlockSpaceManager\n"
              "from tinyserve.block_manager import BlockSpaceManager as PackageBlockSpaceManager\n"
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus",
              check="tinyserve.exercises.ch03:check_block_manager", answer="CopyOnWriteManager",
              own=(
                  "tinyserve.block_manager:BlockSpaceManager.can_allocate",
                  "tinyserve.block_manager:BlockSpaceManager.allocate",
                  "tinyserve.block_manager:BlockSpaceManager._prompt_blocks",
                  "tinyserve.block_manager:BlockSpaceManager._needs_new_block",
                  "tinyserve.block_manager:BlockSpaceManager.can_append_slot",
                  "tinyserve.block_manager:BlockSpaceManager.append_slot",
                  "tinyserve.block_manager:BlockSpaceManager.fork",
                  "tinyserve.block_manager:BlockSpaceManager.free",
                  "tinyserve.block_manager:V04BlockSpaceManager.can_allocate",
                  "tinyserve.block_manager:V04BlockSpaceManager.can_append_slot",
              )),
    Component("admission", "admission.py", "can_admit", 4, "Scheduler(can_admit=)",
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus"),
    Component("orca_round", "orca_round.py", "Scheduler", 4, "LLMEngine(scheduler=), the policy='orca' round",
              "from collections import deque\n"
              "from tinyserve import refusals\n"
              "from tinyserve.block_manager import AllocStatus\n"
              "from tinyserve.scheduler import Scheduler, SchedulerOutputs, SchedulingBudget\n"
              "from tinyserve.scheduler import Scheduler as PackageScheduler\n"
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus",
              check="tinyserve.exercises.ch04:check_orca_round", answer="OrcaRound",
              own=(
                  "tinyserve.scheduler:Scheduler._schedule_mixed",
                  "tinyserve.scheduler:Scheduler._decode_running",
                  "tinyserve.scheduler:Scheduler._swap_in_swapped",
                  "tinyserve.scheduler:Scheduler._admit_waiting",
              )),
    Component("scheduler_round", "scheduler_round.py", "Scheduler", 5, "LLMEngine(scheduler=), the policy='vllm' round",
              "from collections import deque\n"
              "from tinyserve import refusals\n"
              "from tinyserve.block_manager import AllocStatus\n"
              "from tinyserve.scheduler import Scheduler, SchedulerOutputs, SchedulingBudget\n"
              "from tinyserve.scheduler import Scheduler as PackageScheduler\n"
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus",
              check="tinyserve.exercises.ch05:check_scheduler_round", answer="VllmRound",
              own=(
                  "tinyserve.scheduler:Scheduler._schedule_vllm",
                  "tinyserve.scheduler:Scheduler._admit_waiting",
                  "tinyserve.scheduler:Scheduler._decode_running",
                  "tinyserve.scheduler:Scheduler._swap_in_swapped",
              )),
    Component("victim", "victim.py", "choose_victim", 5, "Scheduler(choose_victim=)",
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus"),
    Component("cache_engine", "cache_engine.py", "CacheEngine", 6, "Worker(cache_engine=)",
              "import torch\nfrom tinyserve.cache_engine import CacheEngine as PackageCacheEngine",
              check="tinyserve.exercises.ch06:check_cache_engine", answer="SwappingCacheEngine",
              own=(
                  "tinyserve.cache_engine:CacheEngine.swap_in",
                  "tinyserve.cache_engine:CacheEngine.swap_out",
                  "tinyserve.cache_engine:CacheEngine.copy",
                  "tinyserve.cache_engine:CacheEngine._move",
              )),
    Component("attention", "attention.py", "AttentionBackend", 7, "attention_backend=<object>",
              "import torch\nfrom tinyserve.attention.metadata import AttentionMetadata",
              check="tinyserve.exercises.ch07:check_attention_backend", answer="PagedAttentionBackend",
              own=(
                  "tinyserve.attention.reference:store_kv",
                  "tinyserve.attention.reference:paged_attention",
                  "tinyserve.attention.reference:sequence_attention",
                  "tinyserve.attention.reference:causal_attention",
                  "tinyserve.attention.reference:paged_decode_attention",
                  "tinyserve.attention.reference:TorchBackend.store_kv",
                  "tinyserve.attention.reference:TorchBackend.forward",
                  "tinyserve.attention.batched:paged_attention",
                  "tinyserve.attention.batched:paged_decode_attention",
                  "tinyserve.attention.batched:BatchedTorchBackend.store_kv",
                  "tinyserve.attention.batched:BatchedTorchBackend.forward",
                  "tinyserve.attention.triton_store:store_kv",
                  "tinyserve.attention.triton_backend:prefill_attention",
                  "tinyserve.attention.triton_backend:TritonBackend.store_kv",
                  "tinyserve.attention.triton_backend:TritonBackend.forward",
              )),
    Component("decode_kernel", "decode_kernel.py", "paged_decode", 8, "TritonBackend(decode=)",
              "import torch\nfrom tinyserve.attention.triton_env import max_along, next_pow2, sum_along, tl, triton",
              check="tinyserve.exercises.ch08:check_decode_kernel", answer="paged_decode",
              own=(
                  "tinyserve.attention.triton_paged:paged_decode_attention",
                  "tinyserve.attention.reference:paged_decode_attention",
                  "tinyserve.attention.batched:paged_decode_attention",
              )),
    Component("input_builder", "input_builder.py", "prepare_inputs", 9, "LLMEngine(prepare_inputs=)",
              "import torch\nfrom tinyserve.attention.metadata import AttentionMetadata\n"
              "from tinyserve.model_runner import ModelInput\n"
              "from tinyserve.sequence import Sequence, SequenceGroupMetadata",
              check="tinyserve.exercises.ch09:check_input_builder", answer="prepare_inputs",
              own=(
                  "tinyserve.model_runner:prepare_inputs",
                  "tinyserve.model_runner:_add_slots",
              )),
    Component("sampler", "sampler.py", "Sampler", 9, "LLMEngine(sampler=)",
              # The reader's class subclasses the package's Sampler for section 9.7's extras.
              "import torch\nfrom tinyserve.sampler import SampleRequest, apply_min_p\n"
              "from tinyserve.sampler import Sampler as PackageSampler",
              check="tinyserve.exercises.ch09:check_sampler", answer="Sampler",
              own=(
                  "tinyserve.sampler:Sampler.__call__",
                  "tinyserve.sampler:Sampler._draw",
                  "tinyserve.sampler:Sampler._probs",
                  "tinyserve.sampler:apply_top_k_top_p",
              )),
    Component("engine_step", "engine_step.py", "LLMEngine", 9,
              "build_engine's engine class: the serving loop's step and execute (an LLMEngine subclass)",
              "import torch\nfrom tinyserve.engine import LLMEngine\n"
              "from tinyserve.engine import LLMEngine as PackageEngine\n"
              "from tinyserve.logprobs import sampled_logprobs\n"
              "from tinyserve.outputs import RequestOutput\n"
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus",
              check="tinyserve.exercises.ch09_step:check_engine_step", answer="ServingLoop",
              own=(
                  "tinyserve.engine:LLMEngine.step",
                  "tinyserve.engine:LLMEngine.execute",
                  "tinyserve.worker:Worker.execute_model",
              )),
    Component("parallel_mlp", "parallel_mlp.py", "ParallelMLP", 10,
              "TensorParallelExecutor(mlp=) / build_model(mlp=), every rank's MLP",
              "import torch\nimport torch.nn.functional as F\nfrom torch import nn",
              check="tinyserve.exercises.ch10:check_parallel_mlp", answer="ParallelMLP",
              own=(
                  "tinyserve.models.llama:LlamaMLP.forward",
              )),
    Component("v1_round", "v1_round.py", "Scheduler", 13, "LLMEngine(scheduler=), the policy='v1' round",
              "from collections import deque\n"
              "from tinyserve import refusals\n"
              "from tinyserve.scheduler import Scheduler, SchedulerOutputs, SchedulingBudget\n"
              "from tinyserve.scheduler import Scheduler as PackageScheduler\n"
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus",
              check="tinyserve.exercises.ch13:check_v1_round", answer="V1Round",
              own=(
                  "tinyserve.v1_round:V1RoundMixin._schedule_v1",
                  "tinyserve.v1_round:V1RoundMixin._run_running_v1",
                  "tinyserve.v1_round:V1RoundMixin._admit_waiting_v1",
              )),
    Component("beam_select", "beam_select.py", "beam_select", 14, "LLMEngine(beam_select=)",
              "from tinyserve.beam_search import Selection, beam_score, should_stop\n"
              "from tinyserve.sequence import Sequence, SequenceStatus",
              check="tinyserve.exercises.ch14:check_beam_select", answer="beam_select",
              own=("tinyserve.beam_search:select",)),
]}


def component(name: str) -> Component:
    """The component called ``name``; ValueError naming the choices otherwise."""
    if name not in COMPONENTS:
        raise ValueError(f"unknown workspace component {name!r}: choose one of {', '.join(COMPONENTS)}")
    return COMPONENTS[name]
