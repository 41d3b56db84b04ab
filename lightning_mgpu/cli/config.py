"""Structured (dataclass) schemas of the Hydra configs: a typo'd key or a wrong type fails at composition.

Each group mirrors one constructor: ``model`` -> :class:`LlamaConfig`, ``data`` -> the data modules,
``parallel`` -> :class:`MGPUStrategy`, ``trainer`` -> ``lightning.Trainer``, ``logger`` -> its ``logger`` argument,
``optim`` -> :class:`LLMModule`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from lightning_mgpu.cli.config_resilience import BadStepsConfig, SilentCorruptionConfig


@dataclass
class ModelConfig:
    """A named Llama shape, with optional overrides of single fields."""

    name: str = "tiny"  #: tiny | llama3_1b | llama3_8b | llama3_70b | llama3_405b | hf (a transformers model: path)
    activation_checkpointing: str = "none"  #: none | selective (recompute all but matmuls) | full
    compile: bool = False  #: torch.compile each transformer block
    compile_backend: str = "inductor"  #: inductor (fused kernels) | aot_eager (traces, generates no code)
    init_seed: int = 0  #: initial weights depend only on this
    dim: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    ffn_hidden: Optional[int] = None
    vocab_size: Optional[int] = None
    max_seq_len: Optional[int] = None
    tie_embeddings: Optional[bool] = None
    rope_theta: Optional[float] = None
    head_dim: Optional[int] = None  #: width of one attention head (0 = dim // n_heads)
    qk_norm: Optional[bool] = None  #: RMSNorm over each head of the queries and keys (Qwen3)
    #: mixture of experts (``LlamaConfig``'s fields, null: the named shape's): experts per MoE layer (0 = dense)
    num_experts: Optional[int] = None
    experts_per_token: Optional[int] = None  #: top-k
    expert_hidden: Optional[int] = None  #: each expert's SwiGLU width (0 = ffn_hidden)
    shared_experts: Optional[int] = None  #: experts every token goes through, besides its routed ones
    dense_layers: Optional[int] = None  #: the first N layers keep the dense MLP (ffn_hidden wide)
    router_score: Optional[str] = None  #: softmax | sigmoid
    router_renormalize: Optional[bool] = None  #: the top-k weights divided by their sum
    router_scale: Optional[float] = None  #: the routed weights multiplied by it
    aux_loss: Optional[str] = None  #: none | micro_batch | sequence | global_batch: which tokens its statistics count
    z_loss_coeff: Optional[float] = None  #: weight of the router z-loss
    capacity_factor: Optional[float] = None  #: tokens an expert takes, times an even share; null: dropless
    aux_loss_coeff: Optional[float] = None  #: weight of the load-balancing loss
    router_bias_rate: Optional[float] = None  #: > 0: auxiliary-loss-free balancing by a per-expert bias
    init_from: Optional[str] = None  #: hf:PATH = start from a Hugging Face Llama's weights (its shape wins)
    #: with name=hf: a transformers causal-LM directory (config.json, *.safetensors) trained as it is
    path: Optional[str] = None


@dataclass
class AdaptersConfig:
    """PEFT's adapters over the model (``adapters=lora``; model=hf or the package's own): the base frozen."""

    kind: str = "none"  #: none | lora
    rank: int = 16  #: LoRA's rank r
    alpha: float = 32.0  #: LoRA's alpha: the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  #: dropout on the adapter's input (0 keeps every layout's numbers equal to one process's)
    #: all-linear (every linear layer but the head), or module names, e.g. [q_proj,k_proj,v_proj,o_proj] ([wq,wk,wv,wo]
    #: on the package's own model)
    targets: Any = "all-linear"
    #: modules trained whole beside the adapters (PEFT's modules_to_save), e.g. [lm_head]; null: none
    modules_to_save: Optional[list[str]] = None
    seed: int = 0  #: the adapters' initial values are a function of this seed and each parameter's name


@dataclass
class SourceConfig:
    """One token source of a blend: a directory written by mgpu-prepare (or a flat token file) and its weight."""

    path: str = MISSING
    weight: float = 1.0  #: relative share of the samples drawn from it


@dataclass
class DataConfig:
    """Where tokens come from and how a global batch is made."""

    #: corpus (built-in, offline) | text (files) | tokens (pre-tokenised file) | sft (conversations: mgpu-prepare --chat)
    source: str = "corpus"
    path: Optional[str] = None  #: token file, for source=tokens; the directory of mgpu-prepare --chat, for source=sft
    files: List[str] = field(default_factory=list)  #: glob patterns, for source=text
    dtype: str = "uint16"  #: token dtype, for source=tokens
    text_key: str = "text"  #: JSONL field, for source=text
    seq_len: int = 128
    global_batch_size: int = 16  #: samples per optimizer step, over all data-parallel replicas
    micro_batch_size: int = 4  #: samples per forward/backward on one rank
    val_fraction: float = 0.01
    val_batches: int = 4
    cache: Optional[str] = None  #: directory of derived token files (default ~/.cache/lightning_mgpu)
    tokenizer: Optional[str] = None  #: tokenizer.json or a directory with one; null = bytes (or model.init_from's)
    sources: List[SourceConfig] = field(default_factory=list)  #: data=tokens blend: [{path: DIR, weight: 0.7}, ...]
    #: attention within each document of a packed sample, positions restarting per document, no loss on the token
    #: after an end-of-document token; needs tokens with one (mgpu-prepare's, or a tokenizer's): not bytes; with
    #: context parallelism, model=hf only
    document_mask: bool = False
    #: global batches never drawn, counted from 0 as the steps that would draw them: the run takes the next instead
    skip_batches: List[int] = field(default_factory=list)


@dataclass
class OuterOptimizerConfig:
    """:class:`lightning_mgpu.parallel.replicas.OuterOptimizer`: DiLoCo's outer step by default."""

    name: str = "nesterov"  #: nesterov | sgd (momentum 0 and lr 1: plain averaging of the replicas' weights)
    lr: float = 0.7
    momentum: float = 0.9


