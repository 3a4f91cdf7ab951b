"""Fuzzing as a hostile or careless user would (issue 13): configs (as dicts and as JSON text),
safetensors headers, shard indexes, checkpoint paths, the reference API's arguments, the
speculative oracles' arguments (pydflash.speculative) and the weight formats' shapes. Every
case must end in a result or a PydflashError, leave the state it touched intact, and stay
within a time and memory bound.

Two tiers of the same targets, seeded (derandomize): a few hundred cases per target in the
default run, thousands under `-m fuzz` (PYDFLASH_FUZZ_EXAMPLES sets the count). A summary line
(cases, results, pydflash errors, raw errors, hangs, slowest case) ends the module's run.
"""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import shutil
import struct
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pydflash import Checkpoint, DflashCfg, PydflashError, ReferenceDraft, ReferenceKv
from pydflash.formats import codec as quant
from pydflash.formats import format as weight_formats
from pydflash.model import bounds
from tools.make_checkpoint import make_checkpoint

CI_EXAMPLES = int(os.environ.get("PYDFLASH_FUZZ_CI", "250"))
FUZZ_EXAMPLES = int(os.environ.get("PYDFLASH_FUZZ_EXAMPLES", "2000"))
CASE_SECONDS = 2.0  # every case, however hostile, returns within this
HANG_SECONDS = 60  # a case still running after this is a hang: dump the stacks and exit
MEMORY_HEADROOM = 3 << 30  # address space a case may add (RLIMIT_AS): a huge allocation fails

STATS: Counter = Counter()
LAST_ERROR: list[BaseException] = []  # the PydflashError of the last refused case
TIERS = [
    pytest.param(CI_EXAMPLES, id="ci"),
    pytest.param(FUZZ_EXAMPLES, id="fuzz", marks=pytest.mark.fuzz),
]


def tiered(examples: int):
    return settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,  # CASE_SECONDS is checked per case below, on the call alone
        database=None,
        suppress_health_check=list(HealthCheck),
    )


