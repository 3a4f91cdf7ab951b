"""The checkpoint check (pydflash.check: the `pydflash-check` command, `python -m pydflash`,
tools/load_check.py from a checkout): it runs from an installed wheel, outside the checkout;
its figures follow --seed; the checkpoint is opened once; every precision it could not check
gets a line saying why."""

import os
import re
import shutil
import site
import subprocess
import sys
import types
from pathlib import Path

import pytest

from pydflash import Checkpoint, check, synthetic
from pydflash.errors import (
    DeviceMemoryError,
    GeometryError,
    KernelCompileError,
    UnsupportedDeviceError,
)
from tools import make_checkpoint as mc

REPO = Path(__file__).resolve().parents[2]


def run_main(argv, capsys, **kwargs):
    try:
        code = check.main(argv, **kwargs)
    except SystemExit as exc:  # argparse: usage errors, --version
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def dependency_folders() -> list[str]:
    """The import roots of the wheel's dependencies in this interpreter, never the checkout."""
    import ml_dtypes
    import numpy
    import safetensors

    roots = {str(Path(m.__file__).resolve().parents[1]) for m in (ml_dtypes, numpy, safetensors)}
    return sorted(r for r in roots if Path(r) != REPO)


def test_wheel_runs_the_check_outside_the_checkout(tmp_path):
    """The wheel, installed in a fresh venv (numpy, safetensors, ml_dtypes from this machine),
    checks its own synthetic checkpoint from a folder outside the checkout, with the installed
    package (not /work/main's)."""
    src = tmp_path / "src"  # a private copy: no race with another build in the checkout
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy2(REPO / name, src / name)
    for folder in ("pydflash", "cuda_src"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        # packages installed with --user (ml_dtypes on some machines) stay visible
        "PYTHONUSERBASE": site.getuserbase(),
        # and so do the folders this interpreter finds the dependencies in (a machine may
        # provide them through PYTHONPATH, which the venv does not inherit)
        "PYTHONPATH": os.pathsep.join(dependency_folders()),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_CACHE_DIR": "1",
    }

    def run(*cmd, cwd=tmp_path):
        r = subprocess.run(
            [str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
        )
        assert r.returncode == 0, f"{cmd}:\n{r.stdout}\n{r.stderr}"
        return r

    pip_wheel = ("-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q")
    run(sys.executable, *pip_wheel, "-w", tmp_path / "dist", src)
    wheel = next((tmp_path / "dist").glob("pydflash-*.whl"))
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv)
    py = venv / "bin" / "python"
    run(py, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel)

    work = tmp_path / "work"
    work.mkdir()
    out = run(venv / "bin" / "pydflash-check", "--cpu-only", cwd=work).stdout
    assert "reference    forward ctx 16: out [8, 64]" in out, out
    assert "gpu vs ref   bf16 not checked: --cpu-only" in out
    where = Path(re.search(r"^pydflash +\S+ at (.+); seed 0$", out, re.M).group(1))
    assert where.is_relative_to(venv) and not where.is_relative_to(REPO), where
    version = run(py, "-m", "pydflash", "--version", cwd=work).stdout
    assert str(venv) in version and str(REPO / "pydflash") not in version


