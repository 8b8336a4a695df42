"""Typed schemas for every config group, registered in Hydra's ConfigStore.

conf/train.yaml starts its defaults list with `train_schema`, so every group file and every
command-line override is merged onto a typed node: a misspelt key or a value of the wrong type
fails at composition, before anything runs, with Hydra's message naming the key. The entrypoint
turns the composed config into these dataclasses (`OmegaConf.to_object`) and passes them down as
plain arguments; code below the entrypoint never reads the global config.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class CorpusSource(str, enum.Enum):
    builtin = "builtin"  # the interpreter's own documentation: offline, on every machine
    files = "files"  # local txt / jsonl / parquet / csv files (globs allowed)
    hub = "hub"  # a Hugging Face Hub dataset, loaded with `datasets.load_dataset`


class TextSplitting(str, enum.Enum):
    """How a plain-text file is cut into documents (other formats have one document per row)."""

    document = "document"  # the whole file
    paragraph = "paragraph"  # blocks separated by blank lines
    line = "line"  # every non-empty line


@dataclasses.dataclass
class LanguageConfig:
    """WHAT text to train on, and how it splits into train and validation."""

    name: str = MISSING
    source: CorpusSource = CorpusSource.builtin
    files: list[str] = dataclasses.field(default_factory=list)
    text_column: str = "text"
    text_splitting: TextSplitting = TextSplitting.paragraph
    hub_path: Optional[str] = None
    hub_config: Optional[str] = None
    hub_split: str = "train"
    hub_revision: Optional[str] = None
    # Validation is the FIRST `validation_fraction` of the documents (a fixed, reproducible
    # split that needs no shuffle of the corpus), train the rest; the optional caps then keep
    # the first N documents of each.
    validation_fraction: float = 0.05
    max_train_docs: Optional[int] = None
    max_eval_docs: Optional[int] = None
    licence: str = ""
    # Read the corpus as a stream (`datasets` IterableDataset): nothing is downloaded whole and
    # memory stays bounded. Validation is then the first `max_eval_docs` documents of the stream
    # (null → 1000; validation_fraction does not apply, the length being unknown),
    # training the rest, packed on the fly; trainer.max_steps is required.
    streaming: bool = False
    # Streaming only: blocks shuffled together, a window at a time (seeded); 1 → stream order.
    shuffle_buffer: int = 1000


class ModelFamily(str, enum.Enum):
    gpt2 = "gpt2"  # decoder: GPT2LMHeadModel (task=clm), GPT2ForSequenceClassification
    bert = "bert"  # encoder: BertForSequenceClassification (task=classify)
    llama = "llama"  # decoder: LlamaForCausalLM (task=clm), LlamaForSequenceClassification


class Remat(str, enum.Enum):
    """What the backward pass recomputes instead of keeping from the forward pass."""

    none = "none"  # keep every activation: fastest, most memory
    block = "block"  # per block: keep its input and matmul outputs; recompute the rest
    full = "full"  # per block: keep only its input; recompute everything, matmuls included


@dataclasses.dataclass
class RopeScaling:
    """How rotary positions are stretched beyond the trained context (HF's `rope_scaling`,
    whose `rope_type` names it). Set on the command line as model.rope_scaling.type=linear
    model.rope_scaling.factor=4, or model.rope_scaling={type: linear, factor: 4}."""

    type: str = "default"  # default: positions as they are; linear: divided by `factor`
    factor: float = 1.0


@dataclasses.dataclass
class ModelConfig:
    """WHICH network, with GPT2Config's names for the shape; a BERT encoder reads them as
    hidden_size = n_embd, num_hidden_layers = n_layer, num_attention_heads = n_head,
    intermediate_size = n_inner, max_position_embeddings = n_positions, hidden_act =
    activation_function, hidden_dropout_prob = resid_pdrop (= embd_pdrop),
    attention_probs_dropout_prob = attn_pdrop, layer_norm_eps = layer_norm_epsilon.
    A Llama decoder reads them as LlamaConfig's hidden_size, num_hidden_layers,
    num_attention_heads, intermediate_size, max_position_embeddings, hidden_act, rms_norm_eps
    and attention_dropout = attn_pdrop (it has no other dropout), plus the fields below."""

    name: str = MISSING
    family: ModelFamily = ModelFamily.gpt2
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: Optional[int] = None  # None → 4 × n_embd, as in GPT2Config
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    # null → hardware.param_dtype (float32 master weights by default). bfloat16 keeps the
    # parameters (and so AdamW's moments) in bfloat16: half the memory, less precise updates.
    param_dtype: Optional[str] = None
    type_vocab_size: int = 2  # bert: segment (token type) embeddings
    classifier_dropout: Optional[float] = None  # classify: null → resid_pdrop, as in HF
    # Start from pretrained weights: an HF model directory, a Hub id, or pkg://<module>/<dir>
    # (a checkpoint shipped inside an installed Python package). Its config.json then fixes
    # family and shape (the fields above are overwritten from it), and its tokenizer is used.
    init_from: Optional[str] = None
    remat: Remat = Remat.none  # trade compute for activation memory (gradients are the same)
    # llama only (GPT-2 and BERT ignore them):
    n_kv_head: Optional[int] = None  # key/value heads (grouped-query attention); null → n_head
    rope_theta: float = 10000.0  # the base wavelength of the rotary position embeddings
    # Not Optional: OmegaConf cannot merge a command-line dict into a null dataclass node.
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    tie_word_embeddings: bool = True  # the LM head reuses the token embeddings (GPT-2 always)
    attention_bias: bool = False  # biases on the q/k/v/o projections
    mlp_bias: bool = False  # biases on the gate/up/down projections


class OptimizerKind(str, enum.Enum):
    """Which optax optimizer; `name` is only the option's label (conf/optimizer/<name>.yaml)."""

    adamw = "adamw"  # optax.adamw: Adam with decoupled weight decay
    adafactor = "adafactor"  # optax.adafactor: factored second moments, relative step sizes
    lion = "lion"  # optax.lion: sign of an interpolated momentum (Chen et al. 2023)
    sgd = "sgd"  # optax.sgd: plain, heavy-ball or Nesterov momentum


