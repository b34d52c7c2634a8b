"""The persistent input batch: every running request owns a row of preallocated arrays
(its tokens, its block table, its progress), updated incrementally from each
SchedulerOutput. A step's flat inputs are computed from those rows with vectorised numpy
indexing: no Python loop per token, only per request where the scheduler's own output is
per request."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.model.attention.metadata import AttentionMetadata
from engine.outputs import NewRequestData, SchedulerOutput
from engine.request import SamplingParams


@dataclass
class StepInputs:
    """One step's model inputs, on the device, plus what the sampler needs."""

    req_ids: list[str]  # scheduled requests, in scheduling order
    input_ids: torch.Tensor  # [T] token ids, flattened over requests
    positions: torch.Tensor  # [T] position of each token in its sequence
    meta: AttentionMetadata  # attention's view of the batch
    logits_indices: torch.Tensor  # [N] rows of the hidden states that sample
    sample_mask: np.ndarray  # [R] bool: request r samples this step
    sample_rows: np.ndarray  # [N] batch rows of the sampling requests
    sample_params: list[SamplingParams]  # [N] their sampling parameters
    output_positions: np.ndarray  # [N] index of the token each one samples in its output
    drafts: list[list[int]] | None = None  # [N] drafts each one verifies; None: no drafts


class InputBatch:
    """Rows of per-request state, plus the buffers one step's inputs are built in."""

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        max_num_tokens: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.max_model_len = max_model_len
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # known: prompt + sampled
        self.num_prompt = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))  # pop() gives row 0 first
        # Per-step host buffers, reused every step.
        self.input_ids = np.zeros(max_num_tokens, dtype=np.int64)
        self.positions = np.zeros(max_num_tokens, dtype=np.int64)
        self.slot_mapping = np.zeros(max_num_tokens, dtype=np.int64)
        self.query_start_loc = np.zeros(max_num_reqs + 1, dtype=np.int32)
        self.seq_lens = np.zeros(max_num_reqs, dtype=np.int32)
        self.arange = np.arange(max(max_num_tokens, max_num_reqs) + 1, dtype=np.int64)
        self.staging = _Staging(device) if device.type != "cpu" else None

    def __len__(self) -> int:
        return len(self.row_of)

    # -- incremental state updates -------------------------------------------------------

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.params[row] = None
            self.block_table[row, : self.num_blocks[row]] = 0  # pad with the null block
            self.num_blocks[row] = 0
            self.free_rows.append(row)

    def add(self, nr: NewRequestData) -> None:
        self.remove(nr.req_id)  # a resumed request starts over
        if not self.free_rows:
            raise RuntimeError("input batch full: more running requests than max_num_seqs")
        row = self.free_rows.pop()
        self.row_of[nr.req_id] = row
        n = len(nr.token_ids)
        self.token_ids[row, :n] = nr.token_ids
        self.num_tokens[row] = n
        self.num_prompt[row] = nr.num_prompt_tokens
        self.num_computed[row] = nr.num_computed_tokens
        nb = len(nr.block_ids)
        self.block_table[row, :nb] = nr.block_ids
        self.num_blocks[row] = nb
        self.params[row] = nr.sampling_params

    def update(self, out: SchedulerOutput) -> None:
        """Apply one SchedulerOutput: drop finished and preempted requests, add new and
        resumed ones, extend the block tables of those that continue."""
        for rid in out.finished_req_ids:
            self.remove(rid)
        for rid in out.preempted_req_ids:
            self.remove(rid)
        for nr in out.scheduled_new_reqs:
            self.add(nr)
        cached = out.scheduled_cached_reqs
        for rid, blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            row = self.row_of[rid]
            self.num_computed[row] = computed
            if blocks:
                start = self.num_blocks[row]
                self.block_table[row, start : start + len(blocks)] = blocks
                self.num_blocks[row] = start + len(blocks)

    def append_sampled(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Record sampled tokens at the end of their rows (vectorised)."""
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1

    def append_verified(self, rows: np.ndarray, tokens: list[list[int]]) -> None:
        """Record each row's accepted drafts and bonus token. Tokens past a stop are
        appended too; the request is dropped from the batch before they could matter."""
        for row, toks in zip(rows.tolist(), tokens):
            n = int(self.num_tokens[row])
            end = min(n + len(toks), self.max_model_len)
            self.token_ids[row, n:end] = toks[: end - n]
            self.num_tokens[row] = end

    # -- one step's inputs ---------------------------------------------------------------

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Update the rows from `out`, then build the step's flat inputs."""
        self.update(out)
        if self.staging is not None:
            self.staging.reset()
        req_ids = list(out.num_scheduled_tokens)
        num_reqs = len(req_ids)
        rows = np.fromiter((self.row_of[r] for r in req_ids), dtype=np.int64, count=num_reqs)
        n_sched = np.fromiter(out.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        qsl = self.query_start_loc[: num_reqs + 1]
        np.cumsum(n_sched, out=qsl[1:])
        num_tokens = int(qsl[-1])
        spec = out.scheduled_spec_decode_tokens
        num_drafts = self._place_drafts(spec, req_ids, rows) if spec else None
        computed = self.num_computed[rows]
        # Token t belongs to request req[t] and sits at position computed + offset.
        req = np.repeat(self.arange[:num_reqs], n_sched)
        pos = self.positions[:num_tokens]
        np.add(computed[req], self.arange[:num_tokens] - qsl[req], out=pos)
        token_rows = rows[req]
        self.input_ids[:num_tokens] = self.token_ids[token_rows, pos]
        bs = self.block_size
        self.slot_mapping[:num_tokens] = (
            self.block_table[token_rows, pos // bs].astype(np.int64) * bs + pos % bs
        )
        seq_lens = self.seq_lens[:num_reqs]
        seq_lens[:] = computed + n_sched
        self.num_computed[rows] = seq_lens
        max_seq = int(seq_lens.max())
        table = self.block_table[rows, : -(-max_seq // bs)]
        # A request samples when this step reaches the end of its known tokens.
        sample_mask = seq_lens >= self.num_tokens[rows]
        sample_rows = rows[sample_mask]
        last = qsl[1:][sample_mask].astype(np.int64) - 1
        drafts = None
        if num_drafts is not None:
            # A request verifying d drafts needs the logits of its last d + 1 tokens.
            d = num_drafts[sample_mask]
            last = np.repeat(last - d, d + 1) + _ranges(d + 1)
            drafts = [spec.get(req_ids[i], []) for i in np.flatnonzero(sample_mask).tolist()]
        meta = AttentionMetadata(
            num_tokens=num_tokens,
            query_start_loc=self._to_device(qsl),
            seq_lens=self._to_device(seq_lens),
            block_table=self._to_device(table),
            slot_mapping=self._to_device(self.slot_mapping[:num_tokens]),
            max_query_len=int(n_sched.max()),
            max_seq_len=max_seq,
            query_start_loc_cpu=qsl.copy(),
            seq_lens_cpu=seq_lens.copy(),
            block_table_cpu=table,
        )
        return StepInputs(
            req_ids=req_ids,
            input_ids=self._to_device(self.input_ids[:num_tokens]),
            positions=self._to_device(pos),
            meta=meta,
            logits_indices=self._to_device(last),
            sample_mask=sample_mask,
            sample_rows=sample_rows,
            sample_params=[p for p in (self.params[r] for r in sample_rows) if p is not None],
            output_positions=self.num_tokens[sample_rows] - self.num_prompt[sample_rows],
            drafts=drafts,
        )

    def _place_drafts(
        self, spec: dict[str, list[int]], req_ids: list[str], rows: np.ndarray
    ) -> np.ndarray:
        """Write each request's drafts after its known tokens, where the inputs are read
        from; return the number of drafts per scheduled request."""
        num = np.zeros(len(req_ids), dtype=np.int64)
        for i, rid in enumerate(req_ids):
            drafts = spec.get(rid)
            if drafts:
                row = rows[i]
                n = int(self.num_tokens[row])
                # A placeholder (-1, padding) is fed as token 0; it is rejected anyway.
                self.token_ids[row, n : n + len(drafts)] = np.maximum(drafts, 0)
                num[i] = len(drafts)
        return num

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        if self.staging is None:
            return torch.from_numpy(arr)  # CPU: a view of the host buffer, no copy
        return self.staging.put(arr)


def _ranges(lengths: np.ndarray) -> np.ndarray:
    """0..n-1 for each n in `lengths`, concatenated."""
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.asarray(np.arange(total, dtype=np.int64) - starts)


class _Staging:
    """Host-to-device copies through persistent pinned buffers, one per dtype, reused
    every step. Safe because every step ends with a device sync (the sampled tokens)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host: dict[np.dtype, torch.Tensor] = {}
        self.dev: dict[np.dtype, torch.Tensor] = {}
        self.used: dict[np.dtype, int] = {}

    def reset(self) -> None:
        self.used.clear()

    def put(self, arr: np.ndarray) -> torch.Tensor:
        key = arr.dtype
        start = self.used.get(key, 0)
        end = start + arr.size
        host = self.host.get(key)
        if host is None or host.numel() < end:
            host = self._grow(key, end)
        host_np = host.numpy()
        np.copyto(host_np[start:end], arr.reshape(-1))
        dev = self.dev[key][start:end]
        dev.copy_(host[start:end], non_blocking=True)
        self.used[key] = end
        return dev.view(arr.shape)

    def _grow(self, key: np.dtype, size: int) -> torch.Tensor:
        # Only between steps' uses: a buffer handed out this step is never reallocated
        # under it, because the old tensors stay alive through the views returned.
        size = max(size, 2 * (self.host[key].numel() if key in self.host else 4096))
        dtype = torch.from_numpy(np.zeros(0, dtype=key)).dtype
        self.host[key] = torch.empty(size, dtype=dtype).pin_memory()
        self.dev[key] = torch.empty(size, dtype=dtype, device=self.device)
        return self.host[key]
