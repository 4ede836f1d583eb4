// kvcapture: capture named llama.cpp graph tensors through the scheduler's eval callback (cb_eval).
//
// llama.cpp's scheduler calls `kvc_eval_cb(t, ask=true, cap)` for every graph node; we answer whether
// `t`'s name is one of the wanted names (no allocation, no copy on that path). For a wanted node the
// scheduler computes the graph up to it and calls `kvc_eval_cb(t, ask=false, cap)`: we copy its data
// (through ggml_backend_tensor_get, so the tensor may live on any backend, a GPU included) into one
// growing float32 arena and record an event (wanted-name index, ne[0..3], offset). Python reads the
// events back through the accessors below and calls kvc_clear to drop them.
//
// Only contiguous F32 and F16 tensors are captured (F16 converted to F32); any other wanted tensor is
// skipped and counted (kvc_skipped). The callback always returns true on the ask=false path: false
// would make the scheduler cancel the graph compute.
//
// Threading: llama.cpp calls the callback from the thread that runs llama_decode; the caller must not
// read or clear a capture concurrently with a decode on it (kvagent's engine lock serialises them).

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-backend.h"

#define KVC_VERSION "1"
#define KVC_NAME_MAX GGML_MAX_NAME

enum kvc_skip_reason {
    KVC_SKIP_NONCONTIGUOUS = 0,  // a wanted tensor that is not contiguous
    KVC_SKIP_TYPE = 1,           // a wanted tensor neither F32 nor F16
    KVC_SKIP_NOMEM = 2,          // the arena could not grow
    KVC_SKIP_COUNT = 3,
};

typedef struct {
    int32_t name_index;  // index of the wanted name (kvc_want's return value)
    int32_t src_type;    // ggml type of the source tensor (0 F32, 1 F16)
    int64_t ne[GGML_MAX_DIMS];
    size_t offset;       // first float of the data in the arena
    size_t n;            // number of floats
} kvc_event;

typedef struct kvc_capture {
    int enabled;
    // wanted names, with their FNV-1a hashes for a cheap first comparison on the ask path
    char (*names)[KVC_NAME_MAX];
    uint64_t * hashes;
    int n_names, cap_names;
    // captured events and their float32 data
    kvc_event * events;
    size_t n_events, cap_events;
    float * data;
    size_t n_data, cap_data;
    // staging buffer for F16 sources
    uint16_t * staging;
    size_t cap_staging;
    // counters
    int64_t n_asked;
    int64_t skipped[KVC_SKIP_COUNT];
} kvc_capture;

static uint64_t kvc_hash(const char * s) {
    uint64_t h = 1469598103934665603ULL;
    for (; *s; ++s) {
        h ^= (unsigned char) *s;
        h *= 1099511628211ULL;
    }
    return h;
}

static int kvc_find(const kvc_capture * cap, const char * name) {
    if (cap->n_names == 0) {
        return -1;
    }
    const uint64_t h = kvc_hash(name);
    for (int i = 0; i < cap->n_names; ++i) {
        if (cap->hashes[i] == h && strcmp(cap->names[i], name) == 0) {
            return i;
        }
    }
    return -1;
}

// grow *buf (elements of `size` bytes, capacity *cap) to hold at least `need`; 0 on success
static int kvc_reserve(void ** buf, size_t * cap, size_t need, size_t size) {
    if (need <= *cap) {
        return 0;
    }
    size_t n = *cap ? *cap : 16;
    while (n < need) {
        n *= 2;
    }
    void * p = realloc(*buf, n * size);
    if (!p) {
        return -1;
    }
    *buf = p;
    *cap = n;
    return 0;
}

// -- lifetime ---------------------------------------------------------------------------------------
const char * kvc_version(void) { return KVC_VERSION; }

kvc_capture * kvc_new(void) {
    kvc_capture * cap = (kvc_capture *) calloc(1, sizeof(kvc_capture));
    if (cap) {
        cap->enabled = 1;
    }
    return cap;
}

void kvc_free(kvc_capture * cap) {
    if (!cap) {
        return;
    }
    free(cap->names);
    free(cap->hashes);
    free(cap->events);
    free(cap->data);
    free(cap->staging);
    free(cap);
}

