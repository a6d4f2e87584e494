"""The fused CUDA versions of :mod:`workers.kernels`, for CuPy ``float32`` arrays: one
raw kernel (the softmax cross-entropy, one thread per row) and elementwise ones, each
compiled by CuPy on first use. CuPy is imported only then: importing this module never
imports it."""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["SOFTMAX_XENT_SRC", "kernel"]


@functools.cache
def kernel(name: str) -> Any:
    """The fused CUDA kernel ``name`` (compiled on first use)."""
    import cupy as cp

    if name == "softmax_xent":
        return cp.RawKernel(SOFTMAX_XENT_SRC, "qps_softmax_xent")
    if name == "sigmoid_xent":
        return cp.ElementwiseKernel(
            "T z, T y, T scale",
            "T loss, T g",
            """
            T e = exp(-fabs(z));
            loss = (z > (T)0 ? z : (T)0) - z * y + log1p(e);
            T p = z >= (T)0 ? (T)1 / ((T)1 + e) : e / ((T)1 + e);
            g = (p - y) * scale;
            """,
            "qps_sigmoid_xent",
        )
    if name == "relu":
        return cp.ElementwiseKernel("T x", "T y", "y = x > (T)0 ? x : (T)0;", "qps_relu")
    if name == "relu_backward":
        return cp.ElementwiseKernel(
            "T g, T y", "T dx", "dx = y > (T)0 ? g : g * (T)0;", "qps_relu_backward"
        )
    if name == "bias_relu":
        return cp.ElementwiseKernel(
            "T x, T b", "T y", "T v = x + b; y = v > (T)0 ? v : (T)0;", "qps_bias_relu"
        )
    if name == "bag_fixed":
        # out[b, d] = pool over j of table[ids[b, j], d], ids < 0 skipped
        return cp.ElementwiseKernel(
            "raw T table, raw int64 ids, int64 L, int64 D, int32 mean",
            "T out",
            """
            long long b = i / D, d = i % D;
            T acc = 0;
            int cnt = 0;
            for (long long j = 0; j < L; ++j) {
                long long r = ids[b * L + j];
                if (r >= 0) { acc += table[r * D + d]; ++cnt; }
            }
            out = (mean && cnt > 0) ? acc / (T)cnt : acc;
            """,
            "qps_embedding_bag_fixed",
        )
    if name == "bag_offsets":
        # out[b, d] = pool over ids[starts[b]:ends[b]] of table[id, d]
        return cp.ElementwiseKernel(
            "raw T table, raw int64 ids, raw int64 starts, raw int64 ends, int64 D, int32 mean",
            "T out",
            """
            long long b = i / D, d = i % D;
            long long s = starts[b], e = ends[b];
            T acc = 0;
            for (long long j = s; j < e; ++j) acc += table[ids[j] * D + d];
            out = (mean && e > s) ? acc / (T)(e - s) : acc;
            """,
            "qps_embedding_bag_offsets",
        )
    if name == "scatter_add":
        # out[inv[k], d] += values[k, d]
        return cp.ElementwiseKernel(
            "T v, raw int64 inv, int64 D",
            "raw T out",
            "atomicAdd(&out[inv[i / D] * D + i % D], v);",
            "qps_scatter_add_rows",
        )
    if name == "bag_fixed_backward":
        # out[inv[b*L+j], d] += grad[b, d] * scale[b] for every id >= 0
        return cp.ElementwiseKernel(
            "raw T grad, raw int64 ids, raw int64 inv, raw T scale, int64 L, int64 D",
            "raw T out",
            """
            long long d = i % D, bl = i / D, b = bl / L;
            if (ids[bl] >= 0) atomicAdd(&out[inv[bl] * D + d], grad[b * D + d] * scale[b]);
            """,
            "qps_embedding_bag_fixed_backward",
        )
    raise KeyError(name)


# One thread per row: the row's maximum, the sum of exponentials, its loss and (when
# asked) its gradient row, without any [N, C] temporary.
SOFTMAX_XENT_SRC = r"""
extern "C" __global__ void qps_softmax_xent(
    const float* logits, const long long* labels, float* grad, float* row_loss,
    long long n, long long c, float scale, int want_grad)
{
    long long i = (long long)blockDim.x * blockIdx.x + threadIdx.x;
    if (i >= n) return;
    const float* z = logits + i * c;
    float m = z[0];
    for (long long k = 1; k < c; ++k) m = fmaxf(m, z[k]);
    float s = 0.0f;
    for (long long k = 0; k < c; ++k) s += expf(z[k] - m);
    long long y = labels[i];
    row_loss[i] = m + logf(s) - z[y];
    if (want_grad) {
        float inv = 1.0f / s;
        float* g = grad + i * c;
        for (long long k = 0; k < c; ++k) {
            float p = expf(z[k] - m) * inv;
            g[k] = (p - (k == y ? 1.0f : 0.0f)) * scale;
        }
    }
}
"""
