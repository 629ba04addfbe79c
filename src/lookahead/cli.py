"""Command line: ``lookahead generate "PROMPT"`` and ``lookahead bench`` here, ``serve`` in
:mod:`lookahead.cli_serve` and ``calibrate`` in :mod:`lookahead.cli_calibrate`.

The library never prints; these modules format what it returns.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import sys
import time
from pathlib import Path

from . import cli_calibrate, cli_serve, models
from .cli_common import device_for, quiet_transformers, wng
from .quantization import SCHEMES

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + traceback
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lookahead", description="Lossless lookahead decoding for transformers models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    _add_bench(sub)
    cli_serve.add_parser(sub)
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        commands = {"bench": _bench, "serve": cli_serve.run, "calibrate": cli_calibrate.run}
        return commands.get(args.command, _generate)(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as err:  # our errors say what to change
        print(f"lookahead: error: {err}", file=sys.stderr)
        return 1


def _generate(args) -> int:
    import torch
    from transformers import TextStreamer

    from .decoding import Lookahead

    quiet_transformers()
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1")
    lookahead = Lookahead(*wng(args))  # validates W/N/G
    settings = _generation_settings(args)
    model, tokenizer = models.load(args.model, dtype=args.dtype, device=device_for(args.device))
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

    quiet_transformers()
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
    if args.adaptive and wng(args) == (None,) * 3:
        raise ValueError("--adaptive applies to the -W/-N/-G run: give at least one of them")
    if args.num_beams < 1:
        raise ValueError(f"--num-beams must be at least 1, got {args.num_beams}")
    bench.methods_for(*wng(args), adaptive=args.adaptive)  # validates W/N/G before the load
    device = device_for(args.device)
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
    methods = bench.methods_for(*wng(args), adaptive=args.adaptive, device=model.device, num_beams=args.num_beams)
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


if __name__ == "__main__":
    sys.exit(main())
