"""specfast's own runtime: a lean Llama-family transformer in torch (model.py), its static KV
cache (kv_cache.py), compiled static-shape steps (steps.py) and int8 weights on CPU (int8.py)."""