@dataclass
class ParallelConfig:
    """The arguments of :class:`lightning_mgpu.MGPUStrategy`."""

    zero_stage: int = 2
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    #: ranks that split each sequence (long context); tokens per sample must be a multiple of 2 x this
    context_parallel_size: int = 1
    #: ranks of the data x context ranks that split each layer's experts (a mixture-of-experts model)
    expert_parallel_size: int = 1
    sequence_parallel: bool = False
    pipeline_schedule: str = "1f1b"
    virtual_pipeline_size: int = 1
    num_microbatches: Optional[int] = None
    offload_optimizer: Optional[str] = None
    offload_params: Optional[str] = None
    nvme_path: Optional[str] = None
    deepspeed_config: Optional[Any] = None
    pipeline_boundaries: Optional[list[int]] = None
    pipeline_timeline: bool = False
    timeout: Optional[float] = None  #: collective timeout in seconds (MGPUStrategy(timeout=...)); null = torch's default
    #: CPU processes hand the memory a step frees back to the OS: a lower host-memory peak for 10-25% more step time
    return_freed_memory: bool = False
    #: groups of data-parallel ranks (outermost) that synchronise by replica_update; 1 = one group of every rank
    replicas: int = 1
    #: sync (gradients every step) | local (DiLoCo: an outer step every sync_every) | async (push and continue)
    replica_update: str = "sync"
    sync_every: int = 1  #: inner optimizer steps between outer steps (replica_update=local or async)
    max_staleness: int = 2  #: replica_update=async: rounds a replica may run ahead of the newest global weights
    #: chaos: {global rank: factor}, ranks made that many times slower (a sleep after each step's forward-backward)
    slow_ranks: Optional[Any] = None  #: a mapping, typed Any so that a command line can set it whole
    #: the outer step over the replicas' averaged change in weights (replica_update=local or async)
    outer_optimizer: OuterOptimizerConfig = field(default_factory=lambda: OuterOptimizerConfig())


