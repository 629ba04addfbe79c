"""The lookahead decoding loop, handed to ``model.generate(custom_generate=Lookahead(...))``.

transformers prepares the inputs, the logits processors and the stopping criteria, then calls
:meth:`Lookahead.__call__` with the same arguments as its own ``_sample`` loop. The call is a
thin loop over :class:`lookahead.engine.Engine`: it admits the whole batch (the prefill gives
each sequence its first token, as plain decoding does), then steps until every sequence has
finished; each step is one forward pass over t, the window and the candidates of every active
sequence (see ``lookahead.engine`` for the step itself).

A batch is handled as transformers handles it: left-padded prompts, sequences that stop are
padded after their stop (or, without an EOS criterion, decoded on until every one has stopped).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence

import torch
from transformers import StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from .assembly import make_chooser, make_drafter, new_sequence, settle
from .beams import beam_call
from .caches import caller_cache, fill_cache
from .config import LookaheadConfig, LookaheadStats
from .costs import CostCurve, curve_key
from .drafting import TreeDrafter
from .emission import Emitter
from .engine import Engine
from .media import MediaPrefill
from .output import assemble
from .sequences import SeqState
from .step import SYNCED_GPUS_REFUSED, prompt_rows, validate_call
from .support import ModelTraits, check_model

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
    One instance carries what its count drafter learnt (how often each kind of evidence matched,
    how probes fared) from one call to the next on the same model and settings: reuse it across
    prompts of a workload. Outputs never depend on it; in bf16, near-ties can, as on any change of
    step shapes. A new instance starts from the priors.
    With ``record_candidates=True``, ``last_candidates[b]`` maps each step of sequence b (by the
    tokens it had emitted when the step began) to the candidates it had at hand, for
    :func:`lookahead.bound.clairvoyant_bound`.
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
        count_drafting: bool = True,
        draft_length: int | None = None,
        adaptive: bool | None = None,
        cost_curve: CostCurve | Sequence[tuple[int, float]] | None = None,
        record_candidates: bool = False,
    ) -> None:
        self._overrides = {
            "window_size": window_size,
            "ngram_size": ngram_size,
            "max_candidates": max_candidates,
            "seed_pool_from_prompt": seed_pool_from_prompt,
            "pool_from_output": pool_from_output,
            "context_lookup": context_lookup,
            "token_tree": token_tree,
            "count_drafting": count_drafting,
            "draft_length": draft_length,  # None: the config's default
            # auto settings adapt; explicit W/N/G run exactly as asked unless adaptive=True
            "adaptive": adaptive if adaptive is not None else (window_size, ngram_size, max_candidates) == (None,) * 3,
        }
        LookaheadConfig.default_for("cpu", **self._overrides)  # validate now, not mid-generate
        # the forward cost by new tokens that adaptive steps are priced with; None: measured once
        # per architecture, device, dtype and thread count, then read from disk (lookahead.tuning)
        self.cost_curve = CostCurve.from_points(cost_curve) if cost_curve is not None else None
        self.last_stats: LookaheadStats | None = None
        self.last_beam_stats = None  # a beam search's (lookahead.beams.BeamStats); last_stats is then None
        # record_candidates: after each call, last_candidates[b] maps each step's output position
        # (tokens sequence b had emitted when it started) to the candidates it had at hand then
        self.record_candidates = record_candidates
        self.last_candidates: list[dict[int, list[tuple[int, ...]]]] | None = None
        # the count drafter of the last call, by (model's cost key, settings): the next call on the
        # same model starts from its observations (lookahead.drafting.TreeDrafter.carry_from)
        self._drafters: dict[tuple, TreeDrafter] = {}

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
        if kwargs.get("synced_gpus"):  # generate would not hand it to the callable
            raise ValueError(SYNCED_GPUS_REFUSED)
        tokenizer = kwargs.pop("tokenizer", None)
        config = kwargs.get("generation_config")
        if kwargs.get("token_healing") or getattr(config or model.generation_config, "token_healing", False):
            # generate does not hand a custom_generate callable's run the tokenizer it heals with
            raise ValueError(
                "token healing is not available through custom_generate (transformers keeps the tokenizer from "
                "it): heal the prompt first, input_ids = model.heal_tokens(input_ids, tokenizer), then generate "
                "without token_healing"
            )
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
        if (
            getattr(model.config, "is_encoder_decoder", False)
            and isinstance(source, torch.Tensor)
            and source.dim() == 2
            and not source.is_floating_point()  # token ids, not a speech model's features
        ):
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
        # 1. check the call, and narrow W/N/G to what the model takes
        spec = check_model(model)
        validate_call(input_ids, generation_config, synced_gpus, model_kwargs, streamer, logits_processor, model)
        cfg = settle(self.config_for(model.device), spec, self._overrides)
        if (generation_config.num_beams or 1) > 1:  # beam search, replayed over drafted beams
            call = {"input_ids": input_ids, "logits_processor": logits_processor, "streamer": streamer,
                    "stopping_criteria": stopping_criteria, "generation_config": generation_config}  # fmt: skip
            output, self.last_beam_stats = beam_call(model, spec, cfg, call, model_kwargs, source_ids)
            self.last_stats = None
            return output
        batch = input_ids.shape[0]
        source_ids = _source_rows(source_ids, batch)
        stats = LookaheadStats(config=cfg, accepted_hist=[0] * cfg.max_emitted, batch_size=batch)
        self.last_stats = stats
        emitter = _emitter_for(streamer, stopping_criteria, generation_config, batch)
        prompts = prompt_rows(input_ids, model_kwargs.get("attention_mask"), spec)
        target = caller_cache(model_kwargs, batch, spec)  # filled at the end, as plain generate fills it
        spec = _traits_for_batch(spec, prompts, input_ids, generation_config)
        stats.prompt_tokens = sum(len(p) for p in prompts)

        # 2. the sequences, the width chooser and the drafter, and the engine that steps them
        seqs = self._sequences(
            cfg, input_ids, prompts, source_ids, logits_processor, stopping_criteria, generation_config
        )
        chooser = make_chooser(model, cfg, spec, batch, self.cost_curve)
        drafter = self._carried_drafter(model, cfg, spec, batch, chooser.curve)
        want = generation_config.return_dict_in_generate
        engine = Engine(
            model,
            cfg,
            spec,
            chooser,
            emitter,
            stats,
            model_kwargs,
            keep_cache=(want or target is not None) and batch == 1,
            drafter=drafter,
            whole_batch=True,
        )

        # 3. the prefill gives each sequence its first token, then one engine step per forward pass
        engine.admit(seqs, prompts, MediaPrefill.from_call(model, input_ids, model_kwargs))
        start = time.perf_counter()
        while engine.active:
            engine.step()

        # 4. what generate returns, and the call's statistics
        return self._finish(engine, seqs, input_ids, generation_config, start, target, streamer)

    def _sequences(
        self,
        cfg: LookaheadConfig,
        input_ids: torch.LongTensor,  # [B, S]
        prompts: list[list[int]],
        source_ids: torch.LongTensor | None,  # [B, S_enc]
        logits_processor,
        stopping_criteria,
        generation_config,
    ) -> list[SeqState]:
        """One sequence per row of the batch, with the call's logits processors and stopping
        criteria and, when it samples, a seed of its own."""
        batch = input_ids.shape[0]
        seqs = [
            new_sequence(cfg, b, input_ids[b : b + 1], prompt, generation_config.max_length, source_ids=source_ids)
            for b, prompt in enumerate(prompts)
        ]
        for seq in seqs:
            seq.processors, seq.criteria, seq.batch_size = logits_processor, stopping_criteria, batch
            seq.trace = {} if self.record_candidates else None
        if generation_config.do_sample:
            # each sequence draws its tokens from Gumbel noise keyed by (its seed, position), one seed
            # per sequence from torch's global generator: its text is then a function of that seed and
            # its prompt alone, whatever the candidates, the step shapes, or what this instance's
            # drafter learnt on earlier calls (verify.position_noise)
            for seq, seed in zip(seqs, torch.randint(0, 2**63 - 1, (batch,)).tolist(), strict=True):
                seq.seed = seed
        return seqs

    def _carried_drafter(
        self, model, cfg: LookaheadConfig, spec: ModelTraits, batch: int, curve: CostCurve | None
    ) -> TreeDrafter | None:
        """The count drafter for this call (None where none applies), starting from what the last
        call's drafter learnt when that call ran the same model and settings."""
        drafter = make_drafter(cfg, spec, batch, curve)
        if drafter is not None:
            key = (curve_key(model), cfg, curve)
            if key in self._drafters:
                drafter.carry_from(self._drafters[key])
            self._drafters = {key: drafter}  # one kept: the model and settings of the latest call
        return drafter

    def _finish(self, engine: Engine, seqs: list[SeqState], input_ids, generation_config, start, target, streamer):
        """The output ids [B, T] (or generate's output object), once the call's statistics are
        recorded, the stream ended and the caller's cache filled."""
        emitter, stats, batch = engine.emitter, engine.stats, input_ids.shape[0]
        sequences = assemble(seqs, input_ids.shape[1], emitter.stop_ends_seq, generation_config._pad_token_tensor)
        # sequences padded after their stop did not generate the padding; those that ran on are cut to T
        stats.new_tokens = sum(min(seq.length, sequences.shape[1]) - input_ids.shape[1] for seq in seqs)
        planner = engine.drafter or engine.chooser
        stats.wide_steps = planner.wide_steps
        stats.settings = planner.summary()
        stats.decode_seconds = time.perf_counter() - start
        self.last_candidates = [seq.trace for seq in seqs] if self.record_candidates else None
        if streamer is not None:
            streamer.end()
        logger.debug("lookahead %s: %s", engine.cfg, stats.as_dict())
        if target is not None:
            fill_cache(target, engine.runner.cache)
        if not generation_config.return_dict_in_generate:
            return sequences
        # a batch's cache holds holes (see lookahead.runner) and finished sequences were dropped from it
        cache = target if target is not None else engine.runner.hand_back() if batch == 1 else None
        outputs = dict(
            sequences=sequences,
            scores=emitter.scores if generation_config.output_scores else None,
            logits=emitter.logits if generation_config.output_logits else None,
            cache=cache,
        )
        if engine.spec.encoder_decoder:
            return GenerateEncoderDecoderOutput(**outputs)
        return GenerateDecoderOnlyOutput(**outputs)


