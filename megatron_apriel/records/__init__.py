"""The records both sides share, and the files and rules that carry them (a leaf: no torch, no httpx).

``base``: `Record`, the one base with one rule for kind, version and older versions. ``rollouts``:
problems, rollout groups and the trainer's view of a sample. ``stream``: the durable rollout
stream's segment files, the actor's snapshot and the trainer's progress. ``lag``: the policy-lag
bound and the actor's admission rule. ``weights``: the weight-sync messages between the trainer's
senders and the vLLM receivers. ``npy_base64``: the routed-experts payload. ``config``: the stream's
settings (``rollout.*``).
"""
