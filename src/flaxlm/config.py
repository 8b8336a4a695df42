"""Typed schemas for every config group, registered in Hydra's ConfigStore.

conf/train.yaml starts its defaults list with `train_schema`, so every group file and every
command-line override is merged onto a typed node: a misspelt key or a value of the wrong type
fails at composition, before anything runs, with Hydra's message naming the key. The entrypoint
turns the composed config into these dataclasses (`OmegaConf.to_object`) and passes them down as
plain arguments; code below the entrypoint never reads the global config.

Every value has one home. The schema gives types, and a default only where the default is
nothing (None, False, an empty list, a nested schema node); every value someone chose is
MISSING here and lives once in YAML: a group's options in conf/<group>/*.yaml (values several
options share in the base they extend, conf/base/<group>/*.yaml), the run-level nodes (trainer,
checkpoint, tokenizer, samples, seed) in conf/train.yaml. `RENAMED` maps each key an earlier
release spelt differently to its spelling now.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import re
from typing import Any, Optional

# OmegaConf's marker of a value the config must give (`omegaconf.MISSING`), spelt out so that
# the schema (and the model code that reads its enums) imports without Hydra or OmegaConf.
MISSING = "???"


class CorpusSource(str, enum.Enum):
    builtin = "builtin"  # the interpreter's own documentation: offline, on every machine
    files = "files"  # local txt / jsonl / parquet / csv files (globs allowed)
    hub = "hub"  # a Hugging Face Hub dataset, loaded with `datasets.load_dataset`
    mixture = "mixture"  # several of the above, mixed by weight (the `mixture` node)


class TextSplitting(str, enum.Enum):
    """How a plain-text file is cut into documents (other formats have one document per row)."""

    document = "document"  # the whole file
    paragraph = "paragraph"  # blocks separated by blank lines
    line = "line"  # every non-empty line


@dataclasses.dataclass
class LanguageConfig:
    """WHAT text to train on, and how it splits into train and validation."""

    name: str = MISSING
    source: CorpusSource = MISSING
    files: list[str] = dataclasses.field(default_factory=list)
    text_column: str = MISSING  # jsonl / parquet / csv files and Hub datasets
    text_splitting: TextSplitting = MISSING
    hub_path: Optional[str] = None
    hub_config: Optional[str] = None
    hub_split: str = MISSING
    hub_revision: Optional[str] = None
    # Validation is the FIRST `validation_fraction` of the documents (a fixed, reproducible
    # split that needs no shuffle of the corpus), train the rest; the optional caps then keep
    # the first N documents of each.
    validation_fraction: float = MISSING
    max_train_docs: Optional[int] = None
    max_eval_docs: Optional[int] = None
    licence: str = MISSING
    # Read the corpus as a stream (`datasets` IterableDataset): nothing is downloaded whole and
    # memory stays bounded. Validation is then the first `max_eval_docs` documents of the stream
    # (null → 1000; validation_fraction does not apply, the length being unknown),
    # training the rest, packed on the fly; trainer.max_steps is required.
    streaming: bool = False
    # Streaming only: blocks shuffled together, a window at a time (seeded); 1 → stream order.
    shuffle_buffer: int = MISSING


@dataclasses.dataclass
class MixtureStage:
    """The mixture's weights from a step on (`mixture.stages`)."""

    start_step: int = MISSING
    weights: Any = MISSING  # by source name, as mixture.weights


@dataclasses.dataclass
class MixtureConfig:
    """Several corpora in one run (`language=[is,no,da]`, or a preset such as language=nordic):
    each source a language option of its own, by name, and the share of the training blocks
    each gets. docs/languages.md says how blocks are drawn."""

    sources: dict[str, LanguageConfig] = dataclasses.field(default_factory=dict)
    # Weights ∝ (the source's training text in bytes) ^ temperature: 1 → by size, 0 → equal.
    temperature: float = MISSING
    # Explicit weights by source name, normalised to sum to 1 (e.g. {is: 0.4, "no": 0.6});
    # null → by temperature. `Any`, not a typed dict: Hydra's struct mode refuses a new key in
    # one, i.e. `mixture.weights={is: 0.4}` on the command line; the job checks the values.
    weights: Any = None
    # Weights that change at given steps, e.g. [{start_step: 9000, weights: {is: 0.6, ...}}];
    # the weights above hold until the first stage starts.
    stages: list[MixtureStage] = dataclasses.field(default_factory=list)


class ModelFamily(str, enum.Enum):
    gpt2 = "gpt2"  # decoder: GPT2LMHeadModel (task=clm), GPT2ForSequenceClassification
    bert = "bert"  # encoder: BertForSequenceClassification (task=classify)
    llama = "llama"  # decoder: LlamaForCausalLM (task=clm), LlamaForSequenceClassification
    qwen2 = "qwen2"  # Llama's decoder with biases on q/k/v: Qwen2ForCausalLM, ...Classification
    mistral = "mistral"  # Llama's decoder without biases: MistralForCausalLM, ...Classification
    # Mixture-of-Experts decoders (model.moe; flaxlm.models.moe): Llama's attention, each
    # MLP a set of SwiGLU experts behind a router, as HF's classes of these names hold them.
    qwen3_moe = "qwen3_moe"  # Qwen3MoeForCausalLM: q/k RMSNorm per head, renormalised top-k
    qwen2_moe = "qwen2_moe"  # Qwen2MoeForCausalLM: q/k/v biases, a gated shared expert
    mixtral = "mixtral"  # MixtralForCausalLM: Mistral's attention, 8 experts, top-2
    olmoe = "olmoe"  # OlmoeForCausalLM: q/k RMSNorm over the whole projection, 64 experts, top-8