@pytest.fixture(scope="module", autouse=True)
def bounded_memory_and_summary():
    """Cap the address space for the module's cases; write the counts where
    PYDFLASH_FUZZ_SUMMARY says."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = used + MEMORY_HEADROOM
        if hard == resource.RLIM_INFINITY or limit < hard:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        else:
            resource = None  # type: ignore[assignment]
    except (ImportError, OSError, ValueError):
        resource = None  # type: ignore[assignment]
    yield
    if resource is not None:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    summary = os.environ.get("PYDFLASH_FUZZ_SUMMARY")
    if summary and STATS["cases"]:
        Path(summary).write_text(json.dumps(dict(STATS), indent=1) + "\n")


def summary_lines() -> list[str]:
    """What tests/conftest.py prints at the end of a run that ran these targets."""
    if not STATS["cases"]:
        return []
    lines = [
        f"fuzz: {STATS['cases']} cases, {STATS['result']} results, "
        f"{STATS['pydflash_error']} pydflash errors, {STATS['raw_error']} raw errors, "
        f"{STATS['hang']} hangs (slowest case {STATS['slowest_ms'] / 1000:.3f} s)"
    ]
    for target in sorted(k[7:] for k in STATS if k.startswith("target:")):
        n, ok = STATS["target:" + target], STATS["results:" + target]
        slowest = STATS["slowest_ms:" + target] / 1000
        lines.append(f"  {target}: {n} cases, {ok} results, slowest {slowest:.3f} s")
    return lines


REFUSED = object()  # what outcome() returns for a case that raised a PydflashError


def outcome(target: str, call):
    """Run one case: its result, or REFUSED after a PydflashError; any other exception is a
    raw error (re-raised: the test fails), a case over CASE_SECONDS a hang."""
    STATS["cases"] += 1
    STATS["target:" + target] += 1
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    t0 = time.perf_counter()
    try:
        result = call()
        STATS["result"] += 1
        STATS["results:" + target] += 1
    except PydflashError as exc:
        result = REFUSED
        STATS["pydflash_error"] += 1
        LAST_ERROR[:] = [exc]
    except BaseException:
        STATS["raw_error"] += 1
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()
        dt = time.perf_counter() - t0
        ms = int(dt * 1000)
        STATS["slowest_ms"] = max(STATS["slowest_ms"], ms)
        STATS["slowest_ms:" + target] = max(STATS["slowest_ms:" + target], ms)
    if dt > CASE_SECONDS:
        STATS["hang"] += 1
        raise AssertionError(f"{target}: a case took {dt:.2f} s (bound {CASE_SECONDS} s)")
    return result


# -- values a careless or hostile config holds ---------------------------------------------------
KEYS = [
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "num_hidden_layers",
    "rms_norm_eps",
    "vocab_size",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "max_position_embeddings",
    "partial_rotary_factor",
    "attention_bias",
    "is_causal",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "architectures",
    "dspark_bonus_anchor",
    "sample_from_anchor",
    "dflash_config",
    "hidden_act",
    "target_hidden_size",
    "input_embedding_scale",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
]
ROPE_KEYS = [
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
    "sliding_attention",
    "full_attention",
]
WORDS = [
    "silu",
    "gelu",
    "default",
    "linear",
    "llama3",
    "yarn",
    "dynamic",
    "sliding_attention",
    "full_attention",
    "vanilla",
    "gated",
    "rnn",
    "DFlashDraftModel",
    "Qwen3DSparkModel",
    "DFlash2DraftModel",
    "",
]
SPECIAL_NUMBERS = [
    0,
    1,
    -1,
    2,
    3,
    7,
    8,
    16,
    32,
    1023,
    1024,
    1025,
    2**31 - 1,
    2**31,
    2**40,
    2**63,
    -(2**63),
    10**30,
    10**400,
    0.5,
    1.5,
    -0.0,
    1e-300,
    1e300,
    5e-324,
    1e-38,
    float("inf"),
    float("-inf"),
    float("nan"),
]


def _huge() -> int:
    return 10**5000


def scalars(json_safe: bool = False):
    ints = st.integers(min_value=-(2**70), max_value=2**70)
    special = st.sampled_from(SPECIAL_NUMBERS)
    out = [st.none(), st.booleans(), ints, special, st.floats(), st.sampled_from(WORDS)]
    out.append(st.text(max_size=12))
    if not json_safe:
        out.append(st.builds(_huge))  # past Python's int <-> str limit (built: repr fails)
    return st.one_of(*out)


def json_values(json_safe: bool = False):
    return st.recursive(
        scalars(json_safe),
        lambda children: st.one_of(
            st.lists(children, max_size=6),
            st.dictionaries(st.sampled_from(KEYS + ROPE_KEYS) | st.text(max_size=6), children),
        ),
        max_leaves=12,
    )


def base_configs() -> list[dict]:
    tiny = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "block_size": 8,
        "dflash_config": {"mask_token_id": 255, "target_layer_ids": [1, 3, 5]},
    }
    swa = dict(
        tiny,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=8,
    )
    dspark = {
        k: v for k, v in tiny.items() if k not in ("dflash_config", "architectures", "block_size")
    }
    dspark.update(
        architectures=["Qwen3DSparkModel"],
        block_size=7,
        mask_token_id=255,
        target_layer_ids=[1, 3, 5],
        markov_rank=32,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        sample_from_anchor=True,
    )
    yarn = dict(
        tiny,
        attention_bias=True,
        max_position_embeddings=4096,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    )
    llama3 = dict(tiny)
    del llama3["rope_theta"]
    llama3["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    dflash2 = dict(
        tiny,
        architectures=["DFlash2DraftModel"],
        is_causal=False,
        layer_types=["sliding_attention"] * 2,
        sliding_window=8,
    )
    dflash2["dflash_config"] = dict(
        tiny["dflash_config"],
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=16,
        selector_top_k=4,
    )
    return [tiny, swa, dspark, yarn, llama3, dflash2]


BASES = base_configs()
NESTED = ("dflash_config", "rope_parameters", "rope_scaling")


@st.composite
def configs(draw, json_safe: bool = False):
    """A real config shape with up to 5 careless edits: a key set to any value, deleted, or
    set inside one of its nested objects."""
    raw = copy.deepcopy(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(0, 5))):
        op = draw(st.sampled_from(["set", "set", "delete", "nested"]))
        if op == "set":
            raw[draw(st.sampled_from(KEYS) | st.text(max_size=6))] = draw(json_values(json_safe))
        elif op == "delete" and raw:
            raw.pop(draw(st.sampled_from(sorted(raw))), None)
        else:
            outer = draw(st.sampled_from(NESTED))
            inner = raw.get(outer)
            if not isinstance(inner, dict):
                inner = raw[outer] = {}
            inner[draw(st.sampled_from(KEYS + ROPE_KEYS))] = draw(json_values(json_safe))
    return raw


def parsed_config_is_sound(cfg: DflashCfg) -> None:
    """A config that parses is within every bound and its RoPE tables are usable."""
    assert bounds.cfg_problems(cfg) == [], bounds.cfg_problems(cfg)
    for i in range(cfg.n_layer):
        cfg.rope_of(i)
        cfg.window_of(i)


@pytest.mark.parametrize("examples", TIERS)
def test_config_dicts(examples):
    @tiered(examples)
    @given(raw=configs())
    def case(raw):
        before = repr_safe(raw)
        cfg = outcome("config_dict", lambda: DflashCfg.from_dict(raw))
        assert repr_safe(raw) == before, "from_dict changed its input"
        if cfg is not REFUSED:
            parsed_config_is_sound(cfg)

    case()


def repr_safe(raw) -> str:
    """A comparable rendering of a config dict that may hold huge ints and NaN."""
    return json.dumps(raw, default=str, sort_keys=False, allow_nan=True) if _small(raw) else "?"


def _small(raw) -> bool:
    try:
        json.dumps(raw, allow_nan=True)
        return True
    except (ValueError, TypeError):
        return False


TEXT_EDITS = [
    lambda t: t,
    lambda t: t[: len(t) // 2],
    lambda t: "[" * 5000 + "]" * 5000,
    lambda t: t[:-1] + ', "x": ' + "[" * 900 + "]" * 900 + "}",
    lambda t: t[:-1] + ', "hidden_size": 64}',  # a duplicate key
    lambda t: t.replace("64", "9" * 5000, 1),
    lambda t: t.replace("10000.0", "1" + "0" * 400, 1),
    lambda t: t.replace("1e-06", "1e-400", 1),
    lambda t: t.replace("10000.0", "NaN", 1),
    lambda t: "\ufeff" + t,
    lambda t: t.replace('"', "'"),
    lambda t: "",
    lambda t: "null",
    lambda t: t + "\x00",
]


@pytest.mark.parametrize("examples", TIERS)
def test_config_json_text(examples, tmp_path):
    path = tmp_path / "config.json"

    @tiered(examples)
    @given(
        raw=configs(json_safe=True), edit=st.sampled_from(TEXT_EDITS), junk=st.binary(max_size=64)
    )
    def case(raw, edit, junk):
        text = edit(json.dumps(raw))
        path.write_bytes(
            text.encode("utf-8", "surrogatepass") + (junk if junk[:1] == b"\xff" else b"")
        )
        cfg = outcome("config_json", lambda: DflashCfg.from_json(path))
        if cfg is not REFUSED:
            parsed_config_is_sound(cfg)

    case()


# -- safetensors headers -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("fuzz") / "tiny", "tiny-dspark", seed=5)


def header_of(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


DTYPES = ["F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F4", "F6_E2M3", "I64", "BOOL", "C64", "X"]


@st.composite
def header_edits(draw):
    """A list of edits to a valid header: entries retyped, reshaped, moved, added (foreign
    tensors of any dtype, many of them, huge ones), the metadata changed."""
    edits = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(
            st.sampled_from(["dtype", "shape", "offsets", "drop", "foreign", "many", "meta", "raw"])
        )
        edits.append((kind, draw(st.integers(0, 10**6)), draw(json_values(json_safe=True))))
    return edits


def apply_edits(header: dict, data: bytes, edits) -> tuple[dict, bytes]:
    names = sorted(k for k in header if k != "__metadata__")
    for kind, n, value in edits:
        name = names[n % len(names)]
        entry = header.get(name)
        if kind == "dtype" and isinstance(entry, dict):
            entry["dtype"] = DTYPES[n % len(DTYPES)]
        elif kind == "shape" and isinstance(entry, dict):
            entry["shape"] = value if n % 3 == 0 else [n % 7, 2**40] if n % 3 == 1 else [n % 5]
        elif kind == "offsets" and isinstance(entry, dict):
            entry["data_offsets"] = value if n % 2 else [n % 100, n % 100 + 2]
        elif kind == "drop":
            header.pop(name, None)
        elif kind in ("foreign", "many"):
            # well-formed foreign tensors after the data: any dtype, zero-size or small
            count = 1 if kind == "foreign" else 1 + n % 3000
            for j in range(count):
                dtype = DTYPES[(n + j) % (len(DTYPES) - 1)]
                bits = quant_bits(dtype)
                elems = 0 if kind == "many" else 16 * (n % 4)
                start = len(data)
                data += b"\x00" * (elems * bits // 8)
                header[f"foreign.{kind}.{j}"] = {
                    "dtype": dtype,
                    "shape": [elems],
                    "data_offsets": [start, len(data)],
                }
        elif kind == "meta":
            header["__metadata__"] = value
        elif kind == "raw":
            header[name] = value
    return header, data


def quant_bits(dtype: str) -> int:
    from pydflash.io.safetensors import DTYPE_BITS

    return DTYPE_BITS[dtype]


def write_safetensors(path: Path, header, data: bytes, length_edit: int, tail: int) -> None:
    body = json.dumps(header).encode()
    n = len(body)
    if length_edit == 1:
        n = 2**63
    elif length_edit == 2:
        n = len(body) + 100
    elif length_edit == 3:
        n = max(0, len(body) - 3)
    payload = struct.pack("<Q", n) + body + data
    if tail > 0:
        payload += b"\x00" * tail
    elif tail < 0:
        payload = payload[:tail]
    path.write_bytes(payload)


@pytest.mark.parametrize("examples", TIERS)
def test_safetensors_headers(examples, tiny_ckpt, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    header0, data0 = header_of(tiny_ckpt / "model.safetensors")

    @tiered(examples)
    @given(
        edits=header_edits(),
        length_edit=st.sampled_from([0, 0, 0, 1, 2, 3]),
        tail=st.sampled_from([0, 0, 0, 1, -1, -100, 7]),
        load=st.booleans(),
    )
    def case(edits, length_edit, tail, load):
        header, data = apply_edits(copy.deepcopy(header0), data0, edits)
        write_safetensors(ckpt / "model.safetensors", header, data, length_edit, tail)
        if load:
            d = outcome("safetensors_load", lambda: ReferenceDraft.load(ckpt))
            if d is not REFUSED:
                assert set(d.w) <= set(header), "read a tensor the header does not list"
                assert not any(n.startswith("foreign.") for n in d.w), "read a foreign tensor"
        else:
            ck = outcome("safetensors_open", lambda: Checkpoint.open(ckpt))
            if ck is not REFUSED:
                for name in ck.used_shapes():
                    outcome("safetensors_read", lambda name=name: ck.read(name))
                ck.close()

    case()


# -- shard indexes -------------------------------------------------------------------------------
OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A 2-shard checkpoint with its second shard in a subfolder, a secret beside it, and links
    that lead out of the folder, in a loop, and to the secret."""
    root = tmp_path_factory.mktemp("shards")
    ckpt = make_checkpoint(root / "ckpt", "tiny", shards=2, seed=6)
    (ckpt / "sub").mkdir()
    second = "model-00002-of-00002.safetensors"
    (ckpt / second).rename(ckpt / "sub" / second)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"] = {
        k: ("sub/" + v if v == second else v) for k, v in index["weight_map"].items()
    }
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    outside = root / "outside.safetensors"
    shutil.copy(ckpt / "sub" / second, outside)
    (ckpt / "escape.safetensors").symlink_to(outside)
    (ckpt / "loop.safetensors").symlink_to(ckpt / "loop.safetensors")
    (ckpt / "fifo.safetensors").unlink(missing_ok=True)
    os.mkfifo(ckpt / "fifo.safetensors")
    return ckpt, index


