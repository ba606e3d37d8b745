// params.cuh — GENERATED from src/backend/cuda/params.rs; do not edit. Regenerate with
// MEGAMOE_BLESS=1 cargo test -p megamoe --lib params_header
// Every kernel takes exactly one of these structs by value (const __grid_constant__). Pointers
// documented as nullable in params.rs are 0 when absent.

// A TMA tensor map (CUtensorMap), encoded on the host; params.rs' TmaDesc.
struct __align__(64) TmaDesc { unsigned long long v[16]; };

constexpr int WF_NVFP4 = 0;
constexpr int WF_MXFP4 = 1;
constexpr int WF_BF16 = 2;
constexpr int WF_FP8 = 3;
constexpr int QUANT_COPY = 0;
constexpr int QUANT_FP8_ACT = 1;
constexpr int QUANT_NVFP4_ACT = 2;
constexpr int QUANT_FP8_E4M3 = 3;
constexpr int SCORE_SQRT_SOFTPLUS = 0;
constexpr int SCORE_SIGMOID = 1;
constexpr int SCORE_SOFTMAX = 2;
constexpr int OUT_F32 = 0;
constexpr int OUT_BF16 = 1;
constexpr int STATUS_BAD_TOKEN_ID = 1;
constexpr int STATUS_BAD_EXPERT_ID = 2;
constexpr int PLAN_CHUNK = 128;
constexpr int PLAN_WARPS = 8;
constexpr int PLAN_SMALL_WARPS = 32;
constexpr int PLAN_OFF_EXPERTS = 64;
constexpr int PLAN_OFF_RANGES = 16;
constexpr int PLAN_SMALL_CHUNK = 256;
constexpr int PLAN_SMALL_EXPERTS = 512;
constexpr int PLAN_TINY_GROUPS = 8;
constexpr int EP_PACK_THREADS = 1024;
constexpr int PROBE_CTAS = 1024;
constexpr int PROBE_SLOTS = 16;
constexpr int PROBE_START = 0;
constexpr int PROBE_PLAN = 1;
constexpr int PROBE_L1_FIRST = 2;
constexpr int PROBE_L1_LAST = 3;
constexpr int PROBE_L1_DONE = 4;
constexpr int PROBE_BAR1_ARRIVE = 5;
constexpr int PROBE_L2_FIRST = 6;
constexpr int PROBE_L2_LAST = 7;
constexpr int PROBE_L2_DONE = 8;
constexpr int PROBE_BAR2 = 9;
constexpr int PROBE_END = 10;
constexpr int PROBE_L1_ISSUED = 11;
constexpr int PROBE_BAR1_PASSED = 12;
constexpr int PROBE_TIME_START = 13;
constexpr int PROBE_TIME_END = 14;
constexpr int PROBE_SL_EXPERTS = 1;
constexpr int PROBE_SL_X = 2;
constexpr int PROBE_SL_L1_FIRST = 3;
constexpr int PROBE_SL_SENT = 4;
constexpr int PROBE_SL_INBOX = 5;
constexpr int PROBE_SL_ACT = 6;
constexpr int PROBE_SL_L2_DONE = 7;
constexpr int PROBE_SL_LAST_ACT = 8;
constexpr int PROBE_SL_LAST_L2 = 9;
constexpr int PROBE_SL_ISSUED = 11;
constexpr int DF_SYNC_L1 = 0;
constexpr int DF_SYNC_L2 = 1;
constexpr int DF_SYNC_DONE = 2;
constexpr int DF_SYNC_INPUTS = 3;
constexpr int DF_SYNC_ACT = 4;
constexpr int DF_SYNC_COUNTERS = 5;
constexpr int MAX_TOPK = 32;
constexpr int WG_SIDE_WARPS = 3;
constexpr int WG_NARROW_COLS = 16;
constexpr int WG_STAGE_PIECE = 8192;
constexpr int FP8_ACT_BLOCK = 128;
constexpr int ROUTER_EXPERTS_PER_CTA = 2;
constexpr int ROUTER_TILE_TOKENS = 64;
constexpr int ROUTER_TILE_EXPERTS = 64;
constexpr int ROUTER_TILE_K = 32;
constexpr int TC_BLOCK_BYTES_NVFP4 = 576;
constexpr int TC_BLOCK_BYTES_MXFP4 = 544;
constexpr int TC_BLOCK_BYTES_BF16 = 2048;
constexpr int STREAM_MIN_CHUNKS = 4;
constexpr int STREAM_CTAS_PER_SM = 3;
constexpr int SLICE_CLUSTER = 8;
constexpr int SLICE_MAX_TOKENS = 8;
constexpr int SLICE_MAX_SLOTS = 64;
constexpr int SLICE_MAX_LOCAL = 512;
constexpr int SLICE_MAX_L2_GROUPS = 8;
constexpr int SLICE_MAX_STAGES = 16;
constexpr int SLICE_CTAS_PER_SM = 3;
constexpr int W8_BLOCK_BYTES = 1088;
constexpr int W8_CODE_BYTES = 1024;
constexpr int W8_SCALE_BYTES = 512;
constexpr unsigned ROW_NONE = 0xFFFFFFFFu;   // params.rs ROW_NONE

