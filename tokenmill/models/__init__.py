"""Model code: resolving a model name to files (source.py), building and loading models
(registry.py, loader.py), the Llama-family decoders (llama.py) and their layers (layers/).

Nothing is imported here so that ``import tokenmill`` stays fast; import the submodules.
"""
