"""The Caps record: what each known generation enables, and a new one running the generic
paths until its row says otherwise."""

from pydflash.device.caps import ARCHS, Caps


def test_known_generations():
    h200 = Caps.synthetic("sm_90")
    assert h200.wgmma and h200.tma and h200.pdl and h200.known
    assert h200.arch_target == "sm_90a" and h200.smem_per_block == 227 * 1024
    for arch in ("sm_80", "sm_89", "sm_120"):
        c = Caps.synthetic(arch)
        assert c.known and not (c.wgmma or c.tma or c.pdl), arch
    assert Caps.synthetic("sm_80").smem_per_block == 163 * 1024


def test_tma_needs_the_driver_too():
    assert not Caps.synthetic("sm_90", tensor_maps=False).tma
    assert Caps.synthetic("sm_90", tensor_maps=False).wgmma


def test_an_unknown_generation_takes_the_generic_paths():
    c = Caps.of(10, 0, "a new one", 148, 227 * 1024, 228 * 1024, tensor_maps=True)
    assert c.arch == "sm_100" and not c.known
    assert not (c.wgmma or c.tma or c.pdl)
    assert "sm_100" not in ARCHS
