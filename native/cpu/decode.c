/* Every decoder layer of a bf16 step in one call, for the CPU backend: decode tokens and prefill
 * chunks alike.
 *
 * A step runs eleven kernels per layer. Called one at a time from Python, each costs 10-20 us of
 * interpreter, ctypes and tensor allocation on top of its own work: about 2 ms a step on the
 * default model's 30 layers (a one-sequence decode step takes 2.7 ms here, 4.6 through Python).
 * This file runs the same kernels in the same order, with the same arguments, so its results equal
 * the per-kernel path's bit for bit:
 *
 *   h = norm(x += delta); qkv = h Wqkv (+ bias; q, k heads normalised); rotate q, k (but in NoPE
 *   layers); cache k, v;
 *   o = attention(q); delta = o Wo
 *   h = norm(x += delta); delta = (silu(h Wgate) * h Wup) Wdown
 *
 * Attention is decode attention for the step's decode rows and prefill attention for each chunk
 * (which gives a query the bits decode attention would: see ops.c); the rest runs over all rows.
 * A step of many rows is split between the threads by rows instead (forge_split_rows), each running
 * the kernels on its own rows alone, with the same bits.
 * Rows of requests on a LoRA adapter get its updates right after each projection (forge_lora_add,
 * as the per-kernel path adds them: see forge_service/lora.py).
 *
 * Layouts are those of forge_service/backends/cpu.py: x [T, D] fp32 residual stream; the fused
 * projection's rows are q (H heads), k (Hkv), v (Hkv); caches [slots, Hkv, hd] bf16.
 */
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

/* Rows a thread takes at least, where a step is split by rows; and a step is split only past one
 * block of the GEMMs' rows (GEMM_ROWS, quant_gemm.c's ROWS). By weight tiles, a step of 9 to 15 rows
 * runs each tile's 8-row block and then a short one, which costs far more than its rows; by rows,
 * each thread runs one block of its own. In process on the 2-vCPU Zen 4 (bench/kernel_ab.py: steps
 * alternating between builds in one process), against 8 rows a thread: 9 / 10-15 rows 11% / 5-15%
 * faster a step; 8 rows split 4 + 4 gained or lost up to 7% as the machine's memory traffic varied,
 * and 6 and 7 rows split 3 + 3 and 3 + 4 lost 4% and 7% (each thread reads every weight). */
#define SPLIT_ROWS 4
#define GEMM_ROWS 8
#define MAX_SPLIT 4   /* the most threads a step is split between by rows (with more, by weight tiles) */
#define HANDOFF_ROWS 4  /* the fewest rows a run hands off to an idle thread, and keeps */
#define MAX_HANDOFFS 64  /* runs a step's threads hand each other at most */
#define YIELD_AFTER_SPINS 2000  /* a thread waiting for a handoff spins ~50 us, then yields its core */

int forge_q4_linear(const void *x, int x_bf16, int64_t M, int64_t K, int64_t N, const uint8_t *codes,
                    const uint16_t *wd16, const uint16_t *wm16, void *out, int out_form, int levels,
                    float fine_above, int threads);
int forge_q8_linear(const void *x, int x_bf16, int64_t M, int64_t K, int64_t N, const uint8_t *codes,
                    const uint16_t *wd16, void *out, int out_form, int levels, float fine_above, int threads);
void forge_add_rms_norm(float *residual, const uint16_t *delta, const uint16_t *weight, uint16_t *out, int64_t T,
                        int64_t D, float eps, int threads);
void forge_silu_mul(const uint16_t *gate_up, uint16_t *out, int64_t T, int64_t F, int threads);
void forge_add_bias(uint16_t *x, int64_t T, int64_t N, int64_t stride, const uint16_t *bias, int threads);
void forge_head_rms_norm(uint16_t *x, int64_t T, int64_t heads, int64_t split, int64_t hd, int64_t stride,
                         const uint16_t *first, const uint16_t *rest, float eps, int threads);
void forge_rotary(uint16_t *x, int64_t T, int64_t heads, int64_t hd, int64_t stride, const uint16_t *cos,
                  const uint16_t *sin, int threads);
int forge_decode_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int64_t *tables, int64_t width, const int32_t *lens, int64_t block_size, int64_t D,
                           int64_t H, int64_t Hkv, int64_t hd, float scale, uint16_t *out, int threads);