SHARD_NAMES = [
    "model-00001-of-00002.safetensors",
    "sub/model-00002-of-00002.safetensors",
    "sub/./model-00002-of-00002.safetensors",
    "./model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "../outside.safetensors",
    "sub/../../outside.safetensors",
    "/etc/passwd",
    "/dev/zero",
    "C:\\model.safetensors",
    "\\\\server\\share.safetensors",
    "escape.safetensors",
    "loop.safetensors",
    "fifo.safetensors",
    "model\x00.safetensors",
    "",
    "config.json",
    "x" * 5000 + ".safetensors",
    "sub",
    "missing.safetensors",
]


@pytest.mark.parametrize("examples", TIERS)
def test_shard_indexes(examples, sharded):
    global OPENED
    ckpt, index0 = sharded
    index_path = ckpt / "model.safetensors.index.json"
    allowed = str(ckpt.resolve())
    names = sorted(index0["weight_map"])

    @tiered(examples)
    @given(
        edits=st.lists(
            st.tuples(st.integers(0, 10**6), st.sampled_from(SHARD_NAMES) | json_values(True)),
            max_size=4,
        ),
        wrap=st.sampled_from(["ok", "ok", "ok", "list", "missing", "extra"]),
    )
    def case(edits, wrap):
        global OPENED
        index = copy.deepcopy(index0)
        for n, value in edits:
            index["weight_map"][names[n % len(names)]] = value
        doc = {"ok": index, "list": [index], "missing": {"metadata": {}}, "extra": dict(index)}
        if wrap == "extra":
            doc["extra"]["weight_map"] = dict(
                index["weight_map"], **{"ghost.weight": "g.safetensors"}
            )
        try:
            index_path.write_text(json.dumps(doc[wrap]))
        except (ValueError, UnicodeEncodeError):
            return
        OPENED = []
        try:
            ck = outcome("shard_index", lambda: Checkpoint.open(ckpt))
        finally:
            opened, OPENED = OPENED, None
        if ck is not REFUSED:
            ck.close()
        escaped = [
            p
            for p in opened
            if not p.endswith((".py", ".pyc")) and not str(Path(p).resolve()).startswith(allowed)
        ]
        assert not escaped, f"opened outside the checkpoint folder: {escaped}"

    try:
        case()
    finally:
        OPENED = None
        index_path.write_text(json.dumps(index0))


