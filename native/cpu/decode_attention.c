/* Paged decode attention for the CPU backend (AVX-512): one query token per sequence against its
 * context in the KV cache, the query heads of one KV head together, each key and value read once
 * for them (see attention.h for what prefill attention shares with it). */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "attention.h"

#define AHEAD_BYTES (4 << 20)  /* a decode attention job's keys and values and the next one's, at most */

/* Lane i of the result = the sum of v[i]'s lanes (v is clobbered): 16 horizontal sums in 46 ops,
 * where 16 separate reductions take about 128 and a long dependency chain each. */
static inline __m512 sum16(__m512 *v) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)  /* quads 0-1 hold key 2i, quads 2-3 key 2i + 1 */
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)  /* quad q holds key 4i + q */
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xDD));
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)  /* quad q: lanes 0 and 2 hold key 8i + q, lanes 1 and 3 key 8i + 4 + q */
        v[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    /* lane 4q + r holds key q, 8 + q, 4 + q, 12 + q for r = 0, 1, 2, 3 */
    const __m512 mixed = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, mixed);
}

/* G query heads (q: G heads of hd, contiguous) against n keys at `slots` of their shared KV head
 * (rows `row` apart from `off`): out = softmax(scale q.K) V per head, in fp32, rounded to bf16.
 * Each key and value is read and widened once for all G heads. `s` holds G (n + 16) floats of
 * scratch. G and hd are constants where inlined, so queries and accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend(const uint16_t *q, const uint16_t *k_cache,
                                                          const uint16_t *v_cache, const int64_t *slots, int64_t n,
                                                          int64_t row, int64_t off, const int64_t hd, const int G,
                                                          float scale, float *s, uint16_t *out,
                                                          const int64_t *ahead, int64_t ahead_from, int64_t ahead_to) {
    const int64_t pairs = hd / 32, stride = n + 16, chunks = (n + 15) / 16;
    bf16_pairs qv[MAX_GROUP][MAX_PAIRS];
    for (int g = 0; g < G; g++)
        for (int64_t c = 0; c < pairs; c++) qv[g][c] = load_pairs(q + g * hd + 32 * c);
    __m512 top[MAX_GROUP];
    for (int g = 0; g < G; g++) top[g] = _mm512_set1_ps(-INFINITY);
    for (int64_t l0 = 0; l0 < n; l0 += 16) {  /* scores, 16 keys at a time */
        const int64_t count = n - l0 < 16 ? n - l0 : 16;
        /* Ahead of use, as slots come in blocks scattered over the cache, which the hardware
         * prefetcher does not follow: this KV head's part of the next 16 keys to L1; and to L2 the
         * next 16 keys' values and the 16 keys after those. The first KV head of a row (off 0)
         * fetches the whole rows, so that the passes of the row's other KV heads find them in L2. */
        const int64_t bytes = off == 0 ? 2 * row : 2 * hd;
        for (int64_t l = l0 + 16; l < n && l < l0 + 32; l++) {
            for (int64_t b = 0; b < 2 * hd; b += 64)
                _mm_prefetch((const char *)(k_cache + slots[l] * row + off) + b, _MM_HINT_T0);
            for (int64_t b = 0; b < bytes; b += 64)
                _mm_prefetch((const char *)(v_cache + slots[l] * row + off) + b, _MM_HINT_T1);
        }
        for (int64_t l = l0 + 32; l < n && l < l0 + 48; l++)
            for (int64_t b = 0; b < bytes; b += 64)
                _mm_prefetch((const char *)(k_cache + slots[l] * row + off) + b, _MM_HINT_T1);
        if (ahead) {  /* this chunk's share of the next job's keys and values, whole rows, to L2 */
            const int64_t c = l0 / 16, span = ahead_to - ahead_from;
            for (int64_t l = ahead_from + span * c / chunks; l < ahead_from + span * (c + 1) / chunks; l++)
                for (int64_t b = 0; b < 2 * row; b += 64) {
                    _mm_prefetch((const char *)(k_cache + ahead[l] * row) + b, _MM_HINT_T1);
                    _mm_prefetch((const char *)(v_cache + ahead[l] * row) + b, _MM_HINT_T1);
                }
        }
        __m512 dots[MAX_GROUP][16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {  /* past the last key, the last key again (masked off below) */
            const uint16_t *k = k_cache + slots[l0 + (i < count ? i : count - 1)] * row + off;
            bf16_pairs kv[MAX_PAIRS];
            for (int64_t c = 0; c < pairs; c++) kv[c] = load_pairs(k + 32 * c);
            for (int g = 0; g < G; g++) {
                __m512 dot = _mm512_setzero_ps();
                for (int64_t c = 0; c < pairs; c++) dot = dot_pairs(dot, qv[g][c], kv[c]);
                dots[g][i] = dot;
            }
        }
        for (int g = 0; g < G; g++)
            keep_scores(s + g * stride + l0, _mm512_mul_ps(sum16(dots[g]), _mm512_set1_ps(scale)), count, &top[g]);
    }
    float inv[MAX_GROUP];
    for (int g = 0; g < G; g++) inv[g] = normalise(s + g * stride, n, top[g]);
    __m512 acc[MAX_GROUP][2 * MAX_PAIRS];  /* even and odd elements of each 32 */
    for (int g = 0; g < G; g++)
        for (int64_t j = 0; j < 2 * pairs; j++) acc[g][j] = _mm512_setzero_ps();
    weigh(acc, G, s, stride, v_cache, slots, 0, n, row, off, hd);
    for (int g = 0; g < G; g++) store_head(acc[g], inv[g], pairs, out + g * hd);
}