void forge_lora_add(const void *x, int x_bf16, int64_t x_stride, const int64_t *rows, int64_t count, int64_t K,
                    const float *A, int64_t R, const float *Bt, int64_t N, void *y, int y_bf16, int64_t y_stride,
                    int threads);
int forge_prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int64_t *slots, int64_t C, int64_t L, int64_t H, int64_t Hkv, int64_t hd,
                            float scale, uint16_t *out, int threads);

typedef struct {  /* a weight in the quant_gemm.c layout; offset is NULL for q8 */
    const uint8_t *codes;
    const uint16_t *scale, *offset;
    int64_t n, k;
    int32_t levels;
    float fine_above;
} forge_weight;

typedef struct {
    const uint16_t *input_norm, *post_norm;  /* bf16 [D] */
    forge_weight qkv, o, gate_up, down;
    uint16_t *k_cache, *v_cache;
    const uint16_t *qkv_bias;  /* bf16 [Nqkv] (Qwen2), or NULL */
    const uint16_t *q_norm, *k_norm;  /* bf16 [hd] each (Qwen3), or NULL */
    int64_t rope;  /* 0: a layer without rotary embedding (SmolLM3's NoPE layers) */
} forge_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
} forge_dims;

/* LoRA: one adapted module, y[:, offset .. offset + n) += Bt.T (A x) (A [rank, k], Bt [rank, n] fp32). */
typedef struct {
    const float *a, *bt;
    int64_t rank, n, offset;
} forge_lora_module;

enum { P_QKV, P_O, P_GATE_UP, P_DOWN, PROJECTIONS };

/* An adapter's modules in (layer, projection) order: those of layer l's projection p are
 * modules[first[l * PROJECTIONS + p] .. first[l * PROJECTIONS + p + 1]). */
typedef struct {
    const forge_lora_module *modules;
    const int64_t *first;
} forge_lora_table;

typedef struct {  /* the step's rows on one adapter */
    const forge_lora_table *table;
    const int64_t *rows;
    int64_t count;
} forge_lora_rows;

enum { OK = 0, BAD_SHAPE = 1, NO_MEMORY = 2 };

/* Layer l's projection p, x [T, K] -> y [T, N]: each adapter's updates of it, in its listed rows. */
static void adapt(const forge_lora_rows *lora, int64_t adapters, int64_t l, int p, const uint16_t *x, int64_t K,
                  uint16_t *y, int64_t N, int threads) {
    for (int64_t i = 0; i < adapters; i++) {
        const forge_lora_table *t = lora[i].table;
        for (int64_t m = t->first[l * PROJECTIONS + p]; m < t->first[l * PROJECTIONS + p + 1]; m++) {
            const forge_lora_module *u = t->modules + m;
            forge_lora_add(x, 1, K, lora[i].rows, lora[i].count, K, u->a, u->rank, u->bt, u->n, y + u->offset, 1, N,
                           threads);
        }
    }
}

static int project(const forge_weight *w, const uint16_t *x, int64_t T, uint16_t *out, int threads) {
    if (w->offset)
        return forge_q4_linear(x, 1, T, w->k, w->n, w->codes, w->scale, w->offset, out, 1, w->levels,
                               w->fine_above, threads);
    return forge_q8_linear(x, 1, T, w->k, w->n, w->codes, w->scale, out, 1, w->levels, w->fine_above, threads);
}

typedef struct {  /* a prefill chunk in a run of rows: rows first .. first + rows - 1 of the run are the
                   * last of its context's `length` tokens, whose cache slots are at `slots` */
    int64_t first, rows, length;
    const int64_t *slots;
} forge_chunk;

typedef struct {  /* rows of a step: their decode rows first, then their prefill chunks (or pieces of them) */
    float *x;
    uint16_t *delta;
    int64_t T;
    const int64_t *slots;
    const uint16_t *cos, *sin;
    int64_t decodes;
    const int64_t *tables;  /* [decodes, width] */
    const int32_t *lens;
    int64_t chunks;
    const forge_chunk *chunk;
} forge_run;

typedef struct {  /* a run's scratch: h [T, D], qkv [T, Nqkv], attn [T, H hd], gate_up [T, 2F], act [T, F] */
    uint16_t *h, *qkv, *attn, *gate_up, *act;
} forge_scratch;

