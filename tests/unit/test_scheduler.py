"""The scheduler is plain Python: tested over Sequence objects with no model."""

from __future__ import annotations

from omlx_logprobs.batch.scheduler import Scheduler
from omlx_logprobs.batch.sequence import Sequence, Status
from omlx_logprobs.types import FinishReason, SamplingParams


def seq(n: int) -> Sequence:
    return Sequence(f"r{n}", list(range(n)), SamplingParams())


def test_long_prompt_is_prefilled_in_chunks_while_the_batch_decodes() -> None:
    s = Scheduler(max_num_seqs=4, prefill_chunk=5)
    short, long = seq(3), seq(12)
    s.add(short)
    s.add(long)
    work = s.schedule()
    # The short prompt and the first 2 tokens of the long one share the 5-token budget.
    assert [(c.seq, c.start, c.end, c.is_last) for c in work.prefill] == [
        (short, 0, 3, True),
        (long, 0, 2, False),
    ]
    s.update(work)
    assert s.running == [short] and short.status is Status.RUNNING
    chunks = []
    while s.waiting:
        work = s.schedule()
        assert work.decode == [short]  # decoding goes on during the long prefill
        chunks += [(c.start, c.end) for c in work.prefill]
        s.update(work)
    assert chunks == [(2, 7), (7, 12)]
    assert s.running == [short, long]


def test_cached_prefixes_do_not_count_against_the_budget() -> None:
    # Prompts of 10 tokens whose first 8 the runner holds: five fit a 10-token budget; a prompt
    # that does not fit whole is chunked from its start and costs its full length.
    held = {10: 8, 12: 0}
    s = Scheduler(max_num_seqs=8, prefill_chunk=10, cached=lambda q: held[q.prompt_len])
    seqs = [seq(10) for _ in range(6)] + [seq(12)]
    for q in seqs:
        s.add(q)
    work = s.schedule()
    assert [(c.start, c.end) for c in work.prefill] == [(0, 10)] * 5
    s.update(work)
    work = s.schedule()
    assert [(c.seq, c.start, c.end) for c in work.prefill] == [(seqs[5], 0, 10), (seqs[6], 0, 8)]


def test_short_prompts_share_a_step_in_arrival_order() -> None:
    s = Scheduler(max_num_seqs=3, prefill_chunk=100)
    seqs = [seq(n) for n in (4, 9, 2, 5)]
    for q in seqs:
        s.add(q)
    work = s.schedule()
    assert [c.seq for c in work.prefill] == seqs[:3]  # the batch has room for 3
    assert all(c.is_last for c in work.prefill)
    s.update(work)
    assert s.running == seqs[:3] and list(s.waiting) == seqs[3:]


def test_batch_limit_holds_new_prompts_back() -> None:
    s = Scheduler(max_num_seqs=2, prefill_chunk=100)
    seqs = [seq(2) for _ in range(3)]
    for q in seqs:
        s.add(q)
    for _ in range(2):
        s.update(s.schedule())
    assert len(s.running) == 2
    assert not s.schedule().prefill  # full
    seqs[0].finish(FinishReason.STOP)
    s.update(s.schedule())
    assert seqs[0] not in s.running
    work = s.schedule()
    assert [c.seq for c in work.prefill] == [seqs[2]]


def test_sequence_finished_by_its_first_token_never_runs() -> None:
    s = Scheduler(max_num_seqs=2, prefill_chunk=100)
    q = seq(4)
    s.add(q)
    work = s.schedule()
    q.finish(FinishReason.LENGTH)  # what the output processor does for max_tokens=1
    s.update(work)
    assert not s.running and not s.waiting and not s.has_work()


def test_remove_takes_a_sequence_out_wherever_it_is() -> None:
    s = Scheduler(max_num_seqs=2, prefill_chunk=2)
    a, b = seq(2), seq(6)
    s.add(a)
    s.add(b)
    s.update(s.schedule())
    s.update(s.schedule())  # b half prefilled
    s.remove(a)
    s.remove(b)
    assert not s.has_work()


def test_forks_wait_for_room_and_join_with_their_prompt() -> None:
    s = Scheduler(max_num_seqs=4, prefill_chunk=100)
    first = seq(3)
    s.add(first)
    s.update(s.schedule())
    leader = seq(5)
    forks = [leader.fork(i) for i in (1, 2, 3)]
    s.add(leader)
    assert s.schedule().prefill == []  # 1 running + 4 choices > 4
    first.finish(FinishReason.STOP)
    s.update(s.schedule())
    work = s.schedule()
    assert [c.seq for c in work.prefill] == [leader]
    forks[1].finish(FinishReason.ABORT)
    s.update(work)
    assert s.running == [leader, forks[0], forks[2]]
    assert forks[0].num_prefilled == forks[2].num_prefilled == 5


