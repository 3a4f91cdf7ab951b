"""pydflash.device.pdl on the CPU: the ctypes mirrors of CUlaunchConfig / CUlaunchAttribute have
the C layout of cuda.h (x86-64), launch arguments land in the parameter buffer as the C values of
their types (every kernel spec), and only sm_90 devices take the PDL path."""

import ctypes
import struct

import numpy as np

from pydflash import ops
from pydflash.device import pdl


def test_launch_attribute_layout_matches_cuda_h():
    # struct CUlaunchAttribute { CUlaunchAttributeID id; char pad[8 - sizeof(id)];
    #                            CUlaunchAttributeValue value; /* union, 64 bytes */ }
    assert ctypes.sizeof(pdl._Attr) == 72
    assert pdl._Attr.value.offset == 8


def test_launch_config_layout_matches_cuda_h():
    # 7 unsigned ints, then CUstream, CUlaunchAttribute*, unsigned numAttrs
    offsets = {name: getattr(pdl._Config, name).offset for name, _ in pdl._Config._fields_}
    assert [offsets[f"{a}Dim{x}"] for a in ("grid", "block") for x in "XYZ"] == [
        0,
        4,
        8,
        12,
        16,
        20,
    ]
    assert offsets["sharedMemBytes"] == 24
    assert offsets["hStream"] == 32 and offsets["attrs"] == 40 and offsets["numAttrs"] == 48
    assert ctypes.sizeof(pdl._Config) == 56


class FakeArray:  # what the spec casts hand over for device arrays: .data.ptr
    def __init__(self, ptr: int) -> None:
        self.data = type("Data", (), {"ptr": ptr})()


def _read_back(block: pdl.ParamBlock, codes, args) -> list[bytes]:
    """Each argument's bytes as the driver reads them: kernelParams[i] points at sizeof(i)."""
    buf, table = block.pack(args)
    n = len(codes)
    pointers = struct.unpack(f"<{n}Q", ctypes.string_at(table, 8 * n))
    out = [ctypes.string_at(p, struct.calcsize(c)) for p, c in zip(pointers, codes, strict=True)]
    for p, c in zip(pointers, codes, strict=True):  # natural alignment (a struct's at 64)
        assert p % (64 if c.endswith("s") else struct.calcsize(c)) == 0
        assert ctypes.addressof(buf) <= p < ctypes.addressof(buf) + ctypes.sizeof(buf)
    return out


def test_param_block_gives_each_argument_its_c_bytes():
    codes = ("Q", "i", "q", "Q", "f", "I", "128s", "i", "Q")
    struct_bytes = bytes(range(128))
    args = (
        FakeArray(0xDEAD0000),
        np.int32(-7),
        np.int64(1 << 40),
        np.uintp(0),  # a null pointer
        np.float32(0.1),
        np.uint32(0xFFFFFFFF),
        struct_bytes,  # a tensor map by value
        np.int32(2**31 - 1),
        FakeArray(0x7F00_0000_1234),
    )
    got = _read_back(pdl.ParamBlock(codes), codes, args)
    assert got == [
        struct.pack("<Q", 0xDEAD0000),
        struct.pack("<i", -7),
        struct.pack("<q", 1 << 40),
        struct.pack("<Q", 0),
        np.float32(0.1).tobytes(),  # the float32 bits, not a double's rounding
        struct.pack("<I", 0xFFFFFFFF),
        struct_bytes,
        struct.pack("<i", 2**31 - 1),
        struct.pack("<Q", 0x7F00_0000_1234),
    ]


def test_every_kernel_spec_packs_its_cast_arguments():
    """Every kernel of every family: random arguments through the spec's casts and its
    ParamBlock come back as the C values of their parameter types."""
    rng = np.random.default_rng(7)
    seen: set[str] = set()
    for fam in ops.FAMILIES:
        for spec in fam.specs.values():
            values, want = {}, []
            for p in spec.params:
                if p.is_struct:
                    size = int(p.struct_code[:-1])  # "128s"
                    values[p.name] = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
                    want.append(values[p.name])
                elif p.is_pointer:
                    ptr = int(rng.integers(1, 2**47)) & ~0xF
                    null = rng.random() < 0.2
                    values[p.name] = None if null else FakeArray(ptr)
                    want.append(struct.pack("<Q", 0 if null else ptr))
                elif p.ctype == "float":
                    values[p.name] = float(rng.standard_normal())
                    want.append(np.float32(values[p.name]).tobytes())
                else:
                    code = p.struct_code
                    lo, hi = (0, 2**32) if code == "I" else (-(2**31), 2**31)
                    values[p.name] = int(rng.integers(lo, hi))
                    want.append(struct.pack("<" + code, values[p.name]))
            codes = [p.struct_code for p in spec.params]
            got = _read_back(spec.param_block, codes, spec.args(values))
            assert got == want, spec.name
            seen.update(codes)
    assert {"Q", "q", "i", "I", "f", "128s"} <= seen  # every parameter kind was packed


def test_only_sm90_launches_with_pdl():
    from pydflash.device.caps import Caps

    for arch in ("sm_80", "sm_89", "sm_120", "sm_100"):  # no griddepcontrol / not measured
        assert not Caps.synthetic(arch).pdl, arch
    assert Caps.synthetic("sm_90").pdl
    assert not pdl.PdlLauncher(load=False, programmatic=False).available
    assert not pdl.PdlLauncher(load=False, programmatic=True).loaded  # nothing loaded
    assert pdl._ATTR_PROGRAMMATIC_STREAM_SERIALIZATION == 6  # cuda.h CUlaunchAttributeID
