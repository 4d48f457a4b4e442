"""Assembling a scheduler or an engine from the workspace: the reader's parts where written, the
package's for the rest, and a report of whose each part is.

Every part goes in through a documented constructor argument: the allocator through
``BlockSpaceManager(allocator=)``, the block manager, admission rule and victim policy through
``Scheduler(block_manager=, can_admit=, choose_victim=)``, the reader's rounds (``orca_round`` of
chapter 04 and ``scheduler_round`` of chapter 05, ``Scheduler`` subclasses, joined into one class
when both are written, and chapter 13's ``v1_round`` joined with them) as the scheduler class,
through ``LLMEngine(scheduler=)`` in the engine;
the cache engine and the input builder through ``LLMEngine(cache_engine=, prepare_inputs=)``
(given to the Worker), attention through ``attention_backend=<object>``, the sampler through
``LLMEngine(sampler=)`` and chapter 14's beam step through ``LLMEngine(beam_select=)``.
Chapter 08's decode kernel and chapter 10's parallel MLP run in their own chapters' engines (a
Triton backend, two ranks), not here. Chapter 09's ``engine_step``, an
``LLMEngine`` subclass with the reader's ``step`` and ``execute``, is the engine's class itself.

Every part of the reader's goes in wrapped by a ``contain.Tracker`` (``tracker=``, else a fresh
one): the report counts the calls each part served, and checks what it returned (``served``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

from tinyserve import presets
from tinyserve.block_manager import BlockSpaceManager, V04BlockSpaceManager
from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.scheduler import Scheduler, make_block_manager
from tinyserve.workspace.contain import Tracker, track, track_factory, track_schedule
from tinyserve.workspace.served import NOT_COUNTED, SERVED
from tinyserve.workspace.store import COMPONENTS, load

YOURS, PACKAGES = "yours", "package's"
# Parts of the chapters after the capstone's (chapter 13's v1 round, chapter 14's beam step). A
# report names one only when the view reaches its chapter, or, with no chapter given, when it is
# saved: the verdicts of chapters 02-12 and the capstone read as they did before it existed.
LATER_PARTS = ("v1_round", "beam_select")
SCHEDULER_PARTS = ("allocator", "block_manager", "admission", "orca_round", "scheduler_round", "victim", "v1_round")
ENGINE_PARTS = SCHEDULER_PARTS[:-1] + ("cache_engine", "attention", "input_builder", "sampler",
                                       "engine_step") + LATER_PARTS
ROUND_PARTS = ("scheduler_round", "orca_round", "v1_round")  # Scheduler subclasses, joined in this order


class Report(dict):
    """``{component: "yours" | "package's"}`` in the book's order, with ``notes`` on parts that were
    written but could not be used (and why), and ``calls``: how much each of the reader's parts
    served in the run it was built for (``served``). Once a run has ``measured`` them, the text
    says the counts, and a part of the reader's that served nothing is not called one of its parts."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.notes: list[str] = []
        self.calls: dict[str, int] = {}  # the tracker's counts, filled in as the run goes
        self.policies: list[str] = []  # the scheduler policies the run used
        self.measured = False

    def yours(self) -> list[str]:
        """The reader's parts built into the engine (whether or not the run called them)."""
        return [name for name, whose in self.items() if whose == YOURS]

    def served(self) -> list[str]:
        """The reader's parts that served at least one call in the run (all of them until measured)."""
        return [name for name in self.yours() if not self.measured or self.calls.get(name, 0) > 0]

    def said(self) -> list[str]:
        """One line per part of the reader's: what it served ("your orca_round ran 16 rounds")."""
        lines = []
        for name in self.yours():
            served = SERVED.get(name, NOT_COUNTED)
            n = self.calls.get(name, 0)
            if n:
                lines.append(f"your {name} {served.says(n)}")
                continue
            why = ""
            if served.policy and served.policy not in self.policies:
                why = f": {'these workloads use' if len(self.policies) > 1 else 'this workload uses'} " \
                      + " and ".join(f"policy={p!r}" for p in self.policies)
            lines.append(f"your {name} is saved but {served.says(0)} here{why}")
        return lines

    def __str__(self) -> str:
        mine = ", ".join(self.served()) or ("none yet" if not self.yours() else "none that served here")
        theirs = ", ".join(n for n, w in self.items() if w != YOURS) or "none"
        said = [f"  {line}" for line in self.said()] if self.measured else []
        return "\n".join([f"your parts: {mine}"] + said + [f"the package's: {theirs}"]
                         + [f"  note: {n}" for n in self.notes])

    @classmethod
    def combined(cls, reports: list[Report]) -> Report:
        """One report for several runs on the same parts: their calls added up."""
        if not reports:
            return cls()
        total = cls(reports[0])
        for report in reports:
            total.notes += [n for n in report.notes if n not in total.notes]
            total.policies += [p for p in report.policies if p not in total.policies]
            for name, n in report.calls.items():
                total.calls[name] = total.calls.get(name, 0) + n
        total.measured = all(r.measured for r in reports)
        return total


