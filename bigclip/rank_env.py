"""The launcher's environment, read and checked without torch: which rank this process is.

Launchers and the variables they set (bigclip.distributed forms the process group from them):
  torchrun / deepspeed      RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
  srun (one task per GPU)   SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (+ MASTER_ADDR/PORT from the sbatch script)
  plain `python`            nothing: a world of one

Values no launcher writes (WORLD_SIZE=two, a RANK not below WORLD_SIZE, several ranks with no
MASTER_PORT to meet at: the variables set by hand, not by a launcher) fail here in one line, before
torch is imported, instead of deep in torch.distributed's set-up.
"""

from __future__ import annotations

from collections.abc import Mapping

from bigclip.errors import ConfigError

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
SLURM = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
_UNSET = "unset them to train as one process, or launch with torchrun (-m bigclip.train -- FLAGS), deepspeed or srun"


def read_launch_env(env: Mapping[str, str]) -> tuple[int, int, int]:
    """(rank, world_size, local_rank): torchrun's variables, else Slurm's, else a world of one."""
    for names in (TORCHRUN, SLURM):
        if names[0] in env and names[1] in env:
            rank, world = _whole(env, names[0]), _whole(env, names[1])
            local = _whole(env, names[2]) if names[2] in env else 0
            if world < 1 or not 0 <= rank < world or local < 0:
                raise ConfigError(
                    f"{names[0]}={rank} {names[1]}={world}: a launcher numbers ranks 0 to {names[1]} - 1 "
                    f"(and {names[2]} from 0); {_UNSET}"
                )
            return rank, world, local
    return 0, 1, 0


def check_rendezvous(env: Mapping[str, str]) -> None:
    """Several ranks need MASTER_PORT to meet at; every launcher sets it (torchrun, deepspeed, the
    slurm/ scripts), so its absence means the rank variables were set by hand."""
    rank, world, _ = read_launch_env(env)
    if world > 1 and "MASTER_PORT" not in env:
        names = TORCHRUN if "RANK" in env and "WORLD_SIZE" in env else SLURM
        raise ConfigError(
            f"{names[0]}={rank} and {names[1]}={world} are set but MASTER_PORT is not, so no launcher set them "
            f"and the other {world - 1} rank(s) will never come; {_UNSET} (an sbatch script exports "
            "MASTER_ADDR and MASTER_PORT: see `bigclip slurm`)"
        )


def _whole(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(
            f"{name}={env[name]!r} is not a whole number: launchers set it to this process's number; {_UNSET}"
        ) from None
