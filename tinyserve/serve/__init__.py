"""An OpenAI-compatible HTTP server over the engine: ``python -m tinyserve.serve``.

Requests arrive at any moment; the engine only moves forward when someone calls ``step()``.
The server is a few small pieces:

- ``loop.EngineLoop``: one background task that steps the engine for as long as any request is
  unfinished, in a worker thread so the event loop keeps accepting connections, and leaves every
  ``RequestOutput`` in its request's ``mailbox.Mailbox``, where outputs not yet taken merge. A new
  request joins the running batch at the next step: continuous batching, seen from outside.
- ``bodies`` and ``protocol``: a body's size, JSON and strict types, OpenAI's request models and
  error body; ``chat``: messages to prompt ids, bounded before rendering and with the client's
  text never turned into control tokens; ``streaming``: OpenAI's chunk format
  (server-sent events ending with ``data: [DONE]``) from the engine's delta outputs, and a
  response that aborts a request whose client stops reading.
- ``app.create_app``: the FastAPI app with ``/v1/completions`` (a list of prompts answered by
  ``prompt_list``), ``/v1/chat/completions`` (the model's chat template), ``/v1/models``,
  ``/health`` and ``/metrics``; ``tokenizer_routes`` adds vLLM's ``/tokenize``, ``/detokenize``,
  ``/tokenizer_info``, ``/version`` and ``/v1/models/{id}``. A client that disconnects
  has its request aborted, which frees its blocks; invalid requests get a 400 with OpenAI's error
  body. Prompts are tokenized on a thread of their own, never the engine's; ``jsonbody`` builds
  and encodes a plain answer off the event loop and sends it in chunks.
- ``metrics``: the engine's queues, cache usage and counters for Prometheus, under vLLM's names.
- ``settings.ServerSettings``: the server's limits, timeouts and protections, in one place;
  ``guard`` enforces the per-request ones (API key, Host, JSON only, body deadline),
  ``connections`` the per-connection ones (uvicorn's h11 protocol with head and body timeouts,
  and a stall timeout on any answer left unread),
  and ``floodlog`` keeps a flood of identical failures from flooding the log.

``cli`` is the command line; ``app.ServerThread`` runs the app in a background thread for tests
and notebooks.

The names below are imported on first use, so ``python -m tinyserve.serve --help`` answers without
loading torch or FastAPI (``cli`` loads them once the flags are parsed).
"""

import importlib

# name -> the submodule that defines it
_EXPORTS = {"APIError": "bodies", "EngineLoop": "loop", "ServerSettings": "settings", "ServerThread": "app",
            "create_app": "app", "main": "cli", "parser": "cli", "stream_events": "streaming"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tinyserve.serve' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tinyserve.serve.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value
