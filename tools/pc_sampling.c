/* CUPTI PC sampling for one CUDA context, for tools/pc_sample.py (the GPU machine has no ncu).
 *
 * The warps resident on each SM are sampled every 2^period cycles; each sample records the warp's PC and
 * why it could not issue (CUPTI's stall reasons: "smsp__pcsamp_warps_issue_stalled_*"). pcs_stop writes,
 * per sampled PC of every function, the samples of each stall reason, as text:
 *     reason <index> <name>                        (once per stall reason)
 *     pc <function> <pc offset> <index>:<samples> ...
 *     total <samples> dropped <samples> nonuser <samples>
 * libcupti and libcuda are opened at run time (dlopen), so this builds without the CUDA driver:
 *     gcc -O2 -shared -fPIC -I/usr/local/cuda/include tools/pc_sampling.c -o libpcsampling.so -ldl
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda.h>
#include <cupti_pcsampling.h>

#define MAX_PCS 16384

typedef CUptiResult (*cfg_fn)(CUpti_PCSamplingConfigurationInfoParams *);
typedef CUptiResult (*ctx_fn)(void *);
typedef CUptiResult (*nreasons_fn)(CUpti_PCSamplingGetNumStallReasonsParams *);
typedef CUptiResult (*reasons_fn)(CUpti_PCSamplingGetStallReasonsParams *);
typedef CUptiResult (*data_fn)(CUpti_PCSamplingGetDataParams *);
typedef CUresult (*retain_fn)(CUcontext *, CUdevice);

static struct {
    cfg_fn set_config;
    ctx_fn enable, disable, start, stop;
    nreasons_fn n_reasons;
    reasons_fn reasons;
    data_fn get_data;
    CUcontext ctx;
    size_t n_stall;
    uint32_t *stall_index;
    char **stall_names;
    CUpti_PCSamplingData buf;  /* what CUPTI fills at stop */
    CUpti_PCSamplingData more; /* what cuptiPCSamplingGetData fills after */
    char error[256];
} S;

const char *pcs_error(void) { return S.error; }

static int fail(const char *what, int code) {
    snprintf(S.error, sizeof S.error, "%s failed (%d)", what, code);
    return code ? code : -1;
}

#define CALL(expr, what)                     \
    do {                                     \
        int rc_ = (int)(expr);               \
        if (rc_) return fail(what, rc_);     \
    } while (0)

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) snprintf(S.error, sizeof S.error, "no symbol %s", name);
    return p;
}

static int alloc_data(CUpti_PCSamplingData *d) {
    memset(d, 0, sizeof *d);
    d->size = sizeof(CUpti_PCSamplingData);
    d->collectNumPcs = MAX_PCS;
    d->pPcData = calloc(MAX_PCS, sizeof(CUpti_PCSamplingPCData));
    if (!d->pPcData) return -1;
    for (size_t i = 0; i < MAX_PCS; i++) {
        d->pPcData[i].size = sizeof(CUpti_PCSamplingPCData);
        d->pPcData[i].stallReason = calloc(S.n_stall, sizeof(CUpti_PCSamplingStallReason));
        if (!d->pPcData[i].stallReason) return -1;
    }
    return 0;
}

