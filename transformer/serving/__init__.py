"""Serving: a FastAPI app (app.py) that translates JSON requests with the torch engine, and the one web
page it serves (static/index.html: type, see the French, the n-best and the cross-attention). The top
stage: it imports translation/ and checkpoints/; nothing in the package imports it. serve.py runs it
under uvicorn.
"""
