"""Checkpoint reading: config + safetensors (single file or shards), validated up front.

`Checkpoint.open(dir)` reads only headers: it checks every expected tensor's presence, shape and
dtype against the config (with attention_bias, the q/k/v/o biases too), detects the optional
heads (Markov vanilla/gated/rnn, confidence, embed, lm_head), refuses a tensor whose name says
it changes the math but that the loader would not use (under layers.N., fc., the norms, a head),
lists only foreign tensors as `unknown`, and raises one CheckpointError naming every problem.
Tensor data is read later, one tensor at a time, so nothing large is held twice.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from .config import DflashCfg
from .errors import CheckpointError, ConfigError

ACCEPTED_DTYPES = ("BF16", "F16", "F32")
# Bytes per element of every safetensors dtype (unknown extra tensors may use any of them).
_DTYPE_SIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}
MARKOV_W1 = "markov_head.markov_w1.weight"
MARKOV_W2 = "markov_head.markov_w2.weight"
GATE_W, GATE_B = "markov_head.gate_proj.weight", "markov_head.gate_proj.bias"
JOINT_W, JOINT_B = "markov_head.joint_proj.weight", "markov_head.joint_proj.bias"
CONF_W, CONF_B = "confidence_head.proj.weight", "confidence_head.proj.bias"
EMBED, LM_HEAD = "embed_tokens.weight", "lm_head.weight"

LAYER_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_norm",
    "self_attn.k_norm",
)
ATTN_BIASES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
# Names that say a tensor changes the drafter's math: one the loader would not use is an
# error (a silently dropped bias or head computes something else). Anything else is foreign.
# embed_tokens / lm_head are used when present, so an extra tensor of theirs (a bias) counts.
_MATH_PREFIXES = (
    "fc.",
    "norm.",
    "hidden_norm.",
    "markov_head.",
    "confidence_head.",
    "candidate_selector.",
    "embed_tokens.",
    "lm_head.",
)
_LAYER_NAME = re.compile(r"layers\.\d+\.")


def backbone_shapes(cfg: DflashCfg) -> dict[str, tuple[int, ...]]:
    """Every tensor the backbone must have, with its [out, in] (or [n]) shape."""
    h, hd = cfg.hidden, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.n_taps * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(cfg.n_layer):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (cfg.q_dim, h),
                p + "self_attn.k_proj.weight": (cfg.kv_dim, h),
                p + "self_attn.v_proj.weight": (cfg.kv_dim, h),
                p + "self_attn.o_proj.weight": (h, cfg.q_dim),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (cfg.n_ff, h),
                p + "mlp.up_proj.weight": (cfg.n_ff, h),
                p + "mlp.down_proj.weight": (h, cfg.n_ff),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
        if cfg.attention_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (cfg.q_dim,),
                    p + "self_attn.k_proj.bias": (cfg.kv_dim,),
                    p + "self_attn.v_proj.bias": (cfg.kv_dim,),
                    p + "self_attn.o_proj.bias": (h,),
                }
            )
    return shapes


def changes_the_math(name: str) -> bool:
    """True for a tensor name under layers.N., fc., the norms, or a head (SPEC §2)."""
    return name.startswith(_MATH_PREFIXES) or _LAYER_NAME.match(name) is not None


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors dtype string: BF16, F16, F32
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _DTYPE_SIZE.get(self.dtype, 2)


class Checkpoint:
    """A validated checkpoint directory. `cfg` already reflects the heads found on disk."""

    def __init__(
        self, path: Path, cfg: DflashCfg, tensors: dict[str, TensorInfo], unknown: list[str]
    ) -> None:
        self.path, self.cfg, self.tensors, self.unknown = path, cfg, tensors, unknown

    @classmethod
    def open(cls, ckpt_dir: str | Path) -> Checkpoint:
        path = Path(ckpt_dir)
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a directory")
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: no config.json (not a checkpoint directory)")
        cfg = DflashCfg.load(path)
        tensors = _read_headers(path)
        cfg, unknown = _validate(path, cfg, tensors)
        return cls(path, cfg, tensors, unknown)

    # -- inventory -------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.tensors

    @property
    def has_embed(self) -> bool:
        return EMBED in self.tensors

    @property
    def has_lm_head(self) -> bool:
        return LM_HEAD in self.tensors

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    # -- data --------------------------------------------------------------------------------
    def read(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 as ml_dtypes.bfloat16)."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        try:
            with safe_open(str(info.file), framework="numpy") as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{info.file}: cannot read tensor {name!r}: {exc}") from None

    def read_f32(self, name: str) -> np.ndarray:
        return np.asarray(self.read(name), dtype=np.float32)

    def read_bf16_bits(self, name: str) -> np.ndarray:
        """The tensor as raw bf16 bit patterns (uint16); f16/f32 tensors are rounded to bf16."""
        from .quant import bf16_bits_from_f32  # local: quant is only needed for this path

        a = self.read(name)
        if a.dtype == np.dtype("bfloat16"):
            return a.view(np.uint16)
        return bf16_bits_from_f32(np.asarray(a, dtype=np.float32))


def _read_headers(path: Path) -> dict[str, TensorInfo]:
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    problems: list[str] = []
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()
            ):
                raise TypeError("weight_map is not an object of tensor name -> file name")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: unreadable shard index ({exc})") from None
        files = sorted(set(weight_map.values()))
    elif single.is_file():
        weight_map, files = None, ["model.safetensors"]
    else:
        raise CheckpointError(
            f"{path}: neither model.safetensors nor "
            f"model.safetensors.index.json (not a checkpoint directory)"
        )
    tensors: dict[str, TensorInfo] = {}
    for fname in files:
        file = path / fname
        if not file.is_file():
            problems.append(f"shard {fname} named in the index is missing")
            continue
        try:
            with safe_open(str(file), framework="numpy") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    if name in tensors:
                        problems.append(
                            f"{name}: stored in both {tensors[name].file.name} and {fname}"
                        )
                    tensors[name] = TensorInfo(
                        name, file, sl.get_dtype(), tuple(int(d) for d in sl.get_shape())
                    )
        except (SafetensorError, OSError) as exc:
            problems.append(f"{fname}: corrupt or truncated safetensors file ({exc})")
    if weight_map is not None:
        for name, fname in weight_map.items():
            if (path / fname).is_file() and name in tensors and tensors[name].file.name != fname:
                problems.append(f"{name}: index says {fname}, found in {tensors[name].file.name}")
            elif (
                (path / fname).is_file()
                and name not in tensors
                and not any(p.startswith(f"{fname}:") for p in problems)
            ):
                problems.append(f"{name}: listed in the index under {fname} but not in that file")
    if problems:
        raise CheckpointError(f"{path}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    return tensors


def _validate(
    path: Path, cfg: DflashCfg, tensors: dict[str, TensorInfo]
) -> tuple[DflashCfg, list[str]]:
    """Check shapes/dtypes, detect the optional heads, and reconcile them with the config."""
    problems: list[str] = []
    expected = backbone_shapes(cfg)

    def check(name: str, shape: tuple[int, ...]) -> None:
        info = tensors.get(name)
        if info is None:
            problems.append(f"{name}: missing (expected shape {list(shape)})")
        elif info.shape != shape:
            problems.append(f"{name}: expected shape {list(shape)}, found {list(info.shape)}")
        elif info.dtype not in ACCEPTED_DTYPES:
            problems.append(
                f"{name}: dtype {info.dtype} not supported (accepted: {', '.join(ACCEPTED_DTYPES)})"
            )

    for name, shape in expected.items():
        check(name, shape)
    known = set(expected)

    # Optional heads: the files say what is there; the config may only confirm it.
    h = cfg.hidden
    vocab = cfg.vocab_size
    markov_type, rank = None, 0
    if MARKOV_W1 in tensors:
        w1 = tensors[MARKOV_W1].shape
        if len(w1) == 2:
            vocab = vocab or w1[0]
            rank = w1[1]
        markov_type = "rnn" if JOINT_W in tensors else "gated" if GATE_W in tensors else "vanilla"
        check(MARKOV_W1, (vocab, rank))
        check(MARKOV_W2, (vocab, rank))
        known |= {MARKOV_W1, MARKOV_W2}
        if markov_type == "gated":
            check(GATE_W, (rank, h + rank))
            check(GATE_B, (rank,))
            known |= {GATE_W, GATE_B}
        if markov_type == "rnn":
            check(JOINT_W, (3 * rank, 2 * rank + h))
            check(JOINT_B, (3 * rank,))
            known |= {JOINT_W, JOINT_B}
        if cfg.markov_type is not None and cfg.markov_type != markov_type:
            problems.append(
                f"markov_head: config says {cfg.markov_type!r}, tensors say {markov_type!r}"
            )
        if cfg.markov_rank and cfg.markov_rank != rank:
            problems.append(
                f"{MARKOV_W1}: config markov_rank {cfg.markov_rank}, tensor has rank {rank}"
            )
    elif cfg.markov_type is not None:
        problems.append(
            f"{MARKOV_W1}: missing (config declares a {cfg.markov_type} Markov head "
            f"of rank {cfg.markov_rank})"
        )

    confidence, conf_markov = False, False
    if CONF_W in tensors:
        confidence = True
        shape = tensors[CONF_W].shape
        conf_markov = markov_type is not None and shape == (1, h + rank)
        check(CONF_W, (1, h + rank if conf_markov else h))
        check(CONF_B, (1,))
        known |= {CONF_W, CONF_B}
    elif cfg.confidence_head:
        problems.append(f"{CONF_W}: missing (config enables the confidence head)")

    for name in (EMBED, LM_HEAD):
        if name in tensors:
            if len(tensors[name].shape) == 2:
                vocab = vocab or tensors[name].shape[0]
            check(name, (vocab, h))
            known.add(name)
    for name in sorted(set(tensors) - known):
        if not changes_the_math(name):
            continue
        if (
            name.endswith(".bias")
            and any(name.endswith(f".{b}.bias") for b in ATTN_BIASES)
            and not cfg.attention_bias
        ):
            problems.append(
                f"{name}: an attention bias, but config.json does not set "
                f"attention_bias: true (ignoring it would change the math)"
            )
        else:
            problems.append(
                f"{name}: not used by this drafter's configuration, but its name "
                f"says it changes the math (refused rather than ignored)"
            )
    unknown = sorted(n for n in set(tensors) - known if not changes_the_math(n))
    if problems:
        raise CheckpointError(f"{path}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    try:
        cfg = dataclasses.replace(
            cfg,
            vocab_size=vocab,
            markov_type=markov_type,
            markov_rank=rank,
            confidence_head=confidence,
            confidence_with_markov=conf_markov,
        )
    except (TypeError, ValueError) as exc:  # pragma: no cover - replace() of a frozen dataclass
        raise ConfigError(f"{path}: {exc}") from None
    return cfg, unknown