# The families whose transformers config holds a sliding window (model.sliding_window).
WINDOW_FAMILIES = (ModelFamily.mistral, ModelFamily.qwen2)
MOE_FAMILIES = (ModelFamily.qwen3_moe, ModelFamily.qwen2_moe, ModelFamily.mixtral,
                ModelFamily.olmoe)


class QKNorm(str, enum.Enum):
    """RMSNorm on the queries and keys before RoPE (llama-family decoders)."""

    none = "none"  # Llama, Qwen2, Mixtral
    head = "head"  # each head's H values, one scale of width H shared by the heads (Qwen3)
    width = "width"  # the whole projection's N·H (or G·H) values at once (OLMo 2, OLMoE)


class MoeDispatch(str, enum.Enum):
    """How tokens reach their experts (flaxlm.models.moe says what each is)."""

    auto = "auto"  # megablox on a TPU, ragged elsewhere on an accelerator, tiled on a CPU
    ragged = "ragged"  # sorted by expert, jax.lax.ragged_dot (native on TPUs and GPUs)
    tiled = "tiled"  # sorted by expert, a grouped matmul over row tiles written in JAX (CPU)
    megablox = "megablox"  # sorted by expert, JAX's Pallas grouped matmul kernel (TPUs)
    dense = "dense"  # every token through every expert, weighted by its routing: the reference


class Remat(str, enum.Enum):
    """What the backward pass recomputes instead of keeping from the forward pass."""

    none = "none"  # keep every activation: fastest, most memory
    block = "block"  # per block: keep its input, matmul outputs and the splash kernel's
    # output and softmax statistics; recompute the rest (norms, activations, XLA attention)
    full = "full"  # per block: keep only its input; recompute everything, matmuls included
    # jax.checkpoint_policies by name, applied per block (docs/models.md weighs them):
    nothing_saveable = "nothing_saveable"  # = full
    dots_with_no_batch_dims_saveable = "dots_with_no_batch_dims_saveable"  # = block
    dots_saveable = "dots_saveable"  # every matmul output, attention's scores included
    everything_saveable = "everything_saveable"  # nothing recomputed: none's memory, in remat


class AttentionBackend(str, enum.Enum):
    """Which attention computes the model's (flaxlm.models.attention says what each is)."""

    auto = "auto"  # by platform: cudnn on a GPU (bf16/fp16), splash on a TPU, else xla
    xla = "xla"  # jax.nn.dot_product_attention's XLA path: any device
    cudnn = "cudnn"  # cuDNN's fused flash attention: NVIDIA GPUs, bfloat16/float16
    splash = "splash"  # JAX's Pallas splash attention kernel: TPUs, causal LMs
    reference = "reference"  # spelled out with einsums, the softmax in float32


class ContextAttention(str, enum.Enum):
    """How attention sees the whole row when a `context` mesh axis splits its positions
    (hardware.mesh.context > 1; flaxlm.models.attention and flaxlm.models.ring_attention)."""

    # Every device gathers the row's keys and values and attends to them at once: one
    # collective, but the row's keys and values and S × L scores on every device.
    all_gather = "all_gather"
    # The keys and values travel round the axis a slice at a time (ppermute), the softmax
    # accumulated online: one slice and S × S scores at a time, C - 1 transfers.
    ring = "ring"


@dataclasses.dataclass
class RopeScaling:
    """How rotary positions are stretched beyond the trained context (HF's `rope_scaling`,
    whose `rope_type` names it). Set on the command line as model.rope_scaling.type=linear
    model.rope_scaling.factor=4, or model.rope_scaling={type: linear, factor: 4}."""

    # default: positions as they are; linear: divided by `factor`; llama3: Llama 3.1's, the
    # long wavelengths divided by `factor`, the short kept, those between interpolated; yarn:
    # YaRN's (Qwen's and DeepSeek's long context), the same by rotations, and a sharper softmax
    type: str = MISSING
    factor: float = MISSING
    # llama3 only (Llama 3.1's values): wavelengths above original_max_positions /
    # low_freq_factor are stretched, those below original_max_positions / high_freq_factor kept
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192  # the context the model was first trained at
    # yarn only (transformers' defaults): a frequency that turns fewer than beta_slow times in
    # original_max_positions tokens is divided by `factor`, one that turns more than beta_fast
    # times is kept, those between are interpolated (a linear ramp over the head's dimensions,
    # its ends rounded outwards unless truncate=false); cos and sin are scaled by
    # attention_factor, null: 0.1·ln(factor) + 1, or with DeepSeek's mscale and mscale_all_dim
    # the ratio of that formula at each
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    truncate: bool = True


