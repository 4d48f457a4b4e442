"""Solutions to the exercises of chapter 09, the worker and the engine."""

from __future__ import annotations

import torch

from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.engine import LLMEngine as PackageEngine
from tinyserve.logprobs import sampled_logprobs
from tinyserve.model_runner import ModelInput
from tinyserve.sampler import Sampler as PackageSampler
from tinyserve.sampler import apply_min_p


def prepare_inputs(groups, block_size, device="cpu"):
    """Every scheduled sequence's new tokens back to back, no padding: positions
    ``num_computed_tokens .. num_computed_tokens + token_chunk_size - 1`` of each."""
    input_ids, positions, slots = [], [], []
    query_lens, context_lens, tables = [], [], []
    sample_indices, sample_seqs = [], []
    for meta in groups:
        for seq_id, seq in meta.seq_data.items():
            table = meta.block_tables[seq_id]
            start = seq.num_computed_tokens
            end = start + meta.token_chunk_size
            # get_token_ids, not the prompt's: a recomputed prompt brings its outputs too, and a
            # decode's one token is the last one sampled.
            input_ids += seq.get_token_ids()[start:end]
            positions += range(start, end)
            # Position p is at offset p % block_size of block table[p // block_size].
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            query_lens.append(end - start)
            context_lens.append(end)  # attention reads the whole past, this round's tokens included
            tables.append(table)
            if meta.do_sample:  # a prefill chunk short of the prompt's end predicts nothing yet
                sample_indices.append(len(input_ids) - 1)
                sample_seqs.append((meta, seq))
    return ModelInput(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        attn_metadata=AttentionMetadata.build(query_lens, context_lens, tables, slots, device=device),
        sample_indices=torch.tensor(sample_indices, dtype=torch.long, device=device),
        sample_seqs=sample_seqs,
    )


class Sampler(PackageSampler):
    """One row at a time: the argmax for a greedy row; otherwise temperature, then the top-k and
    top-p cut on the sorted probabilities, then one draw of all the row's samples. Section 9.7's
    extras stay the package's: ``_adjust`` (min_tokens and the penalties) and ``apply_min_p``."""

    def __init__(self, seed: int = 0) -> None:
        # Unseeded requests share this generator, seeded once: a run is reproducible as a whole.
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits, requests):
        if len(requests) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(requests)} sample requests")
        logits = self._adjust(logits, requests)  # a copy when it changes anything: the engine reads the originals
        results = []
        for row, request in zip(logits, requests):
            params = request.params
            if params.greedy:
                results.append([int(row.argmax())] * request.num_samples)
                continue
            probs = self.distribution(row, params).cpu()
            if not torch.isfinite(probs).all():  # this request fails alone; the others go on
                results.append(ValueError("the next-token probabilities are not finite (NaN or inf in the logits)"))
                continue
            try:
                drawn = torch.multinomial(probs, request.num_samples, replacement=True,
                                          generator=request.generator or self.generator)
            except RuntimeError as e:  # torch's own check of the distribution
                results.append(e)
                continue
            results.append(drawn.tolist())
        return results

    @staticmethod
    def distribution(row, params):
        """The row's probabilities after temperature, top-k, top-p and min_p."""
        scaled = row / params.temperature
        if params.top_k != -1 or params.top_p < 1.0:
            ranked, order = scaled.softmax(dim=-1).sort(descending=True)
            keep = torch.ones_like(ranked, dtype=torch.bool)
            if params.top_k != -1:
                keep[params.top_k:] = False
            # A token stays while the mass ranked before it is short of top_p; the likeliest always stays.
            keep &= ranked.cumsum(dim=-1) - ranked < params.top_p
            keep[0] = True
            scaled = torch.full_like(scaled, float("-inf")).index_copy(0, order[keep], scaled[order[keep]])
        if params.min_p > 0:
            floor = torch.tensor([params.min_p], dtype=scaled.dtype, device=scaled.device)
            scaled = apply_min_p(scaled[None], floor)[0]
        return scaled.softmax(dim=-1)


def apply_round(gpu, cpu, swap_out, swap_in, copy, writes):
    # The worker's order: swap out, swap in, copy, then the model's writes.
    gpu, cpu = list(gpu), list(cpu)
    for g, c in swap_out.items():
        cpu[c] = gpu[g]
    for c, g in swap_in.items():
        gpu[g] = cpu[c]
    for src, dsts in copy.items():
        for d in dsts:
            gpu[d] = gpu[src]
    for b, value in writes.items():
        gpu[b] = value
    return gpu, cpu


class ServingLoop(PackageEngine):
    """The serving loop, from the contracts of the engine's tools (section 9.4)."""

    def execute(self, metas, out):
        worker = self.executor
        cache = worker.cache_engine
        # Swap-out first: the blocks it empties may be this round's swap-in or copy destinations,
        # or its new tokens' slots. Swap-in before the copies: a copy may read a block it brings back.
        cache.swap_out(out.blocks_to_swap_out)
        cache.swap_in(out.blocks_to_swap_in)
        cache.copy(out.blocks_to_copy)
        if not metas:
            return None
        with torch.inference_mode():  # no autograd bookkeeping: nothing is trained here
            return worker.run(worker.prepare_inputs(metas, worker.block_size, worker.device))

    def step(self):
        metas, out = self.scheduler.schedule()
        logits = self.execute(metas, out)
        if logits is not None:
            logits = self.take_prompt_logprobs(metas, logits)  # reads the positions before they advance
        self.scheduler.update_num_computed_tokens(out)
        groups = [scheduled.seq_group for scheduled in out.scheduled_seq_groups]
        # A row per sequence of a group that reached its end (a prefill chunk short of it has none).
        rows = [(meta, group, seq) for meta, group in zip(metas, groups) if meta.do_sample
                for seq in meta.seq_data.values()]
        produced = []
        if rows:
            requests = [self.sample_request(meta, seq) for meta, _, seq in rows]
            samples = self.sampler(logits, requests)
            for (_, group, seq), tokens, logprobs in zip(rows, samples, sampled_logprobs(logits, requests, samples)):
                if seq.is_finished():  # its request failed on an earlier row
                    continue
                if isinstance(tokens, Exception):
                    self.fail(group, f"sampling failed: {tokens}")
                    continue
                # Forks copy the parent before it takes its own token, the first.
                seqs = [seq] + [self.fork(group, seq, t, lp) for t, lp in zip(tokens[1:], logprobs[1:])]
                seq.append_token_id(tokens[0], *logprobs[0])
                for s, token in zip(seqs, tokens):
                    self.check_stop(group, s)
                    produced.append((group, s, token))
        finished = [g.request_id for g in groups if g.is_finished()]
        self.scheduler.free_finished_seq_groups()
        outputs = [o for g in groups + out.ignored_seq_groups if (o := self.output(g)) is not None]
        for request_id in finished + [g.request_id for g in out.ignored_seq_groups]:
            self.release(request_id)
        self.report_step(out, finished, produced, outputs)
        return outputs
