"""How each choice of an answer is written: its text (after the echoed prompt, when asked) and its
log-probabilities in OpenAI's formats.

The engine reports a token's log-probabilities as a ``{token_id: logprob}`` dict (the top k and
the chosen token). OpenAI writes them differently for the two endpoints:

- completions (``logprobs: k``): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
  four lists with one entry per token; ``top_logprobs`` maps token text to logprob (and is null
  for k = 0), and with ``echo`` the prompt's tokens come first, the first of them with null
  entries (no position predicts it);
- chat (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [...]}]}``, the k likeliest alternatives as a list.

vLLM's ``prompt_logprobs: k`` (completions) adds a ``prompt_logprobs`` list to each choice: null for
the first prompt token, then ``{token_id: {"logprob", "rank", "decoded_token"}}`` per token, the
rank counted among the entries the engine returned (null for a chosen token outside the top k).

A chat answer under a ``tool_choice`` (``structured.py``) carries its text as tool calls: the whole
text as the named function's arguments, or the calls of a ``"required"`` answer's JSON list
(``finish_reason`` "tool_calls"); streamed, a named call's arguments come as ``tool_calls`` deltas.

Token texts come from ``token_texts``, every token decoded once: building an answer must not
use the server's tokenizer, which serves one thread only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tinyserve.outputs import CompletionOutput, RequestOutput
from tinyserve.serve.structured import ToolPlan, new_call_id

# JSON has no -Infinity: a log-probability below this (or not finite) is written as this.
LOGPROB_FLOOR = -9999.0


def token_texts(tokenizer) -> list[str]:
    """The text of every token id alone (slow: run it on the tokenizer's own thread, once)."""
    size = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
    return tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=False)


def _finite(value: float) -> float:
    return value if math.isfinite(value) and value > LOGPROB_FLOOR else LOGPROB_FLOOR


@dataclass
class ChoiceFormat:
    """What one request's choices carry besides their text: logprobs (``top`` is k, None for
    none) and, for completions, the echoed prompt (``echo``; ``echo_only`` for max_tokens=0)."""

    chat: bool
    top: int | None = None
    texts: list[str] | None = None  # token_texts(tokenizer), needed when top is not None
    echo: str | None = None
    echo_only: bool = False
    prompt_top: int | None = None  # vLLM's prompt_logprobs (completions only)
    tools: ToolPlan | None = None  # chat under a tool_choice: the text is tool calls
    _call_ids: dict[int, str] = field(default_factory=dict)  # per streamed choice, its call's id

    def text_and_entries(self, out: RequestOutput, c: CompletionOutput,
                         with_echo: bool) -> tuple[str, list[int], list | None]:
        """A choice's text, token ids and logprob dicts, with the prompt before them if echoed."""
        text, ids, entries = c.text, list(c.token_ids), list(c.logprobs or [])
        if self.echo_only:
            text, ids, entries = "", [], []
        if with_echo:
            text, ids = self.echo + text, list(out.prompt_token_ids) + ids
            entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + entries
        return text, ids, entries

    def logprobs(self, ids: list[int], entries: list, text_offset: int = 0) -> dict | None:
        """The ``logprobs`` of a choice (or of one streamed piece of it) in the endpoint's format."""
        if self.top is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(t, e) for t, e in zip(ids, entries)]}
        tokens, values, tops, offsets = [], [], [], []
        for t, entry in zip(ids, entries):
            tokens.append(self.texts[t])
            offsets.append(text_offset)
            text_offset += len(self.texts[t])
            values.append(None if entry is None else _finite(entry[t]))
            tops.append(None if entry is None else {self.texts[i]: _finite(v) for i, v in entry.items()})
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops if self.top else None,
                "text_offset": offsets}

    def _chat_entry(self, token: int, entry: dict[int, float]) -> dict:
        best = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:self.top]
        return {**self._token(token, entry[token]), "top_logprobs": [self._token(i, v) for i, v in best]}

    def _token(self, token: int, logprob: float) -> dict:
        text = self.texts[token]
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    def choice(self, out: RequestOutput, c: CompletionOutput) -> dict:
        """A whole choice of a non-streamed answer."""
        text, ids, entries = self.text_and_entries(out, c, with_echo=self.echo is not None)
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        finish_reason = c.finish_reason
        calls = None if self.tools is None else self.tools.calls(text)
        if calls is not None:
            body["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
            if self.tools.name is None:
                finish_reason = "tool_calls"  # vLLM's, for "required"; a named call ends as OpenAI's do
        choice = {"index": c.index, **body, "logprobs": self.logprobs(ids, entries), "finish_reason": finish_reason}
        if self.prompt_top is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs(out)
        return choice

    def piece(self, index: int, text: str) -> dict:
        """A streamed choice's new text, in the endpoint's shape (a named tool call's arguments
        in ``tool_calls`` deltas, the first of which carries the call's id and name)."""
        if not self.chat:
            return {"text": text}
        if self.tools is None:
            return {"delta": {"content": text}}
        call = {"index": 0, "function": {"arguments": text}}
        if index not in self._call_ids:
            self._call_ids[index] = new_call_id()
            call = {"index": 0, "id": self._call_ids[index], "type": "function",
                    "function": {"name": self.tools.name, "arguments": text}}
        return {"delta": {"tool_calls": [call]}}

    def prompt_logprobs(self, out: RequestOutput) -> list | None:
        """vLLM's ``prompt_logprobs`` of a request (see the module's docstring)."""
        if out.prompt_logprobs is None:
            return None
        written = []
        for token, entry in zip(out.prompt_token_ids, out.prompt_logprobs):
            if entry is None:
                written.append(None)
                continue
            ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:self.prompt_top]
            ranks = {t: r for r, (t, _) in enumerate(ranked, 1)}
            written.append({str(t): {"logprob": _finite(v), "rank": ranks.get(t), "decoded_token": self.texts[t]}
                            for t, v in entry.items() if t in ranks or t == token})
        return written

    def completion_tokens(self, out: RequestOutput) -> int:
        """The tokens an answer returns (with max_tokens=0 and echo, the one generated is dropped)."""
        return 0 if self.echo_only else sum(len(c.token_ids) for c in out.outputs)
