"""Checkers for the scheduling chapters (04 iteration-level scheduling, 05 the vLLM scheduler).

Each checker calls the reader's function on fixed and random cases and compares its answers
with what the package's real Scheduler (or simulator) does in the same situation.

Chapter 04: ``check_orca_batches``, ``check_static_batching``, ``check_finish_rounds``.
Chapter 05: ``check_admission``, ``check_victim``, ``check_preemption_mode``, ``check_swap_in``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tinyserve.block_manager import BlockSpaceManager
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.verdict import verdict
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from tinyserve.sim import Request, simulate
from tinyserve.viz.rounds import finish_rounds, static_batching

# -- chapter 04 ---------------------------------------------------------------------------------

AMPLE_CACHE = CacheConfig(block_size=16, num_gpu_blocks=4096, num_cpu_blocks=0, watermark=0.0)


def _ample_scheduler_config(policy: str) -> SchedulerConfig:
    """Budgets so large that only the policy decides who runs."""
    return SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64, max_model_len=4096, policy=policy)


def _ae() -> list[Request]:
    needs = {"A": (10, 1), "B": (15, 1), "C": (5, 1), "D": (8, 2), "E": (12, 3)}
    return [Request(rid, 4, out, arrival) for rid, (out, arrival) in needs.items()]


def _workloads(num_cases: int, seed: int) -> list[list[Request]]:
    rng = random.Random(seed)
    cases = [_ae()]
    while len(cases) < num_cases:
        n = rng.randint(1, 7)
        cases.append([Request(chr(ord("A") + i), rng.randint(1, 12), rng.randint(1, 12), rng.randint(1, 6))
                      for i in range(n)])
    return cases


def _describe(requests: list[Request]) -> str:
    return ", ".join(f"{r.request_id}(out={r.output_len}, arrives={r.arrival_round})" for r in requests)


def _compare(name: str, cases: list, expected: Callable, given: Callable, describe: Callable) -> bool:
    failures = []
    for case in cases:
        want = expected(case)
        try:
            got = given(case)
        except Exception as e:  # a crash is a failed case, reported like any other
            failures.append(f"{describe(case)}: raised {type(e).__name__}: {e}")
            continue
        if got != want:
            failures.append(f"{describe(case)}: expected {want!r}, got {got!r}")
    return verdict(name, failures, len(cases))


def check_orca_batches(fn: Callable[[list[Request]], list[int]], num_cases: int = 30, seed: int = 0) -> bool:
    """``fn(requests)`` returns the batch size of every round under the orca policy, from round 1
    until the last request finishes, when memory and budgets never bind. A request's prefill
    produces its first token; a round in which nobody has arrived yet has batch size 0."""
    def expected(reqs):
        return [r.batch_size for r in simulate(reqs, _ample_scheduler_config("orca"), AMPLE_CACHE)]

    return _compare("check_orca_batches", _workloads(num_cases, seed), expected,
                    lambda reqs: list(fn([Request(**vars(r)) for r in reqs])), _describe)


def check_static_batching(fn: Callable[[list[Request], int], dict[str, int]], num_cases: int = 30,
                          seed: int = 1) -> bool:
    """``fn(requests, max_batch_size)`` returns {request id: round of its last token} under
    request-level batching: a batch of up to max_batch_size arrived requests (first come first
    served) starts when the previous one is done and runs until its longest member finishes."""
    rng = random.Random(seed)
    cases = [(reqs, 5 if i == 0 else rng.randint(1, 4)) for i, reqs in enumerate(_workloads(num_cases, seed))]
    return _compare("check_static_batching", cases,
                    lambda c: finish_rounds(static_batching(c[0], c[1])),
                    lambda c: dict(fn([Request(**vars(r)) for r in c[0]], c[1])),
                    lambda c: f"max_batch_size={c[1]}, {_describe(c[0])}")


def check_finish_rounds(fn: Callable[[list[Request], str], dict[str, int]], num_cases: int = 30,
                        seed: int = 2) -> bool:
    """``fn(requests, policy)`` returns {request id: round of its last token} under policy
    "orca" or "vllm", when memory and budgets never bind."""
    cases = [(reqs, policy) for reqs in _workloads(num_cases // 2, seed) for policy in ("orca", "vllm")]

    def expected(c):
        return finish_rounds(simulate(c[0], _ample_scheduler_config(c[1]), AMPLE_CACHE))

    return _compare("check_finish_rounds", cases, expected,
                    lambda c: dict(fn([Request(**vars(r)) for r in c[0]], c[1])),
                    lambda c: f"policy={c[1]}, {_describe(c[0])}")


# -- chapter 05 ---------------------------------------------------------------------------------

def _group(request_id: str, seq_id: int, prompt_len: int, block_size: int, num_outputs: int = 0) -> SequenceGroup:
    seq = Sequence(seq_id, None, list(range(1000, 1000 + prompt_len)), block_size)
    for t in range(num_outputs):
        seq.append_token_id(t)
    return SequenceGroup(request_id, [seq], SamplingParams(max_tokens=64), arrival_time=float(seq_id))


def _admitted(case: dict) -> list[str]:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=case["token_budget"], max_num_seqs=case["max_num_seqs"],
                                      max_model_len=case["token_budget"]),
                      CacheConfig(block_size=case["block_size"], num_gpu_blocks=case["num_free_blocks"],
                                  num_cpu_blocks=0, watermark=0.0))
    for i, (rid, n) in enumerate(case["waiting"]):
        sched.add_seq_group(_group(rid, i, n, case["block_size"]))
    _, out = sched.schedule()
    return [g.request_id for g in out.scheduled_seq_groups]


def check_admission(fn: Callable[..., list[str]], num_cases: int = 40, seed: int = 3) -> bool:
    """``fn(waiting, token_budget, max_num_seqs, num_free_blocks, block_size)`` returns the ids
    the vLLM policy admits into a prefill round, in order. ``waiting`` is a list of
    (request id, prompt length), front of the queue first; nothing is running. Every prompt
    fits the token budget and the cache on its own."""
    rng = random.Random(seed)
    cases = []
    for _ in range(num_cases):
        block_size = rng.choice([2, 4, 8])
        budget = rng.randint(8, 40)
        free = rng.randint(2, 10)
        longest = min(budget, free * block_size)
        waiting = [(f"r{i}", rng.randint(1, longest)) for i in range(rng.randint(1, 6))]
        cases.append({"waiting": waiting, "token_budget": budget, "max_num_seqs": rng.randint(1, 5),
                      "num_free_blocks": free, "block_size": block_size})
    return _compare("check_admission", cases, _admitted,
                    lambda c: list(fn(list(c["waiting"]), c["token_budget"], c["max_num_seqs"],
                                      c["num_free_blocks"], c["block_size"])),
                    lambda c: ", ".join(f"{k}={v}" for k, v in c.items()))


def _victims(case: dict) -> list[str]:
    """Set up a real decode round: each request holds one block of 4 slots; a prompt of 4
    tokens fills it, so after its first token it needs a second block, a prompt of 3 does not."""
    running, needs, free = case["running"], case["needs_block"], case["num_free_blocks"]
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=256,
                                      preemption_mode="recompute"),
                      CacheConfig(block_size=4, num_gpu_blocks=len(running) + free, num_cpu_blocks=0, watermark=0.0))
    for i, rid in enumerate(running):
        sched.add_seq_group(_group(rid, i, 4 if needs[rid] else 3, 4))
    _, prefill = sched.schedule()
    for group in prefill.scheduled_seq_groups:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            seq.num_computed_tokens = seq.get_len()
            seq.append_token_id(7)
    _, out = sched.schedule()
    return list(out.preempted)


def check_victim(fn: Callable[[list[str], dict[str, bool], int], list[str]], num_cases: int = 40,
                 seed: int = 4) -> bool:
    """``fn(running, needs_block, num_free_blocks)`` returns the ids preempted, in order, in a
    decode round. ``running`` is oldest first; ``needs_block[id]`` says whether that request
    needs a new block for its next token; each running request holds exactly one block, which
    is freed if it is preempted (recompute)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(num_cases):
        running = [f"r{i}" for i in range(rng.randint(1, 6))]
        cases.append({"running": running, "needs_block": {rid: rng.random() < 0.6 for rid in running},
                      "num_free_blocks": rng.randint(0, 2)})
    return _compare("check_victim", cases, _victims,
                    lambda c: list(fn(list(c["running"]), dict(c["needs_block"]), c["num_free_blocks"])),
                    lambda c: f"running={c['running']}, needs_block={c['needs_block']}, "
                              f"num_free_blocks={c['num_free_blocks']}")


