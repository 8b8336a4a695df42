"""The grouped matmul of Mixture-of-Experts layers: rows sorted by group, each group multiplied by
its own matrix, `out[rows of g] = lhs[rows of g] @ rhs[g]`, with no row multiplied by a matrix
that is not its group's.

Three ways to compute it, one contract (`grouped_matmul`):

- `ragged`: `jax.lax.ragged_dot`, which TPUs and GPUs run as one instruction. XLA's CPU has no
  such instruction, and JAX lowers it there to every row times every group's matrix, masked:
  the dense cost that the sorting was to avoid.
- `tiled`: the rows in tiles of `TILE_ROWS`, each tile multiplied by the matrix of every group
  it holds rows of, in a `lax.scan` over those (tile, group) visits: at most tiles + groups - 1
  visits, so the work is the rows' own plus one tile per group. Written in JAX for the CPU, with
  its own gradient (`_tiled_backward`), which is the same visits again: the input's gradient
  with the matrices transposed, and each group's matrix gradient summed over its visits. This is
  the structure of megablox's kernel, without the kernel.
- `megablox`: JAX's Pallas grouped matmul for TPUs (`jax.experimental.pallas.ops.tpu.megablox`).

Shapes: M rows, K their width, N the output's, G groups.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

TILE_ROWS = 128  # rows a tiled visit multiplies at once: wide enough for the CPU's matmul


def grouped_matmul(lhs_MxK: jax.Array, rhs_GxKxN: jax.Array, group_sizes_G: jax.Array,
                   backend: str) -> jax.Array:
    """(M, N): row block g of `lhs_MxK` (the `group_sizes_G[g]` rows after the groups before
    it) times `rhs_GxKxN[g]`. Rows past the groups' total come out zero. `backend`: ragged,
    tiled or megablox (see the module's docstring)."""
    group_sizes_G = group_sizes_G.astype(jnp.int32)
    if backend == "ragged":
        return lax.ragged_dot(lhs_MxK, rhs_GxKxN, group_sizes_G)
    if backend == "tiled":
        return tiled_grouped_matmul(lhs_MxK, rhs_GxKxN, group_sizes_G)
    if backend == "megablox":
        return _megablox(lhs_MxK, rhs_GxKxN, group_sizes_G)
    raise ValueError(f"grouped matmul backend {backend!r}: ragged, tiled or megablox")


# megablox's tiles, as measured on a TPU v5e at moe-small's shapes (16,384 rows, 768 <-> 2048,
# 8 experts; docs/benchmarks.md): the whole contraction and output widths in one tile, so that
# each row tile reads its expert's matrix once and no row is read twice, were 3-13% faster than
# MaxText's (512, 1024, 1024) for every product; 256 rows a tile beat 512 by 1-3%. The widths
# are halved, the larger first, until the tiles fit `MEGABLOX_VMEM_BYTES`, a little under the
# 16 MiB of scoped VMEM Mosaic gives a kernel on a v5e (tiles of 19 MB and more did not compile).
MEGABLOX_ROWS = 256
MEGABLOX_WIDEST = 2048
MEGABLOX_VMEM_BYTES = 15 * 2**20


def megablox_tiling(M: int, K: int, N: int, kernel: str = "gmm") -> tuple[int, int, int]:
    """The tiles (rows, contraction, output) of megablox's `kernel` for M rows of width K and
    (K, N) matrices (gmm: their product; tgmm: the matrices' gradients, from the rows' (K, M)
    and the output's (M, N) gradient). A tile that does not divide its dimension is masked at
    the edge, and one wider than the dimension padded, both slow: each tile is the whole
    dimension or a multiple of (8, 128) that divides it."""
    def tile(size, largest, unit):  # a TPU's tiles are multiples of (8, 128)
        if size <= largest:
            return size
        return max((t for t in range(unit, largest + 1, unit) if size % t == 0), default=size)

    def vmem_bytes(tm, tk, tn):
        # bfloat16 inputs and output double-buffered, and a float32 accumulator of the
        # output tile: (tm, tn) for gmm, (tk, tn) per expert for tgmm.
        accumulator = tm * tn if kernel == "gmm" else tk * tn
        return 2 * 2 * (tm * tk + tk * tn + tm * tn) + 4 * accumulator

    tm, tk, tn = (tile(M, MEGABLOX_ROWS, 8), tile(K, MEGABLOX_WIDEST, 128),
                  tile(N, MEGABLOX_WIDEST, 128))
    while vmem_bytes(tm, tk, tn) > MEGABLOX_VMEM_BYTES:
        # The wider of the two first; a width no tile of half its own divides stays.
        halved_k, halved_n = tile(K, tk // 2, 128), tile(N, tn // 2, 128)
        if halved_k < tk and (tk >= tn or halved_n >= tn):
            tk = halved_k
        elif halved_n < tn:
            tn = halved_n
        else:
            break
    return tm, tk, tn


@jax.custom_vjp
def _megablox(lhs_MxK, rhs_GxKxN, group_sizes_G):
    """megablox's forward kernel with its tiles; the gradient (`_megablox_backward`) is ours."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm

    return gmm(lhs_MxK, rhs_GxKxN, group_sizes_G, lhs_MxK.dtype,
               megablox_tiling(*lhs_MxK.shape, rhs_GxKxN.shape[2]))


def _megablox_forward(lhs_MxK, rhs_GxKxN, group_sizes_G):
    return _megablox(lhs_MxK, rhs_GxKxN, group_sizes_G), (lhs_MxK, rhs_GxKxN, group_sizes_G)


def _megablox_backward(residuals, grad_MxN):
    """d lhs = grad · rhsᵀ per group, through the forward kernel with the matrices transposed
    in XLA first, tiled for its own shapes; d rhs = lhsᵀ · grad per group (`tgmm`). megablox's
    own gradient reads the matrices transposed inside the kernel (`transpose_rhs`) with the
    forward's tiles, whose contraction and output tiles then fit neither dimension: on a TPU
    v5e that product ran at half the forward's speed (moe-small's down and gate/up shapes)."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm, tgmm

    lhs_MxK, rhs_GxKxN, group_sizes_G = residuals
    M, K = lhs_MxK.shape
    G, _, N = rhs_GxKxN.shape
    grad_lhs_MxK = gmm(grad_MxN, rhs_GxKxN.swapaxes(1, 2), group_sizes_G, lhs_MxK.dtype,
                       megablox_tiling(M, N, K))
    grad_rhs_GxKxN = tgmm(lhs_MxK.swapaxes(0, 1), grad_MxN, group_sizes_G, rhs_GxKxN.dtype,
                          megablox_tiling(M, K, N, "tgmm"), None, G)
    return grad_lhs_MxK, grad_rhs_GxKxN, None


_megablox.defvjp(_megablox_forward, _megablox_backward)


# ---------------------------------------------------------------- tiled, in JAX


def visits(group_sizes_G: jax.Array, num_rows: int, tile_rows: int = TILE_ROWS):
    """The (tile, group) pairs a tiled grouped matmul visits, in a fixed-length list of
    tiles + groups - 1 entries (the most there can be): each entry's tile index, its group,
    and whether it is real (the list's tail repeats the last visit, marked not real). A group
    of no rows has no visit; one of r rows starting at row s visits tiles s // T to
    (s + r - 1) // T."""
    G = group_sizes_G.shape[0]
    num_tiles = -(-num_rows // tile_rows)
    num_visits = num_tiles + G - 1
    ends_G = jnp.cumsum(group_sizes_G)
    starts_G = ends_G - group_sizes_G
    first_tile_G = starts_G // tile_rows
    tiles_G = jnp.where(group_sizes_G > 0, (ends_G - 1) // tile_rows - first_tile_G + 1, 0)
    visit_ends_G = jnp.cumsum(tiles_G)
    visit_V = jnp.arange(num_visits)
    group_V = jnp.minimum(jnp.searchsorted(visit_ends_G, visit_V, side="right"), G - 1)
    real_V = visit_V < visit_ends_G[-1]
    tile_V = first_tile_G[group_V] + visit_V - (visit_ends_G[group_V] - tiles_G[group_V])
    tile_V = jnp.where(real_V, tile_V, 0)
    return tile_V, group_V, real_V, starts_G, ends_G


def _row_mask(tile, group, real, starts_G, ends_G, tile_rows):
    rows_T = tile * tile_rows + jnp.arange(tile_rows)
    return real & (rows_T >= starts_G[group]) & (rows_T < ends_G[group])


def _padded(rows_MxK: jax.Array, tile_rows: int) -> jax.Array:
    return jnp.pad(rows_MxK, ((0, -rows_MxK.shape[0] % tile_rows), (0, 0)))


def _tiled_forward(lhs_MxK, rhs_GxKxN, group_sizes_G, tile_rows):
    """Each visit adds its tile's rows of its group, times the group's matrix, to the output."""
    M = lhs_MxK.shape[0]
    lhs_PxK = _padded(lhs_MxK, tile_rows)
    tile_V, group_V, real_V, starts_G, ends_G = visits(group_sizes_G, M, tile_rows)
    out_dtype = jnp.result_type(lhs_MxK.dtype, rhs_GxKxN.dtype)

    def visit(out_PxN, tile_group_real):
        tile, group, real = tile_group_real
        start = tile * tile_rows
        lhs_TxK = lax.dynamic_slice_in_dim(lhs_PxK, start, tile_rows)
        product_TxN = jnp.dot(lhs_TxK, rhs_GxKxN[group], preferred_element_type=jnp.float32)
        mask_Tx1 = _row_mask(tile, group, real, starts_G, ends_G, tile_rows)[:, None]
        out_TxN = lax.dynamic_slice_in_dim(out_PxN, start, tile_rows)
        out_TxN = out_TxN + jnp.where(mask_Tx1, product_TxN, 0).astype(out_PxN.dtype)
        return lax.dynamic_update_slice_in_dim(out_PxN, out_TxN, start, axis=0), None

    out_PxN = jnp.zeros((lhs_PxK.shape[0], rhs_GxKxN.shape[2]), out_dtype)
    out_PxN, _ = lax.scan(visit, out_PxN, (tile_V, group_V, real_V))
    return out_PxN[:M]


def _tiled_rhs_gradient(lhs_MxK, grad_MxN, group_sizes_G, num_groups, tile_rows):
    """Each group's matrix gradient, lhs[rows of g]ᵀ · grad[rows of g], summed over its
    visits; float32 sums, in the matrices' dtype at the end."""
    M, K = lhs_MxK.shape
    N = grad_MxN.shape[1]
    lhs_PxK, grad_PxN = _padded(lhs_MxK, tile_rows), _padded(grad_MxN, tile_rows)
    tile_V, group_V, real_V, starts_G, ends_G = visits(group_sizes_G, M, tile_rows)

    def visit(sums_GxKxN, tile_group_real):
        tile, group, real = tile_group_real
        start = tile * tile_rows
        mask_Tx1 = _row_mask(tile, group, real, starts_G, ends_G, tile_rows)[:, None]
        lhs_TxK = jnp.where(mask_Tx1, lax.dynamic_slice_in_dim(lhs_PxK, start, tile_rows), 0)
        grad_TxN = lax.dynamic_slice_in_dim(grad_PxN, start, tile_rows)
        product_KxN = jnp.dot(lhs_TxK.T, grad_TxN, preferred_element_type=jnp.float32)
        return sums_GxKxN.at[group].add(product_KxN), None

    sums_GxKxN = jnp.zeros((num_groups, K, N), jnp.float32)
    sums_GxKxN, _ = lax.scan(visit, sums_GxKxN, (tile_V, group_V, real_V))
    return sums_GxKxN


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(lhs_MxK, rhs_GxKxN, group_sizes_G, tile_rows):
    return _tiled_forward(lhs_MxK, rhs_GxKxN, group_sizes_G, tile_rows)


def _tiled_forward_rule(lhs_MxK, rhs_GxKxN, group_sizes_G, tile_rows):
    out = _tiled_forward(lhs_MxK, rhs_GxKxN, group_sizes_G, tile_rows)
    return out, (lhs_MxK, rhs_GxKxN, group_sizes_G)


def _tiled_backward(tile_rows, residuals, grad_MxN):
    """d lhs: the same visits with each matrix transposed; d rhs: `_tiled_rhs_gradient`. The
    group sizes are integers: no gradient."""
    lhs_MxK, rhs_GxKxN, group_sizes_G = residuals
    grad_lhs_MxK = _tiled_forward(grad_MxN, rhs_GxKxN.swapaxes(1, 2), group_sizes_G, tile_rows)
    grad_rhs_GxKxN = _tiled_rhs_gradient(lhs_MxK, grad_MxN, group_sizes_G,
                                         rhs_GxKxN.shape[0], tile_rows)
    return (grad_lhs_MxK.astype(lhs_MxK.dtype), grad_rhs_GxKxN.astype(rhs_GxKxN.dtype), None)


_tiled.defvjp(_tiled_forward_rule, _tiled_backward)


def tiled_grouped_matmul(lhs_MxK: jax.Array, rhs_GxKxN: jax.Array, group_sizes_G: jax.Array,
                         tile_rows: int = TILE_ROWS) -> jax.Array:
    """`grouped_matmul`'s `tiled` backend; a tile no taller than the rows need."""
    tile_rows = min(tile_rows, max(8, -(-lhs_MxK.shape[0] // 8) * 8))
    # As arrays: the rules index the matrices by a traced group.
    return _tiled(jnp.asarray(lhs_MxK), jnp.asarray(rhs_GxKxN),
                  jnp.asarray(group_sizes_G, jnp.int32), tile_rows)
