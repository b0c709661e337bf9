"""Serving: a FastAPI app (app.py) that translates JSON requests with an engine (the cross-attention
with the torch engine), the batcher that gathers concurrent requests into one call (batcher.py, no
HTTP), and the one web page (static/index.html: type, see the French, the n-best and the
cross-attention). The top stage: it imports translation/; nothing in the package imports it.
serve.py runs it under uvicorn.
"""
