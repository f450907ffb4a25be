// libmlxrs_blas: routes MLX's matrix-vector products to BLAS's gemv (Linux, CPU backend).
//
// MLX's CPU backend calls cblas_sgemm for every float32 matmul, including the [1, K] x [K, N]
// products of decoding one token. OpenBLAS (0.3.21 measured) then packs the whole weight matrix
// before a small kernel runs: 2-4x the cost of a matrix-vector product, which reads each weight once.
// This library defines cblas_sgemm; the loader (crates/mlxrs-sys/src/resolve.rs) opens it with
// RTLD_GLOBAL before the optimized BLAS and before libmlx, so libmlx binds its cblas_sgemm here.
// M == 1 or N == 1 becomes cblas_sgemv; every other product goes to the BLAS's own cblas_sgemm.
//
// The loader hands over the BLAS's functions with mlxrs_blas_bind(). Without that call (the library
// put in LD_PRELOAD before the BLAS, as tests/conftest.py does for the mlx-lm oracle), the first call
// finds them with dlsym(RTLD_NEXT). MLXRS_BLAS_GEMV=off makes the loader skip this library.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

enum { RowMajor = 101, ColMajor = 102 };
enum { NoTrans = 111, Trans = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *,
                         int);

static sgemm_fn next_sgemm;
static sgemv_fn next_sgemv;
static unsigned long long gemv_calls;

// The BLAS's own functions (from the loader, which opened that BLAS). Returns 0 on success.
__attribute__((visibility("default"))) int mlxrs_blas_bind(void *sgemm, void *sgemv) {
    if (!sgemm || !sgemv) return 1;
    __atomic_store_n(&next_sgemm, (sgemm_fn)sgemm, __ATOMIC_RELEASE);
    __atomic_store_n(&next_sgemv, (sgemv_fn)sgemv, __ATOMIC_RELEASE);
    return 0;
}

// How many products went to gemv so far (for tests and `mlxrs --version`).
__attribute__((visibility("default"))) unsigned long long mlxrs_blas_gemv_calls(void) {
    return __atomic_load_n(&gemv_calls, __ATOMIC_RELAXED);
}

static void resolve(void) {
    if (!__atomic_load_n(&next_sgemm, __ATOMIC_ACQUIRE))
        __atomic_store_n(&next_sgemm, (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm"), __ATOMIC_RELEASE);
    if (!__atomic_load_n(&next_sgemv, __ATOMIC_ACQUIRE))
        __atomic_store_n(&next_sgemv, (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv"), __ATOMIC_RELEASE);
    if (!next_sgemm || !next_sgemv) {
        // no BLAS after this library: nothing sensible to compute with
        fprintf(stderr, "libmlxrs_blas: no cblas_sgemm/cblas_sgemv to forward to (load a BLAS after it)\n");
        abort();
    }
}

__attribute__((visibility("default"))) void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha,
                                                        const float *A, int lda, const float *B, int ldb,
                                                        float beta, float *C, int ldc) {
    sgemm_fn gemm = __atomic_load_n(&next_sgemm, __ATOMIC_ACQUIRE);
    sgemv_fn gemv = __atomic_load_n(&next_sgemv, __ATOMIC_ACQUIRE);
    if (!gemm || !gemv) {
        resolve();
        gemm = next_sgemm;
        gemv = next_sgemv;
    }
    if (order == RowMajor && K > 0 && (M == 1 || N == 1)) {
        __atomic_fetch_add(&gemv_calls, 1, __ATOMIC_RELAXED);
        if (M == 1) {
            // c[1, N] = a[1, K] op(B)[K, N]  <=>  c = op(B)^T a; a's elements are 1 apart unless A is
            // stored transposed ([K, 1] row-major with stride lda)
            int incx = ta == NoTrans ? 1 : lda;
            if (tb == NoTrans)  // B is [K, N] row-major: c = B^T a
                gemv(RowMajor, Trans, K, N, alpha, B, ldb, A, incx, beta, C, 1);
            else  // B is [N, K] row-major: c = B a
                gemv(RowMajor, NoTrans, N, K, alpha, B, ldb, A, incx, beta, C, 1);
        } else {
            // c[M, 1] = op(A)[M, K] b[K, 1]; C's rows are ldc apart
            int incx = tb == NoTrans ? ldb : 1;
            if (ta == NoTrans)  // A is [M, K]
                gemv(RowMajor, NoTrans, M, K, alpha, A, lda, B, incx, beta, C, ldc);
            else  // A is [K, M]: c = A^T b
                gemv(RowMajor, Trans, K, M, alpha, A, lda, B, incx, beta, C, ldc);
        }
        return;
    }
    gemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
