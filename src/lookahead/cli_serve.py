"""``lookahead serve``: its options, the checks made before the model loads, and the server's start."""

from __future__ import annotations

import math
import signal
import sys
from pathlib import Path

from . import models
from .cli_common import device_for, quiet_transformers, wng
from .images import DEFAULT_MAX_IMAGE_PIXELS

API_KEYS_VARIABLE = "LOOKAHEAD_API_KEYS"


def add_parser(sub) -> None:
    """``lookahead serve``'s options."""
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    serve.add_argument("--model", default=models.DEFAULT_MODEL, help="as for generate (default: %(default)s)")
    serve.add_argument("--dtype", default="bfloat16", choices=sorted(models.DTYPES), help="default: %(default)s")
    serve.add_argument("--device", default="auto", help="cpu | cuda | cuda:N (default: auto: cuda when available)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    serve.add_argument("--max-batch-size", type=int, default=8, help="sequences decoded together (default: 8)")
    serve.add_argument("--max-queue", type=int, default=64, help="requests waiting before 429 (default: 64)")
    _add_serve_access(serve)
    serve.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        metavar="N",
        help="prompt tokens prefilled per engine step, so that a long prompt is prefilled in chunks between "
        "decode steps (default: %(default)s)",
    )
    serve.add_argument("--plain", action="store_true", help="one-token steps only: the baseline to measure against")
    serve.add_argument("--no-shared-pool", action="store_true", help="do not share n-grams across requests")
    serve.add_argument(
        "--sampling-defaults",
        choices=("model", "openai"),
        default="model",
        help="what a request that leaves out temperature/top_p/top_k gets: the model's generation_config "
        "where it sets them (default), or OpenAI's (temperature 1, no cut)",
    )
    serve.add_argument("-W", "--window-size", type=int, help="server-wide W (default: picked for the device)")
    serve.add_argument("-N", "--ngram-size", type=int, help="server-wide N")
    serve.add_argument("-G", "--max-candidates", type=int, help="server-wide G")