/* Layer l up to its cache writes: h = norm(x += delta); qkv = h Wqkv (bias, head norms, rotary); cache k, v. */
static int layer_in(const forge_layer *p, int64_t l, const forge_dims *dims, const forge_run *r,
                    const forge_scratch *s, const forge_lora_rows *lora, int64_t adapters, int threads) {
    const int64_t D = dims->hidden, H = dims->heads, Hkv = dims->kv_heads, hd = dims->head_dim;
    const int64_t Nqkv = (H + 2 * Hkv) * hd, kv = Hkv * hd, T = r->T;
    forge_add_rms_norm(r->x, l > 0 ? r->delta : NULL, p->input_norm, s->h, T, D, dims->eps, threads);
    const int status = project(&p->qkv, s->h, T, s->qkv, threads);
    if (status) return status;
    adapt(lora, adapters, l, P_QKV, s->h, D, s->qkv, Nqkv, threads);
    if (p->qkv_bias) forge_add_bias(s->qkv, T, Nqkv, Nqkv, p->qkv_bias, threads);
    if (p->q_norm) forge_head_rms_norm(s->qkv, T, H + Hkv, H, hd, Nqkv, p->q_norm, p->k_norm, dims->eps, threads);
    if (p->rope) forge_rotary(s->qkv, T, H + Hkv, hd, Nqkv, r->cos, r->sin, threads);
    for (int64_t t = 0; t < T; t++) {
        memcpy(p->k_cache + r->slots[t] * kv, s->qkv + t * Nqkv + H * hd, sizeof(uint16_t) * (size_t)kv);
        memcpy(p->v_cache + r->slots[t] * kv, s->qkv + t * Nqkv + (H + Hkv) * hd, sizeof(uint16_t) * (size_t)kv);
    }
    return OK;
}

/* The rest of layer l: o = attention(q); delta = o Wo; h = norm(x += delta); delta = (silu(h Wgate) * h Wup) Wdown. */
static int layer_out(const forge_layer *p, int64_t l, const forge_dims *dims, const forge_run *r, int64_t width,
                     const forge_scratch *s, const forge_lora_rows *lora, int64_t adapters, int threads) {
    const int64_t D = dims->hidden, H = dims->heads, Hkv = dims->kv_heads, hd = dims->head_dim;
    const int64_t F = dims->intermediate, Nqkv = (H + 2 * Hkv) * hd, T = r->T;
    int status = OK;
    if (r->decodes && (status = forge_decode_attention(s->qkv, Nqkv, p->k_cache, p->v_cache, r->tables, width,
                                                       r->lens, dims->block_size, r->decodes, H, Hkv, hd,
                                                       dims->scale, s->attn, threads)))
        return status;
    for (int64_t c = 0; c < r->chunks; c++) {  /* its status codes are these */
        const forge_chunk *k = r->chunk + c;
        if ((status = forge_prefill_attention(s->qkv + k->first * Nqkv, Nqkv, p->k_cache, p->v_cache, k->slots,
                                              k->length, k->rows, H, Hkv, hd, dims->scale,
                                              s->attn + k->first * H * hd, threads)))
            return status;
    }
    if ((status = project(&p->o, s->attn, T, r->delta, threads))) return status;
    adapt(lora, adapters, l, P_O, s->attn, H * hd, r->delta, D, threads);
    forge_add_rms_norm(r->x, r->delta, p->post_norm, s->h, T, D, dims->eps, threads);
    if ((status = project(&p->gate_up, s->h, T, s->gate_up, threads))) return status;
    adapt(lora, adapters, l, P_GATE_UP, s->h, D, s->gate_up, 2 * F, threads);
    forge_silu_mul(s->gate_up, s->act, T, F, threads);
    if ((status = project(&p->down, s->act, T, r->delta, threads))) return status;
    adapt(lora, adapters, l, P_DOWN, s->act, F, r->delta, D, threads);
    return OK;
}

/* Scratch for a run of T rows (see forge_scratch), in one allocation that s->h owns: NO_MEMORY
 * where it fails. */
static int scratch(const forge_dims *dims, int64_t T, forge_scratch *s) {
    const int64_t D = dims->hidden, H = dims->heads, Hkv = dims->kv_heads, hd = dims->head_dim;
    const int64_t F = dims->intermediate, Nqkv = (H + 2 * Hkv) * hd;
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)(T * (D + Nqkv + H * hd + 3 * F)));
    *s = (forge_scratch){h, h + T * D, h + T * (D + Nqkv), h + T * (D + Nqkv + H * hd),
                         h + T * (D + Nqkv + H * hd + 2 * F)};
    return h ? OK : NO_MEMORY;
}

