//! `mlxrs._native.download`, `native_pack_info` and `native_pack_install`: thin wrappers over
//! mlxrs-core's `download.rs` (resumable, verified transfer) and `native_pack.rs` (which pack this
//! machine uses, from where; fetching and unpacking it).
use mlxrs_core::download::{self as dl, Advice, DownloadError, Expected};
use mlxrs_core::native_pack;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;
use std::time::Duration;

/// A transfer's result with a callback's exception (or Ctrl-C): raised even when the transfer
/// completed (an interrupt that arrived at the last callback still propagates) and in place of the
/// cancellation it caused; any other failure is reported as such.
fn settle<T>(py: Python<'_>, result: Result<T, DownloadError>, raised: Option<PyErr>) -> PyResult<T> {
    match (result, raised) {
        (Ok(_), Some(e)) => Err(e),
        (Ok(o), None) => Ok(o),
        (Err(DownloadError::Cancelled(_)), Some(e)) => Err(e),
        (Err(e), _) => Err(download_error(py, e)),
    }
}

fn download_error(py: Python<'_>, e: DownloadError) -> PyErr {
    let cls = if matches!(e, DownloadError::Invalid(_)) { "InvalidArgumentError" } else { "DownloadError" };
    let msg = e.to_string();
    match py.import("mlxrs.errors").and_then(|m| m.getattr(cls)) {
        Ok(c) => PyErr::from_value(c.call1((msg,)).unwrap_or_else(|err| err.into_value(py).into_bound(py).into_any())),
        Err(_) => PyValueError::new_err(msg),
    }
}

/// Fetch `url` into `dest` (through `dest + ".incomplete"`, resumed when it exists) and verify
/// it against `sha256`, or `git_sha1` (a git blob id; needs `size`). A mismatch refetches once,
/// then raises `mlxrs.errors.DownloadError` naming `name`. `progress(done, total)` is called as
/// bytes arrive (total 0 while unknown); an exception it raises (or Ctrl-C) stops the transfer,
/// keeps the partial file and propagates. `hub` phrases 401/403/404 for a Hugging Face repo.
/// Returns {"transferred", "resumed_from", "refetched", "size"}.
#[pyfunction]
#[pyo3(signature = (url, dest, *, sha256=None, git_sha1=None, size=None, name=None, token=None, hub=false,
                    retries=5, backoff=0.5, progress=None))]
#[allow(clippy::too_many_arguments)]
pub fn download<'py>(
    py: Python<'py>,
    url: String,
    dest: PathBuf,
    sha256: Option<String>,
    git_sha1: Option<String>,
    size: Option<u64>,
    name: Option<String>,
    token: Option<String>,
    hub: bool,
    retries: u32,
    backoff: f64,
    progress: Option<PyObject>,
) -> PyResult<Bound<'py, PyDict>> {
    let expected = match (sha256, git_sha1) {
        (Some(h), None) => Expected::Sha256(h),
        (None, Some(h)) => Expected::GitBlobSha1(h),
        _ => {
            return Err(download_error(py, DownloadError::Invalid("pass exactly one of sha256= and git_sha1=".into())))
        }
    };
    if !(backoff.is_finite() && backoff >= 0.0) {
        return Err(download_error(
            py,
            DownloadError::Invalid(format!("backoff must be >= 0 seconds (got {backoff})")),
        ));
    }
    let mut req = dl::Request::new(url, dest, expected);
    req.size = size;
    if let Some(n) = name {
        req.name = n;
    }
    req.token = token.filter(|t| !t.is_empty());
    req.advice = if hub { Advice::HuggingFace } else { Advice::Plain };
    req.retries = retries;
    req.backoff = Duration::from_secs_f64(backoff);
    let mut raised: Option<PyErr> = None;
    let result = py.allow_threads(|| {
        let mut cb = |done: u64, total: u64| -> bool {
            Python::with_gil(|py| {
                let r = match &progress {
                    Some(p) => p.call1(py, (done, total)).map(drop),
                    None => Ok(()),
                };
                match r.and_then(|()| py.check_signals()) {
                    Ok(()) => true,
                    Err(e) => {
                        raised = Some(e);
                        false
                    }
                }
            })
        };
        dl::fetch(&req, &mut cb)
    });
    let out = settle(py, result, raised)?;
    let d = PyDict::new(py);
    d.set_item("transferred", out.transferred)?;
    d.set_item("resumed_from", out.resumed_from)?;
    d.set_item("refetched", out.refetched)?;
    d.set_item("size", out.size)?;
    Ok(d)
}

