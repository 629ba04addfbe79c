"""Command line: ``lookahead generate "PROMPT"``, ``bench``, ``serve`` and ``calibrate``.

The library never prints; this module formats what it returns.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import signal
import sys
import time
from pathlib import Path

from . import cli_calibrate, models
from .images import DEFAULT_MAX_IMAGE_PIXELS
from .quantization import SCHEMES

EXIT_USAGE = 2
API_KEYS_VARIABLE = "LOOKAHEAD_API_KEYS"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + traceback
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lookahead", description="Lossless lookahead decoding for transformers models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    _add_bench(sub)
    _add_serve(sub)
    cli_calibrate.add_parser(sub)
    return parser


def _add_generate(sub) -> None:
    """``lookahead generate``'s options."""
    gen = sub.add_parser("generate", help="generate text with lookahead decoding, streaming it")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument(
        "--model",
        default=models.DEFAULT_MODEL,
        help=f"{' | '.join(models.BUNDLED)} | PATH to a local checkpoint (default: %(default)s)",
    )
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("-W", "--window-size", type=int, help="window columns W (default: picked for the device)")
    gen.add_argument("-N", "--ngram-size", type=int, help="n-gram size N (default: picked for the device)")
    gen.add_argument("-G", "--max-candidates", type=int, help="candidates per step G (default: picked)")
    gen.add_argument("--max-new-tokens", type=int, default=256, help="default: %(default)s")
    gen.add_argument("--dtype", default="float32", choices=sorted(models.DTYPES), help="default: %(default)s")
    gen.add_argument("--device", default="auto", help="cpu | cuda | cuda:N (default: auto: cuda when available)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    gen.add_argument("--top-p", type=float, help="nucleus sampling (with --temperature > 0)")
    gen.add_argument("--top-k", type=int, help="top-k sampling (with --temperature > 0)")
    gen.add_argument("--repetition-penalty", type=float, help="transformers' repetition_penalty")
    gen.add_argument("--seed", type=int, help="torch.manual_seed before each generation (sampling)")
    gen.add_argument(
        "--compare",
        action="store_true",
        help="also run plain model.generate and report its speed and (greedy) whether outputs match",
    )


def _add_bench(sub) -> None:
    """``lookahead bench``'s options."""
    bench = sub.add_parser("bench", help="benchmark against plain greedy and prompt lookup decoding")
    bench.add_argument("datasets", nargs="+", help="humaneval | mtbench | FILE.jsonl (lines with a 'prompt')")
    bench.add_argument(
        "--n", type=int, default=20, help="prompts per dataset, taken across its kinds in turn (default: %(default)s)"
    )
    bench.add_argument("--max-new-tokens", type=int, default=256, help="default: %(default)s")
    bench.add_argument("--model", default=models.DEFAULT_MODEL, help="as for generate (default: %(default)s)")
    bench.add_argument("--dtype", default="bfloat16", choices=sorted(models.DTYPES), help="default: %(default)s")
    bench.add_argument("--device", default="auto", help="cpu | cuda | cuda:N (default: auto: cuda when available)")
    bench.add_argument(
        "--quantization",
        choices=list(SCHEMES),
        help="quantize the weights as they load; every method runs on that same quantized model, and its cost "
        "curve is measured for it (default: none)",
    )
    bench.add_argument("-W", "--window-size", type=int, help="also run this fixed W/N/G (the rest default)")
    bench.add_argument("-N", "--ngram-size", type=int)
    bench.add_argument("-G", "--max-candidates", type=int)
    bench.add_argument(
        "--adaptive",
        action="store_true",
        help="the -W/-N/-G run chooses its steps as Lookahead() does, with them as upper bounds "
        "(-W 0 --adaptive: Lookahead() without the Jacobi window, count drafting on)",
    )
    bench.add_argument(
        "--out", default="results/bench", help="folder for JSON, Markdown and PNG (default: %(default)s)"
    )
    bench.add_argument(
        "--batch-size",
        type=int,
        nargs="+",
        default=[1],
        help="prompts per generate call; several values give a throughput table by batch size (default: 1)",
    )
    bench.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="time each prompt's methods this many times, in rotated order, and take the median (default: 1)",
    )
    bench.add_argument(
        "--time-budget",
        type=float,
        metavar="SECONDS",
        help="per dataset and batch size: start no further prompt once this many seconds have passed, and "
        "report those that ran (for a machine held for a fixed time)",
    )
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument(
        "--num-beams",
        type=int,
        default=1,
        help="k > 1: plain beam search against Lookahead()'s beam search, k beams each (default: 1, greedy)",
    )


