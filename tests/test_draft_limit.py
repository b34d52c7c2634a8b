"""The draft limiter: drafts follow a request's recent acceptance, held-back drafts still
teach it, placeholders teach nothing, and it only ever shortens the proposal."""

from __future__ import annotations

from engine.draft_limit import PRIOR, WORTH, DraftLimiter, worth_sending


def test_worth_sending_is_the_longest_prefix_whose_joint_chance_clears_the_bar() -> None:
    assert worth_sending(PRIOR, 4) == 1  # a new request: one draft
    assert worth_sending(0.6, 4) == 2  # 0.36 >= WORTH > 0.216
    assert worth_sending(0.9, 4) == 4  # capped by what was proposed
    assert worth_sending(0.9, 2) == 2
    assert worth_sending(WORTH - 0.01, 4) == 0
    assert worth_sending(1.0, 3) == 3
    for alpha in (0.3, 0.5, 0.7, 0.8, 0.95):
        n = worth_sending(alpha, 100)
        assert alpha**n >= WORTH > alpha ** (n + 1)


def test_accepted_drafts_earn_more_drafts_and_rejections_fewer() -> None:
    lim = DraftLimiter(2)
    proposal = [5, 6, 7, 8]
    assert lim.limit(0, proposal) == [5]
    for _ in range(4):  # every draft sent is accepted, and the bonus matches the next one
        sent = lim.limit(0, proposal)
        lim.observe(0, sent, [*sent, proposal[len(sent)] if len(sent) < 4 else 9])
    assert lim.limit(0, proposal) == proposal
    for _ in range(4):  # the first draft is rejected every time
        sent = lim.limit(0, proposal)
        lim.observe(0, sent, [1])
    assert lim.limit(0, proposal) == []
    assert lim.limit(1, proposal) == [5]  # another row is untouched


def test_held_back_drafts_that_would_have_landed_bring_drafting_back() -> None:
    lim = DraftLimiter(1)
    lim.alpha[0] = 0.1
    text = list(range(100, 140))
    for i in range(6):  # the request repeats itself: each proposal's head is the next token
        sent = lim.limit(0, text[i : i + 4])
        assert sent == [] or i > 0
        lim.observe(0, sent, text[i : i + len(sent) + 1])
        if sent:
            break
    assert sent, "a request whose held-back drafts keep matching drafts again"


def test_placeholders_and_empty_steps_teach_nothing() -> None:
    lim = DraftLimiter(1)
    lim.limit(0, [3, 4])
    lim.observe(0, [-1, -1], [7])  # the scheduler's placeholders, rejected by design
    assert lim.alpha[0] == PRIOR
    lim.observe(0, [], [])  # no token this step (a prefill chunk)
    assert lim.alpha[0] == PRIOR


def test_reset_forgets_a_row() -> None:
    lim = DraftLimiter(1)
    lim.alpha[0] = 0.9
    lim.limit(0, [1, 2])
    lim.reset(0)
    assert lim.alpha[0] == PRIOR and lim.proposal[0] == []
