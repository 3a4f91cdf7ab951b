"""RoundBuffers' shapes on the CPU (host stand-ins for the layer's weights and split factors):
a batched pool whose gate_up takes quant_bf16act (the default policy past 64 rows; the pool's
PoolRounds decides) holds gate_up's product in a buffer of its own; nothing else changes."""

import types

from pydflash import DflashCfg
from pydflash.draft import buffers
from tests.model.test_bounds import base

CFG = DflashCfg.from_dict(base())  # the small geometry the bounds tests use


def layer():
    w = lambda n: types.SimpleNamespace(out_features=n)  # noqa: E731 - a weight's width
    return types.SimpleNamespace(
        qkv=w(CFG.q_dim + 2 * CFG.kv_dim), gate_up=w(2 * CFG.n_ff), attn_conv=None
    )


def ks(**kw):
    base = dict(ks_qkv=1, ks_kv=1, ks_o=1, ks_down=1, ks_conv_attn=0, ks_conv_mlp=0)
    return types.SimpleNamespace(**(base | kw))


def test_gate_up_on_quant_bf16act_has_its_own_buffer():
    m = 4 * CFG.block_size
    plain = buffers._shapes(CFG, layer(), 4, ks())
    assert plain["qkv_part"][0] == plain["x_part"][0] == 1 and "ff_part" not in plain
    split = buffers._shapes(CFG, layer(), 4, ks(), ff_split=True)
    assert split["ff_part"] == (m, 2 * CFG.n_ff)  # one partial: the tile's one launch
    # the decode plan's own splits are kept
    more = buffers._shapes(CFG, layer(), 4, ks(ks_qkv=3, ks_down=4))
    assert more["qkv_part"][0] == 3 and more["x_part"][0] == 4
    assert "ff_part" not in more  # gate_up on the decode linear: no buffer of its own
    # every other buffer is the same
    assert {k: v for k, v in split.items() if k != "ff_part"} == plain