@dataclasses.dataclass
class LoraConfig:
    """Low-rank adapters (LoRA, Hu et al. 2021) on the projections named in `targets`: each
    targeted weight W is frozen and its layer computes x·W + (alpha / rank)·dropout(x)·A·B,
    with A (in × rank) and B (rank × out) the only parameters that train. B starts at zero,
    so the adapted model starts as the base model. On once `rank` is set: model.lora.rank=16,
    or model.lora={rank: 16, targets: [q_proj, v_proj]}.

    Not an Optional node that is null when off: OmegaConf cannot merge a command-line dict
    into a null dataclass node, so the node is always there and its rank says whether it is on."""

    rank: Optional[int] = None  # null: no adapters, every parameter trains
    alpha: float = 32.0  # the adapter's output is scaled by alpha / rank, as PEFT scales it
    dropout: float = 0.0  # on the adapter's input only, during training
    # Projection names, as the family's HF modules are named: llama/qwen2 q_proj, k_proj,
    # v_proj, o_proj, gate_proj, up_proj, down_proj; gpt2 c_attn, c_proj, c_fc (c_proj is
    # both the attention's output and the MLP's). null: every projection of the blocks.
    targets: Optional[list[str]] = None


@dataclasses.dataclass(unsafe_hash=True)  # hashable: the models keep it as a static attribute
class MoeConfig:
    """Mixture-of-Experts MLPs (llama-family decoders; docs/models.md, "Mixture of Experts"):
    each sparse layer's MLP is `num_experts` SwiGLU experts of width `expert_mlp_size`, and a
    router sends each token to `top_k` of them, its output their outputs weighted by the
    router's probabilities. On once `num_experts` is set: model.moe.num_experts=8, or a preset
    (model=moe-tiny, olmoe-1b-7b, qwen3-30b-a3b, mixtral-8x7b).

    Not an Optional node that is null when off, for LoraConfig's reason."""

    num_experts: Optional[int] = None  # null: a dense model
    top_k: int = MISSING  # experts per token (HF: num_experts_per_tok)
    expert_mlp_size: Optional[int] = None  # each expert's inner width; null → model.mlp_size
    # Divide the top-k probabilities by their sum (Mixtral always, Qwen3-MoE; Qwen2-MoE and
    # OLMoE do not: HF's norm_topk_prob)
    normalize_top_k: bool = MISSING
    # A shared expert every token goes through, of this width, its output scaled by a sigmoid
    # gate (Qwen2-MoE's shared_expert_intermediate_size); null → none
    shared_expert_size: Optional[int] = None
    first_dense_layers: int = MISSING  # the first layers keep a dense MLP (DeepSeek's)
    dispatch: MoeDispatch = MISSING
    # Token dropping (Switch/GShard): each expert takes at most capacity_factor × its even share
    # of a device's tokens, the rest pass by the MLP (the residual carries them) and are
    # counted in moe/dropped; null → dropless
    capacity_factor: Optional[float] = None
    # Switch's load-balancing loss × this, added to the training loss (HF: router_aux_loss_coef)
    aux_loss_coef: float = MISSING
    z_loss_coef: float = MISSING  # the router's z-loss (ST-MoE: mean log²Z of its logits) × this
    # DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the routing
    # scores for the choice only, moved by this much per step toward the even load; 0 → off
    bias_update_rate: float = MISSING


@dataclasses.dataclass
class ModelConfig:
    """WHICH network. The shape and dropout fields have one name for every family; docs/models.md
    tables each against GPT2Config's, BertConfig's and LlamaConfig's name for it (each family
    module's `HF_NAMES` is that table in code), and says which fields a family ignores."""

    name: str = MISSING
    family: ModelFamily = MISSING
    vocab_size: int = MISSING
    max_positions: int = MISSING
    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    mlp_size: Optional[int] = None  # the MLP's inner width; null → 4 × hidden_size
    activation: str = MISSING  # the MLP's (Llama's: SwiGLU's gate)
    hidden_dropout: float = MISSING  # gpt2, bert: on what each block adds to the residual
    embedding_dropout: float = MISSING  # gpt2 only (bert's embeddings drop hidden_dropout)
    attention_dropout: float = MISSING  # on the attention probabilities
    layer_norm_eps: float = MISSING  # LayerNorm's epsilon (Llama: RMSNorm's)
    initializer_range: float = MISSING
    type_vocab_size: int = MISSING  # bert only: segment (token type) embeddings
    classifier_dropout: Optional[float] = None  # classify: null → hidden_dropout, as in HF
    # Start from pretrained weights: an HF model directory, a Hub id, or pkg://<module>/<dir>
    # (a checkpoint shipped inside an installed Python package). Its config.json then fixes
    # family and shape (the fields above are overwritten from it), and its tokenizer is used.
    init_from: Optional[str] = None
    # With init_from, a context extension: the run's max_positions, rope_theta and
    # rope_scaling stay (the checkpoint's config.json gives the rest), so that continued
    # pre-training runs at a longer context than the checkpoint's (YaRN, a larger theta);
    # the run's max_positions may not be below the checkpoint's.
    extend_context: bool = False
    remat: Remat = MISSING  # trade compute for activation memory (gradients are the same)
    # Stack the blocks' parameters on a leading layer axis and run them with one compiled
    # block (lax.scan): compile time independent of depth. HF's per-layer names at every
    # boundary (init_from, export); a checkpoint resumes only in its own layout.
    scan_layers: bool = False
    # Which attention backend; with attention dropout, training takes the reference path.
    attention: AttentionBackend = MISSING
    # Under a context axis (hardware.mesh.context > 1): all_gather | ring; ignored without one.
    context_attention: ContextAttention = MISSING
    tie_word_embeddings: bool = MISSING  # the LM head reuses the token embeddings (GPT-2 always)
    # llama and qwen2 only (GPT-2 and BERT ignore them):
    num_kv_heads: Optional[int] = None  # key/value heads (grouped-query); null → num_heads
    # Each head's width, where it is not hidden_size / num_heads (Qwen3-30B-A3B: 32 heads of
    # 128 on a width of 2048); null → hidden_size / num_heads
    head_dim: Optional[int] = None
    rope_theta: float = MISSING  # the base wavelength of the rotary position embeddings
    # Not Optional: OmegaConf cannot merge a command-line dict into a null dataclass node.
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    attention_bias: bool = False  # biases on the q/k/v/o projections
    qkv_bias: bool = False  # biases on q/k/v only, none on o: Qwen2's (model.family=qwen2)
    mlp_bias: bool = False  # biases on the gate/up/down projections
    qk_norm: QKNorm = QKNorm.none  # RMSNorm on queries and keys (Qwen3: per head; OLMoE: width)
    # Sliding-window attention (mistral and qwen2 only): each token attends to itself and the
    # sliding_window - 1 tokens before it, as transformers' Mistral and Qwen2 count; null → the
    # whole row. The first full_attention_layers layers keep attending to the whole row
    # (Qwen2's max_window_layers).
    sliding_window: Optional[int] = None
    full_attention_layers: int = 0
    # Mixture-of-Experts MLPs (the moe families); off while model.moe.num_experts is null.
    moe: MoeConfig = dataclasses.field(default_factory=MoeConfig)
    # Low-rank adapters on a frozen base (task=clm); off while model.lora.rank is null.
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)


