"""Console logging of our processes (each component's stdout and stderr go to run_dir/logs/<component>.log)."""

from __future__ import annotations

import logging
import os
import warnings


def setup_logging(component: str = "rank") -> None:
    """INFO on the first trainer rank and in the other components, WARNING on the other ranks; each
    line labelled with the component (``rank<N>`` for a trainer rank)."""
    rank = int(os.environ.get("RANK", "0"))
    label = f"rank{rank}" if component == "rank" else component
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s {label}] %(message)s", datefmt="%H:%M:%S", force=True)
    logging.getLogger("megatron").setLevel(logging.WARNING)  # Megatron logs every config at INFO
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # Expected on CPU: Megatron announces each torch fallback for the absent Apex/TE kernels.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
