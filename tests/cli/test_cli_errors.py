"""What a user sees when a command line is wrong: the problem list on stderr, exit status 2, no traceback
(unless HYDRA_FULL_ERROR=1); a real crash keeps its traceback; ``--help`` works for every tool.

Three ``mgpu-train`` command lines run as the console script a user types (Hydra's own reporting is part of what
is tested), started at once; the other checks call the same ``main`` functions the console scripts call.
"""

import os
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import composed
from forked_cli import popen_cli

from lightning_mgpu.cli import export, plan, train
from lightning_mgpu.cli.errors import EXIT_REFUSED, refusal_message

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """name -> (exit status, stderr) of each ``mgpu-train`` command line below, run concurrently."""
    tmp = tmp_path_factory.mktemp("cli_errors")
    refused = ["trainer=gpu", "data.global_batch_size=30", "trainer.max_time=12h", "parallel.zero_stage=5",
               "trainer.max_epochs=2", f"hydra.run.dir={tmp / 'refused'}"]
    lines = {"config": refused, "typo": ["trainer.max_step=3"], "full_error": refused}
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    procs = {name: popen_cli([str(BIN / "mgpu-train"), *args], cwd=tmp,
                             env=dict(env, HYDRA_FULL_ERROR="1") if name == "full_error" else env)
             for name, args in lines.items()}
    out = {}
    for name, proc in procs.items():
        stderr = proc.communicate(timeout=240)[1]
        out[name] = (proc.returncode, stderr)
    assert not (tmp / "refused" / "config.yaml").exists()  # refused before the run wrote anything
    return out


def assert_refused(code, stderr, *fragments):
    assert code == EXIT_REFUSED, stderr[-3000:]
    assert "Traceback" not in stderr and "Error executing job" not in stderr and "HYDRA_FULL_ERROR" not in stderr
    for fragment in fragments:
        assert fragment in stderr, stderr


def test_a_refused_configuration_lists_every_problem_and_exits_2(ran):
    visible = torch.cuda.device_count()
    code, stderr = ran["config"]
    assert stderr.startswith("Invalid configuration:\n")  # nothing before the list
    assert_refused(code, stderr,
                   "- data.global_batch_size=30 is not divisible by data.micro_batch_size x data-parallel size",
                   "- trainer.max_time='12h' must be days:hours:minutes:seconds",
                   "- parallel.zero_stage=5 is not a ZeRO stage", "- trainer.max_epochs=2 never happens")
    if visible < 8:
        assert (f"- trainer.devices=8 with trainer.accelerator=gpu needs 8 visible CUDA GPUs; this machine has "
                f"{visible} (torch.cuda.device_count()") in stderr


def test_a_composition_error_is_a_clean_refusal(ran):
    assert_refused(*ran["typo"], "trainer.max_step is not a setting; did you mean trainer.max_steps")


def test_hydra_full_error_shows_the_traceback(ran):
    code, stderr = ran["full_error"]
    assert code == 1 and "Traceback" in stderr and "ConfigError" in stderr and "parallel.zero_stage=5" in stderr


def test_help_works_for_every_tool(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["mgpu-train", "--help"])
    for main, fragment in ((train.main, "logger: csv, mlflow, tensorboard, wandb"),
                           (lambda: plan.main(["--help"]), "KEY=VALUE"), (lambda: export.main(["--help"]), "--dtype")):
        with pytest.raises(SystemExit) as exit_:
            main()
        assert exit_.value.code == 0 and fragment in capsys.readouterr().out


def test_plan_and_export_refuse_the_same_way(tmp_path, capsys):
    for main, args, fragments in (
            (plan.main, ["plan.gpu=h100", "trainer.devices=0"],
             ("Invalid configuration:", "plan.gpu='h100' is unknown", "did you mean h100_80gb", "trainer.devices=0")),
            (plan.main, ["trainer.devics=8"], ("trainer.devics is not a setting; did you mean trainer.devices",)),
            (export.main, [str(tmp_path / "nothing"), str(tmp_path / "out")],
             ("Invalid arguments:", "nothing' is not a directory"))):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        stderr = capsys.readouterr().err
        assert exit_.value.code == EXIT_REFUSED and all(f in stderr for f in fragments), stderr