/* Every layer over a run of rows, kernels on `threads` threads. With `sync` (runs of one step on
 * the threads of a team, a prefill chunk split between them), the team meets at a barrier after
 * each layer's cache writes: a piece of a chunk attends to the keys and values of the pieces
 * before it. Every thread then passes every barrier, on an error too. */
static int run_layers(const forge_layer *layers, int64_t count, const forge_dims *dims, const forge_run *r,
                      int64_t width, const forge_lora_rows *lora, int64_t adapters, int threads, int sync) {
    forge_scratch s;
    int status = scratch(dims, r->T, &s);
    for (int64_t l = 0; l < count && (sync || status == OK); l++) {
        if (status == OK) status = layer_in(layers + l, l, dims, r, &s, lora, adapters, threads);
        if (sync) {
#pragma omp barrier
        }
        if (status == OK) status = layer_out(layers + l, l, dims, r, width, &s, lora, adapters, threads);
    }
    free(s.h);
    return status;
}

/* Whether decode row r (0 < r) is another sequence's than row r - 1: a sequence's rows (its last
 * token, then its drafts) are consecutive, with the same block table and lengths one apart. */
static int starts_sequence(const int64_t *tables, int64_t width, const int32_t *lens, int64_t r) {
    return lens[r] != lens[r - 1] + 1 || memcmp(tables + r * width, tables + (r - 1) * width, sizeof(int64_t) * width);
}

/* In a step split by rows (no chunk split between threads), a thread that finishes its run takes
 * over part of another's at that one's next layer boundary, instead of waiting for it at the step's
 * end. The split's costs are estimates, and a thread preempted for a while (the server's event
 * loop, another process) falls behind its partner: the step took as long as the slower one, on
 * average ~1.4 ms past the other at 32 rows in process on a 2-vCPU machine, ~2.4 ms at 64, and
 * ~2.1-2.6 ms at 32 rows in a server at 32 streams. A running thread that sees another idle hands
 * it the second half of its decode rows (a sequence's rows together; a run with a prefill chunk
 * keeps its rows) for the layers left; a row's results do not depend on which thread computes it. */
typedef struct {
    forge_run runs[MAX_HANDOFFS];
    int64_t from[MAX_HANDOFFS];  /* the layer each handed-off run starts at */
    int64_t queued, taken;       /* runs handed off, and taken (written in the critical section) */
    int64_t pending;             /* runs not finished, handed-off ones included */
    int64_t idle;                /* threads waiting for a run */
    double stall_s;              /* tests: thread 0 starts its run this late, as if preempted */
} forge_handoffs;

/* The second half of run r's rows, where a sequence starts nearest the middle, if both halves hold
 * HANDOFF_ROWS rows: r keeps the first half; *rest gets the second. */
static int halve(forge_run *r, int64_t width, int64_t hd, int64_t D, forge_run *rest) {
    if (r->chunks || r->decodes != r->T || r->T < 2 * HANDOFF_ROWS) return 0;
    int64_t at = -1;
    for (int64_t d = 0; d <= r->T / 2 - HANDOFF_ROWS && at < 0; d++) {
        for (int side = 0; side < 2 && at < 0; side++) {
            const int64_t m = side ? r->T / 2 + d : r->T / 2 - d;
            if (starts_sequence(r->tables, width, r->lens, m)) at = m;
        }
    }
    if (at < 0) return 0;
    *rest = (forge_run){r->x + at * D, r->delta + at * D, r->T - at, r->slots + at, r->cos + at * hd,
                        r->sin + at * hd, r->T - at, r->tables + at * width, r->lens + at, 0, NULL};
    r->T = r->decodes = at;
    return 1;
}

/* Layers from .. count - 1 over run r on this thread alone, handing the second half of its rows to
 * an idle thread at a layer boundary where one waits. */
