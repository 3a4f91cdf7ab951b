"""Checkpoint.open / read on generated checkpoints (SPEC section 2), good and malformed."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pydflash.errors import CheckpointError, ConfigError
from pydflash.io.checkpoint import (
    CONF_B,
    CONF_W,
    EMBED,
    GATE_B,
    GATE_W,
    JOINT_B,
    JOINT_W,
    LM_HEAD,
    MARKOV_W1,
    MARKOV_W2,
    Checkpoint,
    backbone_shapes,
    changes_the_math,
    head_shapes,
)
from pydflash.model.config import BONUS_ANCHOR, SAMPLE_FROM_ANCHOR, DflashCfg
from tools.make_checkpoint import PRESETS, make_checkpoint

BF16 = np.dtype(ml_dtypes.bfloat16)
H = PRESETS["tiny"]["hidden"]  # 64
N_FF = PRESETS["tiny"]["n_ff"]  # 128
VOCAB = PRESETS["tiny"]["vocab"]  # 256
RANK = PRESETS["tiny"]["markov_rank"]  # 32


def bf16(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).astype(BF16)


def st_files(path):
    return sorted(path.glob("*.safetensors"))


def header_free_bytes(path) -> int:
    """Bytes of tensor data in every safetensors file of `path` (file size - 8 - header)."""
    total = 0
    for f in st_files(path):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
        total += os.path.getsize(f) - 8 - n
    return total


def all_arrays(path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in st_files(path):
        out.update(load_file(str(f)))
    return out


def edit_config(path, **changes):
    cfg_path = path / "config.json"
    raw = json.loads(cfg_path.read_text())
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    cfg_path.write_text(json.dumps(raw))


def open_error(path) -> str:
    with pytest.raises(CheckpointError) as ei:
        Checkpoint.open(path)
    return str(ei.value)


# --------------------------------------------------------------------------- good checkpoints


@pytest.mark.parametrize(
    "preset, shards, style",
    [
        ("tiny", 1, "nested"),
        ("tiny", 1, "flat"),
        ("tiny", 3, "nested"),
        ("tiny", 4, "flat"),
        ("tiny-swa", 1, None),
        ("tiny-swa", 5, None),
        ("tiny-dspark", 1, None),
        ("tiny-dspark", 2, "nested"),
    ],
)
def test_open_presets(tmp_path, preset, shards, style):
    g = PRESETS[preset]
    path = make_checkpoint(tmp_path / "ckpt", preset, shards=shards, config_style=style)
    assert len(st_files(path)) == shards
    assert (path / "model.safetensors.index.json").is_file() == (shards > 1)

    ck = Checkpoint.open(path)
    cfg = ck.cfg
    assert ck.path == path
    assert (cfg.hidden, cfg.n_head, cfg.n_kv, cfg.head_dim) == (
        g["hidden"],
        g["n_head"],
        g["n_kv"],
        g["head_dim"],
    )
    assert (cfg.n_ff, cfg.n_layer, cfg.block_size) == (g["n_ff"], g["n_layer"], g["block_size"])
    assert cfg.mask_token_id == g["mask_token_id"]
    assert cfg.target_layer_ids == tuple(g["target_layer_ids"])
    assert cfg.vocab_size == g["vocab"]
    assert cfg.rope_theta == g["rope_theta"]

    # inventory: exactly what was written, with the right shapes and dtype
    arrays = all_arrays(path)
    assert set(ck.tensors) == set(arrays)
    for name, arr in arrays.items():
        info = ck.tensors[name]
        assert info.shape == arr.shape, name
        assert info.dtype == "BF16", name
        assert ck.has(name)
    for name, shape in backbone_shapes(cfg).items():
        assert ck.tensors[name].shape == shape
    assert ck.unknown == []
    assert not ck.has("no.such.tensor")
    if shards > 1:
        assert len({t.file for t in ck.tensors.values()}) == shards

    # byte count: the sum of the tensors' bytes, also as the files see it
    assert ck.total_bytes == sum(a.nbytes for a in arrays.values())
    assert ck.total_bytes == header_free_bytes(path)

    if preset == "tiny-swa":
        assert cfg.layer_sliding == (True, False, True)
        assert [cfg.window_of(i) for i in range(3)] == [8, None, 8]
    else:
        assert all(cfg.window_of(i) is None for i in range(cfg.n_layer))
    if preset == "tiny-dspark":
        assert cfg.layout == SAMPLE_FROM_ANCHOR
        assert cfg.markov_type == "vanilla" and cfg.markov_rank == RANK
        assert cfg.confidence_head and cfg.confidence_with_markov
        assert ck.has_embed and ck.has_lm_head
        assert list(cfg.draft_rows()) == list(range(7))
    else:
        assert cfg.layout == BONUS_ANCHOR
        assert not cfg.has_markov and cfg.markov_rank == 0 and not cfg.confidence_head
        assert not ck.has_embed and not ck.has_lm_head
        assert list(cfg.draft_rows()) == list(range(1, 8))


@pytest.mark.parametrize("rope_style", ["top", "rope_parameters", "rope_scaling"])
def test_open_rope_styles_and_no_head_dim(tmp_path, rope_style):
    path = make_checkpoint(tmp_path / "c", "tiny", rope_style=rope_style, head_dim_in_config=False)
    raw = json.loads((path / "config.json").read_text())
    assert "head_dim" not in raw
    cfg = Checkpoint.open(path).cfg
    assert cfg.head_dim == H // PRESETS["tiny"]["n_head"]
    assert cfg.rope_theta == PRESETS["tiny"]["rope_theta"]


@pytest.mark.parametrize("markov", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("confidence", [False, True])
def test_markov_heads_detected(tmp_path, markov, confidence):
    rank = 8
    path = make_checkpoint(
        tmp_path / "c",
        "tiny",
        markov=markov,
        confidence=confidence,
        overrides={"markov_rank": rank},
    )
    ck = Checkpoint.open(path)
    cfg = ck.cfg
    assert cfg.markov_type == markov and cfg.has_markov
    assert cfg.markov_rank == rank
    assert cfg.vocab_size == VOCAB
    assert ck.tensors[MARKOV_W1].shape == (VOCAB, rank)
    assert ck.tensors[MARKOV_W2].shape == (VOCAB, rank)
    assert ck.has(GATE_W) == ck.has(GATE_B) == (markov == "gated")
    assert ck.has(JOINT_W) == ck.has(JOINT_B) == (markov == "rnn")
    if markov == "gated":
        assert ck.tensors[GATE_W].shape == (rank, H + rank)
    if markov == "rnn":
        assert ck.tensors[JOINT_W].shape == (3 * rank, 2 * rank + H)
    assert cfg.confidence_head == confidence
    assert cfg.confidence_with_markov == confidence
    if confidence:
        assert ck.tensors[CONF_W].shape == (1, H + rank)
    assert ck.unknown == []
    assert ck.total_bytes == header_free_bytes(path)


def test_confidence_without_markov(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny", markov=False, confidence=True)
    ck = Checkpoint.open(path)
    assert ck.cfg.confidence_head
    assert not ck.cfg.confidence_with_markov
    assert not ck.cfg.has_markov
    assert ck.tensors[CONF_W].shape == (1, H)
    assert ck.tensors[CONF_B].shape == (1,)


def test_dspark_without_confidence_markov_and_extras(tmp_path):
    path = make_checkpoint(
        tmp_path / "c", "tiny-dspark", markov=False, confidence=False, embed=False, lm_head=False
    )
    ck = Checkpoint.open(path)
    assert not ck.cfg.has_markov and not ck.cfg.confidence_head
    assert not ck.has_embed and not ck.has_lm_head
    assert ck.cfg.layout == SAMPLE_FROM_ANCHOR  # layout comes from the config, not the heads


@pytest.mark.parametrize("embed, lm_head", [(True, False), (False, True), (True, True)])
def test_embed_and_lm_head_detected(tmp_path, embed, lm_head):
    path = make_checkpoint(tmp_path / "c", "tiny", embed=embed, lm_head=lm_head)
    ck = Checkpoint.open(path)
    assert ck.has_embed == embed
    assert ck.has_lm_head == lm_head
    for name, present in ((EMBED, embed), (LM_HEAD, lm_head)):
        if present:
            assert ck.tensors[name].shape == (VOCAB, H)
    assert ck.unknown == []


def test_cfg_reconciled_from_tensors(tmp_path):
    """A config silent about the heads: the tensors decide markov type, rank, vocab, confidence."""
    path = make_checkpoint(tmp_path / "c", "tiny", markov="gated", confidence=True)
    edit_config(
        path,
        markov_rank=None,
        markov_head_type=None,
        vocab_size=None,
        enable_confidence_head=None,
        confidence_head_with_markov=None,
    )
    raw_cfg = DflashCfg.load(path)
    assert raw_cfg.markov_type is None and raw_cfg.vocab_size is None
    assert not raw_cfg.confidence_head

    cfg = Checkpoint.open(path).cfg
    assert cfg.markov_type == "gated"
    assert cfg.markov_rank == RANK
    assert cfg.vocab_size == VOCAB
    assert cfg.confidence_head and cfg.confidence_with_markov
    # everything else is untouched
    assert cfg.hidden == raw_cfg.hidden and cfg.block_size == raw_cfg.block_size
    assert cfg.layout == raw_cfg.layout


def test_vocab_reconciled_from_embed(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny", embed=True)
    edit_config(path, vocab_size=None)
    assert Checkpoint.open(path).cfg.vocab_size == VOCAB


def test_unknown_extra_tensors_listed_not_fatal(tmp_path):
    extra = {
        "mtp.proj.weight": bf16(np.ones((8, 8))),
        "rotary_emb.inv_freq": np.arange(8, dtype=np.float32),
        "step": np.array([3], dtype=np.int64),
        "flags": np.array([1, 0, 1], dtype=np.int8),
        "model.embed_tokens.weight": bf16(np.zeros((4, 4))),  # foreign: another model's copy
        "lm_head_target.weight": bf16(np.zeros(4)),
    }
    path = make_checkpoint(tmp_path / "c", "tiny", extra_tensors=extra)
    ck = Checkpoint.open(path)
    assert ck.unknown == sorted(extra)
    for name in extra:
        assert ck.has(name)
    assert ck.tensors["step"].dtype == "I64"
    assert ck.tensors["flags"].dtype == "I8"
    assert ck.total_bytes == header_free_bytes(path)
    assert ck.total_bytes == sum(a.nbytes for a in all_arrays(path).values())
    np.testing.assert_array_equal(ck.read("step"), [3])


# --------------------------------------------------------------------------- reading data


@pytest.mark.parametrize("shards", [1, 3])
def test_read_values_and_dtypes(tmp_path, shards):
    rng = np.random.default_rng(1)
    norm = bf16(rng.standard_normal(H))
    hnorm32 = rng.standard_normal(H).astype(np.float32)
    ln16 = rng.standard_normal(H).astype(np.float16)
    fc = bf16(rng.standard_normal((H, 3 * H)))
    path = make_checkpoint(
        tmp_path / "c",
        "tiny",
        shards=shards,
        extra_tensors={
            "norm.weight": norm,
            "hidden_norm.weight": hnorm32,
            "layers.0.input_layernorm.weight": ln16,
            "fc.weight": fc,
        },
    )
    ck = Checkpoint.open(path)
    assert ck.tensors["hidden_norm.weight"].dtype == "F32"
    assert ck.tensors["layers.0.input_layernorm.weight"].dtype == "F16"

    # bf16 as stored
    a = ck.read("norm.weight")
    assert a.dtype == BF16 and a.shape == (H,)
    np.testing.assert_array_equal(a.view(np.uint16), norm.view(np.uint16))
    f = ck.read_f32("norm.weight")
    assert f.dtype == np.float32
    np.testing.assert_array_equal(f, norm.astype(np.float32))
    bits = ck.read_bf16_bits("norm.weight")
    assert bits.dtype == np.uint16 and bits.shape == (H,)
    np.testing.assert_array_equal(bits, norm.view(np.uint16))

    m = ck.read("fc.weight")
    assert m.dtype == BF16 and m.shape == (H, 3 * H)
    np.testing.assert_array_equal(ck.read_bf16_bits("fc.weight"), fc.view(np.uint16))
    np.testing.assert_array_equal(ck.read_f32("fc.weight"), fc.astype(np.float32))

    # f32 as stored; bf16 bits are its round-to-nearest-even
    a32 = ck.read("hidden_norm.weight")
    assert a32.dtype == np.float32
    np.testing.assert_array_equal(a32, hnorm32)
    np.testing.assert_array_equal(
        ck.read_bf16_bits("hidden_norm.weight"), hnorm32.astype(BF16).view(np.uint16)
    )

    # f16 as stored
    a16 = ck.read("layers.0.input_layernorm.weight")
    assert a16.dtype == np.float16
    np.testing.assert_array_equal(a16, ln16)
    np.testing.assert_array_equal(
        ck.read_f32("layers.0.input_layernorm.weight"), ln16.astype(np.float32)
    )
    np.testing.assert_array_equal(
        ck.read_bf16_bits("layers.0.input_layernorm.weight"),
        ln16.astype(np.float32).astype(BF16).view(np.uint16),
    )


def test_read_generated_tensors_match_files(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny-dspark", shards=2)
    ck = Checkpoint.open(path)
    arrays = all_arrays(path)
    for name in (
        "layers.1.mlp.down_proj.weight",
        MARKOV_W1,
        CONF_B,
        EMBED,
        "layers.0.self_attn.k_norm.weight",
    ):
        got = ck.read_bf16_bits(name)
        assert got.shape == arrays[name].shape
        np.testing.assert_array_equal(got, arrays[name].view(np.uint16))
    w = ck.read_f32("layers.0.mlp.gate_proj.weight")
    assert w.shape == (N_FF, H) and np.isfinite(w).all() and np.abs(w).max() > 0


def test_read_unknown_name(tmp_path):
    ck = Checkpoint.open(make_checkpoint(tmp_path / "c", "tiny"))
    with pytest.raises(CheckpointError, match="no.such.tensor"):
        ck.read("no.such.tensor")


def test_read_after_file_truncated(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny")
    ck = Checkpoint.open(path)
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="norm.weight"):
        ck.read("norm.weight")


# --------------------------------------------------------------------------- malformed


def test_missing_tensor(tmp_path):
    name = "layers.1.mlp.up_proj.weight"
    path = make_checkpoint(tmp_path / "c", "tiny", drop_tensors=[name])
    msg = open_error(path)
    assert f"{name}: missing (expected shape [{N_FF}, {H}])" in msg
    assert "1 problem(s)" in msg


def test_misshapen_tensor(tmp_path):
    name = "layers.0.self_attn.q_proj.weight"
    path = make_checkpoint(tmp_path / "c", "tiny", extra_tensors={name: bf16(np.zeros((32, H)))})
    msg = open_error(path)
    assert f"{name}: expected shape [{H}, {H}], found [32, {H}]" in msg


def test_misshapen_1d_tensor(tmp_path):
    name = "layers.1.self_attn.k_norm.weight"
    path = make_checkpoint(tmp_path / "c", "tiny", extra_tensors={name: bf16(np.ones((2, 16)))})
    msg = open_error(path)
    assert f"{name}: expected shape [16], found [2, 16]" in msg


@pytest.mark.parametrize("dtype, tag", [(np.int32, "I32"), (np.float64, "F64"), (np.int8, "I8")])
def test_unsupported_dtype(tmp_path, dtype, tag):
    path = make_checkpoint(
        tmp_path / "c", "tiny", extra_tensors={"norm.weight": np.ones(H, dtype=dtype)}
    )
    msg = open_error(path)
    assert "norm.weight" in msg and tag in msg and "not supported" in msg


@pytest.mark.parametrize("shards", [1, 3])
def test_several_problems_in_one_message(tmp_path, shards):
    path = make_checkpoint(
        tmp_path / "c",
        "tiny",
        shards=shards,
        drop_tensors=["layers.0.mlp.down_proj.weight", "hidden_norm.weight"],
        extra_tensors={
            "layers.1.self_attn.o_proj.weight": bf16(np.zeros((H, 48))),
            "norm.weight": np.ones(H, dtype=np.int32),
            "harmless.extra": bf16(np.zeros(3)),
        },
    )
    msg = open_error(path)
    assert "4 problem(s)" in msg
    assert f"layers.0.mlp.down_proj.weight: missing (expected shape [{H}, {N_FF}])" in msg
    assert f"hidden_norm.weight: missing (expected shape [{H}])" in msg
    assert f"layers.1.self_attn.o_proj.weight: expected shape [{H}, {H}], found [{H}, 48]" in msg
    assert "norm.weight: dtype I32" in msg
    assert "harmless.extra" not in msg
    assert str(path) in msg


def test_truncated_safetensors(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    msg = open_error(path)
    assert "model.safetensors" in msg and "truncated" in msg


def test_truncated_shard(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny", shards=3)
    f = path / "model-00002-of-00003.safetensors"
    f.write_bytes(f.read_bytes()[:50])
    msg = open_error(path)
    assert "model-00002-of-00003.safetensors" in msg and "truncated" in msg
    # one problem for the shard, not one per tensor it should hold
    assert "1 problem(s)" in msg


@pytest.mark.parametrize(
    "garbage", [b"\xff" * 64, b"\x01\x02", b"", struct.pack("<Q", 14) + b'{"x": nonsense']
)
def test_corrupt_header(tmp_path, garbage):
    path = make_checkpoint(tmp_path / "c", "tiny")
    (path / "model.safetensors").write_bytes(garbage)
    msg = open_error(path)
    assert "model.safetensors" in msg and "corrupt" in msg


def test_garbage_over_header_start(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny")
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = os.urandom(32)
    f.write_bytes(bytes(data))
    assert "corrupt" in open_error(path)


def test_directory_without_config(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny")
    (path / "config.json").unlink()
    msg = open_error(path)
    assert "config.json" in msg and str(path) in msg


def test_directory_with_config_but_no_weights(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny")
    (path / "model.safetensors").unlink()
    msg = open_error(path)
    assert "model.safetensors" in msg and str(path) in msg


def test_empty_directory(tmp_path):
    assert "config.json" in open_error(tmp_path)


def test_not_a_directory(tmp_path):
    f = tmp_path / "file.safetensors"
    f.write_bytes(b"x")
    assert "not a directory" in open_error(f)
    assert "not a directory" in open_error(tmp_path / "does-not-exist")


def test_bad_config_in_checkpoint_is_a_config_error(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny")
    edit_config(path, hidden_size=None)
    with pytest.raises(ConfigError) as ei:
        Checkpoint.open(path)
    assert "hidden_size" in str(ei.value) and str(path / "config.json") in str(ei.value)


def test_missing_shard(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny", shards=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    msg = open_error(path)
    assert "model-00002-of-00003.safetensors" in msg and "missing" in msg


def test_tensor_in_index_absent_from_its_shard(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny", shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = "model-00001-of-00002.safetensors"
    victim = sorted(n for n, f in index.items() if f == shard)[0]
    arrays = load_file(str(path / shard))
    del arrays[victim]
    save_file(arrays, str(path / shard))
    msg = open_error(path)
    assert victim in msg and shard in msg and "listed in the index" in msg


def test_index_names_a_tensor_no_shard_has(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny", shards=2)
    ip = path / "model.safetensors.index.json"
    index = json.loads(ip.read_text())
    index["weight_map"]["ghost.weight"] = "model-00002-of-00002.safetensors"
    ip.write_text(json.dumps(index))
    msg = open_error(path)
    assert "ghost.weight" in msg and "model-00002-of-00002.safetensors" in msg


def test_index_points_at_wrong_shard(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny", shards=2)
    ip = path / "model.safetensors.index.json"
    index = json.loads(ip.read_text())
    wm = index["weight_map"]
    name = sorted(n for n, f in wm.items() if f == "model-00001-of-00002.safetensors")[0]
    wm[name] = "model-00002-of-00002.safetensors"
    ip.write_text(json.dumps(index))
    msg = open_error(path)
    assert name in msg and "index says model-00002-of-00002.safetensors" in msg


def test_tensor_stored_in_two_shards(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny", shards=2)
    a = load_file(str(path / "model-00001-of-00002.safetensors"))
    b = load_file(str(path / "model-00002-of-00002.safetensors"))
    name = sorted(a)[0]
    b[name] = a[name]
    save_file(b, str(path / "model-00002-of-00002.safetensors"))
    msg = open_error(path)
    assert name in msg and "stored in both" in msg


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[]",
        '{"metadata": {}}',
        '{"weight_map": [1, 2]}',
        '{"weight_map": {"fc.weight": 3}}',
    ],
)
def test_unreadable_index(tmp_path, text):
    path = make_checkpoint(tmp_path / "c", "tiny", shards=2)
    (path / "model.safetensors.index.json").write_text(text)
    msg = open_error(path)
    assert "model.safetensors.index.json" in msg and "shard index" in msg


def test_config_declares_markov_head_tensors_lack(tmp_path):
    path = make_checkpoint(
        tmp_path / "c", "tiny", markov="vanilla", drop_tensors=[MARKOV_W1, MARKOV_W2]
    )
    msg = open_error(path)
    assert MARKOV_W1 in msg and "missing" in msg and "vanilla" in msg and str(RANK) in msg


def test_config_declares_markov_head_on_plain_checkpoint(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny")
    edit_config(path, markov_rank=32, markov_head_type="rnn")
    msg = open_error(path)
    assert MARKOV_W1 in msg and "rnn" in msg and "32" in msg


def test_markov_w2_missing(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny", markov="vanilla", drop_tensors=[MARKOV_W2])
    msg = open_error(path)
    assert f"{MARKOV_W2}: missing (expected shape [{VOCAB}, {RANK}])" in msg


def test_gated_head_missing_bias(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny", markov="gated", drop_tensors=[GATE_B])
    msg = open_error(path)
    assert f"{GATE_B}: missing (expected shape [{RANK}])" in msg


def test_rnn_head_misshapen(tmp_path):
    path = make_checkpoint(
        tmp_path / "c", "tiny", markov="rnn", extra_tensors={JOINT_W: bf16(np.zeros((3 * RANK, H)))}
    )
    msg = open_error(path)
    assert f"{JOINT_W}: expected shape [{3 * RANK}, {2 * RANK + H}], found [{3 * RANK}, {H}]" in msg


@pytest.mark.parametrize(
    "tensors, declared",
    [("gated", "rnn"), ("gated", "vanilla"), ("vanilla", "gated"), ("rnn", "vanilla")],
)
def test_config_markov_type_disagrees_with_tensors(tmp_path, tensors, declared):
    path = make_checkpoint(tmp_path / "c", "tiny", markov=tensors)
    edit_config(path, markov_head_type=declared)
    msg = open_error(path)
    assert f"config says {declared!r}, tensors say {tensors!r}" in msg


def test_config_markov_rank_disagrees_with_tensors(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny", markov="vanilla")
    edit_config(path, markov_rank=2 * RANK)
    msg = open_error(path)
    assert MARKOV_W1 in msg and str(2 * RANK) in msg and str(RANK) in msg


def test_config_enables_confidence_tensors_lack(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny", confidence=True, drop_tensors=[CONF_W, CONF_B])
    msg = open_error(path)
    assert CONF_W in msg and "missing" in msg


def test_confidence_bias_misshapen(tmp_path):
    path = make_checkpoint(
        tmp_path / "c", "tiny", confidence=True, extra_tensors={CONF_B: bf16(np.zeros(2))}
    )
    assert f"{CONF_B}: expected shape [1], found [2]" in open_error(path)


def test_embed_vocab_mismatch(tmp_path):
    path = make_checkpoint(
        tmp_path / "c", "tiny", embed=True, extra_tensors={EMBED: bf16(np.zeros((VOCAB + 4, H)))}
    )
    assert f"{EMBED}: expected shape [{VOCAB}, {H}], found [{VOCAB + 4}, {H}]" in open_error(path)


@pytest.mark.parametrize("vocab_in_config", [True, False])
@pytest.mark.parametrize("shape", [(), (H,)])
def test_lm_head_wrong_rank(tmp_path, shape, vocab_in_config):
    path = make_checkpoint(tmp_path / "c", "tiny")
    if not vocab_in_config:
        edit_config(path, vocab_size=None)
    f = path / "model.safetensors"
    arrays = load_file(str(f))
    arrays[LM_HEAD] = bf16(np.zeros(shape))  # written directly: keeps a 0-d shape 0-d
    save_file(arrays, str(f))
    msg = open_error(path)
    assert LM_HEAD in msg and f"found {list(shape)}" in msg


# --------------------------------------------------------------------------- issue 8

BIAS_SHAPES = {"q_proj": (4 * 16,), "k_proj": (2 * 16,), "v_proj": (2 * 16,), "o_proj": (H,)}


def test_attention_bias_checkpoint(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny", overrides={"attention_bias": True})
    ck = Checkpoint.open(path)
    assert ck.cfg.attention_bias and ck.unknown == []
    for i in range(ck.cfg.n_layer):
        for proj, shape in BIAS_SHAPES.items():
            info = ck.tensors[f"layers.{i}.self_attn.{proj}.bias"]
            assert info.shape == shape and info.dtype == "BF16"
    assert set(backbone_shapes(ck.cfg)) == set(ck.tensors)


def test_attention_bias_without_its_tensors(tmp_path):
    drop = [f"layers.{i}.self_attn.{p}.bias" for i in range(2) for p in BIAS_SHAPES]
    path = make_checkpoint(
        tmp_path / "c", "tiny", overrides={"attention_bias": True}, drop_tensors=drop
    )
    msg = open_error(path)
    assert "8 problem(s)" in msg
    for name in drop:
        proj = name.split(".")[3]
        assert f"{name}: missing (expected shape {list(BIAS_SHAPES[proj])})" in msg, name


def test_attention_bias_misshapen(tmp_path):
    name = "layers.1.self_attn.k_proj.bias"
    path = make_checkpoint(
        tmp_path / "c",
        "tiny",
        overrides={"attention_bias": True},
        extra_tensors={name: bf16(np.zeros(64))},
    )
    assert f"{name}: expected shape [32], found [64]" in open_error(path)


@pytest.mark.parametrize("attention_bias", [False, None])
def test_bias_tensors_without_attention_bias_refused(tmp_path, attention_bias):
    """A checkpoint with biases whose config does not declare them: never silently dropped."""
    path = make_checkpoint(tmp_path / "c", "tiny", overrides={"attention_bias": True})
    edit_config(path, attention_bias=attention_bias)
    msg = open_error(path)
    assert "8 problem(s)" in msg
    for i in range(2):
        for proj in BIAS_SHAPES:
            assert (
                f"layers.{i}.self_attn.{proj}.bias: an attention bias, but config.json does "
                f"not set attention_bias: true" in msg
            )


MATH_EXTRAS = [
    "layers.9.mlp.up_proj.weight",
    "layers.0.mlp.gate_proj.bias",
    "layers.1.self_attn.rotary_emb.inv_freq",
    "fc.bias",
    "norm.bias",
    "hidden_norm.bias",
    "markov_head.extra.weight",
    "confidence_head.proj2.weight",
    "lm_head.bias",
    "embed_tokens.scale",
    "aux_hidden_norms.0.weight",  # SGLang's Laguna: a norm per tap before fc
]


@pytest.mark.parametrize("name", MATH_EXTRAS)
def test_unused_math_tensor_refused(tmp_path, name):
    path = make_checkpoint(tmp_path / "c", "tiny", extra_tensors={name: bf16(np.ones(4))})
    msg = open_error(path)
    assert (
        f"{name}: not used by this drafter's configuration, but its name says it changes "
        f"the math" in msg
    )
    assert changes_the_math(name)


def test_unused_math_tensors_all_named_at_once(tmp_path):
    extra = {n: bf16(np.ones(4)) for n in MATH_EXTRAS}
    extra["embed_tokens_copy.weight"] = bf16(np.ones(4))  # foreign: fine
    path = make_checkpoint(tmp_path / "c", "tiny", extra_tensors=extra)
    msg = open_error(path)
    assert f"{len(MATH_EXTRAS)} problem(s)" in msg
    assert all(n in msg for n in MATH_EXTRAS)
    assert "embed_tokens_copy" not in msg


@pytest.mark.parametrize(
    "name",
    [
        "model.lm_head.weight",
        "target.embed_tokens.weight",
        "model.fc.weight",
        "mtp.layers.0.weight",
        "rotary_emb.inv_freq",
        "normx.weight",
        "layers_meta",
        "encoder.layers.0.weight",
    ],
)
def test_foreign_names(name):
    assert not changes_the_math(name)


@pytest.mark.parametrize(
    "preset",
    [
        "qwen3-8b-b16",
        "qwen3-4b-b16",
        "gemma4-31b",
        "gpt-oss-20b-b8",
        "qwen3.6-27b",
        "dspark-qwen3-8b-b7",
        "dspark-qwen3-4b-b7",
        "qwen3.8-27b-dflash2",
        "muse-glimmer-30b-dflash2",
    ],
)
def test_public_presets_parse_and_plan_matches_loader(preset):
    """Each public preset's config.json parses, and its tensor plan is exactly what the loader
    expects of that config (plan only: nothing is written)."""
    from tools.make_checkpoint import checkpoint_plan

    raw, plan = checkpoint_plan(preset)
    cfg = DflashCfg.from_dict(raw, source=preset)
    shapes = {n: s for n, s, _ in plan}
    want = backbone_shapes(cfg)
    assert {n: s for n, s in shapes.items() if n in want} == want
    extra = set(shapes) - set(want)
    assert all(n.startswith(("markov_head.", "confidence_head.")) for n in extra) or (
        {n: shapes[n] for n in extra} == head_shapes(cfg)  # DFlash2: the candidate selector
    ), extra
    g = PRESETS[preset]
    assert (cfg.hidden, cfg.n_head, cfg.n_kv, cfg.head_dim, cfg.n_ff, cfg.n_layer) == (
        g["hidden"],
        g["n_head"],
        g["n_kv"],
        g["head_dim"],
        g["n_ff"],
        g["n_layer"],
    )
    assert cfg.block_size == g["block_size"] and cfg.mask_token_id == g["mask_token_id"]
    assert cfg.attention_bias == (preset == "gpt-oss-20b-b8")
    assert cfg.rope_of(0).rope_type == ("yarn" if preset == "gpt-oss-20b-b8" else "default")


# --------------------------------------------------------------------------- DFlash2

D2 = PRESETS["tiny-dflash2"]  # hidden 64, 2 layers, vocab 512, k 2, groups of 16, rank 16
D2_PROJ_ROWS = 2 * 2 * 64 // 16


def test_dflash2_checkpoint_opens(tmp_path):
    from pydflash.io.checkpoint import (
        PREDECESSOR_CODEBOOK,
        SELECTOR_HIDDEN,
        SUCCESSOR_CODEBOOK,
        dflash2_conv_names,
        dflash2_layer_names,
    )

    ck = Checkpoint.open(make_checkpoint(tmp_path / "c", "tiny-dflash2"))
    assert ck.cfg.dflash2 is not None and ck.cfg.vocab_size == 512 and not ck.unknown
    assert ck.cfg.layer_causal == (False, False) and ck.cfg.window_of(1) == 8
    assert dflash2_layer_names(1) == (
        "layers.1.attention_conv.base_kernel",
        "layers.1.attention_conv.kernel_projection.weight",
        "layers.1.mlp_conv.base_kernel",
        "layers.1.mlp_conv.kernel_projection.weight",
    )
    assert dflash2_conv_names(0, "mlp_conv") == (
        "layers.0.mlp_conv.base_kernel",
        "layers.0.mlp_conv.kernel_projection.weight",
    )
    want = {
        SELECTOR_HIDDEN: (16, 64),
        PREDECESSOR_CODEBOOK: (512, 16),
        SUCCESSOR_CODEBOOK: (512, 16),
    }
    for i in range(2):
        base_a, proj_a, base_m, proj_m = dflash2_layer_names(i)
        want.update({base_a: (2, 2, 64), base_m: (2, 2, 64)})
        want.update({proj_a: (D2_PROJ_ROWS, 64), proj_m: (D2_PROJ_ROWS, 64)})
    used = ck.used_shapes()  # what ReferenceDraft.load reads
    assert {n: used[n] for n in want} == want
    assert set(ck.tensors) == set(used)  # nothing else in the checkpoint
    assert ck.read_f32(PREDECESSOR_CODEBOOK).shape == (512, 16)
    dflash = Checkpoint.open(make_checkpoint(tmp_path / "d", "tiny"))
    assert not any("conv" in n or "selector" in n for n in dflash.used_shapes())


def test_dflash2_missing_codebook_named(tmp_path):
    path = make_checkpoint(
        tmp_path / "c", "tiny-dflash2", drop_tensors=["candidate_selector.successor_codebook"]
    )
    msg = open_error(path)
    assert "1 problem(s)" in msg
    assert "candidate_selector.successor_codebook: missing (expected shape [512, 16])" in msg


def test_dflash2_wrong_base_kernel_shape_named(tmp_path):
    name = "layers.1.mlp_conv.base_kernel"
    path = make_checkpoint(
        tmp_path / "c", "tiny-dflash2", extra_tensors={name: bf16(np.ones((2, 3, 64)))}
    )
    assert f"{name}: expected shape [2, 2, 64], found [2, 3, 64]" in open_error(path)


def test_dflash2_problems_all_named_at_once(tmp_path):
    path = make_checkpoint(
        tmp_path / "c",
        "tiny-dflash2",
        drop_tensors=["layers.0.attention_conv.kernel_projection.weight"],
        extra_tensors={
            "layers.1.attention_conv.base_kernel": bf16(np.ones((2, 2, 32))),
            "candidate_selector.hidden_projection.weight": bf16(np.ones((16, 32))),
            "candidate_selector.predecessor_codebook": bf16(np.ones((256, 16))),
            "layers.0.mlp_conv.kernel_projection.bias": bf16(np.ones(D2_PROJ_ROWS)),
        },
    )
    msg = open_error(path)
    assert "5 problem(s)" in msg, msg
    for line in (
        "layers.0.attention_conv.kernel_projection.weight: missing (expected shape [16, 64])",
        "layers.1.attention_conv.base_kernel: expected shape [2, 2, 64], found [2, 2, 32]",
        "candidate_selector.hidden_projection.weight: expected shape [16, 64], found [16, 32]",
        "candidate_selector.predecessor_codebook: expected shape [512, 16], found [256, 16]",
        "layers.0.mlp_conv.kernel_projection.bias: not used by this drafter's configuration",
    ):
        assert line in msg, line


DFLASH2_TENSORS = [
    "layers.0.attention_conv.base_kernel",
    "layers.1.mlp_conv.kernel_projection.weight",
    "candidate_selector.hidden_projection.weight",
    "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
]


def test_dflash2_tensors_in_a_dflash_checkpoint_named(tmp_path):
    """A DFlash (v1) config with DFlash2 tensors: each refused by name, never ignored."""
    extra = {n: bf16(np.ones(4)) for n in DFLASH2_TENSORS}
    msg = open_error(make_checkpoint(tmp_path / "c", "tiny", extra_tensors=extra))
    assert f"{len(DFLASH2_TENSORS)} problem(s)" in msg
    for name in DFLASH2_TENSORS:
        assert f"{name}: a DFlash2 tensor, but config.json declares no DFlash2 drafter" in msg
        assert changes_the_math(name)


def test_dflash2_beside_a_markov_head_refused(tmp_path):
    extra = {
        MARKOV_W1: bf16(np.ones((512, RANK))),
        MARKOV_W2: bf16(np.ones((512, RANK))),
        CONF_W: bf16(np.ones((1, H))),
        CONF_B: bf16(np.ones(1)),
    }
    msg = open_error(make_checkpoint(tmp_path / "c", "tiny-dflash2", extra_tensors=extra))
    assert f"{MARKOV_W1}: a Markov head beside the DFlash2 selector" in msg
    assert f"{CONF_W}: a confidence head beside the DFlash2 selector" in msg


def test_dflash2_config_without_its_tensors_refused(tmp_path):
    """A DFlash2 config over a DFlash checkpoint: the 11 missing tensors named (the backbone
    alone would compute an untrained model)."""
    path = make_checkpoint(tmp_path / "c", "tiny-dflash2")
    dflash = make_checkpoint(tmp_path / "d", "tiny", overrides={"vocab": 512, "mask_token_id": 511})
    for f in st_files(path):
        f.unlink()
    for f in st_files(dflash):
        os.replace(f, path / f.name)
    msg = open_error(path)
    assert "11 problem(s)" in msg and "candidate_selector.successor_codebook: missing" in msg


# --------------------------------------------------------------------------- the serving engines'
# tensor variants: renamed tensors, attention sinks, a trimmed vocabulary, a learned MASK row


def test_encoder_names_are_renamed(tmp_path):
    """Muse-Glimmer's assistant names fc / hidden_norm after its aux encoder (vLLM's mapper)."""
    path = make_checkpoint(tmp_path / "c", "tiny", overrides={"tensor_names": "encoder"})
    ckpt = Checkpoint.open(path)
    assert ckpt.renamed == {
        "fc.weight": "encoder.fc.weight",
        "hidden_norm.weight": "encoder.output_norm_enc.weight",
    }
    want = load_file(str(path / "model.safetensors"))["encoder.fc.weight"]
    np.testing.assert_array_equal(ckpt.read("fc.weight"), want)
    assert not ckpt.unknown


def test_midlayer_renamed_and_a_name_arriving_twice_refused(tmp_path):
    src = make_checkpoint(tmp_path / "a", "tiny", overrides={"n_layer": 1})
    arrays = all_arrays(src)
    moved = {
        (k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k): v
        for k, v in arrays.items()
    }
    save_file(moved, str(src / "model.safetensors"))
    assert (
        Checkpoint.open(src).renamed["layers.0.mlp.down_proj.weight"]
        == "midlayer.mlp.down_proj.weight"
    )
    moved["fc.weight"] = arrays["fc.weight"]
    moved["encoder.fc.weight"] = arrays["fc.weight"]
    save_file(moved, str(src / "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match="both read as fc.weight",
    ):
        Checkpoint.open(src)


def test_attention_sink_tensors(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny", overrides={"attention_sink": True})
    ckpt = Checkpoint.open(path)
    assert ckpt.cfg.attention_sink
    assert ckpt.tensors["layers.1.self_attn.attention_sink_bias"].shape == (4,)
    bad = make_checkpoint(
        tmp_path / "d",
        "tiny",
        overrides={"attention_sink": True},
        drop_tensors=["layers.0.self_attn.attention_sink_bias"],
    )
    with pytest.raises(
        CheckpointError,
        match=r"layers.0.self_attn.attention_sink_bias: missing \(expected shape \[4\]\)",
    ):
        Checkpoint.open(bad)
    # a sink tensor the config does not declare changes the math: refused, not ignored
    stray = make_checkpoint(
        tmp_path / "e",
        "tiny",
        extra_tensors={"layers.0.self_attn.attention_sink_bias": bf16(np.ones(4))},
    )
    with pytest.raises(CheckpointError, match="attention_sink_bias: not used"):
        Checkpoint.open(stray)


def test_trimmed_vocabulary_tensors(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny", overrides={"draft_vocab": 100})
    ckpt = Checkpoint.open(path)
    assert ckpt.cfg.draft_vocab == 100 and ckpt.tensors["lm_head.weight"].shape == (100, H)
    d2t = ckpt.read("d2t")
    assert d2t.dtype == np.int64 and len(set((np.arange(100) + d2t).tolist())) == 100
    assert "d2t" in ckpt.used_shapes() and "lm_head.weight" in ckpt.used_shapes()
    no_map = make_checkpoint(
        tmp_path / "d", "tiny", overrides={"draft_vocab": 100}, drop_tensors=["d2t"]
    )
    with pytest.raises(CheckpointError, match=r"d2t: missing \(expected shape \[100\]\)"):
        Checkpoint.open(no_map)
    floats = make_checkpoint(
        tmp_path / "e",
        "tiny",
        overrides={"draft_vocab": 100},
        extra_tensors={"d2t": np.zeros(100, np.float32)},
    )
    with pytest.raises(CheckpointError, match="d2t: dtype F32 not supported"):
        Checkpoint.open(floats)
    stray = make_checkpoint(tmp_path / "f", "tiny", extra_tensors={"d2t": np.zeros(5, np.int64)})
    with pytest.raises(
        CheckpointError,
        match="d2t: a draft-to-target id map, but config.json sets no draft_vocab_size",
    ):
        Checkpoint.open(stray)


@pytest.mark.parametrize("kind, rows", [("row", 1), ("slots", 7), ("dict", 1)])
def test_mask_embedding_file(tmp_path, kind, rows):
    path = make_checkpoint(tmp_path / "c", "tiny", overrides={"mask_embedding": kind})
    ckpt = Checkpoint.open(path)
    assert ckpt.cfg.mask_embedding_rows == rows
    assert ckpt.mask_embedding.shape == (rows, H) and ckpt.mask_embedding.dtype == np.float32
    assert np.abs(ckpt.mask_embedding).max() > 0


def test_mask_embedding_file_refusals(tmp_path):
    from tools.make_checkpoint import write_torch_file

    path = make_checkpoint(tmp_path / "c", "tiny")
    write_torch_file(path / "mask_embedding.pt", np.ones((3, H), np.float32))
    with pytest.raises(
        CheckpointError, match=r"mask_embedding.pt: expected \[64\], \[1, 64\] or \[7, 64\]"
    ):
        Checkpoint.open(path)
    write_torch_file(
        path / "mask_embedding.pt", {"embedding": np.ones(H, np.float32), "mask_token_id": 3}
    )
    with pytest.raises(CheckpointError, match="mask_token_id 3 differs from the config's 255"):
        Checkpoint.open(path)
    (path / "mask_embedding.pt").write_bytes(b"\x80\x02legacy pickle")
    with pytest.raises(CheckpointError, match="not a torch zip archive"):
        Checkpoint.open(path)


def test_torch_file_refuses_other_globals(tmp_path):
    """A pickle naming anything but a saved tensor's globals is refused, never run."""
    import zipfile

    from pydflash.io import torch_file

    evil = b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R."
    with zipfile.ZipFile(tmp_path / "m.pt", "w") as z:
        z.writestr("m/data.pkl", evil)
    with pytest.raises(CheckpointError, match=r"refers to os.system"):
        torch_file.load(tmp_path / "m.pt")


def test_torch_file_reads_what_torch_writes(tmp_path):
    """Cross-checked against torch itself where it is installed (the device machine)."""
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    from pydflash.io import torch_file

    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2]  # strided
    torch.save({"embedding": t, "mask_token_id": 9}, tmp_path / "m.pt")
    got = torch_file.load(tmp_path / "m.pt")
    np.testing.assert_array_equal(got["embedding"], t.numpy())
    torch.save(torch.randn(5).to(torch.bfloat16), tmp_path / "b.pt")
    b = torch_file.load(tmp_path / "b.pt")
    assert b.dtype == BF16 and b.shape == (5,)
