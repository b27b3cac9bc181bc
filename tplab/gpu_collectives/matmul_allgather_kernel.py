"""The Triton kernel of matmul_allgather.py: one output tile per program; TMA loads of x and W, pipelined; the
tile either stored here (columns [0, LOCAL)) or into every rank's gathered buffer by TMA stores over NVLink."""

import triton
import triton.language as tl


@triton.jit
def _store_tile(tile, off_m, off_n, out_desc, g0, g1, g2, g3, g4, g5, g6, g7, LOCAL, m_local, S, my_first_row,
                RANKS: tl.constexpr):
    if off_n < LOCAL:                                  # (LOCAL is a multiple of BLOCK_N: no tile straddles)
        out_desc.store([off_m, off_n], tile)
    else:                                              # my rows of the gathered (B, S, N - LOCAL) buffers
        row = (off_m // m_local) * S + my_first_row + off_m % m_local    # (m_local a multiple of BLOCK_M)
        col = off_n - LOCAL
        if RANKS > 1:                                  # g0 is mine; g1.. the next ranks', in ring order
            g1.store([row, col], tile)
        if RANKS > 2:
            g2.store([row, col], tile)
        if RANKS > 3:
            g3.store([row, col], tile)
        if RANKS > 4:
            g4.store([row, col], tile)
        if RANKS > 5:
            g5.store([row, col], tile)
        if RANKS > 6:
            g6.store([row, col], tile)
        if RANKS > 7:
            g7.store([row, col], tile)
        g0.store([row, col], tile)

@triton.jit
def matmul_allgather_kernel(x_desc, w_desc, out_desc, bias_ptr, g0, g1, g2, g3, g4, g5, g6, g7,
                            M, N, K, LOCAL, m_local, S, my_first_row,
                            RANKS: tl.constexpr, HAS_BIAS: tl.constexpr, INTERLEAVE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, HALVES: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n                     # GROUP_M row tiles at a time: x's rows stay in L2
    first_m = (pid // in_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    if INTERLEAVE:                                     # 1 local tile, then INTERLEAVE - 1 gathered ones
        n_local = LOCAL // BLOCK_N
        step = pid_n % INTERLEAVE
        pid_n = tl.where(step == 0, pid_n // INTERLEAVE,
                         n_local + (pid_n // INTERLEAVE) * (INTERLEAVE - 1) + step - 1)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):              # (pipelined by Triton: TMA loads num_stages ahead)
        a = x_desc.load([off_m, ki * BLOCK_K])          # (BLOCK_M, BLOCK_K)
        b = w_desc.load([off_n, ki * BLOCK_K])          # (BLOCK_N, BLOCK_K): W's rows are y's columns
        acc = tl.dot(a, b.T, acc)
    if HAS_BIAS:
        cols = off_n + tl.arange(0, BLOCK_N)
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HALVES:                                         # stored as two (BLOCK_M, BLOCK_N/2) halves: less
        halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))   # shared memory
        left, right = tl.split(halves)
        _store_tile(left.to(out_desc.dtype), off_m, off_n, out_desc, g0, g1, g2, g3, g4, g5, g6, g7,
                    LOCAL, m_local, S, my_first_row, RANKS)
        _store_tile(right.to(out_desc.dtype), off_m, off_n + BLOCK_N // 2, out_desc, g0, g1, g2, g3, g4, g5, g6,
                    g7, LOCAL, m_local, S, my_first_row, RANKS)
    else:
        _store_tile(acc.to(out_desc.dtype), off_m, off_n, out_desc, g0, g1, g2, g3, g4, g5, g6, g7,
                    LOCAL, m_local, S, my_first_row, RANKS)

