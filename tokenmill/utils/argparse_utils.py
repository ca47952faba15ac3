"""`FlexibleArgumentParser`: the parser vLLM's example scripts build their options with.

It is an ``argparse.ArgumentParser`` that takes an option spelled with underscores or dashes
(``--max_tokens`` and ``--max-tokens``), as vLLM's does, for the options a script adds itself;
``EngineArgs.add_cli_args`` registers both spellings of the engine's already. vLLM's other parser
extras (``--config`` YAML files, ``--json-arg.key value``, ``-O3``) are serving-CLI conveniences
tokenmill does not have: such an argument is an unknown option, as in a plain ArgumentParser.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any

# The option's name: what follows "--", up to "=" or "." (vLLM leaves dotted JSON keys alone).
_OPTION_NAME = re.compile(r"^--([^=.]*)")


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that reads ``--a_b`` as ``--a-b``."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        # vLLM passes deprecated= (Python 3.13's keyword) on every Python; older ones refuse it.
        if sys.version_info < (3, 13):
            kwargs.pop("deprecated", None)
        return super().add_argument(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([_dashed(arg) for arg in argv], namespace)


def _dashed(arg: str) -> str:
    return _OPTION_NAME.sub(lambda m: "--" + m.group(1).replace("_", "-"), arg, count=1) if arg.startswith("--") else arg
