"""The lookahead decoding loop, handed to ``model.generate(custom_generate=Lookahead(...))``.

transformers prepares the inputs, the logits processors and the stopping criteria, then calls
:meth:`Lookahead.__call__` with the same arguments as its own ``_sample`` loop. The loop:

1. prefill the prompt as plain decoding does; its last row gives the first token t (the cache
   never holds t);
2. each step, one forward pass over t, the lookahead window and up to G pooled candidates;
3. verify the candidates greedily: accepted tokens plus the bonus token (1 to N tokens);
4. emit them one by one through the stopping criteria and the streamer;
5. keep in the cache exactly the committed tokens; update the window and the pool.
"""

from __future__ import annotations

import copy
import functools
import logging
import time

import torch
from transformers import DynamicCache, StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .config import LookaheadConfig, LookaheadStats
from .gate import StepGate
from .layout import build_layout
from .pool import NGramPool
from .step import Scorer, forward_step, keep_committed, prefill, prompt_tokens, validate_call
from .support import check_model
from .verify import verify_greedy, verify_sampling
from .window import JacobiWindow

logger = logging.getLogger(__name__)


class Lookahead:
    """Lossless lookahead decoding as a ``custom_generate`` callable.

    >>> out = model.generate(**inputs, custom_generate=Lookahead(), max_new_tokens=64)

    ``Lookahead()`` picks W, N and G for the model's device and, during each call, falls back to
    one-token steps while wide steps do not pay (``adaptive``); pass W, N or G to override.
    Invalid values raise ``ValueError`` at construction. After each call, ``last_stats`` holds
    a :class:`LookaheadStats` (steps, tokens per step, accepted-length histogram, time).
    """

    def __init__(
        self,
        window_size: int | None = None,
        ngram_size: int | None = None,
        max_candidates: int | None = None,
        *,
        seed_pool_from_prompt: bool = True,
        pool_from_output: bool = True,
        adaptive: bool | None = None,
    ) -> None:
        self._overrides = {
            "window_size": window_size,
            "ngram_size": ngram_size,
            "max_candidates": max_candidates,
            "seed_pool_from_prompt": seed_pool_from_prompt,
            "pool_from_output": pool_from_output,
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
        does not hand on to a ``custom_generate`` callable: ``streamer``, and ``stop_strings``
        with their ``tokenizer``. Use this method whenever you stream or stop on strings.
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
        loop = functools.partial(self, streamer=streamer) if streamer is not None else self
        return model.generate(inputs, custom_generate=loop, **kwargs)

    @torch.no_grad()
    def __call__(
        self,
        model,
        input_ids: torch.LongTensor,  # [1, S]
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus: bool = False,
        streamer=None,
        **model_kwargs,
    ):
        spec = check_model(model)
        validate_call(input_ids, generation_config, synced_gpus, model_kwargs)
        cfg = self.config_for(model.device)
        stats = LookaheadStats(config=cfg, accepted_hist=[0] * cfg.ngram_size)
        self.last_stats = stats
        want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
        want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
        scores: tuple = ()
        raw_logits: tuple = ()

        # committed: the prompt without left padding, then every emitted token (python ints)
        committed = prompt_tokens(input_ids, model_kwargs.get("attention_mask"), spec)
        n_prompt = stats.prompt_tokens = len(committed)
        cache = DynamicCache()
        pool = NGramPool(cfg.ngram_size, max(1, cfg.max_candidates))
        if cfg.seed_pool_from_prompt:
            pool.add_sequence(committed)
        window = JacobiWindow(cfg.window_size, cfg.ngram_size, committed)
        gate = StepGate(enabled=cfg.adaptive)
        n, max_length = cfg.ngram_size, generation_config.max_length

        def emit(tokens, rows, scorer) -> tuple[int, bool]:
            """Append tokens one by one, as plain decoding would, until a stop.
            Returns (tokens kept, whether generation stopped)."""
            nonlocal input_ids, scores, raw_logits
            for count, (token, row) in enumerate(zip(tokens, rows, strict=True), start=1):
                if want_scores:
                    scores += (scorer.processed(row)[None],)
                if want_logits:
                    raw_logits += (scorer.raw(row)[None],)
                input_ids = torch.cat([input_ids, input_ids.new_tensor([[token]])], dim=-1)
                committed.append(token)
                if streamer is not None:
                    streamer.put(input_ids.new_tensor([token]).cpu())
                if bool(stopping_criteria(input_ids, scores if want_scores else None).any()):
                    return count, True
            return len(tokens), False

        # 1. prefill the prompt; its last row gives the first token, exactly as in plain decoding
        start = time.perf_counter()
        first = Scorer(prefill(model, spec, committed, cache, input_ids.device), None, logits_processor, input_ids, [])
        token = first.sample(0) if generation_config.do_sample else first.choice(0)
        stats.prefill_seconds = time.perf_counter() - start
        start = time.perf_counter()
        finished = emit([token], [0], first)[1]
        stats.steps, stats.accepted_hist[0] = 1, 1
        if cfg.pool_from_output:
            pool.add_sequence(committed, start=len(committed) - n)

        while not finished:
            # 2. lay out and run one step (t alone when the gate finds wide steps do not pay)
            wide = gate.wide()
            step_start = time.perf_counter()
            t, past = committed[-1], len(committed) - 1
            remaining = max_length - input_ids.shape[1]  # tokens this call may still emit
            cand_len = min(n - 1, remaining - 1)
            if spec.max_positions is not None:
                cand_len = min(cand_len, spec.max_positions - 1 - past)
            candidates = [c[:cand_len] for c in pool.candidates(t, cfg.max_candidates)] if wide and cand_len > 0 else []
            n_levels = window.n_levels if wide else 0
            if spec.max_positions is not None and past + n_levels + cfg.window_size - 1 > spec.max_positions:
                n_levels = 0  # the window would run past the position table: skip it this step
            layout = build_layout(1, cfg.window_size, n_levels, len(candidates), cand_len)
            step_ids = [t, *(window.tokens() if n_levels else []), *(x for c in candidates for x in c)]
            logits = forward_step(model, spec, layout, step_ids, past, cache)  # [K, V]
            scorer = Scorer(logits, layout, logits_processor, input_ids, candidates)

            # 3. verify: greedy, or sampling that keeps the processed distribution exactly
            if generation_config.do_sample:
                verdict = verify_sampling(candidates, scorer.distribution)
            else:
                verdict = verify_greedy(scorer.choice(layout.t_row), candidates, scorer.candidate_choice)
            emitted_rows = [layout.t_row, *(layout.candidate_rows[k][j] for k, j in verdict.path)]
            gate.record(layout.length > 1, time.perf_counter() - step_start, len(verdict.emitted))

            # 4. emit token by token through the stopping criteria and the streamer
            kept, finished = emit(verdict.emitted, emitted_rows, scorer)

            # 5. commit: cache, window, pool, statistics
            keep_committed(cache, past, layout, verdict.candidate, kept)
            if n_levels:
                for ngram in window.update(t, [scorer.raw_choice(r) for r in layout.last_level_rows]):
                    pool.add(ngram)
            if cfg.pool_from_output:
                pool.add_sequence(committed, start=len(committed) - kept - n + 1)
            stats.steps += 1
            stats.accepted_hist[len(verdict.emitted) - 1] += 1
            stats.truncated_tokens += len(verdict.emitted) - kept

        stats.new_tokens = len(committed) - n_prompt
        stats.wide_steps = gate.wide_steps
        stats.decode_seconds = time.perf_counter() - start
        if streamer is not None:
            streamer.end()
        logger.debug("lookahead %s: %s", cfg, stats.as_dict())
        if not generation_config.return_dict_in_generate:
            return input_ids
        return GenerateDecoderOnlyOutput(
            sequences=input_ids,
            scores=scores if want_scores else None,
            logits=raw_logits if want_logits else None,
            cache=cache,
        )


__all__ = ["Lookahead"]