/* Load the libraries, configure sampling on device 0's primary context (MLX's), start. */
int pcs_start(const char *cupti_path, const char *cuda_path, int period, int serialized) {
    void *cupti = dlopen(cupti_path, RTLD_NOW | RTLD_GLOBAL);
    void *cuda = dlopen(cuda_path, RTLD_NOW | RTLD_GLOBAL);
    if (!cupti || !cuda) {
        snprintf(S.error, sizeof S.error, "dlopen: %s", dlerror());
        return -1;
    }
    retain_fn retain = (retain_fn)sym(cuda, "cuDevicePrimaryCtxRetain");
    S.set_config = (cfg_fn)sym(cupti, "cuptiPCSamplingSetConfigurationAttribute");
    S.enable = (ctx_fn)sym(cupti, "cuptiPCSamplingEnable");
    S.disable = (ctx_fn)sym(cupti, "cuptiPCSamplingDisable");
    S.start = (ctx_fn)sym(cupti, "cuptiPCSamplingStart");
    S.stop = (ctx_fn)sym(cupti, "cuptiPCSamplingStop");
    S.n_reasons = (nreasons_fn)sym(cupti, "cuptiPCSamplingGetNumStallReasons");
    S.reasons = (reasons_fn)sym(cupti, "cuptiPCSamplingGetStallReasons");
    S.get_data = (data_fn)sym(cupti, "cuptiPCSamplingGetData");
    if (!retain || !S.set_config || !S.enable || !S.disable || !S.start || !S.stop || !S.n_reasons ||
        !S.reasons || !S.get_data)
        return -1;
    CALL(retain(&S.ctx, 0), "cuDevicePrimaryCtxRetain");

    CUpti_PCSamplingEnableParams en = {CUpti_PCSamplingEnableParamsSize, NULL, S.ctx};
    CALL(S.enable(&en), "cuptiPCSamplingEnable");

    CUpti_PCSamplingGetNumStallReasonsParams np = {CUpti_PCSamplingGetNumStallReasonsParamsSize, NULL, S.ctx,
                                                    &S.n_stall};
    CALL(S.n_reasons(&np), "cuptiPCSamplingGetNumStallReasons");
    S.stall_index = calloc(S.n_stall, sizeof(uint32_t));
    S.stall_names = calloc(S.n_stall, sizeof(char *));
    for (size_t i = 0; i < S.n_stall; i++) S.stall_names[i] = calloc(CUPTI_STALL_REASON_STRING_SIZE, 1);
    CUpti_PCSamplingGetStallReasonsParams rp = {CUpti_PCSamplingGetStallReasonsParamsSize, NULL, S.ctx,
                                                 S.n_stall, S.stall_index, S.stall_names};
    CALL(S.reasons(&rp), "cuptiPCSamplingGetStallReasons");
    if (alloc_data(&S.buf) || alloc_data(&S.more)) return fail("calloc", -1);

    CUpti_PCSamplingConfigurationInfo info[7];
    memset(info, 0, sizeof info);
    info[0].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_STALL_REASON;
    info[0].attributeData.stallReasonData.stallReasonCount = S.n_stall;
    info[0].attributeData.stallReasonData.pStallReasonIndex = S.stall_index;
    info[1].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_SAMPLING_PERIOD;
    info[1].attributeData.samplingPeriodData.samplingPeriod = (uint32_t)period;
    info[2].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_COLLECTION_MODE;
    info[2].attributeData.collectionModeData.collectionMode =
        serialized ? CUPTI_PC_SAMPLING_COLLECTION_MODE_KERNEL_SERIALIZED : CUPTI_PC_SAMPLING_COLLECTION_MODE_CONTINUOUS;
    info[3].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_ENABLE_START_STOP_CONTROL;
    info[3].attributeData.enableStartStopControlData.enableStartStopControl = 1;
    info[4].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_SAMPLING_DATA_BUFFER;
    info[4].attributeData.samplingDataBufferData.samplingDataBuffer = &S.buf;
    info[5].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_SCRATCH_BUFFER_SIZE;
    info[5].attributeData.scratchBufferSizeData.scratchBufferSize = 256u << 20;
    info[6].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_OUTPUT_DATA_FORMAT;
    info[6].attributeData.outputDataFormatData.outputDataFormat = CUPTI_PC_SAMPLING_OUTPUT_DATA_FORMAT_PARSED;
    CUpti_PCSamplingConfigurationInfoParams cp = {CUpti_PCSamplingConfigurationInfoParamsSize, NULL, S.ctx, 7,
                                                   info};
    CALL(S.set_config(&cp), "cuptiPCSamplingSetConfigurationAttribute");

    CUpti_PCSamplingStartParams st = {CUpti_PCSamplingStartParamsSize, NULL, S.ctx};
    CALL(S.start(&st), "cuptiPCSamplingStart");
    return 0;
}

static uint64_t dump(FILE *f, const CUpti_PCSamplingData *d) {
    uint64_t n = 0;
    for (size_t i = 0; i < d->totalNumPcs && i < MAX_PCS; i++) {
        const CUpti_PCSamplingPCData *pc = &d->pPcData[i];
        fprintf(f, "pc %s %llu", pc->functionName ? pc->functionName : "?", (unsigned long long)pc->pcOffset);
        for (size_t r = 0; r < pc->stallReasonCount; r++) {
            fprintf(f, " %u:%u", pc->stallReason[r].pcSamplingStallReasonIndex, pc->stallReason[r].samples);
            n += pc->stallReason[r].samples;
        }
        fputc('\n', f);
    }
    fprintf(f, "total %llu dropped %llu nonuser %llu full %u\n", (unsigned long long)d->totalSamples,
            (unsigned long long)d->droppedSamples, (unsigned long long)d->nonUsrKernelsTotalSamples,
            (unsigned)d->hardwareBufferFull);
    return n;
}

/* Stop (the GPU must be idle), write every sampled PC to `path`, disable sampling. */
int pcs_stop(const char *path) {
    CUpti_PCSamplingStopParams sp = {CUpti_PCSamplingStopParamsSize, NULL, S.ctx};
    CALL(S.stop(&sp), "cuptiPCSamplingStop");
    FILE *f = fopen(path, "w");
    if (!f) return fail("fopen", -1);
    for (size_t i = 0; i < S.n_stall; i++) fprintf(f, "reason %u %s\n", S.stall_index[i], S.stall_names[i]);
    dump(f, &S.buf);
    for (int round = 0; round < 64; round++) {
        S.more.totalNumPcs = 0;
        S.more.remainingNumPcs = 0;
        CUpti_PCSamplingGetDataParams gp = {CUpti_PCSamplingGetDataParamsSize, NULL, S.ctx, &S.more};
        int rc = (int)S.get_data(&gp);
        if (rc) {
            fprintf(f, "getdata %d\n", rc);
            break;
        }
        if (!S.more.totalNumPcs) break;
        dump(f, &S.more);
        if (!S.more.remainingNumPcs) break;
    }
    fclose(f);
    CUpti_PCSamplingDisableParams dp = {CUpti_PCSamplingDisableParamsSize, NULL, S.ctx};
    CALL(S.disable(&dp), "cuptiPCSamplingDisable");
    return 0;
}