def _gather(names: tuple[str, ...], chapter: int | None, strict: bool,
            tracker: Tracker) -> tuple[dict, Report]:
    """Load each named component the reader has written (up to ``chapter``'s, if given), each
    wrapped by ``tracker``, which the report's calls count on."""
    parts, report = {}, Report()
    report.calls = tracker.counts
    tracker.report = report
    for name in names:
        obj = None
        if chapter is None or COMPONENTS[name].chapter <= chapter:
            with tracker.running(name, "import"):
                obj = load(name, strict=strict)
        if obj is not None:
            # The parts the package constructs are tracked through whatever makes them.
            parts[name] = (track_factory if name in ("allocator", "block_manager", "cache_engine") else track)(
                tracker, name, obj)
        if name in LATER_PARTS and obj is None and (chapter is None or COMPONENTS[name].chapter > chapter):
            continue
        report[name] = YOURS if obj is not None else PACKAGES
    return parts, report


def _takes(cls, keyword: str) -> bool:
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == keyword or p.kind is p.VAR_KEYWORD for p in params)


def _disown(report: Report, name: str, why: str) -> None:
    report[name] = PACKAGES
    report.notes.append(f"your {name} is saved but not used: {why}")


def _round_class(parts: dict, report: Report) -> type:
    """The scheduler class: the reader's rounds (joined into one class if several are written), or
    the package's."""
    rounds = [parts[name] for name in ROUND_PARTS if name in parts]
    for name in ROUND_PARTS:
        if name in parts and not (isinstance(parts[name], type) and issubclass(parts[name], Scheduler)):
            _disown(report, name, "it must be a subclass of tinyserve.scheduler.Scheduler")
            rounds.remove(parts[name])
    while len(rounds) > 1:
        try:
            return type("YourScheduler", tuple(rounds), {})
        except TypeError as e:  # classes whose bases cannot be ordered together: the latest is left out
            names = [n for n in ROUND_PARTS if n in parts and parts[n] in rounds]
            _disown(report, names[-1], f"it cannot be joined with your {' and your '.join(names[:-1])} ({e})")
            rounds.pop()
    return rounds[0] if rounds else Scheduler


def _scheduler(parts: dict, report: Report, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
               tracker: Tracker, cls: type | None = None) -> Scheduler:
    """A Scheduler with the reader's parts in ``parts`` (the package's for the others), whose
    rounds ``tracker`` counts."""
    cc = cache_config
    allocator, manager_cls = parts.get("allocator"), parts.get("block_manager")
    if manager_cls is not None and cc.enable_prefix_caching and not hasattr(manager_cls, "num_cached_tokens"):
        _disown(report, "block_manager", "prefix caching needs a block manager with num_cached_tokens and "
                                         "mark_computed (chapter 12's PrefixCachingBlockSpaceManager)")
        manager_cls = None
    manager = None
    if manager_cls is not None:
        kwargs = {}
        if allocator is not None:
            if _takes(manager_cls, "allocator"):
                kwargs["allocator"] = allocator
            else:
                _disown(report, "allocator", "your BlockSpaceManager takes no allocator= argument")
        manager = manager_cls(cc.block_size, cc.num_gpu_blocks, cc.num_cpu_blocks, cc.watermark, **kwargs)
    elif allocator is not None:
        if cc.enable_prefix_caching:
            _disown(report, "allocator", "the prefix-caching block manager takes no allocator= argument")
        else:
            manager_cls = V04BlockSpaceManager if scheduler_config.compat == "vllm-0.4" else BlockSpaceManager
            manager = manager_cls(cc.block_size, cc.num_gpu_blocks, cc.num_cpu_blocks, cc.watermark,
                                  allocator=allocator)
    cls = cls or _round_class(parts, report)
    scheduler = cls(scheduler_config, cache_config,
                    block_manager=manager or make_block_manager(cc, scheduler_config.compat),
                    choose_victim=parts.get("victim"), can_admit=parts.get("admission"))
    track_schedule(tracker, scheduler)
    return scheduler


def _configs(preset_or_configs) -> tuple[SchedulerConfig, CacheConfig]:
    if preset_or_configs is None:
        preset_or_configs = presets.seed_rounds("swap")
    if isinstance(preset_or_configs, presets.Preset):
        sc, cc = preset_or_configs.scheduler_config, preset_or_configs.cache_config
    else:
        sc, cc = preset_or_configs
    if not isinstance(sc, SchedulerConfig) or not isinstance(cc, CacheConfig):
        raise ValueError("give a presets.Preset or a (SchedulerConfig, CacheConfig) pair, "
                         f"got {preset_or_configs!r}")
    return dataclasses.replace(sc), dataclasses.replace(cc)  # the engine fills in a config's None fields


