// tplab's peer-memory kernels, ring.cu: ring_pull and ring: the textbook rings, p-1 steps each way.
// Compiled as one source with the files before it (tplab.gpu_collectives.peer_kernels.KERNEL_FILES,
// in that order; memory_model.cuh explains the whole).

// The two loops both rings share, two packs per thread per trip (FOR_MY_PACK_PAIRS):
// a chunk's packs read from a peer's slots (``from``) plus this rank's own x, stored into ``dst`` and, where
// ``also`` is not null, into ``also`` too;
template <typename T>
__device__ __forceinline__ void add_and_store(const uint4* from, const uint4* x, uint4* dst, uint4* also,
                                              long long f, long long l) {
    FOR_MY_PACK_PAIRS(i, j, f, l) {
        const bool two = j < l;
        const uint4 a = load_peer(from + i), xa = x[i];
        uint4 b, xb;
        if (two) { b = load_peer(from + j); xb = x[j]; }
        const uint4 u = add_packs<T>(a, xa);
        dst[i] = u;
        if (also) also[i] = u;
        if (two) {
            const uint4 v = add_packs<T>(b, xb);
            dst[j] = v;
            if (also) also[j] = v;
        }
    }
}
// and a finished chunk's packs read from a peer's slots into ``out``, and passed on into ``pass_to`` unless null.
__device__ __forceinline__ void take_and_pass(const uint4* from, uint4* out, uint4* pass_to, long long f, long long l) {
    FOR_MY_PACK_PAIRS(i, j, f, l) {
        const bool two = j < l;
        const uint4 a = load_peer(from + i);
        uint4 b;
        if (two) b = load_peer(from + j);
        out[i] = a;
        if (pass_to) pass_to[i] = a;
        if (two) { out[j] = b; if (pass_to) pass_to[j] = b; }
    }
}

// ---- ring_pull: reduce-scatter then allgather with the left neighbour only, p-1 steps each -------------
// Read-based ring (also for inputs already in the shared buffer): at reduce-scatter step s rank r reads the left neighbour's partial sum of chunk
// c = r-s-1 and adds its own x[c]; at allgather step s it copies the finished chunk r-s from the left.
// Neighbour barriers (left and right) after each step keep every rank within one step of its neighbours,
// so nobody overwrites a chunk the right neighbour has not read yet. Each chunk is summed once, in the
// order x[c+1], x[c+2], ..., x[c] (rounded to T after each step, like NCCL's ring).
template <typename T>
__global__ void ring_pull(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                          unsigned int* epochs, int rank, int p, long long chunk, long long packs,
        Control* ctl, unsigned long long sig) {
    after_previous_kernel();
    BEGIN_CALL_AND_AGREE();
    const int left = (rank + p - 1) % p, right = (rank + 1) % p;
    const unsigned int neighbours = (1u << left) | (1u << right);
    uint4* mine = bufs[rank];
    const uint4* from_left = bufs[left];
#define CHUNK_RANGE(c, f, l) const long long f = (long long)(c) * chunk, l = lmin(f + chunk, packs)
    {   CHUNK_RANGE(rank, f, l);                                  // my own chunk: what the right reads first
        if (x != mine) copy_packs<T>(mine, x, f, l); }
    barrier(flags, this_call, rank, neighbours);
    for (int s = 0; s < p - 1; s++) {                            // reduce-scatter
        const int c = (rank - s - 1 + 2 * p) % p;
        CHUNK_RANGE(c, f, l);
        const bool finished = (s == p - 2);                      // chunk r+1 is complete here
        add_and_store<T>(from_left, x, mine, finished ? out : nullptr, f, l);
        barrier(flags, this_call, rank, neighbours);
    }
    for (int s = 0; s < p - 1; s++) {                            // allgather
        const int c = (rank - s + p) % p;
        CHUNK_RANGE(c, f, l);
        const bool pass_on = (s < p - 2);                        // the right neighbour still needs it
        take_and_pass(from_left, out, pass_on ? mine : nullptr, f, l);
        barrier(flags, this_call, rank, neighbours);
    }
#undef CHUNK_RANGE
    finish(ctl, epochs, this_call);
}

// ---- ring: the textbook ring, pushing: every step writes into the right neighbour's buffer -------------
// Rank r's buffer holds one slot per chunk (slot c at c·chunk, like x). The right neighbour is R.
//   reduce-scatter, step s = 0 .. p-2:  c = r - s
//       v = x[c] (s = 0)  or  slot c + x[c];  R's slot c = v;  barrier(neighbours)
//   last sum:  c = r + 1:  v = slot c + x[c]  -- chunk c is complete here;  out[c] = v
//   allgather, step t = 0 .. p-2:  push v to R's slot c;  barrier(neighbours);  c = c - 1;  v = slot c;  out[c] = v
//   barrier(neighbours)   (before the next call pushes into R's slots, R has read them)
// Like NCCL's ring, the bytes cross NVLink as writes (no round trip), and nothing is copied in first.
// Chunk c is summed in the order x[c], x[c+1], ..., x[c-1], once, so every rank gets the same bits.
template <typename T>
__global__ void ring(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                     unsigned int* epochs, int rank, int p, long long chunk, long long packs,
        Control* ctl, unsigned long long sig) {
    after_previous_kernel();
    BEGIN_CALL_AND_AGREE();
    const int left = (rank + p - 1) % p, right = (rank + 1) % p;
    const unsigned int neighbours = (1u << left) | (1u << right);
    if (sig == 0) barrier(flags, this_call, rank, neighbours);  // (the right neighbour has left its last call:
    const uint4* slot = bufs[rank];                          //  a two_shot's results may still be read there)
    uint4* to_right = bufs[right];
#define CHUNK_RANGE(c, f, l) const long long f = (long long)(c) * chunk, l = lmin(f + chunk, packs)
    for (int s = 0; s < p - 1; s++) {                            // reduce-scatter: add, pass on
        const int c = (rank - s + p) % p;
        CHUNK_RANGE(c, f, l);
        FOR_MY_PACK_PAIRS(i, j, f, l) {
            const bool two = j < l;
            uint4 a = x[i], b;
            if (two) b = x[j];
            if (s > 0) {
                a = add_packs<T>(load_peer(slot + i), a);       // what the left sent, then mine
                if (two) b = add_packs<T>(load_peer(slot + j), b);
            }
            to_right[i] = a;
            if (two) to_right[j] = b;
        }
        barrier(flags, this_call, rank, neighbours);
    }
    {   const int c = (rank + 1) % p;                            // the last addition: chunk r+1 complete
        CHUNK_RANGE(c, f, l);
        add_and_store<T>(slot, x, out, p > 1 ? to_right : nullptr, f, l);   // (and allgather step 0: pass it on)
        barrier(flags, this_call, rank, neighbours);
    }
    for (int t = 1; t < p; t++) {                                // allgather: take, pass on
        const int c = (rank + 1 - t + p) % p;
        CHUNK_RANGE(c, f, l);
        const bool pass_on = (t < p - 1);                        // R still lacks it
        take_and_pass(slot, out, pass_on ? to_right : nullptr, f, l);
        barrier(flags, this_call, rank, neighbours);
    }
#undef CHUNK_RANGE
    finish(ctl, epochs, this_call);
}