def test_a_real_crash_is_not_a_refusal(tmp_path, monkeypatch, capfd):
    """A directory that looks like a universal checkpoint but holds garbage is refused as damaged, naming the file
    (exit 2); an error that is not a refusal (here the reader failing) leaves ``main`` as it is (the interpreter
    prints its traceback and exits 1)."""
    (tmp_path / "torn").mkdir()
    for name in (".metadata", "trainer_state.pt"):
        (tmp_path / "torn" / name).write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit) as exit_:
        export.main([str(tmp_path / "torn"), str(tmp_path / "out")])
    assert exit_.value.code == EXIT_REFUSED and "trainer_state.pt is not a readable trainer state" in capfd.readouterr().err

    def crash(path):
        raise RuntimeError("the disk went away")

    monkeypatch.setattr(export, "read_trainer_state", crash)  # the first read of a universal checkpoint
    with pytest.raises(Exception) as err:
        export.main([str(tmp_path / "torn"), str(tmp_path / "out")])
    assert not isinstance(err.value, SystemExit) and refusal_message(err.value) is None


COMPOSITION_ERRORS = [  # what a new user mistypes, and the line they get
    (["trainer.max_step=3"], "trainer.max_step is not a setting; did you mean trainer.max_steps"),
    (["trainr.devices=2"], "trainr is not a setting; did you mean trainer?"),
    (["parallel.zero_stage=two"], "parallel.zero_stage: Value 'two' of type 'str' could not be converted to Integer"),
    (["trainer.limit_val_batches=all"], "trainer.limit_val_batches: Value 'all' of type 'str' could not be converted"),
    (["model=llama3_9b"], "model=llama3_9b is not an option of model; choose one of deepseek_moe_16b, hf, llama3_1b, "
                          "llama3_405b"),
    (["recipe=llama3_1t"], "recipe=llama3_1t is not an option of recipe; choose one of deepseek_moe_16b_1node, "
                           "deepseek_v3_hf_32node, finetune_8b_1node, gpt_oss_120b_hf_lora_2node, llama3_1b_1node"),
    (["logger=tensorbord"], "choose one of csv, mlflow, tensorboard, wandb; did you mean tensorboard?"),
    (["logger=[csv,tensorbord]"], "logger=tensorbord is not an option of logger"),
    (["logger.wandb.project=x"], "needs logger=wandb or logger=[csv,wandb]"),
    (["trainer.devices"], "'trainer.devices' is not an override: missing EQUAL at '<EOF>'"),
    (["data=text", "data.files=a.txt"], "data.files: Invalid value assigned: str is not a ListConfig"),
    (["parallel.timeout_s=30"], "parallel.timeout_s was renamed parallel.timeout"),  # old keys name the new ones
    (["checkpoint.consolidated=true"], "checkpoint.consolidated was renamed checkpoint.save_consolidated_weights"),
    (["trainer.throughput=false"], "trainer.throughput was renamed throughput.enabled"),
    (["trainer.check_memory=false"], "trainer.check_memory was renamed cluster.check_memory"),
]


@pytest.mark.parametrize("overrides, line", COMPOSITION_ERRORS, ids=[o[0] for o, _ in COMPOSITION_ERRORS])
def test_each_composition_error_reads_as_one_line(overrides, line):
    with pytest.raises(Exception) as err:
        composed(*overrides)
    message = refusal_message(err.value)
    assert message is not None and message.startswith("Invalid command line:\n  - ") and line in message, message


def test_other_errors_are_not_refusals():
    assert refusal_message(RuntimeError("a crash")) is None
    assert refusal_message(AssertionError("a bug")) is None
