"""Starting a run's processes and watching them: what ``apriel-train`` does on one machine, and the
checks and steps the SLURM job shares with it.

- ``preflight.py``: every check that can run before a process starts (the launch and the dry run
  run the same ones; SLURM's ``prepare`` step too), and the tiny base model;
- ``components.py``: the processes of a run and their command lines (servers, actor, trainer);
- ``local.py``: the local launcher (start, restart a crashed server or actor, stop together);
- ``progress.py``: the progress bar and each step's metrics on the console;
- ``report.py``: the dry run's report; ``export.py``: the final checkpoint as a Hugging Face model.

Each process is a ``megatron_apriel.process.ManagedProcess``: its own process group, dead with
its owner, and nothing it started left behind when it is stopped.
"""
