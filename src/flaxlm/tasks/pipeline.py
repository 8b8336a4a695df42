"""The one pipeline every task runs, and the interface through which a task states its parts.

A run goes: the model it starts from → the task's data → the train state (optimizer, weights,
a stopped run restored) → the run's model/ directory started → the evaluator → the banner →
the loop with its hooks → the final metrics → the export (and samples). That order, and every
step in it that does not depend on the objective, is written once, in `run`; the steps
themselves live in tasks/base.py. A task (`Task`) states only what is its own: its data, the
network it trains and its steps, its evaluation, its hooks, its final metrics and what it
exports. It never calls a step of the pipeline itself.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from flaxlm.config import TrainConfig
from flaxlm.data.loader import BatchSource
from flaxlm.models import lora, moe
from flaxlm.models.layers import TransformerSpec
from flaxlm.parallel import run_accelerator
from flaxlm.tasks import base
from flaxlm.tasks.base import EvalMetrics, JobContext, Start, Training
from flaxlm.training.evaluation import Evaluate
from flaxlm.training.loop import Hook, Throughput
from flaxlm.training.plan import global_batch_size
from flaxlm.training.step import CompiledSteps, TrainState


@dataclasses.dataclass(kw_only=True)
class TaskData:
    """What a task trains and evaluates on, as the pipeline reads it. A task's own data (its
    held-out rows, its labels, ...) is a subclass that adds fields."""

    tokenizer: Any
    loader: BatchSource
    fingerprint: dict[str, str]  # what a checkpoint records of the data (prepare_training)
    trains_on: str  # for the banner: its rows, their length and layout, where they come from
    batch_unit: str = ""  # for the banner: what a row of the global batch is ("pairs")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Network:
    """The network a task trains, as the pipeline makes, compiles, sizes and saves it."""

    build: Callable[[TransformerSpec, nnx.Rngs], nnx.Module]
    compile_steps: Callable[..., CompiledSteps]  # (mesh, graphdef, optimizer)
    flops_per_token: Callable[[Training], float]  # for MFU, of the model as built
    # model/config.json, written at the start (flaxlm-export reads it): a classifier's
    # transformers config, which its export writes again; an LM's values (`hf.lm_config_json`),
    # since its export makes its own config and the class would import PyTorch at the start.
    hf_config: Any
    tokenizer: Any  # the tokenizer model/ keeps
    # The nnx filter of what trains (None: every parameter); with model.lora the adapters
    # (`lora.trainable`), and whatever else a task trains beside them (a fresh head).
    trainable: Any = None
    about: str = ""  # for the banner, after the parameter count: "2 labels", "DPO β=0.1"
    sequences_per_row: int = 1  # sequences of seq_len tokens in a row (DPO's pair: two)


@dataclasses.dataclass
class Run:
    """One run as the pipeline builds it up, step by step; each part of the task is handed it
    and reads what the steps before have made."""

    job: JobContext
    config: TrainConfig  # with the model the run starts from (model.init_from's shape)
    start: Start
    seq_len: int
    batch_size: int  # global: rows per optimizer step
    eval_batch_size: int  # global: rows per evaluation batch
    data: Any = None  # the task's TaskData
    network: Network | None = None
    training: Training | None = None
    evaluator: Evaluate | None = None
    throughput: Throughput | None = None


class Task(abc.ABC):
    """One objective flaxlm trains for; `flaxlm.tasks.registry` registers each by name. The
    abstract methods are what every task states; the others have the common answer."""

    # Whether its rows are padded examples whose padding attention must mask (rather than
    # blocks of tokens, every one real): the fused kernels that take only causal and segment
    # masks cannot run its model.
    pads_rows: bool = False
    # Whether the loader's batches are what the train step takes before the train state exists
    # (not so for DPO, whose rows get the reference model's log-probs then): the train step is
    # then compiled from the first batch's shapes while the model is initialised.
    batches_before_state: bool = True

    def libraries(self, config: TrainConfig) -> list[str]:
        """The slow-to-import libraries a run of `config` will use (imported while the runtime
        starts, `lazy_imports.import_in_background`): the tokenizer's class, and `datasets`
        for the examples of every task but the language model's own corpora."""
        return ["transformers.PreTrainedTokenizerFast", "datasets"]

    @abc.abstractmethod
    def check_settings(self, config: TrainConfig) -> int:
        """Check what can be checked before any data is read (raising FlaxlmError); return the
        sequence length the task trains on."""

    @abc.abstractmethod
    def eval_metrics(self, config: TrainConfig) -> EvalMetrics:
        """The eval metrics a run of `config` will log, known before any data is read."""

    def sequence_length(self, config: TrainConfig, seq_len: int) -> int:
        """The sequence length once the model the run starts from is known (`config.model`:
        model.init_from's shape), checked; `seq_len` is what `check_settings` returned."""
        return seq_len

    @abc.abstractmethod
    def data(self, run: Run) -> TaskData:
        """Read, check and lay out the data; its tokenizer and its training loader."""

    @abc.abstractmethod
    def network(self, run: Run) -> Network:
        """The network the task trains on `run.data`, and its steps."""

    def with_state(self, run: Run) -> None:
        """What the task does once the train state exists (`run.training`), before the run's
        model/ is started. Most tasks need nothing here."""
        return None

    @abc.abstractmethod
    def evaluator(self, run: Run) -> Evaluate:
        """The evaluation the loop runs, over the held-out data."""

    def hooks(self, run: Run) -> list[Hook]:
        """The task's own loop hooks, run after the evaluation (training/hooks.py)."""
        return []

    def final_metrics(self, run: Run, state: TrainState, last_eval: dict) -> dict[str, float]:
        """What the run returns and its model card reports: the last evaluation, the tokens
        trained on and the steps."""
        steps = int(state.step)
        return {**last_eval, "tokens_seen": steps * run.throughput.tokens_per_step,
                "steps": steps}

    @abc.abstractmethod
    def export(self, run: Run, params: dict, final: dict) -> None:
        """Complete the run's model/ from the trained `params` (and whatever else the task
        leaves behind: samples, predictions)."""