/// The native pack for `backend` (None: this machine's) — {"version", "platform", "backend",
/// "dir", "archive", "files", "url", "sha256", "origin", "problem"}; `problem` is the message to
/// show when it cannot be fetched (e.g. none published for this platform), and then url/sha256
/// are None.
#[pyfunction]
#[pyo3(signature = (backend=None))]
pub fn native_pack_info<'py>(py: Python<'py>, backend: Option<&str>) -> PyResult<Bound<'py, PyDict>> {
    let backend = checked_backend(py, backend)?;
    let d = PyDict::new(py);
    d.set_item("version", mlxrs_sys::NATIVE_PACK_VERSION)?;
    d.set_item("platform", native_pack::platform(backend))?;
    d.set_item("backend", backend)?;
    d.set_item("dir", native_pack::dir(backend).map(|p| p.display().to_string()))?;
    d.set_item("archive", native_pack::archive_name(backend))?;
    d.set_item("files", native_pack::required_files(backend))?;
    match native_pack::source(backend) {
        Ok(s) => {
            d.set_item("url", s.url)?;
            d.set_item("sha256", s.sha256)?;
            d.set_item(
                "origin",
                match s.origin {
                    native_pack::Origin::Env => native_pack::URL_ENV,
                    native_pack::Origin::Release => "release",
                },
            )?;
            d.set_item("problem", py.None())?;
        }
        Err(e) => {
            d.set_item("url", py.None())?;
            d.set_item("sha256", py.None())?;
            d.set_item("origin", py.None())?;
            d.set_item("problem", e.to_string())?;
        }
    }
    Ok(d)
}

/// Fetch, verify and unpack the native pack for `backend` (None: this machine's) unless it is
/// already complete (or `force`): mlxrs-core's `native_pack::install`, the code the runtime runs
/// on first need. `progress(done, total)` runs as bytes arrive (an exception it raises, or
/// Ctrl-C, stops the transfer, keeping the partial file); `on_wait()` runs once when another
/// process is fetching the same pack. Returns {"dir", "fetched", "resumed_from", "size"}.
#[pyfunction]
#[pyo3(signature = (backend=None, *, force=false, progress=None, on_wait=None))]
pub fn native_pack_install<'py>(
    py: Python<'py>,
    backend: Option<&str>,
    force: bool,
    progress: Option<PyObject>,
    on_wait: Option<PyObject>,
) -> PyResult<Bound<'py, PyDict>> {
    let backend = checked_backend(py, backend)?;
    let src = native_pack::source(backend).map_err(|e| download_error(py, e))?;
    let (result, raised) = py.allow_threads(|| {
        let raised: std::cell::RefCell<Option<PyErr>> = std::cell::RefCell::new(None);
        // a callback's exception (or Ctrl-C) stops the transfer and is raised afterwards
        let call = |f: &Option<PyObject>, args: Option<(u64, u64)>| -> bool {
            Python::with_gil(|py| {
                let r = match (f, args) {
                    (Some(f), Some(a)) => f.call1(py, a).map(drop),
                    (Some(f), None) => f.call0(py).map(drop),
                    (None, _) => Ok(()),
                };
                match r.and_then(|()| py.check_signals()) {
                    Ok(()) => true,
                    Err(e) => {
                        raised.borrow_mut().get_or_insert(e);
                        false
                    }
                }
            })
        };
        let mut prog = |done: u64, total: u64| call(&progress, Some((done, total)));
        let mut waiting = || {
            call(&on_wait, None);
        };
        let r = native_pack::install(
            backend,
            &src,
            force,
            native_pack::Hooks { progress: &mut prog, waiting: &mut waiting },
        );
        (r, raised.into_inner())
    });
    let out = settle(py, result, raised)?;
    let d = PyDict::new(py);
    d.set_item("dir", out.dir.display().to_string())?;
    d.set_item("fetched", out.fetched.is_some())?;
    d.set_item("resumed_from", out.fetched.map_or(0, |o| o.resumed_from))?;
    d.set_item("size", out.fetched.map_or(0, |o| o.size))?;
    Ok(d)
}

fn checked_backend<'a>(py: Python<'_>, backend: Option<&'a str>) -> PyResult<&'a str> {
    let backend: &str = match backend {
        Some(b) => b,
        None => native_pack::default_backend(),
    };
    let valid: &[&str] = if cfg!(target_os = "macos") { &["metal"] } else { &["cpu", "cuda"] };
    if !valid.contains(&backend) {
        return Err(download_error(
            py,
            DownloadError::Invalid(format!("backend must be one of {} here (got {backend:?})", valid.join(", "))),
        ));
    }
    Ok(backend)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(download, m)?)?;
    m.add_function(wrap_pyfunction!(native_pack_info, m)?)?;
    m.add_function(wrap_pyfunction!(native_pack_install, m)?)?;
    Ok(())
}