static int run_sharing(const forge_layer *layers, int64_t count, const forge_dims *dims, forge_run r, int64_t from,
                       int64_t width, forge_handoffs *share) {
    const int64_t D = dims->hidden, hd = dims->head_dim;
    forge_scratch s;  /* sized for the run's first rows, which are at least as many as it keeps */
    int status = scratch(dims, r.T, &s);
    if (status != OK) return status;
    if (share->stall_s > 0 && from == 0 && omp_get_thread_num() == 0) {
        const double until = omp_get_wtime() + share->stall_s;
        while (omp_get_wtime() < until) _mm_pause();
    }
    for (int64_t l = from; l < count && status == OK; l++) {
        forge_run rest;
        if (l > from && __atomic_load_n(&share->idle, __ATOMIC_ACQUIRE) > 0 && halve(&r, width, hd, D, &rest)) {
            int handed = 0;
            __atomic_add_fetch(&share->pending, 1, __ATOMIC_ACQ_REL);  /* before it can be taken */
#pragma omp critical(forge_handoffs)
            if (share->queued < MAX_HANDOFFS) {
                share->runs[share->queued] = rest;
                share->from[share->queued] = l;
                __atomic_store_n(&share->queued, share->queued + 1, __ATOMIC_RELEASE);
                handed = 1;
            }
            if (!handed) {  /* no room: take the rows back */
                __atomic_sub_fetch(&share->pending, 1, __ATOMIC_ACQ_REL);
                r.T = r.decodes = r.T + rest.T;
            }
        }
        status = layer_in(layers + l, l, dims, &r, &s, NULL, 0, 1);
        if (status == OK) status = layer_out(layers + l, l, dims, &r, width, &s, NULL, 0, 1);
    }
    free(s.h);
    return status;
}

/* One thread of the team: its own run, then runs other threads hand it, until none is left. */
static int share_rows(const forge_layer *layers, int64_t count, const forge_dims *dims, const forge_run *own,
                      int64_t width, forge_handoffs *share) {
    int status = run_sharing(layers, count, dims, *own, 0, width, share);
    for (;;) {
        __atomic_sub_fetch(&share->pending, 1, __ATOMIC_ACQ_REL);  /* the run just finished */
        __atomic_add_fetch(&share->idle, 1, __ATOMIC_ACQ_REL);
        forge_run next;
        int64_t from = -1, spins = 0;
        while (from < 0 && __atomic_load_n(&share->pending, __ATOMIC_ACQUIRE) > 0) {
            const int64_t queued = __atomic_load_n(&share->queued, __ATOMIC_ACQUIRE);
            if (queued > __atomic_load_n(&share->taken, __ATOMIC_ACQUIRE)) {  /* then take it in turn */
#pragma omp critical(forge_handoffs)
                if (share->taken < share->queued) {
                    next = share->runs[share->taken];
                    from = share->from[share->taken];
                    __atomic_store_n(&share->taken, share->taken + 1, __ATOMIC_RELEASE);
                }
            }
            if (from < 0 && ++spins > YIELD_AFTER_SPINS) sched_yield();  /* a core other threads may want */
            else if (from < 0) _mm_pause();
        }
        __atomic_sub_fetch(&share->idle, 1, __ATOMIC_ACQ_REL);
        if (from < 0) return status;  /* every run has finished */
        status |= run_sharing(layers, count, dims, next, from, width, share);
    }
}

/* How a step's T rows (decode rows 0 .. decodes - 1, then prefill chunks as forge_decode_layers
 * takes them) split between `threads` threads, a run each: runs i of rows bounds[i] .. bounds[i + 1],
 * each of at least SPLIT_ROWS rows, their costs as near equal as the rows allow. Returns the
 * number of runs (1: no split). A row costs row_keys (its projections' work, in keys' worth of
 * attention) plus the keys it attends to. A run starts at a sequence's first decode row (a drafted
 * sequence's rows read each other's keys and values, written in the same layer, and stay on one
 * thread), at the first chunk or anywhere in a chunk (forge_decode_layers then has the threads
 * meet after each layer's cache writes).
 *
 * Split by rows, the threads share no barrier in a step of decode rows, and one a layer with a
 * chunk split: split by weight tiles, as each kernel shares out its own work, every kernel ends in
 * one, ~300 a step on the default model. When another thread of the process (the server's event
 * loop) or another process takes a core for a moment, the other thread waits at the next barrier
 * for the one it preempted; by rows, it goes on with its own. Each thread then reads every weight
 * (the second read mostly from the shared L3), so the split is kept to steps whose rows make the
 * GEMMs compute-bound, and to machines of a few threads (MAX_SPLIT): with more, each thread's share
 * of the memory bandwidth and of the caches would be the smaller. A row's results are the same
 * either way (the kernels' results do not depend on the rows beside them). */
