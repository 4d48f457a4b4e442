"""Requests as the scheduler sees them: SamplingParams, Sequence and its logical blocks, SequenceGroup."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve.sampling_params import MAX_N, MIN_TEMPERATURE
from tinyserve.sequence import (
    LogicalTokenBlock,
    SamplingParams,
    Sequence,
    SequenceGroup,
    SequenceGroupMetadata,
    SequenceStatus,
)

# -- SamplingParams ---------------------------------------------------------------------------


def test_sampling_params_defaults_follow_the_design():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, -1, 16)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.seed) == ([], [], False, None)
    assert not p.greedy
    assert SamplingParams(temperature=0.0).greedy


def test_sampling_params_normalises_stop():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=[2, 0]).stop_token_ids == [2, 0]


def test_sampling_params_accepts_the_edges_of_each_range():
    SamplingParams(n=4, temperature=0.5, top_p=1e-6, top_k=1, max_tokens=1, seed=0)
    SamplingParams(top_p=1.0, top_k=-1, temperature=0)
    SamplingParams(n=MAX_N, temperature=MIN_TEMPERATURE, top_k=2**31 - 1, max_tokens=2**31 - 1,
                   stop_token_ids=[0, 2**31 - 1], ignore_eos=True)
    SamplingParams(seed=2**63 - 1)
    SamplingParams(n=3, seed=2**63 - 3)  # the third sample's generator takes seed + 2 = 2**63 - 1
    SamplingParams(temperature=1e30, stop=("a", "b"))


@pytest.mark.parametrize(("field", "value"), [
    ("n", 0), ("n", -1), ("n", 1.5), ("n", True), ("n", MAX_N + 1),
    ("temperature", -0.1), ("temperature", "hot"), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", 1e-38), ("temperature", MIN_TEMPERATURE / 2), ("temperature", True), ("temperature", 10**400),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -1), ("top_p", None), ("top_p", float("nan")),
    ("top_k", 0), ("top_k", -2), ("top_k", 2.5), ("top_k", True), ("top_k", 2**31), ("top_k", 2**63),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0), ("max_tokens", False), ("max_tokens", 2**31),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", 3]), ("stop", 123), ("stop", {"a": 1}),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]), ("stop_token_ids", 5),
    ("stop_token_ids", [2**31]),
    ("ignore_eos", 1), ("ignore_eos", "yes"), ("ignore_eos", None),
    ("seed", "42"), ("seed", 1.5), ("seed", True), ("seed", -1), ("seed", 2**63), ("seed", 2**64 - 1),
])
def test_invalid_sampling_params_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_seed_whose_children_would_overflow_is_refused():
    # Sample i draws from seed + i: the last must still be a valid 64-bit seed.
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(n=2, seed=2**63 - 1)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(n=2, seed=18446744073709551615)  # the value from the issue


def test_verify_catches_a_field_changed_after_construction():
    p = SamplingParams()
    p.temperature = 1e-38
    with pytest.raises(ValueError, match="temperature"):
        p.verify()


def test_several_greedy_samples_are_refused():
    with pytest.raises(ValueError, match="n > 1"):
        SamplingParams(n=2, temperature=0.0)


# -- SequenceStatus, LogicalTokenBlock ----------------------------------------------------------


def test_sequence_status_finished_and_reasons():
    unfinished = {SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.SWAPPED}
    reasons = {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
               SequenceStatus.FINISHED_ABORTED: "abort", SequenceStatus.FINISHED_IGNORED: "ignored"}
    assert unfinished | set(reasons) == set(SequenceStatus)
    for s in unfinished:
        assert not s.is_finished and s.finish_reason is None
    for s, reason in reasons.items():
        assert s.is_finished and s.finish_reason == reason


def test_logical_token_block_fills_up():
    b = LogicalTokenBlock(block_number=3, block_size=2)
    assert (b.block_number, b.num_tokens, b.is_full()) == (3, 0, False)
    b.token_ids.append(7)
    assert (b.num_tokens, b.is_full()) == (1, False)
    b.token_ids.append(8)
    assert (b.num_tokens, b.is_full()) == (2, True)
    assert "7, 8" in repr(b)


# -- Sequence -----------------------------------------------------------------------------------


def chunks(tokens: list[int], size: int) -> list[list[int]]:
    return [tokens[i:i + size] for i in range(0, len(tokens), size)]


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, 50_000), min_size=1, max_size=40),
       outputs=st.lists(st.integers(0, 50_000), max_size=40),
       block_size=st.integers(1, 9))
def test_logical_blocks_cut_the_tokens_in_order(prompt, outputs, block_size):
    seq = Sequence(0, "p", prompt, block_size)
    for t in outputs:
        seq.append_token_id(t)
    tokens = prompt + outputs
    assert seq.get_token_ids() == tokens
    assert seq.get_len() == len(tokens)
    assert (seq.get_prompt_len(), seq.get_output_len()) == (len(prompt), len(outputs))
    assert seq.output_token_ids == outputs
    assert [b.token_ids for b in seq.logical_token_blocks] == chunks(tokens, block_size)
    assert [b.block_number for b in seq.logical_token_blocks] == list(range(len(chunks(tokens, block_size))))
    assert seq.n_blocks == -(-len(tokens) // block_size)
    assert seq.get_last_token_id() == tokens[-1]


def test_sequence_keeps_a_copy_of_the_prompt_and_starts_waiting():
    prompt = [1, 2, 3]
    seq = Sequence(5, "abc", prompt, 4)
    prompt.append(99)
    assert seq.prompt_token_ids == [1, 2, 3]
    assert (seq.seq_id, seq.prompt, seq.status, seq.num_computed_tokens) == (5, "abc", SequenceStatus.WAITING, 0)
    assert not seq.is_finished()
    seq.status = SequenceStatus.FINISHED_STOPPED
    assert seq.is_finished()
    assert "seq_id=5" in repr(seq)


@pytest.mark.parametrize("block_size", [0, -1])
def test_sequence_rejects_a_bad_block_size(block_size):
    with pytest.raises(ValueError, match="block_size"):
        Sequence(0, None, [1], block_size)


def test_is_prefill_follows_computed_tokens():
    seq = Sequence(0, None, [1, 2, 3, 4], 2)
    assert seq.is_prefill()
    seq.num_computed_tokens = 2  # half of the prompt (a chunk)
    assert seq.is_prefill()
    seq.num_computed_tokens = 3  # a chunk one token short of the prompt's end: still a prefill
    assert seq.is_prefill()
    seq.num_computed_tokens = 4
    seq.append_token_id(9)  # the prefill sampled its first token; only that one lacks K/V
    assert not seq.is_prefill()
    seq.num_computed_tokens = 5
    seq.append_token_id(10)
    assert not seq.is_prefill()
    seq.reset_for_recompute()
    assert seq.is_prefill() and seq.num_computed_tokens == 0 and seq.status == SequenceStatus.WAITING
    assert seq.get_token_ids() == [1, 2, 3, 4, 9, 10]  # recompute keeps the tokens, drops the K/V


def test_fork_copies_everything_and_then_diverges():
    parent = Sequence(0, "p", [1, 2, 3], 2)
    parent.append_token_id(4)
    parent.status = SequenceStatus.RUNNING
    parent.num_computed_tokens = 3
    parent.output_text = "x"
    child = parent.fork(1)
    assert child.seq_id == 1
    assert child.get_token_ids() == parent.get_token_ids()
    assert child.output_token_ids == [4]
    assert (child.status, child.num_computed_tokens, child.output_text) == (SequenceStatus.RUNNING, 3, "x")
    child.append_token_id(5)
    parent.append_token_id(6)
    assert parent.get_token_ids() == [1, 2, 3, 4, 6]
    assert child.get_token_ids() == [1, 2, 3, 4, 5]
    assert [b.token_ids for b in child.logical_token_blocks] == [[1, 2], [3, 4], [5]]
    assert [b.token_ids for b in parent.logical_token_blocks] == [[1, 2], [3, 4], [6]]


# -- SequenceGroup ------------------------------------------------------------------------------


def test_sequence_group_lookup_and_status_filter():
    a, b = Sequence(0, "hi", [1, 2], 4), Sequence(1, "hi", [1, 2], 4)
    g = SequenceGroup("r", [a, b], SamplingParams(n=2), arrival_time=3.0)
    assert (g.request_id, g.arrival_time, g.prompt, g.prompt_token_ids, g.error) == ("r", 3.0, "hi", [1, 2], None)
    assert g.get_seqs() == [a, b]
    b.status = SequenceStatus.RUNNING
    assert g.get_seqs(SequenceStatus.RUNNING) == [b]
    assert g.get_seqs(SequenceStatus.WAITING) == [a]
    assert g.get_seqs(SequenceStatus.SWAPPED) == []
    assert g.num_seqs() == 2 and g.num_seqs(SequenceStatus.RUNNING) == 1
    assert g.find(1) is b
    with pytest.raises(KeyError):
        g.find(7)
    assert "'r'" in repr(g)


def test_sequence_group_needs_a_sequence():
    with pytest.raises(ValueError):
        SequenceGroup("r", [], SamplingParams(), 0.0)


def test_sequence_group_add_and_refuse_duplicates():
    a = Sequence(0, None, [1], 4)
    g = SequenceGroup("r", [a], SamplingParams(n=2), 0.0)
    child = a.fork(1)
    g.add(child)
    assert g.get_seqs() == [a, child]
    with pytest.raises(ValueError, match="already"):
        g.add(a.fork(1))


def test_running_seqs_count_n_before_the_prompt_is_sampled():
    a = Sequence(0, None, [1, 2, 3], 4)
    g = SequenceGroup("r", [a], SamplingParams(n=3), 0.0)
    assert g.is_waiting_for_prefill()
    assert g.get_max_num_running_seqs() == 3  # the prompt will be sampled n times
    a.append_token_id(4)
    g.add(a.fork(1))
    assert not g.is_waiting_for_prefill()
    assert g.get_max_num_running_seqs() == 2  # only the live sequences now
    a.status = SequenceStatus.FINISHED_STOPPED
    assert g.get_unfinished_seqs() == [g.find(1)]
    assert g.get_max_num_running_seqs() == 1
    assert not g.is_finished()
    g.find(1).status = SequenceStatus.FINISHED_LENGTH_CAPPED
    assert g.is_finished()
    assert g.get_max_num_running_seqs() == 0


def test_sequence_group_metadata_defaults():
    seq = Sequence(0, None, [1, 2], 4)
    md = SequenceGroupMetadata("r", True, {0: seq}, SamplingParams(), {0: [3]})
    assert (md.token_chunk_size, md.do_sample, md.computed_block_nums) == (1, True, [])
    other = SequenceGroupMetadata("s", False, {}, SamplingParams(), {})
    md.computed_block_nums.append(1)
    assert other.computed_block_nums == []  # no shared mutable default