#define ATTEND_HD(G)                                                                                      \
    switch (hd) {                                                                                         \
        case 64: attend(q, k_cache, v_cache, slots, n, row, off, 64, G, scale, s, out, ah, from, to); break; \
        case 128: attend(q, k_cache, v_cache, slots, n, row, off, 128, G, scale, s, out, ah, from, to); break; \
        default: attend(q, k_cache, v_cache, slots, n, row, off, hd, G, scale, s, out, ah, from, to); break; \
    }

/* Query heads first .. last - 1 of one token (q, out: that token's heads 0 ..), against KV head
 * h / (H / Hkv) each: the heads of one KV head together, up to MAX_GROUP at a time, with G and hd
 * fixed at compile time for the common sizes. `s` holds MAX_GROUP (n + 16) floats. */
static void attend_heads(const uint16_t *q0, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *slots,
                         int64_t n, int64_t H, int64_t Hkv, int64_t hd, int64_t first, int64_t last, float scale,
                         float *s, uint16_t *out0, const int64_t *next, int64_t next_n) {
    const int64_t group = H / Hkv, row = Hkv * hd;
    for (int64_t h = first; h < last;) {
        const int64_t kvh = h / group, end = (kvh + 1) * group < last ? (kvh + 1) * group : last;
        const int64_t count = end - h < MAX_GROUP ? end - h : MAX_GROUP, off = kvh * hd;
        const uint16_t *q = q0 + h * hd;
        uint16_t *out = out0 + h * hd;
        /* The KV heads after the first read from L2 what the first fetched: meanwhile the next
         * job's keys come in, a share for each of them (its first run of query heads). */
        const int later = next && kvh > 0 && h == kvh * group;
        const int64_t *ah = later ? next : NULL;
        const int64_t from = later ? next_n * (kvh - 1) / (Hkv - 1) : 0, to = later ? next_n * kvh / (Hkv - 1) : 0;
        switch (count) {
            case 1: ATTEND_HD(1) break;
            case 2: ATTEND_HD(2) break;
            case 3: ATTEND_HD(3) break;
            default: ATTEND_HD(4) break;
        }
        h += count;
    }
}

