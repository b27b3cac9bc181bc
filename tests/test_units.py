"""Single-process tests of the pieces the algorithms are built from."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tplab
from tplab.toolkit.blocks import block_bounds, block_counts
from tplab.collectives import auto
from tplab.collectives.fold import PowerOfTwoFold
from tplab.toolkit.ops import OPS, get_op


@given(count=st.integers(0, 10_000), parts=st.integers(1, 64))
def test_blocks_cut_like_array_split(count, parts):
    expected = [len(b) for b in np.array_split(np.arange(count), parts)]
    assert block_counts(count, parts) == expected
    bounds = block_bounds(count, parts)
    assert bounds[0] == 0 and bounds[-1] == count and len(bounds) == parts + 1


@given(p=st.integers(1, 200))
def test_fold_maps_every_rank_once(p):
    """The folded ranks form a power of two; every real rank is represented by exactly one new rank,
    and the ranges of real ranks are contiguous and in order (so element ranges stay contiguous)."""
    folds = [PowerOfTwoFold(p, r) for r in range(p)]
    pof2 = folds[0].pof2
    assert pof2 <= p < 2 * pof2
    active = [f for f in folds if not f.sits_out]
    assert sorted(f.newrank for f in active) == list(range(pof2))
    for f in active:
        assert f.real_rank(f.newrank) == f.rank
    covered = [r for n in range(pof2) for r in folds[0].real_ranks_of(n)]
    assert covered == list(range(p))
    assert sum(f.sits_out for f in folds) == p - pof2


def test_auto_follows_mpich_rules():
    assert auto.choose("allreduce", 8, 1, 4) == "recursive_doubling"
    assert auto.choose("allreduce", 2048, 512, 4) == "recursive_doubling"
    assert auto.choose("allreduce", 4096, 1024, 4) == "rabenseifner"
    assert auto.choose("allreduce", 1 << 20, 3, 8) == "recursive_doubling"  # fewer elements than pof2
    assert auto.choose("reduce_scatter", 1 << 20, 1 << 18, 4) == "ring"
    assert auto.choose("allgather", 1024, 256, 4) == "recursive_doubling"
    assert auto.choose("broadcast", 1024, 256, 4) == "binomial"


def test_every_collective_lists_builtin_and_auto():
    assert set(tplab.ALGORITHMS) == {"allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"}
    for names in tplab.ALGORITHMS.values():
        assert "builtin" in names and "auto" in names
    assert set(tplab.ALGORITHMS["allreduce"]) >= {"naive", "ring", "recursive_doubling", "rabenseifner", "tree"}


def test_ops():
    a, b = np.array([1.0, 5.0]), np.array([3.0, 2.0])
    assert get_op("sum").combine(a, b, out=np.empty(2)).tolist() == [4, 7]
    assert get_op("max").combine(a, b, out=np.empty(2)).tolist() == [3, 5]
    assert get_op("min").reduce_many([a, b]).tolist() == [1, 2]
    assert get_op("prod").reduce_many([a, b]).tolist() == [3, 10]
    assert set(OPS) == {"sum", "prod", "max", "min"}
    with pytest.raises(ValueError, match="unknown reduction op 'mean'"):
        get_op("mean")


def test_peer_memory_kernels_ship_with_the_package():
    from importlib.resources import files

    from tplab.gpu_collectives.peer_kernels import KERNEL_FILES, kernel_source

    folder = files("tplab.gpu_collectives").joinpath("kernels")
    assert all(folder.joinpath(name).is_file() for name in KERNEL_FILES)
    source = kernel_source()
    for kernel in ["one_shot", "one_shot_ll", "one_shot_lamport", "two_shot_lamport", "two_shot", "ring", "allgather",
                   "flag_barrier", "sum_slots"]:
        assert f" {kernel}(" in source


def test_peer_memory_auto_table_picks_by_size():
    """"auto" on GPUs: the one-shots for small messages, the two-shots in between, the ring for large ones (the
    table measured on 4x H100 and H200); a table from PeerMemory.tune() replaces it. No GPU needed for the lookup."""
    from types import SimpleNamespace

    from tplab.gpu_collectives.peer_memory import DEFAULT_TABLE, TABLE_FOR_RANKS, PeerMemory

    pm = SimpleNamespace(table=list(DEFAULT_TABLE), limit=lambda algorithm: 1 << 62)
    assert [PeerMemory.choose(pm, n) for n in (1024, 512 << 10, 1 << 20, 2 << 20, (2 << 20) + 16, 16 << 20,
                                               256 << 20)] \
        == ["one_shot_lamport", "one_shot_lamport", "two_shot_lamport", "two_shot_lamport", "two_shot", "two_shot",
            "ring"]
    assert PeerMemory.choose(pm, 1 << 20, "int") == "two_shot"   # (two_shot_lamport's sentinel: floats only)
    pm.limit = lambda algorithm: 256 << 10 if algorithm == "one_shot_ll" else 1 << 62
    assert [PeerMemory.choose(pm, n, "int") for n in (1024, 256 << 10, (256 << 10) + 16)] \
        == ["one_shot_ll", "one_shot_ll", "two_shot"]   # (integers: one_shot_ll to its limit)
    pm.limit = lambda algorithm: 1 << 62
    pm.table = [(4096, "ring"), (1 << 20, "two_shot")]
    assert [PeerMemory.choose(pm, n) for n in (16, 4097, 1 << 30)] == ["ring", "two_shot", "two_shot"]
    pm.table = list(TABLE_FOR_RANKS[2])  # two ranks: the one-shots longer
    assert [PeerMemory.choose(pm, n) for n in (1 << 20, 4 << 20, (4 << 20) + 16)] == \
        ["one_shot_lamport", "one_shot", "two_shot"]
    pm.limit = lambda algorithm: 2048 if algorithm.startswith("one_shot") else 1 << 62  # small one-shot areas
    assert [PeerMemory.choose(pm, n) for n in (2048, 4096)] == ["one_shot_lamport", "two_shot"]
    pm.table = [(1 << 20, "one_shot")]
    assert PeerMemory.choose(pm, 1 << 21) == "two_shot"  # past the table, and past the one-shot's area
    pm.table = [(1 << 20, "one_shot_lamport"), (1 << 62, "two_shot")]
    pm.limit = lambda algorithm: 256 << 10 if algorithm == "one_shot_ll" else 1 << 62
    assert [PeerMemory.choose(pm, 1024, element) for element in ("float", "bf16_bits", "f16_bits", "int", "double")] \
        == ["one_shot_lamport"] * 3 + ["one_shot_ll"] * 2  # (its sentinel is a NaN of 16- and 32-bit floats)
    assert [PeerMemory.choose(pm, 512 << 10, element) for element in ("float", "int")] \
        == ["one_shot_lamport", "two_shot"]
    pm.table = [(1024, "one_shot_lamport"), (4096, "one_shot_lamport")]   # a tuned table that ends in it
    assert [PeerMemory.choose(pm, n, "int") for n in (8192, 300 << 10)] == ["one_shot_ll", "two_shot"]
    assert PeerMemory.choose(pm, 300 << 10, "bf16_bits") == "one_shot_lamport"
    pm.table = [(1 << 20, "two_shot_lamport"), (1 << 62, "ring")]   # its sentinel too: two_shot for the others
    assert [PeerMemory.choose(pm, 1 << 20, element) for element in ("float", "bf16_bits", "int", "double")] \
        == ["two_shot_lamport"] * 2 + ["two_shot"] * 2


def test_two_shot_lamport_takes_what_its_slots_hold():
    """two_shot_lamport's 2p slots per half of one_shot_lamport's area, each half of a one-shot's slot: p/2
    times one_shot_lamport's limit, the chunks (whole cache lines) never longer than a slot."""
    from types import SimpleNamespace

    from tplab.gpu_collectives.peer_kernels import LINE_PACKS, PACK
    from tplab.gpu_collectives.peer_memory import PeerMemory

    for p in range(2, 9):
        pm = SimpleNamespace(size=p, small=8 << 20, ll_bytes=256 << 10, lamport_bytes=1 << 20,
                             lamport_slot_packs=(1 << 20) // PACK, nbytes=64 << 20)
        limit = PeerMemory.limit(pm, "two_shot_lamport")
        assert limit == p * (1 << 19)
        packs = limit // PACK
        chunk = -(-packs // (p * LINE_PACKS)) * LINE_PACKS       # (PeerMemory.allreduce_kernel's)
        assert chunk <= pm.lamport_slot_packs // 2 and 2 * p * (pm.lamport_slot_packs // 2) * PACK == p << 20
    small = SimpleNamespace(size=4, small=1 << 20, ll_bytes=256 << 10, lamport_bytes=1 << 20,
                            lamport_slot_packs=(1 << 20) // PACK, nbytes=1 << 20)
    assert PeerMemory.limit(small, "two_shot_lamport") == 1 << 20   # (never past what any input may be: nbytes)


@given(packs=st.integers(1, 1 << 26), p=st.integers(2, 8), lines=st.integers(1, 1 << 16))
def test_two_shot_chunks_fit_its_two_areas(packs, p, lines):
    """two_shot's chunk (whole cache lines) leaves room for both its areas of p chunks in the buffer, and
    its rounds of p chunks cover the input."""
    from tplab.gpu_collectives.peer_kernels import LINE_PACKS
    from tplab.gpu_collectives.peer_memory import two_shot_chunk

    area = lines * LINE_PACKS * p * 2  # PeerMemory's buffers are whole lines per rank, in packs
    chunk = two_shot_chunk(packs, p, area)
    rounds = -(-packs // (p * chunk))
    assert chunk % LINE_PACKS == 0 and 2 * p * chunk <= area
    assert rounds * p * chunk >= packs and (rounds - 1) * p * chunk < packs


@given(work=st.integers(1, 1 << 22), max_blocks=st.integers(1, 1022))
def test_two_shot_blocks_shrink_to_fill_the_multiprocessors(work, max_blocks):
    """The two-shots' blocks are halved (not below MIN_THREADS) only while their grid would leave SMs idle; the other
    kernels keep theirs (the same on every rank: the sizes are the ranks' agreed arguments)."""
    from tplab.gpu_collectives.peer_memory import LL_THREADS, MIN_THREADS, THREADS, block_threads

    for algorithm in ("two_shot", "two_shot_pull"):
        threads = block_threads(algorithm, work, max_blocks)
        assert MIN_THREADS <= threads <= THREADS and THREADS % threads == 0
        assert threads == MIN_THREADS or -(-work // threads) >= max_blocks  # as small as it goes, or SMs filled
        assert threads == THREADS or -(-work // (2 * threads)) < max_blocks  # halved only from an idle-SM grid
    assert block_threads("one_shot", work, max_blocks) == THREADS
    assert block_threads("one_shot_ll", work, max_blocks) == LL_THREADS


@given(work=st.integers(1, 1 << 17), max_blocks=st.integers(1, 1022))
def test_lamport_blocks_grow_until_a_pack_per_thread(work, max_blocks):
    """one_shot_lamport's blocks: 64 threads, doubled (to at most 256) only while the grid would need more
    blocks than it may have: one pack per thread where the grid allows."""
    from tplab.gpu_collectives.peer_memory import LAMPORT_THREADS, block_threads

    fewest, most = LAMPORT_THREADS
    threads = block_threads("one_shot_lamport", work, max_blocks)
    assert block_threads("two_shot_lamport", work, max_blocks) == threads   # (its work: one chunk)
    assert threads in (64, 128, 256) and fewest <= threads <= most
    assert threads == most or -(-work // threads) <= max_blocks      # one pack per thread, or as large as it goes
    assert threads == fewest or -(-work // (threads // 2)) > max_blocks  # doubled only when the grid was short


def test_plans_do_not_keep_their_communicator_alive():
    """A communicator's plans must not hold it: a cycle leaves it to the garbage collector, which frees it (and
    a sub-communicator's NCCL communicator, whose destruction waits for the peers) at a different moment on
    every rank. Seen as a hang on 4 GPUs after a notebook's p - 1 rank picture."""
    import gc
    import weakref

    import torch

    from tplab.comm import world
    from tplab.comm.null import NullComm

    def used_and_dropped(make):
        comm = make()
        tplab.allreduce(torch.ones(3), comm)
        tplab.allgather(torch.ones(3), comm)
        tplab.reduce_scatter(torch.ones(3), comm)
        return weakref.ref(comm)

    gc.disable()
    try:
        for make in (lambda: world().split(0), lambda: NullComm(0, 1)):
            assert used_and_dropped(make)() is None, "freed as soon as the last reference goes"
    finally:
        gc.enable()


def test_one_colour_per_algorithm_in_every_figure():
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    from tplab.lab.plots import color_of, plot_speedup, plot_times

    df = pd.DataFrame({"size": [8, 16, 8, 16], "time_us": [1.0, 2.0, 1.5, 2.5], "algorithm": ["ring", "ring", "builtin", "builtin"]})
    lines = {line.get_label(): line.get_color() for line in plot_times(df).axes[0].get_lines()}
    assert lines == {"ring": color_of("ring"), "builtin": color_of("builtin")}
    speedup = {line.get_label(): line.get_color() for line in plot_speedup(df).axes[0].get_lines() if line.get_label() == "ring"}
    assert speedup["ring"] == color_of("ring")
    assert color_of("some new algorithm") == color_of("some new algorithm")  # stable for names not listed


def test_step_pictures_are_one_panel_at_jupyterlab_width_labelled_one_way():
    import matplotlib

    matplotlib.use("Agg")
    from tplab.lab.plots import MAX_WIDTH
    from tplab.lab.step_pictures import draw_allreduce_steps

    def ring_like(p):  # rank r's traces: start, then one step per rank in which it holds everyone's sum
        full = (1 << p) - 1
        return [{"rank": r, "steps": [("start", [1 << r] * p, 0)] + [(f"step {s}", [full if s >= r else 1 << r] * p, s)
                                                                      for s in range(1, p + 1)]} for r in range(p)]
    for p in (3, 8, 16):
        fig = draw_allreduce_steps(ring_like(p) + [None])  # a rank outside a sub-communicator gives None
        assert len(fig.axes) == 1 and fig.get_figwidth() <= MAX_WIDTH
        texts = {t.get_text() for t in fig.axes[0].texts}
        if p == 3:
            assert {"0", "1", "2", "012"} <= texts  # which ranks, when they fit a tile
        elif p == 8:
            assert {"1", "8"} == texts  # too narrow for "0123456": how many, in every tile alike
        else:
            assert texts == {""}  # too narrow for any text: the colour alone
