"""What the engine reports: per request after every step, and per step to its callbacks.

``RequestOutput`` and ``CompletionOutput`` follow vLLM's ``vllm/outputs.py``. ``StepEvent`` is
what ``LLMEngine.add_callback`` observers receive; ``StepTimes`` sums where the steps' time went.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tinyserve.scheduler import SchedulerOutputs
from tinyserve.sequence import Sequence, SequenceGroup


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "ignored" | None while running


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # why the request was ignored or failed


@dataclass
class StepTimes:
    """Where the steps' time went (seconds, summed), for the performance chapter. ``history``
    lists each step's (schedule, model, sample, process) only while a recorder keeps it."""

    schedule: float = 0.0
    model: float = 0.0
    sample: float = 0.0
    process: float = 0.0
    history: list[tuple[float, float, float, float]] = field(default_factory=list)

    def add(self, step: tuple[float, float, float, float]) -> None:
        self.schedule, self.model, self.sample, self.process = (
            total + t for total, t in zip((self.schedule, self.model, self.sample, self.process), step))


@dataclass
class StepEvent:
    """What one step did, as the engine tells its callbacks after the step."""

    scheduler_outputs: SchedulerOutputs
    finished: list[str]  # ids of the scheduled requests that finished in this step
    produced: list[tuple[SequenceGroup, Sequence, int]]  # every sampled token, with its group and sequence
    outputs: list[RequestOutput]  # what step() returns
    times: tuple[float, float, float, float]  # seconds spent scheduling, in the model, sampling, processing


# Called as callback(engine, event) after every step (LLMEngine.add_callback).
StepCallback = Callable[[object, StepEvent], None]
