"""The FastAPI app: OpenAI's endpoints over one engine loop.

A handler reads the body (refusing one that is too large before reading it all), checks the
request (400 for anything wrong, before the engine sees it), tokenizes the prompt (or renders
the chat template) with the server's own tokenizer on a thread of its own, so a long prompt
never holds up the engine, adds the request to the loop and waits for its first output.
Errors before the first token are HTTP errors; after it, a streamed answer is sent as
server-sent events. While it waits, a handler watches its connection: a client that goes away
has its request aborted. Every error, unknown paths included, has OpenAI's JSON error body.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from tinyserve.engine import LLMEngine, RequestOutput
from tinyserve.guided_params import GuidedDecodingParams
from tinyserve.sequence import SamplingParams
from tinyserve.serve.bodies import APIError, RequestLimits, invalid_fields, parse_body
from tinyserve.serve.chat import TemplateOptions, check_message_count, prompt_ids
from tinyserve.serve.choices import ChoiceFormat, token_texts
from tinyserve.serve.connections import uvicorn_options
from tinyserve.serve.guard import Guard
from tinyserve.serve.jsonbody import json_answer
from tinyserve.serve.latency import RequestLatencies
from tinyserve.serve.loop import EngineLoop
from tinyserve.serve.mailbox import Mailbox
from tinyserve.serve.metrics import EngineStats, make_registry
from tinyserve.serve.prompt_list import Prompt, respond_to_list
from tinyserve.serve.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    chat_messages,
    check_ranges,
    drop_unknown_fields,
    field_named,
    output_error,
    reject_unsupported,
    to_sampling_params,
    usage,
)
from tinyserve.serve.settings import ServerSettings
from tinyserve.serve.streaming import StallGuardedStream, stream_events
from tinyserve.serve.structured import ToolPlan, guided_decoding, template_tools
from tinyserve.serve.tokenizer_routes import add_tokenizer_routes

log = logging.getLogger("tinyserve.serve")


def create_app(engine: LLMEngine, model_name: str | None = None, max_body_bytes: int | None = None,
               settings: ServerSettings | None = None, ignore_unknown_fields: bool = False) -> FastAPI:
    """The FastAPI app serving ``engine``; its lifespan starts and stops the engine loop.

    ``max_body_bytes`` defaults to what the longest prompt that could fit needs (``RequestLimits``);
    ``settings`` are the server's limits and protections (``ServerSettings()`` by default);
    ``ignore_unknown_fields`` logs and ignores fields the request schema does not know (vLLM's
    way) instead of refusing them by name."""
    settings = settings or ServerSettings()
    name = model_name or Path(str(engine.model_config.model)).name
    max_model_len = engine.scheduler_config.max_model_len
    vocab_size = engine.executor.loaded.hf_config.vocab_size
    # The server's own tokenizer, used on one thread of its own: the engine thread decodes with
    # the engine's, and a fast tokenizer shared across threads can fail ("Already borrowed").
    tokenizer = copy.deepcopy(engine.tokenizer)
    limits = RequestLimits.for_tokenizer(tokenizer, max_model_len, max_body_bytes)
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["tokenize"] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyserve-tokenize")
        state["loop"] = EngineLoop(engine, latencies)
        state["loop"].start()
        yield
        await state.pop("loop").stop()
        state.pop("tokenize").shutdown(wait=True)

    # The docs pages load their scripts from a CDN: served only when asked for.
    docs = settings.enable_docs
    app = FastAPI(title="tinyserve", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.add_middleware(Guard, settings=settings)  # Host, API key, content type, body deadline
    app.state.engine, app.state.tokenizer, app.state.limits = engine, tokenizer, limits
    app.state.settings = settings
    registry = make_registry(lambda: state["loop"].stats if "loop" in state else EngineStats())
    latencies = RequestLatencies(registry)  # time to first token, per output token, end to end

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Unknown paths (404) and wrong methods (405) answer in OpenAI's format too.
        message = {404: f"Unknown path {request.url.path}.",
                   405: f"Method {request.method} is not allowed for {request.url.path}."}.get(exc.status_code,
                                                                                           str(exc.detail))
        return APIError(message, status=exc.status_code, code={404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code)).response(headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return invalid_fields(exc.errors()).response()

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's mistake. Starlette answers with this from its outermost
        # middleware and then re-raises, so that the server logs the one traceback (uvicorn's
        # "Exception in ASGI application") and closes the connection: "Connection: close" says
        # so, or the client would find the connection reset under its next request.
        log.error("unexpected %s in %s %s (the server logs its traceback)", type(exc).__name__, request.method,
                  request.url.path)
        return APIError(f"internal server error: {type(exc).__name__}", status=500, type_="server_error",
                        headers={"Connection": "close"}).response()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    # HEAD too, as load balancers ask (uvicorn sends no body). Kept out of the schema, where it
    # would repeat GET's operation id.
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "tinyserve",
                                            "max_model_len": max_model_len}]}

    def known_fields(data: dict, model) -> None:
        """With ``ignore_unknown_fields``, drop the fields the schema does not know, with a warning."""
        if ignore_unknown_fields:
            dropped = drop_unknown_fields(data, model)
            if dropped:
                log.warning("ignoring unknown fields in a request: %s", ", ".join(dropped))

    def check_request(body: SamplingFields) -> None:
        if body.model not in (None, name):
            raise APIError(f"The model `{body.model}` does not exist; this server serves `{name}`.",
                           param="model", status=404, code="model_not_found")
        reject_unsupported(body)
        check_ranges(body, vocab_size, engine.scheduler_config.max_num_seqs)

    def check_length(num_prompt: int, max_tokens: int | None, prompt_param: str) -> int:
        limit = engine.scheduler_config.prompt_limit
        if num_prompt > limit or num_prompt >= max_model_len:
            raise APIError(f"The prompt has {num_prompt} tokens, more than this server accepts ({limit} tokens; "
                           f"the model's maximum context length is {max_model_len}). Shorten the prompt.",
                           param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            return max_model_len - num_prompt
        if num_prompt + max_tokens > max_model_len:
            raise APIError(f"This model's maximum context length is {max_model_len} tokens, but "
                           f"{num_prompt + max_tokens} were requested ({num_prompt} in the prompt, {max_tokens} "
                           "for the completion). "
                           "Shorten the prompt or lower max_tokens.", param="max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    def validate_ids(ids: list[int]) -> list[int]:
        if not ids:
            raise APIError("the prompt is empty", param="prompt")
        if any(not 0 <= t < vocab_size for t in ids):
            raise APIError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        return ids

    async def off_the_engine(fn, *args):
        """Tokenizing takes time in proportion to the text: never on the engine's thread."""
        return await asyncio.get_running_loop().run_in_executor(state["tokenize"], fn, *args)

    async def choice_format(body: SamplingFields, chat: bool, prompt: str | None, ids: list[int]) -> ChoiceFormat:
        """How the answer's choices are written: logprobs need every token's text (decoded once,
        on the tokenizer's thread, the first time a request asks), echo the prompt's."""
        if chat:
            top = (body.top_logprobs or 0) if body.logprobs else None
        else:
            top = body.logprobs
        prompt_top = None if chat else body.prompt_logprobs  # a chat's are the answer's, not a choice's
        if (top is not None or body.prompt_logprobs is not None) and "texts" not in state:
            state["texts"] = await off_the_engine(token_texts, tokenizer)
        echo = None
        if not chat and body.echo:
            echo = prompt if prompt is not None else await off_the_engine(tokenizer.decode, ids)
        return ChoiceFormat(chat, top, state.get("texts"), echo, echo_only=echo is not None and body.max_tokens == 0,
                            prompt_top=prompt_top)

    async def grammar(body: SamplingFields, chat: bool) -> tuple[GuidedDecodingParams | None, ToolPlan | None]:
        """The grammar a request asks for, compiled (on the tokenizer's thread: a schema can take
        milliseconds) so that one that cannot be is a 400 naming the field that asked for it."""
        guided, plan, param = guided_decoding(body, chat)
        if guided is not None:
            await off_the_engine(engine.constraints.grammars.warm)  # once: seconds on a large vocabulary
            try:
                await off_the_engine(engine.constraints.grammars.compile, guided)
            except ValueError as e:
                raise APIError(f"{param} cannot be compiled into a grammar: {e}", param=param) from None
        return guided, plan

    def truncated(ids: list[int], body: SamplingFields) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: keep the prompt's last k tokens."""
        k = body.truncate_prompt_tokens
        return ids if k is None or len(ids) <= k else ids[-k:]

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest, limits.max_body_bytes,
                                before=lambda data: known_fields(data, CompletionRequest))
        check_request(body)
        # One prompt (text or ids), or a list of them: each is checked as a request of its own.
        prompts = body.prompt
        is_list = isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], (str, list))
        prompts = prompts if is_list else [prompts]
        if len(prompts) > MAX_PROMPTS:
            raise APIError(f"{len(prompts)} prompts in one request, more than this server accepts ({MAX_PROMPTS})",
                           param="prompt")
        where = [f"prompt.{i}" if is_list else "prompt" for i in range(len(prompts))]
        for prompt, param in zip(prompts, where):
            if isinstance(prompt, str):
                limits.check_prompt_chars(len(prompt), param)
        guided, _ = await grammar(body, chat=False)
        special = body.add_special_tokens is not False  # vLLM's default for completions: True
        all_ids = await off_the_engine(lambda: [tokenizer.encode(p, add_special_tokens=special) if isinstance(p, str)
                                                else list(p) for p in prompts])
        ready = []
        for prompt, ids, param in zip(prompts, all_ids, where):
            if body.truncate_prompt_tokens is not None and len(ids) > body.truncate_prompt_tokens:
                ids, prompt = truncated(ids, body), None  # the echo is the truncated prompt, decoded
            max_tokens = check_length(len(ids), body.max_tokens, param)
            params = to_sampling_params(body, max_tokens, guided)
            ids = validate_ids(ids)
            fmt = await choice_format(body, False, prompt if isinstance(prompt, str) else None, ids)
            ready.append(Prompt(ids, params, fmt))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if len(ready) > 1:
            return await respond_to_list(request, state["loop"], request_id, ready, body, name,
                                         settings.stall_timeout_s)
        only = ready[0]
        return await _respond(request, state["loop"], request_id, only.ids, only.params, body, only.fmt, name=name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        # Counted on the parsed JSON: 30,000 messages are refused before pydantic builds them.
        def before(data: dict) -> None:
            check_message_count(data, settings.max_messages)
            known_fields(data, ChatCompletionRequest)

        body = await parse_body(request, ChatCompletionRequest, limits.max_body_bytes, before=before)
        check_request(body)
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(f"the model `{name}` has no chat template; use /v1/completions", param="messages")
        messages = chat_messages(body.messages)
        guided, plan = await grammar(body, chat=True)
        template_kwargs = dict(body.chat_template_kwargs or {})
        if body.tools:  # the template may describe them to the model (SmolLM2's does not)
            template_kwargs["tools"] = template_tools(body.tools)
        options = TemplateOptions(body.add_generation_prompt, body.continue_final_message, template_kwargs,
                                  body.add_special_tokens is True)
        # Checked for size before and after rendering, then tokenized (chat.py): all off the loop.
        ids = await off_the_engine(prompt_ids, tokenizer, messages, limits, settings.special_tokens_in_content,
                                   options)
        ids = truncated(ids, body)
        max_tokens = check_length(len(ids), body.max_completion_tokens or body.max_tokens, "messages")
        params = to_sampling_params(body, max_tokens, guided)
        ids = validate_ids(ids)
        fmt = replace(await choice_format(body, True, None, ids), tools=plan)
        return await _respond(request, state["loop"], f"chatcmpl-{uuid.uuid4().hex}", ids, params, body, fmt,
                              name=name)

    add_tokenizer_routes(app, name, tokenizer, max_model_len, vocab_size, limits, settings, off_the_engine,
                         ignore_unknown_fields)
    return app


async def _next(request: Request, loop: EngineLoop, request_id: str, mailbox: Mailbox) -> RequestOutput | None:
    """The request's next output, or None if the client went away first (its request is aborted)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    getter = asyncio.ensure_future(mailbox.get())
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not getter.done():
        getter.cancel()
        loop.abort(request_id)
        return None
    item = getter.result()
    if isinstance(item, Exception):
        raise APIError(f"the engine failed: {item}", status=500, type_="server_error")
    return item


async def _respond(request: Request, loop: EngineLoop, request_id: str, ids: list[int], params: SamplingParams,
                   body: SamplingFields, fmt: ChoiceFormat, name: str):
    # A stream takes what is new at each step; a plain answer needs only the end. Neither has
    # the engine copy every sequence's whole output at every step.
    params.output_kind = "delta" if body.stream else "final_only"
    try:
        mailbox = await loop.add(request_id, ids, params)
    except ValueError as e:  # the engine's own checks on the request
        raise APIError(str(e), param=field_named(str(e)) or "prompt") from None
    created = int(time.time())
    out = await _next(request, loop, request_id, mailbox)  # wait for the first one, so errors are HTTP errors
    if out is None:
        return JSONResponse({}, status_code=499)  # nobody is listening
    if out.finished and out.error:  # ignored (it can never fit), or the engine failed on it
        raise output_error(out)
    if body.stream:
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        events = stream_events(loop, request_id, mailbox, out, params, created, fmt, name, include_usage,
                               continuous_usage=include_usage and options.continuous_usage_stats)
        return StallGuardedStream(events, request.app.state.settings.stall_timeout_s,
                                  on_stall=lambda: loop.abort(request_id), media_type="text/event-stream")
    while not out.finished:
        out = await _next(request, loop, request_id, mailbox)
        if out is None:
            return JSONResponse({}, status_code=499)
    if out.error:
        raise output_error(out)

    def answer() -> dict:
        # Megabytes with n and logprobs: built and encoded off the loop, and one choice at a time
        # (a generator), so that the garbage collector never walks the whole answer (jsonbody.py).
        choices = (fmt.choice(out, c) for c in out.outputs)
        whole = {"id": request_id, "object": "chat.completion" if fmt.chat else "text_completion",
                 "created": created, "model": name, "choices": choices, "usage": usage(out, fmt.completion_tokens(out))}
        if fmt.chat and body.prompt_logprobs is not None:  # vLLM's: at the top, as the prompt is the request's
            whole["prompt_logprobs"] = replace(fmt, prompt_top=body.prompt_logprobs).prompt_logprobs(out)
        return whole

    return await json_answer(answer)


class ServerThread:
    """Run an app with uvicorn in a background thread (tests, notebooks); port 0 picks a free one.

    uvicorn is set up as on the command line, from the app's ``ServerSettings``."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        settings = getattr(app.state, "settings", None) or ServerSettings()
        self.server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(settings, host, port, log_level)))
        self.thread = threading.Thread(target=self.server.run, name="tinyserve-http", daemon=True)
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RuntimeError("the server did not stop")

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
