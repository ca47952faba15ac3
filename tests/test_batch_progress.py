"""Progress: token rates, an ETA from tokens (not rows), and the drawing policy."""

from __future__ import annotations

import io

from tokenmill.batch.progress import Progress, format_duration


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_eta_counts_tokens_not_rows():
    clock = Clock()
    p = Progress(total_rows=4, stream=io.StringIO(), clock=clock)
    for _ in range(2):
        p.on_submitted()
    assert p.snapshot().eta_s is None  # nothing finished: nothing to extrapolate from
    p.on_tokens(prompt=10, generated=1)
    p.on_tokens(prompt=10, generated=1)
    clock.now += 1.0
    p.on_tokens(0, 9)  # row A: 10 generated in all
    p.on_tokens(0, 1)  # row B: 2 so far
    p.on_row_done(False, prompt=10, generated=10, was_inflight=True)
    s = p.snapshot()
    assert s.rows_done == 1 and s.prompt_tps == 20.0 and s.generated_tps == 12.0
    # Left: row B (8 more generated) + 2 unstarted rows (10 prompt + 10 generated each).
    # Generation: 28 tokens at 12/s; prompts: 20 tokens at 20/s -> the larger, 28/12 s.
    assert abs(s.eta_s - 28 / 12) < 1e-9


def test_eta_with_only_decoding_left_ignores_finished_prompts():
    clock = Clock()
    p = Progress(total_rows=2, stream=io.StringIO(), clock=clock)
    p.on_submitted(), p.on_submitted()
    p.on_tokens(1000, 1), p.on_tokens(1000, 1)
    clock.now += 2.0
    p.on_tokens(0, 99)
    p.on_row_done(False, 1000, 100, was_inflight=True)
    # The other row has its prompt done and 1 of ~100 tokens: 99 left at 101/2 tok/s.
    assert abs(p.snapshot().eta_s - 99 / (101 / 2)) < 1e-9


def test_resumed_rows_and_failures_count_toward_done():
    p = Progress(total_rows=10, resumed_rows=6, stream=io.StringIO(), clock=Clock())
    p.on_row_done(True)
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
