/* Compiled into libmlxc by native/CMakeLists.txt so the loader can tell which mlx-c release it is
   (mlx-c's own mlx_version() reports MLX's version). */
const char* mlxrs_mlxc_version(void) { return MLXRS_MLXC_VERSION; }