int64_t forge_split_rows(int64_t T, int64_t decodes, const int64_t *tables, int64_t width, const int32_t *lens,
                         int64_t chunks, const int64_t *chunk, double row_keys, int threads, int64_t *bounds) {
    const int64_t parts = threads;  /* each thread runs its kernels alone */
    if (parts < 2 || parts > MAX_SPLIT || T < SPLIT_ROWS * parts || T <= GEMM_ROWS) return 1;
    double *cost = malloc(sizeof(double) * (size_t)(T + 1));  /* cost[r]: rows 0 .. r - 1's */
    if (!cost) return 1;
    cost[0] = 0.0;
    for (int64_t d = 0; d < decodes; d++) cost[d + 1] = cost[d] + row_keys + lens[d];
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t first = chunk[3 * c], L = chunk[3 * c + 1], C = chunk[3 * c + 2];
        for (int64_t j = 0; j < L; j++) cost[first + j + 1] = cost[first + j] + row_keys + (double)(C - L + j + 1);
    }
    bounds[0] = 0;
    int64_t i = 1;
    for (; i < parts; i++) {
        const double target = cost[T] * (double)i / (double)parts;
        int64_t want = bounds[i - 1] + 1;  /* the row where the even split falls */
        while (want < T && cost[want + 1] - target < target - cost[want]) want++;
        const int64_t lowest = bounds[i - 1] + SPLIT_ROWS, highest = T - SPLIT_ROWS * (parts - i);
        int64_t r = -1;
        for (int64_t d = 0; d < T && r < 0; d++) {  /* the allowed start nearest it */
            for (int side = 0; side < 2 && r < 0; side++) {
                const int64_t at = side ? want + d : want - d;
                if (at >= lowest && at <= highest && (at >= decodes || starts_sequence(tables, width, lens, at)))
                    r = at;
            }
        }
        if (r < 0) break;
        bounds[i] = r;
    }
    free(cost);
    if (i < parts) return 1;
    bounds[parts] = T;
    return parts;
}

/* T tokens through `count` layers. x [T, hidden] fp32, the embeddings, is updated in place; delta
 * [T, hidden] bf16 is the last layer's MLP output on return, still to be added to x. slots [T]: each
 * token's cache slot; cos, sin [T, head_dim] bf16.
 * Rows 0 .. decodes - 1 are decode tokens (one query each: a sequence's next token, or one of its
 * verified drafts): tables [decodes, width] block ids and lens [decodes] context lengths (the
 * token included). Then `chunks` prefill chunks, chunk c [3]: its first row, its L rows and its C
 * context tokens (its own last), whose slots follow the previous chunks' in context_slots.
 * lora [adapters]: the rows on each LoRA adapter (none: 0). For tests, stall_s holds thread 0 back
 * that long at the start of a step split by rows (as if preempted), and *handoffs (when given) counts
 * the runs the threads handed each other (see forge_handoffs). */