def test_prompts_wait_for_company_while_a_batch_decodes() -> None:
    now = [0.0]
    s = Scheduler(max_num_seqs=8, prefill_chunk=100, prefill_delay_s=0.02, clock=lambda: now[0])
    first = seq(4)
    s.add(first)
    assert [c.seq for c in s.schedule().prefill] == [first]  # nothing decodes: no waiting
    s.update(s.schedule())
    late = seq(5)
    s.add(late)
    assert not s.schedule().prefill  # the batch decodes: the new prompt waits
    now[0] = 0.019
    assert not s.schedule().prefill
    now[0] = 0.021
    work = s.schedule()
    assert [c.seq for c in work.prefill] == [late]
    s.update(work)
    # A full budget's worth of prompts goes at once, without waiting.
    many = [seq(30) for _ in range(4)]
    for q in many:
        s.add(q)
    assert [c.seq for c in s.schedule().prefill] == many


def test_a_prompt_that_waits_for_one_prefilling_now_goes_a_step_later() -> None:
    """`waits` sees the prompts scheduled before it in the step and those between chunks; a
    prompt that waits takes no budget, and those behind it go on."""
    asked: list[tuple[int, list[int]]] = []
    waiters = {12, 13}  # prompt lengths that wait while a 20-token prompt is being prefilled

    def waits(q: Sequence, busy: list[Sequence]) -> bool:
        asked.append((q.prompt_len, [b.prompt_len for b in busy]))
        return q.prompt_len in waiters and any(b.prompt_len == 20 for b in busy)

    s = Scheduler(max_num_seqs=8, prefill_chunk=16, waits=waits)
    first, a, b, c = seq(20), seq(12), seq(3), seq(13)
    for q in (first, a, b, c):
        s.add(q)
    work = s.schedule()  # the first takes the whole budget, in a chunk
    assert [(w.seq, w.start, w.end) for w in work.prefill] == [(first, 0, 16)]
    s.update(work)
    work = s.schedule()  # between its chunks it is busy: a and c wait, b goes
    assert [(w.seq, w.start, w.end) for w in work.prefill] == [(first, 16, 20), (b, 0, 3)]
    assert asked[-3:] == [(12, [20]), (3, [20]), (13, [20, 3])]
    s.update(work)
    work = s.schedule()
    assert [w.seq for w in work.prefill] == [a, c]


def ranked(n: int, priority: int) -> Sequence:
    q = seq(n)
    q.priority = priority
    return q


def test_waiting_prompts_go_by_priority_then_arrival() -> None:
    """vLLM's priority order: lower first, ties by arrival; a prompt between its chunks stays
    first (it holds its partial cache, as vLLM's running prefill does)."""
    s = Scheduler(max_num_seqs=2, prefill_chunk=100)
    a, b, c, d = ranked(3, 0), ranked(4, 5), ranked(5, -1), ranked(6, 0)
    for q in (a, b, c, d):
        s.add(q)
    assert list(s.waiting) == [c, a, d, b]
    work = s.schedule()
    assert [w.seq for w in work.prefill] == [c, a]  # two rows
    s.update(work)
    assert s.running == [c, a] and list(s.waiting) == [d, b]
    s = Scheduler(max_num_seqs=8, prefill_chunk=4)
    long, urgent, later = ranked(10, 3), ranked(2, -7), ranked(2, 3)
    s.add(long)
    s.update(s.schedule())  # long's first chunk
    s.add(later)
    s.add(urgent)
    assert list(s.waiting) == [long, urgent, later]
    work = s.schedule()
    assert [(w.seq, w.start, w.end) for w in work.prefill] == [(long, 4, 8)]


def test_a_higher_priority_prompt_preempts_the_lowest_running() -> None:
    """No rows for the first waiting prompt: the running choices of strictly lower priority
    (the highest value, the latest arrived among equals) are named, as many as it needs, and
    none when those are too few; once retracted they wait first among their priority, in
    their old order."""
    s = Scheduler(max_num_seqs=3, prefill_chunk=100)
    low1, mid, low2 = ranked(3, 5), ranked(3, 1), ranked(3, 5)
    for q in (low1, mid, low2):
        s.add(q)
    s.update(s.schedule())
    assert s.running == [mid, low1, low2] and s.preempts() == []
    other = ranked(4, 5)
    s.add(other)
    assert s.preempts() == []  # an equal priority waits its turn
    urgent = ranked(4, 0)
    s.add(urgent)
    assert list(s.waiting) == [urgent, other]
    assert s.preempts() == [low2]  # the later of the two lowest
    two = ranked(4, 2)
    two.fork(1)
    s.remove(urgent)
    s.add(two)
    assert s.preempts() == [low2, low1]  # two rows: both priority 5, not mid
    three = ranked(4, 3)
    three.fork(1)
    three.fork(2)
    s.remove(two)
    s.add(three)
    assert s.preempts() == []  # three rows, only two lower: nobody is retracted for nothing
    s.remove(three)
    s.add(urgent)
    gone = s.preempts()
    for q in gone:
        q.retract()
    s.requeue(gone)
    assert s.running == [mid, low1] and list(s.waiting) == [urgent, low2, other]
    work = s.schedule()
    assert [w.seq for w in work.prefill] == [urgent]
    s.update(work)
    assert s.preempts() == [] and list(s.waiting) == [low2, other]