def _source_rows(source_ids: torch.LongTensor | None, batch: int) -> torch.LongTensor | None:
    """An encoder's input ids [B, S_enc], one row per sequence: generate expanded every input for
    ``num_return_sequences``, but not the source ids it did not see."""
    if source_ids is None or source_ids.shape[0] == batch:
        return source_ids
    if batch % source_ids.shape[0]:
        raise ValueError(f"source_ids has {source_ids.shape[0]} rows for a batch of {batch}")
    return source_ids.repeat_interleave(batch // source_ids.shape[0], dim=0)


def _emitter_for(streamer, stopping_criteria, generation_config, batch: int) -> Emitter:
    """What appends the call's tokens: streaming them, keeping scores and logits when generate
    returns them, and ending a sequence at its stop unless, as transformers does without an EOS
    criterion, a batch decodes on until every sequence has stopped."""
    want = generation_config.return_dict_in_generate
    has_eos = any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)
    return Emitter(
        streamer,
        want_scores=want and generation_config.output_scores,
        want_logits=want and generation_config.output_logits,
        stop_ends_seq=has_eos or batch == 1,
    )


def _traits_for_batch(spec: ModelTraits, prompts: list[list[int]], input_ids, generation_config) -> ModelTraits:
    """The model's traits as this call's batch meets them: a lone padded prompt never meets
    Phi-3's cache recompute; a batch whose RoPE would change mid-generation is refused."""
    batch = input_ids.shape[0]
    if batch == 1 and len(prompts[0]) < input_ids.shape[1]:
        # Phi-3's generate recomputes its cache where the text *with its padding* reaches refill_at:
        # with left padding, before the positions reach the threshold (a recompute under the same
        # short factors, which changes nothing) or never; the long factors key the new tokens only
        spec = dataclasses.replace(spec, refill_at=None)
    if batch > 1 and spec.rope_threshold is not None and generation_config.max_length > spec.rope_threshold:
        raise ValueError(
            f"this model's rotary embedding changes once a forward pass reaches position {spec.rope_threshold} "
            "(longrope or dynamic RoPE), and under lookahead decoding the sequences of a batch reach it at "
            "different steps, so the output would differ from plain generate: generate these sequences one "
            f"at a time, or keep max_length at most {spec.rope_threshold}"
        )
    return spec


__all__ = ["Lookahead"]
