"""The reader's workspace: the components a reader writes, saved across chapters and plugged into
the scheduler and the engine in place of the package's own.

The workspace is a plain Python package directory outside the checkout's tracked files:
``$TINYSERVE_WORKSPACE`` if set, else ``~/.tinyserve/workspace``. Running a chapter writes there
and nowhere else. Each component is one module; the object of the fixed name is what the
assembly plugs in:

    component        module               object               chapter  goes in through
    allocator        allocator.py         BlockAllocator       02       BlockSpaceManager(allocator=)
    block_manager    block_manager.py     BlockSpaceManager    03       Scheduler(block_manager=)
    admission        admission.py         can_admit            04       Scheduler(can_admit=)
    orca_round       orca_round.py        Scheduler            04       LLMEngine(scheduler=) (policy="orca")
    scheduler_round  scheduler_round.py   Scheduler            05       LLMEngine(scheduler=) (policy="vllm")
    victim           victim.py            choose_victim        05       Scheduler(choose_victim=)
    cache_engine     cache_engine.py      CacheEngine          06       LLMEngine(cache_engine=)
    attention        attention.py         AttentionBackend     07       attention_backend=<object>
    decode_kernel    decode_kernel.py     paged_decode         08       the Triton backend's decode (chapter 08)
    input_builder    input_builder.py     prepare_inputs       09       LLMEngine(prepare_inputs=)
    sampler          sampler.py           Sampler              09       LLMEngine(sampler=)
    engine_step      engine_step.py       LLMEngine            09       build_engine's engine class (step, execute)
    parallel_mlp     parallel_mlp.py      ParallelMLP          10       the tensor-parallel MLP (chapter 10)
    v1_round         v1_round.py          Scheduler            13       LLMEngine(scheduler=) (policy="v1")
    beam_select      beam_select.py       beam_select          14       LLMEngine(beam_select=)

A class named ``AttentionBackend`` or ``Sampler`` is instantiated (``Sampler(seed)``); an object
of that name is used as it is. ``can_admit`` and ``choose_victim`` may be functions or callable
objects; ``BlockAllocator`` and ``CacheEngine`` are classes (or factories) called with the
package's constructor arguments; ``BlockSpaceManager`` and ``Scheduler`` are classes with the
package's constructors (subclasses of the package's: ``load`` refuses any other).

- ``%%workspace <component>`` (a cell magic: ``%load_ext tinyserve.workspace`` or
  ``register_magic()``) runs the cell, runs the component's checker on it with the package's
  own implementation of the component unavailable (``tinyserve.exercises.guard``), and if it
  passed, saves its source as the component's module, the object checked as the answer
  (helpers and imports beside it are saved with it);
  ``save(component, source_or_object)`` does the same from code (``store``).
- ``load(component)`` imports the reader's module afresh and returns the object, or None. Any
  exception while it is imported (``SystemExit`` and ``KeyboardInterrupt`` too), the package's
  own object under the reader's name, one of the wrong kind or signature, and any change the
  module made to tinyserve (undone) are reported, naming the component (``intake``).
- ``build_scheduler(...)`` and ``build_engine(...)`` assemble a scheduler (no model) or an engine
  from the reader's parts, the package's for the rest, with a report of whose each part is
  (``assemble``).
- ``your_engine_so_far(chapter)`` runs s0/s1/s2 through the reader's parts beside the package's
  and prints a verdict: the same rounds (chapters 02–05) or tokens (06 on; from 13 under
  policy="v1" too), or the first difference (``so_far``).
- ``capstone()`` (chapter 09) runs SmolLM2 on s0/s1/s2 and a preempting workload through every
  part the reader has written beside the package's engine, and says whether the tokens are
  identical (``capstone``).
"""

from __future__ import annotations

from tinyserve.workspace.assemble import Report, build_engine, build_scheduler
from tinyserve.workspace.capstone import Capstone, capstone
from tinyserve.workspace.magic import load_ipython_extension, register_magic
from tinyserve.workspace.so_far import Verdict, your_engine_so_far
from tinyserve.workspace.store import (
    COMPONENTS,
    Component,
    WorkspaceError,
    load,
    remove,
    save,
    save_solutions,
    saved_components,
    workspace_dir,
)

__all__ = ["COMPONENTS", "Capstone", "Component", "Report", "Verdict", "WorkspaceError", "build_engine",
           "build_scheduler", "capstone", "load", "load_ipython_extension", "register_magic", "remove", "save",
           "save_solutions", "saved_components", "workspace_dir", "your_engine_so_far"]
