/* A stand-in for libamd_smi.so, so that the real `amdsmi` Python package (its own ctypes wrapper
 * and interface) is what memtop calls in the tests, on a machine with no AMD GPU.
 *
 * Built by tests/amd_standin.py: every struct offset, size, bit position and status code below
 * (the L_*, S_* and K_* macros) comes from the installed amdsmi package's ctypes definitions
 * (standin_layout.h, generated), so a package whose structures change changes this library too.
 * Every other function the wrapper binds is a stub answering NOT_SUPPORTED (standin_stubs.c).
 *
 * The state file (AMD_SMI_STANDIN_STATE; re-read when it changes):
 *   gpu  <index> <total_bytes> <used_bytes> <gfx_percent> <bdf> <uuid> <market name...>
 *   proc <gpu_index> <pid> <vram_bytes>
 *   lost <gpu_index>           every query of that GPU answers AMDSMI_STATUS_NOT_FOUND
 *   deny_processes <gpu_index> its process list answers AMDSMI_STATUS_NO_PERM
 *   init <status>              amdsmi_init answers this status (10 NO_PERM, 34 DRIVER_NOT_LOADED)
 * No state file: no GPUs. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "standin_layout.h"

#define MAXG 64
#define MAXP 1024
typedef struct {
  unsigned long long total, used;
  unsigned util, domain, bus, device, function;
  int lost, deny;
  char uuid[64], name[128];
} gpu_t;
typedef struct { unsigned gpu, pid; unsigned long long vram; } proc_t;
static gpu_t G[MAXG];
static int NG = 0;
static proc_t P[MAXP];
static int NP = 0;
static int INIT_STATUS = 0;
static long long seen_ns = -1;
static int inited = 0;

static void load(void) {
  const char *path = getenv("AMD_SMI_STANDIN_STATE");
  struct stat st;
  if (!path || stat(path, &st) != 0) { NG = 0; NP = 0; INIT_STATUS = 0; seen_ns = -1; return; }
  long long ns = (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
  if (ns == seen_ns) return;
  FILE *f = fopen(path, "r");
  if (!f) return;
  int ng = 0, np = 0, init = 0;
  char line[512];
  static gpu_t g[MAXG];
  memset(g, 0, sizeof g);
  while (fgets(line, sizeof line, f)) {
    unsigned idx;
    if (!strncmp(line, "gpu ", 4) && ng < MAXG) {
      gpu_t *d = &g[ng];
      int off = 0;
      if (sscanf(line + 4, "%u %llu %llu %u %x:%x:%x.%x %63s %n", &idx, &d->total, &d->used, &d->util,
                 &d->domain, &d->bus, &d->device, &d->function, d->uuid, &off) >= 9) {
        snprintf(d->name, sizeof d->name, "%s", off ? line + 4 + off : "AMD Instinct MI300X");
        d->name[strcspn(d->name, "\n")] = 0;
        ng++;
      }
    } else if (!strncmp(line, "proc ", 5) && np < MAXP) {
      if (sscanf(line + 5, "%u %u %llu", &P[np].gpu, &P[np].pid, &P[np].vram) == 3) np++;
    } else if (!strncmp(line, "lost ", 5) && sscanf(line + 5, "%u", &idx) == 1 && idx < MAXG) {
      g[idx].lost = 1;
    } else if (!strncmp(line, "deny_processes ", 15) && sscanf(line + 15, "%u", &idx) == 1 && idx < MAXG) {
      g[idx].deny = 1;
    } else if (!strncmp(line, "init ", 5)) {
      init = atoi(line + 5);
    }
  }
  fclose(f);
  memcpy(G, g, sizeof G);
  NG = ng;
  NP = np;
  INIT_STATUS = init;
  seen_ns = ns;
}

/* A handle is the GPU's position + 1 (never NULL); the socket handle is a fixed pointer. */
static int SOCKET_TOKEN;
#define H2I(h) ((int)(intptr_t)(h) - 1)
#define CHECK(h)                                      \
  do {                                                \
    if (!inited) return S_NOT_INIT;                   \
    load();                                           \
    int i_ = H2I(h);                                  \
    if (i_ < 0 || i_ >= NG) return S_INVAL;           \
    if (G[i_].lost) return S_NOT_FOUND;               \
  } while (0)
#define PUT(type, base, off, value) (*(type *)((char *)(base) + (off)) = (value))
#define PUTS(base, off, size, text) snprintf((char *)(base) + (off), (size), "%s", (text))

