"""The command-line tools facing careless arguments (issue 13): one line per problem on stderr,
then a summary line; exit status 1 for a bad checkpoint or value, 2 for a usage error; never a
traceback."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tools import load_check
from tools import make_checkpoint as mc

REPO = Path(__file__).resolve().parents[2]


def run_main(main, argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: usage errors
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.mark.parametrize("arg", ["", "   "])
def test_load_check_empty_path_is_a_usage_error(arg, capsys):
    code, out, err = run_main(load_check.main, [arg, "--cpu-only"], capsys)
    assert code == 2 and "ckpt_dir is empty" in err and not out


def test_load_check_problems_one_per_line(tmp_path, capsys):
    path = mc.make_checkpoint(tmp_path / "c", "tiny")
    raw = json.loads((path / "config.json").read_text())
    raw.update(num_hidden_layers=10**8, block_size=2**40, rms_norm_eps=0)
    (path / "config.json").write_text(json.dumps(raw))
    code, out, err = run_main(load_check.main, [str(path), "--cpu-only"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 4, err
    assert all(line.startswith("load_check: error: ") for line in lines[:3])
    assert {"num_hidden_layers", "block_size", "rms_norm_eps"} <= {
        line.split(": ")[3] for line in lines[:3]
    }
    assert lines[3] == f"load_check: {path}: INVALID (3 problem(s))"


@pytest.mark.parametrize("arg", ["/no/such/dir", "x" * 5000, "a\x00b"])
def test_load_check_bad_paths(arg, capsys):
    code, _, err = run_main(load_check.main, [arg, "--cpu-only"], capsys)
    assert code in (1, 2) and err.count("\n") <= 8


def test_load_check_valid_checkpoint(tmp_path, capsys):
    path = mc.make_checkpoint(tmp_path / "c", "tiny")
    code, out, err = run_main(load_check.main, [str(path), "--cpu-only"], capsys)
    assert code == 0 and not err and "reference" in out


def test_load_check_dflash2_on_the_cpu(tmp_path, capsys):
    """A DFlash2 checkpoint: its head described, its device memory sized per precision
    (codebooks included), the reference run; the GPU check is the GPU suite's."""
    path = mc.make_checkpoint(tmp_path / "c", "tiny-dflash2")
    code, out, err = run_main(load_check.main, [str(path), "--cpu-only"], capsys)
    assert code == 0 and not err, err
    assert "heads        dflash2 conv 2 taps in groups of 16" in out
    assert "device memory per precision" in out and "reference    forward" in out
    assert "gpu vs ref   bf16 not checked: --cpu-only" in out


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("hidden=0", "hidden must be a positive integer"),
        ("n_layer=100000000", "n_layer must be <="),
        ("target_layer_ids=[]", "target_layer_ids"),
        ("eps=-1", "eps must be a finite number"),
        ("hidden=" + "9" * 5000, "hidden must be a positive integer"),
        ("nope=1", "unknown geometry override"),
    ],
)
def test_make_checkpoint_bad_values(tmp_path, override, fragment, capsys):
    out_dir = tmp_path / "c"
    code, _, err = run_main(mc.main, [str(out_dir), "--override", override], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 2 and fragment in lines[0], err
    assert lines[1].startswith("make_checkpoint: ") and not out_dir.exists()


@pytest.mark.parametrize("argv", [[""], ["x", "--override", "novalue"], ["x", "--shards", "q"]])
def test_make_checkpoint_usage_errors(argv, capsys):
    code, _, err = run_main(mc.main, argv, capsys)
    assert code == 2 and "error" in err


def test_cli_processes_exit_cleanly(tmp_path):
    r = subprocess.run(
        [sys.executable, "tools/load_check.py", "", "--cpu-only"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = subprocess.run(
        [sys.executable, "tools/make_checkpoint.py", str(tmp_path / "c"), "--override", "hidden=0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("\n") == 2


def test_kernel_resources_reads_the_ptxas_report(capsys):
    """tools/kernel_resources.py: registers and spills of every entry point, without a GPU."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC is needed")
    from pydflash.ops import norm
    from tools import kernel_resources

    rows = kernel_resources.report("norm", "sm_90", norm.FAMILY.options)
    assert {r["name"] for r in rows} == set(norm.FAMILY.specs)
    assert all(0 < r["regs"] <= 255 and r["spill"] == (0, 0) for r in rows)
    assert kernel_resources.main(["--family", "norm", "--arch", "sm_80"]) == 0
    assert "norm.residual_rms_norm" in capsys.readouterr().out


def test_bench_round_host_profile_ranks_host_functions_by_own_time(capsys):
    """bench_round --host-profile's report (pure host, no GPU): the functions a call spends its
    host time in, by their own time, per call; the setup before each call is not counted."""
    import time

    from tools import bench_round

    def slow_part():
        time.sleep(0.002)

    def fast_part():
        return sum(range(50))

    def call():
        slow_part()
        fast_part()
        fast_part()

    setups = []
    bench_round.host_profile_calls("a call", call, 5, setup=lambda: setups.append(1), top=20)
    out = capsys.readouterr().out.splitlines()
    assert len(setups) == 5
    assert out[0].startswith("host profile of a call: ") and out[0].endswith(", 5 calls")
    assert float(out[0].split(": ")[1].split(" us")[0]) >= 2000  # the sleep, per call
    assert "time.sleep" in out[1]  # the largest own time first
    fast = next(line for line in out[1:] if "fast_part" in line)
    assert fast.split("calls")[-1].strip() == "2.0"  # calls per profiled call


def test_profile_round_summarizes_ncu_raw_csv():
    """profile_round.summarize on ncu's raw CSV (its notes, a header, a units row, a row a
    kernel, in whatever units ncu printed): per-kernel time, DRAM bytes and the ratio to those
    bytes at the bandwidth, slowest first, and the sum; hand-derived figures."""
    from tools import profile_round

    header = '"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum",'
    header += '"dram__bytes_write.sum","sm__throughput.avg.pct_of_peak_sustained_elapsed",'
    header += '"launch__grid_size"'
    text = "\n".join(
        [
            "==PROF== Connected to process 1",
            header,
            '"","","ns","Mbyte","Kbyte","%",""',
            '"0","linear_v3(float*, int)","10,500","42","0","80","132"',
            '"1","attn_combine(float*)","2,000","1","500","10","256"',
            '"2","linear_v3(float*, int)","9,500","42","0","60","132"',
        ]
    )
    lines = profile_round.summarize(text, bandwidth=4.2e12)
    linear, combine, total = lines[1].split(), lines[2].split(), lines[3].split()
    assert linear[:4] == ["linear_v3", "2", "20.0", "90.9"]
    assert float(linear[4]) == 84.0  # MB
    assert float(linear[5]) == 4200  # GB/s: 84e6 bytes in 20 us
    assert float(linear[6]) == 1.0  # at its own floor
    assert float(linear[7]) == 70.5  # time-weighted SM %: (80 x 10.5 + 60 x 9.5) / 20
    assert combine[:4] == ["attn_combine", "1", "2.0", "9.1"]
    assert float(combine[4]) == 1.5
    assert abs(float(combine[6]) - 2.0 / (1.5e6 / 4.2e12 * 1e6)) < 0.01
    assert total[:3] == ["sum", "3", "22.0"]
    assert profile_round.summarize("==PROF== nothing", 4.2e12) == ["no kernel rows in ncu's output"]


def test_profile_round_refuses_scaled_units_and_survives_zero_bytes():
    """Units other than ncu's base ones are refused by name (the table would be silently off);
    a call that moved no DRAM bytes still gets a table."""
    import pytest

    from tools import profile_round

    header = '"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum",'
    header += '"dram__bytes_write.sum","sm__throughput.avg.pct_of_peak_sustained_elapsed",'
    header += '"launch__grid_size"'
    row = '"0","k(int)","3","0","0","5","1"'
    with pytest.raises(ValueError, match="dram__bytes_read.sum: unit 'KB'"):
        profile_round.summarize("\n".join([header, '"","","ns","KB","byte","%",""', row]), 4e12)
    lines = profile_round.summarize(
        "\n".join([header, '"","","us","byte","byte","%",""', row]), 4e12
    )
    assert lines[-2].split()[:3] == ["sum", "1", "3.0"] and "inf" in lines[-2]


@pytest.mark.parametrize("preset", ["tiny", "tiny-dflash2"])
def test_sanitize_round_hands_propose_float32_tables(tmp_path, preset):
    """tools/sanitize_round.py's propose inputs: an f32 lm_head (a float64 scale once promoted
    it to float64, which propose refuses: the sanitizer runs stopped there) and a bf16 table
    holding the mask token's row (qwen3-8b's 151669 was past a 4096-row table: propose
    refused it)."""
    from pydflash import Checkpoint
    from tools import sanitize_round
    from tools.make_checkpoint import make_checkpoint

    cfg = Checkpoint.open(make_checkpoint(tmp_path / preset, preset, seed=2)).cfg
    table, lm, last = sanitize_round.draft_tables(cfg, np.random.default_rng(0))
    vocab = min(cfg.vocab_size or 4096, 4096)
    assert lm.dtype == np.float32 and table.dtype == np.uint16
    assert lm.shape == (vocab, cfg.hidden)
    assert table.shape == (max(vocab, cfg.mask_token_id + 1), cfg.hidden)
    assert 0 <= last < vocab and isinstance(last, int)
    assert 0.3 < float(lm.std()) * np.sqrt(cfg.hidden) < 3
    values = (table[:vocab].astype(np.uint32) << 16).view(np.float32)
    assert 0.2 < float(values.std()) < 1


def test_sanitize_round_table_reaches_a_mask_token_past_4096(tmp_path):
    """A mask token past the lm_head's 4096 rows (qwen3-8b's 151669) has its row in the table,
    the same values as the row it repeats."""
    import dataclasses

    from pydflash import Checkpoint
    from tools import sanitize_round
    from tools.make_checkpoint import make_checkpoint

    cfg = Checkpoint.open(make_checkpoint(tmp_path / "tiny", "tiny", seed=2)).cfg
    cfg = dataclasses.replace(cfg, vocab_size=151936, mask_token_id=151669)
    table, lm, last = sanitize_round.draft_tables(cfg, np.random.default_rng(1))
    assert table.shape == (151670, cfg.hidden) and lm.shape == (4096, cfg.hidden)
    np.testing.assert_array_equal(table[151669], table[151669 % 4096])
    assert 0 <= last < 4096


@pytest.mark.parametrize("ctx", [1, 40, 300])
def test_sanitize_round_commits_have_their_taps(ctx):
    """Each commit's rows follow the previous one from ctx on, inside the taps the run makes
    (a ctx + 3 tap array once left the last commit empty: every sanitizer run failed there)."""
    from tools import sanitize_round

    sched = sanitize_round.commit_schedule(ctx)
    assert sched[0][0] == ctx
    for (a, t), (b, _) in zip(sched, sched[1:]):
        assert b == a + t
    assert sched[-1][0] + sched[-1][1] == sanitize_round.tap_rows(ctx)
    assert [t for _, t in sched] == list(sanitize_round.COMMITS)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ctx", "9"], "--ctx must be in [10, 65536], found 9"),
        (["--parts", "round", "verify"], "invalid choice: 'verify'"),
        (["--batch-seqs", "1"], "--batch-seqs must be in [2, 64], found 1"),
        (["--batch-seqs", "65"], "--batch-seqs must be in [2, 64], found 65"),
        (["--batch-seqs", "16", "--ctx", "61"], "--ctx must exceed 61 for 16 sequences"),
        (["--batch-activations", "fp8"], "invalid choice: 'fp8'"),
    ],
)
def test_sanitize_round_refuses_a_ctx_its_batch_cannot_ingest_and_unknown_parts(
    tmp_path, capsys, argv, message
):
    """The batched part ingests ctx - 9 rows (ctx 9 left one sequence empty); --parts names
    one of the checked calls. Both refused before a device is touched."""
    from tools import sanitize_round

    with pytest.raises(SystemExit) as exc:
        sanitize_round.main(["--ckpt", str(tmp_path), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_gpu_suite_sanitize_jobs_name_existing_parts_and_precisions():
    """Every sanitize job line of tools/gpu_suite.sh passes sanitize_round arguments it accepts
    (a part or precision misspelt there would fail only on the device)."""
    import re

    from pydflash.draft.weights import PRECISIONS
    from tools import sanitize_round

    text = (Path(__file__).resolve().parents[2] / "tools" / "gpu_suite.sh").read_text()
    block = text[text.index('if [ "$PART" = sanitize ]') :]
    block = block[: block.index("\nfi\n")]
    parts = re.findall(r"for part in ([^;]+);", block)
    precs = re.findall(r"for prec in ([^;]+);", block)
    precs += re.findall(r"--precision ([a-z0-9_ ]+?)(?:\"| --)", block)
    assert parts and precs
    assert set(" ".join(parts).split()) == set(sanitize_round.PARTS)
    named = set(" ".join(precs).split()) - {"$prec"}
    assert named and named <= set(PRECISIONS), named


def test_bench_round_refuses_row_major_with_batch(capsys):
    """--row-major pairs single-round rows; with --batch there are none: refused, not ignored."""
    from tools import bench_round

    with pytest.raises(SystemExit) as exc:
        bench_round.main(["--ckpt", "x", "--row-major", "--batch", "4"])
    assert exc.value.code == 2
    assert "--row-major times single rounds: not with --batch" in capsys.readouterr().err


def test_sanitize_round_batch_offsets_keep_the_three_sequence_part_and_grow_by_four():
    """The batched part's sequences hold ctx - offset rows: 0, 5, 9 as the three-sequence part
    always did, then 4 fewer each (distinct lens, every one ragged against the others)."""
    from tools import sanitize_round

    assert sanitize_round.batch_offsets(2) == [0, 5]
    assert sanitize_round.batch_offsets(3) == [0, 5, 9]
    sixteen = sanitize_round.batch_offsets(16)
    assert len(sixteen) == 16 and sixteen[:3] == [0, 5, 9] and sixteen[-1] == 61
    assert all(b - a == 4 for a, b in zip(sixteen[2:], sixteen[3:]))
