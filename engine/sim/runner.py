"""A runner that executes no model: each request's tokens come from a script.

It follows the fidelity driver's rule: a scheduled request samples exactly when the step
takes it to the end of its known tokens (a partial prefill chunk samples nothing), and the
sample is the next unused token of its script. Speculative decoding is simulated with a
deterministic drafter whose proposals are right for a pseudo-random prefix, or, with a
speculative_config, drafted by the real n-gram proposer over the request's tokens and
verified against the script."""

from __future__ import annotations

import random
import zlib
from typing import Any

from engine.config import SpeculativeConfig
from engine.outputs import ModelRunnerOutput, SchedulerOutput


class SimRunner:
    """Scripted outputs, per request id; a script shorter than needed is padded with 0."""

    plain_shortcut = True  # sample undrafted steps in one loop (off: the general path, to compare)

    def __init__(
        self,
        scripts: dict[str, list[int]],
        num_speculative_tokens: int = 0,
        acceptance_rate: float = 0.7,
        seed: int = 0,
        speculative_config: SpeculativeConfig | None = None,
        max_model_len: int = 1 << 30,
    ) -> None:
        self.scripts = scripts
        self.k = num_speculative_tokens
        self.ngram: Any = None
        self.history: dict[str, list[int]] = {}  # known tokens, for the n-gram drafter
        if speculative_config is not None:
            from engine.ngram import NgramProposer  # numpy: only when drafting for real

            c = speculative_config
            self.k = c.num_speculative_tokens
            self.ngram = NgramProposer(
                self.k, c.prompt_lookup_min, c.prompt_lookup_max, max_model_len
            )
        self.acceptance_rate = acceptance_rate
        self.seed = seed
        self.known: dict[str, int] = {}  # tokens the request has, prompt included
        self.sampled: dict[str, int] = {}  # script position of the next sample

    def add_script(self, request_id: str, tokens: list[int]) -> None:
        self.scripts[request_id] = tokens

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.known.pop(rid, None)
            self.sampled.pop(rid, None)
            self.history.pop(rid, None)
        before: dict[str, int] = {}
        for nr in out.scheduled_new_reqs:
            self.known[nr.req_id] = len(nr.token_ids)
            if self.ngram is not None:
                self.history[nr.req_id] = list(nr.token_ids)
            self.sampled[nr.req_id] = len(nr.token_ids) - nr.num_prompt_tokens
            before[nr.req_id] = nr.num_computed_tokens
        cached = out.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        spec = out.scheduled_spec_decode_tokens
        req_ids = list(out.num_scheduled_tokens)
        if self.plain_shortcut and not spec and not self.k and self.ngram is None:
            return ModelRunnerOutput(req_ids, self._sample_plain(out, before))
        sampled_ids: list[list[int]] = []
        drafts: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            drafted = spec.get(rid, ())
            if before[rid] + n - len(drafted) < self.known[rid]:
                sampled_ids.append([])  # mid-prefill: nothing to sample yet
                continue
            tokens = self._verify(rid, drafted)
            sampled_ids.append(tokens)
            self.known[rid] += len(tokens)
            self.sampled[rid] += len(tokens)
            if self.ngram is not None:
                self.history[rid] += tokens
                drafts[rid] = []
            elif self.k:
                drafts[rid] = self._propose(rid)
        if self.ngram is not None and drafts:
            drafts = self._propose_ngram(list(drafts))
        return ModelRunnerOutput(req_ids, sampled_ids, drafts)

    def _sample_plain(self, out: SchedulerOutput, before: dict[str, int]) -> list[list[int]]:
        """execute()'s samples with no drafting at all: one script token per request that
        reaches the end of its known tokens (what _verify gives for no drafts), without a
        call per request: a simulated step is mostly this loop."""
        known, sampled, scripts = self.known, self.sampled, self.scripts
        sampled_ids: list[list[int]] = []
        for rid, n in out.num_scheduled_tokens.items():
            if before[rid] + n < known[rid]:
                sampled_ids.append([])  # mid-prefill: nothing to sample yet
                continue
            pos = sampled[rid]
            script = scripts.get(rid, ())
            sampled_ids.append([script[pos] if pos < len(script) else 0])
            known[rid] += 1
            sampled[rid] = pos + 1
        return sampled_ids

    def _propose_ngram(self, rids: list[str]) -> dict[str, list[int]]:
        from engine.ngram import propose_lists

        proposals = propose_lists(self.ngram, [self.history[r] for r in rids])
        return dict(zip(rids, proposals))

    def _token(self, rid: str, pos: int) -> int:
        script = self.scripts.get(rid, ())
        return script[pos] if pos < len(script) else 0

    def _verify(self, rid: str, drafted: list[int] | tuple[()]) -> list[int]:
        """Accept the drafts that match the script, then add one more token."""
        pos = self.sampled[rid]
        tokens: list[int] = []
        for tok in drafted:
            if tok != self._token(rid, pos + len(tokens)):
                break
            tokens.append(tok)
        tokens.append(self._token(rid, pos + len(tokens)))
        return tokens

    def _propose(self, rid: str) -> list[int]:
        """k drafts: right for a pseudo-random prefix (fixed per request and position)."""
        pos = self.sampled[rid]
        rng = random.Random(zlib.crc32(f"{self.seed}:{rid}:{pos}".encode()))
        right = 0
        while right < self.k and rng.random() < self.acceptance_rate:
            right += 1
        drafts = [self._token(rid, pos + j) for j in range(right)]
        drafts += [self._token(rid, pos + j) + 1 for j in range(right, self.k)]
        return drafts