@pytest.mark.parametrize("examples", TIERS)
def test_checkpoint_paths(examples, tiny_ckpt):
    @tiered(examples)
    @given(
        path=st.one_of(
            st.text(max_size=40),
            st.sampled_from(["", "\x00", "a" * 5000, "/" * 4097, "/dev/null", str(tiny_ckpt)]),
            st.builds(lambda s: str(tiny_ckpt) + s, st.sampled_from(["/", "/.", "/x", "\x00"])),
            st.none(),
            st.integers(),
            st.binary(max_size=8),
        )
    )
    def case(path):
        ck = outcome("checkpoint_path", lambda: Checkpoint.open(path))
        if ck is not REFUSED:
            ck.close()

    case()


# -- the reference API ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    plain = ReferenceDraft.load(make_checkpoint(root / "tiny", "tiny", seed=7))
    dspark = ReferenceDraft.load(make_checkpoint(root / "dspark", "tiny-dspark", seed=8))
    # sliding layers whose rings (23 rows in a cap-24 KV) give a roll-back floor to keep
    swa = ReferenceDraft.load(make_checkpoint(root / "swa", "tiny-swa", seed=9))
    return [plain, dspark, swa]


def mostly(good, bad):
    """good five times in six, bad otherwise (one_of would flatten bad's many branches and
    draw them almost always): a call of several arguments then often gets into the math."""
    return st.integers(0, 5).flatmap(lambda i: bad if i == 5 else good)  # shrinks to good


