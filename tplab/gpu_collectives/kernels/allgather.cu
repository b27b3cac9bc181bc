// tplab's peer-memory kernels, allgather.cu: the peer-memory all-gather.
// Compiled as one source with the files before it (tplab.gpu_collectives.peer_kernels.KERNEL_FILES,
// in that order; memory_model.cuh explains the whole).

// ---- allgather: every rank's x, in rank order, on every rank (pulled from all peers at once) ------------
//   mine = x;  out part r = x;  barrier(all);  for q != r: out part q = bufs[q];  barrier(all)
extern "C" __global__ void allgather(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                                     unsigned int* epochs, int rank, int p, long long packs,
        Control* ctl, unsigned long long sig) {
    BEGIN_CALL_AND_AGREE();
    const unsigned int all = (1u << p) - 1;
    uint4* mine = bufs[rank];
    uint4* own_part = out + (long long)rank * packs;
    FOR_MY_PACKS(i, 0, packs) { const uint4 v = x[i]; mine[i] = v; own_part[i] = v; }
    barrier(flags, this_call, rank, all);
    for (int step = 1; step < p; step++) {                  // rank r starts at r+1: peers spread the load
        const int q = (rank + step) % p;
        const uint4* theirs = bufs[q];
        uint4* part = out + (long long)q * packs;
        FOR_MY_PACK_PAIRS(i, j, 0, packs) {
            const uint4 a = load_peer(theirs + i);
            if (j < packs) { const uint4 b = load_peer(theirs + j); part[j] = b; }
            part[i] = a;
        }
    }
    barrier(flags, this_call, rank, all);                      // nobody overwrites a buffer still being read
    finish(ctl, epochs, this_call);
}

