"""The progress bar of ``LLM.generate`` and the other batch calls (vLLM's ``use_tqdm``): requests
done, with the tokens per second they produced."""

from __future__ import annotations

from typing import Any, Callable

from tokenmill.outputs import PoolingRequestOutput, RequestOutput

ProgressOption = bool | Callable[..., Any]  # vLLM's use_tqdm: on/off, or a tqdm-like factory


class RequestProgress:
    """tqdm bar: requests done, with generated tokens per second (prompt tokens for pooling models)."""

    def __init__(self, total: int, use_tqdm: ProgressOption):
        self.bar = None
        if callable(use_tqdm):  # vLLM: a tqdm-like factory, e.g. functools.partial(tqdm, leave=False)
            self.bar = use_tqdm(total=total, desc="Processed prompts")
        elif use_tqdm:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        self.tokens = 0

    def finished(self, output: RequestOutput | PoolingRequestOutput) -> None:
        if self.bar is None:
            return
        if isinstance(output, PoolingRequestOutput):
            kind, self.tokens = "input", self.tokens + len(output.prompt_token_ids)
        else:
            kind, self.tokens = "output", self.tokens + sum(len(c.token_ids) for c in output.outputs)
        elapsed = self.bar.format_dict.get("elapsed") or 1e-9
        self.bar.set_postfix_str(f"{kind} {self.tokens / elapsed:,.0f} tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
