/* backend_table.c — the backend table's entries by name, and a check that a table
 * fills every entry (tests/test_cuda_build.py runs it on the CUDA table, which
 * needs no GPU to inspect). */
#include <stddef.h>
#include <string.h>

#include "backend.h"

#define DP_ENTRY(name) {#name, offsetof(dp_backend, name)}
static const struct {
  const char *name;
  size_t offset;
} entries[] = {
    DP_ENTRY(alloc), DP_ENTRY(release), DP_ENTRY(copy_to_device), DP_ENTRY(copy_to_host), DP_ENTRY(fill),
    DP_ENTRY(u8_to_unit), DP_ENTRY(gather_rows), DP_ENTRY(conv2d_forward), DP_ENTRY(conv2d_backward), DP_ENTRY(dense_forward),
    DP_ENTRY(dense_backward), DP_ENTRY(relu_forward), DP_ENTRY(relu_backward), DP_ENTRY(avgpool_forward),
    DP_ENTRY(avgpool_backward), DP_ENTRY(relu_avgpool_forward), DP_ENTRY(avgpool_relu_backward),
    DP_ENTRY(conv2d_relu_avgpool_backward), DP_ENTRY(maxpool_forward), DP_ENTRY(maxpool_backward), DP_ENTRY(softmax_xent),
    DP_ENTRY(sgd_update), DP_ENTRY(loss_flag), DP_ENTRY(restore_unless_allowed), DP_ENTRY(add), DP_ENTRY(add_relu), DP_ENTRY(scale), DP_ENTRY(global_avgpool_forward),
    DP_ENTRY(global_avgpool_backward), DP_ENTRY(bn_sums), DP_ENTRY(bn_finalize), DP_ENTRY(bn_apply), DP_ENTRY(bn_apply_relu),
    DP_ENTRY(bn_backward_sums), DP_ENTRY(bn_backward_dx), DP_ENTRY(metrics_read), DP_ENTRY(synchronize), DP_ENTRY(stream_create),
    DP_ENTRY(stream_destroy), DP_ENTRY(event_create), DP_ENTRY(event_destroy), DP_ENTRY(event_record), DP_ENTRY(event_wait),
    DP_ENTRY(destroy),
};
#undef DP_ENTRY

#define DP_NENTRIES (sizeof entries / sizeof entries[0])
/* every member after the name is a function pointer, and each is listed above */
_Static_assert(sizeof(dp_backend) == sizeof(const char *) + DP_NENTRIES * sizeof(void (*)(void)),
               "backend_table.c must list every entry of dp_backend");

int dp_backend_null_entries(const dp_backend *be, const char **out, int max) {
  int n = 0;
  for (size_t i = 0; i < DP_NENTRIES; ++i) {
    void (*fn)(void);
    memcpy(&fn, (const char *)be + entries[i].offset, sizeof fn);
    if (!fn) {
      if (n < max) out[n] = entries[i].name;
      ++n;
    }
  }
  return n;
}
