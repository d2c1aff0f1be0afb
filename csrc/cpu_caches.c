#include "cpu_caches.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int64_t l2_bytes = DP_L2_DEFAULT;
static const char *l2_source = "default";

static int in_range(int64_t v) { return v >= DP_L2_MIN && v <= DP_L2_MAX; }

/* "1024K", "2M", "1048576": bytes, or -1 */
static int64_t parse_size(const char *s) {
  char *end;
  long long v = strtoll(s, &end, 10);
  if (end == s || v <= 0 || v > DP_L2_MAX) return -1; /* past the range whatever the unit: no shift overflows */
  if (*end == 'K' || *end == 'k') v <<= 10;
  else if (*end == 'M' || *end == 'm') v <<= 20;
  else if (*end != '\0' && *end != '\n') return -1;
  return (int64_t)v;
}

static int read_line(const char *path, char *buf, size_t n) {
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  const int ok = fgets(buf, (int)n, f) != NULL;
  fclose(f);
  return ok;
}

/* cpu0's level-2 data or unified cache in sysfs, or -1 */
static int64_t sysfs_l2(void) {
  for (int i = 0; i < 16; ++i) {
    char path[96], level[16], type[32], size[32];
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
    if (!read_line(path, level, sizeof level)) continue;
    if (atoi(level) != 2) continue;
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/type", i);
    if (!read_line(path, type, sizeof type) || strncmp(type, "Instruction", 11) == 0) continue;
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
    if (read_line(path, size, sizeof size)) return parse_size(size);
  }
  return -1;
}

static void probe(void) {
  const char *env = getenv("DPCORE_L2_BYTES");
  int64_t v;
  if (env && in_range(v = parse_size(env))) {
    l2_bytes = v, l2_source = "DPCORE_L2_BYTES";
    return;
  }
  if (in_range(v = sysfs_l2())) {
    l2_bytes = v, l2_source = "sysfs";
    return;
  }
#ifdef _SC_LEVEL2_CACHE_SIZE
  if (in_range(v = (int64_t)sysconf(_SC_LEVEL2_CACHE_SIZE))) l2_bytes = v, l2_source = "sysconf";
#endif
}

dp_status dp_cpu_l2_env_check(void) {
  const char *env = getenv("DPCORE_L2_BYTES");
  if (env && env[0] && !in_range(parse_size(env)))
    return DP_FAIL(DP_ERR_VALUE, "DPCORE_L2_BYTES must be a size from 128K to 64M (e.g. 2M, 1048576) or unset, got \"%.40s\"",
                   env);
  return DP_OK;
}

int64_t dp_cpu_l2_bytes(void) {
  pthread_once(&once, probe);
  return l2_bytes;
}

const char *dp_cpu_l2_source(void) {
  pthread_once(&once, probe);
  return l2_source;
}
