"""``LLM.generate``'s progress bar reports throughput as vLLM's does, input and output tokens per
second so far, and no ETA (issue 24 §3)."""

from __future__ import annotations

import re

from tinyserve import LLM, SamplingParams


def test_the_progress_bar_shows_token_throughput_and_no_eta(tiny_model_dir, capsys):
    llm = LLM(str(tiny_model_dir), device="cpu", block_size=4, num_gpu_blocks=64, max_model_len=32)
    prompts = ["Hello, my name is", "The life is", "The future of AI is"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=True)
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    m = re.search(r"3/3 \[[\d:]+, input ([\d.]+) tok/s, output ([\d.]+) tok/s\]$", last)
    assert m, last
    assert "<" not in last and "it/s" not in last  # no remaining time, no requests per second
    # Both rates are counts over the same elapsed time: their ratio is the ratio of the counts.
    tokens_in = sum(len(o.prompt_token_ids) for o in outs)
    tokens_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens_out == 15
    rate_in, rate_out = float(m.group(1)), float(m.group(2))
    assert abs(rate_in / rate_out - tokens_in / tokens_out) < 0.05 * tokens_in / tokens_out