class OptimizerName(str, enum.Enum):
    """Which optax optimizer (conf/optimizer/<name>.yaml sets it; an option of another name,
    e.g. a user's adamw-warm.yaml, says which of these it configures)."""

    adamw = "adamw"  # optax.adamw: Adam with decoupled weight decay
    adafactor = "adafactor"  # optax.adafactor: factored second moments, relative step sizes
    lion = "lion"  # optax.lion: sign of an interpolated momentum (Chen et al. 2023)
    sgd = "sgd"  # optax.sgd: plain, heavy-ball or Nesterov momentum
    muon = "muon"  # optax.contrib.muon on hidden matrices, adamw on the rest (Jordan 2024)


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

    name: OptimizerName = MISSING
    lr: float = MISSING
    b1: float = MISSING  # adamw, lion, muon's adamw part
    b2: float = MISSING  # adamw, lion, muon's adamw part
    eps: float = MISSING  # adamw, muon's adamw part
    # Masked off biases and LayerNorm scales. adamw, lion: decoupled, × the scheduled lr;
    # sgd: L2 added to the gradient; adafactor: × the parameter each step, not × the lr.
    weight_decay: float = MISSING
    momentum: Optional[float] = None  # sgd, adafactor, muon; null → no momentum (not muon)
    nesterov: bool = False  # sgd, muon
    schedule: Schedule = MISSING
    warmup_steps: int = MISSING
    end_lr: float = MISSING
    decay_fraction: float = MISSING  # wsd: the last fraction of all steps, spent decaying
    max_grad_norm: Optional[float] = None  # None → no clipping
    # The dtype the optimizer's moments are stored in between steps (each step updates them in
    # float32): bfloat16 halves their memory. null → the parameters' dtype (optax's default).
    # adafactor: its momentum only; its factored second moments stay float32.
    moment_dtype: Optional[str] = None


class DistributedMode(str, enum.Enum):
    off = "off"  # one process: one host, whatever its devices
    auto = "auto"  # jax.distributed.initialize() from the cluster JAX detects (TPU pod slice,
    # SLURM, Open MPI, Kubernetes); one process when none is detected
    explicit = "explicit"  # the coordinator, process count and process id given below


@dataclasses.dataclass
class DistributedConfig:
    """Several processes (hosts) training one model on JAX's multi-controller runtime."""

    mode: DistributedMode = MISSING
    coordinator_address: Optional[str] = None  # explicit: process 0's host:port
    num_processes: Optional[int] = None  # explicit
    process_id: Optional[int] = None  # explicit: this process, 0 … num_processes - 1
    # Seconds any process waits for the others (start-up, a barrier) before it stops with an
    # error instead of hanging: a peer that died never answers.
    timeout_s: int = MISSING


@dataclasses.dataclass
class MeshConfig:
    """The device mesh's axes and their sizes; -1: the devices the other axes leave."""

    data: int = MISSING  # the batch only; parameters replicated along it
    fsdp: int = MISSING  # the batch, and parameters + optimizer state split along it (ZeRO-3)
    tensor: int = MISSING  # attention heads and MLP width split along it (Megatron style)
    # The batch, and a Mixture-of-Experts layer's experts split along it (E/expert per device,
    # tokens moved to them by all-to-all); model.moe.num_experts must divide by it. For every
    # other parameter (and a dense model's) it is data parallelism.
    expert: int = MISSING
    # Each row's positions split over it (context parallelism): every device of the axis holds
    # 1/context of every row's activations, and attention gathers the row's keys and values;
    # the batch's rows are replicated along it, as along tensor.
    context: int = MISSING
    # Under a context axis of C devices, each row cut into 2C chunks and device c given chunks
    # c and 2C-1-c (the balanced order): causal attention's work equal on every device, where
    # contiguous slices (false) give the last device C times the first one's. The same result.
    balance_context: bool = MISSING


@dataclasses.dataclass
class TopologyConfig:
    """The TPU slice `flaxlm-plan` compiles for when it is not attached, in the terms of
    `jax.experimental.topologies.get_topology_desc`."""

    name: Optional[str] = None  # e.g. "v4:2x2x1" (generation:chips per axis); null → none
    chip_config: str = "default"  # "megacore": a v4 / v5p chip's two cores as one JAX device
    chips_per_host: Optional[list[int]] = None  # chips of one host per axis; null → libtpu's