@pytest.mark.parametrize("seed", [0, 7])
def test_packaged_tiny_is_make_checkpoint_tiny_byte_for_byte(tmp_path, seed):
    ours = synthetic.make_checkpoint(tmp_path / "a", "tiny", seed)
    theirs = mc.make_checkpoint(tmp_path / "b", "tiny", seed=seed)
    # the checkpoint's files (the tool may keep its own bookkeeping beside them)
    assert sorted(p.name for p in ours.iterdir()) == ["config.json", "model.safetensors"]
    for name in ("config.json", "model.safetensors"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


def test_installed_presets_say_where_the_others_are(capsys):
    code, out, err = run_main(["--preset", "medium", "--cpu-only"], capsys)
    assert code == 2 and not out and "need a source checkout" in err


def reference_line(out: str) -> str:
    line = next(x for x in out.splitlines() if x.startswith("reference    forward"))
    return re.sub(r"\(\d+\.\d+ s\)", "", line)  # the time taken varies


def test_figures_follow_the_seed(capsys):
    runs = {}
    for seed in ("1", "1", "2"):
        code, out, err = run_main(["--cpu-only", "--seed", seed], capsys)
        assert code == 0 and not err, err
        assert f"; seed {seed}" in out.splitlines()[0]
        runs.setdefault(seed, []).append(reference_line(out))
    assert runs["1"][0] == runs["1"][1] and runs["1"][0] != runs["2"][0]
    code, _, err = run_main(["--seed", "-1"], capsys)
    assert code == 2 and "--seed must be a non-negative integer" in err


def test_the_checkpoint_is_opened_once(tmp_path, capsys, monkeypatch):
    opened = []
    real = Checkpoint.open.__func__

    def counting(cls, ckpt_dir):
        opened.append(ckpt_dir)
        return real(cls, ckpt_dir)

    monkeypatch.setattr(Checkpoint, "open", classmethod(counting))
    path = synthetic.make_checkpoint(tmp_path / "c")
    for argv in ([str(path), "--cpu-only"], ["--cpu-only"], [str(path)]):
        opened.clear()
        code, out, err = run_main(argv, capsys)
        assert code == 0 and not err, err
        # the reference runs on the CPU, or inside the GPU check where a device is here
        assert "reference    forward" in out or "gpu vs ref   bf16" in out, out
        assert len(opened) == 1, opened


def test_no_device_says_so_per_precision(capsys, monkeypatch):
    monkeypatch.setattr(check, "cuda_available", lambda: False)
    code, out, err = run_main(["--precision", "bf16", "q4_0", "bf16"], capsys)
    assert code == 0 and not err, err
    assert "gpu          no CUDA device (or CuPy) here: CPU checks only" in out
    lines = [x for x in out.splitlines() if x.startswith("gpu vs ref")]
    assert lines == [
        "gpu vs ref   bf16 not checked: no CUDA device (or CuPy) here",
        "gpu vs ref   q4_0 not checked: no CUDA device (or CuPy) here",
    ]


class FakeEngine:
    name, arch = "Fake GPU", "sm_75"

    def __init__(self, ordinal):
        pass


@pytest.fixture
def fake_gpu(monkeypatch):
    """A machine whose device answers: CuPy's pool and the Engine faked (no GPU here); the
    per-precision check (_gpu_check) is what each test sets."""
    from pydflash.device import engine

    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setitem(
        sys.modules, "cupy", types.SimpleNamespace(get_default_memory_pool=lambda: pool)
    )
    monkeypatch.setattr(engine, "Engine", FakeEngine)
    monkeypatch.setattr(check, "cuda_available", lambda: True)


def test_a_precision_the_device_lacks_is_said_so(fake_gpu, capsys, monkeypatch):
    """The device's limits are not the checkpoint's fault: a line for that precision, the
    others checked, exit status 0; a drafter that differs still fails."""
    lacks = {
        "q4_0": UnsupportedDeviceError("gemm_quant: needs wgmma and tensor maps (sm_75)"),
        "f32": DeviceMemoryError("1.00 GiB needed, 0.50 GiB free on Fake GPU"),
        "mixed": GeometryError("head_dim 16: attention needs 200 KiB of shared memory"),
    }
    seen = []

    def fake_gpu_check(e, ckpt, precision, ctx, rng):
        seen.append(precision)
        if precision in lacks:
            raise lacks[precision]
        print(f"gpu vs ref   {precision} OK")
        return precision != "q8_0"

    monkeypatch.setattr(check, "_gpu_check", fake_gpu_check)
    argv = ["--precision", "bf16", "q4_0", "f32", "mixed"]
    code, out, err = run_main(argv, capsys)
    assert code == 0 and not err, err
    assert seen == ["bf16", "q4_0", "f32", "mixed"]
    assert "gpu vs ref   bf16 OK" in out
    assert "gpu vs ref   q4_0 not checked: Fake GPU (sm_75) cannot run it: gemm_quant" in out
    assert "gpu vs ref   f32 not checked: Fake GPU (sm_75) cannot run it: 1.00 GiB" in out
    assert "gpu vs ref   mixed not checked: Fake GPU (sm_75) cannot run it: head_dim 16" in out
    assert "reference    forward" not in out  # the GPU check held the reference
    code, out, err = run_main(["--precision", "q8_0", "q4_0"], capsys)
    assert code == 1 and "FAILED at q8_0" in err and "q4_0 not checked" in out
    code, out, err = run_main(["--precision", "q4_0", "f32"], capsys)  # none ran on the device
    assert code == 0 and not err and "reference    forward ctx 16" in out, err


def test_a_compile_error_is_not_a_missing_capability(fake_gpu, capsys, monkeypatch):
    def broken(*args):
        raise KernelCompileError("linear.cu: error: expected ';'")

    monkeypatch.setattr(check, "_gpu_check", broken)
    code, out, err = run_main([], capsys)
    assert code == 1 and "linear.cu: error" in err and "not checked" not in out
