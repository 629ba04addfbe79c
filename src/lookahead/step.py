"""A call's inputs checked (``validate_call``), its prompts read (``prompt_rows``), and a step's
slots scored (``Scorer``: greedy choices and draws, through each sequence's logits processors)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .caches import check_cache_implementation
from .choices import StepChoices
from .layout import StepLayout
from .media import IMAGE_INPUTS, check_media_inputs, takes_images
from .support import ModelTraits

# logits processors that cannot run on a step's expanded rows: they call a model, keep state
# across calls, or expect the batch doubled (name -> why)
_STATEFUL_PROCESSORS = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "it runs the model itself on the unconditional prompt",
    "ClassifierFreeGuidanceLogitsProcessor": "it expects the batch doubled with unconditional rows",
    "DiaClassifierFreeGuidanceLogitsProcessor": "it expects the batch doubled with unconditional rows",
    "DiaEOSDelayPatternLogitsProcessor": "it keeps state from one call to the next",
    "WhisperTimeStampLogitsProcessor": "it keeps state from one call to the next",
    "WhisperNoSpeechDetection": "it runs the model itself and keeps state",
    "SynthIDTextWatermarkLogitsProcessor": "it keeps each row's context from one call to the next",
}


# model inputs the loop handles itself (the masks, positions and cache of every step), or that
# change nothing about the output; anything else would never reach the model, so it is refused
_HANDLED_INPUTS = {
    "attention_mask",  # read for left padding; the loop builds each step's mask
    "position_ids",  # checked to be the standard ones (_check_position_ids); the loop builds its own
    "cache_position",
    "cache",  # must be empty (caller_cache); the loop keeps its own, and fills a caller's at the end
    "past_key_values",
    "use_cache",
    "logits_to_keep",  # the loop keeps the logits of the slots it uses
    "encoder_outputs",  # encoder-decoder models: run once by transformers, used by every step
    "return_dict",
    "output_attentions",  # refused below when asked for in the output
    "output_hidden_states",
    "inputs_embeds",  # refused below with its own message
    "labels",  # a processor's (PaliGemma's); generate never passes them to the model either
}


def _check_position_ids(model_kwargs) -> None:
    """Custom position_ids would be ignored: accept only the standard ones (0.. over each
    sequence's real tokens, as transformers derives them from the attention mask)."""
    given = model_kwargs.get("position_ids")
    if given is None:
        return
    if given.dim() == 3:  # M-RoPE's (a VLM's generate made them): the text positions come first
        given = given[0]
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones(given.shape, dtype=torch.long, device=given.device)
    standard = (mask.long().cumsum(-1) - 1).clamp_min(0)
    real = mask.bool()
    if given.shape != mask.shape or not bool((given[real] == standard[real]).all()):
        raise ValueError(
            "lookahead decoding numbers each sequence's tokens 0, 1, ... itself and cannot take custom "
            "position_ids: drop them"
        )


SYNCED_GPUS_REFUSED = "lookahead decoding does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP)"


def _sharded_across_processes(model) -> bool:
    """What transformers' generate takes as ``synced_gpus`` when not told (DeepSpeed ZeRO-3 or FSDP
    over several processes): a ``custom_generate`` callable is not handed that flag."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    if torch.distributed.get_world_size() < 2:
        return False
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    return bool(is_deepspeed_zero3_enabled() or (model is not None and is_fsdp_managed_module(model)))


def validate_call(
    input_ids, generation_config, synced_gpus, model_kwargs, streamer=None, processors=(), model=None
) -> None:
    """Refuse, before any decoding, what this loop cannot do exactly."""
    for processor in processors or ():
        why = _STATEFUL_PROCESSORS.get(type(processor).__name__)
        if why is not None:
            raise ValueError(
                f"{type(processor).__name__} cannot run under lookahead decoding ({why}, while a step "
                "scores several positions at once): use plain generate for it"
            )
    if model_kwargs.get("inputs_embeds") is not None:  # transformers then passes empty input_ids
        raise ValueError("lookahead decoding needs input_ids, not inputs_embeds")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token (e.g. the BOS token)")
    if generation_config.penalty_alpha is not None or generation_config.dola_layers is not None:
        # with a custom_generate callable transformers no longer dispatches these itself
        raise ValueError(
            "contrastive search (penalty_alpha) and DoLa (dola_layers) are decoding methods of their own: "
            "use plain generate for them, or drop them for lookahead decoding"
        )
    if input_ids.shape[0] > 1 and (generation_config.num_beams or 1) == 1:  # beams advance together
        if streamer is not None:
            raise ValueError("streamers take one sequence: stream a batch of 1, or drop the streamer")
        if generation_config.return_dict_in_generate and (
            generation_config.output_scores or generation_config.output_logits
        ):
            raise ValueError(
                "output_scores / output_logits are available for a batch of 1 only: rows of a batch "
                "advance unevenly under lookahead decoding, so there is no per-step score tensor"
            )
    if synced_gpus or _sharded_across_processes(model):
        raise ValueError(SYNCED_GPUS_REFUSED)
    if generation_config.return_dict_in_generate and (
        generation_config.output_attentions or generation_config.output_hidden_states
    ):
        raise ValueError(
            "output_attentions and output_hidden_states are not available with lookahead decoding: "
            "a step's forward pass mixes the emitted tokens with window and candidate rows"
        )
    check_media_inputs(model, model_kwargs)
    handled = _HANDLED_INPUTS | IMAGE_INPUTS if takes_images(model) else _HANDLED_INPUTS
    unknown = sorted(k for k, v in model_kwargs.items() if v is not None and k not in handled)
    if unknown:
        raise ValueError(
            f"lookahead decoding does not pass {', '.join(unknown)} to the model (it builds each step's "
            "inputs itself), so the output would be wrong: generate without them, or with plain generate"
        )
    _check_position_ids(model_kwargs)
    check_cache_implementation(generation_config, model)


def prompt_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, spec: ModelTraits) -> list[list[int]]:
    """Each sequence's prompt without its left padding, checked against the model's position limit.

    For encoder-decoder models ``input_ids`` are the decoder's start tokens and are kept whole.
    """
    rows = []
    for b, tokens in enumerate(input_ids.tolist()):
        if attention_mask is not None and not spec.encoder_decoder:
            keep = attention_mask[b].tolist()
            first = keep.index(1) if 1 in keep else len(keep)
            if any(k == 0 for k in keep[first:]):
                raise ValueError(
                    f"sequence {b} of the attention_mask has padding after its first real token: decoder-only "
                    "models need left padding (tokenizer.padding_side = 'left')"
                )
            tokens = tokens[first:]
        if not tokens:
            raise ValueError(f"the prompt of sequence {b} is empty once its padding is removed")
        if spec.position_table is not None and len(tokens) > spec.position_table:
            raise ValueError(
                f"the prompt of sequence {b} has {len(tokens)} tokens but the model takes at most "
                f"{spec.position_table} positions: shorten the prompt"
            )
        rows.append(tokens)
    return rows


class Scorer:
    """The model's choices on one step's slots, raw (for the window) and processed (for output).

    ``logits`` holds only the kept slots ([K, V], in ``layout.logit_slots`` order; without a layout,
    slot k is logits[k], as for the prefill's one slot); or, with ``sequence`` given, it is the
    step's [B, K, V] and this sequence's rows are taken when first read. Logits processors see, for
    a candidate slot, the prefix extended with that candidate's tokens up to and including the
    slot's own token, as plain decoding would have shown them. ``input_ids`` [1, S] may be a
    function that returns them: a greedy step without processors never builds them.
    """

    def __init__(
        self,
        logits,
        layout: StepLayout | None,
        processors,
        input_ids,
        candidates: Sequence[Sequence[int]],
        batch: tuple[int, int] = (0, 1),
        choices=None,
        sequence: int | None = None,
    ):
        self._logits, self._sequence = logits, sequence
        self.layout = layout
        self.processors = processors if processors is not None and len(processors) > 0 else None
        self._input_ids = input_ids
        # (sequence index, batch size): processors built for a batch (e.g. repetition_penalty's
        # per-sequence prompt length) see this sequence at its own index, in a batch of copies of it
        self.batch = batch
        self.candidates = candidates
        # the raw greedy choice at each kept slot, indexed by kept slot (``StepChoices.sequence``)
        self._argmax = choices if choices is not None else StepChoices(self.logits[None]).sequence(0)
        self._processed: dict[int, torch.Tensor] = {}

    @property
    def logits(self) -> torch.Tensor:  # [K, V]
        if self._sequence is not None:
            self._logits, self._sequence = self._logits[self._sequence], None
        return self._logits

    @property
    def input_ids(self) -> torch.Tensor:  # [1, S]
        if callable(self._input_ids):
            self._input_ids = self._input_ids()
        return self._input_ids

    def _index(self, slot: int) -> int:
        return slot if self.layout is None else self.layout.logit_index[slot]

    def raw(self, slot: int) -> torch.Tensor:  # [V] float32
        return self.logits[self._index(slot)].float()

    def raw_choice(self, slot: int) -> int:
        return self._argmax[self._index(slot)]

    def processed(self, slot: int) -> torch.Tensor:  # [V] float32
        if self.processors is None:
            return self.raw(slot)
        if slot not in self._processed:
            prefix = self.input_ids
            where = None if self.layout is None else self.layout.candidate_position.get(slot)
            if where is not None:
                k, j = where
                extra = self.input_ids.new_tensor([self.candidates[k][: j + 1]])
                prefix = torch.cat([prefix, extra], dim=-1)
            index, size = self.batch
            scores = self.raw(slot)[None].expand(size, -1).clone()
            self._processed[slot] = self.processors(prefix.expand(size, -1), scores)[index]
        return self._processed[slot]

    def seeded_choice(self, slot: int, noise: torch.Tensor) -> int:
        """A draw from ``slot``'s processed distribution with the given Gumbel noise [V]
        (see ``verify.position_noise``)."""
        return int((self.processed(slot).double() + noise.to(self.logits.device)).argmax())

    def choice(self, slot: int) -> int:
        if self.processors is None:
            return self.raw_choice(slot)
        return int(self.processed(slot).argmax())

    def raw_candidate_choice(self, k: int, j: int) -> int:
        return self.raw_choice(self.layout.candidate_slots[k][j])

    def candidate_choice(self, k: int, j: int) -> int:
        return self.choice(self.layout.candidate_slots[k][j])
