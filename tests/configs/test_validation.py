"""Validation before launch: every bad input is reported with its key, value, rule and fix, all at once,
before any process or process group exists."""

import sys

import pytest
import torch
from hydra.errors import ConfigCompositionException
from cli_helpers import composed

from lightning_mgpu.cli.train import train
from lightning_mgpu.cli.errors import ConfigError
from lightning_mgpu.cli.machine import machine_problems
from lightning_mgpu.cli.spec import config_problems
from lightning_mgpu.cli.validate import check_run

PP2 = ["parallel.pipeline_parallel_size=2"]

BAD_INPUTS = [
    (["trainer.devices=6", "parallel.tensor_parallel_size=4"], "world_size=6 is not divisible by"),
    (["trainer.devices=3", "parallel.tensor_parallel_size=3"], "does not divide n_heads=4"),
    (["trainer.devices=4", "parallel.tensor_parallel_size=4"], "does not divide n_kv_heads=2"),
    (["parallel.tensor_parallel_size=2", "model.ffn_hidden=191"], "does not divide ffn_hidden=191"),
    ([*PP2, "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_pipeline_size=4"],
     "8 stages is more than the model's n_layers=4"),
    (["parallel.pipeline_schedule=zigzag"], "parallel.pipeline_schedule='zigzag' is unknown"),
    (["trainer.devices=4", "parallel.pipeline_parallel_size=4", "data.global_batch_size=8"],
     "needs parallel.num_microbatches >= parallel.pipeline_parallel_size=4 (got 2)"),
    (["parallel.zero_stage=4"], "parallel.zero_stage=4 is not a ZeRO stage"),
    ([*PP2, "trainer.accumulate_grad_batches=2"], "trainer.accumulate_grad_batches=2 is not supported with pipeline"),
    (["parallel.zero_stage=0", "parallel.offload_optimizer=cpu"], "parallel.offload_optimizer='cpu' needs ZeRO"),
    ([*PP2, "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_size=2", "parallel.zero_stage=3"],
     "parallel.zero_stage=3 cannot run parallel.pipeline_schedule='zbv'"),
    (["data.global_batch_size=30"], "data.global_batch_size=30 is not divisible by data.micro_batch_size"),
    (["data.seq_len=512"], "data.seq_len=512 exceeds the model's max_seq_len=256"),
    (["model.name=llama9"], "model.name='llama9' is unknown"),
    (["trainer.precision=fp8"], "trainer.precision='fp8' is not supported"),
    (["optim=muon", "parallel.zero_stage=2", "parallel.offload_optimizer=cpu"],
     "parallel.offload_optimizer='cpu' with Muon: Muon's whole-matrix step gathers ZeRO partitions in device memory"),
    (["optim.name=sgd"], "optim.name='sgd' is unknown; choose adamw or muon"),
    (["optim=muon", "optim.muon_ns_dtype=float16"], "optim.muon_ns_dtype='float16' is unknown"),
    (["trainer.devices=0"], "trainer.devices=0 must be an integer >= 1"),
    (["data.micro_batch_size=0"], "data.micro_batch_size=0 must be a positive integer"),
    (["data=tokens", "data.path=/no/such/tokens.u16"], "data.path='/no/such/tokens.u16' does not exist"),
    (["data=tokens", "data.path=/dev/null"], "data.path='/dev/null' does not exist"),  # a device is no token file
    (["model.vocab_size=64"], "model.vocab_size=64 is smaller than the 256 byte tokens"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=True needs parallel.tensor_parallel_size > 1"),
    (["parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true", "data.seq_len=127"],
     "data.seq_len=127 is not a multiple of 2 (sequence parallelism splits each rank's tokens over "
     "tensor_parallel_size=2); use 126 or 128"),
    (["trainer.devices=4", "parallel.context_parallel_size=4", "data.seq_len=100"],
     "data.seq_len=100 is not a multiple of 8 (context_parallel_size=4 gives each rank 2 of 8 equal chunks); use 96 "
     "or 104"),
    (["trainer.devices=6", "parallel.context_parallel_size=4"],
     "world_size=6 is not divisible by tensor*context*pipeline_parallel_size=1*4*1=4; the world must hold whole copies "
     "of the model: with parallel.tensor_parallel_size=1 and parallel.pipeline_parallel_size=1 choose "
     "parallel.context_parallel_size from 1, 2, 3 or 6"),
    (["model.compile=true", "parallel.zero_stage=3"], "model.compile=true cannot compile blocks under ZeRO-3"),
    (["model.compile=true", "model.compile_backend=fastest"],
     "model.compile_backend='fastest' is not a torch.compile backend; choose inductor (fused kernels) or aot_eager"),
    (["parallel.context_parallel_size=0"], "parallel.context_parallel_size=0 must be a positive integer"),
    (["parallel.offload_params=cpu"], "parallel.offload_params='cpu' needs ZeRO stage 3"),
    (["parallel.offload_optimizer=disk"], "parallel.offload_optimizer='disk' is not an offload device"),
    ([*PP2, "parallel.virtual_pipeline_size=2"], "virtual_pipeline_size=2 needs a multi-stage schedule"),
    ([*PP2, "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_pipeline_size=2",
      "data.global_batch_size=12"], "needs parallel.num_microbatches divisible by parallel.pipeline_parallel_size=2 (got 3)"),
    ([*PP2, "parallel.pipeline_schedule=dualpipev", "parallel.virtual_pipeline_size=2", "data.global_batch_size=8"],
     "parallel.pipeline_schedule='dualpipev' needs parallel.num_microbatches >= its 2*pipeline_parallel_size=4 stages (got 2)"),
    (["trainer.accelerator=tpu"], "trainer.accelerator='tpu' is unknown"),
    (["optim.lr=0"], "optim.lr=0.0 must be > 0"),
    (["optim.betas=[0.9]"], "optim.betas=[0.9] must be two numbers in [0, 1)"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio=2.0 must be between 0 and 1"),
    ([*PP2, "model.tie_embeddings=true"], "model.tie_embeddings=True cannot be split into pipeline stages"),
    ([*PP2, "trainer.precision=16-mixed"], "'16-mixed' is not supported with pipeline parallelism"),
    ([*PP2, "parallel.pipeline_boundaries=[0,3,2]"], "parallel.pipeline_boundaries=[0, 3, 2] must be 3 strictly"),
    (["data=text", "data.files=[/no/such/dir/*.txt]"], "data.files pattern '/no/such/dir/*.txt' matches no file"),
    (["model.dim=30"], "model: dim=30 is not divisible by n_heads=4"),
    (["optim.lr_scaling=cubic"], "optim.lr_scaling='cubic' is unknown"),
    (["data.val_fraction=0"], "data.val_fraction=0.0 must be between 0 and 1"),
    (["parallel.num_microbatches=0"], "num_microbatches=0 must be a positive integer"),
    (["trainer.num_nodes=0"], "trainer.num_nodes=0 must be an integer >= 1"),
    (["cluster=torchrun"], "cluster=torchrun, but this process was not started by torchrun"),
    (["cluster=slurm"], "use `mgpu-train -m cluster=slurm ...`"),
    (["trainer.max_time=12h"], "trainer.max_time='12h' must be days:hours:minutes:seconds"),
    (["trainer.limit_val_batches=2.5"], "trainer.limit_val_batches=2.5 must be a fraction in [0, 1]"),
    (["trainer.num_sanity_val_steps=-2"], "trainer.num_sanity_val_steps=-2 must be >= 0"),
    (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0 must be an integer >= 1"),
    (["trainer.max_epochs=2"], "trainer.max_epochs=2 never happens: the training stream is endless"),
    (["trainer.check_val_every_n_epoch=1"], "trainer.check_val_every_n_epoch=1 never happens"),
    (["trainer.limit_train_batches=4", "trainer.check_val_every_n_epoch=1", "trainer.val_check_interval=5"],
     "trainer.val_check_interval=5 is longer than an epoch (trainer.limit_train_batches=4)"),
    (["logger.csv.flush_logs_every_n_steps=0"], "logger.csv.flush_logs_every_n_steps=0 must be an integer >= 1"),
    (["+trainer.max_epoch=3"], "trainer.max_epoch is not a setting; did you mean trainer.max_epochs"),
    (["data=tokens"], "data.path is not set: data=tokens reads a flat token file"),
    (["trainer.devices=8", "data.global_batch_size=16"],  # both nearest multiples are 32: named once
     "use data.global_batch_size=32, or data.micro_batch_size=1 or 2 (it must divide the 2 samples per rank)"),
    (["parallel.replicas=2"], "parallel.replicas=2 splits the data-parallel ranks into groups that synchronise on "
                              "their own, which parallel.replica_update='sync' does not do"),
    (["parallel.replicas=3", "parallel.replica_update=local"],
     "parallel.replicas=3 does not divide the 2 data-parallel ranks; choose 1, 2"),
    (["parallel.replica_update=async"], "parallel.replica_update='async' needs more than one replica"),
    (["parallel.replicas=2", "parallel.replica_update=async", "parallel.max_staleness=-1"],
     "parallel.max_staleness=-1 must be an integer >= 0"),
    (["parallel.replicas=2", "parallel.replica_update=async", "checkpoint.every_n_steps=5"],
     "replica_update='async' cannot save or resume checkpoints"),
    (["parallel.replicas=2", "parallel.replica_update=local", "trainer.max_time=00:01:00:00"],
     "trainer.max_time='00:01:00:00' makes every rank meet after every batch"),
    (["trainer.devices=4", "parallel.replicas=2", "parallel.replica_update=async", "parallel.tensor_parallel_size=2"],
     "parallel.max_staleness=2 lets the ranks of one replica continue from different versions"),
    (["cluster.max_restarts=2"], "cluster.max_restarts=2 needs checkpoint.resume=auto and checkpoint.every_n_steps"),
    (["cluster.max_restarts=-1"], "cluster.max_restarts=-1 must be an integer >= 0"),
    (["parallel.slow_ranks={5: 2.0}"], "parallel.slow_ranks=5 is not a rank of this job (ranks 0 to 1)"),
    (["parallel.slow_ranks={1: 0.5}"], "parallel.slow_ranks={1: 0.5} must slow the rank by a factor >= 1"),
    (["parallel.replica_update=local", "parallel.sync_every=0"], "parallel.sync_every=0 must be a positive integer"),
    (["parallel.replica_update=local", "parallel.zero_stage=0", "trainer.precision=bf16-mixed"],
     "parallel.zero_stage=0 with trainer.precision='bf16-mixed' keeps no fp32 master weights"),
    (["parallel.replica_update=local", "checkpoint.every_n_steps=5", "checkpoint.format=deepspeed"],
     "replica_update='local' saves each replica's round in universal checkpoints only"),
    (["parallel.replica_update=local", "parallel.outer_optimizer.name=adam"],
     "parallel.outer_optimizer='adam' is unknown; choose nesterov or sgd"),
    (["trainer.max_steps=10", "profile.steps=[5,10,-1]"],
     "profile.steps=[5, 10, -1]: 10, -1 are not steps of this run, which trains steps 0 to 9 (trainer.max_steps=10), "
     "counted from 0 as metrics.csv counts them; choose steps in that range, or raise trainer.max_steps"),
    (["profile.largest_tensors=-1"], "profile.largest_tensors=-1 must be an integer >= 0"),
]


@pytest.mark.parametrize("overrides, fragment", BAD_INPUTS, ids=[f[:48] for _, f in BAD_INPUTS])
def test_each_bad_input_is_named_with_its_fix(overrides, fragment):
    problems = config_problems(composed(*overrides))
    assert any(fragment in p for p in problems), problems


def test_data_text_refuses_parquet_arrow_and_saved_datasets_by_name(tmp_path):
    """Without a tokenizer data=text reads a file's bytes as text: a Parquet or Arrow file would train on its encoding,
    and a saved dataset (a directory) is not read at all. Each is named, every one at once, with mgpu-prepare as the
    fix; a tokenizer reads Parquet and Arrow rows (as mgpu-prepare does), so only the directory is refused then."""
    from helpers import make_tokenizer

    for name in ("a.parquet", "b.pq", "c.arrow", "d.txt"):
        (tmp_path / name).write_bytes(b"PAR1")  # the rule goes by the name: nothing is read before launch
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "state.json").write_text("{}")
    files = f"data.files=['{tmp_path}/*.p*q*','{tmp_path}/c.arrow','{tmp_path}/saved','{tmp_path}/d.txt']"
    problems = [str(p) for p in config_problems(composed("data=text", files))]
    fix = "and train with data=tokens data.path=DIR"
    assert [p for p in problems if "data.files" in p] == [
        f"data.files pattern '{tmp_path}/*.p*q*' matches the Parquet/Arrow file(s) '{tmp_path}/a.parquet', "
        f"'{tmp_path}/b.pq', which data=text without a tokenizer would read as raw bytes, not as rows of text; "
        f"tokenise them with `mgpu-prepare --tokenizer PATH --out DIR '{tmp_path}/*.p*q*'` {fix} (or give "
        "data.tokenizer=PATH)",
        f"data.files pattern '{tmp_path}/c.arrow' matches the Parquet/Arrow file(s) '{tmp_path}/c.arrow', which "
        "data=text without a tokenizer would read as raw bytes, not as rows of text; tokenise them with `mgpu-prepare "
        f"--tokenizer PATH --out DIR {tmp_path}/c.arrow` {fix} (or give data.tokenizer=PATH)",
        f"data.files pattern '{tmp_path}/saved' matches '{tmp_path}/saved', a dataset written by save_to_disk, which "
        f"data=text does not read (it reads files); tokenise it with `mgpu-prepare --tokenizer PATH --out DIR "
        f"{tmp_path}/saved` (with --split NAME for a DatasetDict) {fix}",
    ]
    tokenizer = make_tokenizer(tmp_path / "tok", vocab_size=300, n_bytes=20_000)
    with_tokenizer = [str(p) for p in config_problems(composed("data=text", files, f"data.tokenizer={tokenizer}"))]
    assert [p for p in with_tokenizer if "data.files" in p] == [problems[-1]]


def test_the_table_covers_many_distinct_rules():
    assert len({fragment for _, fragment in BAD_INPUTS}) >= 25


def test_defaults_and_every_recipe_are_clean():
    assert config_problems(composed()) == []


def test_every_problem_is_listed_at_once_before_anything_starts(tmp_path):
    cfg = composed("trainer.devices=3", "parallel.tensor_parallel_size=3", "parallel.zero_stage=5",
                   "data.seq_len=512", "optim.lr=-1", "trainer.precision=fp8")
    with pytest.raises(ConfigError, match="Invalid configuration") as err:
        train(cfg, tmp_path / "run")
    message = str(err.value)
    for fragment in ("n_heads=4", "n_kv_heads=2", "zero_stage=5", "data.seq_len=512", "optim.lr=-1", "fp8"):
        assert fragment in message
    assert not (tmp_path / "run").exists()  # refused before writing anything


def test_a_gpu_trainer_needs_the_gpus_it_asks_for(monkeypatch):
    """Refused before launch, naming what is visible; not at SLURM submission (the job runs elsewhere), but again
    inside the job."""
    visible = torch.cuda.device_count()
    for overrides in (["trainer=gpu"], ["trainer.accelerator=cuda"]):
        cfg = composed(*overrides, f"trainer.devices={visible + 1}")
        assert config_problems(cfg) == []  # the configuration itself is fine; this machine is not
        [problem] = machine_problems(cfg)
        assert f"trainer.devices={visible + 1} with trainer.accelerator={cfg.trainer.accelerator} needs " \
               f"{visible + 1} visible CUDA GPU" in problem
        assert f"this machine has {visible} (torch.cuda.device_count()" in problem and "trainer=cpu" in problem
        with pytest.raises(ConfigError, match="visible CUDA GPU"):
            check_run(cfg)
    if visible:
        assert machine_problems(composed("trainer=gpu", f"trainer.devices={visible}")) == []
    assert machine_problems(composed("trainer=cpu", "trainer.devices=4")) == []
    submitted = composed("recipe=llama3_70b_8node")  # cluster=slurm, 8 GPUs a node
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    assert machine_problems(submitted) == []  # at submission
    monkeypatch.setenv("SLURM_JOB_ID", "42")  # inside the job
    if visible < 8:
        assert "needs 8 visible CUDA GPUs" in machine_problems(submitted)[0]


@pytest.mark.parametrize("logger, extra", [("wandb", "wandb"), ("mlflow", "mlflow"), ("tensorboard", "tensorboard")])
def test_a_logger_without_its_package_names_the_extra(monkeypatch, logger, extra):
    cfg = composed(f"logger=[csv,{logger}]")
    assert machine_problems(cfg) == []  # the test extra installs every logger's package
    for module in ("wandb", "mlflow", "tensorboard", "tensorboardX"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed: find_spec and import fail
    [problem] = machine_problems(cfg)
    assert problem.startswith(f"logger={logger} needs the ") and f"pip install 'lightning_mgpu[{extra}]'" in problem


def test_unknown_recipe_fails_at_composition():
    with pytest.raises(ConfigCompositionException, match="llama3_1t"):
        composed("recipe=llama3_1t")
