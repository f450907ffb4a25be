//! `Array`: an owned reference to an MLX array (Drop frees, Clone shares the same buffer).
use super::{check, runtime::init, take_string};
use crate::error::{Error, Result};
use half::{bf16, f16};
use mlxrs_sys as sys;

/// MLX element types, in mlx-c's numbering.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bool,
    Uint8,
    Uint16,
    Uint32,
    Uint64,
    Int8,
    Int16,
    Int32,
    Int64,
    Float16,
    Float32,
    Float64,
    Bfloat16,
    Complex64,
}

impl Dtype {
    pub(crate) fn raw(self) -> sys::mlx_dtype {
        self as sys::mlx_dtype
    }
    pub(crate) fn from_raw(v: sys::mlx_dtype) -> Dtype {
        use Dtype::*;
        [Bool, Uint8, Uint16, Uint32, Uint64, Int8, Int16, Int32, Int64, Float16, Float32, Float64, Bfloat16, Complex64]
            [v as usize]
    }
    /// Bytes per element.
    pub fn size(self) -> usize {
        use Dtype::*;
        match self {
            Bool | Uint8 | Int8 => 1,
            Uint16 | Int16 | Float16 | Bfloat16 => 2,
            Uint32 | Int32 | Float32 => 4,
            Uint64 | Int64 | Float64 | Complex64 => 8,
        }
    }
    pub fn is_float(self) -> bool {
        matches!(self, Dtype::Float16 | Dtype::Float32 | Dtype::Float64 | Dtype::Bfloat16)
    }
    /// numpy-style name ("float32", "bfloat16", …).
    pub fn name(self) -> &'static str {
        use Dtype::*;
        match self {
            Bool => "bool",
            Uint8 => "uint8",
            Uint16 => "uint16",
            Uint32 => "uint32",
            Uint64 => "uint64",
            Int8 => "int8",
            Int16 => "int16",
            Int32 => "int32",
            Int64 => "int64",
            Float16 => "float16",
            Float32 => "float32",
            Float64 => "float64",
            Bfloat16 => "bfloat16",
            Complex64 => "complex64",
        }
    }
    pub fn from_name(s: &str) -> Option<Dtype> {
        use Dtype::*;
        Some(match s {
            "bool" => Bool,
            "uint8" | "u8" => Uint8,
            "uint16" => Uint16,
            "uint32" => Uint32,
            "uint64" => Uint64,
            "int8" => Int8,
            "int16" => Int16,
            "int32" | "i32" => Int32,
            "int64" => Int64,
            "float16" | "f16" | "fp16" => Float16,
            "float32" | "f32" | "fp32" => Float32,
            "float64" => Float64,
            "bfloat16" | "bf16" => Bfloat16,
            "complex64" => Complex64,
            _ => return None,
        })
    }
}

/// Rust element types that map one-to-one onto an MLX dtype.
pub trait Element: Copy + 'static {
    const DTYPE: Dtype;
}
macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(impl Element for $t { const DTYPE: Dtype = Dtype::$d; })*};
}
element!(bool => Bool, u8 => Uint8, u16 => Uint16, u32 => Uint32, u64 => Uint64, i8 => Int8, i16 => Int16,
         i32 => Int32, i64 => Int64, f16 => Float16, f32 => Float32, f64 => Float64, bf16 => Bfloat16);

/// An MLX array handle.
pub struct Array(pub(crate) sys::mlx_array);

// SAFETY: an mlx_array is a reference-counted pointer to an immutable array; MLX's own Python binding
// shares them between threads. Mutation happens only through new handles.
unsafe impl Send for Array {}
unsafe impl Sync for Array {}

impl Drop for Array {
    fn drop(&mut self) {
        if !self.0.ctx.is_null() {
            unsafe { sys::mlx_array_free(self.0) };
        }
    }
}

impl Clone for Array {
    fn clone(&self) -> Self {
        let mut a = unsafe { sys::mlx_array_new() };
        unsafe { sys::mlx_array_set(&mut a, self.0) };
        Array(a)
    }
}

impl std::fmt::Debug for Array {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = unsafe { sys::mlx_string_new() };
        if unsafe { sys::mlx_array_tostring(&mut s, self.0) } != 0 {
            unsafe { sys::mlx_string_free(s) };
            return write!(f, "Array(shape={:?}, dtype={:?})", self.shape(), self.dtype());
        }
        f.write_str(&take_string(s))
    }
}

fn shape_len(shape: &[i32]) -> Result<usize> {
    shape.iter().try_fold(1usize, |acc, &d| {
        if d < 0 {
            Err(Error::Invalid(format!("negative dimension in shape {shape:?}")))
        } else {
            acc.checked_mul(d as usize).ok_or_else(|| Error::Invalid(format!("shape {shape:?} overflows")))
        }
    })
}