// -- configuration ----------------------------------------------------------------------------------
// Want tensors named exactly `name`. Returns its index (the same for a name wanted twice), or -1 when
// the name is empty or longer than GGML_MAX_NAME - 1, or memory ran out.
int kvc_want(kvc_capture * cap, const char * name) {
    if (!cap || !name || !*name || strlen(name) >= KVC_NAME_MAX) {
        return -1;
    }
    int i = kvc_find(cap, name);
    if (i >= 0) {
        return i;
    }
    size_t cap_names = (size_t) cap->cap_names;
    size_t cap_hashes = cap_names;
    if (kvc_reserve((void **) &cap->names, &cap_names, (size_t) cap->n_names + 1, KVC_NAME_MAX) ||
        kvc_reserve((void **) &cap->hashes, &cap_hashes, (size_t) cap->n_names + 1, sizeof(uint64_t))) {
        return -1;
    }
    cap->cap_names = (int) (cap_names < cap_hashes ? cap_names : cap_hashes);
    i = cap->n_names++;
    strcpy(cap->names[i], name);
    cap->hashes[i] = kvc_hash(name);
    return i;
}

// Drop captured events, data and counters; keep the wanted names and the allocated memory.
void kvc_clear(kvc_capture * cap) {
    if (!cap) {
        return;
    }
    cap->n_events = 0;
    cap->n_data = 0;
    cap->n_asked = 0;
    memset(cap->skipped, 0, sizeof(cap->skipped));
}

// Forget every wanted name (and the captured events, whose name indices would dangle).
void kvc_unwant_all(kvc_capture * cap) {
    if (cap) {
        cap->n_names = 0;
        kvc_clear(cap);
    }
}

int kvc_n_wants(const kvc_capture * cap) { return cap ? cap->n_names : 0; }

const char * kvc_want_name(const kvc_capture * cap, int i) {
    return (cap && i >= 0 && i < cap->n_names) ? cap->names[i] : NULL;
}

void kvc_set_enabled(kvc_capture * cap, int enabled) {
    if (cap) {
        cap->enabled = enabled != 0;
    }
}

int kvc_enabled(const kvc_capture * cap) { return cap ? cap->enabled : 0; }

// -- the callback -----------------------------------------------------------------------------------
static void kvc_capture_tensor(kvc_capture * cap, int name_index, struct ggml_tensor * t) {
    if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16) {
        cap->skipped[KVC_SKIP_TYPE]++;
        return;
    }
    if (!ggml_is_contiguous(t)) {
        cap->skipped[KVC_SKIP_NONCONTIGUOUS]++;
        return;
    }
    const size_t n = (size_t) ggml_nelements(t);
    const size_t nbytes = ggml_nbytes(t);
    if (kvc_reserve((void **) &cap->events, &cap->cap_events, cap->n_events + 1, sizeof(kvc_event)) ||
        kvc_reserve((void **) &cap->data, &cap->cap_data, cap->n_data + n, sizeof(float))) {
        cap->skipped[KVC_SKIP_NOMEM]++;
        return;
    }
    float * dst = cap->data + cap->n_data;
    if (t->type == GGML_TYPE_F32) {
        ggml_backend_tensor_get(t, dst, 0, nbytes);
    } else {
        if (kvc_reserve((void **) &cap->staging, &cap->cap_staging, n, sizeof(uint16_t))) {
            cap->skipped[KVC_SKIP_NOMEM]++;
            return;
        }
        ggml_backend_tensor_get(t, cap->staging, 0, nbytes);
        ggml_fp16_to_fp32_row((const ggml_fp16_t *) cap->staging, dst, (int64_t) n);
    }
    kvc_event * ev = &cap->events[cap->n_events++];
    ev->name_index = name_index;
    ev->src_type = (int32_t) t->type;
    for (int d = 0; d < GGML_MAX_DIMS; ++d) {
        ev->ne[d] = t->ne[d];
    }
    ev->offset = cap->n_data;
    ev->n = n;
    cap->n_data += n;
}

