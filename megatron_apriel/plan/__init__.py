"""Sizing of trainer and rollout-fleet layouts for a base model and a cluster (pure arithmetic).

``params``: the parameter tensors of one pipeline stage, as Megatron builds them. ``buffers``:
Megatron DDP's contiguous parameter/gradient buffers and the distributed optimizer's shards,
laid out exactly as Megatron lays them out. ``activations``: an estimate of the activations one
micro-batch keeps for backward. ``servers``: vLLM servers and weight-update traffic. ``layouts``:
every valid (tp, pp, dp) with its per-GPU memory, and the recommended one.
"""