impl Array {
    /// Wrap a handle that mlx-c filled in (ownership moves to the Array).
    pub(crate) fn from_raw(a: sys::mlx_array) -> Array {
        Array(a)
    }

    /// An empty handle for an out-parameter.
    pub(crate) fn empty_raw() -> sys::mlx_array {
        unsafe { sys::mlx_array_new() }
    }

    /// Copy `data` into a new array of `shape`.
    pub fn from_slice<T: Element>(data: &[T], shape: &[i32]) -> Result<Array> {
        let n = shape_len(shape)?;
        if n != data.len() {
            return Err(Error::Invalid(format!("data has {} elements but shape {shape:?} needs {n}", data.len())));
        }
        init()?;
        // SAFETY: data holds exactly prod(shape) elements of T, and mlx-c copies them.
        let a = unsafe {
            sys::mlx_array_new_data(data.as_ptr().cast(), shape.as_ptr(), shape.len() as i32, T::DTYPE.raw())
        };
        Ok(Array(a))
    }

    /// Copy raw little-endian bytes of `dtype` into a new array (numpy buffers, safetensors payloads).
    pub fn from_bytes(bytes: &[u8], shape: &[i32], dtype: Dtype) -> Result<Array> {
        let n = shape_len(shape)?;
        if n.checked_mul(dtype.size()) != Some(bytes.len()) {
            return Err(Error::Invalid(format!(
                "{} bytes cannot fill shape {shape:?} of {}",
                bytes.len(),
                dtype.name()
            )));
        }
        init()?;
        // SAFETY: bytes holds exactly prod(shape) * itemsize bytes; mlx-c copies them.
        let a =
            unsafe { sys::mlx_array_new_data(bytes.as_ptr().cast(), shape.as_ptr(), shape.len() as i32, dtype.raw()) };
        Ok(Array(a))
    }

    pub fn scalar<T: Element>(v: T) -> Result<Array> {
        Array::from_slice(&[v], &[])
    }

    pub fn f32(v: f32) -> Result<Array> {
        Array::scalar(v)
    }

    pub fn shape(&self) -> Vec<i32> {
        let n = self.ndim();
        if n == 0 {
            return Vec::new();
        }
        // SAFETY: mlx_array_shape points at ndim ints owned by the array, valid while it lives.
        unsafe { std::slice::from_raw_parts(sys::mlx_array_shape(self.0), n).to_vec() }
    }

    pub fn dim(&self, axis: i32) -> i32 {
        let n = self.ndim() as i32;
        let ax = if axis < 0 { axis + n } else { axis };
        unsafe { sys::mlx_array_dim(self.0, ax) }
    }

    pub fn ndim(&self) -> usize {
        unsafe { sys::mlx_array_ndim(self.0) }
    }

    pub fn size(&self) -> usize {
        unsafe { sys::mlx_array_size(self.0) }
    }

    pub fn nbytes(&self) -> usize {
        unsafe { sys::mlx_array_nbytes(self.0) }
    }

    pub fn dtype(&self) -> Dtype {
        Dtype::from_raw(unsafe { sys::mlx_array_dtype(self.0) })
    }

    /// Evaluate this array (and its graph).
    pub fn eval(&self) -> Result<()> {
        bump_eval_epoch();
        check(unsafe { sys::mlx_array_eval(self.0) })
    }