class DropoutRng(str, enum.Enum):
    """Which generator draws the dropout masks (flaxlm.training.keys)."""

    auto = "auto"  # unsafe_rbg on a TPU, threefry elsewhere
    threefry = "threefry"  # JAX's default: the same masks on every platform and layout
    rbg = "rbg"  # the chip's RngBitGenerator: fast to compile on a TPU, masks of its own
    unsafe_rbg = "unsafe_rbg"  # rbg with cheaper key derivation (fold_in, split) of its own


@dataclasses.dataclass
class HardwareConfig:
    """WHERE: platform, devices, per-device batch and dtypes."""

    name: str = MISSING
    platform: str = MISSING  # cpu | gpu | tpu (what JAX must run on)
    # CPU only: how many XLA host devices to create; null → one per CPU core. Takes effect only
    # if JAX has not started yet in this process (the first run of a multirun fixes it).
    cpu_devices: Optional[int] = None
    num_devices: Optional[int] = None  # devices in the data mesh; null → all JAX devices
    per_device_batch_size: int = MISSING
    # A causal LM's micro-batch holds at most this many tokens per device: fewer rows where
    # its blocks are long, at least one (conf/base/hardware/common.yaml's
    # per_device_batch_size reads it through rows_per_device); null → the rows whatever the
    # length.
    tokens_per_device: Optional[int] = None
    # trainer.loss_chunk_size's default: chunks of LOSS_CHUNK positions where a micro-batch's
    # whole float32 logits would need more than this per device; null → whole.
    max_whole_logits_gib: Optional[float] = None
    per_device_eval_batch_size: Optional[int] = None  # null → per_device_batch_size
    compute_dtype: str = MISSING  # activations and matmuls
    # Parameters and optimizer state: float32 master weights, or bfloat16 for half the memory
    # (AdamW's moments too) and less precise updates.
    param_dtype: str = MISSING
    # Denominator of MFU, per device; null → the device's known bfloat16 peak
    # (flaxlm.hardware_peak), and no MFU at all on a device without one (a CPU).
    peak_tflops_per_device: Optional[float] = None
    # A device's memory (GiB) and its bandwidth (GB/s), for flaxlm-plan's verdict and roofline;
    # null → unknown (no verdict, and a roofline of FLOPs alone).
    hbm_gib_per_device: Optional[float] = None
    hbm_gbps_per_device: Optional[float] = None
    # The dropout masks' generator: threefry's are the same on every platform, and cost the
    # quickstart's train step 25-29 s more compile on a TPU; rbg's are the chip's own
    # (docs/checkpoints.md, "Dropout's generator"). auto → unsafe_rbg on a TPU, threefry
    # elsewhere.
    dropout_rng: DropoutRng = MISSING
    topology: TopologyConfig = dataclasses.field(default_factory=TopologyConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)


class Padding(str, enum.Enum):
    max_length = "max_length"  # every example padded to task.max_seq_length: one shape
    buckets = "buckets"  # each batch padded to the next of a few lengths: less padding, few shapes


class LongConversations(str, enum.Enum):
    """task=sft: what happens to a conversation longer than task.max_seq_length."""

    truncate = "truncate"  # keep its first max_seq_length tokens (the rest is not trained on)
    drop = "drop"  # leave it out


