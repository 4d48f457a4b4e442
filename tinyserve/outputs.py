"""What the engine reports: per request after every step, and per step to its callbacks.

``RequestOutput`` and ``CompletionOutput`` follow vLLM's ``vllm/outputs.py``; ``OutputBuilder``
makes them in the kind each request asked for (``SamplingParams.output_kind``): the whole output
so far (vLLM v0.4's only kind), only what is new, or one output at the end. A server streaming a
long answer wants the new part only: copying every sequence's whole token list at every step
costs time and memory in proportion to the length, at every step. ``StepEvent`` is what
``LLMEngine.add_callback`` observers receive; ``StepTimes`` sums where the steps' time went.

A request with ``best_of`` > n draws best_of samples and reports the n with the highest
cumulative logprob, ranked, once they are all finished: which n those are is not known before.
A beam search reports its n best beams by beam score (v0.4's ``RequestOutput.from_seq_group``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tinyserve.beam_search import beam_score
from tinyserve.scheduler import SchedulerOutputs
from tinyserve.sequence import Sequence, SequenceGroup


@dataclass
class CompletionOutput:
    index: int
    text: str  # with output_kind="delta": only the text that is new since the last output
    token_ids: list[int]  # likewise
    finish_reason: str | None  # "stop" | "length" | "abort" | "ignored" | None while running
    cumulative_logprob: float = 0.0  # the sum of the model's log-probabilities of token_ids (all of them)
    logprobs: list[dict[int, float]] | None = None  # per token {token_id: logprob}, when asked for; a delta's own


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # why the request was ignored or failed
    retryable: bool = False  # the engine gave up for lack of memory now, not because of the request
    # With prompt_logprobs: None for the first prompt token, then a {token_id: logprob} per token
    # (None until the prompt has been computed).
    prompt_logprobs: list[dict[int, float] | None] | None = None


class OutputBuilder:
    """Builds a request's RequestOutput after a step, in the request's ``output_kind``.

    For ``"delta"`` it remembers, per sequence, how many tokens and characters it has reported.
    New text is held back while it could still turn into a stop string (the engine cuts a stop
    string out of the text when it completes), so a delta is never taken back: the deltas of a
    sequence add up to its final text and token ids.
    """

    def __init__(self, compat: str = "tinyserve", eos_token_id: int | None = None) -> None:
        self.eos_token_id = eos_token_id  # a beam's score does not count a final EOS
        self._reported: dict[int, tuple[int, int]] = {}  # seq_id -> (tokens, characters) reported
        # vLLM v0.4 reports a refused (ignored) request's finish_reason as "length".
        self._ignored_reason = "length" if compat == "vllm-0.4" else "ignored"

    def build(self, group: SequenceGroup) -> RequestOutput | None:
        """The output for ``group`` now, or None when its kind has nothing to report yet."""
        params = group.sampling_params
        kind = params.output_kind
        if kind == "final_only" and not group.is_finished():
            return None
        seqs = group.get_seqs()
        if params.use_beam_search:  # the n best beams, by beam score
            if kind == "delta" and not group.is_finished():
                return None
            seqs = sorted(seqs, key=lambda s: beam_score(s, params.length_penalty, self.eos_token_id),
                          reverse=True)[:params.n]
        elif params.num_samples > params.n:  # best_of: the n likeliest, known only at the end
            if kind == "delta" and not group.is_finished():
                return None
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:params.n]
        if kind == "delta":
            # A stop string kept in the output is never cut back into: nothing needs holding back.
            holdback = 0 if params.include_stop_str_in_output else max(map(len, params.stop), default=1) - 1
            completions = [self._delta(i, s, holdback, params.logprobs is not None) for i, s in enumerate(seqs)]
        else:
            completions = [CompletionOutput(i, s.output_text, list(s.output_token_ids), self._reason(s),
                                            s.cumulative_logprob,
                                            list(s.output_logprobs) if params.logprobs is not None else None)
                           for i, s in enumerate(seqs)]
        # A prompt never changes once added: only the cumulative kind (a snapshot to keep) copies it.
        prompt_ids = list(group.prompt_token_ids) if kind == "cumulative" else group.prompt_token_ids
        prompt_logprobs = group.prompt_logprobs
        if prompt_logprobs is not None and len(prompt_logprobs) < len(group.prompt_token_ids):
            prompt_logprobs = None  # the prompt is still being computed (chunked prefill)
        return RequestOutput(group.request_id, group.prompt, prompt_ids, completions, group.is_finished(),
                             group.error, group.retryable, prompt_logprobs)

    def _reason(self, seq: Sequence) -> str | None:
        reason = seq.status.finish_reason
        return self._ignored_reason if reason == "ignored" else reason

    def _delta(self, index: int, seq: Sequence, holdback: int, with_logprobs: bool) -> CompletionOutput:
        tokens, chars = self._reported.get(seq.seq_id, (0, 0))
        text, ids = seq.output_text, seq.output_token_ids
        # A stop string found later begins at most holdback characters before the text reported
        # now ends, so what is reported stays text (the cut never reaches back into it).
        end = len(text) if seq.is_finished() else max(chars, len(text) - holdback)
        self._reported[seq.seq_id] = (len(ids), end)
        return CompletionOutput(index, text[chars:end], ids[tokens:], self._reason(seq), seq.cumulative_logprob,
                                seq.output_logprobs[tokens:] if with_logprobs else None)

    def forget(self, group: SequenceGroup) -> None:
        """The request is done (finished or aborted): drop what was remembered of it."""
        for seq in group.get_seqs():
            self._reported.pop(seq.seq_id, None)


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