@dataclass
class TrainerConfig:
    """The ``lightning.Trainer`` arguments a run needs, named as Lightning names them.

    The training stream is endless (one batch per optimizer step), so a run stops at ``max_steps`` (or
    ``max_time``) and validation is scheduled in steps; epochs exist only when ``limit_train_batches`` sets
    their length.
    """

    accelerator: str = "cpu"  #: cpu | gpu | cuda | auto
    devices: int = 2  #: processes (GPUs) per node
    num_nodes: int = 1
    max_steps: int = 300  #: optimizer steps; also the length of the LR schedule
    precision: str = "32-true"  #: 32-true | bf16-mixed | bf16-true | 16-mixed
    #: fp8 matmuls of every linear layer over that precision: null (off) | rowwise | tensorwise (torchao's recipes)
    fp8: Optional[str] = None
    gradient_clip_val: Optional[float] = 1.0  #: clip the global gradient norm to this; null = no clipping
    log_every_n_steps: int = 1  #: log (and flush metrics.csv) every N steps
    val_check_interval: Optional[int] = None  #: validate every N batches (steps x accumulate_grad_batches); null: last
    enable_progress_bar: bool = True
    enable_model_summary: bool = True  #: print the module's parameter table before training
    max_time: Optional[str] = None  #: stop after this wall time, "DD:HH:MM:SS" (e.g. 00:12:00:00); null = no limit
    max_epochs: Optional[int] = None  #: stop after N epochs of limit_train_batches steps; null = no limit
    limit_train_batches: Optional[int] = None  #: batches per epoch; null = one endless epoch
    limit_val_batches: float = 1.0  #: validation batches: a fraction in [0, 1] of data.val_batches, or a count > 1
    num_sanity_val_steps: int = 2  #: validation batches run before training to catch errors early; -1 = all, 0 = off
    check_val_every_n_epoch: Optional[int] = None  #: validate after every N epochs (needs limit_train_batches)
    accumulate_grad_batches: int = 1  #: batches whose gradients are summed into one optimizer step
    deterministic: Optional[bool] = None  #: true = torch.use_deterministic_algorithms(True); null = torch's default
    benchmark: Optional[bool] = None  #: torch.backends.cudnn.benchmark; null = leave as it is
    detect_anomaly: bool = False  #: torch.autograd anomaly detection (slow; finds the op that made a NaN)


@dataclass
class CSVLoggerConfig:
    """``lightning.pytorch.loggers.CSVLogger``: ``metrics.csv`` and ``hparams.yaml`` in the run directory."""

    flush_logs_every_n_steps: Optional[int] = None  #: write metrics.csv every N steps; null = trainer.log_every_n_steps


@dataclass
class TensorBoardLoggerConfig:
    """``TensorBoardLogger``: event files in ``<run dir>/tensorboard`` (extra: ``lightning_mgpu[tensorboard]``)."""

    log_graph: bool = False  #: also write the module's graph
    default_hp_metric: bool = False  #: log a placeholder hp_metric


@dataclass
class WandbLoggerConfig:
    """``WandbLogger``: a Weights & Biases run under ``<run dir>/wandb`` (extra: ``lightning_mgpu[wandb]``)."""

    offline: bool = True  #: true = no network; upload later with `wandb sync <run dir>/wandb/offline-run-*`
    project: str = "lightning_mgpu"
    name: Optional[str] = None  #: the run's display name; null = wandb's
    tags: List[str] = field(default_factory=list)


@dataclass
class MLFlowLoggerConfig:
    """``MLFlowLogger`` (extra: ``lightning_mgpu[mlflow]``)."""

    experiment_name: str = "lightning_mgpu"
    run_name: Optional[str] = None
    tracking_uri: Optional[str] = None  #: null = a local file store, <run dir>/mlruns


@dataclass
class LoggerConfig:
    """The Lightning loggers of a run: ``logger=csv`` (default), ``logger=tensorboard``, ``logger=[csv,wandb]``...

    Each option of the ``logger`` group fills its own key; a key left null is a logger not selected.
    """

    csv: Optional[CSVLoggerConfig] = None
    tensorboard: Optional[TensorBoardLoggerConfig] = None
    wandb: Optional[WandbLoggerConfig] = None
    mlflow: Optional[MLFlowLoggerConfig] = None


