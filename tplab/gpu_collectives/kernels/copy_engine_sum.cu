// tplab's peer-memory kernels, copy_engine_sum.cu: the reduction step of the copy-engine all-reduce.
// Compiled as one source with the files before it (tplab.gpu_collectives.peer_kernels.KERNEL_FILES,
// in that order; memory_model.cuh explains the whole).

// ---- the reduction step of the copy-engine all-reduce (copy_engine.py) ----------------------------------
// The copy engines have pushed block r of every rank q's input into slot q of this rank's shared half
// (`slots`, `stride` packs apart; slot r holds this rank's own block r); sum them in rank order into slot r,
// which the peers then copy out.
template <typename T>
__global__ void sum_slots(uint4* slots, long long stride, int rank, int p, long long packs) {
    const uint4* in[MAX_RANKS];
#pragma unroll
    for (int q = 0; q < MAX_RANKS; q++) in[q] = slots + (long long)(q < p ? q : 0) * stride;
    uint4* mine = slots + (long long)rank * stride;
    FOR_MY_PACKS(i, 0, packs) mine[i] = sum_in_rank_order<T>(in, p, i);
}

