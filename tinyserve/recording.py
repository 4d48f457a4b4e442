"""Recording the engine's rounds for the book: an observer of ``LLMEngine.step``.

The engine tells its callbacks what each step did (``engine.StepEvent``). ``HistoryRecorder``
is such a callback: it snapshots every round as the same ``sim.RoundRecord`` the simulator
produces, so the drawings and widgets show simulated and real rounds alike, and keeps where
each step's time went. The engine core knows nothing of records; a server runs without one,
and its memory stays flat however long it runs.

    engine = LLMEngine(..., record_history=True)   # engine.history is recorder.records
    recorder = HistoryRecorder(); engine.add_callback(recorder)   # or attach one for a while
"""

from __future__ import annotations

from tinyserve.sim import RoundRecord, make_record, seq_key


class HistoryRecorder:
    """Keeps a RoundRecord and the (schedule, model, sample, process) seconds of every step.

    Rounds are numbered from 1 from the first step the recorder sees.
    """

    def __init__(self) -> None:
        self.records: list[RoundRecord] = []
        self.step_times: list[tuple[float, float, float, float]] = []

    def __call__(self, engine, event) -> None:
        # Each produced token as text, under the request id (suffixed ".i" for sample i of n).
        tokens = {seq_key(group, seq): engine.tokenizer.decode([token]) for group, seq, token in event.produced}
        self.records.append(make_record(len(self.records) + 1, engine.scheduler, event.scheduler_outputs,
                                        event.finished, tokens))
        self.step_times.append(event.times)