def _add_serve_access(parser) -> None:
    """``lookahead serve``'s options on its callers: API keys, whose n-grams their drafts draw on,
    the largest body, how long a shutdown waits for them."""
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require 'Authorization: Bearer KEY' on /v1/*; may be given more than once (keys also come from "
        f"--api-key-file and from ${API_KEYS_VARIABLE}, comma-separated, which keep them out of ps)",
    )
    parser.add_argument(
        "--api-key-file", metavar="PATH", help="API keys, one a line (blank lines and #-comments skipped)"
    )
    parser.add_argument(
        "--pool-scope",
        choices=("shared", "key"),
        help="whose n-grams a request's drafts may draw on: every request's (shared) or its own API key's (key); "
        "default: key with more than one API key, else shared",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="larger request bodies are refused with 413 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        metavar="N",
        help="a vision-language model's images past this many pixels are refused with 400, before they are "
        "decoded (default: %(default)s)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, wait this long for requests in flight, then cancel them and exit 0 "
        "(default: %(default)s)",
    )


def run(args) -> int:
    try:
        import uvicorn
    except ImportError as err:
        raise ValueError("lookahead serve needs the server's extras: pip install 'lookahead-decoding[serve]'") from err

    from .api import SamplingDefaults
    from .decoding import Lookahead
    from .metrics import Metrics
    from .pool import SharedPool
    from .server import ServerSettings, create_app
    from .service import PLAIN_CONFIG, Service

    quiet_transformers()
    keys, pool_scope = _check_serve(args)
    lookahead = Lookahead(*wng(args))  # validates W/N/G
    device = device_for(args.device)
    cfg = PLAIN_CONFIG if args.plain else lookahead.config_for(device)
    shared = None if args.plain or args.no_shared_pool else SharedPool()
    metrics = Metrics()
    loaded = {}

    def load():  # on the engine thread, which then runs every forward pass (see lookahead.service)
        model, loaded["tokenizer"] = models.load(args.model, dtype=args.dtype, device=device)
        loaded["processor"] = models.load_processor(args.model)  # a vision-language model's: it takes images
        return model

    service = Service(
        load, cfg, max_batch_size=args.max_batch_size, max_queue=args.max_queue, shared_pool=shared,
        pool_scopes=pool_scope == "key", prefill_chunk=args.prefill_chunk, on_step=metrics.on_step,
    )  # fmt: skip
    tokenizer = loaded["tokenizer"]
    sampling = SamplingDefaults() if args.sampling_defaults == "openai" else None
    settings = ServerSettings(
        model_name=args.model, api_keys=keys, pool_scope=pool_scope, sampling=sampling,
        max_body_bytes=args.max_body_bytes, drain_timeout=args.drain_timeout, max_image_pixels=args.max_image_pixels,
    )  # fmt: skip
    app = create_app(service, tokenizer, settings, metrics, processor=loaded["processor"])
    _announce(args, cfg, app.state.sampling_defaults, len(keys), pool_scope == "key" and shared is not None)
    # uvicorn stops admission on SIGTERM/SIGINT, waits for the requests in flight, then re-raises
    # the signal to the handler it found: a no-op one lets the process exit 0 once drained
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    # past --drain-timeout uvicorn cancels the requests still in flight (a client that stopped reading)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=args.drain_timeout)
    print("lookahead: server stopped", file=sys.stderr)
    return 0


def _check_serve(args) -> tuple[list[str], str]:
    """What ``lookahead serve`` refuses before it loads the model; returns the API keys and the
    pool scope (``--pool-scope``, or its default for that many keys)."""
    if args.max_batch_size < 1 or args.max_queue < 1:
        raise ValueError("--max-batch-size and --max-queue must be at least 1")
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in 1-65535, got {args.port}")
    keys = api_keys(args)
    pool_scope = args.pool_scope or ("key" if len(keys) > 1 else "shared")
    if args.max_body_bytes < 1 or args.prefill_chunk < 1 or args.max_image_pixels < 1:
        raise ValueError("--max-body-bytes, --prefill-chunk and --max-image-pixels must be at least 1")
    if not (math.isfinite(args.drain_timeout) and args.drain_timeout >= 0):
        raise ValueError(f"--drain-timeout must be a number of seconds >= 0, got {args.drain_timeout}")
    if args.plain and wng(args) != (None,) * 3:
        raise ValueError("--plain takes one-token steps: drop -W/-N/-G, or drop --plain")
    return keys, pool_scope


def _announce(args, cfg, defaults, n_keys: int, pool_per_key: bool) -> None:
    """What the server runs, on stderr: the model and its steps, the sampling a request gets by
    default (``defaults``: the app's ``SamplingDefaults``), the API keys and their pools."""
    from .api import SamplingDefaults

    mode = (
        "plain one-token steps" if args.plain else f"lookahead {cfg.window_size}/{cfg.ngram_size}/{cfg.max_candidates}"
    )
    print(f"lookahead: serving {args.model} ({args.dtype}, {mode}) on http://{args.host}:{args.port}", file=sys.stderr)
    origin = "the model's generation_config; OpenAI's where it sets none"
    if defaults == SamplingDefaults():
        origin = "OpenAI's"
    print(f"lookahead: a request that leaves out a sampling field gets {defaults.describe()} "
          f"({origin})", file=sys.stderr)  # fmt: skip
    if n_keys:
        pools = "a warm pool per key" if pool_per_key else "one warm pool"
        print(f"lookahead: {n_keys} API key(s), {pools}", file=sys.stderr)


def api_keys(args) -> list[str]:
    """The API keys of --api-key, --api-key-file and $LOOKAHEAD_API_KEYS, in that order, each once."""
    import os

    keys = list(args.api_key)
    if any(not key.strip() for key in keys):
        raise ValueError("--api-key is empty (an unset variable?): give a key, or drop the flag to serve without one")
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()
        except OSError as err:
            raise ValueError(f"--api-key-file {args.api_key_file}: cannot read it ({err.strerror})") from err
        found = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not found:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key: one key a line")
        keys += found
    variable = os.environ.get(API_KEYS_VARIABLE)
    if variable is not None:
        found = [key.strip() for key in variable.split(",") if key.strip()]
        if not found:
            raise ValueError(f"${API_KEYS_VARIABLE} is set but holds no key: unset it, or give comma-separated keys")
        keys += found
    return [key.strip() for key in dict.fromkeys(keys)]
