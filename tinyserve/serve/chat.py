"""Chat messages to prompt token ids: the model's chat template, applied so that nothing a client
writes can cost the server more than a bounded prompt, or become a control token.

- Bounded work. ``check_message_count`` refuses a body with more than ``max_messages`` messages
  before it is validated. Before rendering, the messages' characters plus the template's own
  characters per message (measured once per template) are checked against the prompt bound;
  after rendering, the rendered text is checked again, before it is tokenized.
- Template errors are the client's. A template that refuses the messages (Llama 2's and
  Mistral's ``raise_exception("Conversation roles must alternate ...")``, a field it needs and
  does not find, a tool call it cannot write) is a 400 carrying the template's own message and
  naming the first message it fails on. A template that does not compile is the server's fault,
  and stays a 500.
- What a message holds. Besides its content, a message may carry a ``name``, a ``tool_call_id``
  and ``tool_calls``: all go to the template, and every string in them is counted and guarded
  like the content.
- Options (vLLM's): ``add_generation_prompt``, ``continue_final_message`` and
  ``chat_template_kwargs`` go to the template, ``add_special_tokens`` to the tokenizer
  (``TemplateOptions``).
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
from dataclasses import dataclass, field
from functools import lru_cache

import jinja2

from tinyserve.serve.bodies import APIError, RequestLimits


def check_message_count(data: dict, max_messages: int) -> None:
    """Refuse more than ``max_messages`` messages, on the parsed JSON before it is validated."""
    messages = data.get("messages")
    if isinstance(messages, list) and len(messages) > max_messages:
        raise APIError(f"messages: {len(messages)} messages, more than this server accepts in one request "
                       f"({max_messages})", param="messages", code="too_many_messages")


@dataclass(frozen=True)
class TemplateOptions:
    """How messages are rendered and tokenized (vLLM's chat request fields of the same names)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs: more variables for the template
    add_special_tokens: bool = False  # the template writes the BOS token itself, as a rule

    def kwargs(self) -> dict:
        return {**self.template_kwargs, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}


def prompt_ids(tokenizer, messages: list[dict], limits: RequestLimits, special_tokens_in_content: bool,
               options: TemplateOptions | None = None) -> list[int]:
    """The token ids of ``messages`` rendered with the tokenizer's chat template, ready to generate.

    Slow in proportion to the messages: run it off the event loop and the engine's thread."""
    options = options or TemplateOptions()
    source = template_source(tokenizer)
    if "developer" not in source:
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    turns = sum(m["role"] in ("user", "assistant") for m in messages)
    chars = sum(len(text) for m in [*messages, options.template_kwargs] for text in _texts(m))
    limits.check_prompt_chars(chars + turns * message_overhead(tokenizer, source), "messages", at_least=True)
    specials = special_tokens(tokenizer)
    # chat_template_kwargs are the client's text too: guarded like the messages.
    client_texts = (t for m in [*messages, options.template_kwargs] for t in _texts(m))
    if special_tokens_in_content or not any(specials.pattern.search(t) for t in client_texts):
        text = render(tokenizer, messages, **options.kwargs())
        limits.check_prompt_chars(len(text), "messages")
        return tokenizer.encode(text, add_special_tokens=options.add_special_tokens)
    return _ids_with_content_as_text(tokenizer, messages, limits, specials, options)


def _texts(value, nested: bool = False):
    """Every string a message holds (its role and its own field names aside), keys of nested
    objects (a tool call's arguments) included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            if key != "role":
                if nested:
                    yield key
                yield from _texts(item, nested=True)
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item, nested=True)


def _map_texts(value, fn):
    """``value`` with ``fn`` applied to every string in it (a message's role aside)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k if k == "role" else fn(k): v if k == "role" else _map_texts(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_texts(item, fn) for item in value]
    return value


def template_source(tokenizer) -> str:
    """The chat template's text (all of them, for a tokenizer with several named templates)."""
    template = getattr(tokenizer, "chat_template", None)
    return " ".join(template.values()) if isinstance(template, dict) else str(template or "")


# Exceptions a template raises on messages it cannot render (a missing field is an
# UndefinedError, a string where it expects a dict a TypeError, continue_final_message whose last
# message the template rewrites a ValueError).
RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError)


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
    """The chat template applied to ``messages``; a template that refuses them is a 400 naming the
    first message it fails on (found by rendering ever longer beginnings of the conversation)."""
    try:
        return _apply(tokenizer, messages, add_generation_prompt, kwargs)
    except jinja2.TemplateSyntaxError:
        raise  # the template itself is broken: the server's fault, whatever the messages
    except RENDER_ERRORS as e:
        where = _first_failing(tokenizer, messages, add_generation_prompt, kwargs)
        param = "messages" if where is None else f"messages.{where}"
        raise APIError(f"{param}: the model's chat template cannot render {'them' if where is None else 'it'}: "
                       f"{type(e).__name__}: {e}", param=param) from None


def _apply(tokenizer, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)


def _first_failing(tokenizer, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> int | None:
    """The index of the message that makes the template fail: the shortest failing beginning,
    found by bisection (a dozen renders at most, and only on the way to a 400)."""
    kwargs = {**kwargs, "continue_final_message": False}  # a beginning never ends on the final message

    def fails(count: int) -> bool:
        try:
            _apply(tokenizer, messages[:count], add_generation_prompt, kwargs)
        except RENDER_ERRORS:
            return True
        return False

    if not messages:
        return None
    low, high = 1, len(messages)
    if not fails(high):  # only the options for the final message made it fail
        return high - 1
    while low < high:  # the shortest failing beginning is in [low, high]
        mid = (low + high) // 2
        if fails(mid):
            high = mid
        else:
            low = mid + 1
    return low - 1


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
                              specials: SpecialTokens, options: TemplateOptions) -> list[int]:
    """Token ids in which special-token text from the content is plain text (see the docstring)."""
    nonce = secrets.randbits(64)  # a client cannot write a marker it cannot guess
    pieces: dict[str, str] = {}

    def mark(found: re.Match) -> str:
        marker = f"\ue000{nonce}.{len(pieces)}\ue001"
        pieces[marker] = found[0]
        return marker

    marked = render(tokenizer, [_map_texts(m, lambda text: specials.pattern.sub(mark, text)) for m in messages],
                    **_map_texts(options.kwargs(), lambda text: specials.pattern.sub(mark, text)))
    marker = re.compile(re.escape(f"\ue000{nonce}.") + r"\d+\ue001")

    def restore(text: str) -> str:
        return marker.sub(lambda found: pieces[found[0]], text)

    limits.check_prompt_chars(len(restore(marked)), "messages")
    before, after = _added_special_tokens(tokenizer) if options.add_special_tokens else ([], [])
    ids: list[int] = list(before)
    start = 0
    for found in specials.pattern.finditer(marked):  # the template's own special tokens
        ids += _encode_as_text(tokenizer, restore(marked[start:found.start()]))
        ids.append(specials.ids[found[0]])
        start = found.end()
    return ids + _encode_as_text(tokenizer, restore(marked[start:])) + after


def _added_special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """The ids ``encode(add_special_tokens=True)`` puts before and after a text (a BOS, as a rule)."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return full[:i], full[i + len(plain):]
    return [], []


def _encode_as_text(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []
