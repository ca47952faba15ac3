"""Pooling models (embed, classify, score, encode): their settings (`config.py`), the engine that
serves them (`engine.py`, chosen instead of the generation engine when `LLM()` starts), its
runner (`runner.py`), the poolers and heads' activations (`poolers.py`) and LLM's pooling
methods (`llm_methods.py`). The models themselves live in `tokenmill/models/`.
"""
