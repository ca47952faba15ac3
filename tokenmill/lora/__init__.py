"""LoRA adapters (PEFT folders) applied per request, as vLLM's ``LLM(enable_lora=True)`` and
``generate(..., lora_request=LoRARequest(...))``.

- ``request.py``: ``LoRARequest`` (vLLM's fields and equality).
- ``adapter.py``: reading and checking a PEFT folder against the model (engine side, at intake).
- ``layers.py``: the low-rank update of one linear layer over a few device slots.
- ``model.py``: a model's LoRA layers by module name, loading an adapter into a slot (every rank).
- ``slots.py``: which adapter sits in which device slot (engine side, once a step).
"""
