"""``python -m tinyserve.serve``: load a model and serve it over HTTP (loopback by default)."""

from __future__ import annotations

import argparse
import math

import uvicorn

from tinyserve.engine import LLM
from tinyserve.serve.app import create_app


def gib(text: str) -> float:
    """A size in GiB: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of GiB >= 0, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    """The command line's flags, named like vLLM's."""
    p = argparse.ArgumentParser(prog="python -m tinyserve.serve", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="smollm2-135m", help="'smollm2-135m' or a local Hugging Face directory")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as `model`")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--swap-space", type=gib, default=1.0,
                   help="CPU swap space for preempted requests' KV blocks, in GiB per GPU (default: 1)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's own limit")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--enable-chunked-prefill", action="store_true")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> None:
    """Build the engine from the flags and run the server until interrupted."""
    args = parser().parse_args(argv)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
              num_gpu_blocks=args.num_gpu_blocks, swap_space=args.swap_space, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
              enable_prefix_caching=args.enable_prefix_caching, enable_chunked_prefill=args.enable_chunked_prefill)
    app = create_app(llm.engine, args.served_model_name or (args.model if args.model == "smollm2-135m" else None))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
