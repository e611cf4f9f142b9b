"""Running a config on a SLURM cluster: the job's settings (`SlurmConfig`), the layout it implies
(`JobLayout`), the checks made before submitting, and the rendering of ``slurm/train.sbatch``."""

from megatron_apriel.slurm.config import SlurmConfig

__all__ = ["SlurmConfig"]
