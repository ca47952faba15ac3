"""The `tokenmill run` batch job: streaming readers, resume journal, writers, progress (see docs/batch.md)."""
