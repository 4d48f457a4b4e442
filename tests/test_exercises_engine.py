"""The engine checkers (chapters 00 and 09) accept correct answers, written here by hand and
independently of the package, and reject plausible wrong ones."""

from __future__ import annotations

from tinyserve.exercises import engine as ex

# -- chapter 00: the rounds, worked out by hand -------------------------------------------------


def rounds_by_hand(prompt_lens, output_lens, token_budget, block_size=None, num_gpu_blocks=None,
                   prefill_mixes_decodes=False):
    """Play the vllm policy with ample memory: prefill rounds take waiting prompts in order while
    they fit the budget; otherwise every running request decodes. Returns per round
    (phase, tokens, free blocks)."""
    n = len(prompt_lens)
    waiting = list(range(n))
    running: list[int] = []
    made = [0] * n  # output tokens so far
    fed = [0] * n  # tokens whose K/V has been computed
    out = []
    while waiting or running:
        batch, budget = [], token_budget
        while waiting and prompt_lens[waiting[0]] <= budget:
            i = waiting.pop(0)
            budget -= prompt_lens[i]
            batch.append(i)
        if batch:
            phase, tokens = "prefill", sum(prompt_lens[i] for i in batch)
            decoders = list(running) if prefill_mixes_decodes else []
            for i in batch:
                fed[i] = prompt_lens[i]
                made[i] = 1
            for i in decoders:
                fed[i] += 1
                made[i] += 1
            running += batch
        else:
            phase, tokens = "decode", len(running)
            for i in running:
                fed[i] += 1
                made[i] += 1
        running = [i for i in running if made[i] < output_lens[i]]
        free = None
        if block_size is not None:
            free = num_gpu_blocks - sum(-(-fed[i] // block_size) for i in running)
        out.append((phase, tokens, free))
    return out


def phases(p, o, b):
    return [r[0] for r in rounds_by_hand(p, o, b)]


def tokens(p, o, b):
    return [r[1] for r in rounds_by_hand(p, o, b)]


def free_blocks(p, o, b, bs, g):
    return [r[2] for r in rounds_by_hand(p, o, b, bs, g)]


def test_round_phases():
    assert ex.check_round_phases(phases)
    # Mixing prefill and decode (orca) or forgetting the prefill's own token shifts the phases.
    assert not ex.check_round_phases(lambda p, o, b: ["prefill"] + ["decode"] * (max(o) - 1))
    assert not ex.check_round_phases(lambda p, o, b: [r[0] for r in rounds_by_hand(p, [x + 1 for x in o], b)])


def test_tokens_per_round():
    assert ex.check_tokens_per_round(tokens)
    # The seed preset's rounds: 5+5, then 3, then decodes of 3 sequences.
    assert tokens([5, 5, 3], [8, 8, 8], 10)[:3] == [10, 3, 3]
    mixing = lambda p, o, b: [r[1] for r in rounds_by_hand(p, o, b, prefill_mixes_decodes=True)]  # noqa: E731
    assert not ex.check_tokens_per_round(mixing)
    assert not ex.check_tokens_per_round(lambda p, o, b: [sum(p)] + [len(p)] * (max(o) - 1))


def test_free_blocks():
    assert ex.check_free_blocks(free_blocks)
    # Counting the K/V of the token just sampled (not computed yet) is one too many at block edges.
    def holds_sampled_token(p, o, b, bs, g):
        n = len(p)
        waiting, running, made, fed, out = list(range(n)), [], [0] * n, [0] * n, []
        while waiting or running:
            batch, budget = [], b
            while waiting and p[waiting[0]] <= budget:
                i = waiting.pop(0)
                budget -= p[i]
                batch.append(i)
            for i in batch or running:
                fed[i] = p[i] if i in batch else fed[i] + 1
                made[i] += 1
            running = [i for i in running + batch if made[i] < o[i]]
            out.append(g - sum(-(-(fed[i] + 1) // bs) for i in running))
        return out
    assert not ex.check_free_blocks(holds_sampled_token)

    def never_frees(p, o, b, bs, g):
        rows = rounds_by_hand(p, o, b, bs, g)
        low = g
        result = []
        for r in rows:
            low = min(low, r[2])
            result.append(low)
        return result
    assert not ex.check_free_blocks(never_frees)


# -- chapter 09 -----------------------------------------------------------------------------------


def pack(seqs, block_size):
    positions, slots, starts, context = [], [], [0], []
    for computed, new, table in seqs:
        for p in range(computed, computed + new):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        starts.append(starts[-1] + new)
        context.append(computed + new)
    return {"positions": positions, "slot_mapping": slots, "query_start_loc": starts, "context_lens": context}


def test_packed_inputs():
    assert ex.check_packed_inputs(pack)

    def positions_from_zero(seqs, block_size):
        got = pack(seqs, block_size)
        got["positions"] = [p for _, new, _ in seqs for p in range(new)]
        return got

    def context_without_new_tokens(seqs, block_size):
        got = pack(seqs, block_size)
        got["context_lens"] = [c for c, _, _ in seqs]
        return got

    def slot_is_block(seqs, block_size):
        got = pack(seqs, block_size)
        got["slot_mapping"] = [table[p // block_size] for c, n, table in seqs for p in range(c, c + n)]
        return got

    def starts_without_zero(seqs, block_size):
        got = pack(seqs, block_size)
        got["query_start_loc"] = got["query_start_loc"][1:]
        return got

    for wrong in (positions_from_zero, context_without_new_tokens, slot_is_block, starts_without_zero):
        assert not ex.check_packed_inputs(wrong), wrong.__name__


def keep(probs, top_k, top_p):
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if top_k != -1:
        order = order[:top_k]
    kept, mass = [], 0.0
    for i in order:
        if kept and mass >= top_p:
            break
        kept.append(i)
        mass += probs[i]
    return sorted(kept)


def test_top_k_top_p():
    assert ex.check_top_k_top_p(keep)
    # The fixed distribution of the chapter: 0.40, 0.25, 0.20, 0.10, 0.05 in rank order.
    fixed = [0.05, 0.40, 0.25, 0.20, 0.10]
    assert keep(fixed, -1, 0.5) == [1, 2] and keep(fixed, 3, 1.0) == [1, 2, 3]

    def stops_before_reaching_p(probs, top_k, top_p):  # drops the token that crosses top_p
        kept = keep(probs, top_k, top_p)
        order = sorted(kept, key=lambda i: -probs[i])
        return sorted(order[:-1] or order)

    def ignores_top_k(probs, top_k, top_p):
        return keep(probs, -1, top_p)

    def keeps_the_least_likely(probs, top_k, top_p):
        order = sorted(range(len(probs)), key=lambda i: probs[i])
        return sorted(order[: top_k if top_k != -1 else len(probs)])

    for wrong in (stops_before_reaching_p, ignores_top_k, keeps_the_least_likely):
        assert not ex.check_top_k_top_p(wrong), wrong.__name__


def apply_round(gpu, cpu, swap_out, swap_in, copy, writes, order=("out", "in", "copy", "model")):
    gpu, cpu = list(gpu), list(cpu)
    for op in order:
        if op == "out":
            for g, c in swap_out.items():
                cpu[c] = gpu[g]
        elif op == "in":
            for c, g in swap_in.items():
                gpu[g] = cpu[c]
        elif op == "copy":
            for src, dsts in copy.items():
                for d in dsts:
                    gpu[d] = gpu[src]
        else:
            for b, v in writes.items():
                gpu[b] = v
    return gpu, cpu


def test_worker_order():
    assert ex.check_worker_order(apply_round)
    # Every other order of the four operations loses or corrupts something on some case.
    import itertools

    for order in itertools.permutations(("out", "in", "copy", "model")):
        if order == ("out", "in", "copy", "model"):
            continue
        wrong = lambda *a, order=order: apply_round(*a, order=order)  # noqa: E731
        assert not ex.check_worker_order(wrong), order


def test_worker_order_reference_on_the_walkthrough():
    # Round 3: s2's block 2 is saved to CPU block 0 before s1's new token is written into it.
    gpu, cpu = ex.worker_order_reference([100, 101, 102, 103], [200, 201], {2: 0}, {}, {}, {3: 300, 2: 301})
    assert cpu == [102, 201] and gpu == [100, 101, 301, 300]


def test_a_crashing_answer_is_a_failed_case(capsys):
    def crashes(*args):
        raise NotImplementedError

    assert not ex.check_packed_inputs(crashes)
    assert "raised NotImplementedError" in capsys.readouterr().out
