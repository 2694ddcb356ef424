/* Sampling on CPU, fp32, with no [rows, vocab] tensor written out (raypaged.worker.sampler's CPU fast paths).
 *
 * Greedy (raypaged_greedy_f32): each row's argmax and its log-probability in two passes over the row. Pass 1 keeps
 * 16 running maxima side by side with the first index of each, then takes the lowest index among the lanes holding
 * the greatest (torch.argmax's first occurrence). Pass 2 sums exp(x - max) in 16 float lanes over runs of SUM_RUN
 * values, each run's sums added into 16 double lanes; the chosen token's log-probability is then -log(sum), which
 * is log_softmax's x - max - log(sum) at the max. On 2 EPYC cores, [32, 49152] logits: 214 us, against 1,240 for
 * torch's argmax (441), log_softmax (343) and their gathers.
 *
 * Sampled (raypaged_sample_f32): temperature, top-k, top-p and min-p in vLLM's order, then a draw by inverse CDF
 * for the row's uniform, as the torch path's _warped and _draw (the same token for the same uniform, to float
 * rounding). Each token's weight exp((x - max) / T) is written once to a per-thread row. Top-k and top-p each keep a
 * prefix of one order (logit descending, then index ascending), found without sorting the row: the tokens within
 * reach of the max are gathered (top-p's reach is where all the tokens past it weigh less than 1 - top_p of the
 * mass; top-k's widens until it holds k), a histogram of their logits with each bucket's count and weight says which
 * bucket the prefix ends in, and only that bucket's tokens are split again until few enough are left to sort.
 * Top-p's mass is that of the top-k prefix (it renormalizes over it); min-p then drops the kept tokens whose weight
 * is below min_p (the max weighs 1, so min_p x the max probability). The draw sums the kept weights in blocks of
 * DRAW_BLOCK, picks the block holding u x the total, then the token within it.
 *
 * A row whose max is not finite (a NaN, or +-inf at the max) or whose sum is not finite (a NaN past the max) is left
 * to torch: greedy returns that row's index + 1, and the caller takes the general path for the whole batch; the
 * sampled draw gives that row token -1, and the caller draws it (it alone) in torch.
 * Rows are split between the threads; each row is one thread's, so the result does not depend on the thread count.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_exp.h"

#define LANES 16
#define SUM_RUN 1024 /* values summed in float before their sums go into double: 64 per lane */
#define HIST 1024    /* buckets of a histogram */
#define TOP_K_DEPTH 4.0 /* top-k looks first at the tokens within this of the max, (max - x) / T */
#define SORTED 256   /* a bucket of at most this many tokens is sorted rather than split again */
#define SPLITS 8     /* splits of a bucket before its tokens are sorted whatever their number */
#define DRAW_BLOCK 1024
#define MIN_EXP -87.0f /* a weight below exp(MIN_EXP) is 0: a -inf logit never weighs anything */

typedef float vecf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t veci __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef float vecf_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

static inline vecf load(const float *p) { return *(const vecf_unaligned *)p; }

/* The row's max and the index of its first occurrence (vocab when there is none: an all-NaN row). */
static int64_t row_argmax(const float *x, int64_t vocab, float *max_out) {
    /* 16 lanes as GCC's generic vectors (one AVX-512 register, or a pair of AVX ones): where a value beats its
     * lane's best, the compare's all-ones mask selects the value and its index */
    float max = -INFINITY;
    int64_t token = vocab, t = 0; /* token: no index yet, past every real one */
    if (vocab >= LANES) {
        vecf best = load(x);
        veci at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, index = at;
        const veci step = index - index + LANES;
        for (t = LANES; t + LANES <= vocab; t += LANES) {
            const vecf v = load(x + t);
            index += step;
            const veci beats = v > best;
            best = (vecf)((beats & (veci)v) | (~beats & (veci)best));
            at = (beats & index) | (~beats & at);
        }
        for (int l = 0; l < LANES; ++l)
            if (best[l] > max || (best[l] == max && at[l] < token)) {
                max = best[l];
                token = at[l];
            }
    }
    for (; t < vocab; ++t) /* the last vocab % 16 (all of them after every lane's indices) */
        if (x[t] > max) {
            max = x[t];
            token = t;
        }
    *max_out = max; /* a NaN is never > the running max, so a row with one is caught by its sum */
    return token;
}

/* The sum of exp((x - max) / temperature) over the row (float lanes over runs of SUM_RUN, added in double); with
 * `weights`, each term is written there, and a term below exp(MIN_EXP) is 0. */
