"""The Mixture-of-Experts MLP of the llama-family decoders (`model.moe`): a router and a set of
SwiGLU experts, optionally a gated shared expert, in the parameter layout of transformers'
Qwen3-MoE / Qwen2-MoE / OLMoE blocks (`mlp.gate`, `mlp.experts`, `mlp.shared_expert`,
`mlp.shared_expert_gate`), the experts' matrices stacked on a leading expert axis.

Routing (as the released families route): softmax over the router's logits in float32, each
token's `top_k` largest probabilities chosen, divided by their sum where the family does
(`normalize_top_k`); the token's output is its experts' outputs weighted by them. With
`bias_update_rate` the choice is made on the probabilities plus a per-expert bias that the
train step moves toward the even load (DeepSeek-V3's auxiliary-loss-free balancing); the
weights stay the unbiased probabilities.

Dispatch (`model.moe.dispatch`): the token copies (T·K of them) are sorted by expert and each
expert's run of rows multiplied by its matrices in one grouped matmul (`grouped_matmul`), then
unsorted and summed per token: no row meets an expert it was not sent to, and nothing is
dropped. With `capacity_factor` each expert takes at most that many times its even share of a
device's copies, in order, into a fixed (E, C) buffer, and the rest are dropped (their MLP
output is zero; the residual carries the token on). `dense` runs every token through every
expert and weights by the routing (zero off the chosen ones): the reference the others are
tested against.

Within a step on a device mesh the dispatch runs per device on its own rows
(`jax.shard_map` over the batch axes): a sort over the whole global batch would move every
token between devices. The router and its statistics stay global. With an `expert` mesh axis
(`hardware.mesh.expert`, expert parallelism) each of its P devices holds E/P of the experts:
a device sorts its own copies by expert as above, sends each device the ones for its experts
(`jax.lax.all_to_all`), runs what it receives through its experts and sends the outputs back
(`_expert_exchange`; with a capacity, `_capacity_exchange`).

Statistics (`RouterStats`, per sparse layer, over the whole batch): Switch's load-balancing
loss E · Σ_e f_e · P̄_e (f_e the tokens sent to expert e per token, P̄_e its mean probability;
transformers' definition, K at the even load), the router's z-loss (mean log²Z of its
logits), each expert's share of the copies, and the share dropped.

Shapes: T tokens (rows × positions), D model width, E experts, K experts per token, F an
expert's width, M = T·K token copies, C an expert's capacity.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import PartitionSpec

from flaxlm.config import ModelConfig, MoeConfig, MoeDispatch
from flaxlm.errors import FlaxlmError
from flaxlm.models.grouped_matmul import grouped_matmul
from flaxlm.models.layers import ACTIVATIONS, TransformerSpec, axes, check_experts_family
from flaxlm.parallel import BATCH_AXES, EXPERT_AXIS, TENSOR_AXIS, sequence_axis


def check_moe(cfg: ModelConfig) -> None:
    """The expert settings that must make sense before any data is read or anything built:
    experts exactly on the families that have them (`layers.check_experts_family`), then
    their numbers."""
    check_experts_family(cfg)
    moe = cfg.moe
    if moe.num_experts is None:
        return
    problems = []
    if moe.num_experts < 1:
        problems.append(f"model.moe.num_experts={moe.num_experts} must be at least 1")
    elif not 1 <= moe.top_k <= moe.num_experts:
        problems.append(f"model.moe.top_k={moe.top_k} must be between 1 and "
                        f"model.moe.num_experts={moe.num_experts}: a token cannot go to more "
                        "experts than there are")
    if moe.capacity_factor is not None and not moe.capacity_factor > 0:
        problems.append(f"model.moe.capacity_factor={moe.capacity_factor} must be > 0 (1.0: "
                        "each expert takes its even share of the tokens; null: dropless)")
    if not 0 <= moe.first_dense_layers < cfg.num_layers:
        problems.append(f"model.moe.first_dense_layers={moe.first_dense_layers} must be from 0 "
                        f"to model.num_layers - 1 = {cfg.num_layers - 1}")
    elif moe.first_dense_layers and cfg.scan_layers:
        problems.append(f"model.moe.first_dense_layers={moe.first_dense_layers} with "
                        "model.scan_layers=true: a scan runs one kind of layer, and the first "
                        "layers are dense; set model.scan_layers=false")
    for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
        if not getattr(moe, name) >= 0:
            problems.append(f"model.moe.{name}={getattr(moe, name)} must be >= 0")
    if problems:
        raise FlaxlmError("; ".join(problems) + ".")


def enabled(cfg: ModelConfig) -> bool:
    return cfg.moe.num_experts is not None


def expert_width(cfg: ModelConfig) -> int:
    return cfg.moe.expert_mlp_size or cfg.mlp_size or 4 * cfg.hidden_size


def is_sparse_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether decoder layer `layer` has experts (the first `first_dense_layers` do not)."""
    return enabled(cfg) and layer >= cfg.moe.first_dense_layers


