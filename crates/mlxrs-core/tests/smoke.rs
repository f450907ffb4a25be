use mlxrs_core::handle::{self as mx, Array};

#[test]
fn matmul_and_error_recovery() {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
    let b = Array::from_slice(&[5.0f32, 6.0, 7.0, 8.0], &[2, 2]).unwrap();
    let c = mx::matmul(&a, &b).unwrap();
    assert_eq!(c.to_vec::<f32>().unwrap(), vec![19.0, 22.0, 43.0, 50.0]);
    let bad = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3, 1]).unwrap();
    let err = mx::matmul(&a, &bad).and_then(|x| x.eval().map(|_| x)).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("matmul") || msg.contains("shape"), "{msg}");
    // the next call works
    let d = mx::add(&a, &b).unwrap();
    assert_eq!(d.to_vec::<f32>().unwrap(), vec![6.0, 8.0, 10.0, 12.0]);
    let info = mlxrs_core::info::runtime_info().unwrap();
    eprintln!("{info:?}");
}
