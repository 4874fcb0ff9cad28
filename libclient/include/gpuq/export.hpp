/* gpuq symbol export.
 *
 * libgpuq.so is built with -fvisibility=hidden: only declarations marked GPUQ_API are exported.
 * The static library and the consumers of either library see the same attribute, which is
 * harmless there. This header is plain preprocessor so that the C header gpuq.h can include it.
 */
#ifndef GPUQ_EXPORT_HPP_
#define GPUQ_EXPORT_HPP_

#if defined(__GNUC__) || defined(__clang__)
#define GPUQ_API __attribute__((visibility("default")))
#else
#define GPUQ_API
#endif

#endif /* GPUQ_EXPORT_HPP_ */