def arrays_like(rows: int, cols: int):
    """Arrays a caller might pass for [rows, cols]: right, transposed, flat, ragged, wrong
    dtype, non-finite, scalars, None, strings."""
    good = st.builds(
        lambda seed, scale: np.random.default_rng(seed).standard_normal((rows, cols)) * scale,
        st.integers(0, 2**32 - 1),
        st.sampled_from([1.0] * 12 + [1e-30, 1e30, 1e200]),
    )

    def cast(dtype):
        def f(a):
            with np.errstate(all="ignore"):
                return a.astype(dtype)

        return f

    bad = st.one_of(
        good.map(lambda a: a.T),
        good.map(lambda a: a.reshape(-1)),
        good.map(lambda a: a.reshape(1, rows, cols)),
        good.map(lambda a: a[:, :-1] if cols > 1 else a[:0]),
        good.map(cast(np.complex64)),
        good.map(lambda a: a > 0),
        good.map(cast(np.int64)),
        good.map(cast(np.float16)),
        good.map(lambda a: np.where(a > 2, np.nan, a)),
        good.map(lambda a: np.where(a > 2, np.inf, a)),
        good.map(lambda a: a.astype(object)),
        good.map(lambda a: a.tolist()),
        st.just([[1.0, 2.0], [3.0]]),
        scalars(),
        st.none(),
    )
    return mostly(st.one_of(good, good.map(cast(np.float32))), bad)


def positions_like(n: int):
    base = st.builds(lambda s: np.arange(s, s + n), st.integers(0, 1000))
    bad = st.one_of(
        base.map(lambda p: p[:-1]),
        base.map(lambda p: -p - 1),
        base.map(lambda p: p + 0.5),
        base.map(lambda p: p.astype(np.float64)),
        base.map(lambda p: np.where(p % 2 == 0, np.nan, p)),
        base.map(lambda p: [2**70] * n),
        base.map(lambda p: p + 2**31),
        base.map(lambda p: p.astype(np.uint64) + np.uint64(2**63)),
        base.map(lambda p: p.astype(bool)),
        base.map(lambda p: [str(x) for x in p]),
        st.builds(range, st.integers(-3, n + 3)),
        scalars(),
        st.none(),
    )
    return mostly(st.one_of(base, base.map(lambda p: p.tolist())), bad)


COUNTS = st.one_of(
    st.integers(0, 6),
    st.integers(0, 6),
    st.integers(0, 6),
    st.sampled_from([-1, 2**62, 1.5, "3", None, True, np.int64(2)]),
)


def kv_snapshot(kv: ReferenceKv):
    k, v = [a.copy() for a in kv.k], [a.copy() for a in kv.v]
    return (kv.len, kv.rollback_floor, k, v, kv.pos.copy())


def kv_same(kv: ReferenceKv, snap, floor_too: bool = True) -> bool:
    """The KV as snap saw it; floor_too=False after a good round (its block went to the
    rings' oldest slots: the roll-back floor may rise, as on the GPU)."""
    n, floor, k, v, pos = snap
    return (
        kv.len == n
        and (kv.rollback_floor == floor or not floor_too)
        and all(np.array_equal(a, b, equal_nan=True) for a, b in zip(kv.k, k))
        and all(np.array_equal(a, b, equal_nan=True) for a, b in zip(kv.v, v))
        and np.array_equal(kv.pos, pos)
    )