def _add_serve(sub) -> None:
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.command == "calibrate":
            _quiet_transformers()
            return cli_calibrate.run(args, _device(args.device))
        return {"bench": _bench, "serve": _serve}.get(args.command, _generate)(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as err:  # our errors say what to change
        print(f"lookahead: error: {err}", file=sys.stderr)
        return 1


def _device(name: str) -> str:
    """``auto``: the first CUDA device when there is one, else the CPU."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"unknown --device {name!r}: use cpu, cuda, cuda:N or auto") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this machine has no CUDA device (torch {torch.__version__}): use cpu")
    try:  # a device torch can name but not reach (mps without support, cuda:7 on one GPU)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:
        raise ValueError(f"--device {name} cannot be used here ({str(err).splitlines()[0]}): use cpu or auto") from err
    return name


def _api_keys(args) -> list[str]:
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


def _quiet_transformers() -> None:
    """No transformers warnings or progress bars among the command's own lines."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # transformers imports torchao wherever it is installed (the quant extra): its kernels for
    # GPUs this machine lacks, and torch's notes on its types, are no news to the command's user
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _wng(args) -> tuple[int | None, int | None, int | None]:
    """-W, -N and -G as given (None where not)."""
    return args.window_size, args.ngram_size, args.max_candidates


def _generate(args) -> int:
    import torch
    from transformers import TextStreamer

    from .decoding import Lookahead

    _quiet_transformers()
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1")
    lookahead = Lookahead(*_wng(args))  # validates W/N/G
    settings = _generation_settings(args)
    model, tokenizer = models.load(args.model, dtype=args.dtype, device=_device(args.device))
    inputs = _prompt_inputs(args, tokenizer).to(model.device)

    if args.compare:  # one-time costs (allocations, the model probe) stay out of both timings
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
        lookahead.generate(model, **inputs, max_new_tokens=2, do_sample=False)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    start = time.perf_counter()
    out = lookahead.generate(model, **inputs, streamer=streamer, **settings)
    seconds = time.perf_counter() - start
    stats = lookahead.last_stats
    cfg = stats.config
    print()
    print(
        f"[lookahead W={cfg.window_size} N={cfg.ngram_size} G={cfg.max_candidates}] "
        f"{stats.new_tokens} tokens in {seconds:.2f} s: {stats.new_tokens / seconds:.1f} tokens/s, "
        f"{stats.tokens_per_step:.2f} tokens/step, mean accepted length {stats.mean_accepted:.2f}"
    )
    if not args.compare:
        return 0
    return _compare(args, model, inputs, settings, out, stats.new_tokens / seconds)


def _prompt_inputs(args, tokenizer):
    """The prompt's input ids (a BatchEncoding), wrapped in the chat template with --chat."""
    text = args.prompt
    if args.chat:
        if tokenizer.chat_template is None:
            raise ValueError(f"model {args.model!r} has no chat template: drop --chat")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    return tokenizer(text, return_tensors="pt", add_special_tokens=not args.chat)


def _compare(args, model, inputs, settings: dict, out, rate: float) -> int:
    """--compare: plain ``model.generate`` on the same inputs and settings, its speed against
    lookahead's ``rate`` (tokens/s) and, greedy, whether its output matches ``out`` (exit 3 where
    it differs)."""
    import torch

    if args.seed is not None:
        torch.manual_seed(args.seed)
    start = time.perf_counter()
    plain = model.generate(**inputs, **settings)
    plain_seconds = time.perf_counter() - start
    # an encoder-decoder model's output is the decoder's, from its start token
    new = plain.shape[1] - (1 if model.config.is_encoder_decoder else inputs["input_ids"].shape[1])
    timing = f"{new} tokens in {plain_seconds:.2f} s: {new / plain_seconds:.1f} tokens/s"
    speedup = rate / (new / plain_seconds)
    if settings["do_sample"]:  # two draws from the same distribution: only the speed compares
        print(f"[plain generate] {timing}; tokens/s ratio {speedup:.2f}x; sampled: the texts are two draws")
        return 0
    same = plain.shape == out.shape and bool((plain == out).all())
    print(f"[plain generate] {timing}; speedup {speedup:.2f}x; outputs {'identical' if same else 'DIFFER'}")
    return 0 if same else 3


def _generation_settings(args) -> dict:
    """generate() keyword arguments from the CLI's sampling options, checked."""
    for flag, value in (("temperature", args.temperature), ("top-p", args.top_p),
                        ("repetition-penalty", args.repetition_penalty)):  # fmt: skip
        if value is not None and not math.isfinite(value):
            raise ValueError(f"--{flag} must be a finite number, got {value}")
    if args.temperature < 0:
        raise ValueError("--temperature must be >= 0 (0 = greedy)")
    sample = args.temperature > 0
    if not sample and (args.top_p is not None or args.top_k is not None):
        raise ValueError("--top-p and --top-k sample: give --temperature > 0 too")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError("--top-p must be in (0, 1]")
    if args.top_k is not None and args.top_k < 1:
        raise ValueError("--top-k must be at least 1")
    if args.repetition_penalty is not None and args.repetition_penalty <= 0:
        raise ValueError("--repetition-penalty must be > 0")
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=sample)
    if sample:
        settings.update(temperature=args.temperature, top_p=args.top_p or 1.0, top_k=args.top_k or 0)
    if args.repetition_penalty is not None:
        settings["repetition_penalty"] = args.repetition_penalty
    return settings


