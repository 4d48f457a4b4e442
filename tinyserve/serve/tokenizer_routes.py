"""The server's tokenizer, model card and version, as vLLM serves them: ``POST /tokenize``,
``POST /detokenize``, ``GET /tokenizer_info``, ``GET /version`` and ``GET /v1/models/{id}``.

A client that counts tokens, or an evaluation harness that needs no tokenizer of its own
(lm-eval's ``tokenizer_backend="remote"``), asks the server: the answer is then the server's own
tokenization, exactly what a completion or a chat would be fed. So a prompt is encoded as
``/v1/completions`` encodes it, and chat messages go through the same rendering as
``/v1/chat/completions`` (``chat.prompt_ids``: bounded, and special-token text in content kept
as text unless the server says otherwise). The work runs on the server's tokenizer thread
(``run``, the app's ``off_the_engine``), never on the event loop, and the answer is serialized
there too: a long prompt's token list is a large answer.

The request bodies are vLLM's (``TokenizeCompletionRequest``, ``TokenizeChatRequest``,
``DetokenizeRequest``), with the server's strict types: unknown fields are refused, a token id
outside the vocabulary is a 400 naming it. ``/tokenizer_info`` is the tokenizer's configuration
(``tokenizer_config.json``'s fields, as vLLM returns them, without file paths), which is what
lm-eval reads its special tokens and chat template from.

Under ``--api-key`` these routes need the key, as every route does but ``/health`` and
``/metrics`` (``guard.OPEN_PATHS``). vLLM differs here: its ``AuthenticationMiddleware``
(``vllm/entrypoints/serve/utils/server_utils.py``) guards only paths starting with ``/v1``, ``/v2``,
``/inference`` or ``/cohere``, so its ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` and
``/version`` are open. They stay guarded here because ``/tokenize`` renders chat templates and
tokenizes bodies up to the size limit (work anyone could make the server do) and
``/tokenizer_info`` hands out the chat template; no client loses by it, since those that call
them send the key they send to ``/v1`` (lm-eval's ``RemoteTokenizer`` does).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from tinyserve.serve.bodies import APIError, RequestLimits, parse_body
from tinyserve.serve.chat import TemplateOptions, check_message_count, prompt_ids
from tinyserve.serve.protocol import ChatMessage, chat_messages, drop_unknown_fields
from tinyserve.serve.settings import ServerSettings

try:
    VERSION = importlib.metadata.version("tinyserve")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    VERSION = "0+unknown"

log = logging.getLogger("tinyserve.serve")

# init_kwargs entries that are paths on the server's disk: the operator's business, not the client's.
PRIVATE_KEYS = {"name_or_path", "is_local", "local_files_only", "cache_dir"}
# As protocol.py's bodies: unknown fields refused, strict types (true is not 1, "4" is not 4).
STRICT = ConfigDict(extra="forbid", strict=True)


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a prompt: its ids as ``/v1/completions`` would feed them."""

    model_config = STRICT

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's BOS (or whatever it adds around a text)
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` with messages: their ids as ``/v1/chat/completions`` would feed them."""

    model_config = STRICT

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of the template's own (which most templates write)
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's fields that tinyserve refuses by name rather than as unknown.
    chat_template: Any = None
    tools: Any = None


class TokenizeRequest:
    """Either body, told apart as vLLM does: one with ``messages`` is a chat."""

    @staticmethod
    def which(data: dict) -> type[TokenizeCompletionRequest | TokenizeChatRequest]:
        return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest

    @classmethod
    def model_validate(cls, data: dict) -> TokenizeCompletionRequest | TokenizeChatRequest:
        return cls.which(data).model_validate(data)


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text, decoded as the tokenizer decodes them."""

    model_config = STRICT

    model: str | None = None
    tokens: list[int]


def model_card(name: str, max_model_len: int) -> dict:
    """The served model as ``/v1/models`` lists it."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "tinyserve", "max_model_len": max_model_len}


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """The tokenizer's configuration, JSON-ready: ``init_kwargs`` (what ``tokenizer_config.json``
    held) without paths, then the special tokens, chat template and class read from the tokenizer
    itself (which wins: a special token can be set after loading)."""
    info = {k: _jsonable(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
            if k not in PRIVATE_KEYS and not k.endswith("_file")}
    for role in ("bos", "eos", "pad", "unk"):
        info[f"{role}_token"] = _jsonable(getattr(tokenizer, f"{role}_token", None))
        info[f"{role}_token_id"] = getattr(tokenizer, f"{role}_token_id", None)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one is the chat's
        template = template.get("default")
    info["chat_template"] = template
    info["model_max_length"] = _jsonable(getattr(tokenizer, "model_max_length", None))
    info["tokenizer_class"] = type(tokenizer).__name__
    info["max_model_len"] = max_model_len
    return info


def _jsonable(value):
    if hasattr(value, "content"):  # an AddedToken: its text
        return value.content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no inf
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def add_tokenizer_routes(app: FastAPI, name: str, tokenizer, max_model_len: int, vocab_size: int,
                         limits: RequestLimits, settings: ServerSettings,
                         run: Callable[..., Awaitable], ignore_unknown_fields: bool = False) -> None:
    """Add the endpoints to ``app``, serving ``tokenizer`` (the server's own, used only through
    ``run``, which calls a function on the server's tokenizer thread) for the model ``name``.
    ``ignore_unknown_fields``: log and drop fields the bodies do not know, as the other endpoints."""
    info = tokenizer_info(tokenizer, max_model_len)

    def before_validation(model) -> Callable[[dict], None]:
        """The checks on a parsed body before it is validated as ``model``."""
        def before(data: dict) -> None:
            check_message_count(data, settings.max_messages)
            if ignore_unknown_fields:
                dropped = drop_unknown_fields(data, model.which(data) if model is TokenizeRequest else model)
                if dropped:
                    log.warning("ignoring unknown fields in a request: %s", ", ".join(dropped))
        return before

    def check_model(model: str | None) -> None:
        if model not in (None, name):
            raise APIError(f"The model `{model}` does not exist; this server serves `{name}`.",
                           param="model", status=404, code="model_not_found")

    def answer(payload: dict) -> bytes:
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()

    def tokenize_chat(body: TokenizeChatRequest) -> list[int]:
        if body.chat_template is not None:
            raise APIError("chat_template: this server renders chats with the model's own template only",
                           param="chat_template")
        if body.tools is not None:
            raise APIError("tools are not rendered by /tokenize", param="tools")
        if body.add_generation_prompt and body.continue_final_message:
            raise APIError("continue_final_message needs add_generation_prompt: false (the final message is "
                           "continued, not answered)", param="continue_final_message")
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(f"the model `{name}` has no chat template; tokenize a prompt instead", param="messages")
        options = TemplateOptions(body.add_generation_prompt, body.continue_final_message,
                                  dict(body.chat_template_kwargs or {}), body.add_special_tokens)
        return prompt_ids(tokenizer, chat_messages(body.messages), limits, settings.special_tokens_in_content,
                          options)

    def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> bytes:
        if isinstance(body, TokenizeChatRequest):
            ids = tokenize_chat(body)
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return answer({"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs})

    def detokenize(tokens: list[int]) -> bytes:
        bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab_size), None)
        if bad is not None:  # outside the model's vocabulary: the tokenizer would skip it, silently
            raise APIError(f"tokens.{bad}: {tokens[bad]} is not a token id (ids are in [0, {vocab_size}))",
                           param="tokens")
        return answer({"prompt": tokenizer.decode(tokens)})

    @app.post("/tokenize")
    async def tokenize_endpoint(request: Request) -> Response:
        body = await parse_body(request, TokenizeRequest, limits.max_body_bytes,
                                before=before_validation(TokenizeRequest))
        check_model(body.model)
        return Response(await run(tokenize, body), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize_endpoint(request: Request) -> Response:
        body = await parse_body(request, DetokenizeRequest, limits.max_body_bytes,
                                before=before_validation(DetokenizeRequest))
        check_model(body.model)
        return Response(await run(detokenize, body.tokens), media_type="application/json")

    @app.get("/tokenizer_info")
    async def tokenizer_info_endpoint() -> dict:
        return info

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id)
        return model_card(name, max_model_len)