static double row_exp_sum(const float *x, int64_t vocab, float max, float temperature, float *weights) {
    double sums[LANES] = {0};
    for (int64_t t = 0; t < vocab;) {
        float part[LANES] = {0};
        const int64_t end = t + SUM_RUN < vocab ? t + SUM_RUN : vocab;
        if (weights == NULL) { /* temperature 1: greedy's raw sum */
            for (; t + LANES <= end; t += LANES)
                for (int l = 0; l < LANES; ++l) part[l] += exp_nonpositive(x[t + l] - max);
            for (int l = 0; t < end; ++l, ++t) part[l] += exp_nonpositive(x[t] - max);
        } else {
            for (; t + LANES <= end; t += LANES)
                for (int l = 0; l < LANES; ++l) {
                    const float a = (x[t + l] - max) / temperature;
                    const float w = a < MIN_EXP ? 0.0f : exp_nonpositive(a);
                    weights[t + l] = w;
                    part[l] += w;
                }
            for (int l = 0; t < end; ++l, ++t) {
                const float a = (x[t] - max) / temperature;
                weights[t] = a < MIN_EXP ? 0.0f : exp_nonpositive(a);
                part[l] += weights[t];
            }
        }
        for (int l = 0; l < LANES; ++l) sums[l] += part[l];
    }
    double sum = 0.0;
    for (int l = 0; l < LANES; ++l) sum += sums[l];
    return sum;
}

/* Writes token_ids[r] and logprobs[r] for rows [0, rows); returns 0, or 1 + the first row left to torch. */
int raypaged_greedy_f32(const float *logits, int64_t rows, int64_t vocab, int64_t row_stride, int64_t *token_ids,
                        float *logprobs, int num_threads) {
    int64_t refused = rows; /* the lowest row whose max or sum is not finite */
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(min : refused)
    for (int64_t r = 0; r < rows; ++r) {
        const float *x = logits + r * row_stride;
        float max;
        const int64_t token = row_argmax(x, vocab, &max);
        const double sum = isfinite(max) ? row_exp_sum(x, vocab, max, 1.0f, NULL) : NAN;
        if (!isfinite(sum)) {
            refused = r < refused ? r : refused;
            continue;
        }
        token_ids[r] = token;
        logprobs[r] = (float)-log(sum);
    }
    return refused < rows ? (int)(refused + 1) : 0;
}

typedef struct {
    float x;
    int32_t i;
} token; /* a token's logit and index */

/* The order top-k and top-p keep a prefix of: logit descending, then index ascending. */
static inline int ahead(float xa, int64_t ia, float xb, int64_t ib) { return xa > xb || (xa == xb && ia < ib); }

static int by_order(const void *a, const void *b) {
    const token *p = a, *q = b;
    return ahead(p->x, p->i, q->x, q->i) ? -1 : ahead(q->x, q->i, p->x, p->i);
}

typedef struct {
    float x;     /* the prefix's last token: its logit */
    int64_t i;   /* and its index */
    double mass; /* the prefix's weight */
} prefix;

static inline int kept(float x, int64_t i, prefix p) { return x > p.x || (x == p.x && i <= p.i); }

typedef struct {
    float *weights; /* [vocab] */
    token *tokens;  /* [vocab]: the tokens of the bucket being split */
    int32_t count[HIST];
    double mass[HIST];
} scratch;

/* The bucket of a logit x: (top - x) x scale clamped to [0, HIST - 2], never decreasing as x decreases; a -inf goes
 * in the last, HIST - 1. */
static inline int bucket(float top, float x, float scale) {
    if (!(x > -INFINITY)) return HIST - 1;
    const float d = (top - x) * scale;
    return d < (float)(HIST - 2) ? (int)d : HIST - 2;
}

/* Whether a prefix of count n and weight m reaches `count` (when count > 0), else `mass`. */
#define REACHED(count, mass, n, m) ((count) > 0 ? (n) >= (count) : (m) >= (mass))

/* The first bucket of the histogram at which the order's prefix reaches `count` or `mass`, the counts and weights of
 * the buckets before it added to *n and *m; the last bucket holding a token when none does (rounding). */
static int walk(const scratch *s, int64_t count, double mass, int64_t *n, double *m) {
    int last = HIST - 1;
    while (last > 0 && s->count[last] == 0) --last;
    int b = 0;
    for (; b < last && !REACHED(count, mass, *n + s->count[b], *m + s->mass[b]); ++b) {
        *n += s->count[b];
        *m += s->mass[b];
    }
    return b;
}

/* The tokens whose logit is at least `floor_x`, in index order, into `out`; their number. A run of 64 with none (most
 * of a peaked row) costs four compares. */