uint32_t amdsmi_init(uint64_t flags) {
  (void)flags;
  load();
  if (INIT_STATUS) return (uint32_t)INIT_STATUS;
  inited++;
  return S_SUCCESS;
}
uint32_t amdsmi_shut_down(void) {
  if (inited) inited--;
  return S_SUCCESS;
}
uint32_t amdsmi_get_socket_handles(uint32_t *count, void **handles) {
  if (!inited) return S_NOT_INIT;
  if (!count) return S_INVAL;
  if (handles && *count >= 1) handles[0] = &SOCKET_TOKEN;
  *count = 1;
  return S_SUCCESS;
}
uint32_t amdsmi_get_processor_handles(void *socket, uint32_t *count, void **handles) {
  if (!inited) return S_NOT_INIT;
  if (socket != &SOCKET_TOKEN || !count) return S_INVAL;
  load();
  if (!handles) { *count = NG; return S_SUCCESS; }
  uint32_t n = *count < (uint32_t)NG ? *count : (uint32_t)NG;
  for (uint32_t i = 0; i < n; i++) handles[i] = (void *)(intptr_t)(i + 1);
  *count = n;
  return S_SUCCESS;
}
uint32_t amdsmi_get_processor_type(void *h, uint32_t *type) {
  CHECK(h);
  *type = K_PROCESSOR_TYPE_AMD_GPU;
  return S_SUCCESS;
}
uint32_t amdsmi_get_gpu_device_uuid(void *h, uint32_t *len, char *uuid) {
  CHECK(h);
  if (!len || !uuid) return S_INVAL;
  if (strlen(G[H2I(h)].uuid) + 1 > *len) return S_INSUFFICIENT_SIZE;
  strcpy(uuid, G[H2I(h)].uuid);
  return S_SUCCESS;
}
uint32_t amdsmi_get_gpu_device_bdf(void *h, uint64_t *bdf) {
  CHECK(h);
  gpu_t *g = &G[H2I(h)];
  *bdf = ((uint64_t)g->function << K_BDF_SHIFT_function_number) |
         ((uint64_t)g->device << K_BDF_SHIFT_device_number) |
         ((uint64_t)g->bus << K_BDF_SHIFT_bus_number) |
         ((uint64_t)g->domain << K_BDF_SHIFT_domain_number);
  return S_SUCCESS;
}
uint32_t amdsmi_get_gpu_asic_info(void *h, void *info) {
  CHECK(h);
  memset(info, 0, L_asic__SIZE);
  PUTS(info, L_asic_market_name, L_asic_market_name_SIZE, G[H2I(h)].name);
  PUT(uint32_t, info, L_asic_vendor_id, 0x1002);
  PUTS(info, L_asic_vendor_name, L_asic_vendor_name_SIZE, "Advanced Micro Devices Inc. [AMD/ATI]");
  PUT(uint64_t, info, L_asic_device_id, 0x74a1);
  PUT(uint64_t, info, L_asic_target_graphics_version, 0x942);
  PUT(uint32_t, info, L_asic_num_of_compute_units, 304);
  PUT(uint32_t, info, L_asic_oam_id, (uint32_t)H2I(h));
  return S_SUCCESS;
}
uint32_t amdsmi_get_gpu_driver_info(void *h, void *info) {
  CHECK(h);
  memset(info, 0, L_driver__SIZE);
  PUTS(info, L_driver_driver_name, L_driver_driver_name_SIZE, "amdgpu");
  PUTS(info, L_driver_driver_version, L_driver_driver_version_SIZE, "6.12.12");
  PUTS(info, L_driver_driver_date, L_driver_driver_date_SIZE, "2015/01/01 00:00");
  return S_SUCCESS;
}
uint32_t amdsmi_get_gpu_memory_total(void *h, uint32_t type, uint64_t *total) {
  CHECK(h);
  if (type != K_MEM_TYPE_VRAM) return S_NOT_SUPPORTED;
  *total = G[H2I(h)].total;
  return S_SUCCESS;
}
uint32_t amdsmi_get_gpu_memory_usage(void *h, uint32_t type, uint64_t *used) {
  CHECK(h);
  if (type != K_MEM_TYPE_VRAM) return S_NOT_SUPPORTED;
  *used = G[H2I(h)].used;
  return S_SUCCESS;
}
uint32_t amdsmi_get_gpu_activity(void *h, void *usage) {
  CHECK(h);
  memset(usage, 0, L_engine__SIZE);
  PUT(uint32_t, usage, L_engine_gfx_activity, G[H2I(h)].util);
  PUT(uint32_t, usage, L_engine_umc_activity, G[H2I(h)].util / 2);
  PUT(uint32_t, usage, L_engine_mm_activity, 0xFFFF); /* N/A, as an MI300X says */
  return S_SUCCESS;
}
uint32_t amdsmi_get_temp_metric(void *h, uint32_t sensor, uint32_t metric, int64_t *value) {
  CHECK(h);
  /* An MI300X: no edge sensor, the hotspot one answers. */
  if (sensor != K_TEMPERATURE_TYPE_HOTSPOT || metric != K_TEMP_CURRENT) return S_NOT_SUPPORTED;
  *value = 40 + G[H2I(h)].util / 4;
  return S_SUCCESS;
}
uint32_t amdsmi_get_power_info(void *h, void *info) {
  CHECK(h);
  memset(info, 0, L_power__SIZE);
  PUT(uint32_t, info, L_power_current_socket_power, 150 + G[H2I(h)].util * 5);
  PUT(uint32_t, info, L_power_average_socket_power, 0xFFFF);
  PUT(uint32_t, info, L_power_power_limit, 750);
  return S_SUCCESS;
}
uint32_t amdsmi_get_gpu_process_list(void *h, uint32_t *max, void *list) {
  CHECK(h);
  int gi = H2I(h);
  if (!max) return S_INVAL;
  if (G[gi].deny) return S_NO_PERM;
  uint32_t n = 0;
  for (int k = 0; k < NP; k++) {
    if ((int)P[k].gpu != gi) continue;
    if (list && n < *max) {
      char *e = (char *)list + (size_t)n * L_proc__SIZE;
      memset(e, 0, L_proc__SIZE);
      snprintf(e + L_proc_name, L_proc_name_SIZE, "python3");
      PUT(uint32_t, e, L_proc_pid, P[k].pid);
      PUT(uint64_t, e, L_proc_mem, P[k].vram);
      PUT(uint64_t, e, L_proc_memory_usage_vram_mem, P[k].vram);
      PUT(uint64_t, e, L_proc_memory_usage_gtt_mem, 2ULL << 20);
      PUT(uint32_t, e, L_proc_cu_occupancy, 0xFFFFFFFF);
    }
    n++;
  }
  if (list && n > *max) { *max = n; return S_OUT_OF_RESOURCES; }
  *max = n;
  return S_SUCCESS;
}
