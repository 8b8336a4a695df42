"""model.init_from and tokenizer.path in a bucket (issue 45): the folder (or the
tokenizer.json object) copied once into the cache, keyed by the objects' versions, and read
from there; against the GCS emulator of tests/buckets.py."""

from __future__ import annotations

import os

import pytest
from conftest import assert_names, config_node

from flaxlm.errors import FlaxlmError
from flaxlm.storage import cached_copy


def put_folder(bucket, local, key: str) -> str:
    for name in sorted(os.listdir(local)):
        bucket.put(f"{key}/{name}", open(os.path.join(local, name), "rb").read())
    return f"{bucket.url}/{key}"


@pytest.mark.parametrize("store", ["gcs", "s3"])
def test_a_bucket_folder_is_copied_once_and_again_when_an_object_changes(store, request,
                                                                       tmp_path, monkeypatch):
    bucket = request.getfixturevalue(store)  # either store's
    bucket.put("m/config.json", "{}")
    bucket.put("m/sub/w.bin", b"\x00\x01")
    cache = str(tmp_path / "cache")
    first = cached_copy(f"{bucket.url}/m", cache, "model.init_from")
    assert sorted(os.listdir(first)) == ["config.json", "sub"]
    assert open(os.path.join(first, "sub", "w.bin"), "rb").read() == b"\x00\x01"

    import fsspec

    with monkeypatch.context() as patch:  # the same versions: no download
        patch.setattr(fsspec.filesystem(bucket.url.partition(":")[0]), "get_file",
                      lambda *a, **k: 1 / 0)
        assert cached_copy(f"{bucket.url}/m/", cache, "model.init_from") == first
    bucket.put("m/config.json", '{"new": 1}')
    second = cached_copy(f"{bucket.url}/m", cache, "model.init_from")
    assert second != first and open(os.path.join(second, "config.json")).read() == '{"new": 1}'
    assert not [n for n in os.listdir(os.path.join(cache, "objects")) if n.startswith(".tmp-")]


def test_init_from_and_tokenizer_path_in_a_bucket_load_as_local_ones(gcs, tmp_path):
    from test_export import CONFIG, export

    from flaxlm.data.tokenizer import prepare_tokenizer
    from flaxlm.models import pretrained

    local = export(tmp_path / "hf")  # a small GPT-2 export with its tokenizer
    url = put_folder(gcs, local, "models/small")
    cache = str(tmp_path / "cache")
    checkpoint = pretrained.resolve_checkpoint(url, cache)
    assert checkpoint.startswith(cache)
    shape = pretrained.pretrained_model_config(checkpoint, CONFIG)
    assert (shape.num_layers, shape.hidden_size) == (CONFIG.num_layers, CONFIG.hidden_size)

    for name in ("", "/tokenizer.json"):  # a folder, or one object: as the local one reads
        tokenizers = [prepare_tokenizer(config_node("tokenizer", path=path), None, 97, cache)
                      for path in (f"{url}{name}", f"{local}{name}")]
        ids = [tokenizer("Return the value").input_ids for tokenizer in tokenizers]
        assert ids[0] == ids[1] and len(ids[0]) > 3
    assert len(os.listdir(os.path.join(cache, "objects"))) == 2  # the folder, the one object


@pytest.mark.parametrize(("url", "fragments"), [
    ("gs://no-such-bucket/models/a", ("'gs://no-such-bucket'", "does not exist")),
    ("{bucket}/models/none", ("'{bucket}/models/none' does not exist",)),
])
def test_a_model_that_is_not_in_the_bucket_is_one_paragraph(gcs, tmp_path, url, fragments):
    from flaxlm.models import pretrained

    url = url.format(bucket=gcs.url)
    with pytest.raises(FlaxlmError) as error:
        pretrained.resolve_checkpoint(url, str(tmp_path))
    assert_names(error.value, "model.init_from",
                 *(fragment.format(bucket=gcs.url) for fragment in fragments))
