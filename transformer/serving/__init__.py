"""Serving: a FastAPI app (app.py) that translates JSON requests with an engine (the cross-attention
with the torch engine) and shows one text's search step by step (explain_response.py: POST /explain's
answer, the torch engine), the batcher that gathers concurrent requests into one call (batcher.py, no
HTTP), uvicorn with the limits that keep the server answering whatever its clients do (server.py), and
the one web page (static/index.html: type, see the French, the n-best, the cross-attention and the
search step by step).
The top stage: it imports translation/ (and checkpoints/ for names); nothing in the package imports it.
serve.py runs it.
"""
