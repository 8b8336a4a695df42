"""model.scan_layers: a scanned model (the blocks' parameters stacked, run by one `lax.scan`)
computes what the unrolled one does (loss and gradients, segment ids included, every remat
policy), generates the same tokens, lays its parameters out on a mesh with the layer axis
whole, and meets HF's per-layer layout at every boundary (stack/unstack, export, init_from,
a run's checkpoints); a resume in the other layout is refused with the way out."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, compose, config_node, make_tokenizer, mesh_config, model_config
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from numerics import NEWTON_SCHULZ_SLOPE, approx, assert_close, transformer
from safetensors.numpy import load_file

from flaxlm.config import Remat
from flaxlm.errors import FlaxlmError
from flaxlm.export import export_hf
from flaxlm.generate import GenerationSettings, generate_ids
from flaxlm.models import hf, pretrained
from flaxlm.models.build import build_classifier, build_lm
from flaxlm.models.layers import TransformerSpec, stack_layers, unstack_layers
from flaxlm.parallel import make_mesh, state_shardings

SHAPES = {
    "gpt2": model_config("gpt2", name="t", vocab_size=97, max_positions=32, hidden_size=32,
                         num_layers=2, num_heads=4, hidden_dropout=0.0,
                         embedding_dropout=0.0, attention_dropout=0.0),
    "llama": model_config("llama", name="t", vocab_size=97, max_positions=32, hidden_size=32,
                          num_layers=2, num_heads=4, num_kv_heads=2, mlp_size=48,
                          initializer_range=0.1),
}


def build(family: str, scanned: bool, **changes):
    config = dataclasses.replace(SHAPES[family], scan_layers=scanned, **changes)
    return build_lm(TransformerSpec(config), nnx.Rngs(0))


def packed_batch():
    """Two rows of two documents each: segment ids and positions that restart."""
    ids_BxL = jax.random.randint(jax.random.key(1), (2, 16), 0, 97)
    segment_ids_BxL = jnp.asarray([[0] * 6 + [1] * 10, [0] * 11 + [1] * 5])
    positions_BxL = jnp.asarray([list(range(6)) + list(range(10)),
                                 list(range(11)) + list(range(5))])
    return ids_BxL, segment_ids_BxL, positions_BxL


def loss_and_grads(model):
    ids_BxL, segment_ids_BxL, positions_BxL = packed_batch()
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params):
        logits_BxLxV = nnx.merge(graphdef, params)(ids_BxL, segment_ids_BxL=segment_ids_BxL,
                                                   positions_BxL=positions_BxL)
        log_probs = jax.nn.log_softmax(logits_BxLxV[:, :-1])
        return -jnp.take_along_axis(log_probs, ids_BxL[:, 1:, None], axis=-1).mean()

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return float(value), nnx.to_pure_dict(grads)


# Both families' widest reduction: GPT-2's MLP (4 × 32; Llama's vocabulary is 97).
FORWARD = transformer(2, 128)
BACKWARD = transformer(2, 128, backward=True)


def assert_close_trees(actual: dict, expected: dict, **settings) -> None:
    """Leaf by leaf, exactly without `settings`, else within their derived tolerance."""
    for (path, a), (_, b) in zip(hf.flatten_params(actual), hf.flatten_params(expected),
                                 strict=True):
        if settings:
            assert_close(a, b, err_msg=str(path), **settings)
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_scanned_model_starts_from_the_unrolled_weights_and_computes_the_same(family):
    layers_key = hf.FAMILY_NAMES[SHAPES[family].family].layers_module
    unrolled, scanned = build(family, False), build(family, True)
    assert_close_trees(nnx.to_pure_dict(nnx.state(scanned, nnx.Param)),
                       stack_layers(nnx.to_pure_dict(nnx.state(unrolled, nnx.Param)),
                                    layers_key))
    loss, grads = loss_and_grads(unrolled)
    scanned_loss, scanned_grads = scanned_loss_and_grads(family)
    # One program in a loop, the other unrolled: the same sums, compiled apart.
    assert scanned_loss == approx(loss, **FORWARD)
    assert_close_trees(scanned_grads, stack_layers(grads, layers_key), **BACKWARD)


@functools.cache
def scanned_loss_and_grads(family: str):
    """`loss_and_grads` of `family`'s scanned model (built as the tests build it, the same
    weights each time), once: the unrolled model and the remat policies are compared with it."""
    return loss_and_grads(build(family, True))


# block and full are dots_with_no_batch_dims_saveable and nothing_saveable by other names.
@pytest.mark.slow
@pytest.mark.parametrize("remat", [Remat.full, Remat.dots_saveable, Remat.everything_saveable])
def test_remat_policies_give_the_same_gradients_scanned(remat):
    grads = scanned_loss_and_grads("llama")[1]
    _, rematerialised = loss_and_grads(build("llama", True, remat=remat))
    assert_close_trees(rematerialised, grads, **BACKWARD)


def test_scanned_model_with_dropout_trains_with_per_layer_masks():
    """A scan cannot draw keys inside its body: each layer gets its own, split ahead. The
    masks differ from the unrolled model's (same law), so only their effect is checked:
    dropout on changes the loss, and the same key gives the same loss."""
    model = build("gpt2", True, hidden_dropout=0.5, attention_dropout=0.5)
    ids_BxL, _, _ = packed_batch()
    run = jax.jit(lambda model, key: model(ids_BxL, nnx.Rngs(dropout=key)).sum())
    one, two = jax.random.key(1), jax.random.key(2)
    assert float(run(model, one)) == float(run(model, one)) != float(run(model, two))
    assert float(run(model, one)) != float(model(ids_BxL).sum())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_scanned_model_generates_what_the_unrolled_one_does(family):
    prompts = [[5, 6, 7], [8, 9]]
    sampling = GenerationSettings(max_new_tokens=6, temperature=0.0, seed=0)
    expected = generate_ids(build(family, False), prompts, sampling, eos_token_id=None)
    assert generate_ids(build(family, True), prompts, sampling, eos_token_id=None) == expected


def test_stacked_layers_are_never_split_over_the_mesh():
    """fsdp splits each stacked matrix on its model width, as it does a layer's, and never
    on the layer axis, which each step of the scan reads whole."""
    mesh = make_mesh(8, mesh_config(data=1, fsdp=8))
    state = nnx.state(build("llama", True), nnx.Param)
    shardings = nnx.to_pure_dict(state_shardings(state, mesh))
    q_proj = shardings["model"]["layers"]["self_attn"]["q_proj"]["kernel"].spec
    assert tuple(q_proj) == (None, "fsdp")  # (layers, embed, heads)
    assert tuple(shardings["model"]["embed_tokens"]["embedding"].spec) in [(), (None, "fsdp")]


@settings(max_examples=25, deadline=None)
@given(num_layers=st.integers(1, 4),
       shapes=st.lists(st.lists(st.integers(1, 3), max_size=3), min_size=1, max_size=3))
def test_stack_then_unstack_is_the_identity(num_layers, shapes):
    rng = np.random.default_rng(0)
    leaves = {f"w{i}": shape for i, shape in enumerate(shapes)}
    unrolled = {"embed": rng.normal(size=(2, 3)),
                "layers": {index: {"block": {name: rng.normal(size=shape)
                                             for name, shape in leaves.items()}}
                           for index in range(num_layers)}}
    stacked = stack_layers(unrolled, "layers")
    for name, shape in leaves.items():
        assert stacked["layers"]["block"][name].shape == (num_layers, *shape)
    assert_close_trees(stack_layers(stacked, "layers"), stacked)  # already stacked
    back = unstack_layers(stacked, "layers")
    assert_close_trees(back, unrolled)
    assert_close_trees(unstack_layers(unrolled, "layers"), unrolled)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_export_of_a_scanned_model_is_the_unrolled_ones_and_loads_back(family, tmp_path):
    tokenizer = make_tokenizer()
    exports = {}
    for scanned in (False, True):
        model = build(family, scanned)
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        out = export_hf(str(tmp_path / f"scanned-{scanned}"), params,
                        dataclasses.replace(SHAPES[family], scan_layers=scanned), tokenizer)
        exports[scanned] = load_file(f"{out}/model.safetensors")
    assert exports[True].keys() == exports[False].keys()
    for key, tensor in exports[False].items():
        np.testing.assert_array_equal(exports[True][key], tensor, err_msg=key)
    # model.init_from into a scanned model: the per-layer tensors stacked.
    fresh = build_lm(TransformerSpec(dataclasses.replace(SHAPES[family], scan_layers=True)),
                     nnx.Rngs(7))
    report = pretrained.load_pretrained_weights(fresh, str(tmp_path / "scanned-False"))
    assert not report.missing
    assert_close_trees(nnx.to_pure_dict(nnx.state(fresh, nnx.Param)),
                       nnx.to_pure_dict(nnx.state(build(family, True), nnx.Param)))


@pytest.mark.slow  # muon's update compiles slowly
def test_muon_steps_each_layer_of_a_stacked_kernel_as_its_own_matrix():
    import optax

    from flaxlm.training.optimizer import make_optimizer

    opt = config_node("optimizer", ["optimizer=muon"], lr=0.05)
    tx = make_optimizer(opt, optax.constant_schedule(opt.lr))
    params = nnx.to_pure_dict(nnx.state(build("llama", False), nnx.Param))
    grads = jax.tree.map(lambda leaf: jnp.sin(3 * leaf) + 0.1, params)

    def step(params, grads):
        return tx.update(grads, tx.init(params), params)[0]

    unrolled = jax.jit(step)(params, grads)
    scanned = jax.jit(step)(stack_layers(params, "layers"), stack_layers(grads, "layers"))
    # Newton–Schulz on a batch of matrices against one at a time: 5 steps of 3 products as wide
    # as a matrix (Llama's MLP: 48), each magnifying an error by up to its slope.
    assert_close_trees(scanned, stack_layers(unrolled, "layers"), terms=48, depth=5 * 3,
                       amplification=NEWTON_SCHULZ_SLOPE**5)


def test_scanned_bert_classifier_gives_the_unrolled_ones_logits():
    """BERT's encoder scans too (GPT-2's and Llama's classifiers run their LM's body)."""
    shape = dict(name="t", vocab_size=97, max_positions=32, hidden_size=32, num_layers=2,
                 num_heads=4, hidden_dropout=0.0, attention_dropout=0.0)
    ids_BxL, _, _ = packed_batch()
    mask_BxL = jnp.ones_like(ids_BxL).at[1, 12:].set(0)
    logits = []
    for scanned in (False, True):
        config = model_config("bert", **shape, scan_layers=scanned)
        model = build_classifier(TransformerSpec(config), 3, nnx.Rngs(0))
        logits.append(model(ids_BxL, mask_BxL, jnp.zeros_like(ids_BxL)))
    assert_close(logits[1], logits[0], **FORWARD)


def test_an_earlier_run_is_unrolled_and_resuming_in_the_other_layout_is_refused(tmp_path):
    from omegaconf import OmegaConf

    from flaxlm.config import upgrade_saved_config
    from flaxlm.runs import check_resumable

    resolved = OmegaConf.to_container(compose(["model.scan_layers=true"]), resolve=True)
    earlier = {**resolved, "model": {k: v for k, v in resolved["model"].items()
                                     if k != "scan_layers"}}
    assert upgrade_saved_config(earlier)["model"]["scan_layers"] is False
    path = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.create(earlier), path)
    with pytest.raises(FlaxlmError) as refused:
        check_resumable(str(path), resolved)
    assert "model.scan_layers=true" in str(refused.value)
    assert "Resume with model.scan_layers=false" in str(refused.value)
    assert "model.init_from=<dir> model.scan_layers=true" in str(refused.value)
    check_resumable(str(path), {**resolved, "model": {**resolved["model"],
                                                      "scan_layers": False}})


@pytest.mark.slow
def test_the_plan_of_a_scanned_model_makes_no_roofline_of_its_loop_counted_once(capsys):
    from flaxlm.cli import plan as plan_cli

    plan_cli.main([*TINY, "model=llama-tiny", "task.max_seq_length=32",
                   "hardware.peak_tflops_per_device=100", "model.scan_layers=true"])
    out = capsys.readouterr().out
    assert "counts the scanned block once" in out and "projected (estimate)" not in out


# --- a run ------------------------------------------------------------------------------------

RUN = [*TINY, "model=llama-tiny", "trainer.eval_before_training=false",
       "trainer.eval_every_steps=null", "language.max_eval_docs=6"]


@pytest.mark.slow
def test_scanned_run_resumes_exports_and_refuses_the_other_layout(tmp_path):
    from flaxlm.job import train
    from flaxlm.run_model import load_run_model
    from flaxlm.training.checkpoint.manager import restore_params

    run_dir = tmp_path / "run"
    scanned = [*RUN, "model.scan_layers=true"]
    train(compose([*scanned, "trainer.max_steps=2"], run_dir=run_dir))
    params, saved_config, step = restore_params(str(run_dir))
    assert step == 2 and saved_config["model"]["scan_layers"] is True  # the layout, recorded
    assert params["model"]["layers"]["self_attn"]["q_proj"]["kernel"].shape[0] == 2

    with pytest.raises(FlaxlmError) as refused:
        train(compose([*RUN, "model.scan_layers=false", "trainer.max_steps=3"],
                      run_dir=run_dir))
    message = str(refused.value)
    assert "model.scan_layers" in message and "model.scan_layers=true" in message
    assert "model.init_from" in message  # the way to go on in the other layout
    assert restore_params(str(run_dir))[2] == 2  # nothing written

    train(compose([*scanned, "trainer.max_steps=3"], run_dir=run_dir))  # same layout: resumes
    assert restore_params(str(run_dir))[2] == 3

    run = load_run_model(str(run_dir))
    out = export_hf(str(tmp_path / "export"), run.params, run.model_config, run.tokenizer)
    exported = load_file(f"{out}/model.safetensors")
    assert "model.layers.1.self_attn.q_proj.weight" in exported
    q_proj = np.asarray(run.params["model"]["layers"]["self_attn"]["q_proj"]["kernel"][1])
    np.testing.assert_array_equal(exported["model.layers.1.self_attn.q_proj.weight"], q_proj.T)
    assert len(generate_ids(run.model(), [[5, 6]], GenerationSettings(max_new_tokens=3),
                            eos_token_id=None)[0]) <= 3