@dataclasses.dataclass
class TaskConfig:
    """WHAT objective. `clm`: causal language modelling on packed blocks. `classify`:
    sequence (or sentence-pair) classification, or regression when num_labels = 1. `sft`:
    supervised fine-tuning on conversations, the loss on the assistant's tokens. `dpo`: Direct
    Preference Optimisation on pairs of replies, one preferred. `reward`: a reward model (a
    causal LM's one-output head) on the same pairs, with the Bradley–Terry loss."""

    name: str = MISSING
    # clm: blocks of this many tokens; null → the model's context length (model.max_positions).
    # classify: examples truncated and padded to this many tokens (conf/task/classify.yaml).
    max_seq_length: Optional[int] = None
    # clm: each token attends only to its own document in a packed block, and positions
    # restart at every document (docs/recipes.md, "Documents in packed blocks"). Off: a block
    # is one sequence, documents see the ones before them, as in HF's `group_texts` recipes.
    # Off is also how every run saved before this key existed trained (`ADDED`).
    document_masking: bool = False
    # classify only, below. The data: a Hub dataset (hub_path and hub_config,
    # e.g. nyu-mll/glue with config mrpc; spelt as in the language group), or local tsv / csv /
    # jsonl / parquet files.
    hub_path: Optional[str] = None
    hub_config: Optional[str] = None
    hub_split: str = MISSING  # the Hub dataset's split to train on
    hub_eval_split: Optional[str] = MISSING  # ... and to evaluate on (sft: null → hold out)
    files: list[str] = dataclasses.field(default_factory=list)  # training examples
    eval_files: list[str] = dataclasses.field(default_factory=list)
    text_column: str = MISSING
    text_pair_column: Optional[str] = None  # null → single-sentence classification
    label_column: str = MISSING
    num_labels: Optional[int] = None  # null → from the data; 1 → regression (STS-B)
    # Metrics on the eval split, named as GLUE reports them: accuracy, f1, matthews,
    # pearson, spearman. Empty → accuracy (+ f1 with two labels), or pearson/spearman.
    metrics: list[str] = dataclasses.field(default_factory=list)
    padding: Padding = MISSING
    # sft only, below (conf/task/sft.yaml; the data settings above are shared with classify:
    # hub_path, hub_config, hub_split, hub_eval_split, files, eval_files). A conversation is a
    # `messages_column` of [{role, content}, ...] (HF chat datasets, e.g. UltraChat) or, when
    # the data has no such column, one user turn `prompt_column` and one assistant turn
    # `response_column`.
    messages_column: str = MISSING
    prompt_column: str = MISSING
    response_column: str = MISSING
    long_conversations: LongConversations = MISSING
    # A Jinja chat template that replaces the tokenizer's (null: the tokenizer's own, else
    # flaxlm's ChatML default, data/chat_template.py).
    chat_template: Optional[str] = None
    # Held-out conversations when there are no eval files and hub_eval_split is null: this
    # fraction of the training split (at least one conversation).
    eval_fraction: float = MISSING
    # Read the training conversations as a stream (a Hub dataset or JSON lines / parquet
    # files): nothing materialised whole; needs trainer.max_steps and an eval split or files.
    streaming: bool = False
    # > 0: that many generated drill conversations (arithmetic, word reversal; data/drills.py)
    # instead of files or a hub dataset: offline data for experiment=sft-llama-tiny-drills.
    # dpo: that many generated preference pairs (data/preference_drills.py).
    drills: int = 0
    # dpo only, below (conf/task/dpo.yaml): a pair is task.prompt_column and the two replies
    # `chosen_column` and `rejected_column`, each a string or a list of {role, content} turns;
    # `beta` scales the implicit reward β·(log π − log π_ref) (Rafailov et al. 2023).
    chosen_column: str = MISSING
    rejected_column: str = MISSING
    beta: float = 0.1


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
    min_frequency: int = MISSING
    special_tokens: list[str] = MISSING
    bos_token: str = MISSING
    pad_token: str = MISSING
    eos_token: str = MISSING  # also separates documents when packing
    unk_token: str = MISSING
    mask_token: str = MISSING
    convention: TokenConvention = MISSING
    # language.streaming only: the BPE trains on the first `train_docs` training documents of
    # the stream (without streaming it trains on the whole training split).
    train_docs: int = MISSING


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

    num_epochs: int = MISSING
    max_steps: Optional[int] = None  # if set, overrides num_epochs
    # Rows per optimizer step. null → hardware.per_device_batch_size × devices ×
    # grad_accum_steps; if set, must divide evenly over devices ×
    # grad_accum_steps. Fixing it keeps a run's recipe the same on different hardware.
    global_batch_size: Optional[int] = None
    # Micro-batches per optimizer step: their gradients are averaged inside one jitted step
    # before a single update, so a small machine reaches a large batch (GPT-2's 512 sequences).
    # Steps and the schedule count optimizer steps.
    grad_accum_steps: int = MISSING
    eval_every_steps: Optional[int] = None  # null → only at the end of each epoch
    log_every_steps: int = MISSING  # between train-metric log lines
    eval_before_training: bool = MISSING
    # Continue the latest checkpoint of the run directory (run_dir, or resume_from) if it has
    # one. auto: resume if there is a checkpoint, else start fresh; never: always a fresh run
    # (in a new run_dir); must: fail unless there is a checkpoint to resume.
    resume: ResumeMode = MISSING
    # A resume whose training or validation data differs from what the checkpoint recorded
    # (an edited file, a new dataset version) stops with an error; true continues on the
    # changed data and records that in metrics.jsonl (resume/changed_data).
    resume_on_changed_data: bool = False
    # A step whose loss or gradients are not finite: false → stop with an error naming the
    # step; true → skip its update (parameters and optimizer state unchanged) and go on; the
    # skipped steps are counted in train/skipped_steps.
    skip_nonfinite: bool = False
    # The z-loss (PaLM's): this coefficient × the mean log²Z of each position's softmax
    # normaliser Z is added to the LM's training loss and logged as train/z_loss (train/loss
    # includes it; eval/loss never does). 0 → none; PaLM used 1e-4.
    z_loss: float = 0.0
    # Positions of the sequence whose logits (and their float32 copy) the LM's loss holds at
    # once: the final hidden states go through the LM head chunk by chunk, recomputed in the
    # backward pass, instead of as one (batch, length, vocab) array. null → all at once.
    loss_chunk_size: Optional[int] = None
    # What the run returns to a sweeper: an eval metric it logs, e.g. eval/loss or eval/f1.
    # null → the task's main metric: eval/loss for clm; for classify f1 if task.metrics has
    # it, else the first of task.metrics (or of the defaults its num_labels gives).
    objective: Optional[str] = None
    objective_mode: Optional[ObjectiveMode] = None  # null → min for losses, max otherwise
    objective_value: ObjectiveValue = MISSING


@dataclasses.dataclass
class CheckpointConfig:
    """When to save the full train state to <run_dir>/checkpoints/ and how many to keep."""

    every_steps: Optional[int] = MISSING  # null → only at epoch ends, the last step, on SIGTERM
    at_epoch_end: bool = MISSING
    keep_last: int = MISSING  # the newest checkpoints kept
    keep_best: int = MISSING  # plus this many with the lowest eval loss (0 → none extra)
    # Write files in a background thread: the step loop only waits for the copy off the device.
    async_save: bool = MISSING


