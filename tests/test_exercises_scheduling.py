"""The scheduling checkers accept correct answers (written here by hand, independently of the
package) and reject plausible wrong ones."""

from __future__ import annotations

from tinyserve.exercises import scheduling as ex

# -- chapter 04 ---------------------------------------------------------------------------------


def orca_batches(requests):
    left = {r.request_id: r.output_len for r in requests}
    sizes, rnd = [], 0
    while any(left.values()):
        rnd += 1
        batch = [r.request_id for r in requests if r.arrival_round <= rnd and left[r.request_id] > 0]
        for rid in batch:
            left[rid] -= 1
        sizes.append(len(batch))
    return sizes


def orca_batches_skipping_empty_rounds(requests):
    return [n for n in orca_batches(requests) if n]


def orca_batches_prefill_makes_no_token(requests):
    left = {r.request_id: r.output_len + 1 for r in requests}
    sizes, rnd = [], 0
    while any(left.values()):
        rnd += 1
        batch = [r.request_id for r in requests if r.arrival_round <= rnd and left[r.request_id] > 0]
        for rid in batch:
            left[rid] -= 1
        sizes.append(len(batch))
    return sizes


def static_finish(requests, max_batch_size, off_by_one=0, ignore_arrivals=False):
    queue = sorted(requests, key=lambda r: r.arrival_round)
    rnd, done = 1, {}
    while queue:
        arrived = queue if ignore_arrivals else [r for r in queue if r.arrival_round <= rnd]
        if not arrived:
            rnd += 1
            continue
        batch = arrived[:max_batch_size]
        for r in batch:
            done[r.request_id] = rnd + r.output_len - 1 + off_by_one
            queue.remove(r)
        rnd += max(r.output_len for r in batch)
    return done


def finish(requests, policy, vllm_one_prefill_at_a_time=False, vllm_like_orca=False):
    left = {r.request_id: r.output_len for r in requests}
    started, done, rnd = [], {}, 0
    while len(done) < len(requests):
        rnd += 1
        arrived = [r.request_id for r in requests if r.arrival_round <= rnd and r.request_id not in started]
        if policy == "vllm" and arrived and not vllm_like_orca:
            batch = arrived[:1] if vllm_one_prefill_at_a_time else arrived
        else:
            batch = [rid for rid in started if rid not in done] + arrived
        for rid in batch:
            if rid not in started:
                started.append(rid)
            left[rid] -= 1
            if left[rid] == 0:
                done[rid] = rnd
    return done


def test_chapter_04_checkers_accept_correct_answers():
    assert ex.check_orca_batches(orca_batches)
    assert ex.check_static_batching(static_finish)
    assert ex.check_finish_rounds(finish)


def test_chapter_04_checkers_reject_wrong_answers(capsys):
    assert not ex.check_orca_batches(orca_batches_skipping_empty_rounds)
    assert not ex.check_orca_batches(orca_batches_prefill_makes_no_token)
    assert not ex.check_static_batching(lambda reqs, k: static_finish(reqs, k, off_by_one=1))
    assert not ex.check_static_batching(lambda reqs, k: static_finish(reqs, k, ignore_arrivals=True))
    assert not ex.check_finish_rounds(lambda reqs, p: finish(reqs, p, vllm_like_orca=True))
    assert not ex.check_finish_rounds(lambda reqs, p: finish(reqs, p, vllm_one_prefill_at_a_time=True))
    assert "✗ check_finish_rounds" in capsys.readouterr().out


# -- chapter 05 ---------------------------------------------------------------------------------


def admission(waiting, token_budget, max_num_seqs, num_free_blocks, block_size, skip=False, blocks=True,
              seqs=True):
    out = []
    for rid, n in waiting:
        need = -(-n // block_size)
        fits = n <= token_budget and (not seqs or len(out) < max_num_seqs) and (not blocks or need <= num_free_blocks)
        if not fits:
            if skip:
                continue
            break
        out.append(rid)
        token_budget -= n
        num_free_blocks -= need
    return out


def victims(running, needs_block, num_free_blocks, oldest_first=False, self_first=False, no_free_on_preempt=False):
    remaining, out, free = list(running), [], num_free_blocks
    while remaining:
        g = remaining.pop(0)
        if not needs_block[g]:
            continue
        if self_first and free == 0:
            out.append(g)
            free += 0 if no_free_on_preempt else 1
            continue
        while free == 0:
            if remaining:
                out.append(remaining.pop(0) if oldest_first else remaining.pop())
                free += 0 if no_free_on_preempt else 1
            else:
                out.append(g)
                break
        else:
            free -= 1
    return out


def mode(num_seqs, setting):
    # Recompute rebuilds a single sequence only: several are swapped even when recompute is forced.
    if setting == "swap" or num_seqs > 1:
        return "swap"
    return "recompute"


def swap_in(num_blocks, num_seqs, num_free_gpu_blocks, watermark_blocks):
    # Each sequence appends a token right after it comes back, so it may need one more block.
    return num_free_gpu_blocks - (num_blocks + num_seqs) >= watermark_blocks


def test_chapter_05_checkers_accept_correct_answers():
    assert ex.check_admission(admission)
    assert ex.check_victim(victims)
    assert ex.check_preemption_mode(mode)
    assert ex.check_swap_in(swap_in)


def test_chapter_05_checkers_reject_wrong_answers():
    assert not ex.check_admission(lambda *a: admission(*a, skip=True))
    assert not ex.check_admission(lambda *a: admission(*a, blocks=False))
    assert not ex.check_admission(lambda *a: admission(*a, seqs=False))
    assert not ex.check_victim(lambda *a: victims(*a, oldest_first=True))
    assert not ex.check_victim(lambda *a: victims(*a, self_first=True))
    assert not ex.check_victim(lambda *a: victims(*a, no_free_on_preempt=True))
    assert not ex.check_preemption_mode(lambda n, s: s or "recompute")
    assert not ex.check_preemption_mode(lambda n, s: s or "swap")
    assert not ex.check_preemption_mode(lambda n, s: mode(n, None))  # ignores the setting
    assert not ex.check_preemption_mode(lambda n, s: s or mode(n, None))  # recomputes several sequences
    assert not ex.check_swap_in(lambda b, n, f, w: f - b >= w)  # forgets the appended token
    assert not ex.check_swap_in(lambda b, n, f, w: f >= b + n)  # forgets the watermark
    assert not ex.check_swap_in(lambda b, n, f, w: f - (b + n) > w)


def test_a_crashing_answer_is_a_failed_case_not_a_crash(capsys):
    def boom(*_):
        raise KeyError("oops")

    assert not ex.check_admission(boom)
    assert "raised KeyError" in capsys.readouterr().out


def test_checkers_are_reachable_from_the_package():
    import tinyserve.exercises as exercises

    assert exercises.check_victim is ex.check_victim