int forge_decode_layers_stalled(const forge_layer *layers, int64_t count, const forge_dims *dims, float *x,
                                uint16_t *delta, int64_t T, const int64_t *slots, const uint16_t *cos,
                                const uint16_t *sin, int64_t decodes, const int64_t *tables, int64_t width,
                                const int32_t *lens, int64_t chunks, const int64_t *chunk,
                                const int64_t *context_slots, const forge_lora_rows *lora, int64_t adapters,
                                int threads, double stall_s, int64_t *handoffs) {
    const int64_t D = dims->hidden, H = dims->heads, Hkv = dims->kv_heads, hd = dims->head_dim;
    const int64_t F = dims->intermediate, Nqkv = (H + 2 * Hkv) * hd;
    for (int64_t l = 0; l < count; l++) {
        const forge_layer *p = layers + l;
        if (p->qkv.n != Nqkv || p->qkv.k != D || p->o.n != D || p->o.k != H * hd || p->gate_up.n != 2 * F ||
            p->gate_up.k != D || p->down.n != D || p->down.k != F)
            return BAD_SHAPE;
    }
    if (decodes < 0 || chunks < 0) return BAD_SHAPE;
    int64_t rows = decodes;  /* the chunks tile rows decodes .. T - 1, in order */
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t *k = chunk + 3 * c;
        if (k[0] != rows || k[1] < 1 || k[2] < k[1]) return BAD_SHAPE;
        rows += k[1];
    }
    if (rows != T) return BAD_SHAPE;
    /* the chunks as runs take them, then room for each run's pieces of them */
    forge_chunk *whole = malloc(sizeof(forge_chunk) * (size_t)((MAX_SPLIT + 1) * chunks + 1));
    if (!whole) return NO_MEMORY;
    const int64_t *context = context_slots;
    for (int64_t c = 0; c < chunks; c++) {
        whole[c] = (forge_chunk){chunk[3 * c], chunk[3 * c + 1], chunk[3 * c + 2], context};
        context += chunk[3 * c + 2];
    }
    const forge_run step = {x, delta, T, slots, cos, sin, decodes, tables, lens, chunks, whole};
    /* The step splits between the threads by rows (see forge_split_rows), but for LoRA adapters,
     * whose rows are listed for the whole step. */
    const double row_keys = (double)(D * Nqkv + H * hd * D + 3 * D * F) / (double)(8 * H * hd);
    int64_t bounds[MAX_SPLIT + 1];
    const int64_t parts = adapters ? 1 : forge_split_rows(T, decodes, tables, width, lens, chunks, chunk, row_keys,
                                                          threads, bounds);
    int status = OK;
    if (parts < 2) {
        status = run_layers(layers, count, dims, &step, width, lora, adapters, threads, 0);
        free(whole);
        return status;
    }
    forge_run runs[MAX_SPLIT];
    int sync = 0;
    for (int64_t i = 0; i < parts; i++) {
        const int64_t r0 = bounds[i], r1 = bounds[i + 1], d1 = r1 < decodes ? r1 : decodes;
        forge_run *r = runs + i;
        *r = (forge_run){x + r0 * D, delta + r0 * D, r1 - r0, slots + r0, cos + r0 * hd, sin + r0 * hd,
                         d1 > r0 ? d1 - r0 : 0, r0 < decodes ? tables + r0 * width : NULL,
                         r0 < decodes ? lens + r0 : NULL, 0, whole + chunks * (i + 1)};
        for (int64_t c = 0; c < chunks; c++) {  /* the part of each chunk in rows r0 .. r1 - 1 */
            const forge_chunk *k = whole + c;
            const int64_t a = k->first > r0 ? k->first : r0, b = k->first + k->rows < r1 ? k->first + k->rows : r1;
            if (a >= b) continue;
            sync |= a > k->first || b < k->first + k->rows;
            /* rows a .. b - 1 see the context up to row b - 1's own token */
            const int64_t length = k->length - (k->first + k->rows - b);
            whole[chunks * (i + 1) + r->chunks++] = (forge_chunk){a - r0, b - a, length, k->slots};
        }
    }
    forge_handoffs share = {.pending = parts, .stall_s = stall_s};
#pragma omp parallel num_threads(parts) reduction(| : status)
    {
        if (omp_get_num_threads() == parts && !sync) {
            status |= share_rows(layers, count, dims, runs + omp_get_thread_num(), width, &share);
        } else if (omp_get_num_threads() == parts) {
            status |= run_layers(layers, count, dims, runs + omp_get_thread_num(), width, lora, 0, 1, sync);
        } else {  /* fewer threads than runs (inside another parallel region): one thread, the whole step */
#pragma omp single
            status |= run_layers(layers, count, dims, &step, width, lora, 0, threads, 0);
        }
    }
    if (handoffs) *handoffs += share.queued;
    free(whole);
    return status;
}

/* forge_decode_layers_stalled without the test's stall. */
int forge_decode_layers(const forge_layer *layers, int64_t count, const forge_dims *dims, float *x, uint16_t *delta,
                        int64_t T, const int64_t *slots, const uint16_t *cos, const uint16_t *sin, int64_t decodes,
                        const int64_t *tables, int64_t width, const int32_t *lens, int64_t chunks,
                        const int64_t *chunk, const int64_t *context_slots, const forge_lora_rows *lora,
                        int64_t adapters, int threads) {
    return forge_decode_layers_stalled(layers, count, dims, x, delta, T, slots, cos, sin, decodes, tables, width, lens,
                                       chunks, chunk, context_slots, lora, adapters, threads, 0.0, NULL);
}