struct RouterLogitsParams {
    const bf16_t* x;
    const float* wg;
    int t;
    int h;
    int e;
    float* scores;
    int parts;
};
static_assert(sizeof(RouterLogitsParams) == 48, "RouterLogitsParams mirrors params.rs");

struct RouterTopkParams {
    const float* bias;
    const int* tid2eid;
    const void* token_ids;
    int token_ids_i64;
    int vocab;
    int t;
    int e;
    int k;
    int score_func;
    int renorm;
    float route_scale;
    float* scores;
    int parts;
    int* topk_ids;
    float* topk_w;
    unsigned* status;
};
static_assert(sizeof(RouterTopkParams) == 96, "RouterTopkParams mirrors params.rs");

struct PlanParams {
    const int* topk_ids;
    int slots;
    int experts;
    int expert_base;
    int global_experts;
    int bm;
    unsigned* counts;
    unsigned* offsets;
    int* tile_start;
    unsigned* chunk_rows;
    int* tiles;
    int* num_tiles;
    unsigned* perm;
    unsigned* row_of_slot;
    unsigned* status;
};
static_assert(sizeof(PlanParams) == 104, "PlanParams mirrors params.rs");

struct QuantRowsParams {
    const bf16_t* src;
    void* dst;
    const unsigned* perm;
    const int* topk_ids;
    int expert_base;
    int k;
    int gather;
    const unsigned* offsets;
    int experts;
    int cols;
    int mode;
    const float* in_scale;
    float* scales;
    int scale_pitch;
    const int* tile_start;
    int tile_rows;
    unsigned* direct;
    const unsigned* row_of_slot;
};
static_assert(sizeof(QuantRowsParams) == 128, "QuantRowsParams mirrors params.rs");

struct CombineParams {
    const float* l2;
    const unsigned* row_of_slot;
    const float* shared_out;
    int t;
    int h;
    int k;
    void* y;
    int y_dtype;
    int folded;
    int zeroed;
};
static_assert(sizeof(CombineParams) == 64, "CombineParams mirrors params.rs");

struct ResidualNormParams {
    float* hs;
    const float* y;
    bf16_t* x;
    int t;
    int h;
};
static_assert(sizeof(ResidualNormParams) == 32, "ResidualNormParams mirrors params.rs");

struct EpPackParams {
    const int* topk_ids;
    const float* topk_w;
    const int* ranges;
    int* dest_row;
    int* src_token;
    int* send_ids;
    float* send_w;
    unsigned* status;
    int t;
    int k;
    int cap;
    int e;
};
static_assert(sizeof(EpPackParams) == 80, "EpPackParams mirrors params.rs");

struct EpRowsParams {
    const bf16_t* x;
    const int* src_token;
    bf16_t* send_x;
    unsigned char* send_q;
    float* send_s;
    int h;
    int cap;
};
static_assert(sizeof(EpRowsParams) == 48, "EpRowsParams mirrors params.rs");

struct EpUnpackParams {
    const unsigned char* q;
    const float* s;
    const int* ids;
    bf16_t* x;
    int rows;
    int h;
    int k;
};
static_assert(sizeof(EpUnpackParams) == 48, "EpUnpackParams mirrors params.rs");

struct EpReduceParams {
    const float* back;
    const int* dest_row;
    const float* shared_out;
    void* y;
    int t;
    int h;
    int cap;
    int world;
    int y_dtype;
};
static_assert(sizeof(EpReduceParams) == 56, "EpReduceParams mirrors params.rs");

