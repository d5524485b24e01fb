/* The stand-in libnvidia-ml.so.1 of the tests: the real nvidia-ml-py (pynvml) loads it through
 * LD_LIBRARY_PATH.  A copy of ../shared/tools/fakenvml/fakenvml.c extended with MIG instances and
 * the driver's refusal of a MIG GPU's process list to a user (tests/nvml_standin.py builds it and
 * writes its state).  Devices and processes come from a state file (NVML_STANDIN_STATE, re-read
 * when it changes):
 *   gpu     <index> <total_bytes> <used_bytes> <util_percent> <name words...>
 *   mig     <parent> <gpu_instance> <compute_instance> <total_bytes> <used_bytes> <name words...>
 *   proc    <gpu_index> <pid> <used_bytes>
 *   migproc <parent> <gpu_instance> <compute_instance> <pid> <used_bytes>
 * A GPU with a `mig` line is in MIG mode: its instances are reached through
 * nvmlDeviceGetMigDeviceHandleByIndex, each with its own UUID ("MIG-..."), name (the parent's
 * and " MIG <profile>"), memory and processes; the parent's process list is refused to a user
 * (NO_PERMISSION) and gives root every instance's processes, as the driver does.  A MIG handle
 * answers the parent's PCI address (a join by it would be wrong) and NOT_SUPPORTED for
 * utilisation, temperature and power.  v2 memory: a GPU keeps 512 MiB reserved out of `used`,
 * an instance none.  Unknown functions are absent, so bindings report "function not found". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum { OK = 0, UNINIT = 1, INVALID = 2, NOT_SUPPORTED = 3, NO_PERMISSION = 4, NOT_FOUND = 6, INSUFFICIENT = 7, LOST = 15 };
#define MAXG 64
#define MAXM 256
#define MAXP 1024
#define MIG_BASE 0x10000
typedef struct { unsigned long long total, used; unsigned util; char name[96]; } gpu_t;
typedef struct { unsigned parent, gi, ci; unsigned long long total, used; char name[128]; } mig_t;
typedef struct { unsigned gpu, pid; unsigned long long used; int gi, ci; } proc_t; /* gi < 0: whole GPU */
static gpu_t G[MAXG]; static int NG = -1; static mig_t M[MAXM]; static int NM = 0;
static proc_t P[MAXP]; static int NP = 0;
static time_t mtime_seen = 0; static long mtime_ns_seen = -1; static int inited = 0;

static void load(void) {
  const char *path = getenv("NVML_STANDIN_STATE");
  struct stat st;
  if (path && stat(path, &st) == 0) {
    if (NG >= 0 && st.st_mtime == mtime_seen && st.st_mtim.tv_nsec == mtime_ns_seen) return;
    FILE *f = fopen(path, "r");
    if (f) {
      int ng = 0, nm = 0, np = 0; char line[512];
      while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (!strncmp(line, "gpu ", 4) && ng < MAXG) {
          unsigned idx; unsigned long long tot, used; unsigned util; int off = 0;
          if (sscanf(line + 4, "%u %llu %llu %u %n", &idx, &tot, &used, &util, &off) >= 4) {
            G[ng].total = tot; G[ng].used = used; G[ng].util = util;
            snprintf(G[ng].name, sizeof G[ng].name, "%s", off ? line + 4 + off : "NVIDIA H100 80GB HBM3");
            ng++;
          }
        } else if (!strncmp(line, "mig ", 4) && nm < MAXM) {
          mig_t *m = &M[nm]; int off = 0;
          if (sscanf(line + 4, "%u %u %u %llu %llu %n", &m->parent, &m->gi, &m->ci, &m->total, &m->used, &off) >= 5) {
            snprintf(m->name, sizeof m->name, "%s", off ? line + 4 + off : "MIG");
            nm++;
          }
        } else if (!strncmp(line, "proc ", 5) && np < MAXP) {
          if (sscanf(line + 5, "%u %u %llu", &P[np].gpu, &P[np].pid, &P[np].used) == 3) { P[np].gi = P[np].ci = -1; np++; }
        } else if (!strncmp(line, "migproc ", 8) && np < MAXP) {
          if (sscanf(line + 8, "%u %d %d %u %llu", &P[np].gpu, &P[np].gi, &P[np].ci, &P[np].pid, &P[np].used) == 5) np++;
        }
      }
      fclose(f); NG = ng; NM = nm; NP = np; mtime_seen = st.st_mtime; mtime_ns_seen = st.st_mtim.tv_nsec;
      return;
    }
  }
  if (NG >= 0) return;
  NG = 1; NM = 0; NP = 0;
  G[0].total = 80ULL << 30; G[0].used = 10ULL << 30; G[0].util = 50;
  snprintf(G[0].name, sizeof G[0].name, "NVIDIA H100 80GB HBM3");
}

