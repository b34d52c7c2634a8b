"""The batch pane with speculative decoding: a verifying entry counts its decode token as
decode and its drafts as spec, and carries how many drafts were accepted."""

from __future__ import annotations

from recorder.reader import TraceReader
from recorder.schema import Kind, Step
from replays.reducer import apply_with_view
from replays.state import State
from tests.helpers import record, req, workload
from tui.viewmodel import StepInput, _batch
from tui.widgets.batch import bar


def test_spec_tokens_are_their_own_kind(tmp_path) -> None:  # type: ignore[no-untyped-def]
    w = workload([req("a", 20, 12), req("b", 9, 10)], num_speculative_tokens=3)
    path = tmp_path / "spec.trace"
    path.write_bytes(record(w).data)
    seen = 0
    with TraceReader(path) as reader:
        state = State.initial(reader.header)
        for entry in reader.entries():
            if not isinstance(entry.record, Step):
                continue
            view = apply_with_view(state, entry.record)
            vm = _batch(StepInput(view, ()))
            totals = dict(vm.by_kind)
            drafts = sum(e.num_spec_tokens for e in view.scheduled)
            assert totals["spec"] == drafts
            verifying = [e for e in view.scheduled if e.kind == Kind.SPEC]
            assert totals["decode"] >= len(verifying)
            accepted = {a.ref: a.accepted for a in entry.record.spec_accepted}
            for e in vm.entries:
                if e.kind == "spec":
                    seen += 1
                    assert e.accepted == accepted[e.ref] and 0 <= e.accepted <= e.spec
            assert len(bar(vm, 40).plain) == 40
    assert seen > 0
