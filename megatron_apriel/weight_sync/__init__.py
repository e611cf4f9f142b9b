"""Trainer -> vLLM weight updates: typed messages, checksummed buckets, per-stage broadcast.

``sender`` runs in the trainer ranks and never imports vLLM; ``receiver`` runs inside the vLLM
workers (registered as a native weight-transfer engine). ``buckets`` and ``wire`` are shared; the messages
are records (``megatron_apriel.records.weights``).
"""
