"""The OpenAI-compatible server: the web layer (app.py), the request and response shapes
(protocol.py), the continuous-batching loop (scheduler.py) and its metrics (metrics.py)."""
