"""The end of a `tokenmill run`: what it did, as a few lines on stderr, and its exit code."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.batch.progress import format_duration

EXIT_OK, EXIT_ROWS_FAILED, EXIT_INTERRUPTED = 0, 3, 130


@dataclass
class JobSummary:
    output: str
    rows_total: int | None
    rows_done: int  # all attempts together
    failed: int  # all attempts together
    resumed_rows: int  # done by earlier attempts
    prompt_tokens: int  # this attempt
    completion_tokens: int  # this attempt
    wall_s: float
    run_s: float  # wall time minus model loading
    complete: bool
    interrupted: bool = False
    already_complete: bool = False
    repaired_bytes: int = 0
    rebuilt_rows: int | None = None  # rows read back from the output past what the journal recorded
    errors: list[str] = field(default_factory=list)  # the first few failures of this attempt
    input: str = ""

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        return EXIT_ROWS_FAILED if self.failed else EXIT_OK

    def report(self) -> str:
        if self.already_complete:
            head = f"{self.output} is already complete: {self.rows_done} rows, {self.failed} failed (pass --overwrite to run again)"
            return head
        state = "interrupted" if self.interrupted else "done"
        total = f"/{self.rows_total}" if self.rows_total is not None else ""
        lines = [f"tokenmill run {state}: {self.rows_done}{total} rows, {self.failed} failed, wall time {format_duration(self.wall_s)}"]
        if self.rows_total == 0:
            lines.append(f"  warning: {self.input or 'the input'} has no rows, so there was nothing to generate")
        if self.rebuilt_rows is not None:
            lines.append(f"  read back: {self.rebuilt_rows} finished rows the journal had not recorded (missing, damaged or behind) "
                         "were read back from the output")
        if self.resumed_rows:
            lines.append(f"  resumed: {self.resumed_rows} rows were done by an earlier attempt")
        if self.repaired_bytes:
            lines.append(f"  repaired: cut {self.repaired_bytes} bytes of unfinished output left by the earlier attempt")
        run = max(self.run_s, 1e-9)
        lines.append(
            f"  tokens: {self.prompt_tokens:,} prompt, {self.completion_tokens:,} generated; "
            f"throughput {self.prompt_tokens / run:,.1f} prompt tok/s, {self.completion_tokens / run:,.1f} generated tok/s"
        )
        if self.errors:
            lines.append(f"  failures (the 'error' field of {self.output} has each one):")
            lines.extend(f"    {e}" for e in self.errors)
            more = self.failed - len(self.errors)  # past the first few, and an earlier attempt's
            if more > 0:
                lines.append(f"    ... and {more} more (every failed row is in {self.output} with its 'error' field set)")
        if self.interrupted:
            lines.append("  rerun the same command to continue where this attempt stopped")
        lines.append(f"  output: {self.output}")
        return "\n".join(lines)
