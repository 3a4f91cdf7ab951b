"""tools/soak.py on the device, short: the churn soak's spot checks pass and its pool keeps the
plan's bookkeeping through adds, removals, roll-backs and restarts; both modes print their
summary (skipped without a CUDA device). Round time is not judged here: 300 rounds are too
few for it (tools/gpu_suite.sh checks runs the 100,000)."""

import pytest

from pydflash.testing import TOLERANCE
from tools import soak

pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")


@pytest.mark.parametrize(
    "preset, precision", [("tiny", "bf16"), ("tiny-swa", "bf16"), ("tiny-dspark", "q4_0")]
)
def test_churn_soak_short(engine, preset_checkpoint, preset, precision):
    from pydflash import DflashDraft

    path = preset_checkpoint(preset)
    args = soak.parse_args(
        ["--churn", "--ckpt", str(path), "--precision", precision, "--rounds", "300"]
        + ["--slots", "8", "--cap", "64", "--check-every", "50", "--window", "30"]
    )
    d = DflashDraft.load(engine, path, precision, progress=None)
    lines: list[str] = []
    report = soak.run_churn(engine, d, args, lines.append)
    assert report.failed == [], report.failed
    assert report.checks == 6 and report.worst < TOLERANCE[precision]
    assert sum(" == single round" in line for line in lines if line.startswith("check")) == 6
    assert len(report.windows) == 10
    ev = report.events
    assert ev["restarts"] and ev["removed"] > ev["restarts"] and ev["commit roll-backs"]
    first, last = (soak.figures(rows) for rows in soak.ends(report.windows))
    assert soak.not_flat(first, last, soak.CHURN_MEMORY_SLACK_MIB, slower=1e9) == []


def test_both_modes_print_their_summary(engine, preset_checkpoint, capsys):
    path = str(preset_checkpoint("tiny"))
    code = soak.main(["--ckpt", path, "--rounds", "200", "--window", "100"])
    out = capsys.readouterr().out
    summary = [line for line in out.splitlines() if line.startswith("soak: memory")]
    assert code in (0, 1) and len(summary) == 1 and "per iteration" in summary[0]
    code = soak.main(
        ["--churn", "--ckpt", path, "--rounds", "200", "--check-every", "100", "--cap", "64"]
    )
    out = capsys.readouterr().out
    summary = [line for line in out.splitlines() if line.startswith("soak churn: memory")]
    assert len(summary) == 1 and "2 spot checks" in summary[0], out
    reasons = summary[0].partition(": FAIL (")[2].rstrip(")")
    # a short run may judge its time unlucky; nothing else may fail
    assert all("slower" in r for r in reasons.split("; ") if r), summary[0]
    assert code == (1 if reasons else 0)
    assert any(line.startswith("soak churn: events") for line in out.splitlines())