def build_scheduler(preset_or_configs=None, *, chapter: int | None = None, strict: bool = False,
                    tracker: Tracker | None = None) -> tuple[Scheduler, Report]:
    """A Scheduler (no model) on a preset's configs (default: ``presets.seed_rounds("swap")``), or a
    ``(scheduler_config, cache_config)`` pair, with the reader's allocator, block manager,
    admission rule, scheduler round and victim policy where written (those of chapters up to
    ``chapter``, if given: ``chapter=0`` is the package's scheduler), and the report.
    ``sim.simulate(..., scheduler=)`` runs it. A saved part that fails to import is reported and
    the package's is used, unless ``strict`` (then WorkspaceError). ``tracker`` counts the calls
    of the reader's parts (``report.calls``)."""
    sc, cc = _configs(preset_or_configs)
    tracker = tracker or Tracker()
    parts, report = _gather(SCHEDULER_PARTS, chapter, strict, tracker)
    report.policies = [sc.policy]
    return _scheduler(parts, report, sc, cc, tracker), report


@functools.cache
def _default_model():
    """SmolLM2-135M on the CPU in float32 if it is installed, otherwise the tests' tiny Llama."""
    import torch

    from tinyserve.models.default_model import ensure_default_model
    from tinyserve.models.loader import load_model
    from tinyserve.models.tiny import tiny_model

    try:
        return load_model(ensure_default_model(), device="cpu", dtype=torch.float32)
    except Exception:  # the weights package is missing: the engine still runs, on random weights
        return tiny_model()


def _loaded(model):
    import torch

    from tinyserve.models.loader import LoadedModel, load_model

    if model is None:
        return _default_model()
    if isinstance(model, LoadedModel):
        return model
    return load_model(model, device="cpu", dtype=torch.float32)


def build_engine(model=None, *, preset=None, chapter: int | None = None, strict: bool = False,
                 attention_backend="torch", tracker: Tracker | None = None,
                 **engine_kwargs) -> tuple[LLMEngine, Report]:
    """An LLMEngine over ``model`` (a LoadedModel, a model name or directory; default SmolLM2 if
    installed, else the tiny random Llama) on ``preset``'s configs (default the s0/s1/s2 preset),
    with every part the reader has written (up to ``chapter``'s; ``chapter=0``: none) and the
    package's for the rest, and the report. The engine is the reader's ``LLMEngine`` subclass
    (``engine_step``) if saved. ``attention_backend`` is the package's backend used where the
    reader has not written one; ``engine_kwargs`` go to LLMEngine (``record_history`` defaults to
    True). ``tracker`` counts the calls of the reader's parts (``report.calls``)."""
    from tinyserve.worker import Worker

    taken = {"cache_engine", "sampler", "beam_select", "executor", "attention_backend", "scheduler",
             "prepare_inputs"} & set(engine_kwargs)
    if taken:
        raise ValueError(f"build_engine fills in {', '.join(sorted(taken))} from the workspace; save your part there")
    sc, cc = _configs(preset)
    loaded = _loaded(model)
    tracker = tracker or Tracker()
    parts, report = _gather(ENGINE_PARTS, chapter, strict, tracker)
    report.policies = [sc.policy]
    backend = parts.get("attention", attention_backend)
    backend = backend() if isinstance(backend, type) else backend
    sampler = parts.get("sampler")
    sampler = sampler(0) if isinstance(sampler, type) else sampler
    model_config = ModelConfig(model=str(loaded.path or "in-memory"))
    worker = Worker(model_config, attention_backend=backend, loaded=loaded, cache_engine=parts.get("cache_engine"),
                    prepare_inputs=parts.get("input_builder"))
    engine_kwargs.setdefault("record_history", True)
    cls = _round_class(parts, report)

    def scheduler(scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> Scheduler:
        # Called by the engine once the cache is sized: the block manager needs num_gpu_blocks.
        return _scheduler(parts, report, scheduler_config, cache_config, tracker, cls)

    engine_cls = parts.get("engine_step", LLMEngine)
    if not (isinstance(engine_cls, type) and issubclass(engine_cls, LLMEngine)):
        _disown(report, "engine_step", "it must be a subclass of tinyserve.engine.LLMEngine")
        engine_cls = LLMEngine
    engine = engine_cls(model_config, cc, sc, executor=worker, sampler=sampler, scheduler=scheduler,
                        beam_select=parts.get("beam_select"), **engine_kwargs)
    return engine, report
