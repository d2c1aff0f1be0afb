/* resident.h — a dataset copied once to a device, so that a training step moves
 * only the indices of its samples: the device gathers the rows itself
 * (backend gather_rows), instead of the host copying every batch's images.
 * On a GPU this takes the host-to-device copy of the images out of the step;
 * on a CPU device it is the same code path over host memory (which is how the
 * CPU suite checks it).
 */
#ifndef DP_RESIDENT_H
#define DP_RESIDENT_H

#include <stdint.h>

#include "backend.h"

typedef struct dp_resident {
  dp_device *dev;     /* borrowed; outlives the dataset */
  void *x;            /* (count, sample_elems) uint8 or float32, device memory */
  int x_is_u8;
  int32_t *y;         /* (count) labels, device memory, checked against num_classes */
  int64_t count, sample_elems;
  int num_classes;
} dp_resident;

/* Copies count samples of sample_elems elements (uint8 or float32) and their
 * labels (int64, each in [0, num_classes)) to dev. */
DP_MUST_CHECK dp_status dp_resident_create(dp_device *dev, const void *x, int x_is_u8, const int64_t *y, int64_t count,
                                           int64_t sample_elems, int num_classes, dp_resident **out);
void dp_resident_destroy(dp_resident *d);
size_t dp_resident_bytes(const dp_resident *d);

#endif
