"""The scheduler's work after the model ran a round: the one place that advances computed
tokens, appends sampled tokens, finishes sequences that stop and frees their blocks.

``PostprocessMixin`` is that part of the ``Scheduler``. ``LLMEngine.step`` calls its pieces with
the sampler's tokens and adds what needs a tokenizer (detokenizing, stop strings) and forks for
n samples; the simulator, the book's tracing helpers and the tests call ``postprocess`` whole.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tinyserve.scheduler_outputs import SchedulerOutputs
from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus


class PostprocessMixin:
    """The Scheduler's bookkeeping after a round (it uses the scheduler's block_manager and config)."""

    def update_num_computed_tokens(self, out: SchedulerOutputs) -> list[tuple[SequenceGroup, Sequence]]:
        """The model has run the round: every scheduled sequence has K/V for its new tokens.

        Returns the sequences whose tokens are now all computed, in batch order: each has a
        token to sample. (A prefill piece short of the prompt's end has none.)"""
        to_sample = []
        for scheduled in out.scheduled_seq_groups:
            group = scheduled.seq_group
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.num_computed_tokens += scheduled.token_chunk_size
                # >>> chapter 12: prefix caching
                if self.cache_config.enable_prefix_caching:  # its full blocks may now be shared
                    self.block_manager.mark_computed(seq)
                # <<<
                if seq.num_computed_tokens >= seq.get_len():
                    to_sample.append((group, seq))
        return to_sample

    def check_stop(self, group: SequenceGroup, seq: Sequence, eos_token_id: int | None = None,
                   stop_string_found: bool = False) -> bool:
        """Finish ``seq`` if its newest token ends it, freeing its blocks; True if it finished.

        It stops on a stop string (the engine looks for those in the text and says so), on EOS
        (unless ``ignore_eos``) or a stop token id, none of which count before ``min_tokens``;
        it is capped at ``max_tokens`` or when it fills ``max_model_len``. Under
        ``compat="vllm-0.4"`` the caps come first, and the length cap is v0.4's: more than
        ``max_model_len`` tokens (``LLMEngine._check_stop``)."""
        params = group.sampling_params
        last = seq.get_last_token_id()
        stopped = seq.get_output_len() >= params.min_tokens and (
            stop_string_found or (not params.ignore_eos and last == eos_token_id) or last in params.stop_token_ids)
        max_len = self.scheduler_config.max_model_len
        capped = seq.get_output_len() >= params.max_tokens or seq.get_len() >= max_len
        # >>> fold: vLLM v0.4 compat
        if self.scheduler_config.compat == "vllm-0.4":  # v0.4 lets a sequence reach max_model_len + 1
            capped = seq.get_output_len() >= params.max_tokens or seq.get_len() > max_len
            stopped = stopped and not capped  # ...and checks the caps before the stop conditions
        # <<<
        if stopped:
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif capped:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        else:
            return False
        self.free_seq(seq)
        return True

    def postprocess(self, out: SchedulerOutputs, next_token: Callable[[SequenceGroup, Sequence], int],
                    eos_token_id: int | None = None) -> list[str]:
        """The whole round's bookkeeping for a caller whose tokens need no text (the simulator,
        the book's tracing helpers, tests): computed tokens advance, each sequence that reached
        its end appends ``next_token(group, seq)`` and finishes if it stops, and finished groups
        leave ``running``. Returns the ids of the scheduled requests that finished.

        Every sequence gets one token: forking a prompt's first sample into ``n`` (parallel
        sampling) is the engine's part. ``LLMEngine.step`` takes the same steps with the
        sampler's tokens, the forks, and the detokenizer's stop strings in between."""
        for group, seq in self.update_num_computed_tokens(out):
            seq.append_token_id(next_token(group, seq))
            self.check_stop(group, seq, eos_token_id)
        finished = [s.seq_group.request_id for s in out.scheduled_seq_groups if s.seq_group.is_finished()]
        self.free_finished_seq_groups()
        return finished

    def free_finished_seq_groups(self) -> None:
        self.running = deque(g for g in self.running if not g.is_finished())
