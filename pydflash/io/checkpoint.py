"""Checkpoint reading: config + safetensors (single file or shards), validated up front.

`Checkpoint.open(dir)` reads only headers, each file's once (`safetensors_io`): it checks every
expected tensor's presence, shape and dtype against the config (with attention_bias, the
q/k/v/o biases too; with a DFlash2 config, each layer's convs and the candidate selector),
detects the optional heads (Markov vanilla/gated/rnn, confidence, embed, lm_head), refuses a
tensor whose name says it changes the math but that the loader would not use (under layers.N.,
fc., the norms, a head), lists only foreign tensors as `unknown`, and raises one
CheckpointError naming every problem. Every file it opens must lie in the checkpoint
folder (subfolders allowed; absolute paths, `..`, NUL bytes and symlinks leading outside are
refused before anything is opened; the one exception is the Hugging Face cache, whose
snapshots/<rev>/ files link into ../../blobs/). Tensor data is read later, only for the tensors
asked for, through one handle per file (`close()` or a `with` block releases them).
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import weakref
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, ConfigError, collected
from ..heads import detect_markov_kind, markov_kind

# the Markov head's tensor names live with its kinds; re-exported: importers read them here
from ..heads.markov import GATE_B, GATE_W, JOINT_B, JOINT_W, MARKOV_W1, MARKOV_W2  # noqa: F401
from ..model import bounds
from ..model.config import DflashCfg
from . import jsonio
from .files import TensorInfo, allowed_roots, checkpoint_dir, confine, read_headers
from .safetensors import (
    Entry,
    HeaderError,
    open_checked,
    read_entry,
)

ACCEPTED_DTYPES = ("BF16", "F16", "F32")
CONF_W, CONF_B = "confidence_head.proj.weight", "confidence_head.proj.bias"
EMBED, LM_HEAD = "embed_tokens.weight", "lm_head.weight"
D2T = "d2t"  # a trimmed draft vocabulary's offsets: target id = draft id + d2t[draft id]
D2T_DTYPES = ("I64", "I32")
SINK = "self_attn.attention_sink_bias"  # per layer, [n_head]
MASK_EMBEDDING_FILE = "mask_embedding.pt"
# the name mask_embedding.pt's rows go by among a drafter's weights (not a checkpoint tensor)
MASK_EMBEDDING = "mask_embedding"
# Tensor names other exports use for the same tensors (vLLM's hf_to_vllm_mapper; Muse-Glimmer's
# assistant calls its fc / hidden_norm the aux encoder's), renamed on open
RENAMES = (
    ("encoder.fc.", "fc."),
    ("encoder.output_norm_enc.", "hidden_norm."),
    ("midlayer.", "layers.0."),
)

# DFlash2's tensors (config `dflash2`): each layer's attention and MLP sublayers are wrapped in
# a grouped dynamic conv, `layers.N.<conv>.base_kernel` [2, k, hidden] (side: 0 on the sublayer
# input, 1 on its output; tap; channel) and `layers.N.<conv>.kernel_projection.weight`
# [2 * k * hidden / conv_group_size, hidden]; the candidate selector's hidden projection
# [selector_rank, hidden] and two codebooks [vocab, selector_rank], stored without `.weight`
DFLASH2_ATTENTION_CONV = "attention_conv"
DFLASH2_MLP_CONV = "mlp_conv"
DFLASH2_CONVS = (DFLASH2_ATTENTION_CONV, DFLASH2_MLP_CONV)
CONV_BASE_KERNEL = "base_kernel"
CONV_KERNEL_PROJECTION = "kernel_projection.weight"
SELECTOR_HIDDEN = "candidate_selector.hidden_projection.weight"
PREDECESSOR_CODEBOOK = "candidate_selector.predecessor_codebook"
SUCCESSOR_CODEBOOK = "candidate_selector.successor_codebook"
SELECTOR_TENSORS = (SELECTOR_HIDDEN, PREDECESSOR_CODEBOOK, SUCCESSOR_CODEBOOK)

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
    "d2t",
    "mask_embedding",
    "aux_hidden_norms.",  # SGLang's Laguna: an RMSNorm per target-layer tap before fc
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


def dflash2_conv_names(layer: int, conv: str) -> tuple[str, str]:
    """(base_kernel, kernel_projection.weight) names of `layer`'s DFlash2 conv `conv` (one of
    DFLASH2_CONVS)."""
    if conv not in DFLASH2_CONVS:
        raise ValueError(f"conv must be one of {DFLASH2_CONVS}, found {jsonio.brief(conv)}")
    p = f"layers.{layer}.{conv}."
    return p + CONV_BASE_KERNEL, p + CONV_KERNEL_PROJECTION


def dflash2_layer_names(layer: int) -> tuple[str, str, str, str]:
    """The DFlash2 conv tensors of `layer`: attention_conv's base_kernel and
    kernel_projection.weight, then mlp_conv's."""
    attention = dflash2_conv_names(layer, DFLASH2_ATTENTION_CONV)
    mlp = dflash2_conv_names(layer, DFLASH2_MLP_CONV)
    return (*attention, *mlp)


