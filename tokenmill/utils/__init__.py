"""vLLM's small script helpers under their vLLM paths (``vllm.utils.argparse_utils``,
``vllm.utils.print_utils``), so a script built from vLLM's examples changes only its imports."""
