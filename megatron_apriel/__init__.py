"""megatron_apriel: Megatron-Core RL post-training backend for the Apriel-1.5-OpenReasoner recipe.

Layers, lowest first. A module imports only from its own layer or from lower ones; within the
layer of the two sides, a side (between ``|``) does not import another. Names are dotted paths
under ``megatron_apriel``; a package name covers its modules, ``*.config`` every config leaf, and
the longest name that matches a module places it (a layer may take several lines).
``tests/unit/config/test_layers.py`` reads this table and the package's imports.

    0 settings:      config conf *.config choices rewards sampling
    0 records:       records rollout model.arch parallel.dims
    0 processes:     stop lifetime process logs metrics refusals run_dir files
    1 parallel:      _patches parallel
    2 model:         model
    3 convert, plan: convert plan
    4 sync, verify:  weight_sync verifiers envs serving
    5 data:          data tokenizer
    6 fleet access:  fleet
    7 sides:         trainer | actor eval | tiny
    8 launchers:     launch slurm
    9 entry points:  entrypoints

Leaves import no torch and no httpx (at module level: the standard library, pydantic, the
records' numpy, Hydra for ``config``, psutil for ``process``); ``import megatron_apriel.config``
loads no torch, numpy or httpx. ``testing/`` holds helpers for tests and benchmarks; no library
module imports it. No entry point imports another.
"""

__version__ = "0.1.0"