static int64_t gather(const float *x, int64_t vocab, float floor_x, token *out) {
    const vecf zero = {0}, floor = zero + floor_x;
    int64_t n = 0, t = 0;
    for (; t + 4 * LANES <= vocab; t += 4 * LANES) {
        const veci in = (load(x + t) >= floor) | (load(x + t + LANES) >= floor) | (load(x + t + 2 * LANES) >= floor) |
                        (load(x + t + 3 * LANES) >= floor);
        int32_t any = 0;
        for (int l = 0; l < LANES; ++l) any |= in[l];
        if (any)
            for (int64_t j = t; j < t + 4 * LANES; ++j) { /* written whether or not kept: no branch to mispredict */
                out[n] = (token){x[j], (int32_t)j};
                n += x[j] >= floor_x;
            }
    }
    for (; t < vocab; ++t) {
        out[n] = (token){x[t], (int32_t)t};
        n += x[t] >= floor_x;
    }
    return n;
}

/* The logit `depth` below the max in units of the temperature (-inf past float's range). */
static inline float floor_at(float max, double depth, float temperature) {
    const double floor_x = (double)max - depth * temperature;
    return floor_x > -FLT_MAX ? (float)floor_x : -INFINITY;
}

/* The shortest prefix of the order whose count reaches `count` (when count > 0), else whose weight (of `w`, NULL for
 * none) reaches `mass`; when none does (a mass that a bucket's sum reaches and its tokens' running sum misses by
 * rounding), the prefix through that bucket's last token.
 * Only the tokens of logit at least `floor_x` (a prefix of the order) are looked at: for a count, while they are
 * fewer, those 4x as far below the max, then all; for a mass, the caller chose `floor_x` to be enough. */
static prefix shortest_prefix(const float *x, const float *w, int64_t vocab, float max, int64_t count, double mass,
                              float floor_x, scratch *s) {
    int64_t n_before = 0; /* the count and weight of the order before the tokens being split */
    double m_before = 0.0;
    int64_t n = gather(x, vocab, floor_x, s->tokens);
    for (int deeper = 0; count > 0 && n < count; ++deeper) /* too few for the top-k: 4x as deep, then all */
        n = gather(x, vocab, deeper ? -INFINITY : max - 4.0f * (max - floor_x), s->tokens);
    token *tokens = s->tokens;
    float hi = -INFINITY; /* the bucket's greatest logit */
    int ties = 0;         /* the tokens left are many ties at hi, and -infs */
    for (int split = 0; n > SORTED && split < SPLITS; ++split) {
        float lo = INFINITY; /* the least finite logit (a -inf goes in the last bucket) */
        hi = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
            hi = tokens[j].x > hi ? tokens[j].x : hi;
            lo = tokens[j].x < lo && tokens[j].x > -INFINITY ? tokens[j].x : lo;
        }
        if ((ties = !(hi > lo))) break;
        const float range = hi - lo, split_scale = isfinite(range) ? (HIST - 2) / range : 0.0f;
        memset(s->count, 0, sizeof(s->count));
        memset(s->mass, 0, sizeof(s->mass));
        for (int64_t j = 0; j < n; ++j) {
            const int c = bucket(hi, tokens[j].x, split_scale);
            s->count[c] += 1;
            s->mass[c] += w != NULL ? w[tokens[j].i] : 0.0f;
        }
        const int b = walk(s, count, mass, &n_before, &m_before);
        int64_t left = 0;
        for (int64_t j = 0; j < n; ++j) {
            if (bucket(hi, tokens[j].x, split_scale) == b) tokens[left++] = tokens[j];
        }
        n = left;
    }
    /* the tokens left are sorted, or are ties and -infs, each group in index order: the ties first */
    const int sorted = !ties;
    if (sorted) qsort(tokens, (size_t)n, sizeof(token), by_order);
    token at = tokens[0]; /* the bucket holds a token (walk) */
    for (int pass = 0; pass < 2 - sorted; ++pass)
        for (int64_t j = 0; j < n; ++j)
            if (sorted || (tokens[j].x == hi) == (pass == 0)) {
                at = tokens[j];
                n_before += 1;
                m_before += w != NULL ? w[at.i] : 0.0f;
                if (REACHED(count, mass, n_before, m_before)) return (prefix){at.x, at.i, m_before};
            }
    return (prefix){at.x, at.i, m_before}; /* the bucket's sum reached it, the tokens' running one did not */
}