def dispatch_backend(moe: MoeConfig, platform: str | None = None) -> str:
    """The dispatch `model.moe.dispatch` means on `platform` (the default backend's if None):
    auto is megablox's kernel on a TPU, ragged_dot on a GPU, the tiled grouped matmul on a
    CPU (where ragged_dot is every row times every expert)."""
    dispatch = MoeDispatch(moe.dispatch)
    if dispatch is not MoeDispatch.auto:
        return dispatch.value
    platform = platform or jax.default_backend()
    return {"tpu": "megablox", "gpu": "ragged"}.get(platform, "tiled")


def resolved(moe: MoeConfig, platform: str) -> MoeConfig:
    """`moe` with its dispatch as it runs on `platform`: auto made concrete before the model is
    traced, so that a plan compiled on this CPU for a TPU traces the TPU's kernel, not the
    CPU's."""
    return dataclasses.replace(moe, dispatch=MoeDispatch(dispatch_backend(moe, platform)))


def describe_dispatch(moe: MoeConfig, platform: str | None = None) -> str:
    """How tokens reach their experts on `platform`, for the run's banner."""
    backend = dispatch_backend(moe, platform)
    if moe.capacity_factor is not None and backend != MoeDispatch.dense.value:
        return f"tokens past capacity factor {moe.capacity_factor:g} dropped"
    return f"{backend} dispatch"


@struct.dataclass
class RouterStats:
    """One sparse layer's routing over a batch (stacked over layers on a leading axis)."""

    balance_loss: jax.Array  # Switch's load-balancing loss, unscaled: K at the even load
    z_loss: jax.Array  # mean log²Z of the router's logits
    load_E: jax.Array  # each expert's share of the token copies (sums to 1)
    dropped: jax.Array  # the share of token copies dropped past capacity (0 dropless)


# The experts' stacked matrices, by their parameter names (weight decay applies to them).
EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")


class Experts(nnx.Module):
    """E SwiGLU MLPs, their matrices stacked: gate and up (E, D, F), down (E, F, D)."""

    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        cfg = spec.model
        E, D, F = cfg.moe.num_experts, cfg.hidden_size, expert_width(cfg)
        init = nnx.initializers.normal(cfg.initializer_range)

        def matrix(shape, logical_axes):
            return nnx.Param(init(rngs.params(), shape, spec.param_dtype), **axes(*logical_axes))

        self.gate_proj = matrix((E, D, F), ("experts", "embed", "mlp"))
        self.up_proj = matrix((E, D, F), ("experts", "embed", "mlp"))
        self.down_proj = matrix((E, F, D), ("experts", "mlp", "embed"))
        self.activation = ACTIVATIONS[cfg.activation]
        self.dtype = spec.compute_dtype

    def matrices(self):
        # jnp: a model filled from host arrays (a checkpoint read into an abstract model)
        # holds numpy ones, which the grouped matmul's traced expert index cannot index.
        return tuple(jnp.asarray(w[...], self.dtype)
                     for w in (self.gate_proj, self.up_proj, self.down_proj))


class RouterBias(nnx.Param):
    """The auxiliary-loss-free balancing bias (`bias_update_rate`, kept as its `update_rate`
    metadata): in the parameters, so that it is checkpointed and sharded with them, but never
    differentiated (its gradient is zero, and so is any optimizer's update of it); the train
    step moves it (`rebalanced`)."""


