"""The candidate selector's host-side plans: the top-K passes' chunking for the public
vocabularies and its limits, the codebooks' placement argument and what it saves."""

import dataclasses

import pytest

from pydflash.draft.weights import PRECISIONS, precision_bytes
from pydflash.errors import ArgumentError
from pydflash.heads.selector import check_codebooks
from pydflash.model.config import DflashCfg
from pydflash.ops import selector
from tools.make_checkpoint import checkpoint_plan


@pytest.mark.parametrize("vocab, top_k", [(248320, 16), (202048, 16), (512, 4), (10**6, 16)])
def test_chunks_cover_the_vocabulary_within_shared_memory(vocab, top_k):
    chunk, chunks = selector.chunking(vocab, top_k)
    assert (
        chunk >= max(selector.MIN_CHUNK, top_k) and (chunks - 1) * chunk < vocab <= chunks * chunk
    )
    assert 8 * chunk <= 48 * 1024 and 8 * chunks * top_k <= 48 * 1024


def test_chunking_refuses_what_does_not_fit():
    assert selector.chunking(248320, 512) is None
    assert selector.chunking(6144 * 6144 // 16 + 10**5, 16) is None


def test_codebooks_argument():
    assert check_codebooks("host") == "host"
    for bad in ("disk", None, 0):
        with pytest.raises(ArgumentError, match="codebooks must be one of"):
            check_codebooks(bad)


@pytest.mark.parametrize("preset", ["qwen3.8-27b-dflash2", "muse-glimmer-30b-dflash2"])
def test_device_bytes_count_the_convs_and_codebooks(preset):
    cfg = DflashCfg.from_dict(checkpoint_plan(preset)[0])
    d2 = cfg.dflash2
    width = 2 * d2.conv_kernel_size * cfg.hidden // d2.conv_group_size
    for p in PRECISIONS:
        dev, per_round = precision_bytes(cfg, p)
        host, per_round_host = precision_bytes(cfg, p, "host")
        assert (
            dev - host == 2 * 2 * cfg.vocab_size * d2.selector_rank and per_round == per_round_host
        )
    # bf16: the round reads the two convs' projections of every layer beside its linears
    plain = precision_bytes(dataclasses.replace(cfg, dflash2=None), "bf16")[1]
    assert precision_bytes(cfg, "bf16")[1] - plain == cfg.n_layer * 2 * 2 * width * cfg.hidden