/* The kept token (in `keep`, weight at least min_p) at u x their total weight, by blocks of DRAW_BLOCK. */
static int64_t draw(const float *x, const float *w, int64_t vocab, prefix keep, float min_p, double u) {
    const int64_t blocks = (vocab + DRAW_BLOCK - 1) / DRAW_BLOCK;
    double cdf[blocks];
    double total = 0.0;
    const vecf zero = {0}, last_x = zero + keep.x, floor = zero + min_p;
    const veci lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const veci last_i = lane - lane + (int32_t)(keep.i < vocab ? keep.i : vocab); /* vocab < 2^31 */
    for (int64_t k = 0; k < blocks; ++k) {
        const int64_t end = (k + 1) * DRAW_BLOCK < vocab ? (k + 1) * DRAW_BLOCK : vocab;
        vecf part = zero; /* 16 float lanes; a kept token's weight selected by the compares' all-ones masks */
        int64_t t = k * DRAW_BLOCK;
        for (; t + LANES <= end; t += LANES) {
            const vecf v = load(x + t), weight = load(w + t);
            const veci index = lane + (int32_t)t;
            const veci in = ((v > last_x) | ((v == last_x) & (index <= last_i))) & (weight >= floor);
            part += (vecf)(in & (veci)weight);
        }
        for (int l = 0; t < end; ++l, ++t) part[l] += kept(x[t], t, keep) && w[t] >= min_p ? w[t] : 0.0f;
        for (int l = 0; l < LANES; ++l) total += part[l];
        cdf[k] = total;
    }
    double target = u * total;
    if (!(target < total)) target = nextafter(total, 0.0); /* u x total rounded up to the total */
    int64_t k = 0;
    while (k < blocks - 1 && !(cdf[k] > target)) ++k;
    double acc = k > 0 ? cdf[k - 1] : 0.0;
    int64_t last = -1; /* the block's last kept token that weighs anything (the block's sum may round above the
                          running one) */
    const int64_t end = (k + 1) * DRAW_BLOCK < vocab ? (k + 1) * DRAW_BLOCK : vocab;
    for (int64_t t = k * DRAW_BLOCK; t < end; ++t)
        if (w[t] > 0.0f && w[t] >= min_p && kept(x[t], t, keep)) {
            last = t;
            if ((acc += w[t]) > target) return t;
        }
    return last;
}

/* This thread's scratch for rows of `vocab` tokens, kept from call to call (OpenMP's threads live on, and a fresh
 * ~600 KB allocation a call would be mapped and zeroed anew by the kernel each time), grown when a vocabulary is
 * larger; NULL when memory runs out. */
static scratch *thread_scratch(int64_t vocab) {
    static __thread scratch *kept = NULL;
    static __thread int64_t capacity = 0;
    if (kept != NULL && capacity >= vocab) return kept;
    if (kept != NULL) {
        free(kept->weights);
        free(kept->tokens);
        free(kept);
        kept = NULL;
        capacity = 0;
    }
    scratch *s = malloc(sizeof(scratch));
    float *weights = malloc((size_t)vocab * sizeof(float));
    token *tokens = malloc((size_t)vocab * sizeof(token));
    if (s == NULL || weights == NULL || tokens == NULL) {
        free(s);
        free(weights);
        free(tokens);
        return NULL;
    }
    s->weights = weights;
    s->tokens = tokens;
    kept = s;
    capacity = vocab;
    return kept;
}

/* 1 + the number of the row's logits above `value`: its rank (1: the likeliest). */
static int64_t rank_of(const float *y, int64_t vocab, float value) {
    const vecf zero = {0}, v = zero + value;
    veci above = (veci)(zero - zero); /* each lane's count */
    int64_t t = 0;
    for (; t + LANES <= vocab; t += LANES) above -= load(y + t) > v; /* a true compare is -1 */
    int64_t count = 1;
    for (int l = 0; l < LANES; ++l) count += above[l];
    for (; t < vocab; ++t) count += y[t] > value;
    return count;
}

/* The row's `n` largest logits, in the order (descending, then index ascending), into s->tokens[0, n); n. */
static int64_t top_tokens(const float *y, int64_t vocab, float max, int64_t n, scratch *s) {
    if (n <= 0) return 0;
    const prefix last = shortest_prefix(y, NULL, vocab, max, n, 0.0, floor_at(max, TOP_K_DEPTH, 1.0f), s);
    const int64_t found = gather(y, vocab, last.x, s->tokens); /* the prefix, and ties after its last token */
    int64_t in = 0;
    for (int64_t j = 0; j < found; ++j)
        if (kept(s->tokens[j].x, s->tokens[j].i, last)) s->tokens[in++] = s->tokens[j];
    qsort(s->tokens, (size_t)in, sizeof(token), by_order);
    return in < n ? in : n;
}

