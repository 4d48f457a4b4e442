"""Deliberately wrong answers to chapter 09's core components, merged into tests/exercise_mistakes.py:
the input builder (``check_input_builder``), the sampler (``check_sampler``) and the serving loop
(``check_engine_step``)."""

from __future__ import annotations

import functools

import torch

from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.engine import LLMEngine
from tinyserve.logprobs import sampled_logprobs
from tinyserve.model_runner import ModelInput
from tinyserve.sampler import Sampler, apply_min_p

# -- the input builder --------------------------------------------------------------------------


def _packing(groups, block_size, device="cpu", slip=None):
    """prepare_inputs, with the one slip named by ``slip``."""
    ids, positions, slots, qlens, clens, tables, sample, owners = [], [], [], [], [], [], [], []
    for meta in groups:
        for seq_id, seq in meta.seq_data.items():
            table = meta.block_tables[seq_id]
            start = seq.num_computed_tokens
            end = start + meta.token_chunk_size
            tokens = seq.prompt_token_ids if slip == "prompt ids" else seq.get_token_ids()
            first = len(ids)
            ids += tokens[start:end]
            span = range(0, end - start) if slip == "positions from 0" else range(start, end)
            positions += span
            for p in range(start, end):
                if slip == "no block_size":
                    slots.append(table[p // block_size] + p % block_size)
                elif slip == "contiguous":
                    slots.append(table[0] * block_size + p)
                else:
                    slots.append(table[p // block_size] * block_size + p % block_size)
            qlens.append(end - start)
            clens.append(end - start if slip == "context is the chunk" else end)
            tables.append(table)
            if meta.do_sample or slip == "sample every sequence":
                sample.append(first if slip == "first row" else len(ids) - 1)
                owners.append((meta, seq))
    return ModelInput(torch.tensor(ids, dtype=torch.long, device=device),
                      torch.tensor(positions, dtype=torch.long, device=device),
                      AttentionMetadata.build(qlens, clens, tables, slots, device=device),
                      torch.tensor(sample, dtype=torch.long, device=device), owners)


# -- the sampler ------------------------------------------------------------------------------------


class _SlippingSampler(Sampler):
    """The chapter's sampler, row by row, with one slip per subclass."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def adjust(self, logits, requests):
        return self._adjust(logits, requests)

    def generator_of(self, request):
        return request.generator or self.generator

    def cut_on(self, scaled, row, params):  # the probabilities top-k and top-p are cut on
        return scaled.softmax(-1)

    def keep(self, ranked, params):
        keep = torch.ones_like(ranked, dtype=torch.bool)
        if params.top_k != -1:
            keep[params.top_k:] = False
        keep &= ranked.cumsum(-1) - ranked < params.top_p
        keep[0] = True
        return keep

    def scale(self, row, params):
        return row / params.temperature

    def draw(self, probs, request):
        return torch.multinomial(probs, request.num_samples, replacement=True,
                                 generator=self.generator_of(request)).tolist()

    def __call__(self, logits, requests):
        logits = self.adjust(logits, requests)
        out = []
        for row, r in zip(logits, requests):
            p = r.params
            if p.greedy:
                out.append([int(row.argmax())] * r.num_samples)
                continue
            scaled = self.scale(row, p)
            if p.top_k != -1 or p.top_p < 1.0:
                ranked, order = self.cut_on(scaled, row, p).sort(descending=True)
                keep = self.keep(ranked, p)
                scaled = torch.full_like(scaled, float("-inf")).index_copy(0, order[keep], scaled[order[keep]])
            if p.min_p > 0:
                scaled = apply_min_p(scaled[None], torch.tensor([p.min_p]))[0]
            probs = scaled.softmax(-1)
            out.append(self.draw(probs, r) if torch.isfinite(probs).all() else ValueError("not finite"))
        return out


class _TopPShort(_SlippingSampler):  # stops before the token whose mass reaches top_p
    def keep(self, ranked, params):
        keep = super().keep(ranked, params)
        keep &= ranked.cumsum(-1) < params.top_p
        keep[0] = True
        return keep


class _TopKPlusOne(_SlippingSampler):  # keeps k + 1 tokens (counts ranks from 1 and keeps rank k too)
    def keep(self, ranked, params):
        keep = torch.ones_like(ranked, dtype=torch.bool)
        if params.top_k != -1:
            keep[params.top_k + 1:] = False
        keep &= ranked.cumsum(-1) - ranked < params.top_p
        keep[0] = True
        return keep


class _CutBeforeTemperature(_SlippingSampler):  # cuts top-k/top-p on the untempered probabilities
    def cut_on(self, scaled, row, params):
        return row.softmax(-1)


class _SharedGenerator(_SlippingSampler):  # ignores the request's own generator (its seed)
    def generator_of(self, request):
        return self.generator


class _OneDrawRepeated(_SlippingSampler):  # n > 1: draws one token and repeats it
    def draw(self, probs, request):
        token = torch.multinomial(probs, 1, generator=self.generator_of(request)).item()
        return [token] * request.num_samples


class _InPlaceTemperature(_SlippingSampler):  # divides the caller's logits in place
    def scale(self, row, params):
        return row.div_(params.temperature)


class _NoAdjust(_SlippingSampler):  # drops the package's penalties and min_tokens
    def adjust(self, logits, requests):
        return logits


class _UnseededOwnGenerator(_SlippingSampler):  # its own generator ignores the seed: not reproducible
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator()
        self.generator.seed()


# -- the serving loop -------------------------------------------------------------------------------


class _SlippingLoop(LLMEngine):
    """The chapter's step and execute, with the one slip named by ``slip``."""

    slip = None

    def execute(self, metas, out):
        worker, slip = self.executor, self.slip
        cache = worker.cache_engine
        if slip == "no orders without groups" and not metas:
            return None
        if slip == "swap in first":
            cache.swap_in(out.blocks_to_swap_in)
            cache.swap_out(out.blocks_to_swap_out)
        else:
            cache.swap_out(out.blocks_to_swap_out)
            cache.swap_in(out.blocks_to_swap_in)
        if slip != "copy first":
            cache.copy(out.blocks_to_copy)
        if not metas:
            return None
        with torch.inference_mode():
            logits = worker.run(worker.prepare_inputs(metas, worker.block_size, worker.device))
        if slip == "copy first":  # too late: the model read and wrote the blocks before their copies
            cache.copy(out.blocks_to_copy)
        return logits

    def step(self):
        slip = self.slip
        metas, out = self.scheduler.schedule()
        logits = self.execute(metas, out)
        if logits is not None:
            logits = self.take_prompt_logprobs(metas, logits)
        self.scheduler.update_num_computed_tokens(out)
        groups = [s.seq_group for s in out.scheduled_seq_groups]
        seen = self.__dict__.setdefault("seen", {})
        seen.update((g.request_id, g) for g in groups)
        rows = [(meta, group, seq) for meta, group in zip(metas, groups)
                if meta.do_sample or slip == "sample every row" for seq in meta.seq_data.values()]
        produced = []
        if rows:
            requests = [self.sample_request(meta, seq) for meta, _, seq in rows]
            samples = self.sampler(logits, requests)
            for (_, group, seq), tokens, logprobs in zip(rows, samples, sampled_logprobs(logits, requests, samples)):
                if seq.is_finished():
                    continue
                if slip == "every sample to the parent":
                    for t, lp in zip(tokens, logprobs):
                        seq.append_token_id(t, *lp)
                    self.check_stop(group, seq)
                    produced += [(group, seq, t) for t in tokens]
                    continue
                if slip == "fork after the parent's token":
                    seq.append_token_id(tokens[0], *logprobs[0])
                    seqs = [seq] + [self.fork(group, seq, t, lp) for t, lp in zip(tokens[1:], logprobs[1:])]
                else:
                    seqs = [seq] + [self.fork(group, seq, t, lp) for t, lp in zip(tokens[1:], logprobs[1:])]
                    seq.append_token_id(tokens[0], *logprobs[0])
                for s, token in zip(seqs, tokens):
                    if s is seq or slip != "forks not stop-checked":
                        self.check_stop(group, s)
                    produced.append((group, s, token))
        finished = [g.request_id for g in groups if g.is_finished()]
        if slip != "finished groups kept":
            self.scheduler.free_finished_seq_groups()
        reported = groups + ([] if slip == "ignored left out" else out.ignored_seq_groups)
        if slip == "every request seen":  # its own list of requests, which abort_request never empties
            reported = list(seen.values()) + out.ignored_seq_groups
        outputs = [o for g in reported if (o := self.output(g)) is not None]
        for request_id in finished + [g.request_id for g in out.ignored_seq_groups]:
            self.release(request_id)
            seen.pop(request_id, None)
        if slip != "no report":
            self.report_step(out, finished, produced, outputs)
        return outputs


def _loop(slip: str) -> type:
    return type(f"ServingLoop_{slip.replace(' ', '_')}", (_SlippingLoop,), {"slip": slip})


class _Wrapper(LLMEngine):  # the package's loop under the reader's name
    def step(self):
        return super().step()

    def execute(self, metas, out):
        return super().execute(metas, out)


class _WorkerWrapper(_SlippingLoop):  # execute hands the round to the package's worker
    def execute(self, metas, out):
        return self.executor.execute_model(metas, out.blocks_to_swap_in, out.blocks_to_swap_out, out.blocks_to_copy)


MISTAKES = {
    "check_input_builder": [functools.partial(_packing, slip=slip) for slip in (
        "positions from 0",       # every sequence's positions start at 0, computed prefix or not
        "prompt ids",             # reads the prompt's tokens: a decode or a recomputed prompt has none there
        "no block_size",          # slot = block + offset, forgetting that a block holds block_size slots
        "contiguous",             # assumes a sequence's blocks follow its first one
        "context is the chunk",   # context_lens = the new tokens only: attention would miss the past
        "sample every sequence",  # samples a prefill chunk that has not reached the prompt's end
        "first row",              # samples a sequence's first new row rather than its last
    )],
    "check_sampler": [_TopPShort, _TopKPlusOne, _CutBeforeTemperature, _SharedGenerator, _OneDrawRepeated,
                      _InPlaceTemperature, _NoAdjust, _UnseededOwnGenerator],
    "check_engine_step": [_loop(slip) for slip in (
        "swap in first",                  # swap-in before swap-out: a block swapped out may be the destination
        "copy first",                     # the copies after the model: it wrote into blocks not yet copied
        "no orders without groups",       # skips a round of cache orders alone
        "sample every row",               # samples a prefill chunk that has not reached its prompt's end
        "every sample to the parent",     # best_of samples all appended to one sequence, no forks
        "fork after the parent's token",  # the forks copy the parent's new token too
        "forks not stop-checked",         # the forks' text never detokenized, their stops never checked
        "finished groups kept",           # finished groups stay in the running queue
        "ignored left out",               # the requests the scheduler refused get no output
        "every request seen",             # returns requests not in the round, aborted ones too
        "no report",                      # the observers (history, totals) hear nothing
    )] + [LLMEngine, _Wrapper, _WorkerWrapper],
}
