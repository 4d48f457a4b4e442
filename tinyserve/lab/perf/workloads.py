"""The benchmark workloads: real token ids cut from one passage, with exact output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Prompts are cut from this text (written for the book), so every prompt is real English.
PASSAGE = """\
The harbour woke before the town did. Long before the bakers lit their ovens, the fishing boats
came back through the narrow gap in the sea wall, one after another, their lamps swinging, and
the gulls followed them in like a second, noisier fleet. On the quay an old woman sold coffee
from a cart with one squeaking wheel. She knew every captain by the way he tied his rope, and
she knew which of them would pay today and which would promise to pay tomorrow.
By seven the market stalls were up. There were crates of silver sardines, baskets of mussels
still closed tight against the air, a single enormous tuna laid out on ice like a sleeping
dog. Children ran between the tables, and the stall keepers shouted prices that fell as the
morning went on. A teacher walked her class along the water to count the boats and to learn
the names of the fish, and most of the children learned instead how far a gull can carry a
stolen piece of bread.
In the afternoon the wind turned. It came from the west, warm and full of salt, and the
shutters of the houses on the hill began to knock against their frames. The ferry to the
island was cancelled, and a group of travellers sat in the waiting room with their bags,
reading the same timetable again and again as if it might change its mind. A boy who worked at
the ticket office brought them tea and told them, with great seriousness, that the sea always
calms down by the evening, which was not true, but it made everyone feel better.
When the storm finally arrived it was shorter than anyone had feared. The rain hammered the
roofs for an hour, the streets turned into small rivers, and then the clouds tore open and the
whole bay was lit from below by a low orange sun. People came out onto their balconies to look.
Somebody played an accordion badly and nobody minded. The fishermen checked their boats, the
old woman folded her umbrella, and the town, which had been holding its breath all afternoon,
let it out again and went looking for dinner.
"""


# -- workloads -------------------------------------------------------------------------------------


@dataclass
class Workload:
    """Requests as token ids, each with the exact number of tokens it must generate."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def load_tokenizer(model: str = "smollm2-135m"):
    from transformers import AutoTokenizer

    from tinyserve.models.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(model))


def make_prompts(tokenizer, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts of the given token lengths, cut from ``PASSAGE`` at random offsets (wrapping)."""
    stream = tokenizer.encode(PASSAGE)
    rng = random.Random(seed)
    prompts = []
    for n in lengths:
        start = rng.randrange(len(stream))
        prompts.append([stream[(start + i) % len(stream)] for i in range(n)])
    return prompts


def mixed_workload(tokenizer, num_requests: int = 64, min_out: int = 8, max_out: int = 128,
                   min_prompt: int = 16, max_prompt: int = 256, seed: int = 0) -> Workload:
    """Output lengths drawn uniformly from ``[min_out, max_out]``; prompt lengths likewise."""
    rng = random.Random(seed)
    prompt_lens = [rng.randint(min_prompt, max_prompt) for _ in range(num_requests)]
    output_lens = [rng.randint(min_out, max_out) for _ in range(num_requests)]
    return Workload(f"mixed-{num_requests}x{min_out}..{max_out}", make_prompts(tokenizer, prompt_lens, seed),
                    output_lens)


def uniform_workload(tokenizer, num_requests: int = 32, output_len: int = 64, min_prompt: int = 16,
                     max_prompt: int = 256, seed: int = 0) -> Workload:
    """Every request generates ``output_len`` tokens (prompts still vary in length)."""
    rng = random.Random(seed)
    prompt_lens = [rng.randint(min_prompt, max_prompt) for _ in range(num_requests)]
    return Workload(f"uniform-{num_requests}x{output_len}", make_prompts(tokenizer, prompt_lens, seed),
                    [output_len] * num_requests)
