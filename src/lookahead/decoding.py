"""The lookahead decoding loop, handed to ``model.generate(custom_generate=Lookahead(...))``.

transformers prepares the inputs, the logits processors and the stopping criteria, then calls
:meth:`Lookahead.__call__` with the same arguments as its own ``_sample`` loop. The loop:

1. prefill the prompts as plain decoding does; each row's last position gives its first token t
   (the cache never holds t);
2. each step, one forward pass over every active row's t, lookahead window and up to G pooled
   candidates;
3. verify each row's candidates: accepted tokens plus the bonus token (1 to N tokens per row);
4. emit them one by one through the stopping criteria and the streamer;
5. keep in the cache exactly the committed tokens (``lookahead.runner`` explains how, for rows
   that advance unevenly); update the windows and pools; drop the rows that have finished.

A batch is handled as transformers handles it: left-padded prompts, rows that stop are padded
after their stop (or, without an EOS criterion, decoded on until every row has stopped).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import time

import torch
from transformers import StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from .config import LookaheadConfig, LookaheadStats
from .layout import StepLayout, build_layout
from .lookup import ContextIndex
from .pool import NGramPool
from .rows import Emitter, Row, align, assemble, plan_step, step_sizes, use_tree
from .runner import DecoderRunner, Seq2SeqRunner
from .step import Scorer, prompt_rows, validate_call
from .support import MaskSpec, check_model
from .tuning import WidthChooser, cost_curve, match_lengths
from .verify import Verdict, verify_greedy, verify_sampling
from .window import JacobiWindow

logger = logging.getLogger(__name__)


class Lookahead:
    """Lossless lookahead decoding as a ``custom_generate`` callable.

    >>> out = model.generate(**inputs, custom_generate=Lookahead(), max_new_tokens=64)

    ``Lookahead()`` takes W, N and G for the model's device as upper bounds and, step by step,
    runs the setting (or plain one-token step) with the highest expected tokens per second, from
    the model's measured cost curve and the acceptance seen so far (``adaptive``, see
    ``lookahead.tuning``); pass W, N or G to run a fixed setting. Invalid values raise
    ``ValueError`` at construction. After each call, ``last_stats`` holds a
    :class:`LookaheadStats` (steps, tokens per step, accepted-length histogram, the settings
    chosen, time). Batches of left-padded prompts and encoder-decoder models are supported.
    """

    def __init__(
        self,
        window_size: int | None = None,
        ngram_size: int | None = None,
        max_candidates: int | None = None,
        *,
        seed_pool_from_prompt: bool = True,
        pool_from_output: bool = True,
        context_lookup: bool = True,
        token_tree: bool = True,
        adaptive: bool | None = None,
    ) -> None:
        self._overrides = {
            "window_size": window_size,
            "ngram_size": ngram_size,
            "max_candidates": max_candidates,
            "seed_pool_from_prompt": seed_pool_from_prompt,
            "pool_from_output": pool_from_output,
            "context_lookup": context_lookup,
            "token_tree": token_tree,
            # auto settings adapt; explicit W/N/G run exactly as asked unless adaptive=True
            "adaptive": adaptive if adaptive is not None else (window_size, ngram_size, max_candidates) == (None,) * 3,
        }
        LookaheadConfig.default_for("cpu", **self._overrides)  # validate now, not mid-generate
        self.last_stats: LookaheadStats | None = None

    def config_for(self, device: torch.device | str) -> LookaheadConfig:
        """The W/N/G this callable uses on ``device``."""
        return LookaheadConfig.default_for(device, **self._overrides)

    def __repr__(self) -> str:
        given = {k: v for k, v in self._overrides.items() if v is not None and k[0] in "wnm"}
        return f"Lookahead({', '.join(f'{k}={v}' for k, v in given.items())})"

    def generate(self, model, inputs=None, **kwargs):
        """``model.generate(inputs, custom_generate=self, **kwargs)``, plus what transformers 5.x
        does not hand on to a ``custom_generate`` callable: ``streamer``, ``stop_strings`` with
        their ``tokenizer``, and, for encoder-decoder models, the encoder's input ids (pooled as
        candidates: summaries and translations copy from their source). Use this method whenever
        you stream, stop on strings, or run an encoder-decoder model.
        """
        streamer = kwargs.get("streamer")  # left in kwargs: generate itself streams the prompt
        tokenizer = kwargs.pop("tokenizer", None)
        config = kwargs.get("generation_config")
        stop_strings = kwargs.pop("stop_strings", None)
        if stop_strings is None and getattr(config or model.generation_config, "stop_strings", None):
            config = copy.deepcopy(config or model.generation_config)
            stop_strings, config.stop_strings = config.stop_strings, None
            kwargs["generation_config"] = config
        if stop_strings:
            if tokenizer is None:
                raise ValueError("stop_strings need the model's tokenizer: pass tokenizer=...")
            criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
            criteria.append(StopStringCriteria(tokenizer, stop_strings))
            kwargs["stopping_criteria"] = criteria
        extra = {"streamer": streamer} if streamer is not None else {}
        source = inputs if inputs is not None else kwargs.get("input_ids")
        if getattr(model.config, "is_encoder_decoder", False) and isinstance(source, torch.Tensor):
            extra["source_ids"] = source  # the encoder's input: n-grams the output often copies
        loop = functools.partial(self, **extra) if extra else self
        return model.generate(inputs, custom_generate=loop, **kwargs)

    @torch.no_grad()
    def __call__(
        self,
        model,
        input_ids: torch.LongTensor,  # [B, S]
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus: bool = False,
        streamer=None,
        source_ids: torch.LongTensor | None = None,  # [B, S_enc]: pooled too, for encoder-decoder models
        **model_kwargs,
    ):
        spec = check_model(model)
        validate_call(input_ids, generation_config, synced_gpus, model_kwargs, streamer)
        cfg = self._settle(self.config_for(model.device), spec)
        batch, max_length = input_ids.shape[0], generation_config.max_length
        stats = LookaheadStats(config=cfg, accepted_hist=[0] * cfg.ngram_size, batch_size=batch)
        self.last_stats = stats
        want = generation_config.return_dict_in_generate
        has_eos = any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)
        emitter = Emitter(
            stopping_criteria,
            streamer,
            want_scores=want and generation_config.output_scores,
            want_logits=want and generation_config.output_logits,
            stop_ends_row=has_eos or batch == 1,
            batch_size=batch,
        )
        prompts = prompt_rows(input_ids, model_kwargs.get("attention_mask"), spec)
        stats.prompt_tokens = sum(len(p) for p in prompts)
        rows = [self._row(b, input_ids, prompt, cfg, source_ids) for b, prompt in enumerate(prompts)]
        runner = Seq2SeqRunner(model, model_kwargs) if spec.encoder_decoder else DecoderRunner(model, spec)
        chooser = WidthChooser(
            curve=cost_curve(model, lambda: _calibration_step(model, spec)) if cfg.adaptive else None,
            max_candidates=cfg.max_candidates,
            ngram_size=cfg.ngram_size,
            window_size=cfg.window_size,
            batch=batch,
            enabled=cfg.adaptive,
        )
        sample = generation_config.do_sample

        # 1. prefill every prompt; its last position gives the row's first token, as in plain decoding
        start = time.perf_counter()
        logits = runner.prefill(prompts)  # [B, V]
        stats.prefill_seconds = time.perf_counter() - start
        start = time.perf_counter()
        for b, row in enumerate(rows):
            first = Scorer(logits[b : b + 1], None, logits_processor, row.ids, [], (row.index, batch))
            emitter.emit(row, [first.sample(0) if sample else first.choice(0)], [0], first)
            _pool_output(row, cfg, 1)
        stats.steps, stats.row_steps, stats.accepted_hist[0] = 1, batch, batch
        active = _drop_finished(rows, rows, runner, emitter.stop_ends_row, max_length)

        while active:
            # 2. plan and run one step for every active row, as wide as pays (lookahead.tuning)
            chooser.batch = len(active)
            matches = [row.context.match_length(row.committed) if row.context and chooser.enabled else None
                       for row in active]  # fmt: skip
            limits = [_limit(row, rows, emitter.stop_ends_row, max_length) for row in active]
            sizes = None
            if chooser.enabled and use_tree(active, cfg):  # price each option by its token tree
                sizes = step_sizes(active[0], cfg, spec, limits[0], chooser.options())
            choice = chooser.choose(matches, sizes)
            layout, step_ids = plan_step(active, cfg, choice, spec, limits)
            logits = runner.step(layout, step_ids)  # [B, K, V]

            # 3. verify each row: greedy, or sampling that keeps the processed distribution exactly
            scorers = [
                Scorer(logits[b], layout, logits_processor, r.ids, r.candidates, (r.index, batch))
                for b, r in enumerate(active)
            ]
            verdicts = [_verify(row, scorer, layout, sample) for row, scorer in zip(active, scorers, strict=True)]
            for row, scorer, match in zip(active, scorers, matches, strict=True) if chooser.enabled else ():
                lengths = match_lengths(row.candidates, scorer.raw_choice(layout.t_row), scorer.raw_candidate_choice)
                chooser.record(choice, max((len(c) for c in row.candidates), default=0), lengths, match)
            if runner.aligned:
                verdicts = align(verdicts, active)

            # 4. emit token by token through the stopping criteria and the streamer
            kept = []
            for row, verdict, scorer in zip(active, verdicts, scorers, strict=True):
                emitted_rows = [layout.t_row, *(layout.candidate_rows[k][j] for k, j in verdict.path)]
                kept.append(emitter.emit(row, verdict.emitted, emitted_rows, scorer))
            chooser.after_step(choice)

            # 5. commit: cache, windows, pools, statistics; drop the rows that have finished
            runner.commit(layout, [(v.candidate, k) for v, k in zip(verdicts, kept, strict=True)])
            for row, ids, verdict, scorer, count in zip(active, step_ids, verdicts, scorers, kept, strict=True):
                if layout.level_rows:
                    for ngram in row.window.update(ids[0], [scorer.raw_choice(r) for r in layout.last_level_rows]):
                        row.pool.add(ngram)
                _pool_output(row, cfg, count)
                stats.accepted_hist[len(verdict.emitted) - 1] += 1
                stats.truncated_tokens += len(verdict.emitted) - count
            stats.steps += 1
            stats.row_steps += len(active)
            active = _drop_finished(active, rows, runner, emitter.stop_ends_row, max_length)

        sequences = assemble(rows, input_ids.shape[1], emitter.stop_ends_row, generation_config._pad_token_tensor)
        # rows padded after their stop did not generate the padding; rows that ran on are cut to T
        new_per_row = [min(row.ids.shape[1], sequences.shape[1]) - input_ids.shape[1] for row in rows]
        stats.new_tokens = sum(new_per_row)
        stats.wide_steps = chooser.wide_steps
        stats.settings = chooser.summary()
        stats.decode_seconds = time.perf_counter() - start
        if streamer is not None:
            streamer.end()
        logger.debug("lookahead %s: %s", cfg, stats.as_dict())
        if not want:
            return sequences
        # a batch's cache holds holes (see lookahead.runner) and finished rows were dropped from it
        cache = runner.cache if batch == 1 else None
        outputs = dict(
            sequences=sequences,
            scores=emitter.scores if generation_config.output_scores else None,
            logits=emitter.logits if generation_config.output_logits else None,
            cache=cache,
        )
        return GenerateEncoderDecoderOutput(**outputs) if spec.encoder_decoder else GenerateDecoderOnlyOutput(**outputs)

    def _settle(self, cfg: LookaheadConfig, spec: MaskSpec) -> LookaheadConfig:
        """Encoder-decoder decoders take linear steps only: no window, one candidate (see runner)."""
        if not spec.encoder_decoder or (cfg.window_size == 0 and cfg.max_candidates <= 1):
            return cfg
        if self._overrides["window_size"] or (self._overrides["max_candidates"] or 0) > 1:
            logger.warning(
                "encoder-decoder models run lookahead with W=0 and G<=1 (their decoders take no "
                "position_ids); asked for W=%s, G=%s",
                cfg.window_size,
                cfg.max_candidates,
            )
        return dataclasses.replace(cfg, window_size=0, max_candidates=min(1, cfg.max_candidates))

    @staticmethod
    def _row(index: int, input_ids, prompt: list[int], cfg: LookaheadConfig, source_ids) -> Row:
        pool = NGramPool(cfg.ngram_size, max(1, cfg.max_candidates))
        if cfg.seed_pool_from_prompt:
            pool.add_sequence(prompt)
            if source_ids is not None:
                pool.add_sequence(source_ids[index].tolist())
        window = JacobiWindow(cfg.window_size, cfg.ngram_size, prompt)
        context = ContextIndex() if cfg.context_lookup else None
        if context is not None:
            context.extend(prompt)
        ids = input_ids[index : index + 1]
        return Row(index=index, ids=ids, committed=list(prompt), pool=pool, window=window, context=context)


def _verify(row: Row, scorer: Scorer, layout: StepLayout, sample: bool) -> Verdict:
    if sample:
        return verify_sampling(row.candidates, scorer.distribution)
    return verify_greedy(scorer.choice(layout.t_row), row.candidates, scorer.candidate_choice)


def _pool_output(row: Row, cfg: LookaheadConfig, emitted: int) -> None:
    """Pool (and index) the n-grams that end in the tokens just emitted."""
    if row.context is not None:
        row.context.extend(row.committed)
    if cfg.pool_from_output:
        row.pool.add_sequence(row.committed, start=len(row.committed) - emitted - cfg.ngram_size + 1)


def _calibration_step(model, spec: MaskSpec):
    """A forward pass over k new tokens after a 64-token context, the cache restored after: what
    :func:`lookahead.tuning.measure` times."""
    device = model.device
    if spec.encoder_decoder:
        encoder = model.get_encoder()(input_ids=torch.ones(1, 32, dtype=torch.long, device=device))
        runner = Seq2SeqRunner(model, {"encoder_outputs": encoder})
    else:
        runner = DecoderRunner(model, spec)
    context = 64 if spec.max_positions is None else min(64, spec.max_positions // 4)
    runner.prefill([[1] * context])

    def step(k: int) -> None:
        if spec.max_positions is not None and context + k >= spec.max_positions:
            k = spec.max_positions - context - 1  # the position table's end: time what fits
        runner.step(build_layout(1, 0, 0, 1 if k > 1 else 0, k - 1), [[1] * k])
        runner.cache.crop(-k)

    return step


def _limit(row: Row, rows: list[Row], stop_ends_row: bool, max_length: int) -> int:
    """The length a row may reach: max_length, or, once every row has stopped (rows that run on
    after their stop), the longest stop."""
    if stop_ends_row or any(r.stopped_at is None for r in rows):
        return max_length
    return max(r.stopped_at for r in rows)


def _drop_finished(active: list[Row], rows: list[Row], runner, stop_ends_row: bool, max_length: int) -> list[Row]:
    """The rows still decoding; the runner forgets the others."""

    def finished(row: Row) -> bool:
        if row.ids.shape[1] >= max_length:
            return True
        if row.stopped_at is None:
            return False
        return stop_ends_row or row.ids.shape[1] >= _limit(row, rows, False, max_length)

    keep = [i for i, row in enumerate(active) if not finished(row)]
    if keep and len(keep) < len(active):
        runner.select(keep)
    return [active[i] for i in keep]


__all__ = ["Lookahead"]