@st.composite
def api_calls(draw, d: ReferenceDraft):
    c, b = d.cfg, d.cfg.block_size
    method = draw(
        st.sampled_from(
            [
                "ctx_features",
                "forward",
                "forward_block",
                "ingest_ctx",
                "forward_round",
                "draft",
                "draft_tokens",
                "len",
                "kv_new",
            ]
        )
    )
    t = draw(COUNTS)
    rows = t if isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 64 else 3
    vocab = c.vocab_size or 64
    args: dict = {"method": method, "t": t}
    if method in ("ctx_features", "forward"):
        args["taps"] = draw(arrays_like(rows, c.tap_width))
    if method in ("forward_block", "ingest_ctx"):
        args["feats"] = draw(arrays_like(rows, c.hidden))
    if method in ("forward", "forward_block", "forward_round"):
        args["noise"] = draw(arrays_like(b, c.hidden))
        args["pos"] = draw(positions_like(rows + b if method != "forward_round" else b))
    if method == "ingest_ctx":
        args["pos"] = draw(positions_like(rows))
    if method in ("draft", "draft_tokens"):
        args["hidden"] = draw(arrays_like(b, c.hidden))
        args["lm"] = draw(
            st.one_of(arrays_like(vocab, c.hidden), arrays_like(vocab + 3, c.hidden), st.none())
        )
        args["last"] = draw(
            st.one_of(
                st.integers(0, vocab - 1),
                st.integers(-2, vocab + 2),
                scalars(),
                st.sampled_from([np.int64(1), "3"]),
            )
        )
        args["softcap"] = draw(
            st.one_of(st.none(), st.none(), scalars(), st.sampled_from([30.0, 0, 1e-45]))
        )
        args["temperature"] = draw(
            st.one_of(
                st.sampled_from([0.0, 0.0, 0.7, 1.0]),
                st.sampled_from([1e-30, 1e30, float("nan"), -1.0]),
                scalars(),
            )
        )
        args["seed"] = draw(st.integers(0, 2**32 - 1))
        # the draw's randomness: numpy's rng, a Philox seed, given uniforms (hostile: 0, 1,
        # NaN, ... refused), or two sources at once (refused)
        args["source"] = draw(st.sampled_from(["rng", "rng", "seed", "uniforms", "two"]))
        n_drafts = len(c.draft_rows())
        good_u = st.builds(  # [n_drafts, V] for the good lm_head (V + 3 rows: refused)
            lambda s: (
                (np.random.default_rng(s).integers(0, 1 << 23, (n_drafts, vocab)) + 0.5) * 2.0**-23
            ),
            st.integers(0, 2**32 - 1),
        )
        args["uniforms"] = draw(hostile(good_u))
    if method == "len":
        args["value"] = draw(st.one_of(st.integers(-3, 40), scalars()))
    if method == "kv_new":
        args["cap"] = draw(st.one_of(st.integers(-2, 64), scalars(), st.just(2**26)))
        args["other"] = draw(st.booleans())
    return args


def call_api(d: ReferenceDraft, kv: ReferenceKv, other_cfg: DflashCfg, a: dict):
    m, t = a["method"], a["t"]
    if m == "ctx_features":
        return d.ctx_features(a["taps"], t)
    if m == "forward":
        return d.forward(a["taps"], a["noise"], a["pos"], t)
    if m == "forward_block":
        return d.forward_block(a["feats"], a["noise"], a["pos"], t)
    if m == "ingest_ctx":
        return d.ingest_ctx(kv, a["feats"], a["pos"], t)
    if m == "forward_round":
        return d.forward_round(kv, a["noise"], a["pos"])
    if m in ("draft", "draft_tokens"):
        kw = {"logit_softcap": a["softcap"]}
        if m == "draft":
            kw["temperature"] = a["temperature"]
            if a["source"] in ("rng", "two"):
                kw["rng"] = np.random.default_rng(a["seed"])
            if a["source"] in ("seed", "two"):
                kw["seed"] = a["seed"]
            if a["source"] == "uniforms":
                kw["uniforms"] = a["uniforms"]
            return d.draft(a["hidden"], a["lm"], a["last"], **kw)
        return d.draft_tokens(a["hidden"], a["lm"], a["last"], **kw)
    if m == "len":
        kv.len = a["value"]
        return kv.len
    if m == "kv_new":
        return ReferenceKv(other_cfg if a["other"] else d.cfg, a["cap"])
    raise AssertionError(m)


@pytest.mark.parametrize("examples", TIERS)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf / NaN inputs make NaN outputs
def test_reference_api(examples, drafts):
    import dataclasses

    kvs = [ReferenceKv(d.cfg, 24) for d in drafts]
    # a cache built for another drafter: refused before anything is written
    others = [dataclasses.replace(d.cfg, n_layer=1, layer_sliding=(False,)) for d in drafts]
    foreign = [ReferenceKv(o, 24) for o in others]

    feats = np.random.default_rng(9).standard_normal((16, drafts[0].cfg.hidden))

    @tiered(examples)
    @given(
        which=st.integers(0, 2), data=st.data(), foreign_kv=st.booleans(), pre=st.integers(0, 16)
    )
    def case(which, data, foreign_kv, pre):
        d = drafts[which]
        kv = foreign[which] if foreign_kv else kvs[which]
        kv.len = 0  # every case starts from its own committed rows: cases replay alike
        if not foreign_kv:
            d.ingest_ctx(kv, feats[:pre], np.arange(pre), pre)
        a = data.draw(api_calls(d))
        snap = kv_snapshot(kv)
        m = a["method"]
        result = outcome("reference_api", lambda: call_api(d, kv, others[which], a))
        if m == "kv_new":
            return
        if result is REFUSED:
            assert kv_same(kv, snap), f"{m}: state changed by a refused call ({LAST_ERROR})"
        elif m == "len":
            assert kv.len == result <= snap[0]
        elif m == "ingest_ctx":
            assert kv.len == snap[0] + a["t"]
        else:
            good_round = m == "forward_round"
            assert kv_same(kv, snap, not good_round), f"{m}: state changed by a read-only call"
            c = d.cfg
            if m in ("draft", "draft_tokens"):
                tokens = result.tokens if m == "draft" else result
                assert len(tokens) == len(c.draft_rows())
                assert all(0 <= tok < len(a["lm"]) for tok in tokens)
            else:
                rows = a["t"] if m == "ctx_features" else c.block_size
                assert result.shape == (rows, c.hidden)

    case()


