"""Tests of tools/make_checkpoint.py (tiny presets only: every test runs in milliseconds)."""

import json
import math
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # so plain `pytest` from anywhere finds tools/
    sys.path.insert(0, str(REPO))

import tools.make_checkpoint as mc
from tools.make_checkpoint import MARKER, PRESETS, checkpoint_plan, make_checkpoint, to_bf16

BF16 = np.dtype(ml_dtypes.bfloat16)


def load_dir(path):
    """name -> array over model.safetensors or every shard named by the index."""
    path = Path(path)
    idx = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(idx.read_text())["weight_map"].values()))
        if idx.exists()
        else ["model.safetensors"]
    )
    out = {}
    for fname in files:
        with safe_open(str(path / fname), framework="np") as f:
            for k in f.keys():
                assert k not in out, f"{k} in two files"
                out[k] = f.get_tensor(k)
    return out


def expected_shapes(g, markov=None, confidence=False, with_markov=True, embed=False, lm_head=False):
    """The SPEC section 2 name/shape list, written out independently of the tool."""
    h, nh, nkv, hd, ff, v = (
        g["hidden"],
        g["n_head"],
        g["n_kv"],
        g["head_dim"],
        g["n_ff"],
        g["vocab"],
    )
    r = g["markov_rank"]
    e = {
        "fc.weight": (h, len(g["target_layer_ids"]) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(g["n_layer"]):
        e.update(
            {
                f"layers.{i}.self_attn.q_proj.weight": (nh * hd, h),
                f"layers.{i}.self_attn.k_proj.weight": (nkv * hd, h),
                f"layers.{i}.self_attn.v_proj.weight": (nkv * hd, h),
                f"layers.{i}.self_attn.o_proj.weight": (h, nh * hd),
                f"layers.{i}.self_attn.q_norm.weight": (hd,),
                f"layers.{i}.self_attn.k_norm.weight": (hd,),
                f"layers.{i}.mlp.gate_proj.weight": (ff, h),
                f"layers.{i}.mlp.up_proj.weight": (ff, h),
                f"layers.{i}.mlp.down_proj.weight": (h, ff),
                f"layers.{i}.input_layernorm.weight": (h,),
                f"layers.{i}.post_attention_layernorm.weight": (h,),
            }
        )
    if markov:
        e["markov_head.markov_w1.weight"] = (v, r)
        e["markov_head.markov_w2.weight"] = (v, r)
        if markov == "gated":
            e["markov_head.gate_proj.weight"] = (r, h + r)
            e["markov_head.gate_proj.bias"] = (r,)
        if markov == "rnn":
            e["markov_head.joint_proj.weight"] = (3 * r, 2 * r + h)
            e["markov_head.joint_proj.bias"] = (3 * r,)
    if confidence:
        e["confidence_head.proj.weight"] = (1, h + (r if markov and with_markov else 0))
        e["confidence_head.proj.bias"] = (1,)
    if embed:
        e["embed_tokens.weight"] = (v, h)
    if lm_head:
        e["lm_head.weight"] = (v, h)
    return e


def check_tensors(path, expected):
    got = load_dir(path)
    assert set(got) == set(expected)
    for k, shape in expected.items():
        assert got[k].shape == tuple(shape), k
        assert got[k].dtype == BF16, k
    return got


def cfg_of(path):
    return json.loads((Path(path) / "config.json").read_text())


# ----------------------------------------------------------------------------- config


def test_nested_config(tmp_path):
    c = cfg_of(make_checkpoint(tmp_path / "c", "tiny"))
    assert c["architectures"] == ["DFlashDraftModel"]
    assert c["model_type"] == "qwen3"
    assert c["block_size"] == 8
    assert c["dflash_config"] == {"mask_token_id": 255, "target_layer_ids": [1, 3, 5]}
    assert "mask_token_id" not in c and "target_layer_ids" not in c
    assert c["hidden_size"] == 64 and c["num_attention_heads"] == 4
    assert c["num_key_value_heads"] == 2 and c["head_dim"] == 16
    assert c["intermediate_size"] == 128 and c["num_hidden_layers"] == 2
    assert c["vocab_size"] == 256 and c["rms_norm_eps"] == 1e-6
    assert c["rope_theta"] == 10000 and c["max_position_embeddings"] == 40960
    assert c["num_target_layers"] >= 6
    for k in (
        "layer_types",
        "sliding_window",
        "markov_rank",
        "markov_head_type",
        "enable_confidence_head",
        "sample_from_anchor",
        "dspark_bonus_anchor",
    ):
        assert k not in c, k


def test_flat_config(tmp_path):
    c = cfg_of(make_checkpoint(tmp_path / "c", "tiny", config_style="flat"))
    assert "dflash_config" not in c
    assert c["block_size"] == 8 and c["mask_token_id"] == 255
    assert c["target_layer_ids"] == [1, 3, 5]


def test_swa_config(tmp_path):
    c = cfg_of(make_checkpoint(tmp_path / "c", "tiny-swa"))
    assert c["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert c["sliding_window"] == 8 and c["num_hidden_layers"] == 3


def test_dspark_config(tmp_path):
    c = cfg_of(make_checkpoint(tmp_path / "c", "tiny-dspark"))
    assert c["architectures"] == ["Qwen3DSparkModel"]
    assert "dflash_config" not in c
    assert c["block_size"] == 7 and c["mask_token_id"] == 255
    assert c["markov_rank"] == 32 and c["markov_head_type"] == "vanilla"
    assert c["enable_confidence_head"] is True and c["confidence_head_with_markov"] is True
    assert c["sample_from_anchor"] is True and "dspark_bonus_anchor" not in c
    c = cfg_of(make_checkpoint(tmp_path / "d", "tiny-dspark", layout="bonus_anchor"))
    assert c["sample_from_anchor"] is False
    c = cfg_of(make_checkpoint(tmp_path / "e", "tiny-dspark", markov="gated", confidence=False))
    assert c["markov_head_type"] == "gated" and c["enable_confidence_head"] is False
    assert c["confidence_head_with_markov"] is False


def test_layout_key_for_dflash_only_when_given(tmp_path):
    c = cfg_of(make_checkpoint(tmp_path / "a", "tiny", markov="vanilla"))
    assert "dspark_bonus_anchor" not in c and "sample_from_anchor" not in c
    assert c["markov_head_type"] == "vanilla" and c["markov_rank"] == 32
    c = cfg_of(make_checkpoint(tmp_path / "b", "tiny", layout="bonus_anchor"))
    assert c["dspark_bonus_anchor"] is True and "sample_from_anchor" not in c
    c = cfg_of(make_checkpoint(tmp_path / "c", "tiny", layout="sample_from_anchor"))
    assert c["dspark_bonus_anchor"] is False


@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
def test_rope_styles(tmp_path, style):
    c = cfg_of(make_checkpoint(tmp_path / "c", "tiny", rope_style=style))
    assert "rope_theta" not in c
    assert c[style] == {"rope_type": "default", "rope_theta": 10000.0}


def test_head_dim_omission(tmp_path):
    c = cfg_of(make_checkpoint(tmp_path / "c", "tiny", head_dim_in_config=False))
    assert "head_dim" not in c and c["hidden_size"] // c["num_attention_heads"] == 16
    with pytest.raises(ValueError, match="head_dim"):
        make_checkpoint(
            tmp_path / "d", "tiny", head_dim_in_config=False, overrides={"head_dim": 32}
        )
    with pytest.raises(
        ValueError, match="head_dim"
    ):  # 2560/32 = 80 != 128: refused before any work
        make_checkpoint(tmp_path / "e", "qwen3-4b-b16", head_dim_in_config=False)
    assert not (tmp_path / "d").exists() and not (tmp_path / "e").exists()


def test_overrides(tmp_path):
    p = make_checkpoint(tmp_path / "c", "tiny", overrides={"n_layer": 1, "sliding_window": 8})
    c = cfg_of(p)
    assert c["num_hidden_layers"] == 1 and c["sliding_window"] == 8
    check_tensors(p, expected_shapes(dict(PRESETS["tiny"], n_layer=1)))
    # the preset's layer_types pattern follows a changed n_layer
    c = cfg_of(make_checkpoint(tmp_path / "d", "tiny-swa", overrides={"n_layer": 5}))
    s, f = "sliding_attention", "full_attention"
    assert c["layer_types"] == [s, f, s, s, f]
    with pytest.raises(ValueError, match="n_layers_typo"):
        make_checkpoint(tmp_path / "e", "tiny", overrides={"n_layers_typo": 3})


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        make_checkpoint(tmp_path / "a", "no-such-preset")
    with pytest.raises(ValueError, match="markov"):
        make_checkpoint(tmp_path / "b", "tiny", markov="lstm")
    with pytest.raises(ValueError, match="layout"):
        make_checkpoint(tmp_path / "c", "tiny", layout="sideways")
    with pytest.raises(ValueError, match="config_style"):
        make_checkpoint(tmp_path / "d", "tiny", config_style="weird")
    with pytest.raises(ValueError, match="shards"):
        make_checkpoint(tmp_path / "e", "tiny", shards=1000)


# ----------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("preset", ["tiny", "tiny-swa"])
def test_dflash_tensors(tmp_path, preset):
    p = make_checkpoint(tmp_path / "c", preset)
    check_tensors(p, expected_shapes(PRESETS[preset]))
    assert (p / "model.safetensors").exists()
    assert not (p / "model.safetensors.index.json").exists()


def test_tiny_is_small(tmp_path):
    p = make_checkpoint(tmp_path / "c", "tiny")
    assert sum(f.stat().st_size for f in p.iterdir()) < 200_000


def test_dspark_tensors(tmp_path):
    p = make_checkpoint(tmp_path / "c", "tiny-dspark")
    check_tensors(
        p,
        expected_shapes(
            PRESETS["tiny-dspark"], markov="vanilla", confidence=True, embed=True, lm_head=True
        ),
    )


@pytest.mark.parametrize("markov", ["none", "vanilla", "gated", "rnn"])
@pytest.mark.parametrize("confidence", [False, True])
def test_markov_variants(tmp_path, markov, confidence):
    p = make_checkpoint(tmp_path / "c", "tiny", markov=markov, confidence=confidence)
    m = None if markov == "none" else markov
    check_tensors(p, expected_shapes(PRESETS["tiny"], markov=m, confidence=confidence))


def test_confidence_without_markov_width(tmp_path):
    p = make_checkpoint(tmp_path / "c", "tiny-dspark", markov=False, embed=False, lm_head=False)
    got = check_tensors(p, expected_shapes(PRESETS["tiny-dspark"], confidence=True))
    assert got["confidence_head.proj.weight"].shape == (1, 64)
    assert "markov_rank" not in cfg_of(p)


def test_embed_lm_head_flags(tmp_path):
    p = make_checkpoint(tmp_path / "c", "tiny", embed=True, lm_head=True)
    check_tensors(p, expected_shapes(PRESETS["tiny"], embed=True, lm_head=True))
    p = make_checkpoint(tmp_path / "d", "tiny-dspark", embed=False, lm_head=False)
    got = load_dir(p)
    assert "embed_tokens.weight" not in got and "lm_head.weight" not in got


@pytest.mark.parametrize("shards", [2, 3, 7])
def test_sharded(tmp_path, shards):
    p = make_checkpoint(tmp_path / "s", "tiny-dspark", shards=shards)
    assert not (p / "model.safetensors").exists()
    index = json.loads((p / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    files = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    assert sorted(set(wm.values())) == files
    assert sorted(x.name for x in p.glob("*.safetensors")) == files
    seen = {}
    total = 0
    for fname in files:
        with safe_open(str(p / fname), framework="np") as f:
            keys = list(f.keys())
            assert keys, f"{fname} is empty"
            for k in keys:
                assert k not in seen and wm[k] == fname
                t = f.get_tensor(k)
                seen[k] = t
                total += t.nbytes
    assert set(seen) == set(wm)
    assert index["metadata"]["total_size"] == total
    exp = expected_shapes(
        PRESETS["tiny-dspark"], markov="vanilla", confidence=True, embed=True, lm_head=True
    )
    assert {k: v.shape for k, v in seen.items()} == exp
    # sharding does not change the values
    single = load_dir(make_checkpoint(tmp_path / "one", "tiny-dspark"))
    for k, v in single.items():
        assert np.array_equal(v.view(np.uint16), seen[k].view(np.uint16)), k


def test_rewrite_removes_stale_shards(tmp_path):
    make_checkpoint(tmp_path / "c", "tiny", shards=3)
    p = make_checkpoint(tmp_path / "c", "tiny")
    assert sorted(x.name for x in p.iterdir()) == [MARKER, "config.json", "model.safetensors"]
    assert json.loads((p / MARKER).read_text())["files"] == ["config.json", "model.safetensors"]


# ----------------------------------------------------------------------------- the folder


def _cli(*args):
    return subprocess.run(
        [sys.executable, "tools/make_checkpoint.py", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_users_files_survive(tmp_path):
    """The review's case: a folder holding someone's model*.safetensors is refused, untouched."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the user's weights")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"a user's shard")
    (out / "notes.txt").write_text("notes")
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    with pytest.raises(ValueError, match="this tool did not write") as ei:
        make_checkpoint(out, "tiny")
    for name in before:
        assert repr(name) in str(ei.value)
    r = _cli(out)
    assert r.returncode == 1 and r.stdout == ""
    (line, summary) = r.stderr.splitlines()  # the error, then the tools' usual summary line
    assert summary == f"make_checkpoint: {out}: checkpoint not written (1 problem)"
    assert line.startswith(f"make_checkpoint: error: {out}: holds 3 file(s) this tool did not")
    assert str(out) in r.stderr and "'notes.txt'" in r.stderr and "--force" in r.stderr
    assert "'model.safetensors'" in r.stderr
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # no marker either
    # a marker of the user's making names only the tool's files: it cannot claim notes.txt
    (out / MARKER).write_text(json.dumps({"files": ["notes.txt", "../outside.txt"]}))
    with pytest.raises(ValueError, match="'notes.txt'"):
        make_checkpoint(out, "tiny")
    assert (out / "notes.txt").read_text() == "notes"


def test_force_replaces_only_the_tools_files(tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the user's weights")  # a name the tool writes
    (out / "model-00001-of-00003.safetensors").write_bytes(b"a user's shard")  # one it does not
    (out / "notes.txt").write_text("notes")
    elsewhere = tmp_path / "blob"
    elsewhere.write_text("a cache blob")
    (out / "config.json").symlink_to(elsewhere)  # replaced by a file, its target untouched
    r = _cli(out, "--force")
    assert r.returncode == 0, r.stderr
    assert "left in place" in r.stderr and "model-00001-of-00003.safetensors" in r.stderr
    assert (out / "notes.txt").read_text() == "notes"
    assert (out / "model-00001-of-00003.safetensors").read_bytes() == b"a user's shard"
    assert elsewhere.read_text() == "a cache blob" and not (out / "config.json").is_symlink()
    assert set(load_dir(out)) == set(expected_shapes(PRESETS["tiny"]))
    assert json.loads((out / MARKER).read_text())["files"] == ["config.json", "model.safetensors"]
    # its own files are replaced and removed again, the others never
    make_checkpoint(out, "tiny", shards=2, force=True)
    assert not (out / "model.safetensors").exists()
    make_checkpoint(out, "tiny", force=True)
    assert sorted(f.name for f in out.iterdir()) == [
        MARKER,
        "config.json",
        "model-00001-of-00003.safetensors",
        "model.safetensors",
        "notes.txt",
    ]
    assert (out / "model-00001-of-00003.safetensors").read_bytes() == b"a user's shard"
    # with nothing else there, no --force is needed to write again
    (out / "notes.txt").unlink()
    (out / "model-00001-of-00003.safetensors").unlink()
    make_checkpoint(out, "tiny", shards=2)
    assert not (out / "model.safetensors").exists()


def test_an_interrupted_run_leaves_a_folder_it_knows(tmp_path, monkeypatch):
    out = tmp_path / "c"

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mc, "write_torch_file", disk_full)
    with pytest.raises(OSError):
        make_checkpoint(out, "tiny", overrides={"mask_embedding": "row"})
    assert (out / "model.safetensors").exists() and not (out / "config.json").exists()
    monkeypatch.undo()
    make_checkpoint(out, "tiny", overrides={"mask_embedding": "row"})  # no --force needed
    assert (out / "config.json").exists() and (out / "mask_embedding.pt").exists()


HUGE = ["--override", "hidden=65536", "--override", "n_ff=1048576"]  # an ~850 GB plan


def _refused_fast(out, capsys):
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        rc = mc.main([str(out), *HUGE])
        dt = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err, summary = capsys.readouterr().err.splitlines()
    assert rc == 1 and summary.endswith("checkpoint not written (1 problem)"), err
    assert dt < 0.5 and peak < 16 << 20, (dt, peak)  # nothing generated
    assert not out.exists()
    return err


def test_a_plan_larger_than_the_machine_is_refused_fast(tmp_path, capsys, monkeypatch):
    err = _refused_fast(tmp_path / "huge", capsys)  # this machine's disk and memory
    assert "the plan needs 850.45" in err and str(tmp_path / "huge") in err
    # the disk: free bytes named beside the need
    monkeypatch.setattr(mc, "_free_disk_bytes", lambda out: 10**11)
    err = _refused_fast(tmp_path / "huge", capsys)
    assert "the plan needs 850.456 GB (850455697792 bytes) of disk" in err
    assert "of disk, the filesystem has 100.000 GB (100000000000 bytes) free" in err
    # the memory: all of one shard's tensors are held together before the shard is written
    monkeypatch.setattr(mc, "_free_disk_bytes", lambda out: 10**13)
    monkeypatch.setattr(mc, "_available_memory_bytes", lambda: 64 << 30)
    err = _refused_fast(tmp_path / "huge", capsys)
    assert "the plan needs 850.457 GB (850456739968 bytes) of host memory at once" in err
    assert "model.safetensors" in err and "its largest tensor alone" in err
    assert "layers.0.mlp.gate_proj.weight, needs 137.4" in err
    # a need under the limit writes (the tiny preset under a 1 GB limit)
    monkeypatch.setattr(mc, "_available_memory_bytes", lambda: 10**9)
    make_checkpoint(tmp_path / "tiny", "tiny")
    monkeypatch.setattr(mc, "_available_memory_bytes", lambda: 200_000)
    with pytest.raises(ValueError, match=r"host memory at once.*more --shards lower it"):
        make_checkpoint(tmp_path / "tiny2", "tiny")
    assert not (tmp_path / "tiny2").exists()


def test_replaced_files_count_as_free_disk(tmp_path, monkeypatch):
    p = make_checkpoint(tmp_path / "c", "tiny")
    size = sum(f.stat().st_size for f in p.iterdir())
    monkeypatch.setattr(mc, "_free_disk_bytes", lambda out: (1 << 20) + 8192)
    make_checkpoint(p, "tiny")  # the old checkpoint's bytes are freed first
    with pytest.raises(ValueError, match="of disk, the filesystem has"):
        make_checkpoint(tmp_path / "d", "tiny")
    assert size > 100_000


# ----------------------------------------------------------------------------- values


def _bytes(p):
    return {f.name: f.read_bytes() for f in sorted(Path(p).iterdir())}


def test_deterministic(tmp_path):
    a = _bytes(make_checkpoint(tmp_path / "a", "tiny-dspark", seed=5))
    b = _bytes(make_checkpoint(tmp_path / "b", "tiny-dspark", seed=5))
    c = _bytes(make_checkpoint(tmp_path / "c", "tiny-dspark", seed=6))
    assert a == b
    assert a["config.json"] == c["config.json"]
    assert a["model.safetensors"] != c["model.safetensors"]
    assert _bytes(make_checkpoint(tmp_path / "d", "tiny", shards=2, seed=1)) == _bytes(
        make_checkpoint(tmp_path / "e", "tiny", shards=2, seed=1)
    )


def test_value_scales(tmp_path):
    p = make_checkpoint(tmp_path / "c", "tiny", markov="gated", confidence=True)
    got = {k: v.astype(np.float32) for k, v in load_dir(p).items()}
    for k, v in got.items():
        assert np.isfinite(v).all(), k
        assert np.any(v != 0), k
        if v.ndim == 2:
            want = 1.0 / math.sqrt(v.shape[1])
            if v.size >= 1000:
                assert abs(v.std() / want - 1) < 0.1, (k, v.std(), want)
                assert abs(v.mean()) < 0.1 * want, k
            assert np.abs(v).max() <= want * math.sqrt(3) * 1.01, k
        elif k.endswith(".bias"):
            assert np.abs(v).max() <= 0.0201, k
        else:  # norm weights: 1 + U(-0.1, 0.1)
            assert 0.89 <= v.min() and v.max() <= 1.11, k
            assert v.std() > 0.01, k
    # distinct tensors get distinct values
    q0, q1 = got["layers.0.self_attn.q_proj.weight"], got["layers.1.self_attn.q_proj.weight"]
    assert not np.array_equal(q0, q1)


def test_to_bf16_matches_ml_dtypes_round_to_nearest_even():
    rng = np.random.default_rng(3)
    x = np.concatenate(
        [
            rng.standard_normal(10000).astype(np.float32),
            np.array([0.0, -0.0, 1.0, -1.0, 1e-30, 3e38, 1.00390625, 1.01171875], np.float32),
            # exact ties: lower 16 bits 0x8000 with even and odd upper halves
            np.array([0x3F808000, 0x3F818000, 0xBF808000], np.uint32).view(np.float32),
        ]
    )
    got = to_bf16(x)
    assert got.dtype == BF16
    assert np.array_equal(got.view(np.uint16), x.astype(BF16).view(np.uint16))


def test_extra_and_dropped_tensors(tmp_path):
    extra = {
        "mystery.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "model.fc.weight": np.ones((2, 2), dtype=BF16),
    }
    p = make_checkpoint(tmp_path / "c", "tiny", extra_tensors=extra)
    got = load_dir(p)
    assert np.array_equal(got["mystery.weight"], extra["mystery.weight"])
    assert got["mystery.weight"].dtype == np.float32
    assert got["model.fc.weight"].dtype == BF16
    assert set(got) == set(expected_shapes(PRESETS["tiny"])) | set(extra)
    # a same-named extra replaces the generated tensor (misshapen-tensor tests)
    bad = np.zeros((64, 100), dtype=BF16)
    got = load_dir(make_checkpoint(tmp_path / "d", "tiny", extra_tensors={"fc.weight": bad}))
    assert got["fc.weight"].shape == (64, 100)
    # drop_tensors leaves a tensor out (missing-tensor tests)
    got = load_dir(
        make_checkpoint(tmp_path / "e", "tiny", drop_tensors=["layers.1.mlp.up_proj.weight"])
    )
    assert "layers.1.mlp.up_proj.weight" not in got
    assert len(got) == len(expected_shapes(PRESETS["tiny"])) - 1
    # extras also land in shards and in the index
    p = make_checkpoint(tmp_path / "f", "tiny", shards=2, extra_tensors=extra)
    wm = json.loads((p / "model.safetensors.index.json").read_text())["weight_map"]
    assert "mystery.weight" in wm and "model.fc.weight" in wm


# ----------------------------------------------------------------- big presets (plan only)


def test_big_preset_plans():
    """Geometry of the real presets, checked against SPEC section 7 without writing anything."""
    cfg, plan = checkpoint_plan("qwen3-8b-b16")
    shapes = {n: s for n, s, _ in plan}
    assert shapes["fc.weight"] == (4096, 5 * 4096)
    layer_bytes = sum(2 * math.prod(s) for n, s, _ in plan if n.startswith("layers."))
    assert abs(layer_bytes / 1e9 - 1.93) < 0.01
    assert abs(2 * math.prod(shapes["fc.weight"]) / 1e9 - 0.17) < 0.01
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert cfg["dflash_config"]["mask_token_id"] == 151669 and cfg["block_size"] == 16

    cfg, plan = checkpoint_plan("gemma4-31b")  # z-lab gemma-4-31B-it-DFlash, SPEC §1b
    shapes = {n: s for n, s, _ in plan}
    assert cfg["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"]
    assert cfg["sliding_window"] == 2048 and cfg["vocab_size"] == 262144
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 12, 23, 35, 46, 57]
    assert cfg["dflash_config"]["mask_token_id"] == 4
    assert shapes["layers.0.self_attn.q_proj.weight"] == (64 * 128, 5376)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (8 * 128, 5376)
    assert shapes["layers.4.mlp.gate_proj.weight"] == (10752, 5376)
    assert shapes["fc.weight"] == (5376, 6 * 5376)

    cfg, plan = checkpoint_plan("gpt-oss-20b-b8")  # z-lab gpt-oss-20b-DFlash, SPEC §1b
    shapes = {n: s for n, s, _ in plan}
    assert cfg["num_hidden_layers"] == 8 and cfg["block_size"] == 8
    assert cfg["dflash_config"]["mask_token_id"] == 200000
    assert shapes["layers.7.self_attn.q_proj.weight"] == (64 * 64, 2880)
    assert shapes["layers.7.self_attn.v_proj.weight"] == (8 * 64, 2880)
    assert shapes["layers.7.mlp.down_proj.weight"] == (2880, 7680)

    cfg, plan = checkpoint_plan("dspark-qwen3-8b-b7")
    shapes = {n: s for n, s, _ in plan}
    assert cfg["block_size"] == 7 and cfg["sample_from_anchor"] is True
    assert cfg["markov_rank"] == 256 and cfg["markov_head_type"] == "vanilla"
    assert shapes["confidence_head.proj.weight"] == (1, 4096 + 256)
    assert shapes["markov_head.markov_w1.weight"] == (151936, 256)
    assert "embed_tokens.weight" not in shapes and "lm_head.weight" not in shapes

    for name in PRESETS:
        cfg, plan = checkpoint_plan(name)
        assert len({n for n, _, _ in plan}) == len(plan)


# ----------------------------------------------------------------------------- CLI


def test_cli(tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run(
        [
            sys.executable,
            "tools/make_checkpoint.py",
            str(out),
            "--preset",
            "tiny",
            "--shards",
            "2",
            "--config-style",
            "flat",
            "--markov",
            "rnn",
            "--confidence",
            "--embed",
            "--seed",
            "3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert str(out) in r.stdout and "tensors" in r.stdout and "bytes" in r.stdout
    c = cfg_of(out)
    assert c["markov_head_type"] == "rnn" and "dflash_config" not in c
    got = load_dir(out)
    assert "markov_head.joint_proj.weight" in got and "embed_tokens.weight" in got
    assert "lm_head.weight" not in got
    same = load_dir(
        make_checkpoint(
            tmp_path / "api",
            "tiny",
            config_style="flat",
            markov="rnn",
            confidence=True,
            embed=True,
            seed=3,
        )
    )
    assert all(np.array_equal(same[k].view(np.uint16), got[k].view(np.uint16)) for k in same)


# ----------------------------------------------------------------------------- issue 8 options


def expected_bias_shapes(g):
    h, nh, nkv, hd = g["hidden"], g["n_head"], g["n_kv"], g["head_dim"]
    out = {}
    for i in range(g["n_layer"]):
        p = f"layers.{i}.self_attn."
        out.update(
            {
                p + "q_proj.bias": (nh * hd,),
                p + "k_proj.bias": (nkv * hd,),
                p + "v_proj.bias": (nkv * hd,),
                p + "o_proj.bias": (h,),
            }
        )
    return out


def test_attention_bias_tensors(tmp_path):
    p = make_checkpoint(tmp_path / "c", "tiny", overrides={"attention_bias": True})
    assert cfg_of(p)["attention_bias"] is True
    g = PRESETS["tiny"]
    got = check_tensors(p, {**expected_shapes(g), **expected_bias_shapes(g)})
    b = got["layers.0.self_attn.q_proj.bias"].astype(np.float32)
    assert np.all(np.abs(b) <= 0.02) and np.std(b) > 0.001  # biases: U(-0.02, 0.02)
    assert cfg_of(make_checkpoint(tmp_path / "d", "tiny"))["attention_bias"] is False


YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}


def test_rope_scaling_written_per_style(tmp_path):
    c = cfg_of(make_checkpoint(tmp_path / "a", "tiny", overrides={"rope": YARN}))
    assert c["rope_theta"] == 10000.0 and c["rope_scaling"] == YARN  # HF 4.x form
    for style in ("rope_parameters", "rope_scaling"):
        c = cfg_of(
            make_checkpoint(tmp_path / style, "tiny", rope_style=style, overrides={"rope": YARN})
        )
        assert "rope_theta" not in c and c[style] == {**YARN, "rope_theta": 10000.0}
    linear = {"rope_type": "linear", "factor": 2.0}
    c = cfg_of(make_checkpoint(tmp_path / "l", "tiny", overrides={"rope": linear}))
    assert c["rope_scaling"] == linear


def test_rope_per_layer_type(tmp_path):
    per = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {**YARN, "rope_theta": 1e6},
    }
    c = cfg_of(make_checkpoint(tmp_path / "c", "tiny-swa", overrides={"rope_per_layer_type": per}))
    assert c["rope_parameters"] == per and "rope_theta" not in c and "rope_scaling" not in c


def test_is_causal_block_size_nested_and_max_positions(tmp_path):
    c = cfg_of(
        make_checkpoint(
            tmp_path / "a",
            "tiny",
            overrides={
                "is_causal": True,
                "block_size_nested": True,
                "max_position_embeddings": 4096,
            },
        )
    )
    assert c["is_causal"] is True and c["max_position_embeddings"] == 4096
    assert "block_size" not in c and c["dflash_config"]["block_size"] == 8
    c = cfg_of(
        make_checkpoint(
            tmp_path / "b",
            "tiny",
            config_style="flat",
            overrides={"block_size_nested": True, "is_causal": False},
        )
    )
    assert c["dflash_config"] == {"block_size": 8} and c["is_causal"] is False
    assert "is_causal" not in cfg_of(make_checkpoint(tmp_path / "d", "tiny"))


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"attention_bias": "yes"}, "attention_bias"),
        ({"is_causal": 1}, "is_causal"),
        ({"rope": {"factor": 2.0}}, "rope"),
        ({"rope_per_layer_type": {"chunked_attention": {}}}, "rope_per_layer_type"),
        ({"rope_per_layer_type": {}}, "rope_per_layer_type"),
    ],
)
def test_bad_issue8_overrides(tmp_path, overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        make_checkpoint(tmp_path / "c", "tiny", overrides=overrides)
    assert not (tmp_path / "c").exists()


def test_public_presets_of_issue8():
    """SPEC §1b field for field (plan only, nothing written)."""
    cfg, plan = checkpoint_plan("gpt-oss-20b-b8")
    shapes = {n: s for n, s, _ in plan}
    assert cfg["attention_bias"] is True and cfg["rope_theta"] == 150000.0
    assert cfg["rope_scaling"] == YARN and cfg["max_position_embeddings"] == 131072
    assert cfg["num_attention_heads"] == 64 and cfg["head_dim"] == 64
    for i in range(8):
        assert shapes[f"layers.{i}.self_attn.q_proj.bias"] == (64 * 64,)
        assert shapes[f"layers.{i}.self_attn.k_proj.bias"] == (8 * 64,)
        assert shapes[f"layers.{i}.self_attn.v_proj.bias"] == (8 * 64,)
        assert shapes[f"layers.{i}.self_attn.o_proj.bias"] == (2880,)

    cfg, plan = checkpoint_plan("qwen3.6-27b")  # z-lab Qwen3.6-27B-DFlash
    shapes = {n: s for n, s, _ in plan}
    assert "block_size" not in cfg and cfg["dflash_config"]["block_size"] == 16
    assert cfg["num_hidden_layers"] == 5 and cfg["sliding_window"] == 2048
    assert cfg["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"]
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 16, 31, 46, 61]
    assert cfg["dflash_config"]["mask_token_id"] == 248070 and cfg["vocab_size"] == 248320
    assert shapes["layers.0.self_attn.q_proj.weight"] == (32 * 128, 5120)
    assert shapes["layers.4.mlp.up_proj.weight"] == (17408, 5120)
    assert shapes["fc.weight"] == (5120, 5 * 5120)
    assert not any(n.endswith(".bias") for n in shapes)

    cfg, plan = checkpoint_plan("dspark-qwen3-4b-b7")  # DeepSpec DSpark Qwen3-4B block 7
    shapes = {n: s for n, s, _ in plan}
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in cfg
    assert cfg["block_size"] == 7 and cfg["mask_token_id"] == 151669
    assert cfg["target_layer_ids"] == [1, 9, 17, 25, 33] and cfg["rope_theta"] == 1e6
    assert cfg["hidden_size"] == 2560 and cfg["intermediate_size"] == 9728
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (32, 8, 128)
    assert cfg["markov_rank"] == 256 and cfg["markov_head_type"] == "vanilla"
    assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is True
    assert cfg["sample_from_anchor"] is True
    assert shapes["confidence_head.proj.weight"] == (1, 2560 + 256)
    assert shapes["markov_head.markov_w2.weight"] == (151936, 256)


# ----------------------------------------------------------------------------- DFlash2


def dflash2_shapes(g):
    """The DFlash2 tensors a geometry adds, written out independently of the tool."""
    d2, h, v = g["dflash2"], g["hidden"], g["vocab"]
    k, r = d2["conv_kernel_size"], d2["selector_rank"]
    e = {
        "candidate_selector.hidden_projection.weight": (r, h),
        "candidate_selector.predecessor_codebook": (v, r),
        "candidate_selector.successor_codebook": (v, r),
    }
    for i in range(g["n_layer"]):
        for conv in ("attention_conv", "mlp_conv"):
            e[f"layers.{i}.{conv}.base_kernel"] = (2, k, h)
            e[f"layers.{i}.{conv}.kernel_projection.weight"] = (
                2 * k * h // d2["conv_group_size"],
                h,
            )
    return e


HEAD_OF_PUBLISHED_DFLASH2 = {
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 256,
    "selector_top_k": 16,
}


def test_dflash2_public_presets():
    """Both published DFlash2 configs field for field, and their tensors (plan only)."""
    cfg, plan = checkpoint_plan("qwen3.8-27b-dflash2")  # z-lab Qwen3.8-27B-DFlash2
    shapes = {n: s for n, s, _ in plan}
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert cfg["layer_types"] == ["sliding_attention"] * 5 and cfg["sliding_window"] == 2048
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (
        5120,
        17408,
        5,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (32, 8, 128)
    assert cfg["vocab_size"] == 248320 and cfg["rope_theta"] == 1e7 and cfg["rms_norm_eps"] == 1e-6
    assert cfg["num_target_layers"] == 64 and cfg["max_position_embeddings"] == 262144
    assert "block_size" not in cfg
    assert cfg["dflash_config"] == {
        "mask_token_id": 248070,
        "target_layer_ids": [5, 19, 33, 47, 61],
        "block_size": 8,
        **HEAD_OF_PUBLISHED_DFLASH2,
    }
    assert shapes["layers.4.attention_conv.kernel_projection.weight"] == (1280, 5120)
    assert shapes["candidate_selector.predecessor_codebook"] == (248320, 256)
    assert shapes["fc.weight"] == (5120, 5 * 5120)
    g = PRESETS["qwen3.8-27b-dflash2"]
    assert shapes == {**expected_shapes(g), **dflash2_shapes(g)}

    cfg, plan = checkpoint_plan("muse-glimmer-30b-dflash2")  # incoai Muse-Glimmer-30B-DFlash2
    shapes = {n: s for n, s, _ in plan}
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert cfg["layer_types"] == ["sliding_attention"] * 5 and cfg["sliding_window"] == 2048
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]) == (
        6656,
        19968,
        202048,
    )
    assert cfg["rope_theta"] == 5e5 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["num_target_layers"] == 52 and cfg["max_position_embeddings"] == 131072
    assert cfg["dflash_config"] == {
        "mask_token_id": 201818,
        "target_layer_ids": [1, 13, 25, 37, 49],
        "block_size": 16,
        "output_multiplier": 0.19611613513818404,
        "final_logit_softcapping": 20.0,
        **HEAD_OF_PUBLISHED_DFLASH2,
    }
    # the published header's shapes (z-lab/dflash's fixture)
    assert shapes["layers.0.attention_conv.base_kernel"] == (2, 2, 6656)
    assert shapes["layers.0.mlp_conv.kernel_projection.weight"] == (1664, 6656)
    assert shapes["candidate_selector.hidden_projection.weight"] == (256, 6656)
    assert shapes["candidate_selector.successor_codebook"] == (202048, 256)
    g = PRESETS["muse-glimmer-30b-dflash2"]
    assert shapes == {**expected_shapes(g), **dflash2_shapes(g)}
    assert len(shapes) == 3 + 5 * 15 + 3  # 23 DFlash2 tensors beside the 58 of DFlash


def test_tiny_dflash2_written(tmp_path):
    g = PRESETS["tiny-dflash2"]
    p = make_checkpoint(tmp_path / "c", "tiny-dflash2")
    c = cfg_of(p)
    assert c["is_causal"] is False and c["sliding_window"] == 8 and c["vocab_size"] == 512
    assert c["dflash_config"]["block_size"] == 4 and c["dflash_config"]["selector_top_k"] == 4
    got = check_tensors(p, {**expected_shapes(g), **dflash2_shapes(g)})
    got = {k: v.astype(np.float32) for k, v in got.items()}
    for k, v in got.items():
        assert np.isfinite(v).all() and np.any(v != 0), k
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            base = got[f"layers.{i}.{conv}.base_kernel"]  # near the identity: tap 0 about 1
            assert 0.89 <= base[:, 0].min() and base[:, 0].max() <= 1.11
            assert np.abs(base[:, 1:]).max() <= 0.101
            proj = got[f"layers.{i}.{conv}.kernel_projection.weight"]
            assert np.abs(proj).max() <= 0.2 * math.sqrt(3 / 64) * 1.01
    book = got["candidate_selector.predecessor_codebook"]  # [vocab, rank]: std 1/sqrt(rank)
    assert abs(book.std() * math.sqrt(16) - 1) < 0.1
    assert not np.array_equal(book, got["candidate_selector.successor_codebook"])


def test_dflash2_flat_style_writes_the_head_at_top_level():
    cfg, _ = checkpoint_plan("tiny-dflash2", config_style="flat")
    assert cfg["selector_rank"] == 16 and cfg["conv_group_size"] == 16
    assert "selector_rank" not in cfg.get("dflash_config", {})


@pytest.mark.parametrize(
    "dflash2, fragment",
    [
        ({"conv_kernel_size": 2}, "dflash2 must be None or a dict of"),
        ([2, 16, 16, 4], "dflash2 must be None or a dict of"),
        (dict(HEAD_OF_PUBLISHED_DFLASH2, selector_rank=0), "dflash2.selector_rank must be"),
        (dict(HEAD_OF_PUBLISHED_DFLASH2, conv_group_size=24), "does not divide hidden 64"),
    ],
)
def test_bad_dflash2_overrides(tmp_path, dflash2, fragment):
    with pytest.raises(ValueError, match=fragment):
        make_checkpoint(tmp_path / "c", "tiny", overrides={"dflash2": dflash2})
    assert not (tmp_path / "c").exists()