def _bench(args) -> int:
    from . import report

    _quiet_transformers()
    device, suites, out = _check_bench(args)
    model, tokenizer = models.load(args.model, dtype=args.dtype, device=device, quantization=args.quantization)
    if model.config.is_encoder_decoder:
        raise ValueError("lookahead bench measures decoder-only models (its bound and prompt lookup are theirs)")
    for name, prompts in suites.items():
        by_batch = {
            batch: _bench_report(args, model, tokenizer, name, prompts, batch, out) for batch in args.batch_size
        }
        if len(by_batch) > 1:
            label = Path(name).stem
            table = report.batch_markdown(
                by_batch,
                f"{label} by batch size ({args.model}, {args.dtype}{_weights(args)}, up to {len(prompts)} prompts)",
            )
            (out / f"{label}-batches.md").write_text(table)
            print(table)
    return 0


def _check_bench(args) -> tuple[str, dict[str, list], Path]:
    """What ``lookahead bench`` refuses before it loads the model: its numbers, W/N/G, the device,
    missing extras, the datasets and an output folder it cannot write. Returns the device, the
    prompts by dataset name and the output folder."""
    from . import bench, datasets
    from .quantization import quantization_config

    if args.n < 1 or args.max_new_tokens < 1 or min(args.batch_size) < 1 or args.repeats < 1:
        raise ValueError("--n, --max-new-tokens, --batch-size and --repeats must be at least 1")
    if args.time_budget is not None and not args.time_budget > 0:
        raise ValueError(f"--time-budget must be a positive number of seconds, got {args.time_budget}")
    if args.adaptive and _wng(args) == (None,) * 3:
        raise ValueError("--adaptive applies to the -W/-N/-G run: give at least one of them")
    if args.num_beams < 1:
        raise ValueError(f"--num-beams must be at least 1, got {args.num_beams}")
    bench.methods_for(*_wng(args), adaptive=args.adaptive)  # validates W/N/G before the load
    device = _device(args.device)
    if args.quantization is not None:  # its package is installed, before the load
        quantization_config(args.quantization, models.parse_dtype(args.dtype), device)
    missing = [name for name in ("tqdm", "psutil", "matplotlib") if importlib.util.find_spec(name) is None]
    if missing:
        needs = ", ".join(missing)
        raise ValueError(f"lookahead bench needs its extras ({needs} missing): pip install 'lookahead-decoding[bench]'")
    suites = {name: datasets.load(name, args.n) for name in args.datasets}  # fail early on a bad name
    labels = [Path(name).stem for name in args.datasets]
    if len(set(labels)) < len(labels):
        raise ValueError(f"datasets {args.datasets} would write reports of the same name: rename one")
    out = Path(args.out)
    try:  # before the run, not after it
        out.mkdir(parents=True, exist_ok=True)
        (out / ".lookahead-write-check").touch()
        (out / ".lookahead-write-check").unlink()
    except OSError as err:
        raise ValueError(f"--out {args.out}: cannot write there ({err.strerror})") from err
    return device, suites, out