# -- the speculative oracles --------------------------------------------------------------------
SPEC_FUNCTIONS = [
    "gumbel",
    "gumbel_argmax",
    "confident_prefix_len",
    "survival_prefix_len",
    "greedy_accept",
    "verify_uniforms",
    "speculative_accept",
    "candidate_accept",
]
SPEC_SPECIAL = [np.nan, np.inf, -np.inf, -1.0, -0.0, 0.0, 1.0, 1.5, 1e30, 1e-45, 1 - 1e-10]
SPEC_BAD_IDS = [-1, 2**31, 2**40, 2**63 - 1]
SPEC_DTYPES = [np.float16, np.float64, np.int64, np.uint8, np.bool_, np.complex64, object, "U4"]
# counts a careless caller passes: past the bound (philox.MAX_COLS), negative, not integers.
# Legal counts stay small: the largest legal one (2^24 uniforms) takes seconds by design.
HUGE_COUNTS = [-1, 2**24 + 1, 2**31, 10**9, 2**62, 2**64, 10**30, 1.5, "3", None, True]


def _cast(a, dtype):
    with np.errstate(all="ignore"):
        return np.asarray(a).astype(dtype)


def _poke(a, value, where: int, as_int: bool = False):
    """A copy of a with one entry set to value (float64, or int64 for an id)."""
    out = np.array(a, np.int64 if as_int else np.float64)
    if out.size:
        out.flat[where % out.size] = value
    return out


def hostile(good, ids: bool = False):
    """An argument as a careless caller passes it: good five times in six, else good with a
    special value poked in, cast to another dtype, transposed, flattened, cut short, grown,
    given an axis more, as a list, or an array of another shape, a ragged list, a scalar,
    None, a string."""
    poked = st.tuples(good, st.sampled_from(SPEC_SPECIAL), st.integers(0, 10**6))
    bad = [
        poked.map(lambda t: _poke(*t)),
        st.tuples(good, st.sampled_from(SPEC_DTYPES)).map(lambda t: _cast(*t)),
        good.map(lambda a: np.asarray(a).T),
        good.map(lambda a: np.asarray(a).reshape(-1)),
        good.map(lambda a: np.asarray(a).reshape(-1)[:-1]),
        good.map(lambda a: np.append(np.asarray(a).reshape(-1), 0.5)),
        good.map(lambda a: np.asarray(a)[None]),
        good.map(lambda a: np.asarray(a).tolist()),
        st.lists(st.integers(0, 4), max_size=3).map(lambda shape: np.full(shape, 0.5)),
        st.just([[0.5], [0.5, 0.5]]),
        scalars(),
        st.none(),
    ]
    if ids:
        bad.append(
            st.tuples(good, st.sampled_from(SPEC_BAD_IDS), st.integers(0, 10**6)).map(
                lambda t: _poke(*t, as_int=True)
            )
        )
    return mostly(good, st.one_of(*bad))


@st.composite
def spec_calls(draw):
    """(function name, args, kwargs): a valid call of n drafts over a vocabulary of V, its
    arguments then each passed as hostile() makes them."""
    name = draw(st.sampled_from(SPEC_FUNCTIONS))
    n, vocab = draw(st.integers(0, 6)), draw(st.integers(1, 12))
    g = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def arg(good, ids=False):
        return draw(hostile(st.just(good), ids))

    def unif(*shape):  # strictly inside (0, 1), as Philox's
        return ((g.integers(0, 1 << 23, shape) + 0.5) * 2.0**-23).astype(np.float32)

    def probs(rows, cols=vocab):
        return g.dirichlet(np.ones(cols), rows).astype(np.float32)

    def count(good):
        # scalars() without the legal counts past 2^16: up to 2^24 uniforms are allowed and
        # take seconds (philox.MAX_COLS), which is the bound working, not a hang
        careless = scalars().filter(lambda v: not (isinstance(v, int) and 2**16 < v <= 2**24))
        return draw(mostly(st.just(good), st.sampled_from(HUGE_COUNTS) | careless))

    def randomness():
        mode = draw(st.sampled_from(["seed", "seed", "uniforms", "uniforms", "both", "none"]))
        kw = {}
        if mode in ("seed", "both"):
            kw["seed"] = draw(mostly(st.integers(0, 2**64 - 1), scalars()))
            kw["offset"] = draw(mostly(st.integers(0, 2**64 - 1), scalars()))
        if mode in ("uniforms", "both"):
            kw["u_accept"], kw["u_sample"] = arg(unif(n)), arg(unif(vocab))
        return kw

    threshold = st.one_of(st.floats(-1, 2), st.sampled_from([0.0, 0.5, 1e-300, 1e39]), scalars())
    if name == "gumbel":
        return name, (arg(unif(vocab)),), {}
    if name == "gumbel_argmax":
        t = draw(mostly(st.floats(0.05, 5.0), scalars()))
        return name, (arg(g.standard_normal(vocab)), t, arg(unif(vocab))), {}
    if name in ("confident_prefix_len", "survival_prefix_len"):
        return name, (arg(g.uniform(0, 1, n).astype(np.float32)), draw(threshold)), {}
    if name == "greedy_accept":
        target = g.integers(0, vocab, n + 1)
        draft = np.where(g.random(n) < 0.8, target[:n], g.integers(0, vocab, n))
        return name, (arg(draft, ids=True), arg(target, ids=True)), {}
    if name == "verify_uniforms":
        seed = draw(mostly(st.integers(0, 2**64 - 1), scalars()))
        offset = draw(mostly(st.integers(0, 2**64 - 1), scalars()))
        return name, (seed, offset, count(n), count(vocab)), {}
    if name == "speculative_accept":
        q = probs(n)
        draft = np.array([g.choice(vocab, p=row / row.sum()) for row in q], np.int64)
        return name, (arg(draft, ids=True), arg(q), arg(probs(n + 1))), randomness()
    k = draw(st.integers(1, vocab))
    cand = np.array([g.permutation(vocab)[:k] for _ in range(n)], np.int64).reshape(n, k)
    drafts = cand[np.arange(n), g.integers(0, k, n)] if n else np.zeros(0, np.int64)
    args = (arg(drafts, ids=True), arg(cand, ids=True), arg(probs(n, k)), arg(probs(n + 1)))
    return name, args, randomness()