def _mode(case: tuple[int, str | None]) -> str:
    num_seqs, setting = case
    seqs = []
    for i in range(num_seqs):
        seq = Sequence(i, None, [1, 2, 3], 4)
        seq.append_token_id(i)
        seq.status = SequenceStatus.RUNNING
        seqs.append(seq)
    group = SequenceGroup("g", seqs, SamplingParams(n=num_seqs, temperature=1.0), arrival_time=0.0)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, preemption_mode=setting),
                      CacheConfig(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8))
    return sched._preemption_mode(group).value


def check_preemption_mode(fn: Callable[[int, str | None], str]) -> bool:
    """``fn(num_seqs, preemption_mode)`` returns "swap" or "recompute": how a group of num_seqs
    running sequences is preempted when the config's preemption_mode is "swap", "recompute" or
    None (vLLM's rule)."""
    cases = [(n, setting) for n in (1, 2, 3, 4) for setting in (None, "swap", "recompute")]
    return _compare("check_preemption_mode", cases, _mode, lambda c: fn(*c),
                    lambda c: f"num_seqs={c[0]}, preemption_mode={c[1]!r}")


def _can_swap_in(case: dict) -> bool:
    """The real BlockSpaceManager: a group of num_seqs sequences sharing num_blocks blocks is
    swapped out, then the GPU is filled until num_free_gpu_blocks remain."""
    total = 100
    bm = BlockSpaceManager(4, total, case["num_blocks"], watermark=case["watermark_blocks"] / total)
    parent = Sequence(0, None, list(range(4 * case["num_blocks"])), 4)
    group = SequenceGroup("g", [parent], SamplingParams(n=case["num_seqs"], temperature=1.0), arrival_time=0.0)
    bm.allocate(group)
    parent.status = SequenceStatus.RUNNING
    for i in range(1, case["num_seqs"]):
        child = parent.fork(i)
        bm.fork(parent, child)
        group.add(child)
    bm.swap_out(group)
    for seq in group.get_seqs():
        seq.status = SequenceStatus.SWAPPED
    filler = _group("filler", 99, 4 * (total - case["num_free_gpu_blocks"]), 4)
    if total > case["num_free_gpu_blocks"]:
        bm.allocate(filler)
    return bm.can_swap_in(group)


def check_swap_in(fn: Callable[[int, int, int, int], bool], num_cases: int = 40, seed: int = 5) -> bool:
    """``fn(num_blocks, num_seqs, num_free_gpu_blocks, watermark_blocks)`` returns whether a
    swapped group can come back: its num_seqs sequences share num_blocks blocks in CPU memory,
    the GPU has num_free_gpu_blocks free, and admission keeps watermark_blocks in reserve."""
    rng = random.Random(seed)
    cases = []
    for _ in range(num_cases):
        blocks, seqs, wm = rng.randint(1, 6), rng.randint(1, 3), rng.randint(0, 3)
        # Free counts around the threshold, where a wrong rule shows.
        free = max(0, blocks + seqs + wm + rng.randint(-3, 2))
        cases.append({"num_blocks": blocks, "num_seqs": seqs, "num_free_gpu_blocks": free, "watermark_blocks": wm})
    return _compare("check_swap_in", cases, _can_swap_in,
                    lambda c: bool(fn(c["num_blocks"], c["num_seqs"], c["num_free_gpu_blocks"],
                                      c["watermark_blocks"])),
                    lambda c: ", ".join(f"{k}={v}" for k, v in c.items()))
