"""Solutions to chapter 00's exercises: predict the engine's rounds.

One function plays the rounds by the rules the chapter states (first come, first served
prefills while they fit the budget, otherwise everyone decodes), and each answer reads one
column off it.
"""


def play(prompt_lens, output_lens, token_budget, block_size=1, num_gpu_blocks=0):
    """Each round as (phase, tokens processed, free blocks after the round)."""
    waiting = list(range(len(prompt_lens)))
    running, cached, made, rounds = [], {}, {}, []
    while waiting or running:
        admitted, budget = [], token_budget
        while waiting and prompt_lens[waiting[0]] <= budget:
            budget -= prompt_lens[waiting[0]]
            admitted.append(waiting.pop(0))
        if admitted:
            phase, tokens = "prefill", sum(prompt_lens[i] for i in admitted)
            for i in admitted:
                cached[i], made[i] = prompt_lens[i], 1
            running += admitted
        else:
            phase, tokens = "decode", len(running)
            for i in running:
                cached[i] += 1
                made[i] += 1
        running = [i for i in running if made[i] < output_lens[i]]
        free = num_gpu_blocks - sum(-(-cached[i] // block_size) for i in running)
        rounds.append((phase, tokens, free))
    return rounds


def round_phases(prompt_lens, output_lens, token_budget):
    return [phase for phase, _, _ in play(prompt_lens, output_lens, token_budget)]


def tokens_per_round(prompt_lens, output_lens, token_budget):
    return [tokens for _, tokens, _ in play(prompt_lens, output_lens, token_budget)]


def free_blocks(prompt_lens, output_lens, token_budget, block_size, num_gpu_blocks):
    return [free for _, _, free in play(prompt_lens, output_lens, token_budget, block_size, num_gpu_blocks)]