def snapshot(values):
    """Copies of the array arguments, to check that no oracle writes into its inputs."""
    return [np.array(v, copy=True) if isinstance(v, np.ndarray) else None for v in values]


def unchanged(values, copies) -> bool:
    for v, c in zip(values, copies):
        if c is None:
            continue
        if v.dtype != c.dtype or v.shape != c.shape:
            return False
        if v.dtype.hasobject and v.tolist() != c.tolist():
            return False
        if not v.dtype.hasobject and v.tobytes() != c.tobytes():
            return False
    return True


def spec_result_is_sound(name: str, args: tuple, result) -> None:
    """What a call that returned must have returned (its arguments were then valid)."""
    size = np.asarray(args[0]).size
    if name == "gumbel":
        assert result.shape == np.shape(args[0]) and np.isfinite(result).all()
    elif name == "gumbel_argmax":
        assert 0 <= result < size
    elif name in ("confident_prefix_len", "survival_prefix_len"):
        assert 0 <= result <= size
    elif name == "verify_uniforms":
        ua, us = result
        assert ua.shape == (args[2],) and us.shape == (args[3],)
        assert ((ua > 0) & (ua < 1)).all() and ((us > 0) & (us < 1)).all()
    else:  # the verifications: (accepted, next token), the token an id of p's vocabulary
        k, nxt = result
        p = args[-1] if name != "greedy_accept" else None  # p is last in both accepts
        vocab = 2**31 if p is None else np.asarray(p).size // (size + 1)
        assert isinstance(k, int) and isinstance(nxt, int)
        assert 0 <= k <= size and 0 <= nxt < vocab


@pytest.mark.parametrize("examples", TIERS)
def test_speculative_oracles(examples):
    """pydflash.speculative over random shapes, dtypes, NaN / inf, negatives and huge counts:
    a result or a PydflashError within the time bound, and the inputs left as they were."""
    from pydflash import speculative

    @tiered(examples)
    @given(call=spec_calls())
    def case(call):
        name, args, kwargs = call
        copies = snapshot([*args, *kwargs.values()])
        fn = getattr(speculative, name)
        result = outcome("speculative", lambda: fn(*args, **kwargs))
        assert unchanged([*args, *kwargs.values()], copies), f"{name}: wrote into its inputs"
        if result is not REFUSED:
            spec_result_is_sound(name, args, result)

    case()


# -- weight formats ------------------------------------------------------------------------------
@pytest.mark.parametrize("examples", TIERS)
def test_quant_shapes(examples):
    dims = st.one_of(
        st.integers(-64, 96), st.sampled_from([2**62, -(2**62), 1.5, "32", None, True, 32.0])
    )

    @tiered(examples)
    @given(
        fmt=st.sampled_from(["q8_0", "q4_0", "bf16", "f32", "q5_k", 3]),
        rows=dims,
        cols=dims,
        buf=st.binary(max_size=200),
        shape_kind=st.sampled_from(["pair", "list", "triple", "scalar", "none"]),
    )
    def case(fmt, rows, cols, buf, shape_kind):
        shape = {
            "pair": (rows, cols),
            "list": [rows, cols],
            "triple": (rows, cols, 1),
            "scalar": rows,
            "none": None,
        }[shape_kind]
        outcome("quant_nbytes", lambda: weight_formats.nbytes(fmt, rows, cols))
        if fmt == "q8_0":
            outcome("quant_decode", lambda: quant.decode_q8_0(buf, shape))
        elif fmt == "q4_0":
            outcome("quant_decode", lambda: quant.decode_q4_0(buf, shape))

    case()