class Schedule(str, enum.Enum):
    linear = "linear"  # warmup, then linear decay to end_lr
    cosine = "cosine"  # warmup, then cosine decay to end_lr
    constant = "constant"  # warmup, then flat
    wsd = "wsd"  # warmup, flat, then linear decay to end_lr over the last decay_fraction of steps


@dataclasses.dataclass
class OptimizerConfig:
    """HOW to step: an optax optimizer with a warmup + decay learning-rate schedule.

    Not every field applies to every kind; each conf/optimizer/*.yaml says which it ignores.
    """

    name: str = MISSING
    kind: OptimizerKind = OptimizerKind.adamw
    lr: float = 3e-4
    b1: float = 0.9  # adamw, lion
    b2: float = 0.98  # adamw, lion
    eps: float = 1e-8  # adamw
    # Masked off biases and LayerNorm scales. adamw, lion: decoupled, × the scheduled lr;
    # sgd: L2 added to the gradient; adafactor: × the parameter each step, not × the lr.
    weight_decay: float = 0.01
    momentum: Optional[float] = None  # sgd, adafactor; null → no momentum
    nesterov: bool = False  # sgd
    schedule: Schedule = Schedule.linear
    warmup_steps: int = 0
    end_lr: float = 0.0
    decay_fraction: float = 0.1  # wsd: the last fraction of all steps, spent decaying
    max_grad_norm: Optional[float] = None  # None → no clipping


class DistributedMode(str, enum.Enum):
    off = "off"  # one process: one host, whatever its devices
    auto = "auto"  # jax.distributed.initialize() from the cluster JAX detects (TPU pod slice,
    # SLURM, Open MPI, Kubernetes); one process when none is detected
    explicit = "explicit"  # the coordinator, process count and process id given below


@dataclasses.dataclass
class DistributedConfig:
    """Several processes (hosts) training one model on JAX's multi-controller runtime."""

    mode: DistributedMode = DistributedMode.off
    coordinator_address: Optional[str] = None  # explicit: process 0's host:port
    num_processes: Optional[int] = None  # explicit
    process_id: Optional[int] = None  # explicit: this process, 0 … num_processes - 1
    # Seconds any process waits for the others (start-up, a barrier) before it stops with an
    # error instead of hanging: a peer that died never answers.
    timeout_s: int = 300


@dataclasses.dataclass
class MeshConfig:
    """The device mesh's axes and their sizes; -1: the devices the other axes leave."""

    data: int = -1  # the batch only; parameters replicated along it
    fsdp: int = 1  # the batch, and parameters + optimizer state split along it (ZeRO-3)
    tensor: int = 1  # attention heads and MLP width split along it (Megatron style)


@dataclasses.dataclass
class HardwareConfig:
    """WHERE: platform, devices, per-device batch and dtypes."""

    name: str = MISSING
    platform: str = "cpu"  # cpu | gpu | tpu (what JAX must run on)
    # CPU only: how many XLA host devices to create; null → one per CPU core. Takes effect only
    # if JAX has not started yet in this process (the first run of a multirun fixes it).
    cpu_devices: Optional[int] = None
    num_devices: Optional[int] = None  # devices in the data mesh; null → all JAX devices
    per_device_batch_size: int = 16
    per_device_eval_batch_size: Optional[int] = None  # null → per_device_batch_size
    compute_dtype: str = "float32"  # activations and matmuls
    param_dtype: str = "float32"  # parameters and optimizer state
    # Denominator of MFU, per device; null → the device's known bfloat16 peak
    # (flaxlm.hardware_peak), and no MFU at all on a device without one (a CPU).
    peak_tflops_per_device: Optional[float] = None
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)