// ggml_backend_sched_eval_callback. ask: whether `t` is wanted (enabled and its name wanted).
// !ask: copy a wanted tensor's data; always returns true (false would cancel the graph compute).
bool kvc_eval_cb(struct ggml_tensor * t, bool ask, void * user_data) {
    kvc_capture * cap = (kvc_capture *) user_data;
    if (ask) {
        if (!cap || !cap->enabled || !t) {
            return false;
        }
        cap->n_asked++;
        return kvc_find(cap, t->name) >= 0;
    }
    if (!cap || !cap->enabled || !t) {
        return true;
    }
    const int i = kvc_find(cap, t->name);
    if (i >= 0) {
        kvc_capture_tensor(cap, i, t);
    }
    return true;
}

// -- reading back -----------------------------------------------------------------------------------
// Event pointers and data stay valid until the next decode (the arena may move) or kvc_clear.
size_t kvc_n_events(const kvc_capture * cap) { return cap ? cap->n_events : 0; }

static const kvc_event * kvc_event_at(const kvc_capture * cap, size_t i) {
    return (cap && i < cap->n_events) ? &cap->events[i] : NULL;
}

int kvc_event_name(const kvc_capture * cap, size_t i) {
    const kvc_event * ev = kvc_event_at(cap, i);
    return ev ? ev->name_index : -1;
}

int kvc_event_src_type(const kvc_capture * cap, size_t i) {
    const kvc_event * ev = kvc_event_at(cap, i);
    return ev ? ev->src_type : -1;
}

// Copies ne[0..3] of event i into `ne` (ggml order: ne[0] is the fastest-varying dimension).
int kvc_event_ne(const kvc_capture * cap, size_t i, int64_t * ne) {
    const kvc_event * ev = kvc_event_at(cap, i);
    if (!ev || !ne) {
        return -1;
    }
    for (int d = 0; d < GGML_MAX_DIMS; ++d) {
        ne[d] = ev->ne[d];
    }
    return 0;
}

// Offset (in floats, into kvc_data) and size (in floats) of event i's data.
size_t kvc_event_offset(const kvc_capture * cap, size_t i) {
    const kvc_event * ev = kvc_event_at(cap, i);
    return ev ? ev->offset : 0;
}

size_t kvc_event_size(const kvc_capture * cap, size_t i) {
    const kvc_event * ev = kvc_event_at(cap, i);
    return ev ? ev->n : 0;
}

const float * kvc_event_data(const kvc_capture * cap, size_t i) {
    const kvc_event * ev = kvc_event_at(cap, i);
    return ev ? cap->data + ev->offset : NULL;
}

// The whole arena: every event's data back to back, kvc_n_data floats.
const float * kvc_data(const kvc_capture * cap) { return cap ? cap->data : NULL; }

size_t kvc_n_data(const kvc_capture * cap) { return cap ? cap->n_data : 0; }

// Wanted tensors skipped since the last kvc_clear, by reason (enum kvc_skip_reason); -1 for a bad reason.
int64_t kvc_skipped(const kvc_capture * cap, int reason) {
    if (!cap || reason < 0 || reason >= KVC_SKIP_COUNT) {
        return -1;
    }
    return cap->skipped[reason];
}

// Graph nodes asked about (while enabled) since the last kvc_clear.
int64_t kvc_n_asked(const kvc_capture * cap) { return cap ? cap->n_asked : 0; }

// -- preemption ------------------------------------------------------------------------------------
// llama.cpp's abort callback (ggml_abort_callback, checked before every graph node on the CPU): true when the
// flag reads KVC_PREEMPT_REQUESTED. kvagent's scheduler arms the flag around a prefill chunk larger than its
// usual one and requests the abort when other work arrives; llama_decode then returns 2 and removes the aborted
// micro-batch's positions, and the prefill goes on later in smaller chunks. Read only here, written by Python.
enum { KVC_PREEMPT_OFF = 0, KVC_PREEMPT_ARMED = 1, KVC_PREEMPT_REQUESTED = 2 };

bool kvc_preempt_requested(void * flag) {
    return flag != NULL && __atomic_load_n((const int *) flag, __ATOMIC_RELAXED) == KVC_PREEMPT_REQUESTED;
}