@dataclass
class OptimConfig:
    """AdamW (or Muon with AdamW, ``name=muon``) with linear warm-up then cosine decay (the arguments of
    :class:`LLMModule`)."""

    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    lr_scaling: Optional[str] = None  #: null | linear | sqrt, relative to reference_batch_size
    reference_batch_size: Optional[int] = None
    #: adamw | muon (Muon for the blocks' weight matrices, AdamW for embeddings, norms, head and routers; optim=muon)
    name: str = "adamw"
    muon_momentum: float = 0.95
    #: auto (bfloat16 on GPUs, float32 on CPUs) | bfloat16 (torch.optim.Muon's) | float32: Newton-Schulz's dtype
    muon_ns_dtype: str = "auto"


@dataclass
class SampleConfig:
    """The text generated after training."""

    #: the text continued; with data=sft the first held-out conversation up to its first answer, as its chat template
    #: rendered it, is continued instead
    prompt: str = "def "
    max_new_tokens: int = 160
    temperature: float = 0.7


@dataclass
class ClusterConfig:
    """How processes are started: ``local`` (Lightning), ``torchrun`` or ``slurm`` (hydra-submitit-launcher)."""

    launcher: str = "local"
    #: cluster=local on CPU: fork local ranks 1..N-1 from the first process, which has imported torch, Lightning and
    #: DeepSpeed already (false: start each as a fresh interpreter, as on GPUs)
    fork_on_cpu: bool = True
    #: refuse a run whose estimated peak memory per GPU (CPU: per machine) cannot fit, before anything starts
    check_memory: bool = True
    #: cluster=local: start a failed or preempted job again, at most this many times, from its newest checkpoint
    #: (needs checkpoint.resume=auto and checkpoint.every_n_steps; torchrun: --max-restarts; SLURM: requeue)
    max_restarts: int = 0
    #: cluster.max_restarts: stop with exit status 76 after this many attempts in a row that failed without a new
    #: optimizer step (a crash loop, which restarts or a requeue would repeat); 0: never
    crash_loop_attempts: int = 3


@dataclass
class ThroughputConfig:
    """:class:`lightning_mgpu.callbacks.ThroughputCallback`: tokens/s, TFLOP/s per GPU and MFU, logged every step."""

    enabled: bool = True  #: add the callback
    peak_flops: Optional[float] = None  #: bf16 peak FLOP/s of one device for MFU; null = from the CUDA device name
    #: also log every collective of a step as comm/* (CommunicationCounter; a Python call per operator while on)
    count_communication: bool = False


@dataclass
class ProfileConfig:
    """:class:`lightning_mgpu.callbacks.profile.ProfileSteps`: each rank's ``torch.profiler`` trace and memory snapshot
    of chosen steps (docs: how-to, "Profile a step"). Off (no callback) while ``steps`` is empty."""

    #: global steps to profile, counted from 0 as metrics.csv counts them, e.g. [5,7]; each below trainer.max_steps
    steps: List[int] = field(default_factory=list)
    dir: Optional[str] = None  #: null = <run dir>/profile; files go to <dir>/step{N}/rank{R}.*
    record_shapes: bool = True  #: record each operator's input shapes in the trace
    with_stack: bool = False  #: record each operator's Python stack (larger traces, slower profiled steps)
    largest_tensors: int = 20  #: how many of the largest live tensors each rank's memory file lists