class Padding(str, enum.Enum):
    max_length = "max_length"  # every example padded to task.max_seq_length: one shape
    buckets = "buckets"  # each batch padded to the next of a few lengths: less padding, few shapes


@dataclasses.dataclass
class TaskConfig:
    """WHAT objective. `clm`: causal language modelling on packed blocks. `classify`:
    sequence (or sentence-pair) classification, or regression when num_labels = 1."""

    name: str = MISSING
    # clm: blocks of this many tokens; null → the model's context length (model.n_positions).
    # classify: examples truncated and padded to this many tokens (conf/task/classify.yaml).
    max_seq_length: Optional[int] = None
    # classify only, below. The data: a Hub dataset (e.g. nyu-mll/glue with config mrpc), or
    # local tsv / csv / jsonl / parquet files.
    dataset: Optional[str] = None
    dataset_config: Optional[str] = None
    train_split: str = "train"
    eval_split: str = "validation"
    train_files: list[str] = dataclasses.field(default_factory=list)
    eval_files: list[str] = dataclasses.field(default_factory=list)
    text_column: str = "sentence1"
    text_pair_column: Optional[str] = None  # null → single-sentence classification
    label_column: str = "label"
    num_labels: Optional[int] = None  # null → from the data; 1 → regression (STS-B)
    # Metrics on the eval split, named as GLUE reports them: accuracy, f1, matthews,
    # pearson, spearman. Empty → accuracy (+ f1 with two labels), or pearson/spearman.
    metrics: list[str] = dataclasses.field(default_factory=list)
    padding: Padding = Padding.max_length


class TokenConvention(str, enum.Enum):
    """Which special tokens frame a document in training and a prompt in generation and export."""

    auto = "auto"  # the tokenizer's own for a model from model.init_from, flaxlm's otherwise
    # flaxlm's, for models it trains: documents joined by EOS alone, a prompt read after an EOS
    flaxlm = "flaxlm"
    # the tokenizer's own: its post-processor (its BOS, if it adds one) on every document, then
    # EOS, and on every prompt as transformers' `tokenizer(text)` encodes it
    tokenizer = "tokenizer"


@dataclasses.dataclass
class TokenizerConfig:
    """Train a byte-level BPE on the training text (cached), or load an existing one."""

    path: Optional[str] = None  # a tokenizer directory or tokenizer.json; null → train one
    vocab_size: Optional[int] = None  # null → the model's vocab_size
    min_frequency: int = 2
    special_tokens: list[str] = dataclasses.field(
        default_factory=lambda: ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    )
    bos_token: str = "<s>"
    pad_token: str = "<pad>"
    eos_token: str = "</s>"  # also separates documents when packing
    unk_token: str = "<unk>"
    mask_token: str = "<mask>"
    convention: TokenConvention = TokenConvention.auto
    # language.streaming only: the BPE trains on the first `train_docs` training documents of
    # the stream (without streaming it trains on the whole training split).
    train_docs: int = 10000


class ResumeMode(str, enum.Enum):
    auto = "auto"  # continue the run directory's latest checkpoint if there is one
    never = "never"  # always a fresh run; a run directory that holds a run is an error
    must = "must"  # there must be a checkpoint to continue


class ObjectiveMode(str, enum.Enum):
    min = "min"  # lower is better (losses)
    max = "max"  # higher is better (accuracy, f1, correlations)


class ObjectiveValue(str, enum.Enum):
    best = "best"  # the best over the run's evaluations
    last = "last"  # the last evaluation's


