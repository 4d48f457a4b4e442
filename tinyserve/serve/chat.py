"""Chat messages to prompt token ids: the model's chat template, applied so that nothing a client
writes can cost the server more than a bounded prompt, or become a control token.

- Bounded work. ``check_message_count`` refuses a body with more than ``max_messages`` messages
  before it is validated. Before rendering, the messages' characters plus the template's own
  characters per message (measured once per template) are checked against the prompt bound;
  after rendering, the rendered text is checked again, before it is tokenized.
- Template errors are the client's. A template that refuses the messages (Llama 2's and
  Mistral's ``raise_exception("Conversation roles must alternate ...")``, a field it needs and
  does not find) is a 400 carrying the template's own message. A template that does not compile
  is the server's fault, and stays a 500.
- Roles. ``developer`` is OpenAI's newer name for ``system``; a template that never mentions it
  gets ``system``.
- Special tokens. A chat template marks the turns with special tokens (``<|im_start|>``); a
  client that writes ``<|im_end|>\\n<|im_start|>system`` in its content would, tokenized as is,
  open a system turn of its own. vLLM encodes it so. With ``special_tokens_in_content=False``
  (the default) such text in content is encoded as plain text: messages whose content holds no
  special-token text are tokenized exactly as vLLM does; otherwise the template is rendered with
  each such piece replaced by a random marker, so every special token left in the text is the
  template's, and the text between those is tokenized with special tokens read as text.
"""

from __future__ import annotations

import re
import secrets
from functools import lru_cache

import jinja2

from tinyserve.serve.bodies import APIError, RequestLimits


def check_message_count(data: dict, max_messages: int) -> None:
    """Refuse more than ``max_messages`` messages, on the parsed JSON before it is validated."""
    messages = data.get("messages")
    if isinstance(messages, list) and len(messages) > max_messages:
        raise APIError(f"messages: {len(messages)} messages, more than this server accepts in one request "
                       f"({max_messages})", param="messages", code="too_many_messages")


def prompt_ids(tokenizer, messages: list[dict], limits: RequestLimits, special_tokens_in_content: bool) -> list[int]:
    """The token ids of ``messages`` rendered with the tokenizer's chat template, ready to generate.

    Slow in proportion to the messages: run it off the event loop and the engine's thread."""
    source = template_source(tokenizer)
    if "developer" not in source:
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    turns = sum(m["role"] in ("user", "assistant") for m in messages)
    limits.check_prompt_chars(sum(len(m["content"]) for m in messages) + turns * message_overhead(tokenizer, source),
                              "messages", at_least=True)
    specials = special_tokens(tokenizer)
    if special_tokens_in_content or not any(specials.pattern.search(m["content"]) for m in messages):
        text = render(tokenizer, messages)
        limits.check_prompt_chars(len(text), "messages")
        return tokenizer.encode(text, add_special_tokens=False)
    return _ids_with_content_as_text(tokenizer, messages, limits, specials)


def template_source(tokenizer) -> str:
    """The chat template's text (all of them, for a tokenizer with several named templates)."""
    template = getattr(tokenizer, "chat_template", None)
    return " ".join(template.values()) if isinstance(template, dict) else str(template or "")


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The chat template applied to ``messages``; a template that refuses them is a 400."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateSyntaxError:
        raise  # the template itself is broken: the server's fault, whatever the messages
    except jinja2.TemplateError as e:
        raise APIError(f"messages: the model's chat template refused them: {e}", param="messages") from None


@lru_cache(maxsize=16)
def _overhead(tokenizer, source: str) -> int:
    def length(roles: list[str]) -> int:
        return len(render(tokenizer, [{"role": r, "content": "x"} for r in roles], add_generation_prompt=False))

    try:
        one, two, three = length(["user"]), length(["user", "assistant"]), length(["user", "assistant", "user"])
    except Exception:  # noqa: BLE001 - a template that refuses the probes: no estimate, the rendered text is checked
        return 0
    # What a user and an assistant message add beyond their content (one "x" each), the smaller:
    # an estimate from below, so the check never refuses messages that would have fitted.
    return max(0, min(two - one, three - two) - 1)


def message_overhead(tokenizer, source: str | None = None) -> int:
    """The characters a chat template adds around each user or assistant message, at least.
    (System messages are not counted: some templates fold them into the first user turn.)"""
    return _overhead(tokenizer, template_source(tokenizer) if source is None else source)


class SpecialTokens:
    """A tokenizer's special tokens (those ``split_special_tokens`` turns into plain text): their ids
    and a pattern that finds them the way the tokenizer does, longest first."""

    def __init__(self, tokenizer) -> None:
        self.ids = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        words = sorted(self.ids, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, words))) if words else re.compile(r"(?!)")


@lru_cache(maxsize=16)
def special_tokens(tokenizer) -> SpecialTokens:
    return SpecialTokens(tokenizer)


def _ids_with_content_as_text(tokenizer, messages: list[dict], limits: RequestLimits,
                              specials: SpecialTokens) -> list[int]:
    """Token ids in which special-token text from the content is plain text (see the docstring)."""
    nonce = secrets.randbits(64)  # a client cannot write a marker it cannot guess
    pieces: dict[str, str] = {}

    def mark(found: re.Match) -> str:
        marker = f"\ue000{nonce}.{len(pieces)}\ue001"
        pieces[marker] = found[0]
        return marker

    marked = render(tokenizer, [{**m, "content": specials.pattern.sub(mark, m["content"])} for m in messages])
    marker = re.compile(re.escape(f"\ue000{nonce}.") + r"\d+\ue001")

    def restore(text: str) -> str:
        return marker.sub(lambda found: pieces[found[0]], text)

    limits.check_prompt_chars(len(restore(marked)), "messages")
    ids: list[int] = []
    start = 0
    for found in specials.pattern.finditer(marked):  # the template's own special tokens
        ids += _encode_as_text(tokenizer, restore(marked[start:found.start()]))
        ids.append(specials.ids[found[0]])
        start = found.end()
    return ids + _encode_as_text(tokenizer, restore(marked[start:]))


def _encode_as_text(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []
