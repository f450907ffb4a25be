//! The load-time check that libmlxc's C API is the one the bindings were generated for.
use mlxrs_sys::{signature_mismatch, SIGNATURES};

fn table(edit: impl Fn(&str, &str) -> Option<String>) -> String {
    SIGNATURES.iter().filter_map(|(n, s)| edit(n, s).map(|s| format!("{n}={s}\n"))).collect()
}

#[test]
fn identical_table_passes_and_extra_functions_are_fine() {
    let mut t = table(|_, s| Some(s.to_string()));
    assert_eq!(signature_mismatch(&t), None);
    t.push_str("mlx_something_new=(mlx_array) -> c_int\n");
    assert_eq!(signature_mismatch(&t), None);
}

#[test]
fn a_changed_signature_is_named() {
    // MLX 0.32's dequantize without the global scale: what an unpatched v0.5.0 would present
    let t = table(|n, s| {
        Some(if n == "mlx_dequantize" {
            s.replace(", mlx_array, mlx_optional_dtype", ", mlx_optional_dtype")
        } else {
            s.to_string()
        })
    });
    let msg = signature_mismatch(&t).expect("a changed signature must be reported");
    assert!(msg.contains("mlx_dequantize: library (") && msg.contains("1 function(s)"), "{msg}");
    assert!(msg.contains("python native/build.py"), "{msg}");
}

#[test]
fn a_missing_function_is_named() {
    let t = table(|n, s| (n != "mlx_fft_fft").then(|| s.to_string()));
    let msg = signature_mismatch(&t).expect("a missing function must be reported");
    assert!(msg.contains("mlx_fft_fft: not in the library's table"), "{msg}");
}

#[test]
fn bindings_follow_the_patched_headers() {
    let sig = |name: &str| SIGNATURES.iter().find(|(n, _)| *n == name).map(|(_, s)| *s).unwrap();
    // native/patches/0004: global scales; 0003: the FFT norm
    assert!(sig("mlx_quantize").contains("*const c_char, mlx_array, mlx_stream"), "{}", sig("mlx_quantize"));
    assert!(sig("mlx_gather_qmm").contains("*const c_char, mlx_array, bool, mlx_stream"));
    assert!(sig("mlx_fft_rfft").contains("c_int, c_int, mlx_fft_norm, mlx_stream"));
}