    /// Evaluate and copy out as `T` (the array is converted to `T`'s dtype first when it differs).
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let bytes = self.to_bytes_as(T::DTYPE)?;
        let n = bytes.len() / std::mem::size_of::<T>();
        let mut out = Vec::<T>::with_capacity(n);
        // SAFETY: `bytes` holds n elements of T's dtype in native layout; T is a plain Copy type of
        // that size; the Vec has capacity n.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.as_mut_ptr().cast::<u8>(), bytes.len());
            out.set_len(n);
        }
        Ok(out)
    }

    /// Evaluate and copy out the raw row-major bytes in the array's own dtype.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        self.to_bytes_as(self.dtype())
    }

    fn to_bytes_as(&self, dtype: Dtype) -> Result<Vec<u8>> {
        let a = if self.dtype() == dtype { self.clone() } else { super::astype(self, dtype)? };
        let a = super::contiguous(&a)?;
        // half types are read through a same-width integer view (mlx-c has no float16 accessors on x86)
        let a = if matches!(dtype, Dtype::Float16 | Dtype::Bfloat16) { super::view(&a, Dtype::Uint16)? } else { a };
        a.eval()?;
        let nbytes = a.size() * dtype.size();
        if nbytes == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: after eval, a row-contiguous array's data pointer addresses size() elements.
        let ptr: *const u8 = unsafe {
            use Dtype::*;
            match dtype {
                Bool => sys::mlx_array_data_bool(a.0).cast(),
                Uint8 => sys::mlx_array_data_uint8(a.0).cast(),
                Uint16 => sys::mlx_array_data_uint16(a.0).cast(),
                Uint32 => sys::mlx_array_data_uint32(a.0).cast(),
                Uint64 => sys::mlx_array_data_uint64(a.0).cast(),
                Int8 => sys::mlx_array_data_int8(a.0).cast(),
                Int16 => sys::mlx_array_data_int16(a.0).cast(),
                Int32 => sys::mlx_array_data_int32(a.0).cast(),
                Int64 => sys::mlx_array_data_int64(a.0).cast(),
                Float16 | Bfloat16 => sys::mlx_array_data_uint16(a.0).cast(),
                Float32 => sys::mlx_array_data_float32(a.0).cast(),
                Float64 => sys::mlx_array_data_float64(a.0).cast(),
                Complex64 => sys::mlx_array_data_complex64(a.0).cast(),
            }
        };
        if ptr.is_null() {
            return Err(Error::Mlx("array has no data after evaluation".into()));
        }
        Ok(unsafe { std::slice::from_raw_parts(ptr, nbytes) }.to_vec())
    }

    /// The values of an evaluated, row-contiguous float32 array, borrowed from MLX's buffer (evaluated
    /// here); None for another dtype or layout. For arrays nothing writes any more (a model's weights):
    /// MLX never writes an evaluated array in place while another handle holds it, and `self` does.
    pub fn f32_values(&self) -> Result<Option<&[f32]>> {
        if self.dtype() != Dtype::Float32 {
            return Ok(None);
        }
        self.eval()?;
        let mut row = false;
        // SAFETY: mlx-c writes one bool through the pointer.
        check(unsafe { sys::_mlx_array_is_row_contiguous(&mut row, self.0) })?;
        let n = self.size();
        if !row || n == 0 {
            return Ok(None);
        }
        // SAFETY: after eval, a row-contiguous float32 array's data pointer addresses size() values,
        // alive while `self` holds the array.
        let ptr = unsafe { sys::mlx_array_data_float32(self.0) };
        if ptr.is_null() {
            return Ok(None);
        }
        Ok(Some(unsafe { std::slice::from_raw_parts(ptr, n) }))
    }

    /// The single element of a size-1 array, as f32.
    pub fn item_f32(&self) -> Result<f32> {
        let v = self.to_vec::<f32>()?;
        v.first()
            .copied()
            .filter(|_| v.len() == 1)
            .ok_or_else(|| Error::Invalid(format!("item() of an array of size {}", v.len())))
    }

    pub fn item_i32(&self) -> Result<i32> {
        let v = self.to_vec::<i32>()?;
        v.first()
            .copied()
            .filter(|_| v.len() == 1)
            .ok_or_else(|| Error::Invalid(format!("item() of an array of size {}", v.len())))
    }
}

/// How many evaluations have been asked for in this process ([`eval`], [`async_eval`],
/// [`Array::eval`] and every read of values; not the stages of a pass, [`eval_stage`]): what was
/// built before a change of this number has been (or is being) evaluated. [`crate::models::sdpa`] tells a graph under construction from one run.
pub fn eval_epoch() -> u64 {
    EVAL_EPOCH.load(std::sync::atomic::Ordering::Relaxed)
}

static EVAL_EPOCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn bump_eval_epoch() {
    EVAL_EPOCH.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Evaluate several arrays together.
pub fn eval(arrays: &[&Array]) -> Result<()> {
    bump_eval_epoch();
    let v = super::ops::VecArray::new(arrays);
    check(unsafe { sys::mlx_eval(v.0) })
}

/// [`eval`] of one stage inside a forward pass (the prefill's per-layer staging): the pass goes on,
/// so [`eval_epoch`] does not move.
pub fn eval_stage(arrays: &[&Array]) -> Result<()> {
    let v = super::ops::VecArray::new(arrays);
    check(unsafe { sys::mlx_eval(v.0) })
}

/// [`async_eval`] of one stage inside a forward pass ([`eval_stage`]).
pub fn async_eval_stage(arrays: &[&Array]) -> Result<()> {
    let v = super::ops::VecArray::new(arrays);
    check(unsafe { sys::mlx_async_eval(v.0) })
}

/// Schedule evaluation without waiting (mlx-lm's async_eval).
pub fn async_eval(arrays: &[&Array]) -> Result<()> {
    bump_eval_epoch();
    let v = super::ops::VecArray::new(arrays);
    check(unsafe { sys::mlx_async_eval(v.0) })
}
