"""The persistent input batch against a naive rebuild from the scheduler's own state, over
random workloads with chunked prefill, preemption and prefix hits."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.hashing import BlockHasher
from engine.model.input_batch import InputBatch
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.request import Request, SamplingParams


class CheckingRunner:
    """Builds each step's inputs with InputBatch and checks them token by token."""

    def __init__(self, config: EngineConfig, seed: int) -> None:
        self.config = config
        self.core: EngineCore | None = None
        self.batch = InputBatch(
            config.max_num_seqs,
            config.max_model_len,
            config.block_size,
            config.max_num_batched_tokens,
            torch.device("cpu"),
        )
        self.rng = random.Random(seed)
        self.steps_checked = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        assert self.core is not None
        inputs = self.batch.prepare(out)
        sched = self.core.scheduler
        bs = self.config.block_size
        ids, pos, slots, sampled = [], [], [], []
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            before = req.num_computed_tokens - n  # the scheduler has advanced it already
            table = sched.kv.get_block_ids(rid)
            for p in range(before, before + n):
                ids.append(req.all_token_ids[p])
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            sampled.append(before + n >= req.num_tokens)
        meta = inputs.meta
        assert inputs.req_ids == list(out.num_scheduled_tokens)
        assert inputs.input_ids.tolist() == ids
        assert inputs.positions.tolist() == pos
        assert meta.slot_mapping.tolist() == slots
        lens = list(out.num_scheduled_tokens.values())
        assert meta.query_start_loc.tolist() == [0, *np.cumsum(lens).tolist()]
        for i, rid in enumerate(inputs.req_ids):
            table = sched.kv.get_block_ids(rid)
            seq_len = int(meta.seq_lens[i])
            assert seq_len == sched.requests[rid].num_computed_tokens
            need = -(-seq_len // bs)
            assert meta.block_table[i, :need].tolist() == table[:need]
            assert not meta.block_table[i, len(table) :].any(), "padding is the null block"
        assert inputs.sample_mask.tolist() == sampled
        tokens = np.array([self.rng.randrange(1000) for _ in range(int(sum(sampled)))])
        self.batch.append_sampled(inputs.sample_rows, tokens)
        result: list[list[int]] = [[] for _ in inputs.req_ids]
        for i, tok in zip(np.flatnonzero(inputs.sample_mask).tolist(), tokens.tolist()):
            result[i] = [tok]
        self.steps_checked += 1
        return ModelRunnerOutput(inputs.req_ids, result)


@pytest.mark.parametrize("seed", range(6))
def test_input_batch_matches_scheduler_state(seed: int) -> None:
    rng = random.Random(seed)
    config = EngineConfig(
        block_size=rng.choice([4, 16]),
        num_blocks=rng.choice([24, 60, 400]),
        max_num_batched_tokens=rng.choice([16, 64, 256]),
        max_num_seqs=8,
        max_model_len=256,
        long_prefill_token_threshold=rng.choice([0, 12]),
        enable_prefix_caching=rng.random() < 0.7,
    )
    runner = CheckingRunner(config, seed)
    core = EngineCore(config, runner)
    runner.core = core
    hasher = BlockHasher(config.block_size)
    shared = [rng.randrange(1000) for _ in range(40)]
    pending = []
    for i in range(14):
        prompt = (shared if rng.random() < 0.5 else []) + [
            rng.randrange(1000) for _ in range(rng.randint(1, 60))
        ]
        pending.append(
            Request(
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=rng.randint(1, 30)),
                arrival_time=float(i),
                block_hasher=hasher,
            )
        )
    steps = preemptions = 0
    while pending or core.has_unfinished():
        for _ in range(rng.randint(0, 2)):
            if pending:
                core.add_request(pending.pop(0))
        if rng.random() < 0.05 and core.scheduler.running:
            core.abort(rng.choice(core.scheduler.running).request_id)
        result = core.step()
        preemptions += len(result.report.preemptions)
        steps += 1
        assert steps < 2000
    assert runner.steps_checked > 10


def test_rows_are_reused_and_block_tables_extended_in_place() -> None:
    config = EngineConfig(
        block_size=4, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64
    )
    runner = CheckingRunner(config, 0)
    core = EngineCore(config, runner)
    runner.core = core
    core.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=8)))
    core.add_request(Request("b", list(range(20, 27)), SamplingParams(max_tokens=2)))
    core.step()
    row_a = runner.batch.row_of["a"]
    while "b" in core.scheduler.requests:
        core.step()
    core.add_request(Request("c", list(range(40, 45)), SamplingParams(max_tokens=2)))
    core.step()  # "b" is dropped at this step's start, "c" takes a free row
    assert runner.batch.row_of["a"] == row_a
    assert "b" not in runner.batch.row_of
    assert runner.batch.num_blocks[row_a] == len(core.scheduler.kv.get_block_ids("a"))