/* One query token per row d against its paged context: out[d, h] = softmax(scale q.K) V, in fp32.
 * q [D, H, hd] bf16 with rows `q_stride` apart; caches [slots, Hkv, hd] bf16; tables [D, W] block
 * ids; lens [D] context lengths; out [D, H, hd]. hd % 32 == 0, hd <= 256. */
int forge_decode_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int64_t *tables, int64_t width, const int32_t *lens, int64_t block_size, int64_t D,
                           int64_t H, int64_t Hkv, int64_t hd, float scale, uint16_t *out, int threads) {
    if (!shapes_ok(H, Hkv, hd)) return 1;
    int64_t longest = 0;
    for (int64_t d = 0; d < D; d++) longest = lens[d] > longest ? lens[d] : longest;
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)(D * longest));
    float *scores = malloc(sizeof(float) * (size_t)(threads * MAX_GROUP * (longest + 16)));
    int64_t *claim = aligned_alloc(64, (size_t)threads * 64);  /* each run's next job, a cache line each */
    if (!slots || !scores || !claim) {
        free(slots);
        free(scores);
        free(claim);
        return 2;
    }
    for (int64_t d = 0; d < D; d++)
        for (int64_t l = 0; l < lens[d]; l++)
            slots[d * longest + l] = tables[d * width + l / block_size] * block_size + l % block_size;
    /* A job is all heads of one sequence, or where that leaves too few jobs to keep every thread
     * busy, a run of consecutive heads of it. Within a job the heads of one KV head run together
     * (attend_heads), and the job reads whole cache rows, where jobs of one KV head each would
     * split every row's cache lines between threads. At 16 sequences of 200 tokens reading is
     * most of the time. */
    int64_t shares = (2 * threads + D - 1) / D;
    shares = shares < 1 ? 1 : shares > H ? H : shares;
    const int64_t per_share = (H + shares - 1) / shares, jobs = D * shares;
    /* Each thread takes the jobs of its own run of consecutive ones, then helps with the others'
     * runs, one job at a time: a thread held up leaves the rest of its run to the others, and the
     * job a thread most likely takes next is the next of its run. While a job's later KV heads
     * compute (their keys and values come from L2, where the first KV head's pass fetched them),
     * the next job's come in from memory, up to AHEAD_BYTES for the two jobs together. With 2
     * threads, 30 layers' attention of 64 sequences of 150 tokens took 12.2-13.0 ms and takes
     * 9.0-9.7; of 32 sequences of 1,000 tokens, 43.4-44.2 -> 33.5-33.6 ms (fetching the next job
     * whole paid even past L2's 1 MB). */
    const int64_t key_bytes = 4 * Hkv * hd;  /* a key's K and V rows, bf16 */
    for (int64_t r = 0; r < threads; r++) claim[8 * r] = r * jobs / threads;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num();
        float *s = scores + t * MAX_GROUP * (longest + 16);
        for (int64_t v = 0; v < threads; v++) {
            const int64_t r = (t + v) % threads, run_end = (r + 1) * jobs / threads;
            int64_t job;
            while ((job = __atomic_fetch_add(&claim[8 * r], 1, __ATOMIC_RELAXED)) < run_end) {
                const int64_t d = job / shares, first = job % shares * per_share;
                const int64_t last = first + per_share < H ? first + per_share : H;
                const int64_t *next = NULL;
                int64_t next_n = 0;
                if (shares == 1 && Hkv > 1 && job + 1 < run_end) {
                    const int64_t room = (AHEAD_BYTES - key_bytes * lens[d]) / key_bytes;
                    next_n = lens[d + 1] < room ? lens[d + 1] : room;
                    next = next_n > 0 ? slots + (d + 1) * longest : NULL;
                }
                attend_heads(q + d * q_stride, k_cache, v_cache, slots + d * longest, lens[d], H, Hkv, hd, first,
                             last, scale, s, out + d * H * hd, next, next_n);
            }
        }
    }
    free(claim);
    free(slots);
    free(scores);
    return 0;
}