@dataclass
class CheckpointConfig:
    """When and where checkpoints are written, and what to resume from."""

    every_n_steps: Optional[int] = None  #: save every N optimizer steps (null: never during training)
    dir: Optional[str] = None  #: null = <run dir>/checkpoints
    keep_last: int = 2  #: complete checkpoints kept; older ones are deleted after a new one is published
    #: null | a checkpoint directory | auto (the newest complete, intact one of this run's format in dir)
    resume: Optional[str] = None
    save_last: bool = False  #: also save when training ends
    #: write periodic checkpoints in the background (universal format): training waits only for the snapshot
    async_save: bool = False
    format: str = "universal"  #: universal (any layout can resume) | deepspeed (same layout only)
    #: read DeepSpeed-format checkpoints, which DeepSpeed unpickles (code in them runs): only files you trust
    trust_deepspeed_checkpoints: bool = False
    #: also write the whole model's weights (for mgpu-export; rank 0 holds them)
    save_consolidated_weights: bool = False


@dataclass
class PlanConfig:
    """``mgpu-plan``: the GPU kind (cluster size is trainer.num_nodes x trainer.devices) and what to print."""

    gpu: str = "h100_80gb"  #: a100_80gb | h100_80gb | h200_141gb
    #: fraction of the bf16 peak the weight matmuls reach; null: the GPU's, fitted to published runs (docs: planning)
    achievable: Optional[float] = None
    top: int = 15  #: rows of the table
    per_stage: bool = False  #: also print every pipeline rank's memory for the configured layout
    commands: int = 3  #: best layouts printed as mgpu-train command lines
    #: one GPU's mean time between job interruptions (with its share of host, network, software): Llama 3's report
    gpu_mtbf_hours: float = 45600.0
    write_gbs_per_node: float = 2.0  #: GB/s each node writes a checkpoint at (shared file system)
    #: GB/s each GPU copies its share of a background checkpoint (checkpoint.async_save) to host memory at
    snapshot_gbs_per_gpu: float = 10.0
    restart_s: float = 300.0  #: seconds from a failure to training again (requeue, start-up, loading)
    #: the run's token budget, e.g. 2e12: prints each layout's time to train, GPU-hours, energy and cost; null: not
    tokens: Optional[float] = None
    #: hours the run must finish in (needs plan.tokens): node counts up to plan.max_nodes that do, cheapest first
    deadline_hours: Optional[float] = None
    #: price of one GPU-hour (an assumed on-demand cloud H100 figure, USD; set your own)
    price_per_gpu_hour: float = 2.5
    #: watts one GPU draws for the energy figure; null: its kind's board power (TDP: A100 400, H100 and H200 700)
    gpu_power_w: Optional[float] = None
    #: watts a node draws besides its GPUs (CPUs, memory, NICs, fans, storage); an assumed 8-GPU server figure
    node_overhead_w: float = 2000.0
    pue: float = 1.0  #: power usage effectiveness: facility energy over the machines' (1.0: the machines alone)
    #: a PNG (or .svg, .pdf) of tokens/s per GPU and scaling efficiency against the node count; null: not drawn
    scaling_curve: Optional[str] = None
    #: the largest node count of the scaling curve and the deadline's search; null: trainer.num_nodes
    max_nodes: Optional[int] = None


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    adapters: AdaptersConfig = field(default_factory=AdaptersConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    seed: int = 1234
    dry_run: bool = False  #: build every rank's share on the meta device, print it beside the planner's, start nothing
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    throughput: ThroughputConfig = field(default_factory=ThroughputConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    bad_steps: BadStepsConfig = field(default_factory=BadStepsConfig)
    sdc: SilentCorruptionConfig = field(default_factory=SilentCorruptionConfig)


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"cluster=torchrun reads {name} from torchrun's environment, but it is not set: start the "
                         "job under torchrun, or use cluster=local")
    return int(value)


# Resolvers of cluster=torchrun: sizes from torchrun's environment.
OmegaConf.register_new_resolver("mgpu_env_int", _env_int, replace=True)
OmegaConf.register_new_resolver("mgpu_torchrun_nodes", lambda: _env_int("WORLD_SIZE") // _env_int("LOCAL_WORLD_SIZE"),
                                replace=True)


def register_configs() -> None:
    """Register the schema (``train_schema``, which types every group) and the recipe group with Hydra."""
    from lightning_mgpu.cli.paths import recipes_dir

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for path in sorted(recipes_dir().glob("*.yaml")):
        cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")
