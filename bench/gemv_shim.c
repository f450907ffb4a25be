// An experiment (bench_generate.py --gemv-shim), not part of mlxrs: a cblas_sgemm interposer for MLX's
// CPU backend. MLX calls cblas_sgemm for every float32 matmul, including the [1, K] x [K, N] products of
// decoding; OpenBLAS 0.3.21 then packs the whole weight matrix before a tiny kernel runs, which costs
// 2-4x a matrix-vector product. Here M == 1 or N == 1 goes to cblas_sgemv; everything else goes to the
// next cblas_sgemm in the lookup order (OpenBLAS, which this library is linked against).
//
// Build: gcc -O2 -shared -fPIC -o libgemvshim.so gemv_shim.c /path/to/libopenblas.so -ldl -Wl,-rpath,DIR
// Use:   MLXRS_BLAS=/path/to/libgemvshim.so (mlxrs) or LD_PRELOAD=/path/to/libgemvshim.so (plain MLX)
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

enum { RowMajor = 101, ColMajor = 102 };
enum { NoTrans = 111, Trans = 112 };
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
extern void cblas_sgemv(int order, int trans, int m, int n, float alpha, const float *a, int lda, const float *x,
                        int incx, float beta, float *y, int incy);

static sgemm_fn next_sgemm;

void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {
    if (order == RowMajor && K > 0) {
        if (M == 1) {
            // c[1,N] = a[1,K] op(B)[K,N]  <=>  c = op(B)^T a
            int incx = ta == NoTrans ? 1 : lda;
            if (tb == NoTrans)  // B is [K,N] row-major: c = B^T a
                cblas_sgemv(RowMajor, Trans, K, N, alpha, B, ldb, A, incx, beta, C, 1);
            else                // B is [N,K] row-major: c = B a
                cblas_sgemv(RowMajor, NoTrans, N, K, alpha, B, ldb, A, incx, beta, C, 1);
            return;
        }
        if (N == 1) {
            // c[M,1] = op(A)[M,K] b[K,1]
            int incx = tb == NoTrans ? ldb : 1;
            if (ta == NoTrans)
                cblas_sgemv(RowMajor, NoTrans, M, K, alpha, A, lda, B, incx, beta, C, ldc);
            else
                cblas_sgemv(RowMajor, Trans, K, M, alpha, A, lda, B, incx, beta, C, ldc);
            return;
        }
    }
    if (!next_sgemm) next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    next_sgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
