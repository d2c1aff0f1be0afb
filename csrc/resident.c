#include "resident.h"

#include <stdlib.h>

dp_status dp_resident_create(dp_device *dev, const void *x, int x_is_u8, const int64_t *y, int64_t count,
                             int64_t sample_elems, int num_classes, dp_resident **out) {
  *out = NULL;
  /* the gather's row indices are int32 on the device */
  if (count < 1 || count > INT32_MAX)
    return DP_FAIL(DP_ERR_VALUE, "a resident dataset needs 1 to %d samples, got %lld", INT32_MAX, (long long)count);
  if (sample_elems < 1) return DP_FAIL(DP_ERR_VALUE, "a resident dataset's samples need at least one element");
  for (int64_t i = 0; i < count; ++i)
    if (y[i] < 0 || y[i] >= num_classes)
      return DP_FAIL(DP_ERR_VALUE, "label %lld at index %lld is outside [0, %d)", (long long)y[i], (long long)i,
                     num_classes);
  dp_resident *d = calloc(1, sizeof *d);
  int32_t *labels = malloc(sizeof(int32_t) * (size_t)count);
  if (!d || !labels) {
    free(d);
    free(labels);
    return DP_FAIL(DP_ERR_MEMORY, "cannot allocate a resident dataset of %lld samples", (long long)count);
  }
  for (int64_t i = 0; i < count; ++i) labels[i] = (int32_t)y[i];
  d->dev = dev;
  d->x_is_u8 = x_is_u8;
  d->count = count;
  d->sample_elems = sample_elems;
  d->num_classes = num_classes;
  const size_t xbytes = (size_t)count * (size_t)sample_elems * (x_is_u8 ? 1 : sizeof(float));
  dp_status st = dp_device_alloc(dev, xbytes, &d->x);
  if (st == DP_OK) st = dp_device_alloc(dev, sizeof(int32_t) * (size_t)count, (void **)&d->y);
  if (st == DP_OK) st = dev->backend->copy_to_device(dev, d->x, x, xbytes);
  if (st == DP_OK) st = dev->backend->copy_to_device(dev, d->y, labels, sizeof(int32_t) * (size_t)count);
  free(labels);
  if (st != DP_OK) {
    dp_resident_destroy(d);
    return st;
  }
  *out = d;
  return DP_OK;
}

void dp_resident_destroy(dp_resident *d) {
  if (!d) return;
  dp_device_free(d->dev, d->x);
  dp_device_free(d->dev, d->y);
  free(d);
}

size_t dp_resident_bytes(const dp_resident *d) {
  return (size_t)d->count * ((size_t)d->sample_elems * (d->x_is_u8 ? 1 : sizeof(float)) + sizeof(int32_t));
}