@dataclasses.dataclass
class LoggerConfig:
    """Experiment tracking. Every run writes metrics.jsonl; the `logger` group is a list of
    options merged into this one node (`logger=[wandb,tensorboard]`), each switching its flag
    on: `wandb` adds a W&B run, `tensorboard` event files in the run directory."""

    name: str = MISSING  # the option merged last; the flags below decide what runs
    wandb: bool = False
    tensorboard: bool = False
    project: Optional[str] = None  # wandb: the W&B project
    entity: Optional[str] = None
    # wandb: auto → online when logged in to W&B, otherwise offline (sync with `wandb sync`)
    mode: Optional[str] = None
    tags: list[str] = dataclasses.field(default_factory=list)
    notes: Optional[str] = None


@dataclasses.dataclass
class SamplesConfig:
    """Text the trained model writes at the end of a task=clm run: printed, logged to
    metrics.jsonl and as a W&B table. Each prompt starts a document (it follows the EOS that
    separates documents, or the tokenizer's own BOS: tokenizer.convention); an empty prompt
    lets the model start its own. No prompts → none. task=sft: each prompt is a user's turn in
    the chat template, and the model's replies are printed before training and after it."""

    prompts: list[str] = MISSING
    max_new_tokens: int = MISSING  # cut to what the context (model.max_positions) leaves
    temperature: float = MISSING  # 0 → greedy
    top_k: int = MISSING  # 0 → no cut
    top_p: float = MISSING  # 1 → no cut
    seed: int = MISSING


@dataclasses.dataclass
class HarnessConfig:
    """lm-evaluation-harness tasks run on the model while it trains (docs/evaluating.md),
    logged as `eval/<task>/<metric>`; any of these can be trainer.objective."""

    # Harness task or group names, e.g. [hellaswag, arc_easy]; none → no downstream evaluation.
    tasks: list[str] = dataclasses.field(default_factory=list)
    limit: Optional[float] = None  # examples per task (below 1: a fraction); null → all
    every_steps: Optional[int] = None  # null → at the end of the run only
    num_fewshot: Optional[int] = None  # null → each task's own
    include_path: Optional[str] = None  # a folder of task YAML files (tasks on local data)
    batch_size: int = MISSING  # rows per forward pass, split over the devices


@dataclasses.dataclass
class EvalConfig:
    """Evaluation beyond the task's own held-out loss: `eval.harness`."""

    harness: HarnessConfig = dataclasses.field(default_factory=HarnessConfig)
    # Where the held-out loss of a causal LM is also reported by position bucket: each
    # predicted token counted by how many tokens of its document (its row, without document
    # masking) the model saw, `eval/position/<from>-<to>/{loss,perplexity}`. Only the
    # boundaries below the block length split it: a run of 2048-token blocks reports none.
    position_buckets: list[int] = MISSING


@dataclasses.dataclass
class StorageRetriesConfig:
    """How a bucket call (data, checkpoints, the run's small files) that failed in a way worth
    retrying (a connection cut or refused, a timeout, throttling, a 5xx) is tried again: at
    most `attempts` tries in all, waits doubling from `first_wait_s` to `max_wait_s`, each
    drawn from the upper half of its bound (flaxlm.storage_retry)."""

    attempts: int = MISSING  # 1: no retry
    first_wait_s: float = MISSING
    max_wait_s: float = MISSING