class MoeMLP(nnx.Module):
    """The sparse MLP: router (`gate`), experts, and the optional shared expert."""

    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs, shared_mlp: type[nnx.Module]):
        cfg = spec.model
        self.moe = cfg.moe
        E = cfg.moe.num_experts
        # The router's weights in float32 whatever the parameters' dtype: a bfloat16 logit
        # differs from its neighbour by 1/128 of its size, enough to flip a top-k choice.
        self.gate = nnx.Linear(cfg.hidden_size, E, use_bias=False, dtype=jnp.float32,
                               param_dtype=jnp.float32,
                               kernel_init=nnx.initializers.normal(cfg.initializer_range),
                               kernel_metadata=axes("embed", None), rngs=rngs)
        self.experts = Experts(spec, rngs)
        if cfg.moe.bias_update_rate:
            self.router_bias = RouterBias(jnp.zeros(E, jnp.float32),
                                          update_rate=cfg.moe.bias_update_rate, **axes(None))
        if cfg.moe.shared_expert_size:
            self.shared_expert = shared_mlp(spec, rngs, width=cfg.moe.shared_expert_size)
            self.shared_expert_gate = nnx.Linear(
                cfg.hidden_size, 1, use_bias=False, dtype=spec.compute_dtype,
                param_dtype=spec.param_dtype,
                kernel_init=nnx.initializers.normal(cfg.initializer_range),
                kernel_metadata=axes("embed", None), rngs=rngs)

    def __call__(self, x_BxLxD: jax.Array, rngs: nnx.Rngs | None = None
                 ) -> tuple[jax.Array, RouterStats]:
        logits_BxLxE = self.gate(x_BxLxD.astype(jnp.float32))
        weights_BxLxK, experts_BxLxK = self.route(logits_BxLxE)
        out_BxLxD, dropped = dispatch(x_BxLxD, experts_BxLxK,
                                      weights_BxLxK.astype(x_BxLxD.dtype),
                                      self.experts, self.moe)
        if self.moe.shared_expert_size:
            shared_BxLxD = self.shared_expert(x_BxLxD, rngs)
            gate_BxLx1 = jax.nn.sigmoid(self.shared_expert_gate(x_BxLxD))
            out_BxLxD = out_BxLxD + gate_BxLx1 * shared_BxLxD
        return out_BxLxD, router_stats(logits_BxLxE, experts_BxLxK, dropped)

    def route(self, logits_BxLxE: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each token's K routing weights and experts (B, L, K)."""
        probs_BxLxE = jax.nn.softmax(logits_BxLxE, axis=-1)
        choice_BxLxE = jax.lax.stop_gradient(probs_BxLxE)
        if self.moe.bias_update_rate:
            choice_BxLxE = choice_BxLxE + jax.lax.stop_gradient(self.router_bias[...])
        _, experts_BxLxK = jax.lax.top_k(choice_BxLxE, self.moe.top_k)
        # The chosen probabilities by one-hot sums, not top_k's values or a gather: their
        # gradient is then elementwise, where top_k's is a scatter into (tokens, E) that ran
        # one update at a time on a TPU.
        chosen_BxLxKxE = experts_BxLxK[..., None] == jnp.arange(probs_BxLxE.shape[-1])
        weights_BxLxK = jnp.sum(jnp.where(chosen_BxLxKxE, probs_BxLxE[..., None, :], 0.0),
                                axis=-1)
        if self.moe.normalize_top_k:
            weights_BxLxK = weights_BxLxK / weights_BxLxK.sum(-1, keepdims=True)
        return weights_BxLxK, experts_BxLxK


def router_stats(logits_BxLxE: jax.Array, experts_BxLxK: jax.Array,
                 dropped: jax.Array) -> RouterStats:
    E = logits_BxLxE.shape[-1]
    logits_TxE = logits_BxLxE.reshape(-1, E)
    T = logits_TxE.shape[0]
    counts_E = expert_counts(experts_BxLxK.reshape(-1), E).astype(jnp.float32)
    mean_probs_E = jax.nn.softmax(logits_TxE, axis=-1).mean(0)
    log_z_T = jax.nn.logsumexp(logits_TxE, axis=-1)
    return RouterStats(balance_loss=E * jnp.sum(counts_E / T * mean_probs_E),
                       z_loss=jnp.mean(jnp.square(log_z_T)),
                       load_E=counts_E / counts_E.sum(), dropped=dropped)


# The metric holding each sparse layer's expert loads (S, E): what `rebalanced` reads; the
# train step takes it out of the metrics it reports, which are scalars.
LOAD_METRIC = "moe/load"

AuxLosses = tuple[jax.Array, dict[str, jax.Array]]


def aux_losses(stats: RouterStats, moe: MoeConfig) -> AuxLosses:
    """What the router adds to the training loss (aux_loss_coef × the balancing loss, plus
    z_loss_coef × its z-loss, each the mean over the sparse layers), and the metrics beside
    it: both losses unscaled, the busiest and idlest expert's load as a multiple of the even
    share (1 is even; 0 an expert that got nothing, `dead_experts` of them over all layers),
    over all sparse layers and each on its own (`moe/layer_<i>/load_max`, `load_min`: i the
    decoder layer's index), the share of token copies dropped, and `LOAD_METRIC`."""
    balance, z_loss = stats.balance_loss.mean(), stats.z_loss.mean()
    load_SxE = stats.load_E
    E = load_SxE.shape[-1]
    metrics = {
        "moe/balance_loss": balance,
        "moe/router_z_loss": z_loss,
        "moe/load_max": load_SxE.max() * E,
        "moe/load_min": load_SxE.min() * E,
        "moe/dead_experts": (load_SxE == 0).sum().astype(jnp.float32),
        "moe/dropped": stats.dropped.mean(),
        LOAD_METRIC: load_SxE,
    }
    for sparse, layer in enumerate(range(moe.first_dense_layers,
                                         moe.first_dense_layers + load_SxE.shape[0])):
        metrics[f"moe/layer_{layer}/load_max"] = load_SxE[sparse].max() * E
        metrics[f"moe/layer_{layer}/load_min"] = load_SxE[sparse].min() * E
    return moe.aux_loss_coef * balance + moe.z_loss_coef * z_loss, metrics


def rebalance(bias_E: jax.Array, load_E: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's update of the routing bias after a step: up by `rate` for an expert
    below the even share, down for one above (unchanged at exactly even)."""
    return bias_E + rate * jnp.sign(1.0 / load_E.shape[-1] - load_E)


def rebalanced(params, load_SxE: jax.Array | None):
    """`params` (an nnx.State) with every `RouterBias` moved by `rebalance` for its layer's
    load: a scanned model's one stacked bias (S, E) at once, an unrolled model's one per
    sparse layer, in layer order (as the loads are stacked). Unchanged without biases."""
    if load_SxE is None:
        return params
    layer = iter(range(load_SxE.shape[0]))

    def update(variable):
        if not isinstance(variable, RouterBias):
            return variable
        rate = variable.get_metadata()["update_rate"]
        bias = variable[...]
        load = load_SxE if bias.ndim == 2 else load_SxE[next(layer)]
        return variable.replace(rebalance(bias, load, rate))

    return jax.tree.map(update, params, is_leaf=lambda node: isinstance(node, nnx.Variable))


# ---------------------------------------------------------------- dispatch


def dispatch(x_BxLxD: jax.Array, experts_BxLxK: jax.Array, weights_BxLxK: jax.Array,
             experts: Experts, moe: MoeConfig) -> tuple[jax.Array, jax.Array]:
    """The experts' weighted outputs (B, L, D) and the share of token copies dropped: on a
    mesh, each device its own rows (`jax.shard_map` over the batch axes; the experts'
    matrices whole on every device, or split over `tensor` on their width, the partial
    outputs then summed over it; with an `expert` axis, each device holds E/expert of the
    experts and its token copies travel to their experts' devices and back by all-to-all,
    `_expert_exchange`); off one, directly."""
    matrices = experts.matrices()
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(axis not in mesh.axis_names for axis in BATCH_AXES):
        return _local_dispatch(x_BxLxD, experts_BxLxK, weights_BxLxK, matrices,
                               experts.activation, moe)
    tensor = TENSOR_AXIS if mesh.shape.get(TENSOR_AXIS, 1) > 1 else None
    # The dense reference runs every token through every expert: it gathers them all.
    expert = (EXPERT_AXIS if mesh.shape.get(EXPERT_AXIS, 1) > 1
              and dispatch_backend(moe) != MoeDispatch.dense.value else None)
    exchange = None if expert is None else _Exchange(expert, mesh.shape[expert])
    # Under a context axis each device holds a slice of its rows' positions: its tokens.
    positions = [axis] if (axis := sequence_axis(x_BxLxD.shape[1])) else []

    def per_device(x, e, w, *m):
        out_BxLxD, dropped = _local_dispatch(x, e, w, m, experts.activation, moe, exchange)
        if tensor:  # each device holds 1/tensor of every expert's width: partial sums
            out_BxLxD = jax.lax.psum(out_BxLxD, tensor)
        return out_BxLxD, jax.lax.pmean(dropped, (*BATCH_AXES, *positions))

    rows = PartitionSpec(BATCH_AXES, *positions)
    return jax.shard_map(
        per_device, mesh=mesh,
        in_specs=(rows, rows, rows, PartitionSpec(expert, None, tensor),
                  PartitionSpec(expert, None, tensor), PartitionSpec(expert, tensor, None)),
        out_specs=(rows, PartitionSpec()), check_vma=False,
    )(x_BxLxD, experts_BxLxK, weights_BxLxK, *matrices)


@dataclasses.dataclass(frozen=True)
class _Exchange:
    """The mesh axis a device's token copies cross to reach their experts: `devices` of
    them, device i holding experts i·E/devices to (i + 1)·E/devices - 1."""

    axis: str
    devices: int


def _local_dispatch(x_BxLxD, experts_BxLxK, weights_BxLxK, matrices, activation,
                    moe: MoeConfig, exchange: _Exchange | None = None):
    B, L, D = x_BxLxD.shape
    K = experts_BxLxK.shape[-1]
    x_TxD = x_BxLxD.reshape(B * L, D)
    experts_TxK = experts_BxLxK.reshape(B * L, K)
    weights_TxK = weights_BxLxK.reshape(B * L, K)
    backend = dispatch_backend(moe)
    E = moe.num_experts  # the matrices hold E/devices of them under an exchange

    def grouped(x_MxD, group_sizes):
        return _grouped_mlp(x_MxD, group_sizes, matrices, activation, backend)

    def batched(x_GxCxD):
        return _batched_mlp(x_GxCxD, matrices, activation)

    if backend == MoeDispatch.dense.value:
        out_TxD, dropped = _dense(x_TxD, experts_TxK, weights_TxK, matrices, activation)
    elif moe.capacity_factor is not None:
        through = batched if exchange is None else functools.partial(
            _capacity_exchange, batched, exchange=exchange)
        out_TxD, dropped = _with_capacity(x_TxD, experts_TxK, weights_TxK, E, through,
                                          moe.capacity_factor)
    else:
        # A token's K experts are distinct, so at most min(K, E/devices) of its copies go to
        # one device: the most one device can be sent by another, nothing dropped.
        through = grouped if exchange is None else functools.partial(
            _expert_exchange, grouped, exchange=exchange,
            rows=B * L * min(K, E // exchange.devices))
        out_TxD, dropped = _dropless(x_TxD, experts_TxK, weights_TxK, E, through)
    return out_TxD.reshape(B, L, D), dropped


def _dropless(x_TxD, experts_TxK, weights_TxK, num_experts, through_experts):
    """Token copies sorted by expert (stably: within an expert, in token order), through the
    experts (`through_experts(x_MxD, group_sizes_E)`: each expert's run of rows by its MLP),
    then each token's K outputs summed with their weights."""
    T, K = experts_TxK.shape
    expert_M = experts_TxK.reshape(T * K)
    order_M, inverse_M, weight_M = sorting(expert_M,
                                           jax.lax.stop_gradient(weights_TxK).reshape(-1))
    # Copy m of the token-major list is token m // K: sorted copy j is token order_M[j] // K,
    # and token t's k-th copy went to sorted row inverse_M[t·K + k].
    token_M, inverse_TxK = order_M // K, inverse_M.reshape(T, K)
    x_MxD = to_experts(x_TxD, token_M, inverse_TxK)
    group_sizes_E = expert_counts(expert_M, num_experts)
    y_MxD = through_experts(x_MxD, group_sizes_E)
    return (combine(y_MxD, token_M, inverse_TxK, weights_TxK, weight_M),
            jnp.zeros((), jnp.float32))


# The two moves of the dropless dispatch, each a gather both ways. Written as the repeat of
# every token K times then permuted (and the reverse), XLA builds (T, K, D) arrays between
# them, which a TPU lays out with K padded to 8 sublanes, and differentiated a gather becomes
# a scatter-add, slow on a TPU: together a tenth of moe-small's step on a v5e.


@jax.custom_vjp
def to_experts(x_TxD: jax.Array, token_M: jax.Array, inverse_TxK: jax.Array) -> jax.Array:
    """The sorted copies' rows, `x_TxD[token_M]`. Its gradient sums each token's K copies'
    gradients, found where `inverse_TxK` says they went: a gather per copy."""
    return x_TxD[token_M]


def _to_experts_forward(x_TxD, token_M, inverse_TxK):
    return x_TxD[token_M], inverse_TxK


def _to_experts_backward(inverse_TxK, grad_MxD):
    grad_TxD = sum(grad_MxD[inverse_TxK[:, k]].astype(jnp.float32)
                   for k in range(inverse_TxK.shape[1]))
    return grad_TxD.astype(grad_MxD.dtype), None, None


to_experts.defvjp(_to_experts_forward, _to_experts_backward)


@jax.custom_vjp
def combine(y_MxD: jax.Array, token_M: jax.Array, inverse_TxK: jax.Array,
            weights_TxK: jax.Array, weight_M: jax.Array) -> jax.Array:
    """Each token's output (T, D): its K copies' rows of the sorted outputs `y_MxD` (at
    `inverse_TxK`), weighted by `weights_TxK`, summed in float32. `token_M` is each sorted
    row's token and `weight_M` its weight (`weights_TxK`'s values in sorted order, for the
    gradient; they are not differentiated through)."""
    return _combine(y_MxD, inverse_TxK, weights_TxK)


def _combine(y_MxD, inverse_TxK, weights_TxK):
    out_TxD = sum(weights_TxK[:, k, None].astype(jnp.float32)
                  * y_MxD[inverse_TxK[:, k]].astype(jnp.float32)
                  for k in range(inverse_TxK.shape[1]))
    return out_TxD.astype(y_MxD.dtype)


def _combine_forward(y_MxD, token_M, inverse_TxK, weights_TxK, weight_M):
    return (_combine(y_MxD, inverse_TxK, weights_TxK),
            (y_MxD, token_M, inverse_TxK, weight_M))


def _combine_backward(residuals, grad_TxD):
    """d y: a sorted row's gradient is its token's times its weight (a gather); d weights:
    each copy's row against its token's gradient."""
    y_MxD, token_M, inverse_TxK, weight_M = residuals
    grad_y_MxD = (grad_TxD[token_M].astype(jnp.float32)
                  * weight_M[:, None].astype(jnp.float32)).astype(y_MxD.dtype)
    grad_f32_TxD = grad_TxD.astype(jnp.float32)
    grad_weights_TxK = jnp.stack(
        [jnp.sum(grad_f32_TxD * y_MxD[inverse_TxK[:, k]].astype(jnp.float32), axis=-1)
         for k in range(inverse_TxK.shape[1])], axis=1)
    return grad_y_MxD, None, None, grad_weights_TxK.astype(weight_M.dtype), None


combine.defvjp(_combine_forward, _combine_backward)


def expert_counts(expert_M: jax.Array, num_experts: int) -> jax.Array:
    """How many of the copies go to each expert (E,), int32: a sum of one-hot rows, which a
    TPU computes at the speed of its vector units, where a scatter-add of T·K ones into E
    slots collides on every slot and runs one update at a time."""
    return jnp.sum(expert_M[:, None] == jnp.arange(num_experts), axis=0, dtype=jnp.int32)


def sorting(keys_M: jax.Array, *payloads_M: jax.Array) -> tuple[jax.Array, ...]:
    """The stable order that sorts `keys_M`, its inverse (where each element went), and each
    payload in that order. All by sorts: a TPU sorts T·K keys in microseconds, where the
    inverse written by a scatter, or a payload read by a gather, took it ten times as long."""
    M = keys_M.shape[0]
    iota_M = jnp.arange(M, dtype=jnp.int32)
    _, order_M, *sorted_payloads = jax.lax.sort((keys_M, iota_M, *payloads_M), num_keys=1,
                                                is_stable=True)
    _, inverse_M = jax.lax.sort((order_M, iota_M), num_keys=1)
    return (order_M, inverse_M, *sorted_payloads)


def _grouped_mlp(x_MxD, group_sizes_G, matrices, activation, backend):
    """Rows grouped by expert (`group_sizes_G` of them each, the rest zero) through their
    experts' SwiGLU MLPs, one grouped matmul per matrix."""
    gate_GxDxF, up_GxDxF, down_GxFxD = matrices
    # Gate and up stay two products: as one of twice the width (the matrices concatenated),
    # the gradient's two halves were concatenated too, which cost a v5e more than the one
    # product saved.
    h_MxF = (activation(grouped_matmul(x_MxD, gate_GxDxF, group_sizes_G, backend))
             * grouped_matmul(x_MxD, up_GxDxF, group_sizes_G, backend))
    return grouped_matmul(h_MxF, down_GxFxD, group_sizes_G, backend)


def _batched_mlp(x_GxCxD, matrices, activation):
    """Each expert's buffer of rows through its SwiGLU MLP, as batched matmuls."""
    gate_GxDxF, up_GxDxF, down_GxFxD = matrices
    h_GxCxF = (activation(jnp.einsum("gcd,gdf->gcf", x_GxCxD, gate_GxDxF))
               * jnp.einsum("gcd,gdf->gcf", x_GxCxD, up_GxDxF))
    return jnp.einsum("gcf,gfd->gcd", h_GxCxF, down_GxFxD)


def _expert_exchange(grouped, x_MxD, group_sizes_E, *, exchange: _Exchange, rows: int):
    """Dropless expert parallelism, inside the shard_map: this device's copies (sorted by
    expert, `group_sizes_E` of each) sent to the devices holding their experts, the copies
    received from every device run through this device's experts (`grouped`), the outputs
    sent back; returns this device's copies' outputs, in their order.

    `jax.lax.all_to_all` moves fixed-size blocks: each device sends every other a block of
    `rows` rows (P devices, Q = E/P experts each: T·min(K, Q), all that one device's T tokens
    can send to one device's experts), its copies first, zeros after. So nothing is dropped,
    whatever the routing, at a memory cost: the send and receive buffers, and the grouped
    matmul over the received rows, hold P·rows rows where the dropless path without an
    expert axis holds T·K: P·min(K, Q)/K times as many (8× for P = 8, Q ≥ K), the busiest
    case the routing could make. (`jax.lax.ragged_all_to_all` sends only the real rows but
    needs the same worst-case receive buffer, and XLA's CPU does not run it.)"""
    M, D = x_MxD.shape
    E, P = group_sizes_E.shape[0], exchange.devices
    Q = E // P
    # Each sorted copy's expert, its device, and its slot in that device's block.
    expert_M = jnp.searchsorted(jnp.cumsum(group_sizes_E), jnp.arange(M), side="right")
    device_M = expert_M // Q
    sent_P = group_sizes_E.reshape(P, Q).sum(1)
    slot_M = jnp.arange(M) - (jnp.cumsum(sent_P) - sent_P)[device_M]
    index_M = device_M * rows + slot_M
    send_PxRxD = jnp.zeros((P * rows, D), x_MxD.dtype).at[index_M].set(x_MxD).reshape(
        P, rows, D)
    # Block p of what arrives came from device p: its copies for each of this device's
    # experts in turn (counts_PxQ[p]), then zeros.
    counts_PxQ = jax.lax.all_to_all(group_sizes_E.reshape(P, Q), exchange.axis, 0, 0)
    received_PxRxD = jax.lax.all_to_all(send_PxRxD, exchange.axis, 0, 0)
    local_PxR = jax.vmap(lambda ends, slots: jnp.searchsorted(ends, slots, side="right"),
                         in_axes=(0, None))(jnp.cumsum(counts_PxQ, axis=1), jnp.arange(rows))
    order_N = jnp.argsort(local_PxR.reshape(P * rows), stable=True)  # the zeros (Q) last
    y_NxD = grouped(received_PxRxD.reshape(P * rows, D)[order_N], counts_PxQ.sum(0))
    y_PxRxD = y_NxD[jnp.argsort(order_N)].reshape(P, rows, -1)
    returned_PxRxD = jax.lax.all_to_all(y_PxRxD, exchange.axis, 0, 0)
    return returned_PxRxD.reshape(P * rows, -1)[index_M]


def _capacity_exchange(batched, x_ExCxD, *, exchange: _Exchange):
    """Expert parallelism with a capacity: this device's (E, C) buffer, expert by expert, is
    already in blocks by the device holding each expert; each device's block goes to it, the
    P blocks received run through this device's Q experts as Q buffers of P·C rows, and the
    outputs go back. The same memory as without an expert axis, and the same copies dropped
    (each device keeps each expert's first C of its own copies)."""
    E, C, D = x_ExCxD.shape
    P = exchange.devices
    Q = E // P
    received_PxQxCxD = jax.lax.all_to_all(x_ExCxD.reshape(P, Q, C, D), exchange.axis, 0, 0)
    y_QxNxD = batched(received_PxQxCxD.transpose(1, 0, 2, 3).reshape(Q, P * C, D))
    y_PxQxCxD = y_QxNxD.reshape(Q, P, C, -1).transpose(1, 0, 2, 3)
    return jax.lax.all_to_all(y_PxQxCxD, exchange.axis, 0, 0).reshape(E, C, -1)


def capacity(num_copies: int, num_experts: int, capacity_factor: float) -> int:
    """Token copies an expert takes: capacity_factor × the even share, rounded up."""
    return max(1, math.ceil(capacity_factor * num_copies / num_experts))


def _with_capacity(x_TxD, experts_TxK, weights_TxK, num_experts, through_experts,
                   capacity_factor):
    """Switch/GShard's token dropping: each expert's first C copies (in token order) go into
    its row of an (E, C) buffer, through the experts (`through_experts(x_ExCxD)`: each row of
    the buffer by its expert's MLP); the rest are dropped."""
    T, K = experts_TxK.shape
    E, D = num_experts, x_TxD.shape[1]
    C = capacity(T * K, E, capacity_factor)
    expert_M = experts_TxK.reshape(T * K)
    order_M, inverse_M, weight_M, sorted_expert_M = sorting(
        expert_M, jax.lax.stop_gradient(weights_TxK).reshape(-1), expert_M)
    group_sizes_E = expert_counts(expert_M, E)
    group_starts_E = jnp.cumsum(group_sizes_E) - group_sizes_E
    slot_M = jnp.arange(T * K) - group_starts_E[sorted_expert_M]
    kept_M = slot_M < C
    # A dropped copy's row goes to one spare slot past the buffer, which is then cut off.
    index_M = jnp.where(kept_M, sorted_expert_M * C + slot_M, E * C)
    token_M, inverse_TxK = order_M // K, inverse_M.reshape(T, K)
    x_MxD = to_experts(x_TxD, token_M, inverse_TxK)
    buffer_NxD = jnp.zeros((E * C + 1, D), x_TxD.dtype).at[index_M].set(x_MxD)
    x_ExCxD = buffer_NxD[:-1].reshape(E, C, D)
    y_NxD = through_experts(x_ExCxD).reshape(E * C, D)
    y_NxD = jnp.concatenate([y_NxD, jnp.zeros((1, D), y_NxD.dtype)])
    y_MxD = y_NxD[index_M]  # dropped copies read the spare slot's zeros
    dropped = 1.0 - kept_M.astype(jnp.float32).mean()
    return combine(y_MxD, token_M, inverse_TxK, weights_TxK, weight_M), dropped


def _dense(x_TxD, experts_TxK, weights_TxK, matrices, activation):
    """Every token through every expert, each output weighted by the token's routing weight
    for that expert (zero for the experts not chosen)."""
    gate_ExDxF, up_ExDxF, down_ExFxD = matrices
    T, K = experts_TxK.shape
    E = gate_ExDxF.shape[0]
    h_TxExF = (activation(jnp.einsum("td,edf->tef", x_TxD, gate_ExDxF))
               * jnp.einsum("td,edf->tef", x_TxD, up_ExDxF))
    y_TxExD = jnp.einsum("tef,efd->ted", h_TxExF, down_ExFxD)
    combine_TxE = jnp.zeros((T, E), weights_TxK.dtype).at[
        jnp.arange(T)[:, None], experts_TxK].add(weights_TxK)
    return jnp.einsum("ted,te->td", y_TxExD, combine_TxE), jnp.zeros((), jnp.float32)


def num_active_params(cfg: ModelConfig, num_params: int) -> int:
    """The parameters a token's forward pass multiplies by: all but the experts it is not
    routed to (E - K of each sparse layer's)."""
    if not enabled(cfg):
        return num_params
    sparse_layers = cfg.num_layers - cfg.moe.first_dense_layers
    per_expert = 3 * cfg.hidden_size * expert_width(cfg)
    idle = cfg.moe.num_experts - cfg.moe.top_k
    return int(num_params - sparse_layers * idle * per_expert)

