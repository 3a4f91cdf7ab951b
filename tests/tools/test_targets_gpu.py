"""The target-model examples on the GPU: a transformers Qwen3 target
(examples/transformers_target.py) and a hand-written JAX decoder (examples/jax_target.py),
each beside a pydflash drafter. Greedy decoding emits exactly the target's own greedy tokens;
the GPU drafter drafts what the NumPy reference drafts (precision f32); sampled decoding
emits the target's distribution. Skipped without CuPy and a CUDA device, without torch and
transformers (their tests), without JAX (its tests)."""

import contextlib
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

# before JAX starts: XLA would take most of the GPU's memory up front
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")
ROOT = Path(__file__).resolve().parents[2]
N_TOKENS = 256
# a GPU draft may differ from the reference's only where the reference's choice was a near
# tie: its top-1 - top-2 score gap below this (the f32 drafters agree to ~1e-5 relative)
NEAR_TIE = 1e-3


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summary(out) -> str:
    hist = np.bincount(out["accepted"], minlength=8).tolist()
    return (
        f"{len(out['tokens'])} tokens in {out['rounds']} rounds, {sum(out['accepted'])} drafts "
        f"accepted; rounds by drafts accepted {hist}"
    )


def first_difference(gpu, ref):
    """The first round where the GPU loop's drafts or acceptance differ from the reference
    loop's, with the slots that differ; None when every round agrees."""
    for r, (a, b) in enumerate(zip(gpu["drafts"], ref["drafts"])):
        if a != b or gpu["accepted"][r] != ref["accepted"][r]:
            return r, [j for j, (x, y) in enumerate(zip(a, b)) if x != y]
    return None


def assert_same_rounds(gpu, ref):
    """Every round equal; a difference is allowed only at a draft whose reference choice was a
    near tie (the loops then part ways, so the rounds after it are not compared)."""
    diff = first_difference(gpu, ref)
    if diff is None:
        assert gpu["rounds"] == ref["rounds"]
        return
    r, slots = diff
    margins = ref["margins"][r]
    msg = (
        f"round {r} of {gpu['rounds']}: GPU drafts {gpu['drafts'][r]} accepted "
        f"{gpu['accepted'][r]}, reference {ref['drafts'][r]} accepted {ref['accepted'][r]}, "
        f"reference margins {margins}"
    )
    assert slots and all(margins[j] < NEAR_TIE for j in slots), msg
    print(f"near tie, compared up to it: {msg}")


# -- transformers -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf(engine):
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    pytest.importorskip("transformers", reason="transformers is not installed here")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    ex = load_example("transformers_target")
    return torch, ex, ex.make_target(0, "cuda")


@pytest.mark.parametrize(
    "stream, precision, side",
    [("torch", "bf16", False), ("torch", "f32", True), ("own", "bf16", False)],
    ids=["torch-stream-bf16", "torch-side-stream-f32", "own-stream-bf16"],
)
def test_transformers_greedy_is_lossless(hf, stream, precision, side):
    """256 greedy tokens equal the target's own greedy loop, with pydflash on torch's current
    stream (the default one, or a side stream torch runs on) or on its own."""
    torch, ex, model = hf
    where = torch.cuda.stream(torch.cuda.Stream()) if side else contextlib.nullcontext()
    with where:
        out = ex.run(N_TOKENS, precision=precision, stream=stream, model=model)
        if stream == "torch":
            assert out["engine"].stream.ptr == torch.cuda.current_stream().cuda_stream
        want = ex.greedy(model, out["prompt"], N_TOKENS)
    print(f"transformers {stream} {precision}: {summary(out)}")
    assert out["tokens"] == want, summary(out)


def test_transformers_gpu_drafts_equal_the_reference(hf):
    """At precision f32 the GPU loop drafts and accepts what the NumPy reference loop does,
    round for round, fed the same target."""
    _, ex, model = hf
    gpu = ex.run(N_TOKENS, precision="f32", model=model)
    ref = ex.run(N_TOKENS, drafter="reference", precision="f32", model=model)
    print(f"transformers GPU: {summary(gpu)}; reference: {summary(ref)}")
    assert gpu["tokens"] == ref["tokens"]
    assert_same_rounds(gpu, ref)


# -- JAX ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def jx(engine):
    jax = pytest.importorskip("jax", reason="JAX is not installed here")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU device here (a CPU-only jaxlib)")
    return load_example("jax_target")


def test_jax_greedy_is_lossless(jx):
    out = jx.run(N_TOKENS)
    want = jx.greedy(out["target"], out["prompt"], N_TOKENS)
    print(f"jax greedy: {summary(out)}")
    assert out["tokens"] == want, summary(out)


def test_jax_sampled_loop_equals_the_reference(jx):
    """At T = 1 (speculative sampling, the same Philox seeds) the GPU loop emits, drafts and
    accepts what the NumPy reference and verification oracle do."""
    gpu = jx.run(N_TOKENS, temperature=1.0)
    ref = jx.run(N_TOKENS, temperature=1.0, drafter="reference", target=gpu["target"])
    print(f"jax T=1 GPU: {summary(gpu)}; reference: {summary(ref)}")
    assert sum(gpu["accepted"]) > 0, summary(gpu)  # multi-row commits were exercised
    if first_difference(gpu, ref) is None:
        assert gpu["tokens"] == ref["tokens"]
    assert_same_rounds(gpu, ref)


def test_jax_first_token_follows_the_target(jx):
    """Speculative sampling's first emitted token is distributed as the target's next-token
    distribution (chi-square, one false alarm in 10,000), not as the drafter's."""
    f = jx.first_token_counts(4000, temperature=1.0, vocab=64)
    stat, dof = jx.chi_square(f["counts"], f["expected"])
    bound = jx.chi_square_bound(dof)
    msg = (
        f"chi-square {stat:.1f} on {dof} dof (bound {bound:.1f}); first draft accepted in "
        f"{f['first_accepted']:.1%} of the rounds"
    )
    print(msg)
    assert stat < bound, msg
    # the test can tell: the drafter's own distribution of that token is far from the target's
    tv = 0.5 * np.abs(f["q0"] - f["expected"]).sum()
    if tv > 0.2:
        stat_q, dof_q = jx.chi_square(f["counts"], f["q0"])
        assert stat_q > jx.chi_square_bound(dof_q), f"{msg}; against q: {stat_q:.1f}"
