// tplab's peer-memory kernels, alltoall.cu: the peer-memory all-to-all.
// Compiled as one source with the files before it (tplab.gpu_collectives.peer_kernels.KERNEL_FILES,
// in that order; memory_model.cuh explains the whole).

// ---- all-to-all: block q of rank r's x goes to rank q (pushed into every peer's buffer at once) ---------
// Rank r's buffer holds p slots of one block each; slot q receives rank q's block for r.
//   for q != r: bufs[q] slot r = x block q;   out block r = x block r;   barrier(all)
//   for q != r: out block q = my slot q;                                 barrier(all)
// (The second barrier: a peer's next call pushes into a slot only after this rank has read it.)
extern "C" __global__ void alltoall(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                                    unsigned int* epochs, int rank, int p, long long packs,
        Control* ctl, unsigned long long sig) {
    BEGIN_CALL_AND_AGREE();
    const unsigned int all = (1u << p) - 1;
    for (int step = 1; step <= p; step++) {                 // rank r starts at r+1: peers spread the load
        const int q = (rank + step) % p;                    // (the last step: q = r, the block that stays)
        const uint4* block = x + (long long)q * packs;
        uint4* to = (q == rank ? out : bufs[q]) + (long long)rank * packs;
        FOR_MY_PACK_PAIRS(i, j, 0, packs) {
            const uint4 a = block[i];
            if (j < packs) { const uint4 b = block[j]; to[j] = b; }
            to[i] = a;
        }
    }
    barrier(flags, this_call, rank, all);
    const uint4* mine = bufs[rank];
    for (int step = 1; step < p; step++) {
        const int q = (rank + step) % p;
        const long long at = (long long)q * packs;
        FOR_MY_PACK_PAIRS(i, j, 0, packs) {
            const uint4 a = load_peer(mine + at + i);       // written by peer q over NVLink: L2, not L1
            if (j < packs) { const uint4 b = load_peer(mine + at + j); out[at + j] = b; }
            out[at + i] = a;
        }
    }
    barrier(flags, this_call, rank, all);
    finish(ctl, epochs, this_call);
}
