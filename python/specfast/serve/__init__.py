"""`specfast serve`: OpenAI's HTTP API over one model, keeping each conversation's KV cache.

protocol.py checks request bodies and shapes responses; pool.py holds the live Sessions, matched
to each request by longest common prefix, and the n-gram corpus; app.py has the routes and the
one worker thread that generates. Needs the `specfast[serve]` extra (starlette, uvicorn).
"""
