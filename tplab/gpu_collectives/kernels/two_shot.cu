// tplab's peer-memory kernels, two_shot.cu: two_shot and two_shot_pull: reduce-scatter, then all-gather (large messages).
// Compiled as one source with the files before it (tplab.gpu_collectives.peer_kernels.KERNEL_FILES,
// in that order; memory_model.cuh explains the whole).

// ---- two-shot: reduce-scatter by pushing, allgather by pushing (large messages) -------------------------
// Rank r's buffer holds two areas of p slots, one chunk each: slot q of `partial` receives chunk r of rank
// q's input, slot q of `result` receives rank q's finished chunk q. Inputs larger than the areas go through
// in rounds of p chunks. Every byte crosses NVLink as a write (no round trip), and the results land where
// they are needed, so a rank only copies its own memory at the end.
//   agreement (every peer has finished its previous call: the start barrier)
//   for each round:
//     for q != r: bufs[q] partial slot r = x chunk q                                  (push)
//     barrier(all)
//     s = sum in rank order of (x chunk r for me, partial slot q for q);  out chunk r = s
//     for q != r: bufs[q] result slot r = s                                           (push)
//     barrier(all)
//     for q != r: out chunk q = result slot q                                         (my own memory)
// No barrier at the end: a peer writes into my partial slots again only after a barrier I pass once I
// have summed them, and into my result slots only after the next round's first barrier, which I reach once I
// have copied them out. The next call must start with a meeting before it writes into a peer: its agreement
// (every kernel's, or agree_only's just before it on the stream). Signature 0 ("agreed already") does not
// say when, so the kernel then meets its peers first. Chunk r is summed once, by rank r.
template <typename T>
__global__ void two_shot(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                         unsigned int* epochs, int rank, int p, long long chunk, long long packs,
        Control* ctl, unsigned long long sig) {
    after_previous_kernel();
    BEGIN_CALL_AND_AGREE();
    const unsigned int all = (1u << p) - 1;
    if (sig == 0) barrier(flags, this_call, rank, all);        // (agreed before, maybe long before: see below)
    const long long round_packs = (long long)p * chunk;
    uint4* partial = bufs[rank];
    uint4* result = bufs[rank] + round_packs;
    for (long long first = 0; first < packs; first += round_packs) {
        const long long last = lmin(first + round_packs, packs);
        for (int step = 1; step < p; step++) {              // rank r starts at r+1: peers spread the load
            const int q = (rank + step) % p;
            const long long f = first + q * chunk, l = lmin(f + chunk, last);
            uint4* slot = bufs[q] + (long long)rank * chunk - f;  // slot[i] for i in chunk q
            FOR_MY_PACK_PAIRS(i, j, f, l) {
                const uint4 a = x[i];
                if (j < l) { const uint4 b = x[j]; slot[j] = b; }
                slot[i] = a;
            }
        }
        barrier(flags, this_call, rank, all);
        const long long f = first + rank * chunk, l = lmin(f + chunk, last);
        const uint4* in[MAX_RANKS];
#pragma unroll
        for (int q = 0; q < MAX_RANKS; q++) in[q] = q == rank ? x : partial + (long long)q * chunk - f;
        FOR_MY_PACKS(i, f, l) {
            const uint4 s = sum_in_rank_order<T>(in, p, i);
            out[i] = s;
            for (int step = 1; step < p; step++)             // rank r starts at r+1: peers spread the load
                (bufs[(rank + step) % p] + round_packs + (long long)rank * chunk - f)[i] = s;
        }
        barrier(flags, this_call, rank, all);
        for (int step = 1; step < p; step++) {
            const int q = (rank + step) % p;
            const long long g = first + q * chunk, h = lmin(g + chunk, last);
            copy_packs<T>(out, result + (long long)q * chunk - g, g, h);
        }
    }
    finish(ctl, epochs, this_call);
}

// ---- two-shot by pulling only: for inputs that already lie in the shared buffers ("registered") ----------
//   mine = x (skipped when x is mine);  barrier(all)
//   chunk r of mine = sum over q of chunk r of bufs[q];  out chunk r = the same;  barrier(all)
//   for every q != r: out chunk q = chunk q of bufs[q];  barrier(all)
// Chunk r is summed once, by rank r, so every rank holds bitwise the same result.
template <typename T>
__global__ void two_shot_pull(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                              unsigned int* epochs, int rank, int p, long long chunk, long long packs,
        Control* ctl, unsigned long long sig) {
    after_previous_kernel();
    BEGIN_CALL_AND_AGREE();
    const unsigned int all = (1u << p) - 1;
    uint4* mine = bufs[rank];
    if (x != mine)                                          // skipped when the input already lives there
        for (int c = 0; c < p; c++)                         // chunk by chunk: block b copies what the peers'
            copy_packs<T>(mine, x, c * chunk, lmin((c + 1) * chunk, packs));   // block b will read
    barrier(flags, this_call, rank, all);
    const long long first = rank * chunk, last = lmin(first + chunk, packs);
    FOR_MY_PACKS(i, first, last) {
        uint4 s = sum_in_rank_order<T>((const uint4* const*)bufs, p, i);
        mine[i] = s;
        out[i] = s;
    }
    barrier(flags, this_call, rank, all);
    for (int step = 1; step < p; step++) {                  // rank r starts at r+1: peers spread the load
        const int q = (rank + step) % p;
        const long long f = q * chunk, l = lmin(f + chunk, packs);
        copy_packs<T>(out, bufs[q], f, l);
    }
    barrier(flags, this_call, rank, all);
    finish(ctl, epochs, this_call);
}

