"""Solutions to chapter 04's exercises: Orca's rounds, both policies, Orca's reservation."""


def orca_batches(requests):
    # A request is in the batch from its arrival round until it has all its tokens.
    left = {r.request_id: r.output_len for r in requests}
    sizes = []
    while any(left.values()):
        now = len(sizes) + 1
        batch = [r.request_id for r in requests if r.arrival_round <= now and left[r.request_id] > 0]
        for rid in batch:
            left[rid] -= 1
        sizes.append(len(batch))
    return sizes


def finish_rounds(requests, policy):
    # Each round, decide who runs, then give each of them one token.
    left = {r.request_id: r.output_len for r in requests}
    started, done, now = [], {}, 0
    while len(done) < len(requests):
        now += 1
        new = [r.request_id for r in requests if r.arrival_round <= now and r.request_id not in started]
        if policy == "vllm" and new:
            batch = new                       # a prefill-only round
        else:
            batch = [rid for rid in started if rid not in done] + new
        for rid in batch:
            if rid not in started:
                started.append(rid)
            left[rid] -= 1
            if left[rid] == 0:
                done[rid] = now
    return done


class OrcaReservation:
    """Admit a request only if its prompt and all of its max_tokens fit beside the reservations
    of the admitted requests that have not finished."""

    def __init__(self):
        self.reserved = {}  # request id -> (group, blocks reserved for it)

    def __call__(self, group, budget, block_manager):
        bs = block_manager.block_size
        need = -(-(group.get_seqs()[0].get_prompt_len() + group.sampling_params.max_tokens) // bs)
        held = sum(blocks for rid, (g, blocks) in self.reserved.items()
                   if rid != group.request_id and not g.is_finished())
        if held + need > block_manager.num_total_gpu_blocks:
            return False
        self.reserved[group.request_id] = (group, need)
        return True
