"""Re-export of `megatron_apriel.records.rollouts` under its old path (the public contract keeps it
for one release); new code imports ``megatron_apriel.records.rollouts``."""

from megatron_apriel.records.rollouts import (  # noqa: F401  (re-exported)
    DETAIL_CHARS,
    DOMAINS,
    EVAL_DOMAINS,
    READ_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    GroupTimings,
    Outcome,
    Problem,
    Rollout,
    RolloutGroup,
    RoutedExperts,
    TrainSample,
    VersionSpan,
    balance_by_tokens,
    routing_rows,
)
