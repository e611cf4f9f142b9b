"""Old import paths, kept for one release: ``megatron_apriel.rollout.types`` re-exports the records
that moved to ``megatron_apriel.records.rollouts``. The actor is now ``megatron_apriel.actor``,
fleet access ``megatron_apriel.fleet`` and the stream ``megatron_apriel.records.stream``."""