def dflash2_layer_shapes(cfg: DflashCfg, layer: int) -> dict[str, tuple[int, ...]]:
    """`layer`'s DFlash2 conv tensors with their shapes ({} without cfg.dflash2)."""
    d2 = cfg.dflash2
    if d2 is None:
        return {}
    h, k = cfg.hidden, d2.conv_kernel_size
    shapes: dict[str, tuple[int, ...]] = {}
    for conv in DFLASH2_CONVS:
        base, projection = dflash2_conv_names(layer, conv)
        # one projection gives both sides' per-row coefficients: a tap a group a side
        shapes.update({base: (2, k, h), projection: (2 * k * (h // d2.conv_group_size), h)})
    return shapes


def dflash2_selector_shapes(cfg: DflashCfg) -> dict[str, tuple[int, ...]]:
    """The candidate selector's tensors with their shapes ({} without cfg.dflash2, or without
    a vocabulary size, which the config parser requires of a DFlash2 drafter)."""
    d2, v = cfg.dflash2, cfg.vocab_size
    if d2 is None or v is None:
        return {}
    r = d2.selector_rank
    return {
        SELECTOR_HIDDEN: (r, cfg.hidden),
        PREDECESSOR_CODEBOOK: (v, r),
        SUCCESSOR_CODEBOOK: (v, r),
    }


def is_dflash2_tensor(name: str) -> bool:
    """A name of DFlash2's: a layer's conv or the candidate selector."""
    if name.startswith("candidate_selector."):
        return True
    parts = name.split(".")
    return len(parts) > 2 and _LAYER_NAME.match(name) is not None and parts[2] in DFLASH2_CONVS


def backbone_shapes(cfg: DflashCfg) -> dict[str, tuple[int, ...]]:
    """Every tensor the backbone must have, with its [out, in] (or [n]) shape; a DFlash2
    drafter's layer convs too."""
    h, hd = cfg.hidden, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.tap_width),
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
        shapes.update(dflash2_layer_shapes(cfg, i))
        if cfg.attention_sink:
            shapes[p + SINK] = (cfg.n_head,)
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


def head_shapes(cfg: DflashCfg) -> dict[str, tuple[int, ...]]:
    """The tensors of the heads `cfg` declares (Markov, confidence, DFlash2's candidate
    selector), with their shapes."""
    h, r, v = cfg.hidden, cfg.markov_rank, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = dflash2_selector_shapes(cfg)
    if cfg.markov_type is not None and v is not None:
        shapes.update(markov_kind(cfg.markov_type).tensor_shapes(v, r, h))
    if cfg.confidence_head:
        width = h + r if cfg.confidence_with_markov else h
        shapes.update({CONF_W: (1, width), CONF_B: (1,)})
    if cfg.draft_vocab is not None:  # the trimmed vocabulary's own head and its id map
        shapes.update({LM_HEAD: (cfg.draft_vocab, h), D2T: (cfg.draft_vocab,)})
    return shapes


class Checkpoint:
    """A validated checkpoint directory. `cfg` already reflects the heads found on disk."""

    def __init__(
        self,
        path: Path,
        cfg: DflashCfg,
        tensors: dict[str, TensorInfo],
        unknown: list[str],
        sizes: dict[Path, int] | None = None,
    ) -> None:
        self.path, self.cfg, self.tensors, self.unknown = path, cfg, tensors, unknown
        # checkpoint names read under another name (RENAMES): new name -> the file's
        self.renamed: dict[str, str] = {}
        # mask_embedding.pt's rows as float32 [rows, hidden] (cfg.mask_embedding_rows), or None
        self.mask_embedding: np.ndarray | None = None
        # file -> size when its header was read: a file that changed since is refused
        self._sizes = dict(sizes or {})
        self._handles: dict[Path, io.FileIO] = {}
        self._finalizer = weakref.finalize(self, _close_all, self._handles)

    @classmethod
    def open(cls, ckpt_dir: str | os.PathLike[str]) -> Checkpoint:
        path = checkpoint_dir(ckpt_dir)
        roots = allowed_roots(path)
        config, problem = confine(path, "config.json", roots, ".json")
        if config is None or not config.is_file():
            why = f" ({problem})" if problem else ""
            raise CheckpointError(f"{path}: no config.json (not a checkpoint directory){why}")
        cfg = DflashCfg.load(path)
        tensors, sizes = read_headers(path, roots)
        tensors, renamed = _renamed(path, tensors)
        mask_rows = _mask_embedding(path, roots, cfg)
        cfg, unknown = _validate(path, cfg, tensors, mask_rows)
        ckpt = cls(path, cfg, tensors, unknown, sizes)
        ckpt.renamed, ckpt.mask_embedding = renamed, mask_rows
        return ckpt

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

    def used_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the drafter's math reads (backbone and heads; not the embed/lm_head
        copies, except a trimmed vocabulary's own lm_head and d2t), with its shape: what
        ReferenceDraft.load reads."""
        return {**backbone_shapes(self.cfg), **head_shapes(self.cfg)}

    # -- data --------------------------------------------------------------------------------
    def read(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 as ml_dtypes.bfloat16), read through the file's one
        handle (opened on first use, checked to be the file whose header was read)."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: no tensor {jsonio.brief(name)}")
        try:
            f = self._handles.get(info.file)
            if f is None:
                f = self._handles[info.file] = open_checked(info.file, self._sizes[info.file])
            return read_entry(f, _entry_of(info))
        except (HeaderError, OSError, KeyError) as exc:
            raise CheckpointError(f"{info.file}: cannot read tensor {name!r}: {exc}") from None
        except MemoryError:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} ({info.nbytes} bytes) does not fit in host memory"
            ) from None

    def read_f32(self, name: str) -> np.ndarray:
        return np.asarray(self.read(name), dtype=np.float32)

    def read_bf16_bits(self, name: str) -> np.ndarray:
        """The tensor as raw bf16 bit patterns (uint16); f16/f32 tensors are rounded to bf16."""
        from ..formats.codec import bf16_bits_from_f32  # local: quant is only needed for this path

        a = self.read(name)
        if a.dtype == np.dtype("bfloat16"):
            return a.view(np.uint16)
        return bf16_bits_from_f32(np.asarray(a, dtype=np.float32))

    def close(self) -> None:
        """Close the file handles reads opened (reading again reopens them)."""
        _close_all(self._handles)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_all(handles: dict[Path, io.FileIO]) -> None:
    for f in handles.values():
        f.close()
    handles.clear()


def _entry_of(info: TensorInfo) -> Entry:
    return Entry(info.dtype, info.shape, info.start, info.end)


def _renamed(
    path: Path, tensors: dict[str, TensorInfo]
) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors under pydflash's names (RENAMES), and new name -> stored name; a name that
    would arrive twice is refused."""
    out: dict[str, TensorInfo] = {}
    renamed: dict[str, str] = {}
    problems = []
    for name, info in tensors.items():
        new = name
        for old, repl in RENAMES:
            if name.startswith(old):
                new = repl + name[len(old) :]
                break
        if new in out:
            first = renamed.get(new, new)
            problems.append(f"{first} and {name}: both read as {new}")
            continue
        if new != name:
            renamed[new] = name
            info = dataclasses.replace(info, name=new)
        out[new] = info
    if problems:
        raise CheckpointError(collected(path, problems))
    return out, renamed


def _mask_embedding(path: Path, roots: list[Path], cfg: DflashCfg) -> np.ndarray | None:
    """mask_embedding.pt beside config.json (vLLM / SGLang): a tensor of one row or a row per
    MASK slot, bare or as {"embedding": ..., "mask_token_id": ...}, as float32 [rows, hidden];
    None without the file."""
    from . import torch_file

    file, problem = confine(path, MASK_EMBEDDING_FILE, roots, ".pt")
    if file is None:
        if os.path.lexists(path / MASK_EMBEDDING_FILE):
            raise CheckpointError(f"{path}: {problem}")
        return None
    if not file.is_file():
        return None
    obj = torch_file.load(file)
    if isinstance(obj, dict):
        extra = set(obj) - {"embedding", "mask_token_id"}
        tid = obj.get("mask_token_id")
        if extra or "embedding" not in obj:
            raise CheckpointError(
                f"{file}: expected a tensor or {{'embedding', 'mask_token_id'}}, found keys "
                f"{sorted(map(str, obj))}"
            )
        if tid is not None and tid != cfg.mask_token_id:
            raise CheckpointError(
                f"{file}: mask_token_id {jsonio.brief(tid)} differs from the config's "
                f"{cfg.mask_token_id}"
            )
        obj = obj["embedding"]
    if not isinstance(obj, np.ndarray):
        raise CheckpointError(f"{file}: expected a tensor, found {type(obj).__name__}")
    rows = obj.reshape(1, -1) if obj.ndim == 1 else obj
    b = cfg.block_size
    if rows.ndim != 2 or rows.shape[1] != cfg.hidden or rows.shape[0] not in (1, b - 1):
        raise CheckpointError(
            f"{file}: expected [{cfg.hidden}], [1, {cfg.hidden}] or [{b - 1}, {cfg.hidden}] "
            f"(one MASK row, or one a slot), found {list(obj.shape)}"
        )
    out = np.asarray(rows, np.float32)
    if not np.isfinite(out).all():
        raise CheckpointError(f"{file}: holds a non-finite value")
    return out


def _validate(
    path: Path,
    cfg: DflashCfg,
    tensors: dict[str, TensorInfo],
    mask_rows: np.ndarray | None = None,
) -> tuple[DflashCfg, list[str]]:
    """Check shapes/dtypes, detect the optional heads, and reconcile them with the config."""
    problems: list[str] = []
    expected = backbone_shapes(cfg)

    def check(
        name: str, shape: tuple[int | None, ...], dtypes: tuple[str, ...] = ACCEPTED_DTYPES
    ) -> None:
        """Presence, shape (None: a vocabulary size no tensor or key gave) and dtype."""
        info = tensors.get(name)
        want = "[" + ", ".join("vocab" if d is None else str(d) for d in shape) + "]"
        if info is None:
            problems.append(f"{name}: missing (expected shape {want})")
        elif len(info.shape) != len(shape) or any(
            d is not None and d != f for d, f in zip(shape, info.shape)
        ):
            problems.append(f"{name}: expected shape {want}, found {list(info.shape)}")
        elif info.dtype not in dtypes:
            problems.append(
                f"{name}: dtype {info.dtype} not supported (accepted: {', '.join(dtypes)})"
            )

    for name, shape in expected.items():
        check(name, shape)
    known = set(expected)
    for name, shape in dflash2_selector_shapes(cfg).items():  # [] without a DFlash2 head
        check(name, shape)
        known.add(name)

    # Optional heads: the files say what is there; the config may only confirm it.
    h = cfg.hidden
    vocab = cfg.vocab_size
    markov_type, rank = None, 0
    if MARKOV_W1 in tensors:
        w1 = tensors[MARKOV_W1].shape
        if len(w1) == 2:
            vocab = vocab or w1[0]
            rank = w1[1]
        markov = detect_markov_kind(tensors)
        markov_type = markov.name
        check(MARKOV_W1, (vocab, rank))  # vocab may still be unknown here: not tensor_shapes
        check(MARKOV_W2, (vocab, rank))
        known |= {MARKOV_W1, MARKOV_W2}
        for name, shape in markov.extra_shapes(rank, h).items():
            check(name, shape)
            known.add(name)
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

    if cfg.draft_vocab is not None:  # a trimmed vocabulary: its own head and id map
        check(LM_HEAD, (cfg.draft_vocab, h))
        check(D2T, (cfg.draft_vocab,), D2T_DTYPES)
        known |= {LM_HEAD, D2T}
    elif D2T in tensors:
        problems.append(
            f"{D2T}: a draft-to-target id map, but config.json sets no draft_vocab_size"
        )
    for name in (EMBED, LM_HEAD):
        if name in tensors and name not in known:
            if len(tensors[name].shape) == 2:
                vocab = vocab or tensors[name].shape[0]
            check(name, (vocab, h))
            known.add(name)
    if markov_type is not None and cfg.logit_scale != 1.0:
        problems.append(
            f"{MARKOV_W1}: a Markov head beside logit_scale {cfg.logit_scale:g} (vLLM scales "
            "the Markov bias too, which this runtime does not implement)"
        )
    if markov_type is not None and cfg.draft_vocab is not None:
        problems.append(f"{MARKOV_W1}: a Markov head with a trimmed draft vocabulary")
    if cfg.dflash2 is not None:  # the selector takes their place (the config refuses both)
        if markov_type is not None:
            problems.append(f"{MARKOV_W1}: a Markov head beside the DFlash2 selector")
        if confidence:
            problems.append(f"{CONF_W}: a confidence head beside the DFlash2 selector")
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
        elif is_dflash2_tensor(name) and cfg.dflash2 is None:
            problems.append(
                f"{name}: a DFlash2 tensor, but config.json declares no DFlash2 drafter "
                "(architectures DFlash2DraftModel with dflash_config's conv_* and selector_* "
                "keys); refused rather than ignored"
            )
        else:
            problems.append(
                f"{name}: not used by this drafter's configuration, but its name "
                f"says it changes the math (refused rather than ignored)"
            )
    unknown = sorted(n for n in set(tensors) - known if not changes_the_math(n))
    if problems:
        raise CheckpointError(collected(path, problems))
    try:
        cfg = dataclasses.replace(
            cfg,
            vocab_size=vocab,
            markov_type=markov_type,
            markov_rank=rank,
            confidence_head=confidence,
            confidence_with_markov=conf_markov,
            mask_embedding_rows=0 if mask_rows is None else int(mask_rows.shape[0]),
        )
    except (TypeError, ValueError) as exc:  # pragma: no cover - replace() of a frozen dataclass
        raise ConfigError(f"{path}: {exc}") from None
    # the tensors may give sizes the config did not (vocabulary, rank): bounded the same way
    problems = bounds.cfg_problems(cfg)
    if problems:
        raise CheckpointError(collected(path, problems))
    return cfg, unknown
