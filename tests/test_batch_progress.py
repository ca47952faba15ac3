"""Progress: token rates, an ETA from the tokens still to generate (max_tokens bounds refined as rows
finish), and the drawing policy; all driven by a fake clock."""

from __future__ import annotations

import io
import random

from tokenmill.batch.progress import Progress, format_duration


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def simulate(lengths, bound, slots, prompt=10, step_s=0.1):
    """A batch engine on a fake clock: ``slots`` rows run at once, one token per running row per step
    (the prompt with the first one). Returns (ETA, true time left) after every step."""
    clock = Clock()
    p = Progress(total_rows=len(lengths), stream=io.StringIO(), clock=clock)
    waiting = list(enumerate(lengths))
    running: dict[int, list[int]] = {}
    readings = []
    while waiting or running:
        while waiting and len(running) < slots:
            key, length = waiting.pop(0)
            p.on_submitted(key, bound)
            running[key] = [length, 0]
        for key, state in list(running.items()):
            p.on_tokens(key, prompt if state[1] == 0 else 0, 1)
            state[1] += 1
            if state[1] == state[0]:
                p.on_row_done(key, failed=False)
                del running[key]
        p.on_step()
        clock.now += step_s
        readings.append((p.snapshot().eta_s, clock.now))
    end = clock.now
    return [(eta, end - t) for eta, t in readings]


def test_eta_when_the_short_rows_finish_first():
    """The issue's case: every row in flight, the short ones done first. Averages over finished rows
    said 'ETA 0s' here; the rows still running are bounded by max_tokens and by one token per step."""
    lengths = [6] * 12 + [40] * 12
    readings = simulate(lengths, bound=48, slots=24)
    for step, (eta, truth) in enumerate(readings[:-1], start=1):
        worst = (48 - step) * 0.1  # every row still running goes on to its bound
        assert eta is not None and 0.9 * truth <= eta <= worst + 1e-9, (step, eta, truth)
    assert readings[-1][0] == 0.0


def test_eta_is_there_from_the_first_step_and_settles():
    rng = random.Random(0)
    lengths = [rng.randint(1, 32) for _ in range(40)]
    readings = simulate(lengths, bound=32, slots=4)
    assert readings[0][0] is not None  # no finished row needed: the bounds say how much is left at most
    total = readings[0][1]
    for eta, truth in readings[:-1]:
        assert eta > 0
        if truth < 0.8 * total:  # once a fifth of the work is done: within a factor of two, and at the
            assert 0.5 * truth <= eta <= max(2.0 * truth, truth + 32 * 0.1), (eta, truth)  # tail within a bound


def test_eta_counts_prompt_work_too():
    """Rows that only embed (no generation bound): the prompt tokens left at the prompt rate."""
    clock = Clock()
    p = Progress(total_rows=4, stream=io.StringIO(), clock=clock)
    assert p.snapshot().eta_s is None  # nothing measured yet
    for key in range(2):
        p.on_submitted(key, 0)
        p.on_tokens(key, 100, 0)
        p.on_row_done(key, failed=False)
    p.on_step()
    clock.now += 1.0
    s = p.snapshot()
    assert s.rows_done == 2 and s.prompt_tps == 200.0
    assert abs(s.eta_s - 1.0) < 1e-9  # two rows of ~100 prompt tokens at 200 tok/s


def test_a_dropped_row_is_work_left_again():
    clock = Clock()
    p = Progress(total_rows=1, stream=io.StringIO(), clock=clock)
    p.on_submitted(0, 10)
    p.on_tokens(0, 5, 4)
    p.on_step()
    clock.now += 1.0
    before = p.snapshot().eta_s
    p.on_dropped(0)  # taken out of the engine to run again on its own
    assert p.snapshot().eta_s > before and p.inflight == 0


def test_resumed_rows_and_failures_count_toward_done():
    p = Progress(total_rows=10, resumed_rows=6, stream=io.StringIO(), clock=Clock())
    p.on_row_done(None, failed=True)
    s = p.snapshot()
    assert (s.rows_done, s.failed, s.eta_s) == (7, 1, None)
    assert "rows 7/10 (70.0%) | failed 1 |" in p.line()


def test_non_tty_prints_lines_at_the_interval():
    clock, stream = Clock(), io.StringIO()
    p = Progress(total_rows=None, stream=stream, log_interval=5.0, clock=clock)
    p.maybe_draw()
    assert stream.getvalue() == ""
    clock.now += 5.0
    p.maybe_draw()
    assert stream.getvalue().startswith("rows 0 | prompt 0 tok/s") and stream.getvalue().endswith("ETA --\n")
    p.close()  # no extra line off a terminal


def test_disabled_prints_nothing():
    clock, stream = Clock(), io.StringIO()
    p = Progress(total_rows=3, stream=stream, enabled=False, log_interval=0.0, clock=clock)
    clock.now += 10
    p.maybe_draw()
    p.close()
    assert stream.getvalue() == ""


def test_format_duration():
    assert [format_duration(s) for s in (0, 59.4, 61, 3600 * 2 + 65)] == ["0s", "59s", "1m01s", "2h01m"]


def test_replicas_progress_replayed_on_the_parent_matches_one_progress():
    """--replicas: each replica records its progress calls (decode tokens summed per row between
    flushes) and the parent replays them; with the steps of two engines counted per engine, the
    parent's line reads as one Progress fed every call directly."""
    from tokenmill.batch.replica_messages import ProgressRecorder, replay_progress

    clock, rng = Clock(), random.Random(1)
    lengths = [rng.randint(1, 20) for _ in range(30)]
    direct = Progress(total_rows=len(lengths), stream=io.StringIO(), clock=clock)
    parent = Progress(total_rows=len(lengths), stream=io.StringIO(), clock=clock, engines=2)
    recorders = [ProgressRecorder(), ProgressRecorder()]
    waiting = list(enumerate(lengths))
    running: dict[int, list[int]] = {}
    while waiting or running:
        for shard, recorder in enumerate(recorders):  # two engines, one step each per tick
            mine = [key for key in running if key % 2 == shard]
            for key, length in [w for w in waiting if w[0] % 2 == shard][: 3 - len(mine)]:
                waiting.remove((key, length))
                running[key] = [length, 0]
                for p in (direct, recorder):
                    p.on_submitted(key, 20)
            for key in [key for key in running if key % 2 == shard]:
                state = running[key]
                for p in (direct, recorder):
                    p.on_tokens(key, 7 if state[1] == 0 else 0, 1)
                state[1] += 1
                if state[1] == state[0]:
                    for p in (direct, recorder):
                        p.on_row_done(key, failed=key == 5)
                    del running[key]
            recorder.on_step()
            if rng.random() < 0.4:
                replay_progress(recorder.take(), parent)
        direct.on_step()
        clock.now += 0.1
        for recorder in recorders:
            replay_progress(recorder.take(), parent)
        a, b = direct.snapshot(), parent.snapshot()
        assert (a.rows_done, a.failed, direct.prompt_tokens, direct.generated_tokens, direct.inflight) == \
               (b.rows_done, b.failed, parent.prompt_tokens, parent.generated_tokens, parent.inflight)
        assert (a.eta_s is None) == (b.eta_s is None) and (a.eta_s is None or abs(a.eta_s - b.eta_s) < 1e-6)
    assert parent.rows_done == len(lengths) and parent.failed == 1 and parent.inflight == 0
