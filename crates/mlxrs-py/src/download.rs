//! `mlxrs._native.download` and `native_pack_info`: thin wrappers over mlxrs-core's `download.rs`
//! (resumable, verified transfer) and `native_pack.rs` (which pack this machine uses, from where).
use mlxrs_core::download::{self as dl, Advice, DownloadError, Expected};
use mlxrs_core::native_pack;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;
use std::time::Duration;

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
        _ => return Err(download_error(py, DownloadError::Invalid("pass exactly one of sha256= and git_sha1=".into()))),
    };
    if !(backoff.is_finite() && backoff >= 0.0) {
        return Err(download_error(py, DownloadError::Invalid(format!("backoff must be >= 0 seconds (got {backoff})"))));
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
    let out = match result {
        // the file is complete, but an interrupt that arrived at the last callback still propagates
        Ok(_) if raised.is_some() => return Err(raised.take().expect("checked")),
        Ok(o) => o,
        Err(DownloadError::Cancelled(what)) => {
            return Err(raised.unwrap_or_else(|| download_error(py, DownloadError::Cancelled(what))))
        }
        Err(e) => return Err(download_error(py, e)),
    };
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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(download, m)?)?;
    m.add_function(wrap_pyfunction!(native_pack_info, m)?)?;
    Ok(())
}
