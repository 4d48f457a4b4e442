"""A beam search recorded step by step, from the real engine (chapter 14's tree and stepper).

``record_beam_search(engine, prompt, params)`` runs one beam-search request alone on ``engine``
(an ``LLMEngine``, or an ``LLM``'s ``.engine``) and keeps, for every step, what the engine's
``beam_select`` was given and decided (each candidate child: its parent, its new token, its
cumulative log-probability, finished or not; which were kept, dropped, pushed out, whether the
search stopped) and, after the step, the block table of every running beam with the ref count
of each of its physical blocks. It watches by wrapping ``engine.beam_select`` for the run (the
decision is the engine's own; the wrapper only reads it) and reading the block manager after each
``engine.step()``. Nothing here draws: ``tinyserve.viz.beams`` does.

The memory measure is the benchmark's (``benchmarks/beam_memory.py``): the GPU blocks a group
holds with sharing (distinct physical blocks in its beams' tables) against without it (each
beam its own copy of every block of its table).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinyserve.beam_search import beam_score


@dataclass(frozen=True)
class Child:
    """A candidate of one step: the beam it continues (``parent``, a seq id), its seq id, the
    token it took, its cumulative log-probability after it, and whether it finished."""

    seq_id: int
    parent: int
    token: int
    text: str
    cumulative_logprob: float
    finished: bool


@dataclass(frozen=True)
class BeamBlocks:
    """A running beam after a step: its output tokens and its block table as
    ``(block number, ref count)`` pairs."""

    seq_id: int
    tokens: tuple[int, ...]
    text: str
    cumulative_logprob: float
    blocks: tuple[tuple[int, int], ...]


@dataclass
class BeamStep:
    """One engine step of the search (1-based ``step``): the candidates, the decision, the beams."""

    step: int
    children: list[Child]
    kept: list[int]  # seq ids kept: running beams that go on, and finished ones kept as results
    dropped: list[int]  # candidates freed this step (and parents with no candidate among the best 2W)
    pushed_out: list[int]  # finished beams of earlier steps pushed out of the best W
    stopped: bool
    beams: list[BeamBlocks]  # the running beams after the step, best first
    finished: list[Child]  # the finished beams kept so far, best first (by beam score)
    free_gpu_blocks: int

    @property
    def blocks_shared(self) -> int:
        """GPU blocks the beams hold with sharing: the distinct physical blocks of their tables."""
        return len({b for beam in self.beams for b, _ in beam.blocks})

    @property
    def blocks_unshared(self) -> int:
        """GPU blocks they would hold without sharing: each beam a copy of every block of its table."""
        return sum(len(beam.blocks) for beam in self.beams)


@dataclass
class BeamRun:
    """A recorded beam search: the prompt, its token ids, the width, the steps, the final output."""

    prompt: str
    prompt_token_ids: list[int]
    width: int
    block_size: int
    steps: list[BeamStep] = field(default_factory=list)
    outputs: list = field(default_factory=list)  # the RequestOutput's CompletionOutputs


def _text(tokenizer, token: int) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else str(token)


def record_beam_search(engine, prompt: str, params, request_id: str = "beams", max_steps: int = 200) -> BeamRun:
    """Run ``prompt`` with ``params`` (a beam search) alone on ``engine`` and record every step."""
    if not params.use_beam_search:
        raise ValueError("record_beam_search records a beam search: pass SamplingParams(use_beam_search=True, ...)")
    if engine.has_unfinished_requests():
        raise ValueError("record_beam_search runs its request alone: the engine has unfinished requests")
    tok = engine.tokenizer
    bm = engine.scheduler.block_manager
    decided: list[tuple] = []
    parents: dict[int, tuple[int, ...]] = {}  # running beam id -> its output tokens, before the step
    select = engine.beam_select

    def watching(children, finished, *args):
        selection = select(children, finished, *args)
        decided.append(([_child(c, parents, tok) for c in children], selection))
        return selection

    engine.beam_select = watching
    run = BeamRun(prompt, list(tok(prompt).input_ids) if tok is not None else [], params.num_samples, bm.block_size)
    try:
        engine.add_request(request_id, prompt, params)
        group = engine._groups[request_id]
        run.prompt_token_ids = list(group.prompt_token_ids)
        while engine.has_unfinished_requests() and len(run.steps) < max_steps:
            parents.clear()
            parents.update({s.seq_id: tuple(s.output_token_ids) for s in group.get_unfinished_seqs()})
            decided.clear()
            for out in engine.step():
                if out.finished:
                    run.outputs = list(out.outputs)
            if not decided:
                continue  # a step that sampled nothing for this request (none here: it runs alone)
            children, sel = decided[-1]
            ids = {c.seq_id for c in children}
            kept = [s.seq_id for s in sel.keep]
            running = sorted((s for s in group.get_unfinished_seqs()), key=lambda s: -s.cumulative_logprob)
            beams = [BeamBlocks(s.seq_id, tuple(s.output_token_ids), tok.decode(s.output_token_ids) if tok else "",
                                s.cumulative_logprob,
                                tuple((b.block_number, b.ref_count) for b in bm.block_tables.get(s.seq_id, [])))
                     for s in running]
            done = [s for s in group.get_seqs() if s.is_finished()]
            done_children = [Child(s.seq_id, -1, s.get_last_token_id(), tok.decode(s.output_token_ids) if tok else "",
                                   s.cumulative_logprob, True) for s in done]
            score = {s.seq_id: beam_score(s, params.length_penalty, engine.eos_token_id) for s in done}
            run.steps.append(BeamStep(len(run.steps) + 1, children, kept,
                                      [s.seq_id for s in sel.drop] + [p for p in parents if p not in ids],
                                      [s.seq_id for s in sel.drop_finished], sel.stop, beams,
                                      sorted(done_children, key=lambda c: -score[c.seq_id]),
                                      bm.get_num_free_gpu_blocks()))
    finally:
        engine.beam_select = select
    return run


def _child(seq, parents: dict[int, tuple[int, ...]], tok) -> Child:
    """A candidate, with the beam it continues: the parent whose tokens are its tokens but the last."""
    head = tuple(seq.output_token_ids[:-1])
    parent = seq.seq_id if seq.seq_id in parents else next((p for p, t in parents.items() if t == head), -1)
    return Child(seq.seq_id, parent, seq.get_last_token_id(), _text(tok, seq.get_last_token_id()),
                 seq.cumulative_logprob, seq.is_finished())


def stopping_decisions(best: tuple[float, int], worst: tuple[float, int], prompt_len: int, max_len: int,
                       length_penalties=(0.0, 1.0, 2.0)) -> list[dict]:
    """What each ``early_stopping`` mode decides (``beam_search.should_stop``) when the best
    running beam and the worst kept finished one are ``(cumulative logprob, output tokens)``
    (the finished one ended with EOS), for each length penalty: one row per penalty, with the
    two scores and the three decisions."""
    from tinyserve.beam_search import should_stop
    from tinyserve.sequence import Sequence, SequenceStatus

    eos = 0

    def seq(cumulative: float, out_len: int, finished: bool) -> Sequence:
        s = Sequence(0, None, [1] * prompt_len, 16)
        for i in range(out_len):
            s.append_token_id(eos if finished and i == out_len - 1 else 1)
        s.cumulative_logprob = cumulative
        s.status = SequenceStatus.FINISHED_STOPPED if finished else SequenceStatus.RUNNING
        return s

    running, done = seq(*best, False), seq(*worst, True)
    rows = []
    for lp in length_penalties:
        row = {"length_penalty": lp, "best running": beam_score(running, lp, eos),
               "best running at max_len": beam_score(running, lp, eos, seq_len=max_len),
               "worst finished": beam_score(done, lp, eos)}
        row.update({repr(mode): should_stop(mode, lp, running, done, eos, max_len) for mode in (True, False, "never")})
        rows.append(row)
    return rows
