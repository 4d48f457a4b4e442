"""Solutions to the exercises of chapter 09, the worker and the engine."""

from __future__ import annotations

import torch

from tinyserve.sampler import Sampler


class NucleusSampler(Sampler):
    """Top-p one row at a time: sort the row's probabilities, find with ``searchsorted`` where
    their running sum reaches ``top_p``, and draw from the tokens up to there."""

    def __call__(self, logits, requests):
        results = []
        for row, request in zip(logits, requests):
            params = request.params
            if params.greedy:
                results.append([int(row.argmax())] * request.num_samples)
                continue
            if params.top_k != -1:
                raise ValueError("NucleusSampler does top-p only: top_k must be -1")
            probs = torch.softmax(row.float() / params.temperature, dim=-1)
            ranked, order = probs.sort(descending=True)
            # The first rank whose running sum reaches top_p: it and every likelier token stay.
            cut = int(torch.searchsorted(ranked.cumsum(0), torch.tensor([params.top_p], device=row.device)))
            keep = order[:cut + 1]
            nucleus = torch.zeros_like(probs)
            nucleus[keep] = probs[keep]
            nucleus /= nucleus.sum()
            drawn = torch.multinomial(nucleus.cpu(), request.num_samples, replacement=True,
                                      generator=request.generator or self.generator)
            results.append(drawn.tolist())
        return results


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
