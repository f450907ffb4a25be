/* mlxrs's own additions to libmlxc (not mlx-c's): entry points for what MLX 0.32 adds and mlx-c
   v0.5.0's C API does not reach, written the way mlx-c writes its functions (result through the
   first pointer, 0 on success, 1 after reporting the exception through mlx-c's error handler).
   Compiled into libmlxc by native/CMakeLists.txt, so they share mlx-c's private handle helpers. */
#include "mlx/c/error.h"
#include "mlx/c/private/mlx.h"
#include "mlx/fast.h"

extern "C" {

/* fast::scaled_dot_product_attention with MLX 0.32's force_fused: true asks for the fused kernel
   even where MLX would materialize the scores (long prompts), trading speed for peak memory. */
int mlxrs_fast_scaled_dot_product_attention_fused(
    mlx_array* res,
    const mlx_array queries,
    const mlx_array keys,
    const mlx_array values,
    float scale,
    const char* mask_mode,
    const mlx_array mask_arr /* may be null */,
    const mlx_array sinks /* may be null */,
    bool force_fused,
    const mlx_stream s) {
  try {
    mlx_array_set_(
        *res,
        mlx::core::fast::scaled_dot_product_attention(
            mlx_array_get_(queries),
            mlx_array_get_(keys),
            mlx_array_get_(values),
            scale,
            std::string(mask_mode),
            (mask_arr.ctx ? std::make_optional(mlx_array_get_(mask_arr))
                          : std::nullopt),
            (sinks.ctx ? std::make_optional(mlx_array_get_(sinks))
                       : std::nullopt),
            force_fused,
            mlx_stream_get_(s)));
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}

/* fast::gated_delta_update (MLX 0.32): the gated DeltaNet recurrence of Qwen3.5/Qwen3-Next in one
   kernel where the backend has one; res gets [output, final state]. */
int mlxrs_fast_gated_delta_update(
    mlx_vector_array* res,
    const mlx_array queries,
    const mlx_array keys,
    const mlx_array values,
    const mlx_array gates,
    const mlx_array beta,
    const mlx_array initial_state /* may be null */,
    const mlx_array mask /* may be null */,
    const mlx_stream s) {
  try {
    mlx_vector_array_set_(
        *res,
        mlx::core::fast::gated_delta_update(
            mlx_array_get_(queries),
            mlx_array_get_(keys),
            mlx_array_get_(values),
            mlx_array_get_(gates),
            mlx_array_get_(beta),
            (initial_state.ctx
                 ? std::make_optional(mlx_array_get_(initial_state))
                 : std::nullopt),
            (mask.ctx ? std::make_optional(mlx_array_get_(mask))
                      : std::nullopt),
            mlx_stream_get_(s)));
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}

} // extern "C"