def run(task: Task, job: JobContext, seq_len: int) -> dict[str, float]:
    """Train `task` in `job`; return its final metrics (`eval/loss` and `steps` among them).
    `seq_len`: what the task's `check_settings` returned."""
    start = base.model_start(job.config)
    config = dataclasses.replace(job.config, model=start.model)
    run = Run(job, config, start, task.sequence_length(config, seq_len),
              global_batch_size(config, job.mesh.size),
              base.eval_batch_size(config.hardware, job.mesh.size))
    run.data = data = task.data(run)
    run.network = network = task.network(run)
    run.training = training = base.prepare_training(
        job, start, network.build, network.compile_steps, data.loader, data.tokenizer,
        data.fingerprint, pads_rows=task.pads_rows, trainable=network.trainable,
        compile_ahead=task.batches_before_state)
    task.with_state(run)
    base.start_model_dir(job, config.model, network.tokenizer, network.hf_config)
    run.evaluator = evaluator = task.evaluator(run)
    run.throughput = base.throughput(
        job, run.batch_size * network.sequences_per_row * run.seq_len,
        network.flops_per_token(training))
    print(banner(run, network))
    state, last_eval = base.run_loop(job, training, data.loader, evaluator, run.throughput,
                                     hooks=task.hooks(run))
    final = task.final_metrics(run, state, last_eval)
    task.export(run, base.model_params(state), final)
    return final


def banner(run: Run, network: Network) -> str:
    """The line that says what the run is about to do, from what the task names: what the
    network is about (`Network.about`) and what it trains on (`TaskData.trains_on`)."""
    training, model = run.training, run.config.model
    about = f", {network.about}" if network.about else ""
    if moe.enabled(model):  # what a token meets: its top-k experts of each sparse layer
        active = moe.num_active_params(model, training.num_params)
        dispatch = moe.describe_dispatch(model.moe, run_accelerator(run.config.hardware).platform)
        about += (f", {active / 1e6:.2f}M active: {model.moe.top_k} of "
                  f"{model.moe.num_experts} experts per token, {dispatch}")
    if training.trainable is not None:
        about += (f", {training.num_trainable / 1e6:.3g}M of them trained "
                  f"({100 * training.num_trainable / training.num_params:.2g}%: "
                  f"model.lora rank {model.lora.rank} on {', '.join(lora.targets(model))})")
    about += f", optimizer state {training.opt_state_bytes / 2**20:,.1f} MiB"
    unit = f" {run.data.batch_unit}" if run.data.batch_unit else ""
    return (f"flaxlm: {model.name} ({training.num_params / 1e6:.2f}M params{about}) on "
            f"{run.job.mesh.size} {jax.default_backend()} device(s), "
            f"{training.attention.describe()} | {run.data.trains_on} | global batch "
            f"{run.batch_size}{unit} ({run.throughput.tokens_per_step} tokens/step) | "
            f"{training.plan.total_steps} steps ({training.plan.steps_per_epoch}/epoch) | "
            f"run dir {run.job.run.path}")