static int mig_mode(int g) { for (int k = 0; k < NM; k++) if ((int)M[k].parent == g) return 1; return 0; }
/* The device behind a handle: its GPU's index, and the MIG instance (or -1). */
static nvmlReturn_t resolve(void *h, int *g, int *m) {
  if (!inited) return UNINIT;
  load();
  long v = (long)h;
  if (v >= MIG_BASE) {
    int k = (int)(v - MIG_BASE);
    if (k < 0 || k >= NM) return NOT_FOUND;
    *g = (int)M[k].parent; *m = k;
  } else {
    *g = (int)v - 1; *m = -1;
  }
  if (*g < 0 || *g >= NG) return INVALID;
  return OK;
}
#define DEV(h) int g_ = 0, m_ = -1; do { nvmlReturn_t r_ = resolve(h, &g_, &m_); if (r_) return r_; } while (0)
#define GPU_ONLY() do { if (m_ >= 0) return NOT_SUPPORTED; } while (0)

nvmlReturn_t nvmlInitWithFlags(unsigned flags) { (void)flags; inited++; load(); return OK; }
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlShutdown(void) { if (inited) inited--; return OK; }
const char *nvmlErrorString(nvmlReturn_t r) {
  switch (r) { case OK: return "Success"; case UNINIT: return "Uninitialized"; case INVALID: return "Invalid Argument";
  case NOT_SUPPORTED: return "Not Supported"; case NO_PERMISSION: return "Insufficient Permissions";
  case NOT_FOUND: return "Not Found"; case INSUFFICIENT: return "Insufficient Size";
  case LOST: return "GPU is lost"; default: return "Unknown Error"; }
}
static nvmlReturn_t str(char *buf, unsigned len, const char *s) { if (!buf) return INVALID; if (strlen(s) + 1 > len) return INSUFFICIENT; strcpy(buf, s); return OK; }
nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned len) { return str(v, len, "580.159.04"); }
nvmlReturn_t nvmlSystemGetNVMLVersion(char *v, unsigned len) { return str(v, len, "13.580.159.04"); }
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) { *v = 13000; return OK; }
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { *v = 13000; return OK; }
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *c) { if (!inited) return UNINIT; load(); *c = NG; return OK; }
nvmlReturn_t nvmlDeviceGetCount(unsigned *c) { return nvmlDeviceGetCount_v2(c); }
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned i, void **h) { if (!inited) return UNINIT; load(); if ((int)i >= NG) return INVALID; *h = (void *)(long)(i + 1); return OK; }
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned i, void **h) { return nvmlDeviceGetHandleByIndex_v2(i, h); }
nvmlReturn_t nvmlDeviceGetIndex(void *h, unsigned *i) { DEV(h); *i = g_; return OK; }
nvmlReturn_t nvmlDeviceGetName(void *h, char *n, unsigned len) { DEV(h); return str(n, len, m_ >= 0 ? M[m_].name : G[g_].name); }
static void uuid_of(int g, int m, char *b, size_t len) {
  if (m < 0) snprintf(b, len, "GPU-fa4e0000-0000-4000-8000-%012d", g);
  else snprintf(b, len, "MIG-5a1e%04u-00%02u-4000-8000-%012u", M[m].parent, M[m].gi, M[m].ci);
}
nvmlReturn_t nvmlDeviceGetUUID(void *h, char *u, unsigned len) { DEV(h); char b[80]; uuid_of(g_, m_, b, sizeof b); return str(u, len, b); }
nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *u, void **h) {
  if (!inited) return UNINIT;
  load();
  char b[80];
  for (int i = 0; i < NG; i++) { uuid_of(i, -1, b, sizeof b); if (!strcmp(b, u)) { *h = (void *)(long)(i + 1); return OK; } }
  for (int k = 0; k < NM; k++) { uuid_of(0, k, b, sizeof b); if (!strcmp(b, u)) { *h = (void *)(long)(MIG_BASE + k); return OK; } }
  return NOT_FOUND;
}
nvmlReturn_t nvmlDeviceGetSerial(void *h, char *s, unsigned len) { DEV(h); char b[32]; snprintf(b, sizeof b, "16520000%05d", g_); return str(s, len, b); }
typedef struct { unsigned long long total, free, used; } mem1_t;
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } mem2_t;
nvmlReturn_t nvmlDeviceGetMemoryInfo(void *h, mem1_t *m) {
  DEV(h);
  unsigned long long total = m_ >= 0 ? M[m_].total : G[g_].total, used = m_ >= 0 ? M[m_].used : G[g_].used;
  m->total = total; m->used = used; m->free = total - used; return OK;
}
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(void *h, mem2_t *m) {
  DEV(h);
  if (m_ >= 0) { m->total = M[m_].total; m->reserved = 0; m->used = M[m_].used; m->free = M[m_].total - M[m_].used; return OK; }
  gpu_t *g = &G[g_]; unsigned long long r = 512ULL << 20;
  m->total = g->total; m->reserved = r; m->used = g->used > r ? g->used - r : 0; m->free = g->total - g->used; return OK;
}
typedef struct { unsigned long long t, f, u; } bar1_t;
nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(void *h, bar1_t *b) { DEV(h); b->t = 128ULL << 30; b->u = 32ULL << 20; b->f = b->t - b->u; return OK; }
typedef struct { unsigned gpu, memory; } util_t;
nvmlReturn_t nvmlDeviceGetUtilizationRates(void *h, util_t *u) { DEV(h); GPU_ONLY(); u->gpu = G[g_].util; u->memory = G[g_].util / 2; return OK; }
typedef struct { unsigned pid; unsigned long long used; unsigned gi, ci; } proc3_t;
static int listed(int k, int g, int m) {
  if ((int)P[k].gpu != g) return 0;
  if (m < 0) return 1; /* the parent: everything on it (root only, for a GPU in MIG mode) */
  return P[k].gi == (int)M[m].gi && P[k].ci == (int)M[m].ci;
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(void *h, unsigned *count, proc3_t *out) {
  DEV(h);
  if (m_ < 0 && mig_mode(g_) && geteuid() != 0) return NO_PERMISSION;
  unsigned n = 0;
  for (int k = 0; k < NP; k++) if (listed(k, g_, m_)) n++;
  if (!out || *count < n) { unsigned have = *count; *count = n; return (n == 0 && (!out || have == 0)) ? OK : INSUFFICIENT; }
  unsigned j = 0;
  for (int k = 0; k < NP; k++) if (listed(k, g_, m_)) {
    out[j].pid = P[k].pid; out[j].used = P[k].used;
    out[j].gi = P[k].gi < 0 ? 0xFFFFFFFF : (unsigned)P[k].gi; out[j].ci = P[k].ci < 0 ? 0xFFFFFFFF : (unsigned)P[k].ci; j++;
  }
  *count = n; return OK;
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(void *h, unsigned *c, proc3_t *o) { return nvmlDeviceGetComputeRunningProcesses_v3(h, c, o); }
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(void *h, unsigned *c, proc3_t *o) { (void)o; DEV(h); *c = 0; return OK; }
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(void *h, unsigned *c, proc3_t *o) { return nvmlDeviceGetGraphicsRunningProcesses_v3(h, c, o); }
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(void *h, unsigned *c, proc3_t *o) { return nvmlDeviceGetGraphicsRunningProcesses_v3(h, c, o); }
typedef struct { char busIdLegacy[16]; unsigned domain, bus, device, pciDeviceId, pciSubSystemId; char busId[32]; } pci_t;
nvmlReturn_t nvmlDeviceGetPciInfo_v3(void *h, pci_t *p) {
  DEV(h); memset(p, 0, sizeof *p); p->bus = 0x18 + g_; p->pciDeviceId = 0x233010DE;
  snprintf(p->busId, sizeof p->busId, "00000000:%02X:00.0", p->bus); snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "0000:%02X:00.0", p->bus); return OK;
}
nvmlReturn_t nvmlDeviceGetPciInfo_v2(void *h, pci_t *p) { return nvmlDeviceGetPciInfo_v3(h, p); }
nvmlReturn_t nvmlDeviceGetTemperature(void *h, int s, unsigned *t) { (void)s; DEV(h); GPU_ONLY(); *t = 40 + G[g_].util / 4; return OK; }
nvmlReturn_t nvmlDeviceGetFanSpeed(void *h, unsigned *f) { DEV(h); GPU_ONLY(); *f = 30; return OK; }
nvmlReturn_t nvmlDeviceGetPowerUsage(void *h, unsigned *p) { DEV(h); GPU_ONLY(); *p = 100000 + G[g_].util * 5000; return OK; }
nvmlReturn_t nvmlDeviceGetPowerManagementLimit(void *h, unsigned *p) { DEV(h); GPU_ONLY(); *p = 700000; return OK; }
nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(void *h, unsigned *p) { DEV(h); GPU_ONLY(); *p = 700000; return OK; }
nvmlReturn_t nvmlDeviceGetPersistenceMode(void *h, int *m) { DEV(h); *m = 1; return OK; }
nvmlReturn_t nvmlDeviceGetPerformanceState(void *h, int *s) { DEV(h); *s = 0; return OK; }
nvmlReturn_t nvmlDeviceGetComputeMode(void *h, int *m) { DEV(h); *m = 0; return OK; }
nvmlReturn_t nvmlDeviceGetDisplayActive(void *h, int *m) { DEV(h); *m = 0; return OK; }
nvmlReturn_t nvmlDeviceGetDisplayMode(void *h, int *m) { DEV(h); *m = 0; return OK; }
/* MIG */
nvmlReturn_t nvmlDeviceGetMigMode(void *h, unsigned *c, unsigned *p) { DEV(h); GPU_ONLY(); *c = *p = (unsigned)mig_mode(g_); return OK; }
nvmlReturn_t nvmlDeviceIsMigDeviceHandle(void *h, unsigned *m) { DEV(h); *m = m_ >= 0; return OK; }
nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(void *h, unsigned *c) { DEV(h); GPU_ONLY(); *c = mig_mode(g_) ? 7 : 0; return OK; }
nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(void *h, unsigned i, void **out) {
  DEV(h); if (m_ >= 0) return INVALID;
  if (!mig_mode(g_)) return INVALID;
  unsigned seen = 0;
  for (int k = 0; k < NM; k++) if ((int)M[k].parent == g_) { if (seen == i) { *out = (void *)(long)(MIG_BASE + k); return OK; } seen++; }
  return NOT_FOUND;
}
nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(void *h, void **out) { DEV(h); if (m_ < 0) return INVALID; *out = (void *)(long)(g_ + 1); return OK; }
nvmlReturn_t nvmlDeviceGetGpuInstanceId(void *h, unsigned *id) { DEV(h); if (m_ < 0) return INVALID; *id = M[m_].gi; return OK; }
nvmlReturn_t nvmlDeviceGetComputeInstanceId(void *h, unsigned *id) { DEV(h); if (m_ < 0) return INVALID; *id = M[m_].ci; return OK; }
typedef struct { unsigned mp, ce, dec, enc, jpg, ofa, gi_slices, ci_slices; unsigned long long mem_mb; } attrs_t;
nvmlReturn_t nvmlDeviceGetAttributes_v2(void *h, attrs_t *a) {
  DEV(h); if (m_ < 0) return NOT_SUPPORTED;
  memset(a, 0, sizeof *a);
  const char *p = strstr(M[m_].name, "MIG ");
  unsigned slices = 0;
  if (p) sscanf(p + 4, "%ug", &slices);
  a->gi_slices = slices ? slices : 1; a->ci_slices = a->gi_slices; a->mem_mb = M[m_].total >> 20; a->mp = 14 * a->gi_slices;
  return OK;
}
nvmlReturn_t nvmlDeviceGetClockInfo(void *h, int t, unsigned *c) { (void)t; DEV(h); *c = 1980; return OK; }
nvmlReturn_t nvmlDeviceGetMaxClockInfo(void *h, int t, unsigned *c) { (void)t; DEV(h); *c = 1980; return OK; }
nvmlReturn_t nvmlDeviceGetCudaComputeCapability(void *h, int *a, int *b) { DEV(h); *a = 9; *b = 0; return OK; }
nvmlReturn_t nvmlDeviceGetPcieThroughput(void *h, int c, unsigned *v) { (void)c; DEV(h); *v = 0; return OK; }
nvmlReturn_t nvmlDeviceGetCurrentDriverModel(void *h, int *m) { (void)m; DEV(h); return NOT_SUPPORTED; }
nvmlReturn_t nvmlDeviceGetTotalEccErrors(void *h, int a, int b, unsigned long long *c) { (void)a; (void)b; (void)c; DEV(h); return NOT_SUPPORTED; }
nvmlReturn_t nvmlDeviceGetEncoderUtilization(void *h, unsigned *u, unsigned *p) { (void)u; (void)p; DEV(h); return NOT_SUPPORTED; }
nvmlReturn_t nvmlDeviceGetDecoderUtilization(void *h, unsigned *u, unsigned *p) { (void)u; (void)p; DEV(h); return NOT_SUPPORTED; }
nvmlReturn_t nvmlDeviceGetProcessUtilization(void *h, void *s, unsigned *c, unsigned long long t) { (void)s; (void)c; (void)t; DEV(h); return NOT_SUPPORTED; }
nvmlReturn_t nvmlDeviceGetDriverModel(void *h, int *c, int *p) { (void)c; (void)p; DEV(h); return NOT_SUPPORTED; }
nvmlReturn_t nvmlDeviceGetDriverModel_v2(void *h, int *c, int *p) { return nvmlDeviceGetDriverModel(h, c, p); }