@dataclasses.dataclass
class TrainerConfig:
    """How long to train and how often to evaluate and log."""

    num_epochs: int = 1
    max_steps: Optional[int] = None  # if set, overrides num_epochs
    # Rows per optimizer step. null → hardware.per_device_batch_size × devices ×
    # grad_accum_steps; if set, must divide evenly over devices ×
    # grad_accum_steps. Fixing it keeps a run's recipe the same on different hardware.
    global_batch_size: Optional[int] = None
    # Micro-batches per optimizer step: their gradients are averaged inside one jitted step
    # before a single update, so a small machine reaches a large batch (GPT-2's 512 sequences).
    # Steps and the schedule count optimizer steps.
    grad_accum_steps: int = 1
    eval_every: Optional[int] = None  # steps; null → only at the end of each epoch
    log_every: int = 10  # steps between train-metric log lines
    eval_before_training: bool = True
    # Continue the latest checkpoint of the run directory (run_dir, or resume_from) if it has
    # one. auto: resume if there is a checkpoint, else start fresh; never: always a fresh run
    # (in a new run_dir); must: fail unless there is a checkpoint to resume.
    resume: ResumeMode = ResumeMode.auto
    # A resume whose training or validation data differs from what the checkpoint recorded
    # (an edited file, a new dataset version) stops with an error; true continues on the
    # changed data and records that in metrics.jsonl (resume/changed_data).
    resume_on_changed_data: bool = False
    # A step whose loss or gradients are not finite: false → stop with an error naming the
    # step; true → skip its update (parameters and optimizer state unchanged) and go on; the
    # skipped steps are counted in train/skipped_steps.
    skip_nonfinite: bool = False
    # What the run returns to a sweeper: an eval metric it logs, e.g. eval/loss or eval/f1.
    # null → the task's main metric: eval/loss for clm; for classify f1 if task.metrics has
    # it, else the first of task.metrics (or of the defaults its num_labels gives).
    objective: Optional[str] = None
    objective_mode: Optional[ObjectiveMode] = None  # null → min for losses, max otherwise
    objective_value: ObjectiveValue = ObjectiveValue.best


@dataclasses.dataclass
class CheckpointConfig:
    """When to save the full train state to <run_dir>/checkpoints/ and how many to keep."""

    every_steps: Optional[int] = 100  # null → only at epoch ends, the last step and on SIGTERM
    at_epoch_end: bool = True
    keep_last: int = 3  # the newest checkpoints kept
    keep_best: int = 1  # plus this many with the lowest eval loss (0 → none extra)
    # Write files in a background thread: the step loop only waits for the copy off the device.
    async_save: bool = True


@dataclasses.dataclass
class LoggerConfig:
    """Experiment tracking. Every run writes metrics.jsonl; the `logger` group is a list of
    options merged into this one node (`logger=[wandb,tensorboard]`), each switching its flag
    on: `wandb` adds a W&B run, `tensorboard` event files in the run directory."""

    name: str = "none"  # the option merged last; the flags below decide what runs
    wandb: bool = False
    tensorboard: bool = False
    project: str = "flaxlm"
    entity: Optional[str] = None
    # auto → online when logged in to W&B, otherwise offline (sync later with `wandb sync`)
    mode: str = "auto"
    tags: list[str] = dataclasses.field(default_factory=list)
    notes: Optional[str] = None


@dataclasses.dataclass
class SamplesConfig:
    """Text the trained model writes at the end of a task=clm run: printed, logged to
    metrics.jsonl and as a W&B table. Each prompt starts a document (it follows the EOS that
    separates documents, or the tokenizer's own BOS: tokenizer.convention); an empty prompt
    lets the model start its own. No prompts → none."""

    prompts: list[str] = dataclasses.field(default_factory=lambda: ["", "", ""])
    max_new_tokens: int = 40  # cut to what the context (model.n_positions) leaves
    temperature: float = 0.8  # 0 → greedy
    top_k: int = 50  # 0 → no cut
    top_p: float = 1.0  # 1 → no cut
    seed: int = 0


@dataclasses.dataclass
class TrainConfig:
    """The whole composed config of `flaxlm-train`."""

    language: Optional[LanguageConfig] = None  # task=classify: none (its data is in task)
    model: ModelConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    hardware: HardwareConfig = MISSING
    task: TaskConfig = MISSING
    logger: LoggerConfig = MISSING
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    samples: SamplesConfig = dataclasses.field(default_factory=SamplesConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    seed: int = 0
    # Where this run writes; a new run never reuses an existing one. Hydra fills it in for a
    # run (null only where Hydra runs no job, e.g. `flaxlm-train --cfg job --resolve`).
    run_dir: Optional[str] = MISSING
    # Continue the run in this directory (its latest complete checkpoint) instead of run_dir.
    resume_from: Optional[str] = None
    # Tokenizers and packed token blocks, shared by runs; conf/train.yaml sets it (FLAXLM_CACHE).
    cache_dir: str = MISSING


def register_configs() -> None:
    """Make the schema known to Hydra as `train_schema`, the first entry of conf/train.yaml's
    defaults list: every group file and override is then merged onto a typed node."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def dotted(tree: dict, prefix: str = "") -> dict:
    """A nested (resolved) config as {"optimizer.lr": 3e-4, ...}: its leaves by their dotted
    keys, what resume checks, reports and dashboards compare."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