def _bench_report(args, model, tokenizer, name: str, prompts: list, batch: int, out: Path) -> list[dict]:
    """One dataset at one batch size: run every method, write the report (JSON, Markdown, PNG)
    under ``out`` and print its table; returns the report's summary rows."""
    from . import bench, report

    # fresh callables per dataset and batch size: Lookahead() carries its drafting statistics
    # from call to call, so each workload starts from the priors rather than another's
    methods = bench.methods_for(*_wng(args), adaptive=args.adaptive, device=model.device, num_beams=args.num_beams)
    runs = bench.run_bench(
        model,
        tokenizer,
        prompts,
        methods,
        args.max_new_tokens,
        not args.no_progress,
        batch_size=batch,
        repeats=args.repeats,
        time_budget=args.time_budget,
    )
    # prompts the budget let run (the last batch may be short)
    ran = min(len({run.prompt for run in runs}) * batch, len(prompts))
    if ran < len(prompts):
        print(f"time budget: {ran} of {len(prompts)} prompts ran")
    label = Path(name).stem
    stem = label if args.batch_size == [1] else f"{label}-batch{batch}"
    table, rows = report.write_report(runs, out, stem, _bench_meta(args, model, name, batch, ran))
    print(table)
    print(f"written: {out}/{stem}.json, .md, .png\n")
    return rows


def _bench_meta(args, model, name: str, batch: int, ran: int) -> dict:
    """A report's settings, and the costs its steps were priced with."""
    from .calibration import model_batch_costs, model_cost_curve
    from .support import check_model

    meta = dict(
        dataset=name,
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        n=ran,
        max_new_tokens=args.max_new_tokens,
        batch_size=batch,
        repeats=args.repeats,
        num_beams=args.num_beams,
    )
    if batch == 1:  # what the tuner priced its steps with and the bound was priced with
        meta["cost_curve"] = [list(point) for point in model_cost_curve(model).points]
    else:  # what Lookahead() priced a batch's steps with: seconds by batch size and cache length
        costs = model_batch_costs(model, check_model(model), batch, 1)  # as stored by the run
        meta["batch_costs"] = {
            size: {length: [list(point) for point in curve.points] for length, curve in curves}
            for size, curves in costs.by_batch
        }
    return meta


def _weights(args) -> str:
    """What a title says of the weights: ", int8 weights" when they are quantized, else nothing."""
    return f", {args.quantization} weights" if args.quantization else ""


def _serve(args) -> int:
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

    _quiet_transformers()
    keys, pool_scope = _check_serve(args)
    lookahead = Lookahead(*_wng(args))  # validates W/N/G
    device = _device(args.device)
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
    keys = _api_keys(args)
    pool_scope = args.pool_scope or ("key" if len(keys) > 1 else "shared")
    if args.max_body_bytes < 1 or args.prefill_chunk < 1 or args.max_image_pixels < 1:
        raise ValueError("--max-body-bytes, --prefill-chunk and --max-image-pixels must be at least 1")
    if not (math.isfinite(args.drain_timeout) and args.drain_timeout >= 0):
        raise ValueError(f"--drain-timeout must be a number of seconds >= 0, got {args.drain_timeout}")
    if args.plain and _wng(args) != (None,) * 3:
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


if __name__ == "__main__":
    sys.exit(main())