struct GemmOperands {
    const void* a;
    const unsigned* a_rows;
    const unsigned char* wq;
    const unsigned char* ws;
    const float* alpha_w;
    const float* alpha_in;
    const int* tiles;
    const int* num_tiles;
    const unsigned* offsets;
    int a_div;
    int dense_rows;
    int h;
    int inter;
};
static_assert(sizeof(GemmOperands) == 88, "GemmOperands mirrors params.rs");

struct GemmL1Params {
    GemmOperands g;
    const unsigned* perm;
    const float* topk_w;
    float limit;
    bf16_t* act;
};
static_assert(sizeof(GemmL1Params) == 120, "GemmL1Params mirrors params.rs");

struct GemmL1TraceParams {
    GemmL1Params l1;
    float* gate_tr;
    float* up_tr;
};
static_assert(sizeof(GemmL1TraceParams) == 136, "GemmL1TraceParams mirrors params.rs");

struct GemmL2Params {
    GemmOperands g;
    float* out;
    const unsigned* direct;
    float* y;
};
static_assert(sizeof(GemmL2Params) == 112, "GemmL2Params mirrors params.rs");

struct DsL1Params {
    GemmL1Params l1;
    float* partials;
    unsigned* counters;
    const unsigned char* next_wq;
    int prefetch_bytes;
};
static_assert(sizeof(DsL1Params) == 152, "DsL1Params mirrors params.rs");

struct DsL2Params {
    GemmL2Params l2;
    float* partials;
    unsigned* counters;
};
static_assert(sizeof(DsL2Params) == 128, "DsL2Params mirrors params.rs");

struct DfParams {
    PlanParams plan;
    GemmL1Params l1;
    GemmL2Params l2;
    CombineParams combine;
    QuantRowsParams quant_in;
    QuantRowsParams quant_act;
    float* partials1;
    unsigned* counters1;
    float* partials2;
    unsigned* counters2;
    unsigned* sync;
    int prefetch_bytes;
};
static_assert(sizeof(DfParams) == 704, "DfParams mirrors params.rs");

struct SliceParams {
    const int* topk_ids;
    const float* topk_w;
    const bf16_t* x;
    const unsigned char* w1;
    const float* alpha1;
    const unsigned char* w2;
    const float* alpha2;
    float* partials;
    unsigned* status;
    int tokens;
    int k;
    int experts;
    int expert_base;
    int global_experts;
    int h;
    int inter;
    float limit;
    int stages;
};
static_assert(sizeof(SliceParams) == 112, "SliceParams mirrors params.rs");

struct SliceSumParams {
    const float* partials;
    const float* shared_out;
    void* y;
    int clusters;
    int tokens;
    int h;
    int y_dtype;
};
static_assert(sizeof(SliceSumParams) == 40, "SliceSumParams mirrors params.rs");

struct ZeroRowsParams {
    const unsigned* row_of_slot;
    void* y;
    int t;
    int k;
    int row_bytes;
};
static_assert(sizeof(ZeroRowsParams) == 32, "ZeroRowsParams mirrors params.rs");

struct StageRowsParams {
    const unsigned char* src;
    unsigned char* dst;
    const unsigned* perm;
    const unsigned* row_of_slot;
    unsigned* direct;
    unsigned* ready;
    int k;
    int row_bytes;
};
static_assert(sizeof(StageRowsParams) == 56, "StageRowsParams mirrors params.rs");

struct WgL1Params {
    GemmL1Params l1;
    TmaDesc amap;
    TmaDesc wmap;
    unsigned* tile_done;
    ZeroRowsParams zero;
    StageRowsParams stage;
};
static_assert(sizeof(WgL1Params) == 512, "WgL1Params mirrors params.rs");

struct WgL2Params {
    GemmL2Params l2;
    TmaDesc amap;
    TmaDesc wmap;
    unsigned* tile_done;
    int wait_units;
    int zero_warps;
};
static_assert(sizeof(WgL2Params) == 448, "WgL2Params mirrors params.rs");

struct W8L1Params {
    GemmL1Params l1;
    TmaDesc amap;
    TmaDesc smap;
};
static_assert(sizeof(W8L1Params) == 384, "W8L1Params mirrors params.rs");

struct W8L2Params {
    GemmL2Params l2;
    TmaDesc amap;
    TmaDesc smap;
};
static_assert(sizeof(W8L2Params) == 384, "W8L2Params mirrors params.rs");
