"""The step-level engine: lookahead decoding over a batch whose sequences come and go.

``Lookahead.__call__`` admits its whole batch once and steps until every sequence has finished;
a server admits requests as they arrive, at step boundaries, and steps while any is active.
Each step (:meth:`Engine.step`) is one forward pass over every active sequence:

1. plan: a lone sequence drafts a token tree from counts (``lookahead.drafting``); a batch
   chooses how wide to step (``lookahead.tuning``); then each sequence's candidates;
2. run t, the window and the candidates through the model (``lookahead.runner``);
3. verify each sequence: against its greedy choices, or, when it samples, against draws from
   noise keyed by (its seed, position); accepted tokens plus the bonus token;
4. emit them one by one through each sequence's stopping criteria;
5. commit: keep exactly the committed tokens in the cache, shift the windows, pool the new
   n-grams; sequences that finished (or were cancelled) leave the batch.

Admission (:meth:`Engine.admit`) prefills the newcomers together and merges their cache into
the running one (the runner's hole-masked layout lets sequences of any length sit side by side);
the prefill's last position gives each newcomer its first token, exactly as plain decoding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from .choices import StepChoices, fetch_matched
from .config import LookaheadConfig, LookaheadStats
from .drafting import Draft, TreeDrafter
from .emission import Emitter, align
from .layout import StepLayout, build_layout
from .media import MediaPrefill
from .planning import (
    at_hand,
    candidates_for,
    draft_sources,
    plan_step,
    plan_tree,
    step_sizes,
    use_tree,
    window_levels,
)
from .runner import AdmissionError, DecoderRunner
from .seq2seq_runner import Seq2SeqRunner
from .sequences import SeqState
from .step import Scorer
from .support import ModelTraits
from .tuning import WidthChooser, match_lengths
from .verify import Verdict, position_noise, verify_choices


class Engine:
    """Steps a changing batch of :class:`SeqState` through lookahead decoding.

    ``emitter`` appends tokens (its ``stop_ends_seq`` says whether a stop ends a sequence or, as
    transformers does without an EOS criterion, it runs on until every sequence has stopped);
    ``stats`` accumulates over the engine's life; ``on_finish(seq)`` is called for every sequence
    that leaves the batch; ``keep_cache``: the runner's cache is handed back to the caller, so
    sliding-window layers keep every column (otherwise they drop what no window reaches);
    ``whole_batch``: the caller waits until every sequence has finished (``generate``), so a
    batch's steps favour the sequences furthest from their end (:meth:`_weights`).
    """

    def __init__(
        self,
        model,
        cfg: LookaheadConfig,
        spec: ModelTraits,
        chooser: WidthChooser,
        emitter: Emitter,
        stats: LookaheadStats,
        model_kwargs: dict | None = None,
        on_finish: Callable[[SeqState], None] | None = None,
        keep_cache: bool = False,
        drafter: TreeDrafter | None = None,
        whole_batch: bool = False,
    ) -> None:
        self.model, self.cfg, self.spec = model, cfg, spec
        self.chooser, self.emitter, self.stats = chooser, emitter, stats
        self.drafter = drafter  # drafts the steps of a lone sequence (None: the chooser plans every step)
        # the sequence whose step the drafter recorded last, and the length its text will then have:
        # the drafter's pending tries are scored along that text only
        self._drafted: tuple[SeqState, int] | None = None
        self.on_finish = on_finish
        if spec.encoder_decoder:
            self.runner = Seq2SeqRunner(model, model_kwargs or {})
        else:  # a cache handed back to the caller keeps every column; else sliding layers are bounded
            self.runner = DecoderRunner(model, spec, bound_sliding=not keep_cache)
        self.active: list[SeqState] = []  # in the runner's batch order
        self.lazy_choices: bool | None = None  # see lookahead.choices (None: lazy on a CPU only)
        self.roster: list[SeqState] = []  # every sequence ever admitted: stopped ones run on (see _limit)
        # the caller waits for the whole batch (generate): see _weights
        self.whole_batch = whole_batch

    # -- admission -------------------------------------------------------------------------------

    def admit(
        self, seqs: Sequence[SeqState], prompts: Sequence[Sequence[int]], media: MediaPrefill | None = None
    ) -> None:
        """Prefill ``seqs`` (their prompts without padding; ``media``: a VLM's prefill of them) and
        let them join the batch; each gets its first token from the prefill. Into a running batch,
        a failure raises :class:`AdmissionError` and leaves the running sequences as they were."""
        start = time.perf_counter()
        if self.active:
            if self.runner.aligned:
                raise ValueError("encoder-decoder models cannot admit sequences into a running batch")
            newcomers, logits = self.runner.apart(prompts, media)  # [b, V]
            self.stats.prefill_seconds += time.perf_counter() - start
            return self.join(seqs, newcomers, logits)
        try:
            logits = self.runner.prefill(prompts, media)  # [b, V]: a batch starting anew
        except Exception as err:
            raise AdmissionError(f"prefilling the prompts failed: {err}") from err
        self.stats.prefill_seconds += time.perf_counter() - start
        self._emit_last(seqs, logits)
        self._enter(seqs)

    def prefill_apart(self, seq: SeqState, prompt: Sequence[int]) -> ChunkedPrefill:
        """A long prompt's prefill, run a chunk at a time on a runner of its own
        (:class:`ChunkedPrefill`); :meth:`join` it once done."""
        if self.runner.aligned:
            raise ValueError("encoder-decoder models cannot admit sequences into a running batch")
        return ChunkedPrefill(seq, prompt, DecoderRunner(self.model, self.spec, bound_sliding=False, slab=False))

    def join(self, seqs: Sequence[SeqState], newcomers: DecoderRunner, logits) -> None:
        """Let ``seqs``, prefilled on ``newcomers`` (their last logits [b, V]), join the batch: their
        first tokens are chosen, then their cache is merged. Either failing raises
        :class:`AdmissionError`, with the running batch as it was."""
        try:
            self._emit_last(seqs, logits)
        except Exception as err:  # a logits processor of theirs, say: nothing is merged yet
            raise AdmissionError(f"choosing the first token failed: {err}") from err
        if self.active:
            self.runner.merge(newcomers)
        else:  # nothing is running: whatever the runner held has left
            self.runner.adopt(newcomers)
        self._enter(seqs)

    def _enter(self, seqs: Sequence[SeqState]) -> None:
        if not self.emitter.stop_ends_seq:  # only sequences that run on after a stop need the others
            self.roster += seqs
        self.active = self._drop_finished([*self.active, *seqs])

    def _emit_last(self, seqs: Sequence[SeqState], logits) -> None:
        """Each sequence's next token from the logits of its last position [b, V] (a prefill's),
        chosen exactly as plain decoding chooses it."""
        choices = StepChoices(logits[:, None], lazy=False)  # [b, 1]: every choice, read at once
        for b, seq in enumerate(seqs):
            batch = (seq.index, seq.batch_size)
            scorer = Scorer(logits[b : b + 1], None, seq.processors, seq.ids, [], batch, choices.sequence(b))
            if seq.seed is not None:
                first = scorer.seeded_choice(0, position_noise(seq.seed, len(seq.committed), logits.shape[-1]))
            else:
                first = scorer.choice(0)
            self.emitter.emit(seq, [first], [0], scorer)
            self._pool_output(seq, 1)
            seq.steps += 1
        self.stats.steps += 1
        self.stats.sequence_steps += len(seqs)
        self.stats.accepted_hist[0] += len(seqs)

    def _refill(self, active: list[SeqState]) -> bool:
        """Where the model's own generate recomputes its whole cache (``ModelTraits.refill_at``: Phi-3
        on reaching original_max_position_embeddings, to key every token with the long RoPE
        factors), do the same: the text so far is prefilled afresh and gives the next token. Steps
        never carry t past that position before it (``ModelTraits.position_limit``), so t lands on it.
        A batch never gets here (``Lookahead.__call__`` refuses one that would; a server limits
        every request to it)."""
        at = self.spec.refill_at
        if at is None or len(active) != 1 or len(active[0].committed) - 1 != at:
            return False
        (seq,) = active
        self._emit_last(active, self.runner.prefill([seq.committed]))
        if self.drafter is not None:
            self.drafter.forget_pending()
        self.active = self._drop_finished(active)
        return True

    def cancel(self, seq: SeqState) -> None:
        """Let ``seq`` leave the batch at the next step boundary (a client that went away)."""
        seq.cancelled = True

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> None:
        """One forward pass over every active sequence (see the module docstring)."""
        active = self.active = self._drop_finished(self.active)
        if not active or self._refill(active):
            return
        # 1. plan: a count-based token tree for a lone sequence (lookahead.drafting), else as
        # wide as pays (lookahead.tuning); then every sequence's candidates
        limits = [self._limit(seq) for seq in active]
        draft = choice = matches = None
        if self.drafter is not None and len(active) == 1:
            layout, step_ids, draft = self._plan_draft(active[0], limits[0])
        else:
            layout, step_ids, choice, matches = self._plan_width(active, limits)

        # 2. one forward pass, and the model's greedy choices at the kept slots: on an accelerator
        # all of them, read at once (the step's one host-device synchronisation); on a CPU only
        # those read below (lookahead.choices)
        logits = self.runner.step(layout, step_ids)  # [B, K, V]
        choices = StepChoices(logits, lazy=self.lazy_choices)
        fetch_matched(choices, layout, [seq.candidates for seq in active])

        # 3. verify each sequence; the drafter and the chooser learn how far the candidates matched
        scorers = self._scorers(active, logits, layout, choices)
        verdicts = [self._verify(seq, scorer, layout) for seq, scorer in zip(active, scorers, strict=True)]
        if draft is not None:
            self.drafter.record(draft, verdicts[0].emitted)
            self._drafted = (active[0], len(active[0].committed) + len(verdicts[0].emitted))
        if choice and self.chooser.enabled:
            self._observe(active, scorers, layout, choice, matches)
        if self.runner.aligned:
            verdicts = align(verdicts, active)

        # 4. emit token by token through each sequence's stopping criteria
        kept = self._emit(active, verdicts, scorers, layout)
        if choice is not None:
            self.chooser.after_step(choice)

        # 5. commit: cache, windows, pools, statistics; drop the sequences that have finished
        self._commit(active, layout, step_ids, verdicts, kept, choices)
        self.active = self._drop_finished(active)

    def _plan_draft(self, seq: SeqState, limit: int) -> tuple[StepLayout, list[list[int]], Draft]:
        """A lone sequence's step: a token tree drafted from counts (``lookahead.drafting``), the
        window's rows priced into the draft."""
        cfg = self.cfg
        if self._drafted is None or self._drafted[0] is not seq or self._drafted[1] != len(seq.committed):
            self.drafter.forget_pending()
        cap, sources = draft_sources(seq, cfg, self.spec, limit, self.drafter.reach)
        # the window (the sequence's own width: a request may ask for fewer columns than W):
        # on drafted steps and a few others, its rows priced into the draft
        n_levels, width = window_levels([seq], cfg, self.spec), seq.window.window_size
        rider = build_layout(1, width, n_levels).length - 1
        draft = self.drafter.draft(sources, cap, seq.max_candidates, rider)
        seq.candidates = draft.candidates
        layout, step_ids = plan_tree(seq, cfg, n_levels if draft.window else 0, width)
        if seq.trace is not None:
            seq.trace[seq.new_tokens] = [c for _, c in sources]
        return layout, step_ids, draft

    def _plan_width(
        self, active: list[SeqState], limits: list[int]
    ) -> tuple[StepLayout, list[list[int]], tuple[int, int], list]:
        """A step as wide as pays (``lookahead.tuning``), with every sequence's candidates; the
        setting chosen and each sequence's suffix match length come back for the chooser."""
        choice, matches, found = self._choose(active, limits)
        layout, step_ids = plan_step(active, self.cfg, choice, self.spec, limits, found)
        for b, seq in enumerate(active):
            if seq.trace is not None:
                seq.trace[seq.new_tokens] = list(found[b] if found is not None else seq.candidates)
        return layout, step_ids, choice, matches

    def _choose(self, active: list[SeqState], limits: list[int]) -> tuple[tuple[int, int], list, list | None]:
        """The chooser's setting for this step, each sequence's suffix match length, and the
        candidates at hand (looked up once for pricing and planning; None when not adaptive)."""
        cfg, chooser = self.cfg, self.chooser
        chooser.batch, chooser.context = len(active), self.runner.columns
        matches = [seq.match_length() if chooser.enabled else None for seq in active]
        sizes = have = found = None
        if chooser.enabled:
            found = [candidates_for(seq, cfg, self.spec, limit) for seq, limit in zip(active, limits, strict=True)]
        if chooser.enabled and use_tree(active, cfg):  # price each option by its token tree
            sizes = step_sizes(active[0], cfg, self.spec, limits[0], chooser.options(), found[0])
        elif chooser.enabled and len(active) > 1:  # sequences of a batch with nothing to verify gain nothing
            have = [at_hand(s, cfg, self.spec, lim, f) for s, lim, f in zip(active, limits, found, strict=True)]
        weights = self._weights(active, limits) if self.whole_batch and len(active) > 1 else None
        return chooser.choose(matches, sizes, have, weights), matches, found

    laggard_power = 4.0  # see _weights (a class attribute: benchmarks/ab_laggards.py varies it)

    def _weights(self, active: list[SeqState], limits: list[int]) -> list[float]:
        """What a token of each sequence is worth to a caller who waits for the whole batch:
        (tokens it may still emit / the most any may) ** ``laggard_power``. The call lasts as long
        as its slowest sequence; a step that speeds the sequences already ahead only lets them
        idle sooner (on a CPU a smaller batch's step costs nearly as much), so a wide step must
        pay for itself in the tokens of those behind. Plain tokens per second would run wide
        steps that chat's few repeating sequences gain from, while the rest, unhelped, set the
        end: at a batch of 8, 0.94x greedy in the replay (``benchmarks/draft_replay.py --batch 8
        --batch-costs``), 0.97x so weighted. With a power of 4 a sequence with 16% fewer tokens
        left than the last counts half; sequences abreast count alike, as in tokens per second."""
        left = [max(0, limit - seq.length) for seq, limit in zip(active, limits, strict=True)]
        most = max(left) or 1
        return [(n / most) ** self.laggard_power for n in left]

    def _scorers(self, active: list[SeqState], logits, layout: StepLayout, choices: StepChoices) -> list[Scorer]:
        """Each sequence's scorer over this step's logits [B, K, V]; its logits processors see the
        sequence's text before this step."""
        return [
            Scorer(
                logits,
                layout,
                seq.processors,
                lambda seq=seq, length=seq.length: seq.ids[:, :length],  # the prefix before this step
                seq.candidates,
                (seq.index, seq.batch_size),
                choices.sequence(b),
                sequence=b,
            )
            for b, seq in enumerate(active)
        ]

    def _verify(self, seq: SeqState, scorer: Scorer, layout: StepLayout) -> Verdict:
        if seq.seed is not None:  # a draw per position, from noise keyed by (seed, position)
            base = len(seq.committed)
            noise: dict[int, object] = {}

            def draw(slot: int, index: int) -> int:
                if index not in noise:
                    noise[index] = position_noise(seq.seed, index, scorer.logits.shape[-1])
                return scorer.seeded_choice(slot, noise[index])

            first = draw(layout.t_slot, base)
            return verify_choices(first, seq.candidates, lambda k, j: draw(layout.candidate_slots[k][j], base + j + 1))
        return verify_choices(scorer.choice(layout.t_slot), seq.candidates, scorer.candidate_choice)

    def _observe(
        self, active: list[SeqState], scorers: list[Scorer], layout: StepLayout, choice: tuple[int, int], matches: list
    ) -> None:
        """Tell the chooser how far each sequence's candidates matched the model's choices, accepted
        or not: one wide step informs every narrower setting (``lookahead.tuning``)."""
        for seq, scorer, match in zip(active, scorers, matches, strict=True):
            lengths = match_lengths(seq.candidates, scorer.raw_choice(layout.t_slot), scorer.raw_candidate_choice)
            self.chooser.record(choice, max((len(c) for c in seq.candidates), default=0), lengths, match)

    def _emit(
        self, active: list[SeqState], verdicts: list[Verdict], scorers: list[Scorer], layout: StepLayout
    ) -> list[int]:
        """Emit each sequence's verified tokens one by one through its stopping criteria -> how
        many of them each sequence kept."""
        kept = []
        for seq, verdict, scorer in zip(active, verdicts, scorers, strict=True):
            slots = [layout.t_slot, *(layout.candidate_slots[k][j] for k, j in verdict.path)]
            kept.append(self.emitter.emit(seq, verdict.emitted, slots, scorer))
        return kept

    def _commit(
        self,
        active: list[SeqState],
        layout: StepLayout,
        step_ids: list[list[int]],
        verdicts: list[Verdict],
        kept: list[int],
        choices: StepChoices,
    ) -> None:
        """Keep exactly the kept tokens in the cache, shift each window by its last level's
        outputs, pool the new n-grams, and count the step."""
        self.runner.commit(layout, [(v.candidate, k) for v, k in zip(verdicts, kept, strict=True)])
        stats = self.stats
        last_level = [layout.logit_index[s] for s in layout.last_level_slots]  # their kept slots
        for b, (seq, ids, verdict, count) in enumerate(zip(active, step_ids, verdicts, kept, strict=True)):
            if layout.level_slots and seq.window.n_levels:
                outputs = choices.at(b, last_level[: seq.window.window_size])
                seq.pool.add_all(seq.window.update(ids[0], outputs))
            self._pool_output(seq, count)
            seq.steps += 1
            stats.accepted_hist[len(verdict.emitted) - 1] += 1
            stats.truncated_tokens += len(verdict.emitted) - count
        stats.steps += 1
        stats.sequence_steps += len(active)

    # -- bookkeeping -----------------------------------------------------------------------------

    def _pool_output(self, seq: SeqState, emitted: int) -> None:
        """Pool (and index) the n-grams that end in the tokens just emitted."""
        if seq.context is not None:
            seq.context.extend(seq.committed)
        if self.cfg.pool_from_output:
            seq.pool.add_sequence(seq.committed, start=len(seq.committed) - emitted - self.cfg.ngram_size + 1)

    def _limit(self, seq: SeqState) -> int:
        """The length a sequence may reach: its max_length, or, once every sequence has stopped
        (sequences that run on after their stop), the longest stop."""
        if self.emitter.stop_ends_seq or any(s.stopped_at is None for s in self.roster):
            return seq.max_length
        return min(seq.max_length, max(s.stopped_at for s in self.roster))

    def _finished(self, seq: SeqState) -> bool:
        if seq.cancelled or seq.length >= seq.max_length:
            return True
        if seq.stopped_at is None:
            return False
        return self.emitter.stop_ends_seq or seq.length >= self._limit(seq)

    def _drop_finished(self, seqs: list[SeqState]) -> list[SeqState]:
        """The sequences still decoding; the runner forgets the others."""
        keep = [i for i, seq in enumerate(seqs) if not self._finished(seq)]
        if keep and len(keep) < len(seqs):
            self.runner.select(keep)
        for seq in seqs:
            if not seq.finished and self._finished(seq):
                seq.finished = True
                if self.on_finish is not None:
                    self.on_finish(seq)
        return [seqs[i] for i in keep]


class ChunkedPrefill:
    """One long prompt, prefilled a chunk at a time on a runner of its own between the steps of a
    running batch (a server's chunked prefill: the running sequences keep their pace)."""

    def __init__(self, seq: SeqState, prompt: Sequence[int], runner: DecoderRunner) -> None:
        self.seq, self.prompt, self.runner = seq, list(prompt), runner
        self.done = 0  # prompt tokens in the runner's cache
        self.logits = None  # [1, V] after the last chunk

    @property
    def left(self) -> int:
        return len(self.prompt) - self.done

    def advance(self, tokens: int) -> int:
        """Prefill up to ``tokens`` more of the prompt -> how many; :class:`AdmissionError` on failure."""
        chunk = self.prompt[self.done : self.done + tokens]
        try:
            self.logits = self.runner.extend(chunk)
        except Exception as err:
            raise AdmissionError(f"prefilling the prompt failed: {err}") from err
        self.done += len(chunk)
        return len(chunk)
