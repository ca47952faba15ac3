"""vLLM's offline examples, run in-process on tiny local models.

Each test makes the calls one of vLLM's example scripts makes (the path is in its docstring, as
read from vllm-project/vllm at the commit named there; the scripts are Apache-2.0) with only the
substitutions a vLLM user makes: the import (``vllm`` -> ``tokenmill``, the paths of
docs/from-vllm.md), the model (a tiny one from tests/conftest.py), and GPU-only settings. What an
example reads back from its results is read the same way here, and checked.
"""

from __future__ import annotations

import pytest

ENGINE = dict(dtype="float32", device="cpu", seed=0)


def test_flexible_argument_parser_and_print_embeddings(capsys):
    """examples/basic/offline_inference/*.py @41c5903d: the argument parser every example builds,
    an option the script adds taken with underscores as with dashes, and the embeddings printout."""
    from tokenmill import EngineArgs
    from tokenmill.utils.argparse_utils import FlexibleArgumentParser
    from tokenmill.utils.print_utils import print_embeddings

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model="m", runner="pooling", enforce_eager=True)
    sampling = parser.add_argument_group("Sampling parameters")
    sampling.add_argument("--max-tokens", type=int)
    args = vars(parser.parse_args(["--max_tokens", "5", "--max_model_len=64"]))
    assert (args["max_tokens"], args["max_model_len"], args["runner"], args["model"]) == (5, 64, "pooling", "m")
    with pytest.raises(SystemExit):  # an unknown option stays an error, as in argparse
        parser.parse_args(["--no_such_option", "1"])
    print_embeddings([0.5, 0.25, 0.125, 1.0, 2.0])
    print_embeddings([1.0], prefix="Reward")
    assert capsys.readouterr().out.splitlines()[-2:] == ["Embeddings: [0.5, 0.25, 0.125, 1.0, ...] (size=5)",
                                                         "Reward: [1.0] (size=1)"]
