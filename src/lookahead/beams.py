"""Beam search with lookahead: the beams of ``generate(num_beams=k)``, in fewer forward passes.

Each step, every running beam drafts a few continuations (:mod:`lookahead.beam_drafts`), and one
forward pass scores them all: beam ``i``'s row holds its last token ``t_i`` and its draft chains,
so the pass gives the next-token logits after ``t_i`` and after every drafted prefix. Beam search
is then **replayed** depth by depth over those logits with :class:`lookahead.beam_state.BeamState`,
the very bookkeeping plain beam search does, and the step ends at the first depth where a running
beam is not a drafted path (its next logits were not computed) or the search is over.

Why the replay gives plain beam search's choices exactly. A depth of beam search is a function of
the running beams' texts, their scores and the logits after each of them, nothing else (the top
``2k``, the stopping criteria, the finished set: ``BeamState.advance``). At depth 1 the logits are
those after each ``t_i``, which any pass computes. The replay reaches depth ``d + 1`` only when
every running beam after depth ``d`` is ``t_i`` followed by a drafted prefix ``p`` of beam ``i``'s
draft; the pass computed the logits after exactly that text (the draft's slots see the cache of
beam ``i``, ``t_i`` and ``p``, as the layout's mask says), so depth ``d + 1`` gets the same inputs
as in plain beam search. A worked example, k = 2, beam 0 = "... the", beam 1 = "... a", each
drafting one chain of two tokens::

    beam 0 drafts "cat sat", beam 1 drafts "dog ran"
    depth 1 (logits after "the", "a"):    picks "the cat" and "the dog"
        "the cat" is beam 0 + drafted "cat"  -> its next logits were computed
        "the dog" is beam 0 + "dog": beam 0 drafted no "dog"  -> stop here
    the step advanced one depth: beam 0's row is copied into both rows (the cache of "the"), and
    the next step starts from "cat" and "dog"

    had depth 1 picked "the cat" and "a dog": both drafted; depth 2 reads the logits after
    "the cat" (beam 0's slot of "cat") and "a dog" (beam 1's slot of "dog"), and so on.

After ``D`` depths each running beam is some ``t_i`` plus a drafted path of ``D - 1`` tokens plus
one new token: its row is a copy of row ``i`` that keeps ``t_i`` and the path's cache entries
(``D`` columns, every row alike) and feeds the new token next step, as ``_reorder_cache`` plus ``D``
one-token steps would leave it.

Drafting costs slots: a step whose rows carry ``1 + G * L`` tokens costs more than a plain one,
by the batch's measured cost curve (``BatchCosts``). :class:`DraftPricing` chooses each step how
deep to draft, ``L`` from 1 to ``N - 1``, for the most depths per cost, and runs a plain one-token
step where no length pays, probing now and then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .beam_drafts import BeamDrafter
from .beam_state import BeamState
from .layout import StepLayout, build_layout
from .media import MediaPrefill

# logits processors that map log-probabilities <= 0 to values <= 0 (they mask tokens, or scale a
# negative score by a positive factor): with only these, a beam's continuations never score above
# the beam itself, which is what lets a depth leave out beams that were not drafted
_KEEP_AT_MOST_ZERO = {
    "NoRepeatNGramLogitsProcessor", "EncoderNoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor",
    "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor", "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor",
    "RepetitionPenaltyLogitsProcessor", "EncoderRepetitionPenaltyLogitsProcessor",
    "PrefixConstrainedLogitsProcessor", "LogitNormalization",
}  # fmt: skip
HINTS = 2  # a beam's likeliest next tokens drafted first, where the last pass computed them
PROBE_EVERY = 8  # plain steps at least between drafted probes while drafting does not pay
PROBE_SHARE = 0.05  # losing probes cost at most this share of a call: a dear probe waits longer
MARGIN = 1.05  # drafting must beat its cost by this much
DECAY = 0.9  # the weight of what a drafted step saw, one drafted step later


@dataclass
class BeamStats:
    """What one beam-search call did: forward passes after the prefill, depths advanced (new
    tokens per beam, the prefill's first one included), how many steps drafted, and the steps by
    the depths each advanced."""

    steps: int = 0
    depths: int = 0
    drafted_steps: int = 0
    depth_hist: dict[int, int] = field(default_factory=dict)


class DraftPricing:
    """Whether the next step drafts, and how deep. ``went[s][d - 1] / tried[s][d - 1]`` estimates
    how often a step whose chains reach past depth ``d`` goes on from depth ``d`` to ``d + 1``
    (every running beam a drafted path), from the drafted steps seen (decayed counts, an even
    chance until seen), apart for steps right after one that gained more than a depth by drafting
    (``s`` True) and the others: a drafted step that gains makes the next one likelier to gain
    (over 12 HumanEval prompts with SmolLM2, one token deep: 51% after a gain, 39% after none;
    over 8 of MT-bench's, 42% and 23%). A step drafting ``L`` tokens deep then advances ``1 + q1 + q1 q2 + ...`` depths
    (``expected_depth``) for ``ratio(tokens per row)`` plain steps' cost: the length that gains
    most per cost is drafted when it beats a plain step (one depth for one) by ``MARGIN``.

    While no length does, a drafted probe of the best one runs after ``PROBE_EVERY`` plain steps,
    or more: at least ``(ratio - 1) / PROBE_SHARE``, so that a probe that gains nothing costs at
    most ``PROBE_SHARE`` of the steps around it (where a drafted step costs 5 plain ones, as bf16
    on a CPU without AVX-512, 80). A length that would not pay even right after a gain, where
    steps gain most, is never probed. What a probe sees updates the estimates: beams that fork at
    every token at first often settle into text that drafts well later in the same call."""

    def __init__(self, ratio: Callable[[int], float], longest: int) -> None:
        self.ratio = ratio
        # per state (did the last step gain more than one depth by drafting?): the counts by depth
        self.went = {state: [1.0] * longest for state in (False, True)}
        self.tried = {state: [2.0] * longest for state in (False, True)}
        self.after_gain = False
        self.plain_run = 0

    def expected_depth(self, length: int, after_gain: bool | None = None) -> float:
        """The depths a step drafting ``length`` deep is expected to advance, from now (or right
        after a step that gained, or not, as ``after_gain`` says)."""
        state = self.after_gain if after_gain is None else after_gain
        went, tried = self.went[state], self.tried[state]
        depth = reach = 1.0
        for d in range(length):
            reach *= went[d] / tried[d]
            depth += reach
        return depth

    def length(self, most: int, row_tokens: Callable[[int], int]) -> int:
        """The chain length the next step drafts, at most ``most`` (0: a plain step);
        ``row_tokens(length)``: the tokens per row of a step drafting that deep."""
        cost = {n: self.ratio(row_tokens(n)) for n in range(1, most + 1)}
        value = {n: self.expected_depth(n) / cost[n] for n in cost}
        best = max(value, key=value.__getitem__, default=0)
        if best and value[best] >= MARGIN:
            return best
        # a probe now and then, of a length that would pay in a run of gains
        hopeful = [n for n in cost if self.expected_depth(n, after_gain=True) / cost[n] >= MARGIN]
        self.plain_run += 1
        if hopeful:
            best = max(hopeful, key=value.__getitem__)
            if self.plain_run >= max(PROBE_EVERY, (cost[best] - 1) / PROBE_SHARE):
                self.plain_run = 0
                return best
        return 0

    def plain_step(self) -> None:
        """A step ran plain: the next one does not follow a gain."""
        self.after_gain = False

    def record(self, length: int, depth: int) -> None:
        """A step drafted ``length`` deep advanced ``depth`` depths."""
        went, tried = self.went[self.after_gain], self.tried[self.after_gain]
        for d in range(len(went)):
            went[d] *= DECAY
            tried[d] *= DECAY
        for d in range(min(length, depth)):  # it stood at depth d + 1 with chains reaching past it
            tried[d] += 1
            went[d] += depth > d + 1
        self.after_gain = depth > 1


@dataclass(frozen=True)
class _Plan:
    layout: StepLayout
    drafts: list[list[tuple[int, ...]]]  # per row: its real chains (shorter than the layout's, or fewer)


def _row_candidates(drafter: BeamDrafter, item: int, text: list[int], hints: Sequence[int], limit: int, length: int):
    """One beam's candidate chains, in order of trust, ``length`` tokens at most: first one per
    hinted next token (the likeliest after its last token, where the last pass computed them), each
    continued by what followed that text before; then up to ``limit`` of what followed its text
    before."""
    found = []
    for token in hints:
        after = drafter.drafts(item, [*text, token], 1)
        found.append(((token,) + (after[0] if after else ()))[:length])
    return found + drafter.drafts(item, text, limit)


def _candidates(state: BeamState, drafter: BeamDrafter, hints, chains: int, length: int) -> list[list[tuple[int, ...]]]:
    """Each running beam's candidate chains (:func:`_row_candidates`), looked up once per step."""
    return [
        _row_candidates(drafter, row // state.num_beams, text, hints[row], 2 * chains, length)
        for row, text in enumerate(state.texts().tolist())
    ]


def _cut(candidates: Sequence[Sequence[tuple[int, ...]]], chains: int, length: int) -> list[list[tuple[int, ...]]]:
    """Per beam, its first ``chains`` distinct candidates once cut to ``length`` tokens."""
    return [list(dict.fromkeys(c[:length] for c in row))[:chains] for row in candidates]


def _plan(drafts: list[list[tuple[int, ...]]], length: int) -> _Plan:
    """The step's layout for these chains of up to ``length`` tokens (as wide as the widest beam's)."""
    width = max((len(d) for d in drafts), default=0)
    return _Plan(build_layout(1, 0, 0, width, length if width else 0), drafts)


def _step_ids(plan: _Plan, last: Sequence[int]) -> list[list[int]]:
    """Each row's inputs: t, then its chains padded to the layout's (filler slots are never read)."""
    slots = plan.layout.candidate_slots
    n, length = len(slots), len(slots[0]) if slots else 0
    rows = []
    for t, drafts in zip(last, plan.drafts, strict=True):
        chains = [list(d) + [t] * (length - len(d)) for d in drafts]
        chains += [[t] * length] * (n - len(chains))
        rows.append([t] + [token for chain in chains for token in chain])
    return rows


def _chain_of(drafts: Sequence[tuple[int, ...]], path: tuple[int, ...]) -> int | None:
    """The first chain that starts with ``path``, or None."""
    for k, chain in enumerate(drafts):
        if chain[: len(path)] == path:
            return k
    return None


def _hints(plan: _Plan, logits: torch.Tensor, origins, paths, n: int) -> list[list[int]]:
    """Per running beam, its ``n`` likeliest next tokens where the pass computed the logits after
    its text (its whole path was drafted), else none: the next step drafts them first, so that
    beams that fork there are drafted too."""
    layout, hints = plan.layout, []
    for o, path in zip(origins, paths, strict=True):
        k = _chain_of(plan.drafts[o], path)
        if k is None:
            hints.append([])
            continue
        slot = layout.logit_index[layout.candidate_slots[k][len(path) - 1]]
        hints.append(torch.topk(logits[o, slot], n).indices.tolist())
    return hints


def _picks(plan: _Plan, origins: Sequence[int], paths: Sequence[tuple[int, ...]]) -> list:
    """Each running beam's commit: the chain holding its drafted tokens (all but its last) and how
    many entries its row keeps (t and those tokens)."""
    return [
        (_chain_of(plan.drafts[o], path[:-1]) if len(path) > 1 else None, len(path))
        for o, path in zip(origins, paths, strict=True)
    ]


def replay(
    state: BeamState, logits: torch.Tensor, plan: _Plan, advance: Callable, prune: bool = False
) -> tuple[list[int], list]:
    """Beam search, depth by depth, over one pass's ``logits`` [R, K, V] (see the module
    docstring) -> (each running beam's row of origin, its commit pick (chain or None, kept)).
    ``advance(logits [R, V], unknown)`` moves ``state`` one depth, or returns False. ``prune``:
    a depth may go on with beams that were not drafted where none of them can matter
    (``BeamState._prune``)."""
    layout = plan.layout
    t_index = layout.logit_index[layout.t_slot]
    origins, paths = list(range(logits.shape[0])), [()] * logits.shape[0]
    rows_logits, unknown = logits[:, t_index], []
    while advance(rows_logits, unknown):
        parents, tokens = state.parents(), state.last_tokens()
        origins = [origins[p] for p in parents]
        paths = [paths[p] + (token,) for p, token in zip(parents, tokens, strict=True)]
        chains = [_chain_of(plan.drafts[o], path) for o, path in zip(origins, paths, strict=True)]
        unknown = [j for j, k in enumerate(chains) if k is None]
        if state.done or len(unknown) == len(chains) or (unknown and not prune):
            break
        slots = [
            t_index if k is None else layout.logit_index[layout.candidate_slots[k][len(p) - 1]]
            for k, p in zip(chains, paths, strict=True)
        ]
        rows_logits = logits[torch.tensor(origins), torch.tensor(slots)]
    return origins, paths, _picks(plan, origins, paths)


@dataclass(frozen=True)
class BeamSettings:
    """How wide the drafts are: up to ``chains`` chains of ``length`` tokens per beam
    (encoder-decoder models: one chain, their steps are linear), and what a step of a given number
    of tokens per row costs relative to a plain one (None: always draft)."""

    chains: int
    length: int
    ratio: Callable[[int], float] | None = None


def keeps_scores_at_most_zero(processors) -> bool:
    return all(type(p).__name__ in _KEEP_AT_MOST_ZERO for p in processors or ())


def _fill_value(generation_config) -> int:
    """What plain beam search fills unwritten positions with (the pad token, else the first EOS),
    read the way ``generate`` reads it."""
    pad = getattr(generation_config, "_pad_token_tensor", None)
    eos = getattr(generation_config, "_eos_token_tensor", None)
    if eos is None:
        return -1
    return int(pad or eos[0])


def _eos_count(generation_config) -> int:
    eos = getattr(generation_config, "_eos_token_tensor", None)
    return 0 if eos is None else int(eos.shape[0])


class BeamSearch:
    """One ``generate(num_beams=k)`` call over a prefilled ``runner`` (see the module docstring)."""

    def __init__(self, runner, input_ids, processors, stopping_criteria, generation_config, settings: BeamSettings):
        self.runner, self.settings = runner, settings
        self.processors, self.stopping = processors, stopping_criteria
        self.state = BeamState(
            input_ids, generation_config, _eos_count(generation_config), _fill_value(generation_config)
        )
        want = generation_config.return_dict_in_generate
        self.record = {"scores": [], "logits": [], "output_scores": bool(want and generation_config.output_scores)}
        self.pricing = DraftPricing(settings.ratio or (lambda tokens: 1.0), settings.length)
        self.stats = BeamStats()
        self.drafter = BeamDrafter(self.state.batch, max(1, settings.length))
        self.hints: list[list[int]] = [[] for _ in range(self.state.batch * self.state.num_beams)]
        recorded = want and (generation_config.output_scores or generation_config.output_logits)
        self.prune = not recorded and not self.state.do_sample and keeps_scores_at_most_zero(processors)

    def advance(self, logits: torch.Tensor, unknown=()) -> bool:
        return self.state.advance(logits, self.processors, self.stopping, self.record, unknown)

    def run(self, prompts: Sequence[Sequence[int]], sources: Sequence[Sequence[int]] = (), media=None) -> None:
        """Prefill, then steps until beam search is over. ``sources``: per item, more text to draft
        from (an encoder-decoder model's input); ``media``: a VLM's prefill."""
        self.advance(prefill(self.runner, prompts, self.state.num_beams, media))
        self.runner.reorder(self.state.parents())
        self.stats.depths = 1
        for item in range(self.state.batch):
            self.drafter.feed(item, prompts[item * self.state.num_beams])
            if sources:
                self.drafter.feed(item, sources[item])
        while not self.state.done:
            self.step()

    def _chain_length(self) -> int:
        room = self.state.max_length - self.state.cur_len - 1  # the last depth needs no draft after it
        return max(0, min(self.settings.length, room))

    def step(self) -> None:
        length, drafts = self._chosen_drafts()
        rows = self.state.batch * self.state.num_beams
        plan = _plan(drafts, length) if length else _Plan(build_layout(1, 0, 0), [[]] * rows)
        before = self.state.cur_len
        logits = self.runner.step(plan.layout, _step_ids(plan, self.state.last_tokens()))
        origins, paths, picks = replay(self.state, logits, plan, self.advance, self.prune)
        self.hints = _hints(plan, logits, origins, paths, HINTS)
        self.runner.reorder(origins)
        self.runner.commit(plan.layout, picks)
        self._learn(self.state.cur_len - before, length if plan.layout.candidate_slots else 0)

    def _chosen_drafts(self) -> tuple[int, list[list[tuple[int, ...]]]]:
        """How deep this step drafts, as the pricing chooses among the chain lengths that fit, and
        each beam's chains at that length (0, none: a plain step)."""
        most, chains = self._chain_length(), self.settings.chains
        if not most or not chains:
            return 0, []
        found = _candidates(self.state, self.drafter, self.hints, chains, most)
        by_length = {n: _cut(found, chains, n) for n in range(1, most + 1)}
        if not any(by_length[1]):
            return 0, []
        if self.settings.ratio is None:  # W/N/G as asked: every step drafts the longest chains
            return most, by_length[most]
        length = self.pricing.length(most, lambda n: 1 + n * max(map(len, by_length[n])))
        return length, by_length.get(length, [])

    def _learn(self, depth: int, drafted: int) -> None:
        """Feed the beams' new text to the drafter and count the step; ``drafted``: how deep it
        drafted (0: plain)."""
        texts = self.state.texts().tolist()
        for row, text in enumerate(texts):
            self.drafter.feed(row // self.state.num_beams, text, start=len(text) - depth - self.drafter.length - 1)
        stats = self.stats
        stats.steps += 1
        stats.depths += depth
        stats.depth_hist[depth] = stats.depth_hist.get(depth, 0) + 1
        if drafted:
            stats.drafted_steps += 1
            self.pricing.record(drafted, depth)
        else:
            self.pricing.plain_step()


def prefill(runner, prompts: Sequence[Sequence[int]], k: int, media=None) -> torch.Tensor:
    """Every beam's prompt in the cache -> the last logits [B * k, V]. The k beams of a prompt
    start as copies of it (``prompts`` holds each k times, as ``generate`` expands them), and
    transformers' beam search prefills all k. A decoder-only runner prefills each prompt once and
    copies its keys and values into the other k - 1 rows: the same entries, for a k-th of the
    prefill's work (an encoder-decoder model's decoder prompt is one token; a VLM's prefill runs
    as its ``generate`` runs it)."""
    firsts = list(prompts[::k])
    shared = k > 1 and media is None and runner.grows_by_reorder
    if not shared or any(list(p) != list(firsts[row // k]) for row, p in enumerate(prompts)):
        return runner.prefill(prompts, media)
    logits = runner.prefill(firsts)  # [B, V]
    runner.reorder([row // k for row in range(len(prompts))])
    return logits.repeat_interleave(k, dim=0)


def beam_generate(
    runner, prompts, input_ids, processors, stopping_criteria, generation_config, settings, sources=(), media=None
):
    """Beam search with lookahead over ``runner`` (a :class:`lookahead.runner.DecoderRunner` or
    :class:`lookahead.seq2seq_runner.Seq2SeqRunner`) -> (what ``generate`` returns, :class:`BeamStats`).
    ``media``: a VLM's prefill (:class:`lookahead.media.MediaPrefill`)."""
    search = BeamSearch(runner, input_ids, processors, stopping_criteria, generation_config, settings)
    search.run(prompts, sources, media)
    sequences, scores, indices = search.state.result(generation_config.num_return_sequences or 1)
    if not generation_config.return_dict_in_generate:
        return sequences, search.stats
    return _beam_output(runner, generation_config, search.record, sequences, scores, indices), search.stats


def _beam_output(runner, generation_config, record: dict, sequences, scores, indices):
    """``GenerateBeamDecoderOnlyOutput`` / ``GenerateBeamEncoderDecoderOutput``, with what
    ``generate`` fills in (attentions and hidden states are refused before decoding)."""
    from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateBeamEncoderDecoderOutput

    fields = {
        "sequences": sequences,
        "sequences_scores": scores if generation_config.output_scores else None,
        "scores": tuple(record["scores"]) if generation_config.output_scores else None,
        "logits": tuple(record["logits"]) if generation_config.output_logits else None,
        "beam_indices": indices,
        "cache": runner.hand_back(),
    }
    if getattr(runner, "aligned", False):
        return GenerateBeamEncoderDecoderOutput(**fields)
    return GenerateBeamDecoderOnlyOutput(**fields)


def check_beam_call(generation_config, streamer) -> None:
    """Refuse, by name, the beam-search variants this loop does not replay."""
    if (generation_config.num_beam_groups or 1) > 1 or generation_config.diversity_penalty:
        raise ValueError(
            "group (diverse) beam search (num_beam_groups, diversity_penalty) is not supported with lookahead: "
            "use plain generate for it (transformers 5 serves it from the Hub), or drop those options"
        )
    if generation_config.constraints or generation_config.force_words_ids:
        raise ValueError(
            "constrained beam search (constraints, force_words_ids) is not supported with lookahead: "
            "use plain generate for it (transformers 5 serves it from the Hub), or drop those options"
        )
    if streamer is not None:
        raise ValueError("streamers do not take beam search (transformers refuses it too): drop the streamer")


def settings_for(model, spec, cfg, rows: int, context: int) -> BeamSettings:
    """Drafts of up to G chains of N - 1 tokens per beam (``cfg``); with ``cfg.adaptive``, priced
    by the batch's measured cost curve at ``rows`` beams after ``context`` tokens."""
    chains, length = cfg.max_candidates, cfg.ngram_size - 1
    if not cfg.adaptive or not chains:
        return BeamSettings(chains, length)
    from .calibration import model_batch_costs

    costs = model_batch_costs(model, spec, rows, 1 + chains * length)
    return BeamSettings(chains, length, lambda tokens: costs.ratio(tokens, rows, context))


def beam_call(model, spec, cfg, call: dict, model_kwargs: dict, source_ids=None):
    """``Lookahead()(...)`` with ``num_beams > 1``: the runner for the model, the prompts, and
    :func:`beam_generate` -> (output, :class:`BeamStats`). ``call``: generate's ``input_ids``,
    ``logits_processor``, ``stopping_criteria``, ``generation_config`` and ``streamer``."""
    from .runner import DecoderRunner
    from .seq2seq_runner import Seq2SeqRunner
    from .step import prompt_rows

    input_ids, generation_config = call["input_ids"], call["generation_config"]
    check_beam_call(generation_config, call.get("streamer"))
    k = generation_config.num_beams
    prompts = prompt_rows(input_ids, model_kwargs.get("attention_mask"), spec)
    settings = settings_for(model, spec, cfg, input_ids.shape[0], max(len(p) for p in prompts))
    if spec.encoder_decoder:
        runner = Seq2SeqRunner(model, model_kwargs)
        settings = BeamSettings(min(1, settings.chains), settings.length, settings.ratio)  # linear steps
    else:
        runner = DecoderRunner(model, spec)
    sources = ()
    if source_ids is not None:
        sources = source_ids[:: k if source_ids.shape[0] == input_ids.shape[0] else 1].tolist()
    processors, stopping = call["logits_processor"], call["stopping_criteria"]
    media = MediaPrefill.from_call(model, input_ids, model_kwargs)
    return beam_generate(runner, prompts, input_ids, processors, stopping, generation_config, settings, sources, media)