@dataclasses.dataclass
class TrainConfig:
    """The whole composed config of `flaxlm-train`."""

    language: Optional[LanguageConfig] = None  # task=classify: none (its data is in task)
    # language=[a,b,...] (language.source=mixture): the corpora mixed and their weights.
    mixture: Optional[MixtureConfig] = None
    model: ModelConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    hardware: HardwareConfig = MISSING
    task: TaskConfig = MISSING
    logger: LoggerConfig = MISSING
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    samples: SamplesConfig = dataclasses.field(default_factory=SamplesConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    seed: int = MISSING
    # Where this run writes; a new run never reuses an existing one. Hydra fills it in for a
    # run (null only where Hydra runs no job, e.g. `flaxlm-train --cfg job --resolve`).
    run_dir: Optional[str] = MISSING
    # Continue the run in this directory (its latest complete checkpoint) instead of run_dir;
    # or a gs:// or s3:// URL: the output_url of the run to continue, in run_dir (a new local
    # folder).
    resume_from: Optional[str] = None
    # gs://bucket/path or s3://bucket/path: this run's folder in a bucket, for hosts that share
    # no disk. Its checkpoints are written there by every process (run_dir, local, keeps the
    # rest); the same command with the same output_url, on any host, continues the run
    # (flaxlm.run_mirror).
    output_url: Optional[str] = None
    # Retries of every bucket call (output_url, resume_from, data and models in a bucket).
    storage_retries: StorageRetriesConfig = dataclasses.field(
        default_factory=StorageRetriesConfig)
    # Tokenizers and packed token blocks, shared by runs (FLAXLM_CACHE).
    cache_dir: str = MISSING
    # Keep the compiled train and eval steps in <cache_dir>/executables and load them in a
    # later run with the same key (config, devices, versions, flaxlm's source): no tracing,
    # no compiling (flaxlm.training.executables).
    keep_compiled_steps: bool = MISSING
    # A directory written by `flaxlm-plan ... --save DIR` for this run's devices: its steps
    # are loaded instead of compiled; one made for another run is refused.
    compiled_steps: Optional[str] = None


# Keys an earlier release spelt differently, by their old dotted key → the key now. Given on
# the command line or in a user's YAML, an old key is an error that names the new one
# (`renamed_keys`); a run directory's saved config.yaml, or a checkpoint's, written by an
# earlier release is read through `upgrade_saved_config`, so that its runs still resume and
# export. docs/configuration.md lists them.
RENAMED = {
    "task.dataset": "task.hub_path",
    "task.dataset_config": "task.hub_config",
    "task.train_split": "task.hub_split",
    "task.eval_split": "task.hub_eval_split",
    "task.train_files": "task.files",
    "trainer.eval_every": "trainer.eval_every_steps",
    "trainer.log_every": "trainer.log_every_steps",
    "model.param_dtype": "hardware.param_dtype",
    "optimizer.kind": "optimizer.name",
    # GPT2Config's names, once ModelConfig's for every family (docs/models.md).
    "model.n_positions": "model.max_positions",
    "model.n_embd": "model.hidden_size",
    "model.n_layer": "model.num_layers",
    "model.n_head": "model.num_heads",
    "model.n_kv_head": "model.num_kv_heads",
    "model.n_inner": "model.mlp_size",
    "model.activation_function": "model.activation",
    "model.resid_pdrop": "model.hidden_dropout",
    "model.embd_pdrop": "model.embedding_dropout",
    "model.attn_pdrop": "model.attention_dropout",
    "model.layer_norm_epsilon": "model.layer_norm_eps",
}


# Keys added since earlier releases whose runs behaved as a value other than the one a run
# composes today may get, by dotted key → that value. `upgrade_saved_config` fills them into
# a saved config that lacks them, so a resumed run is checked against what it really did: an
# earlier run resumed with a setting that would change what it trains is refused, naming it.
ADDED = {
    "task.document_masking": False,  # blocks were one sequence each
    "model.attention": "xla",  # jax.nn.dot_product_attention's default, XLA's
    "model.scan_layers": False,  # one module per layer
    "hardware.dropout_rng": "threefry",  # JAX's default key
    "hardware.mesh.expert": 1,  # no expert axis
    "hardware.mesh.context": 1,  # no context axis
    "hardware.mesh.balance_context": False,  # contiguous slices (the same result)
    "model.context_attention": "all_gather",  # the only variant there was
}


def renamed_keys(text: str) -> list[str]:
    """"<old> was renamed <new>" for each renamed key that `text` (an error message naming
    keys, e.g. Hydra's "Could not override 'trainer.eval_every'") names in full."""
    return [f"{old} was renamed {new}" for old, new in RENAMED.items()
            if re.search(rf"(?<![\w.]){re.escape(old)}(?![\w])", text)]


def upgrade_saved_config(tree: dict) -> dict:
    """A saved config (nested, as config.yaml holds it) with every key of `RENAMED` under its
    name now, and every key of `ADDED` it lacks at the value its run behaved as. A value moves
    unless it is null where the new key already has one: an earlier model.param_dtype of null
    meant "hardware.param_dtype's"."""
    tree = copy.deepcopy(tree)
    for added, value in ADDED.items():
        *path, leaf = added.split(".")
        parent = _node(tree, path)
        if isinstance(parent, dict) and leaf not in parent:
            parent[leaf] = value
    for old, new in RENAMED.items():
        *old_path, old_leaf = old.split(".")
        parent = _node(tree, old_path)
        if not isinstance(parent, dict) or old_leaf not in parent:
            continue
        value = parent.pop(old_leaf)
        *new_path, new_leaf = new.split(".")
        target = _node(tree, new_path, create=True)
        if value is not None or new_leaf not in target:
            target[new_leaf] = value
    return tree


def _node(tree: dict, path: list[str], create: bool = False):
    for key in path:
        if not isinstance(tree, dict):
            return None
        if key not in tree and create:
            tree[key] = {}
        tree = tree.get(key)
    return tree


def register_configs() -> None:
    """Make the schema known to Hydra as `train_schema`, the first entry of conf/train.yaml's
    defaults list: every group file and override is then merged onto a typed node; and the
    resolvers the config files call."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    OmegaConf.register_new_resolver("rows_per_device", rows_per_device, replace=True)
    OmegaConf.register_new_resolver("loss_chunk_size", loss_chunk_size, replace=True)


def rows_per_device(tokens: int | None, rows: int, task: str, max_seq_length: int | None,
                    max_positions: int) -> int:
    """`rows` per device, fewer for task=clm where they would hold more than `tokens` (its
    rows are packed blocks of task.max_seq_length tokens; null: the model's context), at
    least one; `rows` for any other task (padded rows of varying use) or without `tokens`."""
    if tokens is None or task != "clm":
        return rows
    return max(1, min(rows, tokens // (max_seq_length or max_positions)))


LOSS_CHUNK = 512  # positions per chunk of the LM loss when it is chunked by default


def loss_chunk_size(max_whole_gib: float | None, rows: int, max_seq_length: int | None,
                    max_positions: int, vocab_size: int) -> int | None:
    """trainer.loss_chunk_size's default: LOSS_CHUNK where `rows` rows of the task's length
    would hold more than `max_whole_gib` of float32 logits (the LM loss's input, and its
    gradient's), None (whole) otherwise or without a limit."""
    if max_whole_gib is None:
        return None
    logits_bytes = rows * (max_seq_length or max_positions) * vocab_size * 4
    return LOSS_CHUNK if logits_bytes > max_whole_gib * 2**30 else None


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