/* Writes token_ids[r] and logprobs[r] for rows [0, rows) of `logits`: a row of temperature 0 takes its argmax; top_k
 * 0 and top_p 1 keep every token. The log-probability is of the same row of `raw` (the logits before penalties and
 * bans), or of `logits` when `raw` is NULL. With `tops`, a row whose tops[r] is not negative also gets the token's
 * rank in that row (ranks[r]) and the row's tops[r] likeliest tokens and their log-probabilities, likeliest first
 * (top_ids and top_logprobs, [rows, max_top]). A row left to torch gets token -1; returns their number. */
int raypaged_sample_f32(const float *logits, int64_t rows, int64_t vocab, int64_t row_stride, const float *raw,
                        int64_t raw_stride, const float *temperature, const int64_t *top_k, const float *top_p,
                        const float *min_p, const double *uniforms, int64_t *token_ids, float *logprobs,
                        const int64_t *tops, int64_t max_top, int64_t *ranks, int64_t *top_ids, float *top_logprobs,
                        int num_threads) {
    int64_t refused = 0; /* rows whose max or sum is not finite, or that found no memory */
#pragma omp parallel num_threads(num_threads) reduction(+ : refused)
    {
        scratch *s = thread_scratch(vocab);
        const int ready = s != NULL;
        float *weights = ready ? s->weights : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; ++r) {
            const float *x = logits + r * row_stride, *y = raw == NULL ? x : raw + r * raw_stride;
            const float t = temperature[r];
            float max, raw_max;
            int64_t chosen = row_argmax(x, vocab, &max);
            double raw_sum; /* the logprob's: of the raw row */
            if (y != x) {
                row_argmax(y, vocab, &raw_max);
                raw_sum = isfinite(raw_max) ? row_exp_sum(y, vocab, raw_max, 1.0f, NULL) : NAN;
            } else {
                raw_max = max;
                raw_sum = isfinite(max) ? row_exp_sum(x, vocab, max, 1.0f, NULL) : NAN;
            }
            /* a sampled row's weights and their mass (which also finds a NaN past the max); a greedy row drawing from
             * a penalized copy checks that copy by a sum of its own */
            double mass = raw_sum;
            if (!ready || !isfinite(max))
                mass = NAN;
            else if (t > 0.0f)
                mass = row_exp_sum(x, vocab, max, t, weights);
            else if (y != x)
                mass = row_exp_sum(x, vocab, max, 1.0f, NULL);
            if (!isfinite(mass) || !isfinite(raw_sum)) {
                token_ids[r] = -1;
                refused += 1;
                continue;
            }
            if (t > 0.0f) {
                prefix keep = {-INFINITY, vocab, mass};
                if (top_k[r] > 0 && top_k[r] < vocab)
                    keep = shortest_prefix(x, weights, vocab, max, top_k[r], 0.0, floor_at(max, TOP_K_DEPTH, t), s);
                if (top_p[r] < 1.0f) {
                    /* within the top-k; without one, past this depth every token weighs below exp(-depth), all of
                     * them together below 1 - top_p of the kept mass (at least the max's 1): the prefix ends before */
                    const double depth = log((double)vocab / (1.0 - top_p[r])) + 1.0;
                    const float floor_x = keep.i < vocab ? keep.x : floor_at(max, depth, t);
                    const double mass = (double)top_p[r] * keep.mass;
                    const prefix p = shortest_prefix(x, weights, vocab, max, 0, mass, floor_x, s);
                    keep = ahead(p.x, p.i, keep.x, keep.i) ? p : keep;
                }
                chosen = draw(x, weights, vocab, keep, min_p[r], uniforms[r]);
                if (chosen < 0) { /* no kept token weighs anything: never so while the max is kept, as it always is */
                    token_ids[r] = -1;
                    refused += 1;
                    continue;
                }
            }
            token_ids[r] = chosen;
            const double log_sum = log(raw_sum);
            logprobs[r] = (float)((double)(y[chosen] - raw_max) - log_sum);
            if (tops != NULL && tops[r] >= 0) {
                ranks[r] = rank_of(y, vocab, y[chosen]);
                const int64_t n = top_tokens(y, vocab, raw_max, tops[r] < vocab ? tops[r] : vocab, s);
                for (int64_t j = 0; j < n; ++j) {
                    top_ids[r * max_top + j] = s->tokens[j].i;
                    top_logprobs[r * max_top + j] = (float)((double)(s->tokens[j].x - raw_max) - log_sum);
                }
            }
        }
    }
    return (int)refused;
}
